"""Megatron checkpoint and weight-sync helpers for verl engines.

Drop-in for Trinity-RFT's ``trinity.trainer.verl.megatron_engine`` helpers.
Each takes the engine object (verl's ``McoreEngine``, ``engine.actor.engine``):
``engine.module`` is the Megatron model, ``engine.get_per_tensor_param()``
yields ``(name, tensor)`` pairs in HF naming (a collective across the
tensor/pipeline-parallel ranks: every rank iterates), and
``engine.save_checkpoint()`` writes a distributed checkpoint through the
engine's checkpoint manager.

What the FSDP helpers do the same way (ranks, the upload, the broadcast) is
in :mod:`obsckpt.integrations._common`. Nothing here imports verl or
Megatron-core.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from obsckpt.integrations import alone, object_steps, verl_install
from obsckpt.integrations._common import (
    already_committed,
    broadcast_named_tensors,
    dist_rank,
    dist_world_size,
    per_tensor_params,
    upload_engine_state_dict,
)
from obsckpt.options import MONITOR_ACTOR_NAME, lookup_actor
from obsckpt.store import loading
from obsckpt.store.verified_copy import VerifiedCopy
from obsckpt.sync.buckets import TensorMeta, as_tensor_meta
from obsckpt.sync.wire import BroadcastResult

if TYPE_CHECKING:
    import torch

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
    """Make ``manager`` save only the model while inside, restoring its contents after.

    On obsckpt's :class:`MegatronCheckpointManager` the save inside is also not
    reported as a checkpoint of its own: the caller reports it as a state dict.
    """
    saved = manager.checkpoint_save_contents
    manager.checkpoint_save_contents = ["model"]
    unreported = manager.unreported() if isinstance(manager, MegatronCheckpointManager) else None
    try:
        if unreported is None:
            yield
        else:
            with unreported:
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
    trace_context: dict[str, str] | None = None,
) -> int:
    """Save the actor model for checkpoint-based weight sync, synchronously; call on every rank.

    Runs the engine's own ``save_checkpoint`` (Megatron's distributed
    checkpointing has barriers, so it cannot move to a thread) with the
    checkpoint manager restricted to the model: optimizer, RNG and scheduler
    states are not needed to serve weights. Every rank saves through its
    coordinator's ``save_sync`` as one part of a single save made of
    ``world_size`` parts (a failure is reported too, and raised); the monitor
    counts the save once every rank's part has finished ok, so the step
    commits only when every part is written, and a failed part fails it. No
    collective is added to the engine's own. A step whose state dict is
    already committed is not saved again (logged; 0 on every rank).

    Returns:
        1 on rank 0 and 0 elsewhere: summed over ranks, the one save per step
        that ``register_and_monitor(..., state_dict_thread_count=1)`` registers,
        as Trinity-RFT's trainer does.
    """
    log = logger or _log
    manager = checkpoint_manager(engine)
    if already_committed(coordinator, global_step, log):
        return 0
    rank, world = dist_rank(engine), dist_world_size(engine)
    # Megatron writes local_path in place, shared by every rank (so not paths=); on an
    # s3:// root each rank writes at its scratch path, uploaded after the save.
    coordinator.check_targets(
        [local_path], global_step, True, name=MODEL_SLOT, part=rank, parts=world
    )
    where, paths = object_steps.written_at(local_path, coordinator.rank)

    def save() -> None:
        with model_contents_only(manager):
            engine.save_checkpoint(where, global_step=global_step)

    written = coordinator.save_sync(
        save,
        global_step,
        is_state_dict=True,
        name=MODEL_SLOT,
        paths=paths,
        trace_context=trace_context,
        part=rank,
        parts=world,
        unless_committed=True,
    )
    if not written:  # the step was committed after this rank's check; the monitor said so
        log.info(
            "obsckpt: Megatron model of step %d not saved: the monitor had committed it",
            global_step,
        )
        return 0
    log.info("obsckpt: saved the Megatron model of step %d to %s", global_step, local_path)
    return 1 if rank == 0 else 0


def megatron_upload_state_dict(
    engine: Any,
    synchronizer: Any,
    global_step: int,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict[str, str] | None = None,
) -> float | None:
    """Upload the model's full state dict to the Synchronizer (memory sync); call on every rank."""
    return upload_engine_state_dict(
        engine, synchronizer, global_step, logger, trace_context=trace_context
    )


def megatron_sync_weight_nccl(
    engine: Any,
    model_update_group: Any,
    *,
    meta: Iterable[TensorMeta | tuple[str, str | torch.dtype, Sequence[int]]] | None = None,
    step: int | None = None,
    trace_context: dict[str, str] | None = None,
    metrics: Any = None,
    monitor: Any = None,
) -> BroadcastResult | None:
    """Broadcast the model's parameters from trainer rank 0; call on every trainer rank.

    Every rank iterates ``get_per_tensor_param()`` (it gathers across model
    parallel ranks); rank 0 sends. Without ``meta`` rank 0 first collects the
    tensors to learn their shapes (the bucketed header precedes the data).

    Args:
        engine: verl's Megatron engine.
        model_update_group: as for :func:`~obsckpt.integrations.fsdp_sync_weight_nccl`.
        meta: ``(name, dtype, shape)`` of every tensor ``get_per_tensor_param()``
            yields, in order, to stream them: :class:`~obsckpt.sync.TensorMeta`
            entries, or tuples with the dtype named, as
            ``Synchronizer.get_state_dict_meta()`` returns them.
        step: the version sent (newer than the last one sent).
        trace_context: W3C carrier of the step's trace.
        metrics: a :class:`~obsckpt.telemetry.Metrics` to record into (rank 0).
        monitor: the monitor actor handle, to record through its RPCs (rank 0).

    Returns:
        Rank 0's :class:`~obsckpt.sync.BroadcastResult`; None on other ranks.
    """
    rank = dist_rank(engine)
    named = per_tensor_params(engine)
    listed = as_tensor_meta(meta) if meta is not None else None
    if rank == 0 and listed is None:
        items = list(named)
        listed = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
        named = iter(items)
    return broadcast_named_tensors(
        listed or [],
        named,
        model_update_group,
        rank=rank,
        step=step,
        trace_context=trace_context,
        metrics=metrics,
        monitor=monitor,
    )


# ----------------------------------------------------------------------
# Checkpoint manager
# ----------------------------------------------------------------------


def _config_value(config: Any, key: str) -> Any:
    """``config[key]`` of a mapping (dict, DictConfig) or ``config.key`` of a dataclass."""
    if config is None:
        return None
    if hasattr(config, "get"):
        return config.get(key, None)
    return getattr(config, key, None)


def _barrier() -> None:
    """Every rank of the job's process group, where there is one (Megatron's)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class MegatronCheckpointManager:
    """verl's Megatron checkpoint manager, its saves reported to and committed by the monitor.

    Built with verl's arguments (``verl_install`` rebinds the name where verl's
    Megatron engine and workers build it). Megatron's distributed checkpoint
    has barriers across ranks, so the save itself runs on the calling thread
    (``CheckpointCoordinator.save_sync``), as the helpers above do: this rank
    registers one checkpoint save with the monitor first, the monitor is
    notified when it starts and when it ends (a failure too), and the step
    commits only when every rank's save is done and the trainer submitted it.
    verl's own rotation is not given ``max_ckpt_to_keep`` (it deletes before
    the new save is committed); retention keeps the latest committed step and
    anything newer, as the FSDP manager's does. Other attributes are verl's,
    read and written on verl's manager. Megatron's asynchronous save
    (``checkpoint.async_save``) is refused: it returns before its files are
    written, so the step would commit early.

    Args:
        *args, **kwargs: verl's ``MegatronCheckpointManager`` arguments.
        base_class: the manager class wrapped (default: verl's, which needs
            Megatron-core).
        ray_namespace, monitor, coordinator: as :class:`FSDPCheckpointManager`.
        save_timeout: passed to the default coordinator.
        commit_steps: as :class:`FSDPCheckpointManager`'s: submit each step saved
            here (no trainer does), and a load of one waits for its commit.

    Raises:
        ValueError: verl's checkpoint config asks for ``async_save``.
        RuntimeError: neither ``monitor`` nor ``coordinator`` is given and no
            monitor runs in ``ray_namespace``.
    """

    # Attributes of this wrapper; every other one is verl's manager's.
    _OWN = frozenset(
        {"base", "coordinator", "checkpoint_monitor", "saved_paths", "_reporting", "_commit_steps"}
    )

    def __init__(
        self,
        *args: Any,
        base_class: Any = None,
        ray_namespace: str = "",
        monitor: Any = None,
        coordinator: Any = None,
        save_timeout: float | None = None,
        commit_steps: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if base_class is None:
            try:
                # verl's class, even where verl_install bound this one to verl's name.
                base_class = verl_install.original(
                    "verl.utils.checkpoint.megatron_checkpoint_manager",
                    "MegatronCheckpointManager",
                )
            except ModuleNotFoundError as exc:
                from obsckpt.integrations import _is_verl_missing, _verl_missing

                if _is_verl_missing(exc):
                    raise _verl_missing("MegatronCheckpointManager", exc) from exc
                raise
        self.base = base_class(*args, **kwargs)
        if _config_value(getattr(self.base, "checkpoint_config", None), "async_save"):
            raise ValueError(
                "checkpoint.async_save=True: Megatron's asynchronous save returns before its "
                "files are written (verl then writes latest_checkpointed_iteration.txt itself "
                "once they are), so obsckpt would commit the step too early. Set "
                "actor_rollout_ref.actor.checkpoint.async_save=false (and the critic's) to "
                "checkpoint through obsckpt"
            )
        if monitor is None and coordinator is None:
            monitor = lookup_actor(
                MONITOR_ACTOR_NAME,
                ray_namespace,
                hint="create it first (CheckpointMonitor.get_actor(...)) or pass monitor=",
                error=RuntimeError,
            )
        if coordinator is None:
            from obsckpt.coordinator import CheckpointCoordinator

            coordinator = CheckpointCoordinator(
                monitor, rank=getattr(self.base, "rank", None), save_timeout=save_timeout
            )
        self.coordinator = coordinator
        self.checkpoint_monitor = monitor if monitor is not None else coordinator.monitor
        self._commit_steps = commit_steps
        self.saved_paths: list[str] = []
        self._reporting = True

    @property
    def commit_steps(self) -> bool:
        """Whether this manager submits the steps it saves (asked once, at the first save)."""
        if self._commit_steps is None:
            self._commit_steps = alone.commits_steps(None, self.coordinator)
        return self._commit_steps

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["base"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # verl's properties (should_save_*) read verl's attributes, so a write such as
        # checkpoint_save_contents must land on verl's manager, not on this wrapper.
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.__dict__["base"], name, value)

    @contextmanager
    def unreported(self) -> Iterator[None]:
        """Saves inside run verl's save only: a caller that reports them itself
        (:func:`megatron_save_state_dict`) must not leave a checkpoint save open too."""
        self._reporting = False
        try:
            yield
        finally:
            self._reporting = True

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> dict[str, int]:
        """Run verl's save with monitor notifications; returns this rank's save counts."""
        if local_path is None:
            return {"state_dict": 0, "checkpoint": 0}
        if not self._reporting:
            self.base.save_checkpoint(local_path, hdfs_path, global_step, None, **kwargs)
            return {"state_dict": 0, "checkpoint": 0}
        # Megatron writes in place: a re-save of a committed checkpoint (a job resumed from
        # an older step retrains it) would change, or a crash tear, what the iteration file
        # vouches for. Every rank skips it alike: the step was committed before any rank
        # saved, or, committing meanwhile, the monitor skips each rank's save at admission.
        written = not already_committed(self.coordinator, global_step, _log, is_state_dict=False)
        if written:
            self.coordinator.link.register_thread_count(
                global_step, state_dict_thread_count=0, checkpoint_thread_count=1
            )
            self.coordinator.check_targets([local_path], global_step, name="megatron_checkpoint")
            where, paths = object_steps.written_at(local_path, self.coordinator.rank)
            written = self.coordinator.save_sync(
                lambda: self.base.save_checkpoint(where, hdfs_path, global_step, None, **kwargs),
                global_step,
                name="megatron_checkpoint",
                paths=paths,
                unless_committed=True,
            )
        if getattr(self.base, "rank", 0) == 0:
            self.saved_paths.append(local_path)
            self.enforce_retention(max_ckpt_to_keep)
        if written and self.commit_steps:
            rank = int(getattr(self.base, "rank", 0) or 0)
            alone.submit(self.coordinator, global_step, "checkpoint", rank=rank, barrier=_barrier)
        return {"state_dict": 0, "checkpoint": int(written)}

    def load_checkpoint(self, local_path: str, *args: Any, **kwargs: Any) -> Any:
        """Wait for this rank's saves in flight, verify the step, then load as verl does.

        Megatron's distributed checkpoint is read by Megatron itself, so every
        file under ``local_path`` is first checked against the committed step's
        manifest (listed, same size and CRC32; a listed file missing fails too),
        and the ``torch.load`` calls verl makes are sent through
        :mod:`obsckpt.loading` (``weights_only=True``). Megatron reads its
        distributed checkpoint's ``.metadata`` with ``pickle`` itself: obsckpt
        checks those bytes against the manifest but cannot restrict what they load.

        Raises:
            UnverifiedCheckpointError: the step is not committed, or a file is not
                listed in its manifest or does not match it.
        """
        self.coordinator.wait_all()
        alone.wait_for_saved_step(self.coordinator, local_path)  # saved here: its commit
        if object_steps.is_url(local_path):  # downloaded, verified, then loaded from there
            copy = VerifiedCopy(
                local_path, object_steps.scratch_path(local_path, self.coordinator.rank)
            )
            try:
                copy.fetch()
                with loading.verified_torch_load(step=copy):
                    return self.base.load_checkpoint(copy.dir, *args, **kwargs)
            finally:
                copy.remove()
        with loading.verified_torch_load(local_path) as step:
            step.verify_all(local_path)
            return self.base.load_checkpoint(local_path, *args, **kwargs)

    def enforce_retention(self, max_ckpt_to_keep: int | None) -> list[str]:
        """Delete steps beyond ``max_ckpt_to_keep`` that are safe to delete (rank 0)."""
        from obsckpt.integrations.retention import prune

        doomed = prune(self.saved_paths, max_ckpt_to_keep)
        self.saved_paths = [p for p in self.saved_paths if p not in doomed]
        return doomed


# Where verl's module was patched while this one was being imported, bind it now.
verl_install.bind_pending()
