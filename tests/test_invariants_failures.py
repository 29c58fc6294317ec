"""Every save that cannot run is reported: no step is left waiting for a save that never comes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest
import ray

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveError, SaveTimeoutError


def _wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (found := predicate()) is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def test_a_save_refused_because_its_slot_is_stuck_fails_its_step(namespace, tmp_path):
    """A save whose slot is still busy past save_timeout is raised to the caller and
    reported to the monitor: its registered step fails at once, it is not left pending."""
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(tmp_path / "ckpt"), metrics_port=None
    )
    ray.get(monitor.status.remote())
    coord = CheckpointCoordinator(monitor, rank=0, save_timeout=0.5)
    stuck = threading.Event()
    try:
        asyncio.run(coord.register_and_monitor(2, checkpoint_thread_count=1))
        coord.save_async("model", lambda: stuck.wait(60), 1)
        with pytest.raises(SaveTimeoutError, match="still busy with step 1"):
            coord.save_async("model", lambda: None, 2)

        def step_2_failed():
            status = ray.get(monitor.status.remote())
            failed = {(f["step"], f["kind"]) for f in status["failed"]}
            return status if (2, "checkpoint") in failed else None

        status = _wait_for(step_2_failed, what="step 2 to fail")
        assert [p for p in status["pending"] if p["step"] == 2] == []
        assert status["latest"]["checkpoint"] is None
    finally:
        stuck.set()
        with contextlib.suppress(SaveError):
            coord.wait_all(timeout=60)  # step 1's save ran past save_timeout
        ray.kill(monitor)
