"""A slot's staging holds one snapshot at a time: a new save of the slot waits for the write
of the previous one before it copies into the buffers that write reads from."""

from __future__ import annotations

import threading
import time

import ray
import torch

import obsckpt.store.torchfile
from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.store import layout


def test_a_save_does_not_overwrite_the_staging_its_slot_s_previous_save_is_writing(
    namespace, tmp_path, monkeypatch
):
    """While step 1's file of slot "model" is being written, a save of step 2 into the same
    slot returns only after it; each step's file holds the values of its own call."""
    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    coord = CheckpointCoordinator(monitor, rank=0)
    real_write = obsckpt.store.torchfile.write_torch_file
    release = threading.Event()
    writing = threading.Event()

    def slow_first_write(obj, path):
        if "global_step_1" in str(path):
            writing.set()
            assert release.wait(60)
        return real_write(obj, path)

    monkeypatch.setattr(obsckpt.store.torchfile, "write_torch_file", slow_first_write)
    paths = {s: layout.step_dir(root, s) / "actor" / "model.pt" for s in (1, 2)}
    try:
        coord.save_state_dict_async("model", {"w": torch.full((1 << 16,), 1.0)}, paths[1], 1)
        assert writing.wait(60)
        threading.Timer(0.5, release.set).start()
        t0 = time.monotonic()
        coord.save_state_dict_async("model", {"w": torch.full((1 << 16,), 2.0)}, paths[2], 2)
        waited = time.monotonic() - t0
        coord.wait_all(timeout=60)
        deadline = time.monotonic() + 10
        while not paths[1].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        release.set()
        coord.close(timeout=60)
        ray.kill(monitor)
    for step, expected in ((1, 1.0), (2, 2.0)):
        loaded = torch.load(paths[step], weights_only=True)["w"]
        assert torch.equal(loaded, torch.full((1 << 16,), expected)), (
            f"step {step}'s file holds {loaded.unique().tolist()}, not {expected}"
        )
    assert waited >= 0.4, f"the save of step 2 returned after {waited:.2f} s, during step 1's write"
