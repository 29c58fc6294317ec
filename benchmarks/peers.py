"""obsckpt next to its peers on the same state, in the same run.

Every repetition saves the same state with, one after the other:

* obsckpt ``save_state_dict_async`` (the stall: until it returns; durable:
  until ``wait_all`` returns, file fsynced, renamed and reported);
* torch DCP ``async_save`` with ``FileSystemWriter(thread_count=<obsckpt's
  writer threads>)`` as its stager (DCP's default: a fresh CPU copy of the
  state per save), on a single-process gloo group (stall: until it returns;
  durable: until its future is done, files fsynced by the writer);
* DCP ``async_save`` with the writer's cached staging
  (``cache_staged_state_dict=True``: pinned host buffers kept across saves)
  where torch can pin memory (CUDA), else reported as not measured;
* ``torch.save`` + fsync (synchronous: stall and durable are the same), fewer
  repetitions.

The state lives on the GPU when CUDA is available, else in CPU memory. Each
method makes one warm-up save first: the ratios compare warm saves.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from typing import Any

import torch

from benchmarks.common import Result, Sizes, median, rounded
from benchmarks.save import make_state, state_nbytes, sync_save


def _process_group(bench_dir: str) -> bool:
    """A one-process gloo group for DCP; True if this call created it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    store = os.path.join(bench_dir, f"pg-{uuid.uuid4().hex[:8]}")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    return True


class _Dcp:
    """One DCP setting: a writer per save (the writer is the stager) into its own directory."""

    def __init__(self, name: str, root: str, threads: int, cached: bool) -> None:
        self.name = name
        self.root = root
        self.threads = threads
        self.cached = cached
        self.writer = None
        self.stalls: list[float] = []
        self.durables: list[float] = []
        self.first_stall_s: float | None = None

    def _new_writer(self, path: str):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(
            path, thread_count=self.threads, cache_staged_state_dict=self.cached, sync_files=True
        )

    def save(self, state: dict, step: int, keep: bool = True) -> tuple[float, float]:
        from torch.distributed.checkpoint import async_save

        path = os.path.join(self.root, f"step_{step}")
        if self.writer is None or not self.cached:
            self.writer = self._new_writer(path)
        else:  # the cached writer keeps its staging buffers; point it at the new directory
            self.writer.reset(path)
        t0 = time.perf_counter()
        result = async_save(state, storage_writer=self.writer)
        t1 = time.perf_counter()
        future = getattr(result, "upload_completion", result)
        future.result()
        t2 = time.perf_counter()
        shutil.rmtree(os.path.join(self.root, f"step_{step - 1}"), ignore_errors=True)
        if keep:
            self.stalls.append(t1 - t0)
            self.durables.append(t2 - t0)
        elif self.first_stall_s is None:
            self.first_stall_s = t1 - t0
        return t1 - t0, t2 - t0

    def summary(self) -> dict[str, Any]:
        return {
            "stall_s": round(median(self.stalls), 6),
            "durable_s": round(median(self.durables), 6),
            "first_stall_s": round(self.first_stall_s or 0.0, 6),
            "stall_samples_s": rounded(self.stalls),
            "durable_samples_s": rounded(self.durables),
            "thread_count": self.threads,
            "cached_pinned_staging": self.cached,
        }


def _can_pin() -> bool:
    return torch.cuda.is_available()


def run_peers(sizes: Sizes, bench_dir: str, monitor: Any, log) -> list[Result]:
    import torch.distributed as dist

    from obsckpt import CheckpointCoordinator
    from obsckpt.torchfile import _WRITERS

    device = "cuda" if torch.cuda.is_available() else "cpu"
    state = make_state(sizes.state_bytes, sizes.state_tensors, seed=1)
    if device == "cuda":
        state = {k: v.to(device) for k, v in state.items()}
    nbytes = state_nbytes(state)
    root = os.path.join(bench_dir, "peers")
    os.makedirs(root, exist_ok=True)
    created = _process_group(bench_dir)
    coord = CheckpointCoordinator(monitor, rank=0)
    dcps = [_Dcp("dcp_default_stager", os.path.join(root, "dcp"), _WRITERS, cached=False)]
    if _can_pin():
        dcps.append(
            _Dcp("dcp_cached_pinned_writer", os.path.join(root, "dcp-cached"), _WRITERS, True)
        )

    def ckpt(step: int) -> str:
        return os.path.join(root, "obsckpt", f"global_step_{step}", "model.pt")

    stalls, durables, syncs = [], [], []
    try:
        # Warm-up: one save per method (obsckpt's allocates its staging here too).
        coord.save_state_dict_async("model", state, ckpt(0), 0)
        coord.wait_all()
        for d in dcps:
            d.save(state, 0, keep=False)
        reps = max(2, sizes.save_reps)
        for rep in range(1, reps + 1):
            t0 = time.perf_counter()
            coord.save_state_dict_async("model", state, ckpt(rep), rep)
            t1 = time.perf_counter()
            coord.wait_all()
            t2 = time.perf_counter()
            stalls.append(t1 - t0)
            durables.append(t2 - t0)
            shutil.rmtree(os.path.dirname(ckpt(rep - 1)), ignore_errors=True)
            line = f"  peers rep {rep}/{reps}: obsckpt stall {stalls[-1] * 1e3:.1f} ms, durable {durables[-1]:.3f} s"
            for d in dcps:
                s, w = d.save(state, rep)
                line += f"; {d.name} stall {s * 1e3:.1f} ms, durable {w:.3f} s"
            if rep <= sizes.sync_save_reps:
                path = os.path.join(root, "torch-save.pt")
                syncs.append(sync_save(state, path))
                os.unlink(path)
                line += f"; torch.save+fsync {syncs[-1]:.3f} s"
            log(line)
    finally:
        coord.close(timeout=600)
        if created:
            dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)

    stall, durable = median(stalls), median(durables)
    # The best DCP setting measured is the one compared with.
    best_stall = min(dcps, key=lambda d: median(d.stalls))
    best_durable = min(dcps, key=lambda d: median(d.durables))
    details: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "state_bytes": nbytes,
        "tensors": len(state),
        "reps": len(stalls),
        "obsckpt": {
            "stall_s": round(stall, 6),
            "durable_s": round(durable, 6),
            "stall_samples_s": rounded(stalls),
            "durable_samples_s": rounded(durables),
            "writer_threads": _WRITERS,
        },
        "torch_save_fsync": {"durable_s": round(median(syncs), 6), "samples_s": rounded(syncs)},
        **{d.name: d.summary() for d in dcps},
    }
    if not _can_pin():
        details["dcp_cached_pinned_writer"] = "not measured: pinning host memory needs CUDA"
    return [
        Result(
            "peer_dcp_stall_ratio",
            median(best_stall.stalls) / stall,
            ">=",
            1.3,
            unit="x",
            limit="DCP async_save's stall ÷ obsckpt's on the same state (higher is better for obsckpt)",
            details={**details, "compared_with": best_stall.name},
        ),
        Result(
            "peer_dcp_durable_ratio",
            median(best_durable.durables) / durable,
            ">=",
            1.1,
            unit="x",
            limit="DCP async_save's time to durable ÷ obsckpt's on the same state",
            details={**details, "compared_with": best_durable.name},
        ),
    ]
