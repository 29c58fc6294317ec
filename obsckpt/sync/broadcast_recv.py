"""The receiving side of a weight broadcast: the header, then the tensors, into views or ``into=``.

A receiver reads the header (:mod:`~obsckpt.sync.wire`), computes the
sender's bucket plan from its metadata, and receives each bucket into its
receive area (one flat buffer per bucket, kept while the layout is
unchanged), into the tensors given in ``into=`` (through two reused bucket
buffers, or straight into a tensor that fits), or into fresh storage. An
older step is read whole into scratch memory and refused, so the group stays
in step and the weights unchanged.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from obsckpt.errors import BroadcastError
from obsckpt.sync import wire
from obsckpt.sync.broadcast_endpoint import BroadcastEndpoint
from obsckpt.sync.buckets import Bucket, TensorMeta, plan_buckets
from obsckpt.sync.group import WeightSyncGroup
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing

# Two buffers: one being received into while the other is copied out.
_RECV_BUFFERS = 2


class BroadcastReceiving(BroadcastEndpoint):
    """The receiving side of :class:`~obsckpt.sync.broadcast.WeightBroadcaster` (ranks but ``src``)."""

    def __init__(self, group: WeightSyncGroup, **kwargs: Any) -> None:
        super().__init__(group, **kwargs)
        self._recv_cache: tuple[Any, ...] | None = None
        self._recv_bucket_bytes = self.bucket_bytes
        self._area: dict[int, torch.Tensor] = {}  # bucket index -> flat receive buffer
        self._area_layout: tuple[Any, ...] | None = None
        self._area_views: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def recv(
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        clone: bool = False,
        trace_context: Mapping[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive one broadcast; returns ``{name: tensor}`` in the sender's order.

        By default the tensors are views of this broadcaster's receive area
        (one flat buffer per bucket, kept while the model's layout is
        unchanged): nothing is copied, and the next ``recv()`` overwrites
        them in place, like a model's weights. ``clone=True`` returns tensors
        of fresh storage instead (the tensors of one bucket share it). With
        ``into``, the tensors named there are filled in place (through two
        reused bucket buffers) and returned. A shape mismatch with ``into``
        raises after the whole broadcast was received, so the group stays
        usable.

        A step not newer than :attr:`last_step` is read whole into scratch
        memory and refused: the group stays in step, the weights stay as
        they were. A broadcast that fails midway leaves the tensors it was
        writing (the receive area, or ``into``'s) partly overwritten:
        :attr:`weights_valid` is then False, and :attr:`last_step` stays,
        until the next broadcast received into them.

        Raises:
            BroadcastTimeoutError: the broadcast did not finish within its timeout.
            BroadcastError: it failed (the group is then broken), an older step
                was refused, or ``into`` does not fit (the group stays usable).
        """
        if self.is_sender:
            raise BroadcastError(f"rank {self.group.rank} is the sender; call send()")
        attrs = {span_attr.RANK: self.group.rank, span_attr.METHOD: "broadcast"}
        with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
            with self._failing("receiving"):
                t0 = time.perf_counter()
                deadline = self.group.deadline(self.timeout_s)
                mode, meta, plan, step = self._recv_header(deadline)
                nbytes = sum(m.nbytes for m in meta)
                sp.set_attribute(span_attr.BYTES, nbytes)
                sp.set_attribute(span_attr.BACKEND, self.group.backend)
                sp.set_attribute(span_attr.MODE, mode)
                if step is not None:
                    sp.set_attribute(span_attr.STEP, step)
                held = self.last_step
                refused = wire.is_stale_step(step, held)
                mismatched: list[str] = []
                if refused:
                    self._recv_discard(mode, meta, plan, deadline)
                else:
                    writes = into is not None or not clone
                    self._writing = writes
                    with torch.no_grad():  # into= may hold parameters that require grad
                        if mode == "per_tensor":
                            out = self._recv_per_tensor(meta, into, mismatched, deadline)
                        else:
                            assert plan is not None  # a bucketed header comes with its plan
                            out = self._recv_bucketed(meta, plan, into, clone, mismatched, deadline)
                    self._writing = False
                    if step is not None:
                        self.last_step = step
                    if writes:
                        self.weights_valid = not mismatched
                    self.last_seconds = time.perf_counter() - t0
            if refused:
                self._refuse(
                    BroadcastError(
                        f"refused the weights of step {step}: this receiver already holds step "
                        f"{held} and versions never go backwards; the broadcast was read and "
                        "dropped, the weights are unchanged and the group is still usable"
                    )
                )
            if mismatched:
                self._refuse(
                    BroadcastError(
                        f"received {len(meta)} tensors, but {len(mismatched)} did not fit the "
                        f"tensors given in into= (e.g. {mismatched[0]}): those kept their old "
                        "values, so into= is a mix of versions (weights_valid is False); pass "
                        "tensors of the sender's shapes. The group is still usable"
                    )
                )
        return out

    def _recv_discard(
        self, mode: str, meta: list[TensorMeta], plan: list[Bucket] | None, deadline: float
    ) -> None:
        """Receive a whole broadcast into scratch memory (one collective at a time), keeping the weights."""
        if plan is None:  # per_tensor
            units = [(m.dtype, m.numel) for m in meta]
        else:
            units = [(b.dtype, b.numel) for b in plan]
        size = max((n * dtype.itemsize for dtype, n in units), default=0)
        scratch = torch.empty(size, dtype=torch.uint8, device=self.group.device)
        unit = "tensor" if mode == "per_tensor" else "bucket"
        for k, (dtype, numel) in enumerate(units):
            buf = scratch[: numel * dtype.itemsize].view(dtype)
            self.group.wait(
                self._issue(buf, deadline),
                deadline,
                functools.partial(self._progress, unit, k, len(units), meta),
            )

    def _recv_header(
        self, deadline: float
    ) -> tuple[str, list[TensorMeta], list[Bucket] | None, int | None]:
        device = self.group.device
        preamble = torch.empty(3, dtype=torch.int64, device=device)
        self._broadcast_now(preamble, deadline, "header")
        try:
            length, step = wire.decode_preamble(preamble.cpu().tolist())
        except BroadcastError:
            self.group.mark_broken("received a header that is not obsckpt's")
            raise
        body = torch.empty(length, dtype=torch.uint8, device=device)
        self._broadcast_now(body, deadline, "header")
        raw = body.cpu().numpy().tobytes()
        cached = self._recv_cache
        if cached is None or cached[0] != raw:
            try:
                mode, bucket_bytes, meta = wire.decode_header(raw)
            except BroadcastError:
                self.group.mark_broken("header version mismatch")
                raise
            plan = plan_buckets(meta, bucket_bytes) if mode == "bucketed" else None
            cached = self._recv_cache = (raw, mode, bucket_bytes, meta, plan)
            layout = (bucket_bytes, tuple(meta))
            if mode == "bucketed" and layout != self._area_layout:
                self._area = {}
                self._area_views = {}
                self._area_layout = layout
        _, mode, bucket_bytes, meta, plan = cached
        if any(buf.numel() < bucket_bytes for buf in self._pool):
            self._pool.clear()  # the sender's buckets grew
        self._recv_bucket_bytes = bucket_bytes
        return mode, meta, plan, step

    def _target(
        self, m: TensorMeta, into: Mapping[str, torch.Tensor] | None, mismatched: list[str]
    ) -> torch.Tensor | None:
        if into is None or m.name not in into:
            return None
        dst = into[m.name]
        if tuple(dst.shape) != m.shape:
            mismatched.append(f"{m.name!r}: sent {m.shape}, into= has {tuple(dst.shape)}")
            return None
        return dst

    def _recv_per_tensor(
        self,
        meta: list[TensorMeta],
        into: Mapping[str, torch.Tensor] | None,
        mismatched: list[str],
        deadline: float,
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for i, m in enumerate(meta):
            dst = self._target(m, into, mismatched)
            direct = dst is not None and _receivable(dst, m, self.group.device)
            if dst is not None and direct:
                buf = dst
            else:
                buf = torch.empty(m.shape, dtype=m.dtype, device=self.group.device)
            work = self._issue(buf, deadline)
            self.group.wait(
                work, deadline, functools.partial(self._progress, "tensor", i, len(meta), meta)
            )
            if dst is not None and not direct:
                dst.copy_(buf)
                buf = dst
            out[m.name] = buf
        return out

    def _recv_bucketed(
        self,
        meta: list[TensorMeta],
        plan: list[Bucket],
        into: Mapping[str, torch.Tensor] | None,
        clone: bool,
        mismatched: list[str],
        deadline: float,
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor | None] = {m.name: None for m in meta}
        dests = [self._target(m, into, mismatched) for m in meta]
        inflight: deque[tuple[Any, int, torch.Tensor, torch.Tensor | None, bool]] = deque()
        free = list(self._pool)

        def finish_one() -> None:
            work, b, flat, raw, reuse = inflight.popleft()
            self.group.wait(
                work, deadline, lambda t: self._progress("bucket", b, len(plan), meta, t)
            )
            bucket = plan[b]
            if into is None and not clone:
                # The receive area's views do not change while the layout does not.
                views = self._area_views.get(b)
                if views is None or views[0] is not flat:
                    views = self._area_views[b] = (flat, _views(flat, bucket, meta))
                out.update(views[1])
                return
            for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                m = meta[i]
                if bucket.solo and out[m.name] is not None:
                    continue  # received straight into its destination
                view = flat[off : off + m.numel].view(m.shape)
                dst = dests[i]
                if dst is not None:
                    dst.copy_(view)
                    view = dst
                out[m.name] = view
            if raw is not None and reuse:
                free.append(raw)

        for b, bucket in enumerate(plan):
            all_copied = all(dests[i] is not None for i in bucket.indices)
            raw = None
            if bucket.solo:
                i = bucket.indices[0]
                dst = dests[i]
                if dst is not None and _receivable(dst, meta[i], self.group.device):
                    flat = dst.view(-1)
                    out[meta[i].name] = dst
                else:
                    flat = self._landing(b, bucket, clone)
            elif all_copied:
                # Every tensor of this bucket is copied out: receive into a reused buffer.
                while not free and len(self._pool) >= _RECV_BUFFERS and inflight:
                    finish_one()
                raw = free.pop() if free else self._new_recv_buffer()
                flat = raw[: bucket.nbytes].view(bucket.dtype)
            else:
                flat = self._landing(b, bucket, clone)
            inflight.append((self._issue(flat, deadline), b, flat, raw, all_copied))
            while len(inflight) > _RECV_BUFFERS:
                finish_one()
        while inflight:
            finish_one()
        return out  # type: ignore[return-value]

    def _landing(self, b: int, bucket: Bucket, clone: bool) -> torch.Tensor:
        """Where bucket ``b`` lands: fresh storage, or its slot in the receive area."""
        if clone:
            return torch.empty(bucket.numel, dtype=bucket.dtype, device=self.group.device)
        flat = self._area.get(b)
        if flat is None or flat.numel() != bucket.numel or flat.dtype != bucket.dtype:
            flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=self.group.device)
            self._area[b] = flat
        return flat

    def _new_recv_buffer(self) -> torch.Tensor:
        buf = torch.empty(self._recv_bucket_bytes, dtype=torch.uint8, device=self.group.device)
        self._pool.append(buf)
        return buf

    def release_buffers(self) -> None:
        """Drop the reusable buffers and the receive area (allocated again when needed)."""
        super().release_buffers()
        self._area = {}
        self._area_views = {}


def _views(flat: torch.Tensor, bucket: Bucket, meta: list[TensorMeta]) -> dict[str, torch.Tensor]:
    out = {}
    for i, off in zip(bucket.indices, bucket.offsets, strict=True):
        m = meta[i]
        out[m.name] = flat[off : off + m.numel].view(m.shape)
    return out


def _receivable(dst: torch.Tensor, m: TensorMeta, device: torch.device) -> bool:
    return dst.is_contiguous() and dst.dtype == m.dtype and dst.device == device
