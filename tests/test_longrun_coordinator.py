"""A coordinator that saves for days: threads, files and memory stay what a few saves use.

Real parts: a local Ray with the monitor actor, real files, real threads.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
import weakref

import pytest
import ray
import torch

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveError


def _monitor(namespace, root):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    return monitor


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _obsckpt_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("obsckpt-"))


class _Payload:
    """Stands for what a save writes (a CPU copy of a state dict, gigabytes in a real job)."""


class TestFailedSavesLetGoOfTheirData:
    """Failed background saves waiting for wait_all() keep the data of one save at most,
    however many fail: a job that waits rarely does not hold a copy per failure."""

    def test_only_the_raised_failure_keeps_its_frames(self, namespace, tmp_path):
        coord = CheckpointCoordinator(_monitor(namespace, tmp_path / "ckpt"), rank=0)
        # Logged as a job's handlers log them (formatted, then dropped): pytest's own
        # capture keeps every record, and each record its traceback.
        coord.logger = logging.getLogger("obsckpt.test_longrun.quiet")
        coord.logger.propagate = False
        n = 40
        alive: list[weakref.ref] = []
        for step in range(1, n + 1):
            payload = _Payload()
            alive.append(weakref.ref(payload))

            def save(payload=payload):
                raise OSError(28, "No space left on device")

            coord.save_async("model", save, step)
            del payload, save
        coord._join("model")  # the last save has ended, its failure stored
        deadline = time.monotonic() + 10
        while len(coord.pending_errors()) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        gc.collect()
        kept = sum(r() is not None for r in alive)
        assert kept <= 1, f"{kept} of {n} failed saves still hold what they were writing"
        # Every failure is still there for the caller, with its message.
        errors = coord.pending_errors()
        assert len(errors) == n
        assert all("No space left on device" in str(e) for e in errors)
        # The one raised is whole: where the save failed is still in its cause's traceback.
        with pytest.raises(SaveError) as info:
            coord.wait_all()
        assert info.value.step == 1
        assert isinstance(info.value.__cause__, OSError)
        assert info.value.__cause__.__traceback__ is not None
        del info, errors
        gc.collect()
        assert all(r() is None for r in alive)


class TestSavingForLongUsesNoMore:
    """Hundreds of saves (plain, staged, overlapped, under a watchdog) end with the threads
    and open files that the first few saves left; nothing is left in the step directories."""

    def test_threads_and_files_stay_flat(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = _monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0, save_timeout=60.0)
        state = {"w": torch.randn(64, 64), "b": torch.randn(64)}

        def step(n: int) -> None:
            path = root / f"global_step_{n}" / "actor" / "model_world_size_1_rank_0.pt"
            coord.save_async("extra", lambda: None, n)
            staged = coord.save_state_dict_async(
                "actor", state, path, n, is_state_dict=False, overlap=n % 2 == 0
            )
            staged.wait_staged(30)
            asyncio.run(coord.register_and_monitor(n, checkpoint_thread_count=2))
            coord.wait_all(timeout=30)

        for n in range(1, 11):
            step(n)
        fds, threads = _fds(), _obsckpt_threads()
        for n in range(11, 211):
            step(n)
        assert ray.get(monitor.latest_steps.remote())["checkpoint"] == 210
        assert _fds() <= fds + 2, (fds, _fds())
        assert len(_obsckpt_threads()) <= len(threads), (threads, _obsckpt_threads())
        leftovers = [f for _d, _s, files in os.walk(root) for f in files if ".tmp" in f]
        assert leftovers == []
        coord.close()
