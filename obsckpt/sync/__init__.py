"""Weight sync from the trainer to the rollout side: the Synchronizer actor, broadcast, ipc, shards.

Both sync methods (:mod:`~obsckpt.sync.broadcast`, :mod:`~obsckpt.sync.ipc`) keep the
version rule and return the :class:`BroadcastResult` of :mod:`~obsckpt.sync.wire`.
"""

from __future__ import annotations

from obsckpt.errors import (
    AdapterOnlyError,
    BroadcastError,
    BroadcastTimeoutError,
    IpcLayoutUnknownError,
    MegatronLayoutError,
    StateDictLoadError,
    WeightSyncCorruptError,
)
from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.buckets import DEFAULT_BUCKET_BYTES, TensorMeta, plan_buckets, tensor_meta
from obsckpt.sync.delta_broadcast import DeltaBroadcaster, DeltaSyncResult
from obsckpt.sync.delta_memory import MemorySyncClient
from obsckpt.sync.device import RankDevice, setup_rank_device
from obsckpt.sync.group import WeightSyncGroup, free_port
from obsckpt.sync.ipc import IpcPayload, IpcWeightReceiver, IpcWeightSender
from obsckpt.sync.shards import load_sharded_state_dict, merge_shards
from obsckpt.sync.synchronizer import Synchronizer
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.sync.wire import BroadcastResult

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "AdapterOnlyError",
    "BroadcastError",
    "BroadcastResult",
    "BroadcastTimeoutError",
    "DeltaBroadcaster",
    "DeltaSyncResult",
    "IpcLayoutUnknownError",
    "IpcPayload",
    "IpcWeightReceiver",
    "IpcWeightSender",
    "MegatronLayoutError",
    "MemorySyncClient",
    "RankDevice",
    "StateDictLoadError",
    "Synchronizer",
    "TensorMeta",
    "WeightBroadcaster",
    "WeightSyncCorruptError",
    "WeightSyncGroup",
    "WeightSyncTelemetry",
    "free_port",
    "load_sharded_state_dict",
    "merge_shards",
    "plan_buckets",
    "setup_rank_device",
    "tensor_meta",
]
