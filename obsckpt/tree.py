"""Walking a (nested) state dict: the tensors staging copies, the storages the writer writes.

DTensor and FSDP1's ShardedTensor leaves are recognised only once their
modules are loaded (see :func:`dtensor_type`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def dtensor_type() -> type[Any] | None:
    """DTensor, if its module is loaded; a state dict with DTensors has loaded it.

    Importing ``torch.distributed.tensor`` here would pull in sympy, seconds
    of the first save's stall for a state dict that has no DTensor at all.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


# Leaves that are plain tensors (not DTensor, ShardedTensor or another subclass).
PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def sharded_tensor_type() -> type[Any] | None:
    """FSDP1's ShardedTensor, if its module is loaded (a state dict holding one has loaded it)."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return getattr(module, "ShardedTensor", None)


def local_tensor(obj: Any) -> Any:
    """A DTensor's local shard; any other object as it is."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        return obj.to_local()
    return obj


def tensor_leaves(obj: Any, out: list[tuple[str, torch.Tensor]], key: str = "") -> None:
    """The tensors :meth:`StagingBuffers.plan` stages, in its order, with their keys."""
    if type(obj) in PLAIN_TENSORS:  # the common leaf, without the subclass lookups
        out.append((key, obj.detach()))
        return
    obj = local_tensor(obj)
    sharded = sharded_tensor_type()
    if sharded is not None and isinstance(obj, sharded):
        # A tensor subclass whose ops run shard by shard: staged through its
        # local shards, never as one global-shaped tensor.
        for i, shard in enumerate(obj.local_shards()):
            out.append((f"{key}.shard{i}", shard.tensor.detach()))
    elif isinstance(obj, torch.Tensor):
        out.append((key, obj.detach()))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensor_leaves(v, out, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        for i, v in enumerate(obj):
            tensor_leaves(v, out, f"{key}.{i}" if key else str(i))


def cpu_storages(obj: Any) -> dict[int, int]:
    """Data address -> bytes of the CPU tensors' storages in a (nested) state dict."""
    found: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        item = local_tensor(item)
        sharded = sharded_tensor_type()
        if sharded is not None and isinstance(item, sharded):
            stack.extend(shard.tensor for shard in item.local_shards())
        elif isinstance(item, torch.Tensor):
            if item.device.type == "cpu":
                storage = item.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found
