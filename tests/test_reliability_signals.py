"""Preemption and interrupts: Ctrl-C, SIGTERM and exits with saves in flight.

The processes here are real and so are the signals (``os.kill``); a job's
driver process that exits is a child of the test, connected to the session's
Ray cluster. Rank kills with SIGKILL are in ``test_reliability_kill.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from reliability_helpers import wait_for

from obsckpt import CheckpointMonitor
from obsckpt.store import layout, reader

# A job's driver: it saves one step in the background and is interrupted before the
# save has finished. obsckpt is imported before ray, as a training script may do.
_DRIVER = """
import asyncio, os, signal, sys, time
import obsckpt
import ray
from obsckpt import CheckpointCoordinator

address, namespace, root, mode = sys.argv[1:5]
ray.init(address=address, namespace=namespace, log_to_driver=False)
coord = CheckpointCoordinator(ray.get_actor("checkpoint_monitor", namespace=namespace), rank=0)
path = os.path.join(root, "global_step_1", "actor", "model.bin")

def save():
    time.sleep(1.0)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"weights" * 1000)

asyncio.run(coord.register_and_monitor(1, checkpoint_thread_count=1))
coord.save_async("model", save, 1, paths=[path])
try:
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, never caught
    time.sleep(30)
finally:
    if mode == "shutdown":
        ray.shutdown()  # the job's own clean-up, before its saves have ended
"""


def _run_driver(ray, namespace: str, root, mode: str) -> subprocess.CompletedProcess:
    address = ray.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OBSCKPT_EXIT_WAIT_S"] = "30"
    return subprocess.run(
        [sys.executable, "-c", _DRIVER, address, namespace, str(root), mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


class TestCtrlCLetsRunningSavesCommit:
    """A process stopped by Ctrl-C (any exit without wait_all) finishes its running saves
    before it exits, and their step commits whole."""

    def test_interrupted_driver(self, ray_cluster, namespace, tmp_path):
        ray = ray_cluster
        root = tmp_path / "root"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None
        )
        proc = _run_driver(ray, namespace, root, "exit")
        assert proc.returncode != 0 and "KeyboardInterrupt" in proc.stderr, proc.stderr
        assert "1 saves running (obsckpt-save-model-step1)" in proc.stderr, proc.stderr
        assert "failed" not in proc.stderr, proc.stderr
        wait_for(
            lambda: ray.get(monitor.status.remote())["latest"]["checkpoint"] == 1,
            20,
            "step 1 to commit",
        )
        assert reader.read_iteration(root, "checkpoint") == 1
        assert reader.verify_step(layout.step_dir(root, 1)) == []
        ray.kill(monitor)


class TestNoRayInstanceStartedAfterShutdown:
    """A save still running when its process shut Ray down fails, saying why; it never
    starts a Ray instance of its own (whose processes would outlive the job)."""

    def test_shutdown_with_a_save_running(self, ray_cluster, namespace, tmp_path):
        ray = ray_cluster
        root = tmp_path / "root"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None
        )
        proc = _run_driver(ray, namespace, root, "shutdown")
        err = proc.stderr
        assert "Started a local Ray instance" not in err, err
        assert err.count("Connecting to existing Ray cluster") == 1, err  # its own ray.init
        assert "Ray is not initialized in this process" in err, err
        assert "call wait_all() (or close()) on the coordinator before ray.shutdown()" in err
        # Never named by the iteration file: its report could not be sent.
        assert reader.read_iteration(root, "checkpoint") is None
        status = ray.get(monitor.status.remote())
        assert status["latest"]["checkpoint"] is None
        ray.kill(monitor)


class TestCtrlCIsNotASaveError:
    """Ctrl-C during a synchronous save raises KeyboardInterrupt, not a SaveError that an
    ``except Exception`` around the save would swallow; the monitor is told the save failed."""

    def test_ctrl_c_while_waiting_for_admission(self, ray_cluster, namespace, tmp_path):
        from obsckpt import CheckpointCoordinator

        ray = ray_cluster
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            default_local_dir=str(tmp_path / "root"),
            metrics_port=None,
            save_strategy="SINGLE_THREAD",
        )
        coord = CheckpointCoordinator(monitor, rank=0)
        gate = threading.Event()
        coord.save_async("first", lambda: gate.wait(60), 1)  # holds the only admission
        wait_for(lambda: ray.get(monitor.status.remote())["in_flight"], 20, "the first save")

        armed = threading.Event()
        armed.set()

        def on_sigint(signum, frame):
            if armed.is_set():
                raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_sigint)
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
        try:
            timer.start()
            with pytest.raises(KeyboardInterrupt) as info:
                coord.save_sync(lambda: None, 1, name="second")  # waits behind "first"
        finally:
            armed.clear()
            timer.cancel()
            timer.join()
            signal.signal(signal.SIGINT, previous)
            gate.set()
        assert any("save 'second' of step 1" in n for n in info.value.__notes__)
        status = wait_for(
            lambda: (s := ray.get(monitor.status.remote()))["failed"] and s,
            20,
            "step 1 to fail",
        )
        assert [f["step"] for f in status["failed"]] == [1]
        assert "KeyboardInterrupt" in status["failed"][0]["error"]
        coord.wait_all(30)
        ray.kill(monitor)


class _InterruptedMapping(dict):
    """A state dict whose walk is interrupted, as by a Ctrl-C arriving mid-snapshot."""

    def items(self):
        raise KeyboardInterrupt


class TestCtrlCDuringSnapshotFailsTheStep:
    """Ctrl-C during a background save's snapshot reaches the caller as KeyboardInterrupt and
    the monitor is told: the step that registered the save fails now instead of pending."""

    def test_interrupted_snapshot(self, ray_cluster, namespace, tmp_path):
        from obsckpt import CheckpointCoordinator

        ray = ray_cluster
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(tmp_path / "root"), metrics_port=None
        )
        ray.get(monitor.register_thread_count.remote(1, state_dict_thread_count=1))
        ray.get(monitor.monitor_step.remote(1, True))
        coord = CheckpointCoordinator(monitor, rank=0)
        state = _InterruptedMapping(w=None)
        with pytest.raises(KeyboardInterrupt):
            coord.save_state_dict_async(
                "model", state, tmp_path / "root" / "global_step_1" / "m.pt", 1, is_state_dict=True
            )
        status = wait_for(
            lambda: (s := ray.get(monitor.status.remote()))["failed"] and s,
            20,
            "step 1 to fail",
        )
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(1, "state_dict")]
        assert "KeyboardInterrupt" in status["failed"][0]["error"]
        coord.wait_all(30)
        ray.kill(monitor)
