"""CUDA streams and interprocess events, as the sender and receiver use them.

One seam: the CPU tests replace these functions with stand-ins that log what
each side queues and waits for (CUDA itself needs a GPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def cuda_devices(tensors: Iterable[torch.Tensor]) -> set[torch.device]:
    return {t.device for t in tensors if t.is_cuda}


def current_stream(device: torch.device) -> Any:
    return torch.cuda.current_stream(device)


def new_event() -> Any:
    """An event another process can open and wait for (made on its first record)."""
    return torch.cuda.Event(interprocess=True)


def open_event(device: torch.device, handle: bytes) -> Any:
    return torch.cuda.Event.from_ipc_handle(device, handle)


def graphs_on(device: torch.device) -> bool:
    """Whether copies on ``device`` can be captured as a CUDA graph."""
    return device.type == "cuda"


def capture_copies(device: torch.device, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
    """A CUDA graph of ``dst.copy_(src)`` for each pair; ``replay()`` queues them all.

    Captured on a side stream (capture needs one) in thread-local mode, so the
    rollout's other threads may go on using CUDA meanwhile; nothing runs
    until the first replay, which queues the copies on the current stream.
    """
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            for dst, src in zip(dsts, srcs, strict=True):
                dst.copy_(src, non_blocking=True)
        finally:
            graph.capture_end()
    return graph
