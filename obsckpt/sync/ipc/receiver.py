"""Rollout side of the colocated sync: maps the sender's tensors, copies the weights out."""

from __future__ import annotations

import logging
import operator
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple, TypeAlias, cast

import torch

from obsckpt.errors import BroadcastError, BroadcastTimeoutError, IpcLayoutUnknownError
from obsckpt.sync.buckets import TensorMeta, plan_buckets
from obsckpt.sync.ipc import streams
from obsckpt.sync.ipc.payload import METHOD, PAYLOAD_VERSION, IpcPayload, copy_many, device_uuid
from obsckpt.sync.wire import is_stale_step
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing
from obsckpt.telemetry.metrics import CUDA_IPC, SHM

logger = logging.getLogger(__name__)

_shape = operator.attrgetter("shape")
_data_ptr = torch.Tensor.data_ptr
# The tensors to copy into, the dict recv() returns, and the CUDA devices they are on.
_Targets: TypeAlias = "tuple[list[torch.Tensor], dict[str, torch.Tensor], set[torch.device]]"


class IpcWeightReceiver:
    """Rollout side of the colocated sync: maps the sender's buckets, copies the weights out.

    Args:
        device: where the received weights live (default: the current CUDA
            device for CUDA IPC payloads, else the CPU).
    """

    def __init__(self, *, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._opened: dict[Any, torch.Tensor] = {}  # buckets layout, by handle
        self._storages: dict[int, torch.Tensor] = {}  # direct layout, by storage id
        self._views: dict[tuple[Any, ...], torch.Tensor] = {}  # direct layout: views into them
        self._area: dict[str, torch.Tensor] = {}
        # The layout held: its id and kind, its metadata (parsed), and the
        # sender's tensors it locates.
        self._held: tuple[Any, str] | None = None
        self._wire: tuple[Any, ...] = ()
        self._meta: list[TensorMeta] = []
        self._sources: list[torch.Tensor] = []
        # Where the weights are copied to: the area's or into='s tensors, the
        # dict returned, the CUDA devices to synchronize, and what they came from.
        self._targets: _Targets | None = None
        self._targets_key: _IntoKey | None = None
        # The copies as one CUDA graph, once a second sync copies between the very
        # same targets and sources: (targets, sources, the targets' addresses, graph).
        # _graphs False: capture failed here once, copy_many from then on.
        self._graph: tuple[list[torch.Tensor], list[torch.Tensor], list[int], Any] | None = None
        self._last_pair: tuple[int, int] | None = None
        self._graphs = True
        # recv(wait=False): an interprocess event recorded after each copy, on
        # its device, with the token that names it to the sender.
        self._done: tuple[torch.device, Any, str] | None = None
        self.last_step: int | None = None
        self.last_seconds: float | None = None
        self.last_copy_seconds: float | None = None  # from queueing the copy to its wait
        # False while the receive area or into='s tensors hold bytes of a sync that
        # was refused or failed after its copy began (not a known version); True
        # again after the next sync accepted into them.
        self.weights_valid = True

    def recv(
        self,
        payload: IpcPayload,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        clone: bool = False,
        wait: bool = True,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Take the weights of ``payload``: ``(acknowledgement, {name: tensor})``.

        The tensors are this receiver's own (the sender's buffers are reused):
        by default a receive area overwritten in place by the next sync;
        ``clone=True`` gives fresh tensors; ``into`` fills the given tensors.
        Return the acknowledgement to the sender.

        ``wait=False`` (CUDA IPC, weights on one GPU): return once the copy is
        queued on the current stream, without waiting for it. Work queued on
        that stream afterwards (the rollout's next forward pass) sees the new
        weights; work on other streams, or on the host, must wait for the
        stream first. The acknowledgement then names an interprocess CUDA
        event recorded after the copy, which the sender waits for, so the
        copy overlaps the answer's way back. The first sync with a sender
        waits as with ``wait=True`` (its answer hands the sender the event).

        A payload that arrives after the sender's deadline is refused before
        anything is copied. One whose copy ends (or, with ``wait=False``, is
        queued) after it is refused too, but the copy has by then written the
        receive area or ``into``'s tensors: they hold step N's bytes, which
        the sender may have been rewriting meanwhile. :attr:`weights_valid`
        is then False and :attr:`last_step` stays, until the next accepted
        sync overwrites them whole. (Copying into a second buffer first would
        double the memory the direct layout saves.) With ``clone=True`` the
        held weights are not touched.

        Raises:
            BroadcastError: an older step, a payload from another obsckpt,
                another device, or a layout this receiver was never sent.
            BroadcastTimeoutError: the payload arrived, or its copy ended (was
                queued, with ``wait=False``), after the sender's deadline.
        """
        t0 = time.perf_counter()
        attrs = {span_attr.STEP: payload.step, span_attr.METHOD: METHOD}
        with tracing.span(
            "obsckpt.broadcast", carrier=payload.trace_context, attributes=attrs
        ) as sp:
            sp.set_attribute(span_attr.BACKEND, payload.backend)
            if payload.version != PAYLOAD_VERSION:
                raise BroadcastError(
                    f"unsupported ipc payload version {payload.version}; run the same obsckpt "
                    "version on both sides"
                )
            if is_stale_step(payload.step, self.last_step):
                raise BroadcastError(
                    f"refusing the weights of step {payload.step}: this rollout already holds "
                    f"step {self.last_step} and versions never go backwards"
                )
            self._check_deadline(payload, "arrived")
            sp.set_attribute(span_attr.BYTES, payload.nbytes)
            sp.set_attribute(span_attr.IPC_LAYOUT, payload.layout)
            if payload.described:
                self._take_layout(payload)
            elif self._held != (payload.layout_id, payload.layout):
                raise IpcLayoutUnknownError(
                    f"the weights of step {payload.step} name layout {payload.layout_id} "
                    f"({payload.layout}), which this rollout was never sent (it holds "
                    f"{self._held}); the sender describes the layout again"
                )
            dsts, out, devices = self._targets_for(into, clone)
            ack: dict[str, Any] = {"step": payload.step, "nbytes": payload.nbytes}
            t_copy = time.perf_counter()
            queued = False
            try:
                with torch.no_grad():
                    self._copy(dsts, self._sources, devices, stable=not clone)
                if not wait and payload.backend == CUDA_IPC and len(devices) == 1:
                    (device,) = devices
                    event, token = self._done_event(device)
                    event.record(streams.current_stream(device))
                    if payload.ack_event == token:  # the sender holds the event: it waits for it
                        ack["event"], queued = (token, None), True
                    else:
                        ack["event"] = (token, event.ipc_handle())
                if not queued:
                    for d in devices:  # the copies ran on each device's current stream: wait
                        streams.current_stream(d).synchronize()
                self.last_copy_seconds = time.perf_counter() - t_copy
                # Copied (or queued) after the deadline: the sender may have begun rewriting
                # its tensors. (It orders its own stream after the event when it gives up.)
                self._check_deadline(
                    payload,
                    "was queued" if queued else "was copied",
                    None if clone else into is not None,
                )
            except BaseException:
                if not clone:  # the copy wrote (or is writing) the held weights
                    self.weights_valid = False
                raise
            sp.set_attribute(span_attr.IPC_QUEUED, queued)
            self.last_step = payload.step
            if not clone:
                self.weights_valid = True
            self.last_seconds = time.perf_counter() - t0
        return ack, dict(out)

    def _copy(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        devices: set[torch.device],
        *,
        stable: bool,
    ) -> None:
        """``copy_many(dsts, srcs)``, queued on the current stream.

        On one CUDA device, the second sync in a row between the very same
        target and source lists (``stable``: the receive area or the same
        ``into=`` tensors, the same layout) captures the copies as a CUDA
        graph, which the later syncs replay: one launch instead of one per
        tensor, and the copies run back to back. The graph keeps those lists,
        and so their tensors; it is dropped when a sync copies between others,
        when a target no longer holds the memory it was captured with, and
        when the layout changes.
        """
        graph = self._graph
        if graph is not None:
            # The very same lists, and each target still over the memory captured (a
            # caller may have given a tensor other memory: param.data = ..., set_()).
            if graph[0] is dsts and graph[1] is srcs and list(map(_data_ptr, dsts)) == graph[2]:
                graph[3].replay()
                return
            self._graph = self._last_pair = None  # copied one by one, captured again next
        pair = (id(dsts), id(srcs))
        if stable and self._graphs and pair == self._last_pair and len(devices) == 1:
            (device,) = devices
            if streams.graphs_on(device) and _plain_copies(dsts, srcs, device):
                try:
                    captured = streams.capture_copies(device, dsts, srcs)
                except Exception as exc:  # noqa: BLE001 - the copies still run, one by one
                    self._graphs = False
                    logger.info(
                        "obsckpt: the ipc receiver copies tensor by tensor: capturing its "
                        "copies as a CUDA graph failed (%s: %s)",
                        type(exc).__name__,
                        exc,
                    )
                else:
                    self._graph = (dsts, srcs, list(map(_data_ptr, dsts)), captured)
                    captured.replay()
                    return
        self._last_pair = pair if stable else None
        copy_many(dsts, srcs)

    def _done_event(self, device: torch.device) -> tuple[Any, str]:
        """The interprocess event recorded after each copy on ``device``, and its token."""
        if self._done is None or self._done[0] != device:
            self._done = (device, streams.new_event(), uuid.uuid4().hex[:12])
        return self._done[1], self._done[2]

    def _take_layout(self, payload: IpcPayload) -> None:
        """Parse a described layout and locate the sender's tensors (kept for later payloads)."""
        self._held = None
        self._targets = None  # new sources: the targets are listed again
        self._graph = self._last_pair = None  # nor may a graph keep the old ones open
        if payload.meta != self._wire:  # parsed once per layout of the model
            self._meta = [TensorMeta.from_wire(m) for m in payload.meta]
            self._wire = payload.meta
            # The receive area holds a tensor per name: one the model no longer sends
            # would stay allocated for the rest of the job.
            names = {m.name for m in self._meta}
            for name in [n for n in self._area if n not in names]:
                del self._area[name]
        meta = self._meta
        self._sources = []
        if payload.layout == "direct":
            self._opened.clear()  # no bucket of an earlier layout is used any more
            sources = self._direct_sources(payload, meta)
        elif payload.layout == "buckets":
            self._drop_storages(())
            plan = plan_buckets(meta, payload.bucket_bytes)
            if len(plan) != len(payload.handles):
                raise BroadcastError(
                    f"the payload has {len(payload.handles)} buckets, its metadata plans "
                    f"{len(plan)}; sender and receiver disagree on the protocol"
                )
            slots: list[torch.Tensor | None] = [None] * len(meta)
            keys = set()
            for bucket, handle in zip(plan, payload.handles, strict=True):
                key, buf = self._open(handle, payload)
                keys.add(key)
                flat = buf[: bucket.nbytes].view(bucket.dtype)
                for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                    slots[i] = flat[off : off + meta[i].numel].view(meta[i].shape)
            sources = cast(list[torch.Tensor], slots)  # the plan places every tensor
            # Buffers of earlier layouts (or of a sender since restarted) are not named
            # again: unmap them (a deleted shared-memory file, or device memory, each).
            for stale in [k for k in self._opened if k not in keys]:
                del self._opened[stale]
        else:
            raise BroadcastError(
                f"unknown ipc layout {payload.layout!r}; run the same obsckpt version on both sides"
            )
        self._sources = sources
        self._held = (payload.layout_id, payload.layout)

    def _check_deadline(self, payload: IpcPayload, what: str, into: bool | None = None) -> None:
        """Refuse a payload past the sender's deadline.

        ``into``: None while the held weights are untouched (before the copy,
        or a copy into fresh tensors); else whether the copy went into
        ``into``'s tensors (True) or the receive area (False).
        """
        late = time.monotonic() - payload.deadline
        if late <= 0:
            return
        head = (
            f"the weights of step {payload.step} {what} {late:.2f} s after the sender's "
            "deadline; the sender has given up on this sync and may be rewriting its buffers"
        )
        if into is None:
            raise BroadcastTimeoutError(f"{head}, so they are not used; the weights are unchanged")
        where = "the tensors given in into=" if into else "this receiver's receive area"
        done = "is queued on" if what == "was queued" else "has already overwritten"
        raise BroadcastTimeoutError(
            f"{head}. The copy {done} {where}, which now hold unverified, possibly torn bytes "
            f"of step {payload.step}: not a known version (weights_valid is False; last_step "
            f"stays {self.last_step}). Take the next sync before using them"
        )

    def _direct_sources(self, payload: IpcPayload, meta: list[TensorMeta]) -> list[torch.Tensor]:
        """The sender's tensors, as views of its storages (opened once, kept while live)."""
        if len(payload.views) != len(meta):
            raise BroadcastError(
                f"the payload has {len(payload.views)} views for {len(meta)} tensors; sender "
                "and receiver disagree on the protocol"
            )
        for sid, handle in payload.storages:
            self._storages[sid] = self._open_storage(handle, payload)
        self._drop_storages(payload.live)
        sources = []
        for m, (sid, offset) in zip(meta, payload.views, strict=True):
            key = (sid, offset, m.dtype, m.shape)
            src = self._views.get(key)
            if src is None:
                storage = self._storages.get(sid)
                if storage is None or offset + m.nbytes > storage.numel():
                    raise BroadcastError(
                        f"{m.name!r}: the payload points into storage {sid}, which this "
                        "rollout does not hold (or not that far); sender and receiver "
                        "disagree on the protocol"
                    )
                src = storage[offset : offset + m.nbytes].view(m.dtype).view(m.shape)
                self._views[key] = src
            sources.append(src)
        return sources

    def _drop_storages(self, live: Iterable[int]) -> None:
        """Close the sender's storages not in ``live`` (the sender may free or reuse them)."""
        keep = set(live)
        for sid in [s for s in self._storages if s not in keep]:
            del self._storages[sid]
        if len(self._views) and any(k[0] not in keep for k in self._views):
            self._views = {k: v for k, v in self._views.items() if k[0] in keep}

    def _open_storage(self, handle: Any, payload: IpcPayload) -> torch.Tensor:
        """A byte tensor over one of the sender's storages."""
        if handle[0] != "cuda":
            raise BroadcastError(f"unknown ipc storage handle kind {handle[0]!r}")
        return _rebuild_cuda(handle[1], payload, self.device)

    def _open(self, handle: Any, payload: IpcPayload) -> tuple[Any, torch.Tensor]:
        """``(key, byte tensor)`` of one of the sender's buckets, opened once while named."""
        if handle[0] == SHM:
            key = handle[1]
        else:  # segment handle, offset and size: two buckets may share a segment
            args = handle[1][1]
            key = (args[7], args[9], args[8], payload.device_uuid)
        buf = self._opened.get(key)
        if buf is not None:
            return key, buf
        if handle[0] == SHM:
            _, path, size = handle
            buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        elif handle[0] == "cuda":
            buf = _rebuild_cuda(handle[1], payload, self.device)
        else:
            raise BroadcastError(f"unknown ipc handle kind {handle[0]!r}")
        self._opened[key] = buf
        return key, buf

    def _targets_for(self, into: Mapping[str, torch.Tensor] | None, clone: bool) -> _Targets:
        """The tensors to copy into, the dict to return, and the CUDA devices they are on.

        Kept from sync to sync while the layout and ``into``'s tensors stay the
        same, so a sync does no per-tensor bookkeeping.
        """
        meta, sources = self._meta, self._sources
        if clone:
            device = self.device
            return self._targets_of(
                [
                    torch.empty(m.shape, dtype=m.dtype, device=device or src.device)
                    for m, src in zip(meta, sources, strict=True)
                ]
            )
        key = None if into is None else _IntoKey.of(into)
        if self._targets is not None and _same_into(key, self._targets_key):
            return self._targets
        if into is None:
            dsts = [self._area_tensor(m, src) for m, src in zip(meta, sources, strict=True)]
        else:
            dsts = [
                self._into_tensor(m, into[m.name]) if m.name in into else self._area_tensor(m, src)
                for m, src in zip(meta, sources, strict=True)
            ]
        self._targets, self._targets_key = self._targets_of(dsts), key
        return self._targets

    def _targets_of(self, dsts: list[torch.Tensor]) -> _Targets:
        names = (m.name for m in self._meta)
        return dsts, dict(zip(names, dsts, strict=True)), streams.cuda_devices(dsts)

    @staticmethod
    def _into_tensor(m: TensorMeta, dst: torch.Tensor) -> torch.Tensor:
        if dst.shape != m.shape:
            raise BroadcastError(
                f"{m.name!r}: sent {m.shape}, into= has {tuple(dst.shape)}; pass tensors "
                "of the sender's shapes"
            )
        return dst

    def _area_tensor(self, m: TensorMeta, src: torch.Tensor) -> torch.Tensor:
        device = self.device or src.device
        dst = self._area.get(m.name)
        if dst is None or dst.shape != m.shape or dst.dtype != m.dtype or dst.device != device:
            dst = self._area[m.name] = torch.empty(m.shape, dtype=m.dtype, device=device)
        return dst

    def close(self) -> None:
        """Unmap the sender's buffers and storages and drop the receive area."""
        self._opened.clear()
        self._drop_storages(())
        self._area.clear()
        self._held = None
        self._sources = []
        self._targets = self._targets_key = None
        self._graph = self._last_pair = None
        self._done = None


def _rebuild_cuda(reduced: Any, payload: IpcPayload, device: torch.device | None) -> torch.Tensor:
    """A tensor over the sender's CUDA memory, opened on ``device`` (default: the current one)."""
    rebuild, args = reduced
    device = device or torch.device("cuda", torch.cuda.current_device())
    mine = device_uuid(device)
    if payload.device_uuid is not None and mine != payload.device_uuid:
        raise BroadcastError(
            f"the sender's tensors are on GPU {payload.device_uuid}, this rollout "
            f"runs on {mine}; the ipc method needs both on the same GPU (use "
            "sync_method='broadcast' across GPUs)"
        )
    args = list(args)
    args[6] = device.index  # the sender's index may name another device here
    rebuilt: torch.Tensor = rebuild(*args)
    return rebuilt


def _plain_copies(dsts: list[torch.Tensor], srcs: list[torch.Tensor], device: torch.device) -> bool:
    """Each pair a byte-for-byte copy between dense tensors on ``device`` (a memcpy each)."""
    return all(
        d.dtype == s.dtype
        and d.shape == s.shape
        and d.device == device
        and s.device == device
        and d.is_contiguous()
        and s.is_contiguous()
        for d, s in zip(dsts, srcs, strict=True)
    )


class _IntoKey(NamedTuple):
    """What the targets of an ``into=`` mapping depend on."""

    names: list[str]
    tensors: list[torch.Tensor]
    shapes: list[torch.Size]

    @classmethod
    def of(cls, into: Mapping[str, torch.Tensor]) -> _IntoKey:
        tensors = list(into.values())
        return cls(list(into.keys()), tensors, list(map(_shape, tensors)))


def _same_into(a: _IntoKey | None, b: _IntoKey | None) -> bool:
    """The same names, the very same tensor objects, the same shapes (or both None)."""
    if a is None or b is None:
        return a is b
    return (
        a.names == b.names
        and len(a.tensors) == len(b.tensors)
        and all(map(operator.is_, a.tensors, b.tensors))
        and a.shapes == b.shapes
    )
