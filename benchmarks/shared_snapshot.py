"""One snapshot for the checkpoint and the publish: the stall and the memory of save + publish.

A step that is both saved and published (memory sync to the Synchronizer)
takes one snapshot: the save stages the state into its slot's arena and the
publish reads that arena (``StagedSave.hold``) from a background thread, while
training goes on. Measured side by side, interleaved repetition by repetition:

* ``single``: the save alone (its stall: the ``save_state_dict_async`` call);
* ``shared``: the save, then the publish started on a thread that holds the
  save's snapshot (the stall: until training may go on);
* ``separate``: the save, then a second snapshot of the state for the publish
  (what publishing from the trainer's tensors costs when they must be copied
  off the device again), published on a thread.

``shared_snapshot_stall_vs_single``: shared over single (target <= 1.05).
``shared_snapshot_peak_extra_host``: the training process's peak resident
memory during a shared save + publish, above its level before (the arena
prepared at start-up), over one snapshot's bytes (target <= 1.05; the publish's
serialisation into Ray's object store is in it). The separate path's figures
are in the details.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.common import Result, Sizes, median, rounded
from benchmarks.save import make_state, state_nbytes

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * _PAGE


class _PeakRss:
    """The peak resident set of this process while the block runs, sampled every ms."""

    def __init__(self) -> None:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def run_shared_snapshot(sizes: Sizes, bench_dir: str, monitor: Any, log) -> list[Result]:
    import ray

    from obsckpt import CheckpointCoordinator, Synchronizer
    from obsckpt.sync.publish import publish_staged_async, zero_copy

    state = make_state(sizes.state_bytes, sizes.state_tensors)
    nbytes = state_nbytes(state)
    root = os.path.join(bench_dir, "publish")
    os.makedirs(root, exist_ok=True)
    coord = CheckpointCoordinator(monitor, rank=0)
    coord.prepare("model", state).result()
    namespace = ray.get_runtime_context().namespace
    sync = Synchronizer.get_actor(namespace=f"{namespace}-publish")
    pool = ThreadPoolExecutor(1)  # the separate path's publisher thread
    step = 0

    def path(s: int) -> str:
        return os.path.join(root, f"global_step_{s}", "actor", "model_world_size_1_rank_0.pt")

    def publish(tensors: dict[str, torch.Tensor], s: int) -> None:
        ray.get(sync.set_model_state_dict.remote(zero_copy(tensors), s), timeout=600)

    def one(kind: str) -> tuple[float, int]:
        nonlocal step
        step += 1
        s = step
        with _PeakRss() as rss:
            t0 = time.perf_counter()
            handle = coord.save_state_dict_async("model", state, path(s), s, is_state_dict=True)
            if kind == "shared":
                worker = publish_staged_async(sync, handle, s)
            elif kind == "separate":
                copy = {k: v.clone() for k, v in state.items()}
                worker = pool.submit(publish, copy, s)
            else:
                worker = None
            stall = time.perf_counter() - t0
            if worker is not None:
                worker.result()
            coord.wait_all()
            del handle
        return stall, rss.peak - rss.base

    kinds = ("single", "shared", "separate")
    for kind in kinds:  # warm-up: the publish path, the object store, the file
        one(kind)
    stalls: dict[str, list[float]] = {k: [] for k in kinds}
    extra: dict[str, list[int]] = {k: [] for k in kinds}
    for rep in range(max(3, sizes.save_reps)):
        for kind in kinds if rep % 2 == 0 else tuple(reversed(kinds)):
            st, ex = one(kind)
            stalls[kind].append(st)
            extra[kind].append(ex)
    coord.close()
    ray.kill(sync)
    med = {k: median(v) for k, v in stalls.items()}
    peak = {k: max(v) / nbytes for k, v in extra.items()}
    log(
        f"  stall single {med['single']:.4f} s, shared {med['shared']:.4f} s, separate "
        f"{med['separate']:.4f} s; peak extra host memory shared {peak['shared']:.2f}x, "
        f"separate {peak['separate']:.2f}x of one snapshot"
    )
    details = {
        "bytes": nbytes,
        "tensors": len(state),
        "publish": "Synchronizer.set_model_state_dict (memory sync through Ray's object store)",
        **{f"{k}_stall_s": round(v, 6) for k, v in med.items()},
        **{f"{k}_stall_samples_s": rounded(v) for k, v in stalls.items()},
        **{f"{k}_peak_extra_host_x": round(v, 3) for k, v in peak.items()},
        "separate_vs_single": round(med["separate"] / med["single"], 3),
    }
    return [
        Result(
            "shared_snapshot_stall_vs_single",
            med["shared"] / med["single"],
            "<=",
            1.05,
            unit="x",
            limit="the snapshot copy itself: the publish reads it on a thread",
            details=details,
        ),
        Result(
            "shared_snapshot_peak_extra_host",
            peak["shared"],
            "<=",
            1.05,
            unit="x",
            limit="the publish's serialisation into the object store (one snapshot's bytes)",
            details={k: v for k, v in details.items() if "peak" in k or k == "bytes"},
        ),
    ]
