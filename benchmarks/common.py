"""Shared pieces of the benchmarks: sizes, results, timing helpers, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GiB = 1 << 30
MiB = 1 << 20


@dataclass(kw_only=True, slots=True)
class Sizes:
    """How big and how often; one instance per mode (full, quick, smoke)."""

    mode: str
    state_bytes: int  # the snapshot/save state
    state_tensors: int
    save_reps: int
    sync_save_reps: int
    rss_reps: int
    telemetry_calls: int  # save_async calls per repetition
    telemetry_reps: int
    telemetry_code_iters: int  # loop length timing the telemetry code paths directly
    commit_ranks: int
    commit_slots: int
    commit_steps: int  # p99 over these steps: 100 or more for it not to be the maximum
    commit_floor_every: int  # the RPC floor is measured after every n-th step
    commit_actors: int
    commit_spread_s: float  # window over which one step's saves finish
    commit_burst_steps: int  # steps whose saves all finish at once
    commit_wide_steps: int  # steps with the wider, storage-like spread
    commit_wide_spread_s: float
    bcast_tensors: int
    bcast_bytes: int
    bcast_reps: int

    def __post_init__(self) -> None:
        for name in ("state_bytes", "state_tensors", "save_reps", "commit_ranks", "bcast_tensors"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")


SIZES = {
    "full": Sizes(
        mode="full",
        state_bytes=GiB,
        state_tensors=64,
        save_reps=5,
        sync_save_reps=3,
        rss_reps=3,
        telemetry_calls=1500,
        telemetry_reps=4,
        telemetry_code_iters=10_000,
        commit_ranks=256,
        commit_slots=4,
        commit_steps=100,
        commit_floor_every=4,
        commit_actors=4,
        commit_spread_s=0.5,
        commit_burst_steps=4,
        commit_wide_steps=3,
        commit_wide_spread_s=2.0,
        bcast_tensors=2000,
        bcast_bytes=256 * MiB,
        bcast_reps=9,
    ),
    "quick": Sizes(
        mode="quick",
        state_bytes=256 * MiB,
        state_tensors=64,
        save_reps=3,
        sync_save_reps=2,
        rss_reps=1,
        telemetry_calls=500,
        telemetry_reps=2,
        telemetry_code_iters=10_000,
        commit_ranks=256,
        commit_slots=4,
        commit_steps=10,
        commit_floor_every=2,
        commit_actors=4,
        commit_spread_s=0.5,
        commit_burst_steps=3,
        commit_wide_steps=2,
        commit_wide_spread_s=2.0,
        bcast_tensors=2000,
        bcast_bytes=64 * MiB,
        bcast_reps=3,
    ),
    "smoke": Sizes(
        mode="smoke",
        state_bytes=4 * MiB,
        state_tensors=8,
        save_reps=2,
        sync_save_reps=1,
        rss_reps=1,
        telemetry_calls=20,
        telemetry_reps=1,
        telemetry_code_iters=200,
        commit_ranks=8,
        commit_slots=4,
        commit_steps=1,
        commit_floor_every=1,
        commit_actors=2,
        commit_spread_s=0.05,
        commit_burst_steps=1,
        commit_wide_steps=1,
        commit_wide_spread_s=0.1,
        bcast_tensors=40,
        bcast_bytes=2 * MiB,
        bcast_reps=1,
    ),
}


@dataclass(slots=True)
class Result:
    """One row of the report: a measured value against its target."""

    name: str
    value: float | None
    op: str  # "<=" or ">="
    bound: float
    unit: str = ""
    limit: str = ""  # what bounds this number on the machine
    details: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value <= self.bound if self.op == "<=" else self.value >= self.bound

    @property
    def target(self) -> str:
        return f"{self.op} {self.bound:g}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "value": self.value,
            "target": self.target,
            "met": self.met,
            "unit": self.unit,
            "limit": self.limit,
        }
        if self.skipped is not None:
            out["skipped"] = self.skipped
        out.update(self.details)
        return out


def skipped(name: str, op: str, bound: float, reason: str, unit: str = "") -> Result:
    return Result(name, None, op, bound, unit=unit, skipped=reason)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def p99(xs: list[float]) -> float:
    """99th percentile, linear interpolation between closest ranks."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * 0.99
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def cuda_seconds(fn: Callable[..., Any], *args: Any) -> float:
    """Seconds for ``fn(*args)`` and the GPU work it queues (synchronized before and after)."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def rounded(xs: list[float], digits: int = 6) -> list[float]:
    return [round(x, digits) for x in xs]


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    try:
        path = os.path.realpath(path)
        best, fstype = "", "unknown"
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (
                    path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")
                ):
                    if len(parts[1]) > len(best):
                        best, fstype = parts[1], f"{parts[2]} on {parts[0]} ({parts[1]})"
        return fstype
    except OSError:
        return "unknown"


def machine_info(bench_dir: str) -> dict[str, Any]:
    import torch

    try:
        import ray

        ray_version = ray.__version__
    except ImportError:  # pragma: no cover - ray is a dependency
        ray_version = None
    cuda = torch.cuda.is_available()
    return {
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": _meminfo_total(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "ray": ray_version,
        "cuda": torch.cuda.get_device_name(0) if cuda else None,
        "bench_dir": bench_dir,
        "bench_fs": _fs_type(bench_dir),
    }


def run_pair(worker: Callable[..., None], args: tuple, what: str, timeout: float) -> dict:
    """Run ``worker(rank, port, *args, queue)`` as ranks 0 and 1, each a spawned process;
    their ``(rank, payload)`` reports by rank. A payload with ``error`` raises, naming ``what``."""
    import multiprocessing as mp

    from obsckpt.sync.group import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < 2:
            rank, payload = q.get(timeout=max(1.0, deadline - time.monotonic()))
            if "error" in payload:
                raise RuntimeError(f"{what} rank {rank} failed:\n{payload['error']}")
            out[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out
