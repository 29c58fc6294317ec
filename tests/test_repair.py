"""Iteration files naming a step that is not whole: found, and rewound by `obsckpt repair`
to the latest whole step, atomically, deleting nothing. Plain files; the monitor's start-up check with a local Ray."""

from __future__ import annotations

import asyncio
import io
import time

import pytest
import ray
import torch

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.cli import main
from obsckpt.errors import IterationFileError
from obsckpt.store import commit, layout, reader, repair, rootlock
from obsckpt.store.torchfile import write_torch_file


def cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def step(root, n: int, *, full: bool = True, commit_it: bool = True) -> None:
    sdir = layout.step_dir(root, n)
    write_torch_file(
        {"w": torch.full((4,), float(n))}, sdir / "actor" / "model_world_size_1_rank_0.pt"
    )
    if full:
        write_torch_file({"m": torch.zeros(2)}, sdir / "actor" / "optim_world_size_1_rank_0.pt")
    if commit_it:
        commit.finalize_step(sdir, iterations={"checkpoint": n} if full else {"state_dict": n})


def files(root) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "iteration" not in p.name
    }


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "ckpt"
    step(r, 2)
    step(r, 4)
    step(r, 5, full=False)
    return r


class TestCheck:
    def test_whole_root(self, root):
        assert repair.check_iterations(root) == []
        assert cli("repair", str(root)) == (
            0,
            "every iteration file names a whole step; nothing to repair\n",
            "",
        )

    def test_a_step_not_on_disk(self, root):
        commit.write_iteration(root, "checkpoint", 1000000)
        (bad,) = repair.check_iterations(root)
        assert (bad.kind, bad.named, bad.latest_whole) == ("checkpoint", 1000000, 4)
        assert "global_step_1000000 does not exist" in bad.problem
        text = bad.describe()
        assert "latest_checkpointed_iteration.txt names step 1000000" in text
        assert "the latest whole step on disk is step 4" in text

    def test_an_uncommitted_step_and_a_truncated_one(self, root):
        step(root, 6, commit_it=False)
        commit.write_iteration(root, "checkpoint", 6)
        shard = layout.model_dir(root, 5) / "model_world_size_1_rank_0.pt"
        shard.write_bytes(shard.read_bytes()[:10])
        bad = {b.kind: b for b in repair.check_iterations(root)}
        assert "no manifest.json" in bad["checkpoint"].problem
        assert bad["checkpoint"].latest_whole == 4
        assert "is 10 bytes, the manifest says" in bad["state_dict"].problem
        assert bad["state_dict"].latest_whole == 4  # the state dict of full checkpoint 4

    def test_a_root_verl_wrote_before_obsckpt_is_not_judged(self, tmp_path):
        root = tmp_path / "verl"
        for n in (1, 2):
            step(root, n, commit_it=False)
        commit.write_iteration(root, "checkpoint", 2)
        assert repair.check_iterations(root) == []

    def test_a_verl_root_whose_named_step_lacks_a_rank_shard(self, tmp_path):
        """No manifest anywhere: a missing rank shard (by the world size the shards
        name) still tells the named step is not whole; the latest complete one is named."""
        root = tmp_path / "verl"
        for n in (1, 2):
            for rank in (0, 1):
                path = layout.model_dir(root, n) / f"model_world_size_2_rank_{rank}.pt"
                write_torch_file({"w": torch.ones(2)}, path)
        (layout.model_dir(root, 2) / "model_world_size_2_rank_1.pt").unlink()
        commit.write_iteration(root, "checkpoint", 2)
        (bad,) = repair.check_iterations(root)
        assert (bad.named, bad.latest_whole) == (2, 1)
        assert "actor/model_world_size_2_rank_1.pt missing" in bad.problem

    @pytest.mark.parametrize(
        "held", ["abc\n", "", "\n", "12x"], ids=["text", "empty", "blank", "12x"]
    )
    def test_a_file_holding_no_step_number(self, root, held):
        (root / "latest_checkpointed_iteration.txt").write_text(held)
        (bad,) = repair.check_iterations(root)
        assert (bad.kind, bad.named, bad.latest_whole) == ("checkpoint", None, 4)
        assert "not a step number" in bad.describe()


class TestRepair:
    def test_dry_run_changes_nothing(self, root):
        commit.write_iteration(root, "checkpoint", 1000000)
        code, out, _ = cli("repair", str(root), "--dry-run")
        assert code == 1 and "names step 1000000" in out
        assert reader.read_iteration(root, "checkpoint") == 1000000

    def test_rewinds_to_the_latest_whole_step_and_deletes_nothing(self, root):
        before = files(root)
        commit.write_iteration(root, "checkpoint", 1000000)
        code, out, err = cli("repair", str(root))
        assert code == 0, err
        assert "latest_checkpointed_iteration.txt: step 1000000 -> 4" in out
        assert reader.read_iteration(root, "checkpoint") == 4
        assert reader.read_iteration(root, "state_dict") == 5
        assert files(root) == before
        assert repair.check_iterations(root) == []

    def test_a_candidate_with_a_bad_checksum_is_passed_over(self, root):
        """The step a file is pointed at is checked in full, CRC32s included."""
        shard = layout.model_dir(root, 4) / "model_world_size_1_rank_0.pt"
        data = bytearray(shard.read_bytes())
        data[-50] ^= 0x01
        shard.write_bytes(bytes(data))
        commit.write_iteration(root, "checkpoint", 1000000)
        assert cli("repair", str(root))[0] == 0
        assert reader.read_iteration(root, "checkpoint") == 2

    def test_with_no_whole_step_the_file_is_moved_aside(self, tmp_path):
        root = tmp_path / "ckpt"
        step(root, 3, commit_it=False)
        commit.write_iteration(root, "checkpoint", 3)
        (root / "global_step_3" / "manifest.json").write_text("{}")  # a manifest, unreadable
        code, out, _ = cli("repair", str(root))
        assert code == 0 and "no whole step to name" in out
        assert reader.read_iteration(root, "checkpoint") is None
        (aside,) = root.glob("latest_checkpointed_iteration.txt.bad-*")
        assert aside.read_text().strip() == "3"

    @pytest.mark.parametrize("held", ["abc\n", ""], ids=["text", "empty"])
    def test_a_file_holding_no_step_number_is_pointed_at_the_latest_whole_step(
        self, root, held, caplog
    ):
        """What status, verify and the monitor's start advise for such a file works."""
        before = files(root)
        (root / "latest_checkpointed_iteration.txt").write_text(held)
        code, _, err = cli("status", str(root))
        assert code == 2 and f"`obsckpt repair {root}`" in err
        code, out, err = cli("repair", str(root))
        assert code == 0, err
        assert out.count("\n") == 1 and "not a step number; it now names step 4" in out
        assert reader.read_iteration(root, "checkpoint") == 4
        assert files(root) == before
        # Printed once: not logged as well.
        assert not [r for r in caplog.records if r.name == "obsckpt.store.repair"]
        assert cli("status", str(root))[0] == 0

    def test_status_after_repair_calls_a_corrupted_committed_step_damaged(self, root):
        shard = layout.model_dir(root, 5) / "model_world_size_1_rank_0.pt"
        shard.write_bytes(shard.read_bytes()[:10])
        assert cli("repair", str(root))[0] == 0
        code, out, _ = cli("status", str(root))
        assert code == 1
        (line,) = [ln for ln in out.splitlines() if ln.lstrip().startswith("5 ")]
        assert "damaged" in line and "uncommitted" not in line and "did not finish" not in out
        assert "problem: step 5 is damaged" in out

    def test_refused_while_a_monitor_holds_the_root(self, root):
        commit.write_iteration(root, "checkpoint", 1000000)
        lock = rootlock.acquire(root)
        try:
            code, _, err = cli("repair", str(root))
        finally:
            lock.release()
        assert code == 2 and "a running monitor holds this root" in err
        assert reader.read_iteration(root, "checkpoint") == 1000000


class TestMonitorStart:
    """A monitor never starts on a root whose iteration file names a step that is not whole
    (it would take every newer save for a re-save, and commit nothing); with
    on_bad_iteration="rewind" it repairs the file first and commits from there."""

    @pytest.mark.parametrize("named", ["not on disk", "uncommitted"])
    def test_refused_with_one_line_that_says_how_to_repair(self, namespace, root, named):
        if named == "uncommitted":
            step(root, 1000000, commit_it=False)
        commit.write_iteration(root, "checkpoint", 1000000)
        with pytest.raises(IterationFileError) as info:
            CheckpointMonitor.get_actor(
                namespace=namespace, default_local_dir=str(root), metrics_port=None
            )
        msg = str(info.value)
        assert "\n" not in msg
        assert "latest_checkpointed_iteration.txt names step 1000000" in msg
        assert "the latest whole step on disk is step 4" in msg
        assert f"obsckpt repair {root}" in msg and "on_bad_iteration='rewind'" in msg
        with pytest.raises(ValueError):  # no monitor was left running
            ray.get_actor("checkpoint_monitor", namespace=namespace)
        assert reader.read_iteration(root, "checkpoint") == 1000000

    def test_rewind_repairs_and_later_steps_commit(self, namespace, root):
        commit.write_iteration(root, "checkpoint", 1000000)
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            default_local_dir=str(root),
            metrics_port=None,
            on_bad_iteration="rewind",
        )
        status = ray.get(monitor.status.remote())
        assert status["iteration_repairs"] == [
            f"{root / 'latest_checkpointed_iteration.txt'}: step 1000000 -> 4 "
            f"({layout.step_dir(root, 1000000)} does not exist)"
        ]
        assert reader.read_iteration(root, "checkpoint") == 4
        coord = CheckpointCoordinator(monitor, rank=0)
        path = layout.model_dir(root, 6) / "model_world_size_1_rank_0.pt"
        coord.save_state_dict_async("model", {"w": torch.ones(2)}, str(path), 6)
        coord.wait_all(timeout=60)
        asyncio.run(coord.register_and_monitor(6, checkpoint_thread_count=1))
        for _ in range(200):
            if reader.read_iteration(root, "checkpoint") == 6:
                break
            time.sleep(0.05)
        assert reader.read_iteration(root, "checkpoint") == 6
        ray.kill(monitor)
