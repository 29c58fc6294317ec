"""Colocated weight sync: trainer and rollout share a device and hand over buffers, not bytes.

When the rollout engine runs on the trainer's GPU (verl's hybrid engine),
sending the weights through a collective is wasted work: both processes can
map the same device memory. :class:`IpcWeightSender` packs the model into
bucket buffers of its own (one dtype per bucket, the plan of
:func:`~obsckpt.sync.broadcast.plan_buckets`), and hands the rollout process
a small :class:`IpcPayload`: the tensors' names, dtypes and shapes, the step,
and a handle per bucket. :class:`IpcWeightReceiver` opens the handles (once
per buffer; they are reused from one sync to the next) and copies the
tensors into its own weights.

On CUDA a handle is a CUDA IPC handle (``torch.multiprocessing.reductions``);
on the CPU it is a file in shared memory (``/dev/shm``) that both processes
map, so the same protocol runs, and is tested, without a GPU. The payload
travels however the caller likes (a Ray actor call in the demo); the sender
waits for the receiver's acknowledgement within ``timeout_s``.

The same checks as a broadcast: the step must be newer than the last one
sent (and received); a payload that reaches the receiver after the sender's
deadline is refused (the sender may already be rewriting its buffers), and
so is one whose copy finishes after it. Each sync is timed into
``obsckpt_broadcast_duration_seconds{method="ipc"}`` (backend ``cuda_ipc`` or
``shm``), counted on failure, and traced as an ``obsckpt.broadcast`` span.

The sender keeps one device copy of the model's bytes (its buckets) between
syncs; :meth:`IpcWeightSender.close` frees it.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from obsckpt.sync.broadcast import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT_S,
    BroadcastError,
    BroadcastResult,
    BroadcastTimeoutError,
    Bucket,
    TensorMeta,
    WeightSyncTelemetry,
    plan_buckets,
    tensor_meta,
)
from obsckpt.telemetry import tracing

logger = logging.getLogger(__name__)

METHOD = "ipc"
_PAYLOAD_VERSION = 1


@dataclass(frozen=True, slots=True)
class IpcPayload:
    """What the rollout process needs to take one version of the weights (picklable)."""

    version: int
    step: int
    backend: str  # "cuda_ipc" or "shm"
    bucket_bytes: int
    meta: tuple[tuple[str, str, tuple[int, ...]], ...]
    handles: tuple[Any, ...]  # one per bucket, in plan order
    deadline: float  # wall-clock seconds; the sender may rewrite its buffers after it
    device_uuid: str | None = None
    trace_context: dict[str, str] | None = None

    @property
    def nbytes(self) -> int:
        return sum(TensorMeta.from_wire(m).nbytes for m in self.meta)


def _device_uuid(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


class IpcWeightSender:
    """Trainer side of the colocated sync: packs buckets, hands out their handles.

    Args:
        device: where the buckets live (a CUDA device for CUDA IPC; the CPU uses
            shared-memory files). Default: the current CUDA device, else CPU.
        bucket_bytes: bucket size; a tensor of at least this size gets a bucket alone.
        timeout_s: bound on one sync, acknowledgement included.
        metrics: an :class:`obsckpt.telemetry.metrics.Metrics` to record into.
        monitor: the monitor actor handle, to record through its RPCs.
        shm_dir: where the CPU fallback puts its shared-memory files.
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
    ) -> None:
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
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s = float(timeout_s)
        self.telemetry = WeightSyncTelemetry(metrics=metrics, monitor=monitor)
        default_shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        self.shm_dir = shm_dir or default_shm
        self._plan_key: tuple | None = None
        self._plan: list[Bucket] = []
        self._buffers: list[torch.Tensor] = []
        self._handles: tuple[Any, ...] = ()
        self._paths: list[str] = []
        self._uuid = _device_uuid(self.device)
        self.last_step: int | None = None
        self._version = 0

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        deliver: Callable[[IpcPayload], Any],
        *,
        step: int,
        trace_context: Mapping[str, str] | None = None,
    ) -> BroadcastResult:
        """Pack the tensors, ``deliver`` the payload to the rollout side, wait for its answer.

        ``deliver`` returns the receiver's acknowledgement, or a Ray
        ``ObjectRef`` of it (e.g. ``lambda p: rollout.receive_ipc.remote(p)``);
        the receiver's :meth:`IpcWeightReceiver.recv` returns what it needs.

        Raises:
            ValueError: ``step`` is not newer than the last step sent.
            BroadcastTimeoutError: no acknowledgement within ``timeout_s``.
            BroadcastError: the receiver failed or refused the payload.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(
                f"step {step} is not newer than step {self.last_step}, the last one sent; "
                "weight versions never go backwards"
            )
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        meta = tensor_meta(items)
        nbytes = sum(m.nbytes for m in meta)
        attrs = {"obsckpt.step": step, "obsckpt.bytes": nbytes, "obsckpt.method": METHOD}
        try:
            with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs) as sp:
                sp.set_attribute("obsckpt.backend", self.backend)
                t0 = time.perf_counter()
                deadline_mono = time.monotonic() + self.timeout_s
                self._pack(items, meta)
                self._version += 1
                payload = IpcPayload(
                    version=_PAYLOAD_VERSION,
                    step=step,
                    backend=self.backend,
                    bucket_bytes=self.bucket_bytes,
                    meta=tuple(m.to_wire() for m in meta),
                    handles=self._handles,
                    deadline=time.time() + self.timeout_s,
                    device_uuid=self._uuid,
                    trace_context=tracing.inject() or None,
                )
                ack = self._await(deliver(payload), deadline_mono)
                if not isinstance(ack, Mapping) or ack.get("step") != step:
                    raise BroadcastError(
                        f"the rollout side answered {ack!r} to the weights of step {step}; "
                        "it must return IpcWeightReceiver.recv's acknowledgement"
                    )
                seconds = time.perf_counter() - t0
        except BroadcastError as exc:
            if self.telemetry:
                self.telemetry.failure(self.backend, METHOD, exc)
            raise
        self.last_step = step
        self.telemetry.broadcast(self.backend, seconds, nbytes, METHOD)
        return BroadcastResult(seconds, nbytes, len(meta), len(self._plan), self.backend, METHOD)

    def _pack(self, items: list[tuple[str, torch.Tensor]], meta: list[TensorMeta]) -> None:
        key = (self.bucket_bytes, tuple(meta))
        if key != self._plan_key:
            self._allocate(plan_buckets(meta, self.bucket_bytes))
            self._plan_key = key
        with torch.no_grad():
            for bucket, buf in zip(self._plan, self._buffers, strict=True):
                out = buf[: bucket.nbytes].view(bucket.dtype)
                parts = [items[i][1].detach().reshape(-1) for i in bucket.indices]
                if len(parts) == 1:
                    out.copy_(parts[0])
                else:
                    torch.cat(
                        [p if p.device == self.device else p.to(self.device) for p in parts],
                        out=out,
                    )
        if self.device.type == "cuda":
            # The receiver reads on its own stream: the buckets must be complete first.
            torch.cuda.synchronize(self.device)

    def _allocate(self, plan: list[Bucket]) -> None:
        self._free()
        self._plan = plan
        buffers, handles = [], []
        for bucket in plan:
            size = max(bucket.nbytes, 1)
            if self.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                handles.append(("cuda", reduce_tensor(buf)))
            else:
                path = os.path.join(self.shm_dir, f"obsckpt-ipc-{os.getpid()}-{uuid.uuid4().hex}")
                with open(path, "wb") as f:
                    f.truncate(size)
                self._paths.append(path)
                buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
                handles.append(("shm", path, size))
            buffers.append(buf)
        self._buffers = buffers
        self._handles = tuple(handles)

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
            raise BroadcastError(
                f"ipc weight sync ({self.backend}) failed on the rollout side: {exc}"
            ) from exc

    def _free(self) -> None:
        self._buffers = []
        self._handles = ()
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths = []

    def close(self) -> None:
        """Free the buckets (and their shared-memory files)."""
        self._free()
        self._plan_key = None
        self.telemetry.flush(10.0)

    def __del__(self) -> None:
        try:
            self._free()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


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
        self._opened: dict[Any, torch.Tensor] = {}
        self._area: dict[str, torch.Tensor] = {}
        self.last_step: int | None = None
        self.last_seconds: float | None = None

    def recv(
        self,
        payload: IpcPayload,
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        clone: bool = False,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Take the weights of ``payload``: ``(acknowledgement, {name: tensor})``.

        The tensors are this receiver's own (the sender's buffers are reused):
        by default a receive area overwritten in place by the next sync;
        ``clone=True`` gives fresh tensors; ``into`` fills the given tensors.
        Return the acknowledgement to the sender.

        Raises:
            BroadcastError: an older step, a payload from another obsckpt, or
                another device.
            BroadcastTimeoutError: the payload arrived, or its copy ended,
                after the sender's deadline.
        """
        t0 = time.perf_counter()
        attrs = {"obsckpt.step": payload.step, "obsckpt.method": METHOD}
        with tracing.span(
            "obsckpt.broadcast", carrier=payload.trace_context, attributes=attrs
        ) as sp:
            sp.set_attribute("obsckpt.backend", payload.backend)
            if payload.version != _PAYLOAD_VERSION:
                raise BroadcastError(
                    f"unsupported ipc payload version {payload.version}; run the same obsckpt "
                    "version on both sides"
                )
            if self.last_step is not None and payload.step <= self.last_step:
                raise BroadcastError(
                    f"refusing the weights of step {payload.step}: this rollout already holds "
                    f"step {self.last_step} and versions never go backwards"
                )
            self._check_deadline(payload, "arrived")
            meta = [TensorMeta.from_wire(m) for m in payload.meta]
            sp.set_attribute("obsckpt.bytes", sum(m.nbytes for m in meta))
            plan = plan_buckets(meta, payload.bucket_bytes)
            if len(plan) != len(payload.handles):
                raise BroadcastError(
                    f"the payload has {len(payload.handles)} buckets, its metadata plans "
                    f"{len(plan)}; sender and receiver disagree on the protocol"
                )
            out: dict[str, torch.Tensor] = {}
            for bucket, handle in zip(plan, payload.handles, strict=True):
                flat = self._open(handle, payload)[: bucket.nbytes].view(bucket.dtype)
                for i, off in zip(bucket.indices, bucket.offsets, strict=True):
                    m = meta[i]
                    src = flat[off : off + m.numel].view(m.shape)
                    out[m.name] = self._land(m, src, into, clone)
            devices = {t.device for t in out.values() if t.is_cuda}
            for d in devices:
                torch.cuda.synchronize(d)
            # Copied after the deadline: the sender may have begun rewriting its buckets.
            self._check_deadline(payload, "was copied")
            self.last_step = payload.step
            self.last_seconds = time.perf_counter() - t0
        ack = {"step": payload.step, "nbytes": sum(m.nbytes for m in meta)}
        return ack, out

    def _check_deadline(self, payload: IpcPayload, what: str) -> None:
        late = time.time() - payload.deadline
        if late > 0:
            raise BroadcastTimeoutError(
                f"the weights of step {payload.step} {what} {late:.2f} s after the sender's "
                "deadline; the sender has given up on this sync and may be rewriting its "
                "buffers, so they are not used"
            )

    def _open(self, handle: Any, payload: IpcPayload) -> torch.Tensor:
        key = handle[1] if handle[0] == "shm" else (handle[1][1][7], payload.device_uuid)
        buf = self._opened.get(key)
        if buf is not None:
            return buf
        if handle[0] == "shm":
            _, path, size = handle
            buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        elif handle[0] == "cuda":
            rebuild, args = handle[1]
            device = self.device or torch.device("cuda", torch.cuda.current_device())
            mine = _device_uuid(device)
            if payload.device_uuid is not None and mine != payload.device_uuid:
                raise BroadcastError(
                    f"the sender's buckets are on GPU {payload.device_uuid}, this rollout "
                    f"runs on {mine}; the ipc method needs both on the same GPU (use "
                    "sync_method='broadcast' across GPUs)"
                )
            args = list(args)
            args[6] = device.index  # the sender's index may name another device here
            buf = rebuild(*args)
        else:
            raise BroadcastError(f"unknown ipc handle kind {handle[0]!r}")
        self._opened[key] = buf
        return buf

    def _land(self, m: TensorMeta, src: torch.Tensor, into, clone: bool) -> torch.Tensor:
        device = self.device or src.device
        if into is not None and m.name in into:
            dst = into[m.name]
            if tuple(dst.shape) != m.shape:
                raise BroadcastError(
                    f"{m.name!r}: sent {m.shape}, into= has {tuple(dst.shape)}; pass tensors "
                    "of the sender's shapes"
                )
            dst.copy_(src)
            return dst
        if clone:
            return src.to(device, copy=True)
        dst = self._area.get(m.name)
        if dst is None or dst.shape != src.shape or dst.dtype != src.dtype or dst.device != device:
            dst = self._area[m.name] = torch.empty(m.shape, dtype=m.dtype, device=device)
        dst.copy_(src)
        return dst

    def close(self) -> None:
        """Unmap the sender's buffers and drop the receive area."""
        self._opened.clear()
        self._area.clear()
