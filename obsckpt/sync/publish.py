"""Publishing a save's own snapshot: one copy off the device for the checkpoint and the rollout.

:meth:`~obsckpt.slot_staging.StagedSave.hold` lends the host snapshot a
state-dict save writes. :func:`publish_staged` hands it to the Synchronizer
(memory sync) without a second copy: each tensor travels as a view of its
bytes, which Ray writes into its object store once (pickle protocol 5,
out of band) instead of pickling a copy first. The Synchronizer receives
read-only tensors over the object store's memory. A broadcast or a delta
sync reads the lent snapshot directly (``DeltaBroadcaster.send(snapshot, step=...)``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["ZeroCopyTensor", "publish_staged", "publish_staged_async", "zero_copy"]

_publisher: ThreadPoolExecutor | None = None
_publisher_lock = threading.Lock()


class ZeroCopyTensor:
    """A host tensor that pickles as a view of its bytes (out of band under protocol 5)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        t = self.tensor.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        return _rebuild, (raw, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _rebuild(raw: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        # The object store's buffers are read-only; so is what is built over them.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.from_numpy(raw)
    return flat.view(getattr(torch, dtype)).view(shape)


def zero_copy(state: Any) -> Any:
    """``state`` (dicts, lists and tuples of them) with each tensor wrapped to pickle
    without a copy of its bytes."""
    if isinstance(state, torch.Tensor):
        return ZeroCopyTensor(state)
    if isinstance(state, Mapping):
        return {k: zero_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(zero_copy(v) for v in state)
    return state


def publish_staged(
    synchronizer: Any, staged: Any, step: int, *, timeout: float | None = 600.0
) -> bool:
    """Memory sync of ``staged``'s snapshot (a :class:`~obsckpt.slot_staging.StagedSave`) as ``step``.

    Holds the snapshot until the Synchronizer has it, so the slot's next save
    does not stage over it meanwhile. Returns what ``set_model_state_dict`` returns.
    """
    import ray

    with staged.hold(timeout) as snapshot:
        ref = synchronizer.set_model_state_dict.remote(zero_copy(snapshot), step)
        return bool(ray.get(ref, timeout=timeout))


def publish_staged_async(
    synchronizer: Any, staged: Any, step: int, *, timeout: float | None = 600.0
) -> Future:
    """:func:`publish_staged` on this process's publisher thread; training goes on meanwhile.

    Publishes run one at a time, in the order submitted. The snapshot is held
    from now on, so the slot's next save waits for the publish if it comes first.
    """
    global _publisher
    with _publisher_lock:
        if _publisher is None:
            _publisher = ThreadPoolExecutor(1, thread_name_prefix="obsckpt-publish")
    return _publisher.submit(publish_staged, synchronizer, staged, step, timeout=timeout)
