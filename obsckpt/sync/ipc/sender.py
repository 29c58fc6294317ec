"""Trainer side of the colocated sync: hands out handles to its tensors or buckets."""

from __future__ import annotations

import errno
import fcntl
import logging
import operator
import os
import re
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from obsckpt.errors import BroadcastError, BroadcastTimeoutError, IpcLayoutUnknownError
from obsckpt.sync.broadcast import BroadcastResult
from obsckpt.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    TensorMeta,
    check_unique_names,
    plan_buckets,
    tensor_meta,
)
from obsckpt.sync.group import DEFAULT_TIMEOUT_S, check_newer_step
from obsckpt.sync.ipc import streams
from obsckpt.sync.ipc.payload import METHOD, PAYLOAD_VERSION, IpcPayload, copy_many, device_uuid
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.telemetry import tracing

logger = logging.getLogger(__name__)

# The direct layout is kept while at least this share of the bytes lies in the
# same storages as at the sync before; below it the tensors are taken to be new
# at each sync, and the buckets are cheaper.
_DIRECT_MIN_KEPT = 0.9

# The CPU fallback's shared-memory files: obsckpt-ipc-<pid>-<uuid hex>.
_SHM_PREFIX = "obsckpt-ipc-"
_SHM_NAME = re.compile(r"^obsckpt-ipc-(\d+)-[0-9a-f]{32}$")

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


class IpcWeightSender:
    """Trainer side of the colocated sync: hands out handles to its tensors or buckets.

    Args:
        device: where the buckets live (a CUDA device for CUDA IPC; the CPU uses
            shared-memory files). Default: the current CUDA device, else CPU.
        bucket_bytes: bucket size; a tensor of at least this size gets a bucket alone.
        timeout_s: bound on one sync, acknowledgement included.
        metrics: an :class:`obsckpt.telemetry.metrics.Metrics` to record into.
        monitor: the monitor actor handle, to record through its RPCs.
        shm_dir: where the CPU fallback puts its shared-memory files.
        layout: ``"auto"`` (default: ``direct`` on CUDA while the tensors stay in
            place, else ``buckets``), ``"direct"`` (CUDA only) or ``"buckets"``.
    """

    def __init__(
        self,
        *,
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        metrics: Any = None,
        monitor: Any = None,
        shm_dir: str | None = None,
        layout: str = "auto",
    ) -> None:
        if layout not in ("auto", "direct", "buckets"):
            raise ValueError(f"layout must be 'auto', 'direct' or 'buckets', got {layout!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds, got {timeout_s!r}")
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend = "cuda_ipc" if self.device.type == "cuda" else "shm"
        if layout == "direct" and self.backend != "cuda_ipc":
            raise ValueError(
                f"layout 'direct' hands out CUDA IPC handles of the tensors; on {self.device} "
                "use 'buckets' (or 'auto')"
            )
        self.layout = layout
        self.last_layout: str | None = None
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.telemetry = WeightSyncTelemetry(metrics=metrics, monitor=monitor)
        default_shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.shm_dir = shm_dir or default_shm
        self._plan_key: tuple[Any, ...] | None = None
        self._plan: list[Bucket] = []
        self._buffers: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []  # per tensor, its place in a buffer
        self._alloc_gen = 0
        self._handles: tuple[Any, ...] = ()
        self._paths: list[str] = []
        self._fds: list[int] = []  # one per shared-memory file, holding a shared lock on it
        self._uuid = device_uuid(self.device)
        self.last_step: int | None = None
        # The model's layout: its description, and the fingerprint it was taken from.
        self._fp: _Fingerprint | None = None
        self._meta: list[TensorMeta] = []
        self._meta_gen = 0
        self._wire: tuple[Any, ...] = ()
        self._sizes: list[int] = []
        self._nbytes = 0
        # What identifies the layout last described (kind, metadata, views or
        # buffers), its id, and the id the receiver acknowledged last.
        self._layout_key: tuple[Any, ...] | None = None
        self._token = uuid.uuid4().hex[:12]
        self._layout_n = 0
        self._acked_id: tuple[str, int] | None = None
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
        # The receiver's copy-done event (its token, the event opened here), once
        # a receiver with recv(wait=False) has handed it over.
        self._done: tuple[str, Any] | None = None

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        deliver: Callable[[IpcPayload], Any],
        *,
        step: int,
        trace_context: Mapping[str, str] | None = None,
    ) -> BroadcastResult:
        """Hand over the tensors (or pack them), ``deliver`` the payload, wait for the answer.

        ``deliver`` returns the receiver's acknowledgement, or a Ray
        ``ObjectRef`` of it (e.g. ``lambda p: rollout.receive_ipc.remote(p)``);
        the receiver's :meth:`IpcWeightReceiver.recv` returns what it needs.

        Raises:
            ValueError: ``step`` is not newer than the last step sent.
            TypeError: a value is not a tensor.
            BroadcastTimeoutError: no acknowledgement within ``timeout_s``.
            BroadcastError: the receiver failed or refused the payload.
        """
        check_newer_step(step, self.last_step)
        if isinstance(named_tensors, Mapping):
            names, tensors = list(named_tensors.keys()), list(named_tensors.values())
        else:
            pairs = list(named_tensors)
            names, tensors = [n for n, _ in pairs], [t for _, t in pairs]
        fp = self._fingerprint(names, tensors)
        if not fp.same_meta(self._fp):  # described once per layout of the model, not per sync
            meta = tensor_meta(zip(names, tensors, strict=True))
            check_unique_names(meta)
            if meta != self._meta:
                self._meta = meta
                self._meta_gen += 1
                self._wire = tuple(m.to_wire() for m in meta)
                self._sizes = [m.nbytes for m in meta]
                self._nbytes = sum(self._sizes)
        self._fp = fp
        nbytes = self._nbytes
        attrs = {"obsckpt.step": step, "obsckpt.bytes": nbytes, "obsckpt.method": METHOD}
        payload: IpcPayload | None = None
        try:
            with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
                sp.set_attribute("obsckpt.backend", self.backend)
                t0 = time.perf_counter()
                # The receiver's deadline is the sender's: set before any work.
                deadline = time.monotonic() + self.timeout_s
                layout, direct = self._prepare(tensors, fp)
                sp.set_attribute("obsckpt.ipc_layout", layout)
                payload = self._payload(step, layout, direct, deadline)
                try:
                    ack = self._await(deliver(payload), deadline)
                except IpcLayoutUnknownError as exc:
                    if payload.described:
                        raise
                    # The receiver does not hold the layout (a restarted rollout):
                    # describe it again, within the same deadline.
                    logger.info("obsckpt: %s; describing the layout again", exc)
                    sp.set_attribute("obsckpt.ipc_described_again", True)
                    direct = self._describe_again(layout, tensors, fp)
                    payload = self._payload(step, layout, direct, deadline)
                    ack = self._await(deliver(payload), deadline)
                if not isinstance(ack, Mapping) or ack.get("step") != step:
                    raise BroadcastError(
                        f"the rollout side answered {ack!r} to the weights of step {step}; "
                        "it must return IpcWeightReceiver.recv's acknowledgement"
                    )
                self._wait_copied(ack, deadline)
                seconds = time.perf_counter() - t0
        except BaseException as exc:
            # A receiver answering before its copy finishes may still be copying:
            # later work on this stream (the optimizer's writes) waits for it.
            self._order_after_copy(payload, exc)
            # The receiver may not have opened this sync's storages, nor hold its
            # layout: the next sync describes it again and hands every storage out
            # afresh (under new ids).
            self._forget_shared()
            self._acked_id = None
            if isinstance(exc, BroadcastError) and self.telemetry:
                self.telemetry.failure(self.backend, METHOD, exc)
            raise
        self._acked_id = payload.layout_id
        self.last_step = step
        self.last_layout = layout
        self.telemetry.broadcast(self.backend, seconds, nbytes, METHOD)
        handles = len(self._plan) if layout == "buckets" else len(payload.storages)
        return BroadcastResult(seconds, nbytes, len(names), handles, self.backend, METHOD)

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
        self._acked_id = None
        if layout != "direct":
            return {}  # the buckets' handles travel with the description
        self._forget_shared()
        direct = self._share(tensors, *_storages(tensors), fp)
        self._name_layout(layout, direct)
        return direct

    def _payload(
        self, step: int, layout: str, direct: dict[str, Any], deadline: float
    ) -> IpcPayload:
        """This sync's payload: the layout described only where the receiver lacks it."""
        common: dict[str, Any] = dict(
            version=PAYLOAD_VERSION,
            step=step,
            backend=self.backend,
            bucket_bytes=self.bucket_bytes,
            deadline=deadline,
            device_uuid=self._uuid,
            trace_context=tracing.inject() or None,
            layout=layout,
            layout_id=(self._token, self._layout_n),
            nbytes=self._nbytes,
            ack_event=self._done[0] if self._done is not None else None,
        )
        if self._acked_id == common["layout_id"]:
            return IpcPayload(meta=(), handles=(), described=False, **common)
        handles = self._handles if layout == "buckets" else ()
        return IpcPayload(meta=self._wire, handles=handles, **direct, **common)

    def _choose_layout(
        self, tensors: list[torch.Tensor]
    ) -> tuple[str, list[torch.UntypedStorage], list[tuple[int, int]]]:
        """``direct`` while the tensors stay in the same storages from sync to sync.

        Returns the layout and, for ``direct``, the tensors' storages and their
        ``(address, size)`` keys.
        """
        if self.backend != "cuda_ipc" or self.layout == "buckets" or self._direct_failed:
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
            remove_orphaned_shm(self.shm_dir)
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
                handles.append(("shm", path, size))
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

        The lock tells :func:`remove_orphaned_shm` in another PID namespace
        (sharing this ``/dev/shm``) that the file's owner is alive.
        """
        path = os.path.join(self.shm_dir, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            # Reserve the pages now: a sparse file on a full tmpfs (Docker's 64 MiB
            # /dev/shm) would kill this process with SIGBUS at the first write.
            os.posix_fallocate(fd, 0, size)
        except BaseException as exc:
            os.close(fd)
            os.unlink(path)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG):
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

    def _await(self, answer: Any, deadline: float) -> Any:
        try:
            import ray
        except ImportError:  # pragma: no cover - ray is a dependency
            return answer
        if not isinstance(answer, ray.ObjectRef):
            return answer
        remaining = max(deadline - time.monotonic(), 0.001)
        try:
            return ray.get(answer, timeout=remaining)
        except ray.exceptions.GetTimeoutError as exc:
            raise BroadcastTimeoutError(
                f"ipc weight sync ({self.backend}, {len(self._plan)} buckets) did not finish "
                f"within {self.timeout_s:.1f} s: the rollout side did not acknowledge it; it "
                "will refuse the payload if it reads it later"
            ) from exc
        except ray.exceptions.RayError as exc:
            if isinstance(exc, IpcLayoutUnknownError) or isinstance(
                getattr(exc, "cause", None), IpcLayoutUnknownError
            ):
                raise IpcLayoutUnknownError(str(getattr(exc, "cause", None) or exc)) from exc
            raise BroadcastError(
                f"ipc weight sync ({self.backend}) failed on the rollout side: {exc}"
            ) from exc

    def _wait_copied(self, ack: Mapping[str, Any], deadline: float) -> None:
        """Return once the receiver's copy has finished (within ``deadline``, monotonic).

        An acknowledgement without ``event`` comes after the copy. One with the
        receiver's event and its handle also does (its first sync with this
        sender): the handle is opened, for the later syncs, whose
        acknowledgements name the event only and may come while it copies.
        """
        event = ack.get("event")
        if event is None:
            return
        token, handle = event
        if handle is not None:
            self._done = (token, streams.open_event(self.device, handle))
            return
        if self._done is None or self._done[0] != token:
            raise BroadcastError(
                f"the rollout side answered with copy-done event {token!r}, which it never "
                "handed to this sender; sender and receiver disagree on the protocol"
            )
        done, start = self._done[1], time.monotonic()
        while not done.query():
            now = time.monotonic()
            if now >= deadline:
                raise BroadcastTimeoutError(
                    f"ipc weight sync ({self.backend}): the rollout queued its copy, which "
                    f"had not finished within {self.timeout_s:.1f} s; this device's current "
                    "stream now waits for it"
                )
            # Spin for the first milliseconds (a copy takes about that long), then nap.
            time.sleep(0 if now - start < 0.005 else 0.0001)

    def _order_after_copy(self, payload: IpcPayload | None, exc: BaseException) -> None:
        """After a failed sync, queue a wait for the receiver's copy-done event on this stream.

        The receiver records the event before it checks the deadline and answers,
        so a copy it accepted is ordered before anything this stream does after
        the failure. Not when the receiver is known to be gone (its event with it).
        """
        if payload is None or self._done is None or payload.ack_event != self._done[0]:
            return
        if _receiver_gone(exc):
            return
        try:
            self._done[1].wait(streams.current_stream(self.device))
        except Exception as err:  # noqa: BLE001 - the sync's own error is the one to raise
            logger.warning("obsckpt: could not order this stream after the rollout's copy: %s", err)

    def _free(self) -> None:
        self._buffers = []
        self._slots = []
        self._handles = ()
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def close(self) -> None:
        """Free the buckets (and their shared-memory files)."""
        self._free()
        self._plan_key = None
        self._forget_shared()
        self._previous.clear()
        self._done = None
        self.telemetry.flush(10.0)

    def __del__(self) -> None:
        try:
            self._free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def remove_orphaned_shm(shm_dir: str) -> list[str]:
    """Remove the shared-memory files of senders whose process is gone (a killed trainer).

    A file is removed only when no process of its PID runs on this host and
    no process holds its lock (a live sender keeps one on each of its files,
    which also covers a sender in another PID namespace sharing the directory).
    Returns the paths removed.
    """
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        m = _SHM_NAME.match(name)
        if m is None or _pid_alive(int(m.group(1))):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:
            continue  # locked: its sender is alive
        finally:
            os.close(fd)
    if removed:
        logger.info(
            "obsckpt: removed %d shared-memory files of ipc senders that are gone: %s",
            len(removed),
            removed,
        )
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def _storage_key(storage: torch.UntypedStorage) -> tuple[int, int]:
    """What tells storages apart while they live: ``(address, size)``."""
    return storage.data_ptr(), storage.nbytes()


def _storages(
    tensors: list[torch.Tensor],
) -> tuple[list[torch.UntypedStorage], list[tuple[int, int]]]:
    """The tensors' storages and their keys."""
    storages = [t.untyped_storage() for t in tensors]
    return storages, list(map(_storage_key, storages))


def _receiver_gone(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the rollout's process or actor died."""
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, ray.exceptions.RayActorError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
