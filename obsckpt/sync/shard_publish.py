"""Memory sync from the trainer ranks' own shards: the save's snapshot is the publish.

The whole-model memory sync gathers every sharded tensor (a collective on the
trainer's devices) and copies the full state to rank 0's host, beside the
copy the step's save makes of each rank's shard. Here each rank publishes
its shard instead, from one host snapshot that the step's save then writes
(:meth:`~obsckpt.coordinator.CheckpointCoordinator.stage` and
``save_state_dict_async(staged=...)``), so the state leaves the devices once
for both:

* :func:`publish_staged_shards` (every trainer rank): the snapshot's sharded
  tensors go as :class:`~obsckpt.sync.shards.ShardPiece` (their bytes written
  once into Ray's object store), plain tensors from rank 0 only;
* :meth:`ShardMemorySync.set_model_shard` (the Synchronizer): keeps each
  rank's piece of the step; the last to arrive merges them
  (:func:`~obsckpt.sync.shards.merge_shards`, in a thread) and publishes the
  whole state as :meth:`set_model_state_dict` does. Every rank's call returns
  what that publish returned, or raises what it raised.

A newer step's shard ends a step still missing ranks: its callers get a
:class:`~obsckpt.errors.StateDictLoadError` naming the missing ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from obsckpt import validators
from obsckpt.errors import StateDictLoadError
from obsckpt.sync.publish import ZeroCopyTensor
from obsckpt.sync.shards import ShardPiece, merge_shards

__all__ = ["ShardMemorySync", "publish_staged_shards", "shard_of", "snapshot_size"]

logger = logging.getLogger(__name__)


def shard_of(snapshot: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """What rank ``rank`` sends of its snapshot: sharded tensors as pieces, plain tensors
    (the same on every rank) from rank 0 only (None elsewhere), anything else as it is."""
    out: dict[str, Any] = {}
    for name, value in snapshot.items():
        if hasattr(value, "device_mesh"):
            out[name] = ShardPiece.of(value)
        elif isinstance(value, torch.Tensor):
            out[name] = ZeroCopyTensor(value) if rank == 0 else None
        else:
            out[name] = value
    return out


def snapshot_size(snapshot: Mapping[str, Any]) -> tuple[int, int]:
    """``(tensors, bytes)`` of this rank's part of ``snapshot`` (a sharded tensor's local piece)."""
    count = nbytes = 0
    for value in snapshot.values():
        local = value.to_local() if hasattr(value, "device_mesh") else value
        if isinstance(local, torch.Tensor):
            count += 1
            nbytes += local.numel() * local.element_size()
    return count, nbytes


def publish_staged_shards(
    synchronizer: Any,
    staged: Any,
    step: int,
    *,
    rank: int,
    world_size: int,
    timeout: float | None = 600.0,
) -> bool:
    """Publish ``staged``'s snapshot (this rank's shard, a
    :class:`~obsckpt.slot_staging.StagedSave`) as this rank's part of version ``step``.

    Every rank of the trainer calls it. The snapshot is held until Ray has
    its bytes (the slot's next save waits meanwhile); the call returns once
    the Synchronizer has merged every rank's shard and published the whole
    state, with what that publish returned.

    Raises:
        StateDictLoadError: the shards could not be merged, or a newer step's
            came while this one still missed ranks.
        ray.exceptions.GetTimeoutError: no answer within ``timeout`` seconds.
    """
    import ray

    with staged.hold(timeout) as snapshot:
        ref = synchronizer.set_model_shard.remote(shard_of(snapshot, rank), step, rank, world_size)
    return bool(ray.get(ref, timeout=timeout))


@dataclass(slots=True)
class _Gathering:
    step: int
    world_size: int
    shards: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    started: float = field(default_factory=time.monotonic)


class ShardMemorySync:
    """The Synchronizer's memory sync from shards (mixed into :class:`~obsckpt.sync.Synchronizer`)."""

    _gathering: _Gathering | None = None

    if TYPE_CHECKING:

        async def set_model_state_dict(self, model_state_dict: Any, trainer_step: int) -> bool: ...

    async def set_model_shard(
        self, shard: Mapping[str, Any], trainer_step: int, rank: int, world_size: int
    ) -> bool:
        """Take trainer rank ``rank``'s shard of version ``trainer_step``; once all
        ``world_size`` ranks' are here, merge and publish them (as
        :meth:`set_model_state_dict`). Returns that publish's result to every rank.

        Raises:
            ValueError: ``rank`` or ``world_size`` out of range, a world size
                other than the step's first shard said, a rank sent twice, or
                a step older than one being gathered.
            StateDictLoadError: the merge failed, or a newer step's shard came first.
        """
        validators.validate_step(trainer_step, "trainer_step")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        g = self._gathering
        if g is not None and trainer_step < g.step:
            raise ValueError(
                f"rank {rank} sent its shard of step {trainer_step}, but step {g.step} is "
                "being gathered; versions never go backwards"
            )
        if g is not None and trainer_step > g.step:
            self._abandon(g, trainer_step)
            g = None
        if g is None:
            g = self._gathering = _Gathering(trainer_step, world_size)
        if world_size != g.world_size:
            raise ValueError(
                f"rank {rank} sent step {trainer_step} with world_size {world_size}, but an "
                f"earlier rank's shard of it said {g.world_size}"
            )
        if rank in g.shards:
            raise ValueError(f"rank {rank} sent its shard of step {trainer_step} twice")
        g.shards[rank] = shard
        if len(g.shards) == g.world_size:
            self._gathering = None
            asyncio.ensure_future(self._merge_and_publish(g))
        return await asyncio.shield(g.done)

    def _abandon(self, g: _Gathering, newer: int) -> None:
        missing = sorted(set(range(g.world_size)) - set(g.shards))
        error = StateDictLoadError(
            f"step {g.step}'s shards were never all sent (ranks {missing[:8]} of "
            f"{g.world_size} missing) before step {newer}'s came; step {g.step} is not published"
        )
        logger.warning("obsckpt: %s", error)
        self._gathering = None
        if not g.done.done():
            g.done.set_exception(error)
            g.done.exception()  # retrieved: a rank that never awaits it logs nothing

    async def _merge_and_publish(self, g: _Gathering) -> None:
        try:
            merged = await asyncio.to_thread(merge_shards, g.shards)
            g.shards.clear()  # the object store's copies go once merged
            result = await self.set_model_state_dict(merged, g.step)
        except BaseException as exc:  # noqa: BLE001 - handed to every rank's call
            logger.warning("obsckpt: shards of step %d not published: %s", g.step, exc)
            g.done.set_exception(exc)
            g.done.exception()
            return
        logger.info(
            "obsckpt: merged %d ranks' shards of step %d and published them (%.2f s after "
            "the first arrived)",
            g.world_size,
            g.step,
            time.monotonic() - g.started,
        )
        g.done.set_result(result)
