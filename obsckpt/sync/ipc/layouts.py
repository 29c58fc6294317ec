"""The ipc sender's layouts: how the trainer's tensors are laid out for the receiver at each sync.

Each sync is either ``direct`` (CUDA IPC handles of the trainer's own
storages, and each tensor's place in them) or ``buckets`` (the tensors packed
into bucket buffers of the sender's own, by :func:`~obsckpt.sync.buckets.plan_buckets`,
in device memory or shared-memory files). :class:`SenderLayouts` chooses
between them from a cheap fingerprint of the tensors, keeps the storages it
handed out and the buckets it allocated, and names each layout, so that a
layout the receiver holds travels as its id only. The sending itself (the
payload, the acknowledgement, the deadline) is :class:`~obsckpt.sync.ipc.IpcWeightSender`'s.
"""

from __future__ import annotations

import errno
import logging
import operator
import uuid
from dataclasses import dataclass
from typing import Any, cast

import torch

from obsckpt.errors import BroadcastError
from obsckpt.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    TensorMeta,
    plan_buckets,
    tensor_meta,
    validate_unique_names,
)
from obsckpt.sync.ipc import shm
from obsckpt.sync.ipc.payload import copy_many
from obsckpt.telemetry.metrics import CUDA_IPC, SHM

logger = logging.getLogger(__name__)

# The direct layout is kept while at least this share of the bytes lies in the
# same storages as at the sync before; below it the tensors are taken to be new
# at each sync, and the buckets are cheaper.
_DIRECT_MIN_KEPT = 0.9

_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_shape = operator.attrgetter("shape")
_dtype = operator.attrgetter("dtype")


@dataclass(slots=True)
class _Fingerprint:
    """What must stay the same for a layout to be reused: cheap to take, compared whole."""

    names: list[str]
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    ptrs: list[int]
    dense: list[bool]

    @classmethod
    def of(cls, names: list[str], tensors: list[torch.Tensor]) -> _Fingerprint:
        return cls(
            names,
            list(map(_shape, tensors)),
            list(map(_dtype, tensors)),
            list(map(_data_ptr, tensors)),
            list(map(_is_contiguous, tensors)),
        )

    def same_meta(self, other: _Fingerprint | None) -> bool:
        return (
            other is not None
            and self.names == other.names
            and self.shapes == other.shapes
            and self.dtypes == other.dtypes
        )

    def same_place(self, other: _Fingerprint | None) -> bool:
        """The same tensors at the same addresses, each dense: the same direct views."""
        return (
            other is not None
            and self.same_meta(other)
            and self.ptrs == other.ptrs
            and all(self.dense)
        )


@dataclass(slots=True)
class _Shared:
    """A storage of the trainer's whose handle the receiver holds (direct layout)."""

    sid: int
    storage: torch.UntypedStorage  # held until a sync no longer uses it


class SenderLayouts:
    """The trainer's tensors as the receiver sees them: each sync's layout, its storages, its buckets.

    Args:
        device: where the buckets live (a CUDA device for CUDA IPC; the CPU uses
            shared-memory files). Default: the current CUDA device, else CPU.
        bucket_bytes: bucket size; a tensor of at least this size gets a bucket alone.
        shm_dir: where the CPU fallback puts its shared-memory files.
        layout: ``"auto"``, ``"direct"`` (CUDA only) or ``"buckets"``.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        shm_dir: str | None = None,
        layout: str = "auto",
    ) -> None:
        if layout not in ("auto", "direct", "buckets"):
            raise ValueError(f"layout must be 'auto', 'direct' or 'buckets', got {layout!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = CUDA_IPC if self.device.type == "cuda" else SHM
        if layout == "direct" and self.backend != CUDA_IPC:
            raise ValueError(
                f"layout 'direct' hands out CUDA IPC handles of the tensors; on {self.device} "
                "use 'buckets' (or 'auto')"
            )
        self.layout = layout
        self.bucket_bytes = int(bucket_bytes)
        self.shm_dir = shm_dir or shm.default_dir()
        self._plan_key: tuple[Any, ...] | None = None
        self._plan: list[Bucket] = []
        self._buffers: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []  # per tensor, its place in a buffer
        self._alloc_gen = 0
        self._handles: tuple[Any, ...] = ()
        self._paths: list[str] = []
        self._fds: list[int] = []  # one per shared-memory file, holding a shared lock on it
        # The model's layout: its description, and the fingerprint it was taken from.
        self._fp: _Fingerprint | None = None
        self._meta: list[TensorMeta] = []
        self._meta_gen = 0
        self._wire: tuple[Any, ...] = ()
        self._sizes: list[int] = []
        self._nbytes = 0
        # What identifies the layout last described (kind, metadata, views or
        # buffers), and its id: this sender's token and a counter.
        self._layout_key: tuple[Any, ...] | None = None
        self._token = uuid.uuid4().hex[:12]
        self._layout_n = 0
        # direct layout: storages the receiver holds, by (address, size); held
        # here too, so no other storage can take their address meanwhile
        self._shared: dict[tuple[int, int], _Shared] = {}
        # the last direct sync's fingerprint and the fields it gave, while no
        # tensor had to be copied
        self._reuse: tuple[_Fingerprint, dict[str, Any]] | None = None
        self._next_sid = 0
        self._direct_failed = False
        # buckets layout: weak references to the last sync's storages, to see
        # whether the tensors stay in place
        self._previous: dict[tuple[int, int], Any] = {}

    @property
    def _layout_id(self) -> tuple[str, int]:
        """The id of the layout last named: what a payload that does not describe it names."""
        return (self._token, self._layout_n)

    def _take(self, names: list[str], tensors: list[torch.Tensor]) -> _Fingerprint:
        """Fingerprint this sync's tensors; describe them again only when their metadata changed."""
        fp = self._fingerprint(names, tensors)
        if not fp.same_meta(self._fp):  # described once per layout of the model, not per sync
            meta = tensor_meta(zip(names, tensors, strict=True))
            validate_unique_names(meta)
            if meta != self._meta:
                self._meta = meta
                self._meta_gen += 1
                self._wire = tuple(m.to_wire() for m in meta)
                self._sizes = [m.nbytes for m in meta]
                self._nbytes = sum(self._sizes)
        self._fp = fp
        return fp

    @staticmethod
    def _fingerprint(names: list[str], tensors: list[torch.Tensor]) -> _Fingerprint:
        try:
            return _Fingerprint.of(names, tensors)
        except (TypeError, AttributeError):
            for name, t in zip(names, tensors, strict=True):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(
                        f"{name!r} is a {type(t).__name__}, not a tensor; send a state dict "
                        "of tensors (gather DTensors with full_tensor() first)"
                    ) from None
            raise

    def _prepare(self, tensors: list[torch.Tensor], fp: _Fingerprint) -> tuple[str, dict[str, Any]]:
        """Choose this sync's layout and make the tensors ready to be read: ``(layout, direct fields)``."""
        direct: dict[str, Any] = {}
        if self._reuse is not None and self.layout != "buckets" and fp.same_place(self._reuse[0]):
            # The tensors of the last direct sync, where they were: its views.
            layout, direct = "direct", self._reuse[1]
        else:
            layout, storages, keys = self._choose_layout(tensors)
            if layout == "direct":
                try:
                    direct = self._share(tensors, storages, keys, fp)
                except RuntimeError as exc:  # e.g. memory CUDA cannot export
                    logger.warning(
                        "obsckpt: CUDA IPC cannot share the trainer's tensors (%s); "
                        "the ipc sync packs them into buckets from now on",
                        exc,
                    )
                    self._direct_failed = True
                    layout = "buckets"
        if layout == "buckets":
            self._forget_shared()
            self._pack(tensors)
        elif self.device.type == "cuda":
            # The receiver reads on its own stream: the tensors must be written first.
            torch.cuda.synchronize(self.device)
        self._name_layout(layout, direct)
        return layout, direct

    def _name_layout(self, layout: str, direct: dict[str, Any]) -> None:
        """A new layout id when what the receiver must be told has changed."""
        if layout == "buckets":
            key: tuple[Any, ...] = ("buckets", self._meta_gen, self._alloc_gen)
        else:
            key = ("direct", self._meta_gen, direct["views"])
        if key != self._layout_key:
            self._layout_key = key
            self._layout_n += 1

    def _describe_again(
        self, layout: str, tensors: list[torch.Tensor], fp: _Fingerprint
    ) -> dict[str, Any]:
        """The next payload describes the layout in full, every storage handed out afresh."""
        if layout != "direct":
            return {}  # the buckets' handles travel with the description
        self._forget_shared()
        direct = self._share(tensors, *_storages(tensors), fp)
        self._name_layout(layout, direct)
        return direct

    def _choose_layout(
        self, tensors: list[torch.Tensor]
    ) -> tuple[str, list[torch.UntypedStorage], list[tuple[int, int]]]:
        """``direct`` while the tensors stay in the same storages from sync to sync.

        Returns the layout and, for ``direct``, the tensors' storages and their
        ``(address, size)`` keys.
        """
        if self.backend != CUDA_IPC or self.layout == "buckets" or self._direct_failed:
            return "buckets", [], []
        from torch.multiprocessing.reductions import StorageWeakRef

        storages, keys = _storages(tensors)
        if self.layout == "direct" or not (self._shared or self._previous):
            return "direct", storages, keys  # forced, or the first sync: nothing to compare with
        if self._shared:  # direct last time: the storages it handed out are held
            kept = sum(n for k, n in zip(keys, self._sizes, strict=True) if k in self._shared)
        else:  # buckets last time: weak references to its storages
            previous, kept = self._previous, 0
            for k, n in zip(keys, self._sizes, strict=True):
                ref = previous.get(k)
                if ref is not None and not ref.expired():
                    kept += n
        if kept >= _DIRECT_MIN_KEPT * self._nbytes:
            self._previous = {}
            return "direct", storages, keys
        # Buckets: remember these storages, to compare with at the next sync.
        previous = self._previous
        self._previous = {}
        for k, st in zip(keys, storages, strict=True):
            ref = previous.get(k)
            self._previous[k] = ref if ref is not None and not ref.expired() else StorageWeakRef(st)
        return "buckets", [], []

    def _share(
        self,
        tensors: list[torch.Tensor],
        storages: list[torch.UntypedStorage],
        keys: list[tuple[int, int]],
        fp: _Fingerprint,
    ) -> dict[str, Any]:
        """The direct layout's fields: handles of storages new to the receiver, views, live ids."""
        if self._plan:  # the buckets of an earlier layout are not needed any more
            self._free()
            self._plan_key = None
        self._reuse = None
        held = self._shared
        shared: dict[tuple[int, int], _Shared] = {}
        new: list[tuple[int, Any]] = []
        views: list[tuple[int, int]] = []
        device = self.device
        copied = False
        for i, t in enumerate(tensors):
            st, key = storages[i], keys[i]
            if t.device != device or not t.is_contiguous():
                t = t.detach().to(device).contiguous()  # its storage is held in _shared
                copied = True
                st = t.untyped_storage()
                key = _storage_key(st)
            entry = shared.get(key) or held.get(key)
            if entry is None:
                entry = _Shared(self._next_sid, st)
                self._next_sid += 1
                new.append((entry.sid, self._share_storage(st)))
            shared[key] = entry
            views.append((entry.sid, int(t.storage_offset()) * t.element_size()))
        self._shared = shared
        live = tuple(sorted({e.sid for e in shared.values()}))
        fields = {"storages": tuple(new), "views": tuple(views), "live": live}
        if not copied:  # each tensor dense and on the device: the same views while they stay
            self._reuse = (fp, {"storages": (), "views": fields["views"], "live": live})
        return fields

    def _forget_shared(self) -> None:
        """Hand every storage out afresh at the next direct sync."""
        self._shared.clear()
        self._reuse = None

    def _share_storage(self, storage: torch.UntypedStorage) -> Any:
        """A CUDA IPC handle of a whole storage (torch's reduction of a byte tensor over it)."""
        from torch.multiprocessing.reductions import reduce_tensor

        whole = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
        return ("cuda", reduce_tensor(whole))

    def _pack(self, tensors: list[torch.Tensor]) -> None:
        key = (self.bucket_bytes, self._meta_gen)
        if key != self._plan_key:
            self._allocate(plan_buckets(self._meta, self.bucket_bytes))
            self._plan_key = key
        with torch.no_grad():
            copy_many(self._slots, tensors)
        if self.device.type == "cuda":
            # The receiver reads on its own stream: the buckets must be complete first.
            torch.cuda.synchronize(self.device)

    def _allocate(self, plan: list[Bucket]) -> None:
        self._free()
        if self.device.type != "cuda":
            shm.remove_orphaned_shm(self.shm_dir)
        self._plan = plan
        self._alloc_gen += 1
        try:
            self._allocate_buckets(plan)
        except BaseException:
            self._free()  # no file of a half-made plan stays behind
            self._plan_key = None
            raise

    def _allocate_buckets(self, plan: list[Bucket]) -> None:
        buffers: list[torch.Tensor] = []
        handles: list[tuple[Any, ...]] = []
        slots: list[torch.Tensor | None] = [None] * len(self._meta)
        for bucket in plan:
            size = max(bucket.nbytes, 1)
            if self.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                handles.append(("cuda", reduce_tensor(buf)))
            else:
                path = self._shm_file(size)
                buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                handles.append((SHM, path, size))
            buffers.append(buf)
            flat = buf[: bucket.nbytes].view(bucket.dtype)
            for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                m = self._meta[i]
                slots[i] = flat[off : off + m.numel].view(m.shape)
        self._buffers = buffers
        self._slots = cast(list[torch.Tensor], slots)  # the plan places every tensor
        self._handles = tuple(handles)

    def _shm_file(self, size: int) -> str:
        """A new shared-memory file of ``size`` bytes, share-locked while this sender holds it.

        The lock tells :func:`~obsckpt.sync.ipc.shm.remove_orphaned_shm` in
        another PID namespace (sharing this ``/dev/shm``) that the file's owner
        is alive.
        """
        try:
            path, fd = shm.create(self.shm_dir, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                raise BroadcastError(
                    f"ipc weight sync ({self.backend}): no room for a {size / 2**20:.1f} MiB "
                    f"bucket in {self.shm_dir} ({exc.strerror}; the buckets need "
                    f"{self._nbytes / 2**20:.1f} MiB in all). Enlarge it (docker --shm-size, "
                    "or the pod's /dev/shm emptyDir), or pass shm_dir= a larger directory"
                ) from exc
            raise
        self._paths.append(path)
        self._fds.append(fd)
        return path

    def _free(self) -> None:
        self._buffers = []
        self._slots = []
        self._handles = ()
        shm.remove(self._paths, self._fds)
        self._paths, self._fds = [], []

    def _release_layouts(self) -> None:
        """Free the buckets (and their files) and let go of every storage handed out."""
        self._free()
        self._plan_key = None
        self._forget_shared()
        self._previous.clear()

    def __del__(self) -> None:
        try:
            self._free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, int]:
    """What tells storages apart while they live: ``(address, size)``."""
    return storage.data_ptr(), storage.nbytes()


def _storages(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.UntypedStorage], list[tuple[int, int]]]:
    """The tensors' storages and their keys."""
    storages = [t.untyped_storage() for t in tensors]
    return storages, list(map(_storage_key, storages))
