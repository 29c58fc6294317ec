"""Shared set-up for the weight-sync tests: rank processes, groups, ipc pairs, bit-exact checks.

``run_ranks`` runs a function as every member of a group, each in a process
of its own; ``new_group`` and ``broadcaster`` form the weight-sync group (and the
broadcaster on it) the way every test does, and close it after; ``ipc_pair``
is an ipc sender and receiver in this process, over shared-memory files.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.group import WeightSyncGroup, free_port
from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender

HOST = "127.0.0.1"
MARGIN_S = 2.0  # what a deadline may be overrun by on a loaded machine


# ----------------------------------------------------------------------
# Comparing tensors and reading measurements
# ----------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, on the CPU (any dtype, any layout)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in dtype, shape or any bit, or that only one side has."""
    bad = sorted(set(a) ^ set(b))
    for name in set(a) & set(b):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
            bad.append(name)
    return bad


def new_metrics() -> Any:
    """A :class:`~obsckpt.telemetry.metrics.Metrics` of its own registry."""
    from prometheus_client import CollectorRegistry

    from obsckpt.telemetry.metrics import Metrics

    return Metrics(CollectorRegistry())


def failure_report(
    b: WeightBroadcaster, metrics: Any, exc: BaseException | None, t0: float
) -> dict:
    """How a broadcast that may have failed ended on this side: error, time, group, counts, spans."""
    from obsckpt.telemetry import tracing

    reg = metrics.registry if metrics is not None else None
    return {
        "error": None if exc is None else f"{type(exc).__name__}: {exc}",
        "elapsed": time.monotonic() - t0,
        "broken": b.group.broken,
        "failures": None
        if reg is None
        else {
            reason: reg.get_sample_value(
                "obsckpt_broadcast_failures_total",
                {"backend": b.group.backend, "method": "broadcast", "reason": reason},
            )
            for reason in ("timeout", "error")
        },
        "span_status": [
            s["status"] for s in tracing.finished_spans() if s["name"] == "obsckpt.broadcast"
        ],
    }


# ----------------------------------------------------------------------
# Groups and broadcasters
# ----------------------------------------------------------------------


def new_group(
    rank: int = 0,
    port: int | None = None,
    *,
    world_size: int = 1,
    backend: str = "gloo",
    timeout_s: float = 10.0,
) -> WeightSyncGroup:
    """A weight-sync group on this host (a group of one, on a free port, by default)."""
    return WeightSyncGroup(
        host=HOST,
        port=free_port() if port is None else port,
        rank=rank,
        world_size=world_size,
        backend=backend,
        timeout_s=timeout_s,
    )


@contextlib.contextmanager
def broadcaster(
    rank: int,
    port: int,
    *,
    world_size: int = 2,
    backend: str = "gloo",
    group_timeout_s: float = 30.0,
    **kwargs: Any,
) -> Iterator[WeightBroadcaster]:
    """A :class:`WeightBroadcaster` (``kwargs``) on a new group; the group is closed after."""
    g = new_group(rank, port, world_size=world_size, backend=backend, timeout_s=group_timeout_s)
    try:
        yield WeightBroadcaster(g, **kwargs)
    finally:
        g.close()


def rank_device(rank: int, backend: str) -> torch.device:
    """The device a rank's tensors live on: the CPU for gloo, one GPU per rank for NCCL."""
    if backend == "gloo":
        return torch.device("cpu")
    from obsckpt.sync.device import setup_rank_device

    return setup_rank_device([str(rank)]).device  # one GPU per rank, as Ray gives them


# ----------------------------------------------------------------------
# Ranks in processes of their own
# ----------------------------------------------------------------------


def _child(fn: Callable[[int, Any], Any], rank: int, port: Any, results: Any) -> None:
    try:
        from obsckpt.telemetry import tracing

        tracing.setup_tracing("test", exporter="memory")
        torch.set_num_threads(1)
        results.put((rank, "ok", fn(rank, port)))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(
    fn: Callable[[int, Any], Any],
    world_size: int = 2,
    timeout: float = 120.0,
    *,
    ports: int = 1,
    dies: tuple[int, ...] = (),
) -> dict[int, Any]:
    """Run ``fn(rank, port)`` in ``world_size`` fresh processes; their return values by rank.

    ``fn`` must be importable by name (a module-level function of a test
    module, or a ``functools.partial`` of one). With ``ports`` > 1, ``fn``
    gets a tuple of that many free ports. Ranks in ``dies`` end their process
    themselves and report nothing.
    """
    # A fork server imports torch (and the test's module) once; every rank is then a
    # cheap fork of it.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, getattr(fn, "func", fn).__module__])
    results = ctx.Queue()
    port = free_port() if ports == 1 else tuple(free_port() for _ in range(ports))
    procs = [
        ctx.Process(target=_child, args=(fn, r, port, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    expected = world_size - len(dies)
    try:
        while len(out) < expected:
            try:
                rank, status, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(world_size)) - set(out) - set(dies))} hung")
            if status == "error":
                pytest.fail(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out


# ----------------------------------------------------------------------
# The ipc sync in one process
# ----------------------------------------------------------------------


@contextlib.contextmanager
def ipc_pair(
    shm_dir: Any,
    *,
    bucket_bytes: int = 4 << 10,
    receiver_device: str | None = "cpu",
    **sender_kwargs: Any,
) -> Iterator[tuple[IpcWeightSender, IpcWeightReceiver]]:
    """A CPU ipc sender (its buckets in ``shm_dir``) and a receiver; both closed after."""
    sender = IpcWeightSender(
        device="cpu", bucket_bytes=bucket_bytes, shm_dir=str(shm_dir), **sender_kwargs
    )
    receiver = IpcWeightReceiver(device=receiver_device)
    try:
        yield sender, receiver
    finally:
        sender.close()
        receiver.close()
