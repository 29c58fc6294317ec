"""What travels from the trainer to the rollout process, and what both sides share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

METHOD = "ipc"
PAYLOAD_VERSION = 5


@dataclass(frozen=True, slots=True)
class IpcPayload:
    """What the rollout process needs to take one version of the weights (picklable).

    ``meta``, ``views`` and ``live`` describe layout ``layout_id``. When the
    receiver already holds that layout (the last sync it acknowledged used
    it), ``described`` is false and they are left empty, as are ``handles``
    and ``storages``.
    """

    version: int
    step: int
    backend: str  # "cuda_ipc" or "shm"
    bucket_bytes: int
    meta: tuple[tuple[str, str, tuple[int, ...]], ...]
    handles: tuple[Any, ...]  # buckets layout: one per bucket, in plan order
    # time.monotonic() seconds; the sender may change its tensors after it. CLOCK_MONOTONIC
    # is one clock for every process of a host (as both sides are), and no step of the
    # system clock moves it.
    deadline: float
    device_uuid: str | None = None
    trace_context: dict[str, str] | None = None
    layout: str = "buckets"  # or "direct"
    # direct layout: (storage id, handle) of storages new to the receiver; per
    # tensor, (storage id, byte offset); the ids the receiver keeps open.
    storages: tuple[tuple[int, Any], ...] = ()
    views: tuple[tuple[int, int], ...] = ()
    live: tuple[int, ...] = ()
    layout_id: tuple[str, int] | None = None  # (the sender's token, a counter)
    described: bool = True  # False: meta, views and live are those of layout_id
    nbytes: int = 0
    # The receiver (its event's token) whose copy-done event the sender holds:
    # that receiver may answer before its copy finishes (recv(wait=False)).
    ack_event: str | None = None


def device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one call (on CUDA, batched launches, not one per tensor)."""
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dsts, srcs)
    else:
        for dst, src in zip(dsts, srcs, strict=True):
            dst.copy_(src)
