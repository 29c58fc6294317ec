"""GPU staging: stall, pinned memory, first save and overlapped copies vs the measured D2H copy.

The limit is one device→pinned-host copy of the same tensors into
preallocated pinned buffers (``copy_(non_blocking=True)`` then one
synchronize). Measured on one bf16 state on the GPU:

* ``gpu_stall_vs_d2h``: :meth:`StagingBuffers.stage` with a warm arena
  (what ``save_state_dict_async`` blocks on) ÷ that copy;
* ``gpu_pinned_bytes_ratio``: page-locked bytes the staging holds ÷ the
  state's bytes (the caching host allocator's own pinned bytes, which the
  arena does not use, are in the details);
* ``gpu_first_save_vs_warm``: the first stage of a fresh slot after
  :meth:`StagingBuffers.prepare` ÷ a warm stage (a cold first stage, without
  prepare, is in the details);
* ``gpu_overlapped_stall_vs_d2h``: an overlapped stage (side-stream copy,
  :class:`StagingCopy`) next to a matmul workload on the training stream: how
  much longer the training stream takes than the workload alone (the host
  time to plan the copies and hand them to the copy thread included) ÷ the
  D2H copy.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.common import Result, Sizes, cuda_seconds, median, rounded, skipped

NO_CUDA = "CUDA is not available"


def run_gpu_benchmarks(sizes: Sizes, log) -> list[Result]:
    import torch

    names = (
        ("gpu_stall_vs_d2h", "<=", 1.25),
        ("gpu_pinned_bytes_ratio", "<=", 1.02),
        ("gpu_first_save_vs_warm", "<=", 1.5),
        ("gpu_overlapped_stall_vs_d2h", "<=", 0.1),
    )
    if not torch.cuda.is_available():
        return [skipped(n, op, b, NO_CUDA, unit="x") for n, op, b in names]
    from obsckpt.staging import StagingBuffers, StagingCopy

    per = max(1, sizes.state_bytes // sizes.state_tensors // 2)
    state = {
        f"layers.{i}.weight": torch.randn(per, dtype=torch.bfloat16, device="cuda")
        for i in range(sizes.state_tensors)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    device = torch.cuda.get_device_name(0)
    common = {"device": device, "state_bytes": nbytes, "tensors": len(state)}

    def host_pinned() -> int:
        try:
            return int(torch.cuda.memory.host_memory_stats().get("allocated_bytes.current", 0))
        except Exception:  # noqa: BLE001 - older torch: no host allocator stats
            return -1

    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}
    allocator_before = host_pinned()
    staging = StagingBuffers(pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    staging.stage(state)  # a cold first stage: allocates, registers and faults the arena
    cold_first = time.perf_counter() - t0
    allocator_after = host_pinned()

    def d2h() -> float:
        def copies() -> None:
            for k, t in state.items():
                pinned[k].copy_(t, non_blocking=True)

        return cuda_seconds(copies)

    def stage(buffers: StagingBuffers) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buffers.stage(state)
        return time.perf_counter() - t0

    d2h()
    copies, stalls = [], []
    reps = max(3, sizes.save_reps)
    for _ in range(reps):
        copies.append(d2h())
        stalls.append(stage(staging))
    c, s = median(copies), median(stalls)
    log(f"  gpu stall {s * 1e3:.1f} ms vs D2H {c * 1e3:.1f} ms ({nbytes / c / 1e9:.1f} GB/s)")
    results = [
        Result(
            "gpu_stall_vs_d2h",
            s / c,
            "<=",
            1.25,
            unit="x",
            limit="device-to-host (PCIe / NVLink-C2C) bandwidth into pinned memory",
            details={
                **common,
                "stall_s": round(s, 6),
                "d2h_s": round(c, 6),
                "d2h_GBps": round(nbytes / c / 1e9, 3),
                "stall_samples_s": rounded(stalls),
                "d2h_samples_s": rounded(copies),
            },
        ),
        Result(
            "gpu_pinned_bytes_ratio",
            staging.pinned_bytes / nbytes,
            "<=",
            1.02,
            unit="x",
            limit="the state's bytes (one registered arena, views at 4 KiB offsets)",
            details={
                **common,
                "staging_bytes": staging.bytes_allocated,
                "pinned_bytes": staging.pinned_bytes,
                "caching_host_allocator_delta_bytes": allocator_after - allocator_before
                if allocator_before >= 0
                else None,
            },
        ),
    ]

    # First stage of fresh slots after prepare, against the warm stage above.
    prepares, firsts = [], []
    for _ in range(3):
        fresh = StagingBuffers(pin_memory=True)
        t0 = time.perf_counter()
        fresh.prepare(state)
        prepares.append(time.perf_counter() - t0)
        firsts.append(stage(fresh))
        fresh.release()
    first = median(firsts)
    log(f"  gpu first stage after prepare {first * 1e3:.1f} ms, cold {cold_first:.3f} s")
    results.append(
        Result(
            "gpu_first_save_vs_warm",
            first / s,
            "<=",
            1.5,
            unit="x",
            limit="a warm stage into a registered, faulted-in arena",
            details={
                **common,
                "first_after_prepare_s": round(first, 6),
                "warm_stall_s": round(s, 6),
                "prepare_s": round(median(prepares), 6),
                "first_samples_s": rounded(firsts),
                "prepare_samples_s": rounded(prepares),
                "cold_first_stage_s": round(cold_first, 6),
            },
        )
    )

    # Overlapped: a matmul workload on the training stream while the side stream copies.
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def matmuls(n: int) -> None:
        for _ in range(n):
            torch.mm(a, b)

    matmuls(3)  # cuBLAS picks its kernel on the first products: not part of the timing
    per_mm = cuda_seconds(matmuls, 10) / 10
    n_mm = max(4, math.ceil(2 * c / per_mm))  # about twice the copy: room to hide it

    def workload_alone() -> float:
        return cuda_seconds(matmuls, n_mm)

    # A kept copy thread, as the coordinator's: handing it the copies costs a queue put.
    pool = ThreadPoolExecutor(1, thread_name_prefix="bench-stage")
    pool.submit(lambda: None).result()

    def overlapped() -> tuple[float, float]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, plan = staging.plan(state)
        copier = StagingCopy(staging, plan)
        copier.start(pool.submit)
        t_queue = time.perf_counter() - t0
        matmuls(n_mm)
        copier.wait()  # before the optimizer step: the training stream waits for the copies
        torch.cuda.synchronize()
        total = time.perf_counter() - t0
        copier.finish()
        return total, t_queue

    side = torch.cuda.Stream()
    bufs = list(staging.plan(state)[1])

    def raw_copy() -> float:
        """The floor: the same copies on a side stream, queued inline, with no obsckpt code."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _, src, buf in bufs:
                buf.copy_(src, non_blocking=True)
        matmuls(n_mm)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    # Each kind once untimed, the overlapped stage included: its first use creates
    # the slot's side stream inside the timed region.
    workload_alone()
    raw_copy()
    overlapped()
    alone, together, queued, raw = [], [], [], []
    for _ in range(reps):
        alone.append(workload_alone())
        raw.append(raw_copy())
        total, q = overlapped()
        together.append(total)
        queued.append(q)
    stall_ov = max(0.0, median(together) - median(alone))
    log(
        f"  gpu overlapped: workload {median(alone) * 1e3:.1f} ms alone, "
        f"{median(raw) * 1e3:.1f} ms next to a bare side-stream copy, "
        f"{median(together) * 1e3:.1f} ms with the copy (hand-off {median(queued) * 1e3:.2f} ms)"
    )
    results.append(
        Result(
            "gpu_overlapped_stall_vs_d2h",
            stall_ov / c,
            "<=",
            0.1,
            unit="x",
            limit="the D2H copy the training stream would otherwise wait for",
            details={
                **common,
                "stall_s": round(stall_ov, 6),
                "d2h_s": round(c, 6),
                "matmuls": n_mm,
                "workload_alone_s": round(median(alone), 6),
                "workload_with_copy_s": round(median(together), 6),
                # the GPU's own cost of a concurrent D2H copy (HBM, clocks): a floor
                "workload_with_raw_copy_s": round(median(raw), 6),
                "raw_copy_stall_vs_d2h": round(max(0.0, median(raw) - median(alone)) / c, 4),
                # Each overlapped run against the workload alone just before it: a
                # small difference of two long times, less exposed to drift paired.
                "paired_stall_vs_d2h": round(
                    max(0.0, median([t - a for t, a in zip(together, alone, strict=True)])) / c, 4
                ),
                "hand_off_s": round(median(queued), 6),
                "workload_alone_samples_s": rounded(alone),
                "workload_with_copy_samples_s": rounded(together),
            },
        )
    )
    pool.shutdown()
    staging.release()
    return results
