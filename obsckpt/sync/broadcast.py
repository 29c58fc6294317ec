"""Weight broadcast from trainer rank 0 to the rollout side over a group of its own.

The group is a :class:`~obsckpt.sync.group.WeightSyncGroup` (formed only
once every member has checked in, every wait bounded by a deadline).

:class:`WeightBroadcaster` sends a whole model as a few large flat buckets,
one dtype per bucket: the sender packs tensors into two reusable buffers of
``bucket_bytes`` with one ``torch.cat`` per bucket, while the previous bucket is
still on the wire; the receiver gets the names, dtypes and shapes in a small
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
"""

from __future__ import annotations

import contextlib
import functools
import logging
import pickle
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from obsckpt.errors import BroadcastError
from obsckpt.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    TensorMeta,
    check_unique_names,
    plan_buckets,
    tensor_meta,
)
from obsckpt.sync.group import WeightSyncGroup, check_newer_step
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.telemetry import tracing

logger = logging.getLogger(__name__)

MODES = ("bucketed", "per_tensor")
_MAGIC = 0x0B5C_5EED
_HEADER_VERSION = 1
# Two buffers: one being packed while the other is on the wire.
_SEND_BUFFERS = 2
_RECV_BUFFERS = 2
_END = object()
_T = TypeVar("_T")


# ----------------------------------------------------------------------
# The broadcaster
# ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BroadcastResult:
    """What one broadcast moved and how long it took (on this side)."""

    seconds: float
    nbytes: int
    tensors: int
    collectives: int
    backend: str
    mode: str


class WeightBroadcaster:
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
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds or None, got {timeout_s!r}")
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < group.world_size:
            raise ValueError(
                f"src must be a rank of the group, in [0, {group.world_size}), got {src!r}; "
                "pass the sending member's rank (trainer rank 0 is usually 0)"
            )
        self.group = group
        self.src = src
        self.bucket_bytes = int(bucket_bytes)
        self.mode = mode
        self.timeout_s = timeout_s
        self.telemetry = WeightSyncTelemetry(metrics=metrics, monitor=monitor)
        self._pool: list[torch.Tensor] = []  # raw byte buffers, one bucket each
        self._send_cache: tuple[tuple[Any, ...], bytes, list[Bucket] | None] | None = None
        self._where: list[int] | None = None  # for the cached plan
        self._recv_cache: tuple[Any, ...] | None = None
        self._recv_bucket_bytes = self.bucket_bytes
        self._area: dict[int, torch.Tensor] = {}  # bucket index -> flat receive buffer
        self._area_layout: tuple[Any, ...] | None = None
        self._area_views: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}
        self.last_step: int | None = None
        self.last_seconds: float | None = None
        # False while the receive area or into='s tensors hold bytes of a broadcast
        # that failed or was refused midway (not a known version); True again
        # after the next broadcast received into them.
        self.weights_valid = True
        self._issued = False  # a collective of the current broadcast was issued
        self._writing = False  # the current broadcast writes into the held weights

    @property
    def is_sender(self) -> bool:
        """Whether this member sends (its rank is ``src``)."""
        return self.group.rank == self.src

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
            check_newer_step(step, self.last_step, none_ok=True)
        items: Iterable[tuple[str, torch.Tensor]] = (
            named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
        )
        materialised = meta is None
        if meta is None:
            items = list(items)
            meta = tensor_meta(items)
        else:
            items = _announced(items, meta)
        check_unique_names(meta)
        nbytes = sum(m.nbytes for m in meta)
        attrs = {"obsckpt.step": step, "obsckpt.bytes": nbytes, "obsckpt.rank": self.group.rank}
        with (
            tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp,
            self._failing("sending"),
        ):
            sp.set_attribute("obsckpt.backend", self.group.backend)
            sp.set_attribute("obsckpt.method", "broadcast")
            sp.set_attribute("obsckpt.mode", mode)
            t0 = time.perf_counter()
            deadline = self.group.deadline(self.timeout_s)
            plan = self._send_header(meta, mode, step, deadline)
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

    def _send_header(
        self, meta: list[TensorMeta], mode: str, step: int | None, deadline: float
    ) -> list[Bucket] | None:
        key = (mode, self.bucket_bytes, meta)
        cached = self._send_cache
        if cached is not None and cached[0] == key:
            payload, plan = cached[1], cached[2]
        else:
            header = {
                "version": _HEADER_VERSION,
                "mode": mode,
                "bucket_bytes": self.bucket_bytes,
                "meta": [m.to_wire() for m in meta],
            }
            payload = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
            plan = plan_buckets(meta, self.bucket_bytes) if mode == "bucketed" else None
            self._send_cache = (key, payload, plan)
            self._where = None
        # The step travels in the preamble, so an unchanged model reuses its header bytes.
        device = self.group.device  # NCCL moves only device tensors
        preamble = torch.tensor(
            [_MAGIC, len(payload), -1 if step is None else step], dtype=torch.int64
        ).to(device)
        body = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        self._broadcast_now(preamble, deadline, "header")
        self._broadcast_now(body, deadline, "header")
        return plan

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

        def drain_one() -> None:
            work, buf, b = inflight.popleft()
            self.group.wait(
                work, deadline, lambda t: self._progress("bucket", b, len(plan), meta, t)
            )
            if buf is not None:
                free.append(buf)

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
                    drain_one()
                buf = free.pop() if free else self._new_buffer()
                out = buf[: bucket.nbytes].view(bucket.dtype)
                torch.cat(parts, out=out)
                del parts
                inflight.append((self._issue(out, deadline), buf, b))
                issued += 1
            while len(inflight) > _SEND_BUFFERS:
                drain_one()
        self._check_count(seen, meta)
        while inflight:
            drain_one()
        return issued

    def _new_buffer(self) -> torch.Tensor:
        buf = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=self.group.device)
        self._pool.append(buf)
        return buf

    def _check_item(self, i: int, name: str, t: torch.Tensor, meta: list[TensorMeta]) -> None:
        m = meta[i]
        if m.name != name or m.dtype != t.dtype or m.shape != tuple(t.shape):
            self.group._break("sender's tensors did not match the header it sent")
            raise BroadcastError(
                f"tensor #{i} is {name!r} {t.dtype} {tuple(t.shape)}, but the header announced "
                f"{m.name!r} {m.dtype} {m.shape}; the receivers cannot follow, so the group is "
                "now broken"
            )

    def _check_count(self, seen: int, meta: list[TensorMeta]) -> None:
        if seen != len(meta):
            self.group._break("sender yielded fewer tensors than its header announced")
            raise BroadcastError(
                f"the iterable yielded {seen} tensors but the header announced {len(meta)}; "
                "the group is now broken"
            )

    # -- receiver ------------------------------------------------------

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
        attrs = {"obsckpt.rank": self.group.rank, "obsckpt.method": "broadcast"}
        with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
            with self._failing("receiving"):
                t0 = time.perf_counter()
                deadline = self.group.deadline(self.timeout_s)
                mode, meta, plan, step = self._recv_header(deadline)
                nbytes = sum(m.nbytes for m in meta)
                sp.set_attribute("obsckpt.bytes", nbytes)
                sp.set_attribute("obsckpt.backend", self.group.backend)
                sp.set_attribute("obsckpt.mode", mode)
                if step is not None:
                    sp.set_attribute("obsckpt.step", step)
                held = self.last_step
                refused = step is not None and held is not None and step <= held
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
        magic, length, step = (int(x) for x in preamble.cpu().tolist())
        if magic != _MAGIC:
            self.group._break("received a header that is not obsckpt's")
            raise BroadcastError(
                f"the first message was not a weight-sync header (magic {magic:#x}); sender and "
                "receivers disagree on the protocol, the group is now broken"
            )
        body = torch.empty(length, dtype=torch.uint8, device=device)
        self._broadcast_now(body, deadline, "header")
        raw = body.cpu().numpy().tobytes()
        cached = self._recv_cache
        if cached is None or cached[0] != raw:
            header = pickle.loads(raw)
            if header.get("version") != _HEADER_VERSION:
                self.group._break("header version mismatch")
                raise BroadcastError(
                    f"unsupported weight-sync header version {header.get('version')}; "
                    "run the same obsckpt version on both sides"
                )
            mode = header["mode"]
            bucket_bytes = int(header["bucket_bytes"])
            meta = [TensorMeta.from_wire(m) for m in header["meta"]]
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
        return mode, meta, plan, (None if step < 0 else step)

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

    # -- shared --------------------------------------------------------

    @contextlib.contextmanager
    def _failing(self, role: str) -> Iterator[None]:
        """A broadcast that fails once its first collective was issued breaks the group.

        The peers are then somewhere inside the broadcast's sequence of
        collectives; the next call would pair with what is left of it (a
        receiver taking the wrong bytes as weights, or gloo ending the
        process), so the group is aborted as for a timeout. The failure is
        counted, and anything but a :class:`BroadcastError` is raised as one,
        chained to the original. KeyboardInterrupt and SystemExit break the
        group too, and are raised as they are.
        """
        self._issued = False
        try:
            yield
        except BaseException as exc:
            err: BaseException = exc
            if self._issued:
                if self._writing:
                    self.weights_valid = False
                self._pool = []  # the aborted collectives may still hold these buffers
                self.group._break(f"{role} failed midway: {type(exc).__name__}: {exc}")
                if isinstance(exc, Exception) and not isinstance(exc, BroadcastError):
                    err = BroadcastError(
                        f"weight broadcast ({role}, {self.group.backend}) on {self.group.host}:"
                        f"{self.group.port} failed after it began: {type(exc).__name__}: {exc}; "
                        "the peers are out of step, so the group is now broken: close it and "
                        "form a new group on a fresh port"
                    )
            if self._issued or isinstance(exc, BroadcastError):
                self._count(err)
            if err is exc:
                raise
            raise err from exc
        finally:
            self._issued = self._writing = False

    def _count(self, exc: BaseException) -> None:
        if self.telemetry:
            self.telemetry.failure(self.group.backend, "broadcast", exc)

    def _refuse(self, exc: BroadcastError) -> None:
        """Raise an error that leaves the group in step (counted; the span records it)."""
        self._count(exc)
        raise exc

    def _issue(self, t: torch.Tensor, deadline: float) -> Any:
        """Start one collective of the current broadcast (from here on, a failure breaks the group)."""
        self._issued = True
        return self.group.broadcast_async(t, self.src, deadline)

    def _broadcast_now(self, t: torch.Tensor, deadline: float, what: str) -> None:
        work = self._issue(t, deadline)
        self.group.wait(work, deadline, lambda t: self._progress(what, 0, 1, None, t))

    def _progress(
        self,
        unit: str,
        at: int,
        total: int,
        meta: list[TensorMeta] | None,
        timed_out: bool = True,
    ) -> str:
        budget = self.timeout_s if self.timeout_s is not None else self.group.timeout_s
        role = "sending" if self.is_sender else "receiving"
        if meta is None:
            what = f"{role}, {self.group.backend}"
            done = f"the {unit} was not {'taken' if self.is_sender else 'sent'} by the peers"
        else:
            mib = sum(m.nbytes for m in meta) / 2**20
            what = f"{role}, {len(meta)} tensors, {mib:.1f} MiB, {self.group.backend}"
            done = f"{at} of {total} {unit}s completed"
        where = f"weight broadcast ({what}) on {self.group.host}:{self.group.port}"
        if timed_out:
            return f"{where} did not finish within {budget:.1f} s: {done}; the group is now broken"
        done = f"on the {unit}" if meta is None else f"after {done}"
        return (
            f"{where} failed {done} (a peer gone, or the backend refused the collective); "
            "the group is now broken: close it and form a new group on a fresh port"
        )

    def release_buffers(self) -> None:
        """Drop the reusable buffers and the receive area (allocated again when needed)."""
        self._pool.clear()
        self._area = {}
        self._area_views = {}


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


def _views(flat: torch.Tensor, bucket: Bucket, meta: list[TensorMeta]) -> dict[str, torch.Tensor]:
    out = {}
    for i, off in zip(bucket.indices, bucket.offsets, strict=True):
        m = meta[i]
        out[m.name] = flat[off : off + m.numel].view(m.shape)
    return out


def _receivable(dst: torch.Tensor, m: TensorMeta, device: torch.device) -> bool:
    return dst.is_contiguous() and dst.dtype == m.dtype and dst.device == device
