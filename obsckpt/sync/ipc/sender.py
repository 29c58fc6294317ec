"""Trainer side of the colocated sync: hands out handles to its tensors or buckets.

:class:`IpcWeightSender` is the transport: it builds each sync's payload,
delivers it, waits for the receiver's acknowledgement (and its copy) within
the deadline, and keeps the version rule. How the tensors are laid out for
the receiver (direct storages or buckets) is its base class's,
:class:`~obsckpt.sync.ipc.layouts.SenderLayouts`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from obsckpt.errors import BroadcastError, BroadcastTimeoutError, IpcLayoutUnknownError
from obsckpt.sync.buckets import DEFAULT_BUCKET_BYTES
from obsckpt.sync.group import DEFAULT_TIMEOUT_S
from obsckpt.sync.ipc import streams
from obsckpt.sync.ipc.layouts import SenderLayouts
from obsckpt.sync.ipc.payload import METHOD, PAYLOAD_VERSION, IpcPayload, device_uuid
from obsckpt.sync.ipc.shm import remove_orphaned_shm
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.sync.wire import BroadcastResult, validate_newer_step
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing

__all__ = ["IpcWeightSender", "remove_orphaned_shm"]

logger = logging.getLogger(__name__)


class IpcWeightSender(SenderLayouts):
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
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive seconds, got {timeout_s!r}")
        super().__init__(device=device, bucket_bytes=bucket_bytes, shm_dir=shm_dir, layout=layout)
        self.last_layout: str | None = None
        self.timeout_s = float(timeout_s)
        self.telemetry = WeightSyncTelemetry(metrics=metrics, monitor=monitor)
        self._uuid = device_uuid(self.device)
        self.last_step: int | None = None
        # The layout id the receiver acknowledged last.
        self._acked_id: tuple[str, int] | None = None
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
        validate_newer_step(step, self.last_step)
        if isinstance(named_tensors, Mapping):
            names, tensors = list(named_tensors.keys()), list(named_tensors.values())
        else:
            pairs = list(named_tensors)
            names, tensors = [n for n, _ in pairs], [t for _, t in pairs]
        fp = self._take(names, tensors)
        nbytes = self._nbytes
        attrs = {span_attr.STEP: step, span_attr.BYTES: nbytes, span_attr.METHOD: METHOD}
        payload: IpcPayload | None = None
        try:
            with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
                sp.set_attribute(span_attr.BACKEND, self.backend)
                t0 = time.perf_counter()
                # The receiver's deadline is the sender's: set before any work.
                deadline = time.monotonic() + self.timeout_s
                layout, direct = self._prepare(tensors, fp)
                sp.set_attribute(span_attr.IPC_LAYOUT, layout)
                payload = self._payload(step, layout, direct, deadline)
                try:
                    ack = self._await(deliver(payload), deadline)
                except IpcLayoutUnknownError as exc:
                    if payload.described:
                        raise
                    # The receiver does not hold the layout (a restarted rollout):
                    # describe it again, within the same deadline.
                    logger.info("obsckpt: %s; describing the layout again", exc)
                    sp.set_attribute(span_attr.IPC_DESCRIBED_AGAIN, True)
                    self._acked_id = None
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
            layout_id=self._layout_id,
            nbytes=self._nbytes,
            ack_event=self._done[0] if self._done is not None else None,
        )
        if self._acked_id == common["layout_id"]:
            return IpcPayload(meta=(), handles=(), described=False, **common)
        handles = self._handles if layout == "buckets" else ()
        return IpcPayload(meta=self._wire, handles=handles, **direct, **common)

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

    def close(self) -> None:
        """Free the buckets (and their shared-memory files)."""
        self._release_layouts()
        self._done = None
        self.telemetry.flush(10.0)


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
