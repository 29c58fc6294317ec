"""What the verified read path costs: ``obsckpt.store.loading.load`` against a plain ``torch.load``.

``verified_load_vs_plain``: one committed step's file (the save benchmark's
state: ``state_bytes`` in ``state_tensors`` tensors, written by obsckpt's
writer and committed with its manifest), loaded by obsckpt's verified path
(the step's commit and manifest read; the file read once into private memory,
its CRC32 computed by a second thread right behind the reads; then
deserialised with ``weights_only=True`` from that memory, without a second
copy) against ``torch.load(path, weights_only=True)`` of the same
file. Interleaved repetition by repetition, median of each; the file is in the
page cache for both (the first, cold read is left out), so the ratio is the
cost of the check itself, not of the disk. With a CUDA device the same is
measured with ``map_location="cuda"`` (``verified_load_vs_plain_cuda``).
"""

from __future__ import annotations

import os
import shutil
import time

import torch

from benchmarks.common import Result, Sizes, median, rounded
from benchmarks.save import make_state

TARGET = 1.15


def _committed_file(sizes: Sizes, bench_dir: str) -> str:
    from obsckpt.store import commit, layout
    from obsckpt.store.torchfile import write_torch_file

    root = os.path.join(bench_dir, "load")
    shutil.rmtree(root, ignore_errors=True)
    path = str(layout.model_dir(root, 1) / "model_world_size_1_rank_0.pt")
    write_torch_file(make_state(sizes.state_bytes, sizes.state_tensors), path)
    commit.finalize_step(layout.step_dir(root, 1), iterations={"checkpoint": 1})
    return path


def _measure(path: str, reps: int, map_location: str) -> tuple[list[float], list[float]]:
    from obsckpt.store import loading

    def plain() -> object:
        return torch.load(path, map_location=map_location, weights_only=True)

    def verified() -> object:
        return loading.load(path, map_location=map_location)

    for fn in (plain, verified):  # warm: the page cache, the allocator, torch's imports
        fn()
    plain_s: list[float] = []
    verified_s: list[float] = []
    for _ in range(reps):
        for fn, out in ((plain, plain_s), (verified, verified_s)):
            if map_location == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            obj = fn()
            if map_location == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
            del obj
    return plain_s, verified_s


def _result(name: str, plain_s: list[float], verified_s: list[float], nbytes: int) -> Result:
    return Result(
        name,
        median(verified_s) / median(plain_s),
        "<=",
        TARGET,
        unit="x",
        limit="the read itself; the CRC32 (zlib-ng, ~10 GB/s) overlaps it, bar the last chunk",
        details={
            "file_bytes": nbytes,
            "plain_torch_load_s": rounded(plain_s),
            "verified_load_s": rounded(verified_s),
            "verified_gb_per_s": round(nbytes / median(verified_s) / 1e9, 2),
        },
    )


def run_verified_load(sizes: Sizes, bench_dir: str, log) -> list[Result]:
    path = _committed_file(sizes, bench_dir)
    nbytes = os.path.getsize(path)
    reps = max(3, 2 * sizes.save_reps)
    try:
        log(f"load: {nbytes / 2**20:.0f} MiB, verified against plain torch.load, {reps} reps")
        results = [_result("verified_load_vs_plain", *_measure(path, reps, "cpu"), nbytes)]
        if torch.cuda.is_available():
            cuda = _result("verified_load_vs_plain_cuda", *_measure(path, reps, "cuda"), nbytes)
        else:
            cuda = Result(
                "verified_load_vs_plain_cuda",
                None,
                "<=",
                TARGET,
                unit="x",
                skipped="no CUDA device on this machine",
            )
        return [*results, cuda]
    finally:
        shutil.rmtree(os.path.dirname(os.path.dirname(os.path.dirname(path))), ignore_errors=True)
