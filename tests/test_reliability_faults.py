"""Injected save failures under every save strategy: raise, hang past save_timeout,
full disk, read-only directory; and a commit into a root that turned read-only.

Full disk and read-only directories are real: a 1 MiB tmpfs and a read-only
tmpfs mounted for the test (needs root). Where mounting is not permitted the
save function raises ``OSError(ENOSPC)`` / ``OSError(EROFS)`` instead, and the
report says so.
"""

from __future__ import annotations

import asyncio
import errno
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from reliability_helpers import assert_root_consistent, report, scrape, trials, wait_for

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveError, SaveStrategy
from obsckpt.store import layout, reader
from obsckpt.telemetry import tracing

SAVE_TIMEOUT = 0.5
FAULTS = ("raise", "hang", "full_disk", "read_only")
SLOTS = ("model", "optim", "extra")
# Set when a hung save's call returns: wait_all() raises its timeout before that,
# and its slot stays busy until then.
HUNG: list[threading.Event] = []


def _mount(target: Path, options: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True, check=False)


@pytest.fixture
def fault_dirs(tmp_path):
    """(full_dir, read_only_dir, real): a tiny tmpfs and a read-only tmpfs when mountable."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    real = _mount(full, "size=1m") and _mount(ro, "ro,size=1m")
    yield full, ro, real
    _umount(full)
    _umount(ro)


@pytest.fixture(scope="module")
def memory_spans():
    tracing.setup_tracing("obsckpt-tests", exporter="memory")
    return tracing


def _fault_save(kind: str, full: Path, ro: Path, real: bool, step: int, slot: str):
    """A save function that fails the way ``kind`` says."""
    state = {"w": torch.zeros(1 << 19)}  # 2 MiB: more than the full tmpfs holds
    returned = threading.Event()
    if kind == "hang":
        HUNG.append(returned)

    def save():
        if kind == "raise":
            raise RuntimeError(f"injected failure in {slot} step {step}")
        if kind == "hang":
            time.sleep(SAVE_TIMEOUT * 2.5)
            returned.set()
            return
        target = full if kind == "full_disk" else ro
        if not real:
            code = errno.ENOSPC if kind == "full_disk" else errno.EROFS
            raise OSError(code, os.strerror(code), str(target / f"{slot}.pt"))
        torch.save(state, target / f"{slot}-{step}.pt")

    return save


def _ok_save(root: str, step: int, slot: str):
    def save():
        path = layout.step_dir(root, step) / f"{slot}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"step": torch.tensor(step)}, path)

    return save


@pytest.mark.parametrize("strategy", list(SaveStrategy), ids=lambda s: s.name)
class TestInjectedFailures:
    """Whatever fails, nothing deadlocks: every failure is counted and traced, wait_all
    raises it, the failed step never commits and later steps do."""

    def test_random_failures(
        self, ray_cluster, namespace, tmp_path, fault_dirs, memory_spans, strategy
    ):
        ray = ray_cluster
        full, ro, real = fault_dirs
        seed = int(os.environ.get("OBSCKPT_RELIABILITY_SEED", "0")) or random.randrange(1 << 30)
        rng = random.Random(seed)
        root = str(tmp_path / "root")
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=strategy,
            default_local_dir=root,
            trace_exporter="memory",
        )
        address = ray.get(monitor.metrics_address.remote())
        coord = CheckpointCoordinator(monitor, save_timeout=SAVE_TIMEOUT, rpc_timeout=60)
        memory_spans.clear_finished_spans()
        n_steps = max(trials(8), len(FAULTS) + 2)
        injected = {k: 0 for k in FAULTS}
        failed_steps, ok_steps = [], []
        t0 = time.monotonic()
        for step in range(1, n_steps + 1):
            # Every fault kind shows up; a clean step follows them, and the last step is clean.
            if step in (n_steps, len(FAULTS) + 1):
                plan = ["ok"] * len(SLOTS)
            elif step <= len(FAULTS):
                plan = [FAULTS[step - 1]] + ["ok"] * (len(SLOTS) - 1)
                rng.shuffle(plan)
            else:
                plan = [rng.choice(("ok", "ok") + FAULTS) for _ in SLOTS]
            asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=len(SLOTS)))
            for slot, kind in zip(SLOTS, plan, strict=True):
                fn = (
                    _ok_save(root, step, slot)
                    if kind == "ok"
                    else _fault_save(kind, full, ro, real, step, slot)
                )
                coord.save_async(slot, fn, step)
            faults = [k for k in plan if k != "ok"]
            for k in faults:
                injected[k] += 1
            if faults:
                with pytest.raises(SaveError) as info:
                    coord.wait_all(timeout=30)
                assert info.value.step == step
                failed_steps.append(step)
                # A hung save's slot is free again only once its call returns; the
                # trainer's next save of it would wait for that (at most save_timeout).
                for returned in HUNG:
                    assert returned.wait(30), "a hung save never returned"
                HUNG.clear()
            else:
                coord.wait_all(timeout=30)
                ok_steps.append(step)
                wait_for(
                    lambda step=step: (
                        ray.get(monitor.status.remote())["latest"]["checkpoint"] == step
                    ),
                    30,
                    f"clean step {step} to commit under {strategy.name}",
                )
        elapsed = time.monotonic() - t0

        status = ray.get(monitor.status.remote())
        assert status["latest"]["checkpoint"] == ok_steps[-1]
        assert sorted({f["step"] for f in status["failed"]}) == failed_steps
        assert status["pending"] == [] and status["in_flight"] == []
        assert status["admission_waiting"] == 0
        assert assert_root_consistent(root)["checkpoint"] == ok_steps[-1]

        s = scrape(address)
        n_failed_saves = sum(injected.values())
        assert s.total("obsckpt_saves_total", result="error") == n_failed_saves
        assert s.total("obsckpt_saves_total", result="ok") == len(SLOTS) * n_steps - n_failed_saves
        assert s.value("obsckpt_step_failures_total", kind="checkpoint") == len(failed_steps)
        assert s.value("obsckpt_pending_steps", kind="checkpoint") == 0

        # Traces: every failed save is an error span here; the monitor committed only clean steps.
        spans = [sp for sp in memory_spans.finished_spans() if sp["name"] == "obsckpt.save"]
        errors = [sp for sp in spans if sp["status"] == "ERROR"]
        assert len(errors) == n_failed_saves, [sp["attributes"] for sp in errors]
        assert {sp["attributes"]["obsckpt.step"] for sp in errors} == set(failed_steps)
        commits = [
            sp for sp in ray.get(monitor.debug_spans.remote()) if sp["name"] == "obsckpt.commit"
        ]
        assert sorted(sp["attributes"]["obsckpt.step"] for sp in commits) == ok_steps
        assert all(sp["status"] != "ERROR" for sp in commits)
        report(
            "faults",
            strategy=strategy.name,
            seed=seed,
            steps=n_steps,
            failed_steps=len(failed_steps),
            committed_steps=len(ok_steps),
            injected=injected,
            real_mounts=real,
            elapsed_s=round(elapsed, 2),
        )
        ray.kill(monitor, no_restart=True)


class TestReadOnlyRootAtCommit:
    """A commit into a root that became read-only fails the step (counted, error span);
    once the root is writable again the next step commits."""

    def test_commit_fails_then_recovers(self, ray_cluster, namespace, tmp_path):
        ray = ray_cluster
        root = tmp_path / "root"
        if not _mount(root, "size=64m"):
            pytest.skip("mounting a tmpfs is not permitted here; run as root")
        try:
            monitor = CheckpointMonitor.get_actor(
                namespace=namespace, default_local_dir=str(root), trace_exporter="memory"
            )
            address = ray.get(monitor.metrics_address.remote())
            coord = CheckpointCoordinator(monitor, rpc_timeout=60)

            def step_saves(step: int) -> None:
                asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=1))
                coord.save_async("model", _ok_save(str(root), step, "model"), step)
                coord.wait_all(timeout=30)

            step_saves(1)
            wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, 30, "step 1 to commit")
            # Step 2's files are written, then the root turns read-only before its commit.
            ray.get(monitor.register_thread_count.remote(2, checkpoint_thread_count=1))
            coord.save_async("model", _ok_save(str(root), 2, "model"), 2)
            coord.wait_all(timeout=30)
            subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
            ray.get(monitor.monitor_step.remote(2, False))
            status = ray.get(monitor.status.remote())
            assert [f["step"] for f in status["failed"]] == [2]
            assert "Read-only file system" in status["failed"][0]["error"]
            assert status["latest"]["checkpoint"] == 1
            s = scrape(address)
            assert s.value("obsckpt_step_failures_total", kind="checkpoint") == 1
            commit_spans = [
                sp for sp in ray.get(monitor.debug_spans.remote()) if sp["name"] == "obsckpt.commit"
            ]
            assert [(sp["attributes"]["obsckpt.step"], sp["status"]) for sp in commit_spans] == [
                (1, "UNSET"),
                (2, "ERROR"),
            ]
            subprocess.run(["mount", "-o", "remount,rw", str(root)], check=True)
            step_saves(3)
            wait_for(lambda: reader.read_iteration(root, "checkpoint") == 3, 30, "step 3 to commit")
            assert assert_root_consistent(root)["checkpoint"] == 3
            ray.kill(monitor, no_restart=True)
        finally:
            _umount(root)
