"""Snapshot stall, synchronous save and background write throughput, in one run.

Every repetition measures, one after the other on the same state:

* the warm copy of the state into preallocated buffers (the memcpy limit);
* ``save_state_dict_async``: the time the caller is blocked, then the
  background write until ``wait_all`` returns (file fsynced, renamed, reported);
* a direct-I/O write of the same number of bytes (``O_DIRECT`` from an
  aligned buffer, then fsync): what the filesystem itself sustains;
* ``torch.save`` + fsync of the same state (default settings), the synchronous
  baseline (fewer repetitions: it is the slow one).

After them, the first save of fresh slots with :meth:`prepare` called first,
against the second save of the same slot right after (``first_save_vs_warm``),
and the very first save of the run, which allocated its staging on the
caller's path (in the details as ``cold_first_save_s``, and against the warm
stall above as ``cold_first_save_vs_warm``).

Last, ``small_tensor_bytes_vs_torch_save``: the file obsckpt's writer makes of
an optimizer state of ~4,000 small tensors (one scalar ``step`` per
parameter), against ``torch.save``'s of the same state (one write each; sizes
do not vary between runs).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import time
from typing import Any

import torch

from benchmarks.common import Result, Sizes, median, rounded

# O_DIRECT wants the buffer, offset and length aligned to the logical block size.
_ALIGN = 4096
_DIRECT_CHUNK = 64 << 20


def make_state(nbytes: int, ntensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``ntensors`` float32 tensors of equal size totalling ``nbytes`` (random, incompressible)."""
    per = max(1, nbytes // ntensors // 4)
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.rand(per, generator=g) for i in range(ntensors)}


def state_nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def copy_limit(
    state: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """(torch ``copy_`` seconds, ``memmove`` seconds) to copy ``state`` into warm ``bufs``."""
    t0 = time.perf_counter()
    for k, t in state.items():
        bufs[k].copy_(t)
    t1 = time.perf_counter()
    for k, t in state.items():
        ctypes.memmove(bufs[k].data_ptr(), t.data_ptr(), t.numel() * t.element_size())
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


class DirectWriter:
    """Writes ``nbytes`` with O_DIRECT from one aligned buffer and fsyncs (like ``dd oflag=direct``)."""

    def __init__(self, directory: str, nbytes: int) -> None:
        self.path = os.path.join(directory, "direct-io.bin")
        self.nbytes = max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)
        self.chunk = min(_DIRECT_CHUNK, self.nbytes)
        self.buf = mmap.mmap(-1, self.chunk)  # page-aligned
        self.buf.write(
            os.urandom(min(self.chunk, 1 << 20)) * (self.chunk // min(self.chunk, 1 << 20))
        )
        self.error: str | None = None
        if not hasattr(os, "O_DIRECT"):
            self.error = "os.O_DIRECT is not available on this platform"

    def run(self) -> float | None:
        """Seconds for one write + fsync, or None if the filesystem refuses O_DIRECT."""
        if self.error:
            return None
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                self.error = f"the filesystem refuses O_DIRECT ({exc.strerror})"
                return None
            raise
        try:
            view = memoryview(self.buf)
            t0 = time.perf_counter()
            left = self.nbytes
            while left:
                n = min(left, self.chunk)
                written = os.write(fd, view[:n])
                left -= written
            os.fsync(fd)
            return time.perf_counter() - t0
        finally:
            os.close(fd)
            os.unlink(self.path)

    def close(self) -> None:
        self.buf.close()


def sync_save(state: dict[str, torch.Tensor], path: str) -> float:
    """``torch.save`` (default settings) + fsync; seconds."""
    t0 = time.perf_counter()
    torch.save(state, path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def optimizer_state(params: int, numel: int = 32) -> dict[str, Any]:
    """An Adam-like optimizer state: per parameter a scalar int64 ``step`` and two small moments."""
    g = torch.Generator().manual_seed(0)
    return {
        "state": {
            i: {
                "step": torch.tensor(1000, dtype=torch.int64),
                "exp_avg": torch.randn(numel, generator=g),
                "exp_avg_sq": torch.rand(numel, generator=g),
            }
            for i in range(params)
        },
        "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.999), "params": list(range(params))}],
    }


def small_tensor_bytes(bench_dir: str, params: int = 1334) -> Result:
    """File bytes of obsckpt's writer ÷ ``torch.save``'s for ``3 × params`` small tensors."""
    from obsckpt.store.torchfile import write_torch_file
    from obsckpt.tree import PACK_MAX

    state = optimizer_state(params)
    ours = os.path.join(bench_dir, "small-tensors-obsckpt.pt")
    theirs = os.path.join(bench_dir, "small-tensors-torch-save.pt")
    t0 = time.perf_counter()
    record = write_torch_file(state, ours)
    t1 = time.perf_counter()
    sync_s = sync_save(state, theirs)
    reference = os.path.getsize(theirs)
    loaded = torch.load(ours, weights_only=True)
    loaded_ok = all(
        torch.equal(loaded["state"][i][k], v) and loaded["state"][i][k].dtype == v.dtype
        for i in range(0, params, max(1, params // 16))
        for k, v in state["state"][i].items()
    )
    del loaded
    os.unlink(ours)
    os.unlink(theirs)
    if not loaded_ok:
        raise RuntimeError(f"{ours} did not load back equal to the state that was saved")
    return Result(
        "small_tensor_bytes_vs_torch_save",
        record.size / reference,
        "<=",
        1.2,
        unit="x",
        limit="torch.save's own bytes: the tensors' bytes, the pickle and a zip record per storage",
        details={
            "tensors": 3 * params,
            "obsckpt_file_bytes": record.size,
            "torch_save_file_bytes": reference,
            "pack_max_bytes": PACK_MAX,
            "obsckpt_write_s": round(t1 - t0, 6),
            "torch_save_fsync_s": round(sync_s, 6),
            "torch_load_ok": loaded_ok,
        },
    )


def _prepared_first_saves(coord, state, root: str, sizes: Sizes, log) -> tuple[list, list, list]:
    """(prepare, first-save stall, second-save stall) seconds of fresh slots prepared beforehand.

    The second save of the same slot, right after, is the warm stall the first
    is compared with: same slot, same moment, so machine noise hits both alike.
    """
    prepares, firsts, seconds = [], [], []
    for rep in range(min(3, sizes.save_reps)):
        coord.close()  # the slots so far are released: each measurement starts from nothing
        slot = f"prepared{rep}"
        # After the overlapped saves' steps; each slot's files inside their own step.
        step = sizes.save_reps + 3 + 2 * rep
        paths = [os.path.join(root, f"global_step_{s}", slot, "model.pt") for s in (step, step + 1)]
        t0 = time.perf_counter()
        coord.prepare(slot, state)
        t1 = time.perf_counter()
        coord.save_state_dict_async(slot, state, paths[0], step)
        t2 = time.perf_counter()
        coord.wait_all()
        t3 = time.perf_counter()
        coord.save_state_dict_async(slot, state, paths[1], step + 1)
        t4 = time.perf_counter()
        coord.wait_all()
        for path in paths:
            shutil.rmtree(os.path.dirname(os.path.dirname(path)), ignore_errors=True)
        prepares.append(t1 - t0)
        firsts.append(t2 - t1)
        seconds.append(t4 - t3)
        log(
            f"  prepared slot {rep + 1}: prepare {t1 - t0:.3f} s, first stall "
            f"{(t2 - t1) * 1e3:.1f} ms, second {(t4 - t3) * 1e3:.1f} ms"
        )
    coord.close()
    return prepares, firsts, seconds


def run_save_benchmarks(sizes: Sizes, bench_dir: str, monitor: Any, log) -> list[Result]:
    from obsckpt import CheckpointCoordinator

    state = make_state(sizes.state_bytes, sizes.state_tensors)
    nbytes = state_nbytes(state)
    bufs = {k: torch.empty_like(t) for k, t in state.items()}
    copy_limit(state, bufs)  # touch the buffers: the limit is a *warm* copy
    root = os.path.join(bench_dir, "save")
    os.makedirs(root, exist_ok=True)
    coord = CheckpointCoordinator(monitor, rank=0)
    direct = DirectWriter(bench_dir, nbytes)

    def ckpt_path(step: int) -> str:
        return os.path.join(root, f"global_step_{step}", "actor", "model_world_size_1_rank_0.pt")

    # Warm-up: allocates the staging buffers (first-save cost is not the steady state).
    t0 = time.perf_counter()
    coord.save_state_dict_async("model", state, ckpt_path(0), 0, is_state_dict=True)
    cold_first = time.perf_counter() - t0
    coord.wait_all()
    first_file_bytes = os.path.getsize(ckpt_path(0))

    copies, memmoves, stalls, writes, directs, syncs = [], [], [], [], [], []
    for rep in range(sizes.save_reps):
        step = rep + 1
        c, m = copy_limit(state, bufs)
        copies.append(c)
        memmoves.append(m)

        t0 = time.perf_counter()
        coord.save_state_dict_async("model", state, ckpt_path(step), step, is_state_dict=True)
        t1 = time.perf_counter()
        coord.wait_all()
        t2 = time.perf_counter()
        stalls.append(t1 - t0)
        writes.append(t2 - t1)
        shutil.rmtree(os.path.join(root, f"global_step_{step - 1}"), ignore_errors=True)

        d = direct.run()
        if d is not None:
            directs.append(d)
        if rep < sizes.sync_save_reps:
            syncs.append(sync_save(state, os.path.join(bench_dir, "sync-save.pt")))
            os.unlink(os.path.join(bench_dir, "sync-save.pt"))
        log(
            f"  save rep {rep + 1}/{sizes.save_reps}: copy {c * 1e3:.1f} ms, stall "
            f"{(t1 - t0) * 1e3:.1f} ms, write {t2 - t1:.3f} s"
            + (f", direct {d:.3f} s" if d is not None else "")
            + (f", torch.save {syncs[-1]:.3f} s" if rep < sizes.sync_save_reps else "")
        )

    # Overlapped saves (a copy thread on CPU): how soon the call returns, and
    # how long after the call wait_staged() returns.
    returns, staged = [], []
    for rep in range(2):
        step = sizes.save_reps + 1 + rep
        t0 = time.perf_counter()
        handle = coord.save_state_dict_async(
            "model", state, ckpt_path(step), step, is_state_dict=True, overlap=True
        )
        t1 = time.perf_counter()
        handle.wait_staged()
        t2 = time.perf_counter()
        coord.wait_all()
        shutil.rmtree(os.path.join(root, f"global_step_{step}"), ignore_errors=True)
        returns.append(t1 - t0)
        staged.append(t2 - t0)

    last = ckpt_path(sizes.save_reps)
    file_bytes = os.path.getsize(last)
    prepares, firsts, seconds = _prepared_first_saves(coord, state, root, sizes, log)
    loaded = torch.load(last, mmap=True, weights_only=True)
    loaded_ok = list(loaded) == list(state) and all(
        torch.equal(loaded[k], state[k]) for k in list(state)[:: max(1, len(state) // 4)]
    )
    del loaded
    shutil.rmtree(root, ignore_errors=True)
    direct.close()

    limit_copy = min(median(copies), median(memmoves))
    stall = median(stalls)
    common = {"state_bytes": nbytes, "tensors": len(state), "reps": sizes.save_reps}
    results = [
        Result(
            "stall_vs_memcpy",
            stall / limit_copy,
            "<=",
            1.25,
            unit="x",
            limit="memory bandwidth (one copy of the state is the least a snapshot can do)",
            details={
                **common,
                "stall_s": round(stall, 6),
                "memcpy_s": round(limit_copy, 6),
                "memcpy_GBps": round(nbytes / limit_copy / 1e9, 3),
                "torch_copy_s": rounded(copies),
                "memmove_s": rounded(memmoves),
                "stall_samples_s": rounded(stalls),
                "overlap_return_s": round(median(returns), 6),
                "overlap_wait_staged_s": round(median(staged), 6),
            },
        )
    ]
    first, second = median(firsts), median(seconds)
    results.append(
        Result(
            "first_save_vs_warm",
            first / second,
            "<=",
            1.5,
            unit="x",
            limit="a warm save's stall (one copy into staging that is already mapped and faulted in)",
            details={
                **common,
                "first_save_after_prepare_s": round(first, 6),
                "second_save_s": round(second, 6),
                "prepare_s": round(median(prepares), 6),
                "first_save_samples_s": rounded(firsts),
                "second_save_samples_s": rounded(seconds),
                "prepare_samples_s": rounded(prepares),
                "cold_first_save_s": round(cold_first, 6),
                "cold_first_save_vs_warm": round(cold_first / stall, 3),
                "warm_stall_s": round(stall, 6),
            },
        )
    )
    sync = median(syncs)
    results.append(
        Result(
            "sync_save_vs_stall",
            sync / stall,
            ">=",
            25,
            unit="x",
            limit="disk write bandwidth ÷ memory bandwidth: the stall cannot beat one memcpy",
            details={
                **common,
                "torch_save_fsync_s": round(sync, 6),
                "stall_s": round(stall, 6),
                "bound_if_stall_were_memcpy": round(sync / limit_copy, 3),
                "torch_save_samples_s": rounded(syncs),
                "note": "target applies to the full-size run" if sizes.mode != "full" else "",
            },
        )
    )
    write_bw = file_bytes / median(writes)
    details = {
        **common,
        "file_bytes": file_bytes,
        "first_file_bytes": first_file_bytes,
        "write_s": round(median(writes), 6),
        "write_GBps": round(write_bw / 1e9, 3),
        "write_samples_s": rounded(writes),
        "torch_load_ok": loaded_ok,
    }
    if directs:
        direct_bw = direct.nbytes / median(directs)
        details.update(
            direct_io_s=round(median(directs), 6),
            direct_io_GBps=round(direct_bw / 1e9, 3),
            direct_io_samples_s=rounded(directs),
        )
        results.append(
            Result(
                "write_vs_disk",
                write_bw / direct_bw,
                ">=",
                0.8,
                unit="x",
                limit="the filesystem's direct-I/O write bandwidth",
                details=details,
            )
        )
    else:
        results.append(
            Result(
                "write_vs_disk",
                None,
                ">=",
                0.8,
                unit="x",
                skipped=f"no direct-I/O baseline: {direct.error}",
                details=details,
            )
        )
    if not loaded_ok:
        raise RuntimeError(f"{last} did not load back equal to the state that was saved")
    results.append(small_tensor_bytes(bench_dir))
    log(f"  small tensors: file {results[-1].value:.3f} x torch.save's")
    return results
