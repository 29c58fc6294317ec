"""Weight broadcast from trainer rank 0 to the rollout side over a group of its own.

The group is a :class:`~obsckpt.sync.group.WeightSyncGroup` (formed only
once every member has checked in, every wait bounded by a deadline).

:class:`WeightBroadcaster` sends a whole model as a few large flat buckets,
one dtype per bucket: the sender packs tensors into two reusable buffers of
``bucket_bytes`` with one copy per bucket (``torch._foreach_copy_`` into views
shaped as its tensors; ``torch.cat`` for a lazy stream), while the previous bucket
is still on the wire; the receiver gets the names, dtypes and shapes in a small
header and rebuilds named tensors as views of the received buckets (or copies
them into tensors it already holds, ``recv(into=...)``). Tensors larger than a
bucket go alone, without a copy. ``mode="per_tensor"`` sends one collective per
tensor, as the reference implementation does, for comparison.

A broadcast that does not finish within its timeout raises
:class:`BroadcastTimeoutError` on every side that waits for it, saying how far
it got; the group is then marked broken (the peers' collective sequence is
unknown) and must be closed and created again. So does any other failure once
the first collective of a broadcast was issued (a lazy generator raising, an
allocation or a copy failing): it is raised as :class:`BroadcastError`,
chained to the original.

Versions never go backwards: the sender refuses a step not newer than the last
one it sent (``ValueError``, before any collective); a receiver refuses an
older step after reading the whole broadcast into scratch memory, so the group
stays in step and its weights stay those of the last step it accepted.

Modules: this one (the sending side), :mod:`~obsckpt.sync.broadcast_recv`
(the receiving side), :mod:`~obsckpt.sync.broadcast_endpoint` (what both
share: settings, failure handling, the collectives' deadlines) and
:mod:`~obsckpt.sync.wire` (the header, the version rule, the result).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from obsckpt.errors import BroadcastError
from obsckpt.sync import wire
from obsckpt.sync.broadcast_endpoint import MODES
from obsckpt.sync.broadcast_recv import BroadcastReceiving
from obsckpt.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    TensorMeta,
    plan_buckets,
    tensor_meta,
    validate_unique_names,
)
from obsckpt.sync.group import WeightSyncGroup
from obsckpt.sync.wire import BroadcastResult
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing

__all__ = ["MODES", "BroadcastResult", "WeightBroadcaster"]

# Two buffers: one being packed while the other is on the wire.
_SEND_BUFFERS = 2
_END = object()
_T = TypeVar("_T")


class WeightBroadcaster(BroadcastReceiving):
    """Sends (rank ``src``) or receives (other ranks) whole models over a :class:`WeightSyncGroup`.

    Keep one per group: its buffers are reused from one broadcast to the next.
    Give ``metrics`` or ``monitor`` to the sending side only, so each broadcast
    is counted once.

    Args:
        group: the weight-sync group.
        src: the sending rank in the group.
        bucket_bytes: bucket size; tensors of at least this size go alone.
        mode: ``bucketed`` (default) or ``per_tensor``; receivers follow the sender.
        timeout_s: bound on one whole broadcast (default: the group's timeout).
        metrics: an :class:`obsckpt.telemetry.metrics.Metrics` to record into.
        monitor: the monitor actor handle, to record through its RPCs.
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        *,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        mode: str = "bucketed",
        timeout_s: float | None = None,
        metrics: Any = None,
        monitor: Any = None,
    ) -> None:
        super().__init__(
            group,
            src=src,
            bucket_bytes=bucket_bytes,
            mode=mode,
            timeout_s=timeout_s,
            metrics=metrics,
            monitor=monitor,
        )
        # The last layout sent: its key, header bytes, bucket plan and byte count.
        self._send_cache: tuple[tuple[Any, ...], bytes, list[Bucket] | None, int] | None = None
        self._where: list[int] | None = None  # for the cached plan
        # Per bucket of the cached plan: send buffers and their views shaped as the
        # bucket's tensors, which a whole state is copied into in one call.
        self._pack_views: dict[int, list[tuple[torch.Tensor, list[torch.Tensor]]]] = {}

    # -- sender --------------------------------------------------------

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        *,
        meta: list[TensorMeta] | None = None,
        mode: str | None = None,
        step: int | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> BroadcastResult:
        """Broadcast every tensor to the receivers; returns once all are sent.

        ``named_tensors`` may be a lazy generator (e.g. FSDP2 ``full_tensor()``
        gathered one at a time) when ``meta`` gives its names, dtypes and
        shapes up front; it must then yield exactly those, in that order.

        Raises:
            ValueError: ``step`` is not newer than the last step sent (nothing
                is sent then), or ``mode`` is unknown.
            BroadcastTimeoutError: the broadcast did not finish within its timeout.
            BroadcastError: it failed once begun (the group is then broken), or
                the tensors do not match ``meta``.
        """
        if not self.is_sender:
            raise BroadcastError(f"rank {self.group.rank} is not the sender (src={self.src})")
        mode = mode or self.mode
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if step is not None:
            wire.validate_newer_step(step, self.last_step, none_ok=True)
        items: Iterable[tuple[str, torch.Tensor]] = (
            named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        )
        materialised = meta is None
        if meta is None:
            items = list(items)
            meta = tensor_meta(items)
        else:
            items = _announced(items, meta)
        payload, plan, nbytes = self._layout(meta, mode)
        attrs = {span_attr.STEP: step, span_attr.BYTES: nbytes, span_attr.RANK: self.group.rank}
        with (
            tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp,
            self._failing("sending"),
        ):
            sp.set_attribute(span_attr.BACKEND, self.group.backend)
            sp.set_attribute(span_attr.METHOD, "broadcast")
            sp.set_attribute(span_attr.MODE, mode)
            t0 = time.perf_counter()
            deadline = self.group.deadline(self.timeout_s)
            self._send_header(payload, step, deadline)
            if mode == "per_tensor":
                count = self._send_per_tensor(items, meta, deadline)
            else:
                assert plan is not None  # a bucketed header comes with its plan
                # A materialised dict's metadata was computed from its own tensors.
                count = self._send_bucketed(items, meta, plan, deadline, check=not materialised)
            seconds = time.perf_counter() - t0
        if step is not None:
            self.last_step = step
        self.last_seconds = seconds
        self.telemetry.broadcast(self.group.backend, seconds, nbytes, "broadcast")
        return BroadcastResult(seconds, nbytes, len(meta), count, self.group.backend, mode)

    def _layout(self, meta: list[TensorMeta], mode: str) -> tuple[bytes, list[Bucket] | None, int]:
        """The header bytes, bucket plan and byte count of ``meta`` sent in ``mode``: made
        (and the names checked unique) for a new layout, the last ones for the same.

        Raises:
            ValueError: a name appears twice (nothing was sent).
        """
        key = (mode, self.bucket_bytes, meta)
        cached = self._send_cache
        if cached is not None and cached[0] == key:
            return cached[1], cached[2], cached[3]
        validate_unique_names(meta)
        payload = wire.encode_header(mode, self.bucket_bytes, meta)
        plan = plan_buckets(meta, self.bucket_bytes) if mode == "bucketed" else None
        nbytes = sum(m.nbytes for m in meta)
        self._send_cache = (key, payload, plan, nbytes)
        self._where = None
        self._pack_views = {}
        return payload, plan, nbytes

    def _send_header(self, payload: bytes, step: int | None, deadline: float) -> None:
        # The step travels in the preamble, so an unchanged model reuses its header bytes.
        device = self.group.device  # NCCL moves only device tensors
        preamble = torch.tensor(wire.encode_preamble(len(payload), step), dtype=torch.int64).to(
            device
        )
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        self._broadcast_now(preamble, deadline, "header")
        self._broadcast_now(body, deadline, "header")

    def _send_per_tensor(
        self,
        items: Iterable[tuple[str, torch.Tensor]],
        meta: list[TensorMeta],
        deadline: float,
    ) -> int:
        sent = 0
        for i, (name, t) in enumerate(items):
            self._check_item(i, name, t, meta)
            src = t.detach().to(self.group.device).contiguous()
            work = self._issue(src, deadline)
            self.group.wait(
                work, deadline, functools.partial(self._progress, "tensor", i, len(meta), meta)
            )
            sent += 1
        self._check_count(sent, meta)
        return sent

    def _send_bucketed(
        self,
        items: Iterable[tuple[str, torch.Tensor]],
        meta: list[TensorMeta],
        plan: list[Bucket],
        deadline: float,
        check: bool,
    ) -> int:
        """Bucketed send: each bucket goes once its last tensor has arrived.

        ``items`` may be a lazy stream; with ``check`` each tensor is checked
        against the metadata announced in the header.
        """
        if not check and isinstance(items, list):
            return self._send_whole(items, meta, plan, deadline)
        where = self._where
        if where is None or len(where) != len(meta):
            where = [0] * len(meta)  # tensor index -> bucket index
            for b, bucket in enumerate(plan):
                for i in bucket.indices:
                    where[i] = b
            self._where = where
        pending: dict[int, list[torch.Tensor]] = {}
        inflight: deque[tuple[Any, torch.Tensor | None, int]] = deque()
        free = list(self._pool)
        issued = 0
        seen = 0

        for i, (name, t) in enumerate(items):
            if check:
                self._check_item(i, name, t, meta)
            seen += 1
            b = where[i]
            bucket = plan[b]
            if t.requires_grad:
                t = t.detach()
            if t.device != self.group.device:
                t = t.to(self.group.device)
            if bucket.solo:
                flat = t.contiguous().view(-1)
                inflight.append((self._issue(flat, deadline), None, b))
                issued += 1
            else:
                parts = pending.setdefault(b, [])
                parts.append(t.reshape(-1))
                if len(parts) < len(bucket.indices):
                    continue
                del pending[b]
                while not free and len(self._pool) >= _SEND_BUFFERS and inflight:
                    self._drain(inflight, free, deadline, plan, meta)
                buf = free.pop() if free else self._new_buffer()
                out = buf[: bucket.nbytes].view(bucket.dtype)
                torch.cat(parts, out=out)
                del parts
                inflight.append((self._issue(out, deadline), buf, b))
                issued += 1
            while len(inflight) > _SEND_BUFFERS:
                self._drain(inflight, free, deadline, plan, meta)
        self._check_count(seen, meta)
        while inflight:
            self._drain(inflight, free, deadline, plan, meta)
        return issued

    def _send_whole(
        self,
        items: list[tuple[str, torch.Tensor]],
        meta: list[TensorMeta],
        plan: list[Bucket],
        deadline: float,
    ) -> int:
        """Bucketed send of a whole state at hand (its metadata made from it): each
        bucket is packed by one copy into views of a send buffer kept per bucket, not
        tensor by tensor, and goes while the next is packed. Same collectives, same
        order as :meth:`_send_bucketed`."""
        device = self.group.device
        tensors = [t if t.device == device else t.to(device) for _, t in items]
        inflight: deque[tuple[Any, torch.Tensor | None, int]] = deque()
        free = list(self._pool)
        with torch.no_grad():
            for b, bucket in enumerate(plan):
                if bucket.solo:
                    flat = tensors[bucket.indices[0]].detach().contiguous().view(-1)
                    inflight.append((self._issue(flat, deadline), None, b))
                    continue
                while not free and len(self._pool) >= _SEND_BUFFERS and inflight:
                    self._drain(inflight, free, deadline, plan, meta)
                buf = free.pop() if free else self._new_buffer()
                out, views = self._bucket_views(b, bucket, buf, tensors)
                torch._foreach_copy_(views, [tensors[i] for i in bucket.indices])
                inflight.append((self._issue(out, deadline), buf, b))
                while len(inflight) > _SEND_BUFFERS:
                    self._drain(inflight, free, deadline, plan, meta)
            while inflight:
                self._drain(inflight, free, deadline, plan, meta)
        return len(plan)

    def _bucket_views(
        self, b: int, bucket: Bucket, buf: torch.Tensor, tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Bucket ``b``'s part of ``buf`` and its views shaped as the bucket's tensors."""
        out = buf[: bucket.nbytes].view(bucket.dtype)
        held = self._pack_views.setdefault(b, [])
        for kept, views in held:
            if kept is buf:
                return out, views
        views = [
            out[off : off + tensors[i].numel()].view(tensors[i].shape)
            for i, off in zip(bucket.indices, bucket.offsets, strict=True)
        ]
        held.append((buf, views))
        return out, views

    def _drain(
        self,
        inflight: deque[tuple[Any, torch.Tensor | None, int]],
        free: list[torch.Tensor],
        deadline: float,
        plan: list[Bucket],
        meta: list[TensorMeta],
    ) -> None:
        work, buf, b = inflight.popleft()
        self.group.wait(work, deadline, lambda t: self._progress("bucket", b, len(plan), meta, t))
        if buf is not None:
            free.append(buf)

    def _new_buffer(self) -> torch.Tensor:
        buf = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        self._pool.append(buf)
        self._pack_views = {}  # views of the buffers that were, if any
        return buf

    def release_buffers(self) -> None:
        """Drop the reusable buffers and everything viewing them (allocated again when needed)."""
        super().release_buffers()
        self._pack_views = {}

    def _check_item(self, i: int, name: str, t: torch.Tensor, meta: list[TensorMeta]) -> None:
        m = meta[i]
        if m.name != name or m.dtype != t.dtype or m.shape != tuple(t.shape):
            self.group.mark_broken("sender's tensors did not match the header it sent")
            raise BroadcastError(
                f"tensor #{i} is {name!r} {t.dtype} {tuple(t.shape)}, but the header announced "
                f"{m.name!r} {m.dtype} {m.shape}; the receivers cannot follow, so the group is "
                "now broken"
            )

    def _check_count(self, seen: int, meta: list[TensorMeta]) -> None:
        if seen != len(meta):
            self.group.mark_broken("sender yielded fewer tensors than its header announced")
            raise BroadcastError(
                f"the iterable yielded {seen} tensors but the header announced {len(meta)}; "
                "the group is now broken"
            )


def _announced(items: Iterable[_T], meta: list[TensorMeta]) -> Iterator[_T]:
    """``items``, checked to end with the last tensor the header announced.

    The check comes before that tensor is handed on, so a stream that yields
    more fails while the receivers still wait for its last collective: every
    side then sees the broadcast fail (the group is broken), none takes it whole.
    """
    it = iter(items)
    n = len(meta)
    if n == 0:
        _check_end(it, n)
    for i in range(n):
        try:
            item = next(it)
        except StopIteration:
            return  # fewer than announced: the sender's count check raises
        if i == n - 1:
            _check_end(it, n)
        yield item


def _check_end(it: Iterator[Any], n: int) -> None:
    extra = next(it, _END)
    if extra is not _END:
        name = extra[0] if isinstance(extra, tuple) and extra else extra
        raise BroadcastError(
            f"the iterable yields more than the {n} tensors the header announced (next: "
            f"{name!r}); the receivers cannot follow, so the group is now broken. Pass meta "
            "that lists every tensor the iterable yields"
        )
