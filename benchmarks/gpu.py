"""GPU snapshot stall: staging a CUDA state into pinned host buffers vs the measured D2H copy.

The limit is one device→pinned-host copy of the same tensors into
preallocated pinned buffers (``copy_(non_blocking=True)`` then one
synchronize); the obsckpt path is :meth:`StagingBuffers.stage` with warm
pinned buffers, which is what ``save_state_dict_async`` blocks on.
"""

from __future__ import annotations

import time

from benchmarks.common import Result, Sizes, median, rounded, skipped


def run_gpu_stall(sizes: Sizes, log) -> Result:
    import torch

    if not torch.cuda.is_available():
        return skipped("gpu_stall_vs_d2h", "<=", 1.25, "CUDA is not available", unit="x")
    from obsckpt.snapshot import StagingBuffers

    per = max(1, sizes.state_bytes // sizes.state_tensors // 2)
    state = {
        f"layers.{i}.weight": torch.randn(per, dtype=torch.bfloat16, device="cuda")
        for i in range(sizes.state_tensors)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in state.items()}
    staging = StagingBuffers(pin_memory=True)
    staging.stage(state)  # allocate the pinned staging buffers once

    def d2h() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, t in state.items():
            pinned[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def stage() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        staging.stage(state)
        return time.perf_counter() - t0

    d2h()
    copies, stalls = [], []
    for _ in range(max(3, sizes.save_reps)):
        copies.append(d2h())
        stalls.append(stage())
    c, s = median(copies), median(stalls)
    log(f"  gpu stall {s * 1e3:.1f} ms vs D2H {c * 1e3:.1f} ms ({nbytes / c / 1e9:.1f} GB/s)")
    return Result(
        "gpu_stall_vs_d2h",
        s / c,
        "<=",
        1.25,
        unit="x",
        limit="device-to-host (PCIe / NVLink-C2C) bandwidth into pinned memory",
        details={
            "device": torch.cuda.get_device_name(0),
            "state_bytes": nbytes,
            "tensors": len(state),
            "stall_s": round(s, 6),
            "d2h_s": round(c, 6),
            "d2h_GBps": round(nbytes / c / 1e9, 3),
            "stall_samples_s": rounded(stalls),
            "d2h_samples_s": rounded(copies),
        },
    )
