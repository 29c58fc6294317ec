"""Walking a (nested) state dict: the tensors staging copies, the storages the writer writes.

DTensor and FSDP1's ShardedTensor leaves are recognised only once their
modules are loaded (see :func:`dtensor_type`). :class:`StoragePacker` finds
the small storages the writer packs into one storage per dtype.
"""

from __future__ import annotations

import ctypes
import pickle
import sys
import types
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

# Storages smaller than this are packed into one storage per dtype (see
# StoragePacker): a record of their own would cost up to a page of alignment each.
# At 64 KiB a page is at most 6% of a storage kept apart, and the copy into
# the pack costs less than the records it saves (docs/performance.md).
PACK_MAX = 64 << 10
# Where a packed storage starts in its pack: torch's own record alignment for
# storages that fill a cache line, 16 bytes (any dtype's size) below that.
_PACK_ALIGN = 64
_PACK_ALIGN_TINY = 16
# Never packed: RNG and generator states are uint8 tensors, and torch's setters
# (torch.set_rng_state, torch.cuda.set_rng_state, Generator.set_state) read a
# state's storage from its start, whatever the tensor's offset: loaded back as a
# view into a pack, a state would restore another tensor's bytes (or crash).
_NEVER_PACKED = (torch.uint8,)


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


def _packable(t: Any) -> bool:
    """Whether ``t`` is a tensor ``torch.save`` would pickle as a plain view of a CPU storage."""
    return (
        type(t) is torch.Tensor
        and t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.is_quantized
        and not t.is_nested
        and not t._backward_hooks
        and not torch._utils._get_obj_state(t)
    )


class _NullFile:
    def write(self, data: Any) -> int:
        return len(data)


def _offset_dtensor_reduction(o: Any) -> Any:
    """How ``torch.save`` pickles a DTensor at offset 0, for one at another offset;
    ``NotImplemented`` for anything else (pickled as torch pickles it).

    A DTensor takes its local tensor's storage offset, and torch pickles it
    without its storage (a wrapper's, which has no data) only while its
    ``data_ptr()``, that offset in bytes, is 0. Over a local tensor at
    another offset (a view into a packed storage once loaded, or into a
    staging buffer shared with other tensors) torch would pickle that
    storage and fail ("invalid python storage"). The local tensor, in the
    DTensor's state, keeps its own offset.
    """
    dtensor = dtensor_type()
    if dtensor is None or type(o) is not dtensor or not o.storage_offset():
        return NotImplemented
    o._clear_non_serializable_cached_data()
    args = (type(o), o.dtype, tuple(o.size()), o.stride(), 0, o.layout, o.device, o.requires_grad)
    rebuild = torch._utils._rebuild_wrapper_subclass
    state = torch._utils._get_obj_state(o)
    return (torch._tensor._rebuild_from_type_v2, (rebuild, type(o), args, state))


class _StorageFinder(pickle.Pickler):
    """Pickles an object into nothing to find the storages of its plain tensors.

    A class of the module, not of a call, with what it finds on the instance:
    a class is a reference cycle, and one holding the storages (staging
    buffers) would keep them mapped until the collector runs.
    """

    def __init__(self) -> None:
        super().__init__(_NullFile(), protocol=torch.serialization.DEFAULT_PROTOCOL)
        # storage -> (the storage, the dtypes of the plain tensors seen over it)
        self.found: dict[int, tuple[torch.UntypedStorage, set[torch.dtype]]] = {}
        self.shared: set[int] = set()  # storages also pickled other than by a plain tensor

    def reducer_override(self, o: Any) -> Any:
        if _packable(o):
            storage = o.untyped_storage()
            self.found.setdefault(storage._cdata, (storage, set()))[1].add(o.dtype)
            return (int, ())
        if isinstance(o, np.ndarray) and not o.dtype.hasobject:
            return (int, ())  # holds no tensor: its bytes need no copy here
        return _offset_dtensor_reduction(o)

    def persistent_id(self, o: Any) -> Any:
        if isinstance(o, torch.storage.TypedStorage):
            self.shared.add(o._untyped_storage._cdata)
            return 0
        if torch.is_storage(o):
            self.shared.add(o._cdata)
            return 0
        return None


class _PackedPickler(pickle.Pickler):
    """Writes each tensor of a packed storage over its pack (see StoragePacker.pickle_module)."""

    # storage -> (its pack, element offset); set on the subclass made for each save
    places: dict[int, tuple[Any, int]] = {}

    def reducer_override(self, o: Any) -> Any:
        place = None
        if type(o) is torch.Tensor and self.places and _packable(o):
            place = self.places.get(o.untyped_storage()._cdata)
        if place is None:
            return _offset_dtensor_reduction(o)
        storage, offset = place
        args: tuple[Any, ...] = (
            storage,
            offset + o.storage_offset(),
            tuple(o.size()),
            o.stride(),
            o.requires_grad,
            OrderedDict(),
        )
        rebuild: Any = torch._utils._rebuild_tensor_v2
        if isinstance(storage, torch.UntypedStorage):
            rebuild = torch._utils._rebuild_tensor_v3
            args += (o.dtype,)
        metadata = torch._utils.get_tensor_metadata(o)
        if metadata:
            args += (metadata,)
        return (rebuild, args)


class StoragePacker:
    """The small storages of an object, copied into one packed storage per dtype.

    A first pass pickles the object into nothing to find every storage and
    how it is referenced; a storage smaller than :data:`PACK_MAX`, seen only
    through plain tensors of one dtype, is copied into its dtype's pack.
    :meth:`pickle_module` then hands ``torch.save`` a pickler that writes
    each tensor of such a storage as ``torch.save`` would (the same rebuild
    function and arguments, so ``weights_only`` loads accept it) but over
    the pack, at the storage's offset in it. :meth:`close` lets go of the
    packs once the object is written.
    """

    def __init__(self, obj: Any) -> None:
        finder = _StorageFinder()
        finder.dump(obj)
        found, shared = finder.found, finder.shared
        del finder  # its memo holds every object pickled
        self.places: dict[int, tuple[Any, int]] = {}  # storage -> (its pack, element offset)
        self.packs: list[torch.Tensor] = []
        layout: dict[torch.dtype, list[tuple[torch.UntypedStorage, int]]] = {}
        ends: dict[torch.dtype, int] = {}
        for cdata, (small, dtypes) in found.items():
            nbytes = small.nbytes()
            if cdata in shared or len(dtypes) != 1 or nbytes >= PACK_MAX:
                continue
            (dtype,) = dtypes
            if dtype in _NEVER_PACKED:
                continue
            align = _PACK_ALIGN if nbytes >= _PACK_ALIGN else _PACK_ALIGN_TINY
            offset = -(-ends.get(dtype, 0) // align) * align
            layout.setdefault(dtype, []).append((small, offset))
            ends[dtype] = offset + nbytes
        for dtype, members in layout.items():
            itemsize = dtype.itemsize
            pack = torch.empty(-(-ends[dtype] // itemsize) * itemsize, dtype=torch.uint8)
            if dtype in torch.storage._new_dtypes():  # torch pickles these untyped
                storage: Any = pack.untyped_storage()
            else:
                storage = torch.storage.TypedStorage(
                    wrap_storage=pack.untyped_storage(), dtype=dtype, _internal=True
                )
            base = pack.data_ptr()
            for member, offset in members:
                if member.nbytes():
                    ctypes.memmove(base + offset, member.data_ptr(), member.nbytes())
                self.places[member._cdata] = (storage, offset // itemsize)
            self.packs.append(pack)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.packs)

    def pickle_module(self) -> types.ModuleType:
        """A stand-in for :mod:`pickle` whose ``Pickler`` writes packed tensors over their pack.

        The pickler is a class of its own (``torch.save`` subclasses it), a
        reference cycle: it holds this packer's ``places``, which
        :meth:`close` empties.
        """
        module = types.ModuleType("obsckpt_packed_pickle")
        pickler = type("Pickler", (_PackedPickler,), {"places": self.places})
        module.Pickler = pickler  # type: ignore[attr-defined]
        return module

    def close(self) -> None:
        """Let go of the packs (the object is written): the picklers made for it may live on."""
        self.places.clear()
        self.packs.clear()
