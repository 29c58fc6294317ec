"""Megatron checkpoint and weight-sync helpers for verl engines.

Drop-in for Trinity-RFT's ``trinity.trainer.verl.megatron_engine`` helpers.
Each takes the engine object (verl's ``McoreEngine``, ``engine.actor.engine``):
``engine.module`` is the Megatron model, ``engine.get_per_tensor_param()``
yields ``(name, tensor)`` pairs in HF naming (a collective across the
tensor/pipeline-parallel ranks: every rank iterates), and
``engine.save_checkpoint()`` writes a distributed checkpoint through the
engine's checkpoint manager.

Nothing here imports verl or Megatron-core.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from obsckpt.integrations.verl_fsdp import (
    _already_committed,
    all_ranks_ok,
    broadcast_named_tensors,
    dist_rank,
    per_tensor_params,
    upload_state_dict,
)
from obsckpt.sync.broadcast import BroadcastResult, TensorMeta

_log = logging.getLogger(__name__)

MODEL_SLOT = "megatron_state_dict"


def checkpoint_manager(engine: Any) -> Any:
    """The engine's checkpoint manager (verl 0.9 spells the attribute ``checkpoint_mananager``)."""
    for attr in ("checkpoint_manager", "checkpoint_mananager"):
        manager = getattr(engine, attr, None)
        if manager is not None:
            return manager
    raise AttributeError(
        f"{type(engine).__name__} has no checkpoint_manager; pass verl's McoreEngine "
        "(engine.actor.engine)"
    )


@contextmanager
def model_contents_only(manager: Any) -> Iterator[None]:
    """Make ``manager`` save only the model while inside, restoring its contents after."""
    saved = manager.checkpoint_save_contents
    manager.checkpoint_save_contents = ["model"]
    try:
        yield
    finally:
        manager.checkpoint_save_contents = saved


def megatron_save_state_dict(
    engine: Any,
    local_path: str,
    global_step: int,
    coordinator: Any,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict | None = None,
) -> int:
    """Save the actor model for checkpoint-based weight sync, synchronously; call on every rank.

    Runs the engine's own ``save_checkpoint`` (Megatron's distributed
    checkpointing has barriers, so it cannot move to a thread) with the
    checkpoint manager restricted to the model: optimizer, RNG and scheduler
    states are not needed to serve weights. Reported to the monitor once per
    step, as Trinity-RFT registers it: rank 0 saves through the coordinator's
    ``save_sync`` (a failure is reported too), the other ranks save directly,
    and all ranks agree on success inside rank 0's reported save, so it is
    reported (ok or failed) only once every rank's part is written or failed. A step whose state dict is already committed is not saved again
    (logged; 0 on every rank).

    Returns:
        The number of saves this rank reported (1 on rank 0, 0 elsewhere), for
        ``register_and_monitor(..., state_dict_thread_count=...)``.
    """
    log = logger or _log
    manager = checkpoint_manager(engine)
    if _already_committed(coordinator, global_step, log):
        return 0
    rank = dist_rank(engine)

    def save() -> None:
        error: BaseException | None = None
        try:
            with model_contents_only(manager):
                engine.save_checkpoint(local_path, global_step=global_step)
        except Exception as exc:  # noqa: BLE001 - re-raised once every rank has heard of it
            error = exc
        # Rank 0 reports only once every rank's part is written, and a failure if one is not.
        if not all_ranks_ok(error is None) and error is None:
            error = OSError(f"another rank could not save its part of step {global_step}")
        if error is not None:
            raise error

    if rank == 0:
        coordinator.save_sync(
            save, global_step, is_state_dict=True, name=MODEL_SLOT, trace_context=trace_context
        )
    else:
        save()
    log.info("obsckpt: saved the Megatron model of step %d to %s", global_step, local_path)
    return 1 if rank == 0 else 0


def megatron_upload_state_dict(
    engine: Any,
    synchronizer: Any,
    global_step: int,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict | None = None,
) -> float | None:
    """Upload the model's full state dict to the Synchronizer (memory sync); call on every rank."""
    return upload_state_dict(
        per_tensor_params(engine),
        synchronizer,
        global_step,
        rank=dist_rank(engine),
        logger=logger,
        trace_context=trace_context,
    )


def megatron_sync_weight_nccl(
    engine: Any,
    model_update_group: Any,
    *,
    meta: list[TensorMeta] | None = None,
    step: int | None = None,
    trace_context: dict | None = None,
    metrics: Any = None,
    monitor: Any = None,
) -> BroadcastResult | None:
    """Broadcast the model's parameters from trainer rank 0; call on every trainer rank.

    Every rank iterates ``get_per_tensor_param()`` (it gathers across model
    parallel ranks); rank 0 sends. Without ``meta`` rank 0 first collects the
    tensors to learn their shapes (the bucketed header precedes the data).
    """
    rank = dist_rank(engine)
    named = per_tensor_params(engine)
    if rank == 0 and meta is None:
        items = list(named)
        meta = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
        named = iter(items)
    return broadcast_named_tensors(
        meta or [],
        named,
        model_update_group,
        rank=rank,
        step=step,
        trace_context=trace_context,
        metrics=metrics,
        monitor=monitor,
    )
