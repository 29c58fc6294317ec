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
