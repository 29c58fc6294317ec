"""Bad input: every bad argument or file content gets a clear error naming the value,
and nothing already committed is lost. docs/reliability.md tabulates these cases.

The monitor is used in-process here (its RPCs are async methods, driven with
asyncio.run): validation is the same inside the actor.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
import torch

from obsckpt import (
    CheckpointCoordinator,
    CheckpointDirError,
    CheckpointMonitor,
    IterationFileError,
    NotificationError,
    PartsMismatchError,
)
from obsckpt.store import layout, reader, rootlock

COMMITTED = 3


def _noop() -> None:
    pass


def _monitor(root, **kwargs) -> CheckpointMonitor:
    return CheckpointMonitor(default_local_dir=root, metrics_port=None, **kwargs)


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root and its bytes (not the lock file each monitor writes its pid to)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != rootlock.LOCK_NAME
    }


@pytest.fixture
def committed(tmp_path) -> tuple[Path, CheckpointMonitor, dict[str, bytes]]:
    """A root where step 3 is committed, the monitor that committed it, and the files' bytes."""
    root = tmp_path / "root"
    monitor = _monitor(root)

    async def commit_step() -> None:
        await monitor.register_thread_count(COMMITTED, checkpoint_thread_count=1)
        path = layout.step_dir(root, COMMITTED) / "model.pt"
        path.parent.mkdir(parents=True)
        torch.save({"w": torch.ones(4)}, path)
        admitted = await monitor.notify_started("n", "j", step=COMMITTED, slot="model")
        await monitor.notify_finished(COMMITTED, False, ticket=admitted["ticket"], slot="model")
        await monitor.monitor_step(COMMITTED, False)

    asyncio.run(commit_step())
    assert reader.read_iteration(root, "checkpoint") == COMMITTED
    return root, monitor, _snapshot(root)


def _assert_nothing_lost(root: Path, before: dict[str, bytes]) -> None:
    assert _snapshot(root) == before
    assert reader.read_iteration(root, "checkpoint") == COMMITTED
    assert reader.verify_step(layout.step_dir(root, COMMITTED)) == []


BAD_STEPS = [-1, 1.5, True, "3", None, 2**63]
BAD_SLOTS = ["../x", "a/b", "", ".", "..", "x" * 129, "a b", None, "-lead"]


class TestBadSaveArguments:
    """The worker API refuses bad steps and slot names before doing anything."""

    @pytest.mark.parametrize("step", BAD_STEPS, ids=repr)
    def test_bad_step(self, committed, step):
        root, _, before = committed
        coord = CheckpointCoordinator(None)
        with pytest.raises(ValueError, match="global_step") as info:
            coord.save_async("model", _noop, step)
        assert repr(step) in str(info.value) or str(step) in str(info.value)
        with pytest.raises(ValueError, match="global_step"):
            coord.save_state_dict_async("model", {}, root / "x.pt", step)
        with pytest.raises(ValueError, match="global_step"):
            coord.save_sync(_noop, step)
        _assert_nothing_lost(root, before)

    @pytest.mark.parametrize("slot", BAD_SLOTS, ids=repr)
    def test_bad_slot(self, committed, slot):
        root, _, before = committed
        coord = CheckpointCoordinator(None)
        with pytest.raises(ValueError, match="slot name") as info:
            coord.save_async(slot, _noop, 4)
        assert repr(slot) in str(info.value)
        with pytest.raises(ValueError, match="slot name"):
            coord.save_state_dict_async(slot, {}, root / "x.pt", 4)
        _assert_nothing_lost(root, before)

    @pytest.mark.parametrize(
        "part,parts,shown",
        [(0, None, "parts must"), (None, 2, "part must"), (2, 2, "got 2"), (0, 0, "got 0")],
    )
    def test_bad_parts(self, committed, part, parts, shown):
        root, _, before = committed
        coord = CheckpointCoordinator(None)
        with pytest.raises(ValueError, match=shown):
            coord.save_async("model", _noop, 4, part=part, parts=parts)
        with pytest.raises(ValueError, match=shown):
            coord.save_state_dict_async("model", {}, root / "x.pt", 4, part=part, parts=parts)
        with pytest.raises(ValueError, match=shown):
            coord.save_sync(_noop, 4, part=part, parts=parts)
        _assert_nothing_lost(root, before)

    def test_a_coordinator_without_a_monitor_refuses_to_save(self, committed):
        root, _, before = committed
        coord = CheckpointCoordinator(None)
        ran = []
        for call in (
            lambda: coord.save_async("model", lambda: ran.append(1), 4),
            lambda: coord.save_sync(lambda: ran.append(1), 4),
            lambda: coord.save_state_dict_async("model", {}, root / "x.pt", 4),
            lambda: asyncio.run(coord.register_and_monitor(4)),
        ):
            with pytest.raises(ValueError, match=r"no monitor \(checkpoint_monitor=None\)"):
                call()
        assert ran == []
        _assert_nothing_lost(root, before)

    @pytest.mark.parametrize("rank", [-1, "0", 1.0, True], ids=repr)
    def test_bad_rank(self, rank):
        with pytest.raises(ValueError, match="rank must be a non-negative integer") as info:
            CheckpointCoordinator(None, rank=rank)
        assert repr(rank) in str(info.value)
        coord = CheckpointCoordinator(None, rank=1)
        with pytest.raises(ValueError, match="rank must be"):
            coord.rank = rank
        assert coord.rank == 1

    @pytest.mark.parametrize("timeout", [0, -1, "5", True, None, float("nan"), float("inf")])
    def test_bad_rpc_timeout(self, timeout):
        with pytest.raises(ValueError, match="rpc_timeout must be a positive, finite") as info:
            CheckpointCoordinator(None, rpc_timeout=timeout)
        assert repr(timeout) in str(info.value)
        coord = CheckpointCoordinator(None, rpc_timeout=5)
        with pytest.raises(ValueError, match="rpc_timeout must be"):
            coord.rpc_timeout = timeout
        assert coord.rpc_timeout == 5

    @pytest.mark.parametrize("timeout", [0, -1, "5", True, float("nan")], ids=repr)
    def test_bad_save_timeout(self, timeout):
        with pytest.raises(ValueError, match="save_timeout") as info:
            CheckpointCoordinator(None, save_timeout=timeout)
        assert repr(timeout) in str(info.value)


class TestBadMonitorArguments:
    """The monitor refuses bad construction arguments with an error naming the value."""

    @pytest.mark.parametrize("port", [-1, 70000, "80", True, 1.5], ids=repr)
    def test_bad_metrics_port(self, tmp_path, port):
        with pytest.raises(ValueError, match="metrics_port") as info:
            CheckpointMonitor(default_local_dir=tmp_path / "root", metrics_port=port)
        assert repr(port) in str(info.value)
        with pytest.raises(ValueError, match="metrics_port"):
            CheckpointMonitor.get_actor(default_local_dir=tmp_path / "root", metrics_port=port)

    @pytest.mark.parametrize("strategy", ["bogus", 3, None, "single-thread"], ids=repr)
    def test_bad_save_strategy(self, tmp_path, strategy):
        with pytest.raises(ValueError, match="save_strategy") as info:
            _monitor(tmp_path / "root", save_strategy=strategy)
        assert repr(strategy) in str(info.value)
        with pytest.raises(ValueError, match="save_strategy"):
            CheckpointMonitor.get_actor(default_local_dir=tmp_path / "root", save_strategy=strategy)

    def test_missing_root(self):
        with pytest.raises(ValueError, match="default_local_dir is required"):
            CheckpointMonitor(metrics_port=None)

    def test_root_is_a_file(self, tmp_path):
        root = tmp_path / "root"
        root.write_bytes(b"not a directory")
        with pytest.raises(CheckpointDirError, match="is a file, not a directory") as info:
            _monitor(root)
        assert str(root) in str(info.value)
        assert root.read_bytes() == b"not a directory"

    def test_unwritable_root(self, tmp_path):
        root = tmp_path / "ro"
        root.mkdir()
        if os.geteuid() == 0:
            # root ignores permission bits: use a read-only mount.
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(root)],
                capture_output=True,
                check=False,
            )
            if done.returncode != 0:
                pytest.skip("cannot make an unwritable directory: root, and mount not permitted")
        else:
            root.chmod(0o555)
        try:
            with pytest.raises(CheckpointDirError, match="is not writable") as info:
                _monitor(root)
            assert str(root) in str(info.value)
            assert list(root.iterdir()) == []
        finally:
            if os.geteuid() == 0:
                subprocess.run(["umount", "-l", str(root)], check=False)
            else:
                root.chmod(0o755)


BAD_RPCS = [
    ("register_thread_count", (-1,), {"checkpoint_thread_count": 1}, "-1"),
    ("register_thread_count", ("4",), {"checkpoint_thread_count": 1}, "'4'"),
    ("register_thread_count", (4,), {"checkpoint_thread_count": -2}, "-2"),
    ("register_thread_count", (4,), {"checkpoint_thread_count": True}, "True"),
    ("register_thread_count", (4,), {"state_dict_thread_count": 1.5}, "1.5"),
    ("monitor_step", (-5, False), {}, "-5"),
    ("monitor_step", (True, False), {}, "True"),
    ("monitor_step", (4.0, False), {}, "4.0"),
    ("notify_started", ("n", "j"), {"step": -1, "slot": "model"}, "-1"),
    ("notify_started", ("n", "j"), {"step": 4, "kind": "weights"}, "'weights'"),
    ("notify_finished", (-1, False), {}, "-1"),
    ("notify_finished", (None, False), {}, "None"),
    ("notify_started", ("n", "j"), {"step": 4, "part": 2, "parts": 2}, "parts=2) "),
    ("notify_started", ("n", "j"), {"step": 4, "part": 0}, "got None"),
    ("notify_started", ("n", "j"), {"part": 0, "parts": 1}, "without step"),
    ("notify_finished", (4, False), {"part": 0, "parts": 0}, "got 0"),
    ("notify_finished", (4, False), {"part": -1, "parts": 2}, "got -1"),
]


class TestBadNotifications:
    """Bad RPC arguments, old steps and surplus finishes raise; the committed step stays."""

    @pytest.mark.parametrize(
        "method,args,kwargs,shown", BAD_RPCS, ids=[f"{m}{a}{k}" for m, a, k, _ in BAD_RPCS]
    )
    def test_bad_rpc_arguments(self, committed, method, args, kwargs, shown):
        root, monitor, before = committed
        with pytest.raises(ValueError) as info:
            asyncio.run(getattr(monitor, method)(*args, **kwargs))
        assert shown in str(info.value), str(info.value)
        _assert_nothing_lost(root, before)

    @pytest.mark.parametrize("step", [0, 1, 2])
    def test_monitor_step_older_than_committed(self, committed, step):
        root, monitor, before = committed
        asyncio.run(monitor.monitor_step(step, False))  # ignored, logged
        asyncio.run(monitor.register_thread_count(step, checkpoint_thread_count=1))
        assert asyncio.run(monitor.status())["pending"] == []
        _assert_nothing_lost(root, before)

    def test_save_into_committed_step(self, committed):
        root, monitor, before = committed

        async def resave() -> dict:
            t = await monitor.notify_started("n", "j", step=COMMITTED, slot="model")
            await monitor.notify_finished(COMMITTED, False, ticket=t["ticket"], slot="model")
            return t

        assert asyncio.run(resave())["resave"] is True
        status = asyncio.run(monitor.status())
        assert status["pending"] == [] and status["failed"] == [] and status["resaves"] == 2
        _assert_nothing_lost(root, before)

    def test_more_finishes_than_registrations(self, committed):
        root, monitor, before = committed

        async def surplus() -> None:
            await monitor.register_thread_count(4, checkpoint_thread_count=1)
            for _ in range(2):
                t = await monitor.notify_started("n", "j", step=4, slot="model")
                await monitor.notify_finished(4, False, ticket=t["ticket"], slot="model")
            await monitor.monitor_step(4, False)

        with pytest.raises(NotificationError, match="2 saves finished but only 1 were registered"):
            asyncio.run(surplus())
        status = asyncio.run(monitor.status())
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(4, "checkpoint")]
        assert status["latest"]["checkpoint"] == COMMITTED
        assert reader.read_iteration(root, "checkpoint") == COMMITTED
        assert reader.verify_step(layout.step_dir(root, COMMITTED)) == []

    def test_parts_that_disagree(self, committed):
        root, monitor, before = committed

        async def disagree() -> None:
            await monitor.register_thread_count(4, checkpoint_thread_count=1)
            t = await monitor.notify_started("n", "j", step=4, slot="model", part=0, parts=2)
            await monitor.notify_finished(4, False, ticket=t["ticket"], slot="model")
            await monitor.notify_started("n", "j", step=4, slot="model", part=1, parts=3)

        with pytest.raises(PartsMismatchError, match="says the save has 3 parts but an earlier"):
            asyncio.run(disagree())
        status = asyncio.run(monitor.status())
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(4, "checkpoint")]
        assert status["in_flight"] == []
        _assert_nothing_lost(root, before)


BAD_ITERATION_FILES = {
    "garbage": b"hello\n",
    "negative": b"-3\n",
    "fraction": b"3.5\n",
    "exponent": b"1e30\n",
    "empty": b"",
    "whitespace": b"  \n",
    "two numbers": b"3\n4\n",
    "trailing junk": b"12abc\n",
    "not utf-8": b"\xff\xfe\n",
    "non-ascii digit": "\u0663\n".encode(),
    "31 digits (1e30)": b"1" + b"0" * 30 + b"\n",
    "100 digits (> 64 bytes)": b"9" * 100 + b"\n",
}


class TestBadIterationFile:
    """A monitor refuses to start on an iteration file that does not name a step, and
    names the file; the file and the steps on disk are left as they are."""

    @pytest.mark.parametrize(
        "content", BAD_ITERATION_FILES.values(), ids=BAD_ITERATION_FILES.keys()
    )
    @pytest.mark.parametrize("kind", layout.KINDS)
    def test_bad_content(self, committed, content, kind):
        root, monitor, _ = committed
        asyncio.run(monitor.shutdown())  # the job that committed has ended
        path = root / layout.ITERATION_FILES[kind]
        path.write_bytes(content)
        before = _snapshot(root)
        with pytest.raises(IterationFileError) as info:
            _monitor(root)
        assert str(path) in str(info.value)
        assert "step number" in str(info.value)
        assert _snapshot(root) == before
        assert reader.verify_step(layout.step_dir(root, COMMITTED)) == []

    def test_iteration_file_is_a_directory(self, tmp_path):
        root = tmp_path / "root"
        (root / layout.ITERATION_FILES["checkpoint"]).mkdir(parents=True)
        with pytest.raises(IterationFileError, match="is a directory"):
            _monitor(root)
