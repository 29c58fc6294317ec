"""The monitor actor killed and restarted by Ray (``max_restarts=-1``) in the middle of a job.

The restarted monitor recovers the committed steps from disk, never moves an
iteration file backwards, treats the steps it lost track of as abandoned
(``status()["abandoned"]``, ``obsckpt_abandoned_steps``), handles workers'
notifications about them without failing, and commits new steps normally.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
import uuid

import pytest
import torch
from reliability_helpers import (
    assert_root_consistent,
    monitor_status,
    report,
    scrape,
    trials,
    wait_for,
)

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.store import layout, reader


def _status(ray, monitor, timeout: float = 60.0) -> dict:
    """status(), retried while Ray restarts the actor."""
    return monitor_status(monitor, timeout)


def _restarted_status(ray, monitor) -> dict | None:
    status = _status(ray, monitor)
    return status if status["restarted"] else None


def _save_fn(root: str, step: int, slot: str, gate: threading.Event | None = None):
    def save():
        path = layout.step_dir(root, step) / "actor" / f"{slot}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"step": torch.tensor(step)}, path)
        if gate is not None:
            assert gate.wait(60), "test gate never opened"

    return save


def _register(monitor, step: int, count: int) -> None:
    asyncio.run(_await(monitor.register_thread_count.remote(step, checkpoint_thread_count=count)))


def _submit(monitor, step: int) -> None:
    asyncio.run(_await(monitor.monitor_step.remote(step, False)))


async def _await(ref):
    return await ref


def _commit(ray, monitor, coord: CheckpointCoordinator, root: str, step: int) -> None:
    asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=2))
    for slot in ("model", "optim"):
        coord.save_async(slot, _save_fn(root, step, slot), step)
    coord.wait_all(timeout=60)
    wait_for(
        lambda: _status(ray, monitor)["latest"]["checkpoint"] == step, 60, f"step {step} to commit"
    )


class TestMonitorRestart:
    """A restarted monitor recovers from disk, abandons what it lost, and commits new steps."""

    def test_kill_while_steps_are_open(self, ray_cluster, namespace, tmp_path):
        ray = ray_cluster
        root = str(tmp_path / "root")
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root)
        coord = CheckpointCoordinator(monitor, rpc_timeout=60)
        for step in (1, 2):
            _commit(ray, monitor, coord, root, step)

        # Step 3: registered, submitted, saves admitted and writing when the monitor dies.
        gate = threading.Event()
        _register(monitor, 3, 2)
        _submit(monitor, 3)
        for slot in ("model", "optim"):
            coord.save_async(slot, _save_fn(root, 3, slot, gate), 3)
        wait_for(
            lambda: len(_status(ray, monitor)["in_flight"]) == 2, 30, "step 3's saves admitted"
        )
        # Step 4: registered before the kill, submitted after it.
        _register(monitor, 4, 2)

        ray.kill(monitor, no_restart=False)
        # ray.kill returns at once; the old process may still answer a call or two.
        status = wait_for(lambda: _restarted_status(ray, monitor), 60, "the restarted monitor")
        assert status["latest"]["checkpoint"] == 2
        assert [a["step"] for a in status["abandoned"]] == [3]  # its directory is on disk
        assert status["pending"] == []
        address = ray.get(monitor.metrics_address.remote())
        s = scrape(address)
        assert s.value("obsckpt_latest_step", kind="checkpoint") == 2
        assert s.value("obsckpt_abandoned_steps") == 1
        assert s.value("obsckpt_pending_steps", kind="checkpoint") == 0
        # Its last commit is the iteration file's, so "no recent commit" can still fire.
        committed_at = os.stat(os.path.join(root, layout.ITERATION_FILES["checkpoint"])).st_mtime
        assert s.value("obsckpt_last_commit_timestamp_seconds", kind="checkpoint") == (
            pytest.approx(committed_at)
        )

        # The saves admitted before the restart finish now: handled, not failures.
        gate.set()
        coord.wait_all(timeout=60)
        # The trainer submits step 4, whose registration the monitor lost, and saves it.
        asyncio.run(coord.register_and_monitor(4))
        for slot in ("model", "optim"):
            coord.save_async(slot, _save_fn(root, 4, slot), 4)
        coord.wait_all(timeout=60)
        status = _status(ray, monitor)
        assert [a["step"] for a in status["abandoned"]] == [3, 4], status["abandoned"]
        assert status["pending"] == [] and status["failed"] == []
        assert status["latest"]["checkpoint"] == 2
        assert reader.read_iteration(root, "checkpoint") == 2

        # An old step is ignored; the iteration file does not move backwards.
        ray.get(monitor.monitor_step.remote(1, False))
        assert reader.read_iteration(root, "checkpoint") == 2

        # New steps commit normally.
        for step in (5, 6):
            _commit(ray, monitor, coord, root, step)
        assert assert_root_consistent(root)["checkpoint"] == 6
        s = scrape(address)
        assert s.value("obsckpt_latest_step", kind="checkpoint") == 6
        assert s.value("obsckpt_abandoned_steps") == 2
        assert s.total("obsckpt_saves_total", result="error") == 0
        assert s.value("obsckpt_step_failures_total", kind="checkpoint") == 0
        ray.kill(monitor, no_restart=True)

    def test_kill_at_random_moments(self, ray_cluster, namespace, tmp_path):
        """Kill the monitor at random moments while a trainer loop runs; the iteration
        file is sampled throughout and never goes backwards or names a partial step."""
        ray = ray_cluster
        seed = int(os.environ.get("OBSCKPT_RELIABILITY_SEED", "0")) or random.randrange(1 << 30)
        rng = random.Random(seed)
        root = str(tmp_path / "root")
        monitor = CheckpointMonitor.get_actor(
            namespace=f"{namespace}-{uuid.uuid4().hex[:4]}", default_local_dir=root
        )
        coord = CheckpointCoordinator(monitor, rpc_timeout=30)
        seen: list[int] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                step = reader.read_iteration(root, "checkpoint")
                if step is not None and (not seen or seen[-1] != step):
                    seen.append(step)
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, name="iteration-sampler", daemon=True)
        sampler.start()
        kills = trials(2)
        step = 0
        errors = 0
        try:
            for _ in range(kills):
                kill_at = time.monotonic() + rng.uniform(0.05, 0.6)
                killed = False
                while not killed:
                    step += 1
                    try:
                        asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=2))
                        for slot in ("model", "optim"):
                            coord.save_async(slot, _save_fn(root, step, slot), step)
                        if time.monotonic() >= kill_at:
                            ray.kill(monitor, no_restart=False)
                            killed = True
                        coord.wait_all(timeout=60)
                    except Exception:  # noqa: BLE001 - RPCs cut by the kill fail this step only
                        errors += 1
                        coord.pending_errors()
                        try:
                            coord.wait_all(timeout=60)
                        except Exception:  # noqa: BLE001
                            pass
                wait_for(lambda: _restarted_status(ray, monitor), 60, "the restarted monitor")
            # After the last restart, the job goes on committing.
            for _ in range(2):
                step += 1
                _commit(ray, monitor, coord, root, step)
        finally:
            stop.set()
            sampler.join()
        assert seen == sorted(seen), f"iteration file went backwards: {seen}"
        assert assert_root_consistent(root)["checkpoint"] == step
        status = _status(ray, monitor)
        report(
            "monitor_restart",
            seed=seed,
            kills=kills,
            steps=step,
            abandoned=len(status["abandoned"]),
            failed=len(status["failed"]),
            step_errors_seen_by_trainer=errors,
            iteration_values_seen=len(seen),
        )
        ray.kill(monitor, no_restart=True)
