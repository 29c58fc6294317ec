"""obsckpt: crash-consistent, observable asynchronous checkpointing for Ray-based RL training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from obsckpt.admission import SaveStrategy
from obsckpt.coordinator import CheckpointCoordinator, StagedSave
from obsckpt.errors import *  # noqa: F403 - every exception is part of the public API
from obsckpt.errors import __all__ as _errors
from obsckpt.monitor import CheckpointMonitor
from obsckpt.store.scratch import scratch_path

if TYPE_CHECKING:
    from obsckpt.resume import ResumeRecord
    from obsckpt.sync.synchronizer import Synchronizer

__version__ = "0.1.0"

__all__ = [
    "CheckpointCoordinator",
    "CheckpointMonitor",
    "ResumeRecord",
    "SaveStrategy",
    "StagedSave",
    "Synchronizer",
    "scratch_path",
    *_errors,
]


def __getattr__(name: str) -> Any:
    # The Synchronizer pulls in the weight-sync stack; load it on first use.
    if name == "Synchronizer":
        from obsckpt.sync.synchronizer import Synchronizer

        return Synchronizer
    if name == "ResumeRecord":  # torch and NumPy: loaded on first use too
        from obsckpt.resume import ResumeRecord

        return ResumeRecord
    raise AttributeError(f"module 'obsckpt' has no attribute {name!r}")
