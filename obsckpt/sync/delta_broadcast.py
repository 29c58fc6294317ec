"""Delta weight broadcast: send only what changed since the version every receiver holds.

:class:`DeltaBroadcaster` is a :class:`~obsckpt.sync.broadcast.WeightBroadcaster`
whose ``send``/``recv`` run a small protocol around the broadcast:

1. **Offer.** The sender broadcasts the step, the version a delta would be
   based on, and whether it wants a full sync (its first, a new layout, every
   ``full_every`` versions, after a failure, after a resume, or when the delta,
   encoded before the offer, would exceed half the state's bytes).
2. **Vote.** Every member takes part in an all-reduce (minimum): a receiver
   votes for the delta only if it holds that base version, whole. One receiver
   that is new, behind, or whose weights are not a known version makes the
   sync a full one for all.
3. **Data.** A full sync is the ordinary bucketed broadcast. A delta is a plan
   (per block of a tensor, its entries; per chunk, its CRC32) and the payload
   (:mod:`~obsckpt.sync.delta`); a receiver checks every chunk before it
   applies anything, then writes the entries into its weights in place.
4. **Verify.** The sender broadcasts CRC32 digests of some tensors of the new
   version (all of them after a full sync); each receiver compares its own.
5. **Result.** A second all-reduce brings each receiver's result (and its
   version, and how long it was paused) back to the sender.

**Resume.** A trainer that resumed from a checkpoint calls
:meth:`DeltaBroadcaster.resume_from` with the committed step before its first
sync: that sync is a full one, marked as a resume, and receivers take it even
though they hold a later version (the run they got it from was rolled back),
so none waits for versions the trainer will not send again. Versions rise
from there.

A chunk that fails its check, or a digest that differs, fails that sync on
that receiver: its version stays, :class:`WeightSyncCorruptError` is raised
there (the group stays usable), the sender counts it
(``obsckpt_weight_sync_corrupt_total``) and makes the next sync a full one.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from obsckpt.errors import BroadcastError, WeightSyncCorruptError
from obsckpt.sync import delta, wire
from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    TensorMeta,
    tensor_meta,
    validate_unique_names,
)
from obsckpt.sync.group import WeightSyncGroup
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing

__all__ = ["DeltaBroadcaster", "DeltaSyncResult"]

logger = logging.getLogger(__name__)

DELTA_MAGIC = 0x0B5C_DE17
_NONE = 2**62  # a vote's "no version" (the minimum ignores it)
# A receiver's result, lowest (worst) wins: applied and verified, not taken (a
# refused older step), a digest that differed after the apply, a chunk that failed.
OK, NOT_TAKEN, DIGEST, CHECKSUM = 3, 2, 1, 0
_CHECKS = {DIGEST: "digest", CHECKSUM: "checksum"}
# The offer's last field: a delta is fine, a full sync is wanted, a full sync after a resume.
_DELTA_OK, _FULL, _RESUME = 0, 1, 2
PHASES = ("snapshot", "encode", "wire", "apply", "verify")
# A delta of more than this fraction of the state's bytes is sent whole instead
# (a step that moved most values: a learning-rate spike, a fresh optimizer).
MAX_DELTA_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class DeltaSyncResult:
    """What one sync did, as the sender saw it.

    ``encoding`` is ``full`` or ``delta``; ``sent_bytes`` what went on the
    wire for the weights, ``state_bytes`` the whole state's size;
    ``phases`` seconds per phase (``apply`` is the slowest receiver's,
    ``verify`` the slowest side's digests; ``pause_s`` the slowest receiver's time
    in the sync); ``rollout_version`` the oldest version a receiver holds
    after it (None: no receiver holds one); ``corrupt`` the check that failed
    on some receiver (``checksum``, ``digest``) or None.
    """

    step: int
    encoding: str
    seconds: float
    sent_bytes: int
    state_bytes: int
    changed_fraction: float | None
    phases: dict[str, float] = field(default_factory=dict)
    pause_s: float = 0.0
    rollout_version: int | None = None
    corrupt: str | None = None

    @property
    def verified(self) -> bool:
        return self.corrupt is None


class DeltaBroadcaster(WeightBroadcaster):
    """Weight broadcast that sends deltas against the version the receivers hold.

    Args:
        group, src, bucket_bytes, timeout_s, metrics, monitor: as
            :class:`~obsckpt.sync.broadcast.WeightBroadcaster` (``bucket_bytes``
            is also the delta's chunk size).
        full_every: a full sync at least every this many versions (1: always full).
        digest_tensors: tensors digested after a delta (all after a full sync).
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        *,
        src: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        full_every: int = 20,
        digest_tensors: int = 8,
        timeout_s: float | None = None,
        metrics: Any = None,
        monitor: Any = None,
    ) -> None:
        for name, value in (("full_every", full_every), ("digest_tensors", digest_tensors)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        super().__init__(
            group,
            src=src,
            bucket_bytes=bucket_bytes,
            timeout_s=timeout_s,
            metrics=metrics,
            monitor=monitor,
        )
        self.full_every = full_every
        self.digest_tensors = digest_tensors
        # Sender: the host copy of the last version sent, the base of the next delta.
        self._base: list[torch.Tensor] | None = None
        self._base_meta: list[TensorMeta] | None = None
        self._since_full = 0
        self._force_full = True
        self._resumed = False
        self._background = ThreadPoolExecutor(1, thread_name_prefix="obsckpt-delta-base")
        self._moving: Future[None] | None = None
        # Receiver: the tensors that hold the weights, in the sender's order.
        self._held: dict[str, torch.Tensor] | None = None
        self._held_meta: list[TensorMeta] | None = None

    def force_full(self) -> None:
        """Make the next sync a full one (the sender's side)."""
        self._force_full = True

    def resume_from(self, step: int) -> None:
        """The trainer resumed from committed ``step``: the next sync (of ``step`` or later) is
        full, and receivers take it even if they hold a later version (the sender's side).

        Raises:
            ValueError: ``step`` is not a non-negative integer.
        """
        wire.validate_newer_step(step, None)
        self.last_step = step - 1 if step > 0 else None
        self._force_full = self._resumed = True

    # -- sender --------------------------------------------------------

    def send(  # type: ignore[override]
        self,
        named_tensors: Mapping[str, torch.Tensor],
        *,
        step: int,
        trace_context: Mapping[str, str] | None = None,
    ) -> DeltaSyncResult:
        """Sync ``named_tensors`` as version ``step`` to every receiver (full or delta).

        Raises:
            ValueError: ``step`` is not newer than the last one sent (nothing sent).
            BroadcastTimeoutError, BroadcastError: as :meth:`WeightBroadcaster.send`.
        """
        if not self.is_sender:
            raise BroadcastError(f"rank {self.group.rank} is not the sender (src={self.src})")
        wire.validate_newer_step(step, self.last_step)
        items = list(named_tensors.items())
        meta = tensor_meta(items)
        validate_unique_names(meta)
        tensors = [t.detach() for _, t in items]
        state_bytes = sum(m.nbytes for m in meta)
        phases: dict[str, float] = {"snapshot": self._settle_base()}
        want_full = (
            self._force_full
            or self._base is None
            or self._base_meta != meta
            or self._since_full + 1 >= self.full_every
        )
        t0 = time.perf_counter()
        encoded = None
        if not want_full:
            # Encoded before the offer: a delta that would not save much goes whole.
            assert self._base is not None
            try:
                encoded = delta.encode_delta(tensors, self._base, chunk_bytes=self.bucket_bytes)
            except ValueError:  # a dtype without an integer twin (complex128): sent whole
                want_full = True
            else:
                phases["encode"] = time.perf_counter() - t0
                want_full = encoded[0].nbytes > MAX_DELTA_FRACTION * state_bytes
        base_step = -1 if self.last_step is None or self._resumed else self.last_step
        offer = _RESUME if self._resumed else (_FULL if want_full else _DELTA_OK)
        attrs = {
            span_attr.STEP: step,
            span_attr.BYTES: state_bytes,
            span_attr.RANK: self.group.rank,
        }
        with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
            sp.set_attribute(span_attr.BACKEND, self.group.backend)
            sp.set_attribute(span_attr.METHOD, "broadcast")
            deadline = self.group.deadline(self.timeout_s)
            with self._failing("sending"):
                self._send_small([DELTA_MAGIC, step, base_step, offer], deadline)
                vote = self._min([1, _NONE], deadline)
            full = want_full or vote[0] == 0
            sp.set_attribute(span_attr.MODE, "full" if full else "delta")
            fraction: float | None = None
            if full:
                if self._resumed:
                    self.last_step = None
                result = WeightBroadcaster.send(self, items, step=step)
                phases["wire"] = result.seconds
                sent = result.nbytes
                t = time.perf_counter()
                self._keep_base(tensors, meta)
                phases["snapshot"] += time.perf_counter() - t
            with self._failing("sending"):
                if not full:
                    assert encoded is not None
                    plan, payload = encoded
                    t = time.perf_counter()
                    self._send_delta(plan, payload, deadline)
                    phases["wire"] = time.perf_counter() - t
                    sent = plan.nbytes
                    fraction = plan.fraction
                    self.last_step = step
                t = time.perf_counter()
                picked = delta.digest_indices(meta, step, sample=self.digest_tensors, full=full)
                digests = [(i, delta.digest(tensors[i])) for i in picked]
                phases["verify"] = time.perf_counter() - t
                self._send_obj(digests, deadline)  # taken once every receiver has applied
                res = self._min([OK, _NONE, 0, 0, 0], deadline)
            if not full:
                # The base moves to this version after the sync, while training goes on;
                # the next sync waits for it (its snapshot phase).
                self._moving = self._background.submit(self._move_base, plan, payload)
            status, oldest = int(res[0]), int(res[1])
            phases["apply"] = -int(res[2]) / 1e6
            phases["verify"] = max(phases["verify"], -int(res[3]) / 1e6)
            pause = -int(res[4]) / 1e6
            corrupt = _CHECKS.get(status)
            sp.set_attribute(span_attr.BYTES, sent)
            if corrupt is not None:
                sp.set_attribute("obsckpt.corrupt", corrupt)
        self._resumed = False
        if status != OK:
            self._force_full = True
        else:
            self._force_full = False
            self._since_full = 0 if full else self._since_full + 1
        seconds = time.perf_counter() - t0
        out = DeltaSyncResult(
            step=step,
            encoding="full" if full else "delta",
            seconds=seconds,
            sent_bytes=sent,
            state_bytes=state_bytes,
            changed_fraction=fraction,
            phases=phases,
            pause_s=pause,
            rollout_version=None if oldest >= _NONE else oldest,
            corrupt=corrupt,
        )
        if not full:
            self.telemetry.broadcast(self.group.backend, seconds, sent, "broadcast")
        self.telemetry.weight_sync(_report(out))
        return out

    def _move_base(self, plan: delta.DeltaPlan, payload: torch.Tensor) -> None:
        assert self._base is not None
        delta.apply_delta(self._base, plan, payload)

    def _settle_base(self) -> float:
        """Wait for the base's move to the last version; seconds waited. A move that
        failed leaves no base: the next sync is full."""
        moving, self._moving = self._moving, None
        if moving is None:
            return 0.0
        t = time.perf_counter()
        try:
            moving.result()
        except Exception as exc:  # noqa: BLE001 - the next sync is full instead
            logger.warning(
                "obsckpt: the delta base could not be moved (%s); next sync is full", exc
            )
            self._base = self._base_meta = None
        return time.perf_counter() - t

    def close(self) -> None:
        """Let go of the sender's base copy and helper thread (the group stays the caller's)."""
        self._settle_base()
        self._background.shutdown(wait=True)
        self._base = self._base_meta = None
        self._held = self._held_meta = None

    def _keep_base(self, tensors: list[torch.Tensor], meta: list[TensorMeta]) -> None:
        """Copy the version just sent, beside it: the base of the next delta."""
        base = self._base
        if base is None or self._base_meta != meta:
            # Where the weights live: a GPU's delta is found on the GPU.
            base = [
                torch.empty(m.shape, dtype=m.dtype, device=t.device)
                for m, t in zip(meta, tensors, strict=True)
            ]
        for dst, src in zip(base, tensors, strict=True):
            dst.copy_(src)
        self._base, self._base_meta = base, meta

    def _send_delta(self, plan: delta.DeltaPlan, payload: torch.Tensor, deadline: float) -> None:
        self._send_obj(plan.to_wire(), deadline)
        data = payload.to(self.group.device)
        for chunk in delta.chunk_views(data, plan):
            self._broadcast_now(chunk, deadline, "delta chunk")

    # -- receiver ------------------------------------------------------

    def recv(  # type: ignore[override]
        self,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        trace_context: Mapping[str, str] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Receive one sync into the weights this receiver holds; returns them (``{name: tensor}``).

        The first sync (and any full one) is received as :meth:`WeightBroadcaster.recv`
        receives: into ``into``'s tensors, or the receive area. A delta is
        written into the tensors of the last sync, in place.

        Raises:
            WeightSyncCorruptError: a chunk failed its check (nothing applied) or a
                digest differed after the apply; the version stays, the group is usable.
            BroadcastError: an older step was refused, or the group broke.
        """
        if self.is_sender:
            raise BroadcastError(f"rank {self.group.rank} is the sender; call send()")
        t0 = time.perf_counter()
        deadline = self.group.deadline(self.timeout_s)
        attrs = {span_attr.RANK: self.group.rank, span_attr.METHOD: "broadcast"}
        held_before, valid_before = self.last_step, self.weights_valid
        with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
            with self._failing("receiving"):
                offer = self._recv_small(4, deadline)
                if offer[0] != DELTA_MAGIC:
                    self.group.mark_broken("received an offer that is not a delta sync's")
                    raise BroadcastError(
                        f"the first message was not a delta sync's offer (magic {offer[0]:#x}); "
                        "sender and receivers disagree on the protocol (use DeltaBroadcaster on "
                        "every member), the group is now broken"
                    )
                step, base_step, kind = offer[1], offer[2], offer[3]
                want_full = kind != _DELTA_OK
                if kind == _RESUME:
                    # The sender's run was rolled back to a checkpoint: versions restart.
                    self.last_step = None
                sp.set_attribute(span_attr.STEP, step)
                takes_delta = (
                    self._held is not None
                    and self.weights_valid
                    and self.last_step == base_step
                    and (into is None or all(into.get(n) is t for n, t in self._held.items()))
                )
                mine = -1 if self.last_step is None else self.last_step
                vote = self._min([int(takes_delta), mine], deadline)
            full = want_full or vote[0] == 0
            sp.set_attribute(span_attr.MODE, "full" if full else "delta")
            status, apply_s, refused = OK, 0.0, None
            if full:
                try:
                    got = WeightBroadcaster.recv(self, into=into)
                    self._held, self._held_meta = got, tensor_meta(got.items())
                except BroadcastError as exc:
                    if self.group.broken is not None:
                        raise
                    refused, status = exc, NOT_TAKEN
            with self._failing("receiving"):
                if not full:
                    status, apply_s = self._recv_delta(step, deadline)
                t = time.perf_counter()
                sent_digests = self._recv_obj(deadline)
                if status == OK:
                    status = self._verify(sent_digests)
                verify_s = time.perf_counter() - t
                if status in (DIGEST, CHECKSUM):
                    self.last_step, self.weights_valid = (
                        held_before,
                        status == CHECKSUM and valid_before,
                    )
                pause = time.perf_counter() - t0
                mine = -1 if self.last_step is None else self.last_step
                self._min([status, mine, -_us(apply_s), -_us(verify_s), -_us(pause)], deadline)
            if status in _CHECKS:
                sp.set_attribute("obsckpt.corrupt", _CHECKS[status])
        if refused is not None:
            raise refused
        if status in _CHECKS:
            self._refuse(
                WeightSyncCorruptError(
                    f"the weights of step {step} failed their {_CHECKS[status]} check on rank "
                    f"{self.group.rank}: "
                    + (
                        "a chunk of the delta did not match its CRC32, nothing was applied"
                        if status == CHECKSUM
                        else "after the apply, a tensor's CRC32 differs from the sender's "
                        "(weights_valid is False)"
                    )
                    + f"; this receiver keeps step {held_before}, the next sync is a full one, "
                    "and the group is still usable"
                )
            )
        assert self._held is not None
        return self._held

    def _recv_delta(self, step: int, deadline: float) -> tuple[int, float]:
        plan = delta.DeltaPlan.from_wire(self._recv_obj(deadline))
        payload = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.group.device)
        for chunk in delta.chunk_views(payload, plan):
            self._broadcast_now(chunk, deadline, "delta chunk")
        t = time.perf_counter()
        assert self._held is not None and self._held_meta is not None
        if delta.check_chunks(payload, plan):
            return CHECKSUM, time.perf_counter() - t
        try:
            delta.check_plan(plan, self._held_meta, payload.numel())
        except ValueError:
            return CHECKSUM, time.perf_counter() - t
        targets = [self._held[m.name] for m in self._held_meta]
        self._writing = True
        self.weights_valid = False
        with torch.no_grad():
            delta.apply_delta(targets, plan, payload)
        self.weights_valid = True
        self._writing = False
        self.last_step = step
        return OK, time.perf_counter() - t

    def _verify(self, digests: list[tuple[int, int]]) -> int:
        assert self._held is not None and self._held_meta is not None
        for i, want in digests:
            if delta.digest(self._held[self._held_meta[i].name]) != want:
                return DIGEST
        return OK

    # -- small messages ------------------------------------------------

    def _send_small(self, values: list[int], deadline: float) -> None:
        t = torch.tensor(values, dtype=torch.int64).to(self.group.device)
        self._broadcast_now(t, deadline, "offer")

    def _recv_small(self, n: int, deadline: float) -> list[int]:
        t = torch.empty(n, dtype=torch.int64, device=self.group.device)
        self._broadcast_now(t, deadline, "offer")
        return [int(x) for x in t.cpu().tolist()]

    def _send_obj(self, obj: Any, deadline: float) -> None:
        raw = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._send_small([len(raw)], deadline)
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.group.device)
        self._broadcast_now(body, deadline, "delta header")

    def _recv_obj(self, deadline: float) -> Any:
        (n,) = self._recv_small(1, deadline)
        body = torch.empty(n, dtype=torch.uint8, device=self.group.device)
        self._broadcast_now(body, deadline, "delta header")
        return pickle.loads(body.cpu().numpy().tobytes())  # noqa: S301 - the group's own sender

    def _min(self, values: list[int], deadline: float) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64).to(self.group.device)
        self._issued = True
        work = self.group.min_async(t, deadline)
        self.group.wait(
            work, deadline, lambda timed_out: self._progress("vote", 0, 1, None, timed_out)
        )
        return [int(x) for x in t.cpu().tolist()]


def _us(seconds: float) -> int:
    return int(seconds * 1e6)


def _report(r: DeltaSyncResult) -> dict[str, Any]:
    return {
        "method": "broadcast",
        "step": r.step,
        "encoding": r.encoding,
        "phases": r.phases,
        "sent_bytes": r.sent_bytes,
        "state_bytes": r.state_bytes,
        "changed_fraction": r.changed_fraction,
        "pause_s": r.pause_s,
        "rollout_version": r.rollout_version,
        "corrupt": r.corrupt,
    }
