"""Checkpoint sync from an s3:// root: the Synchronizer follows the root's pointer, reads a
committed step's model shards from its manifest (verified, weights only), merges and
publishes them; a damaged shard is a failed load, never published (SeaweedFS)."""

from __future__ import annotations

import asyncio
import uuid

import torch
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor
from obsckpt.options import MonitorOptions
from obsckpt.store.s3root import S3Root, open_s3_root
from obsckpt.store.torchfile import upload_torch_file
from obsckpt.sync.synchronizer import Synchronizer


def _model(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "layer.weight": torch.randn(64, 32, generator=g),
        "layer.bias": torch.randn(64, generator=g),
    }


def _commit_model(monitor: CheckpointMonitor, store: S3Root, step: int, world: int = 2) -> None:
    async def scenario() -> None:
        await monitor.register_thread_count(step, state_dict_thread_count=world)
        for rank in range(world):
            path = f"actor/model_world_size_{world}_rank_{rank}.pt"
            rec = upload_torch_file(_model(step), store.writer(step, path), path)
            reply = await monitor.notify_started(
                step=step, slot=f"model{rank}", kind="state_dict", rank=rank
            )
            await monitor.notify_finished(
                step,
                True,
                ticket=reply["ticket"],
                slot=f"model{rank}",
                rank=rank,
                files=[rec.to_json()],
            )
        await monitor.monitor_step(step, True)

    asyncio.run(scenario())


def test_checkpoint_sync_from_s3(seaweed_server) -> None:
    from seaweed import BUCKET

    url = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"
    store = open_s3_root(url)
    monitor = CheckpointMonitor(
        options=MonitorOptions(default_local_dir=url, metrics_port=None),
        registry=CollectorRegistry(),
    )
    _commit_model(monitor, store, 1)
    sync = Synchronizer(url, namespace="no-monitor-here", registry=CollectorRegistry())
    assert asyncio.run(sync.checkpoint_root()) == url
    assert asyncio.run(sync.poll_once()) == 1
    got, version = asyncio.run(sync.get_model_state_dict())
    assert version == 1 and all(torch.equal(got[k], v) for k, v in _model(1).items())
    # Step 2 committed, then one of its shards damaged: a failed load, not published.
    _commit_model(monitor, store, 2)
    key = store.step_key(2, "actor/model_world_size_2_rank_1.pt")
    data = bytearray(store.client.get(key))
    data[-100] ^= 0xFF
    store.client.put(key, bytes(data))
    assert asyncio.run(sync.poll_once()) == 1
    status = asyncio.run(sync.status())
    assert status["load_failures"] == 1 and "step 2:" in status["last_error"], status
    got, version = asyncio.run(sync.get_model_state_dict())
    assert version == 1 and all(torch.equal(got[k], v) for k, v in _model(1).items())
