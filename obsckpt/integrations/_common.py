"""What the verl FSDP and Megatron helpers share: ranks, the engine's tensors, upload, broadcast.

:mod:`~obsckpt.integrations.verl_fsdp` and
:mod:`~obsckpt.integrations.verl_megatron` differ in how they save a
checkpoint and gather the model's tensors; once gathered, the tensors are
uploaded to the Synchronizer (memory sync) or broadcast from trainer rank 0
(weight sync) the same way, here. Both modules import from this one, never
from each other; their public names stay importable from where they were.

Nothing here imports verl.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from obsckpt.save_threads import STALL_WARNING_S, wait_watched
from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.buckets import TensorMeta
from obsckpt.sync.group import WeightSyncGroup
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.sync.wire import BroadcastResult
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing

_log = logging.getLogger(__name__)

# One broadcaster (and its reusable buffers) per weight-sync group, kept on the group:
# a broadcaster holds its group, so a map keyed weakly by the group would keep both.
_BROADCASTER_ATTR = "_obsckpt_broadcaster"


# ----------------------------------------------------------------------
# Ranks and the engine's tensors
# ----------------------------------------------------------------------


def dist_rank(engine: Any = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(getattr(engine, "rank", 0) or 0)


def dist_world_size(engine: Any = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(getattr(engine, "world_size", 1) or 1)


def per_tensor_params(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``engine.get_per_tensor_param()`` as an iterator of ``(name, tensor)`` pairs."""
    out = engine.get_per_tensor_param()
    # verl 0.9 returns (iterator, peft_config); older engines return the iterator itself.
    if isinstance(out, tuple) and len(out) == 2 and not isinstance(out[0], str):
        out = out[0]
    return iter(out)


def already_committed(
    coordinator: Any, global_step: int, log: logging.Logger, *, is_state_dict: bool = True
) -> bool:
    """True (logged) when the monitor has committed ``global_step`` or a later step of the kind.

    The kind is the state dict by default, the full checkpoint with ``is_state_dict=False``.
    """
    latest = coordinator.committed_step(is_state_dict=is_state_dict)
    if latest is None or global_step > latest:
        return False
    log.info(
        "obsckpt: %s of step %d not saved again: the monitor has committed step %d "
        "and a re-save would change files the iteration file vouches for",
        "state dict" if is_state_dict else "checkpoint",
        global_step,
        latest,
    )
    return True


# ----------------------------------------------------------------------
# Memory sync
# ----------------------------------------------------------------------


def gather_full_state_dict(
    named_tensors: Iterable[tuple[str, torch.Tensor]], keep: bool
) -> dict[str, torch.Tensor]:
    """Materialise full tensors on CPU when ``keep`` (rank 0); just drive the collectives otherwise."""
    out: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        if keep:
            # A copy: a tensor that was never sharded is the live parameter itself.
            out[name] = t.detach().to("cpu", copy=True)
    return out


def hand_to_synchronizer(ref: Any, what: str, log: logging.Logger | None = None) -> Any:
    """``ray.get(ref)`` of a Synchronizer call, watched: a warning every ``STALL_WARNING_S``.

    The call may take as long as the Synchronizer's own waits (a sync the rollout
    side has not finished), so it has no bound of obsckpt's; a stuck one is named
    in the log (``what``, the time waited) instead of hanging the trainer in silence.
    """
    import ray

    wait_watched(
        lambda t: bool(ray.wait([ref], timeout=t)[0]),
        None,
        lambda: f"the Synchronizer to {what}",
        warn_every=STALL_WARNING_S,
        log=log or _log,
    )
    return ray.get(ref)


def upload_state_dict(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    synchronizer: Any,
    global_step: int,
    *,
    rank: int,
    logger: logging.Logger | None = None,
    trace_context: dict[str, str] | None = None,
) -> float | None:
    """Gather ``named_tensors`` and, on rank 0, publish them as version ``global_step``.

    Every rank must call it (gathering full tensors is a collective). Rank 0
    traces the upload (``obsckpt.upload``) and reports its duration through
    the Synchronizer. Returns the seconds it took on rank 0, else None.
    """
    if rank != 0:
        gather_full_state_dict(named_tensors, keep=False)
        return None

    def publish() -> tuple[int, int]:
        state_dict = gather_full_state_dict(named_tensors, keep=True)
        hand_to_synchronizer(
            synchronizer.set_model_state_dict.remote(state_dict, global_step),
            f"take the weights of step {global_step}",
            logger or _log,
        )
        return len(state_dict), sum(t.numel() * t.element_size() for t in state_dict.values())

    return _timed_upload(publish, synchronizer, global_step, rank, logger, trace_context)


def upload_staged_shards(
    staged: Any,
    synchronizer: Any,
    global_step: int,
    *,
    rank: int,
    world_size: int,
    logger: logging.Logger | None = None,
) -> float | None:
    """Publish this rank's shard from ``staged``'s snapshot (a
    :class:`~obsckpt.slot_staging.StagedSave`; the Synchronizer merges every
    rank's, see :mod:`obsckpt.sync.shard_publish`), traced as
    :func:`upload_state_dict`. Every rank must call it. Returns the seconds it
    took on rank 0, else None.
    """
    from obsckpt.sync.shard_publish import publish_staged_shards, snapshot_size

    def publish() -> tuple[int, int]:
        with staged.hold() as snapshot:
            sizes = snapshot_size(snapshot)
        publish_staged_shards(synchronizer, staged, global_step, rank=rank, world_size=world_size)
        return sizes

    return _timed_upload(publish, synchronizer, global_step, rank, logger, None, shards=world_size)


def _timed_upload(
    publish: Any,
    synchronizer: Any,
    global_step: int,
    rank: int,
    logger: logging.Logger | None,
    trace_context: dict[str, str] | None,
    *,
    shards: int = 0,
) -> float | None:
    """Run ``publish`` (returning the tensors and bytes it sent) in an ``obsckpt.upload``
    span; rank 0 reports and logs the seconds it took and returns them."""
    log = logger or _log
    attrs = {span_attr.STEP: global_step, span_attr.RANK: rank}
    t0 = time.perf_counter()
    with tracing.span("obsckpt.upload", carrier=trace_context, attributes=attrs) as sp:
        count, nbytes = publish()
        sp.set_attribute(span_attr.BYTES, nbytes)
    seconds = time.perf_counter() - t0
    if rank != 0:
        return None
    try:
        synchronizer.record_upload.remote(seconds)
    except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
        log.warning("obsckpt: could not report the upload duration: %s", exc)
    log.info(
        "obsckpt: uploaded %d tensors (%.1f MiB%s) of step %d to the synchronizer in %.2f s",
        count,
        nbytes / 2**20,
        f" on rank 0, one of {shards} shards" if shards else "",
        global_step,
        seconds,
    )
    return seconds


def upload_engine_state_dict(
    engine: Any,
    synchronizer: Any,
    global_step: int,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict[str, str] | None = None,
) -> float | None:
    """Upload the state dict ``engine.get_per_tensor_param()`` yields (memory sync); call on every rank."""
    return upload_state_dict(
        per_tensor_params(engine),
        synchronizer,
        global_step,
        rank=dist_rank(engine),
        logger=logger,
        trace_context=trace_context,
    )


# ----------------------------------------------------------------------
# Broadcast
# ----------------------------------------------------------------------


def broadcaster_for(group: WeightSyncGroup, **kwargs: Any) -> WeightBroadcaster:
    """The broadcaster kept for ``group`` (created with ``kwargs`` the first time)."""
    b = getattr(group, _BROADCASTER_ATTR, None)
    if b is None:
        b = WeightBroadcaster(group, **kwargs)
        setattr(group, _BROADCASTER_ATTR, b)
    return b


def broadcast_named_tensors(
    meta: list[TensorMeta],
    named: Iterator[tuple[str, torch.Tensor]],
    model_update_group: Any,
    *,
    rank: int,
    step: int | None = None,
    trace_context: dict[str, str] | None = None,
    metrics: Any = None,
    monitor: Any = None,
) -> BroadcastResult | None:
    """Send ``named`` from trainer rank 0; other ranks only drive the gathering collectives.

    ``model_update_group`` is a :class:`WeightBroadcaster`, a
    :class:`WeightSyncGroup` (bucketed) or a ``torch.distributed`` process
    group in which trainer rank 0 is rank 0 (one ``broadcast`` per tensor, the
    reference behaviour). Ranks other than 0 may pass None.
    """
    if rank != 0:
        for _ in named:
            pass
        return None
    if isinstance(model_update_group, WeightSyncGroup):
        model_update_group = broadcaster_for(model_update_group, metrics=metrics, monitor=monitor)
    if isinstance(model_update_group, WeightBroadcaster):
        return model_update_group.send(named, meta=meta, step=step, trace_context=trace_context)
    if model_update_group is None:
        raise ValueError("trainer rank 0 needs a model_update_group to broadcast to")
    # A torch.distributed group: one synchronous broadcast per tensor.
    nbytes = sum(m.nbytes for m in meta)
    backend = str(dist.get_backend(model_update_group))
    attrs = {span_attr.STEP: step, span_attr.BYTES: nbytes, span_attr.RANK: rank}
    with tracing.span("obsckpt.broadcast", carrier=trace_context, attributes=attrs):
        t0 = time.perf_counter()
        count = 0
        for _name, t in named:
            dist.broadcast(
                t.contiguous(),
                src=dist.get_global_rank(model_update_group, 0),
                group=model_update_group,
            )
            count += 1
        seconds = time.perf_counter() - t0
    WeightSyncTelemetry(metrics=metrics, monitor=monitor).broadcast(backend, seconds, nbytes)
    return BroadcastResult(seconds, nbytes, count, count, backend, "per_tensor")
