"""The one interface of a root's committed steps (``obsckpt.store.roots.StepStore``),
checked alike on a local directory and on an ``s3://`` prefix of a real S3 server
(SeaweedFS): steps committed by a real monitor, then read, verified and pruned
through the interface only."""

from __future__ import annotations

import asyncio
import io
import os
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry
from seaweed import BUCKET

from obsckpt import CheckpointMonitor
from obsckpt.store import layout
from obsckpt.store.file_records import relative_record
from obsckpt.store.roots import PosixRoot, StepStore, open_step_store
from obsckpt.store.s3root import S3Root
from obsckpt.store.torchfile import upload_torch_file, write_torch_file


@pytest.fixture(params=["posix", "s3"])
def root(request, tmp_path) -> str:
    if request.param == "posix":
        return str(tmp_path / "ckpt")
    request.getfixturevalue("seaweed_server")
    return f"s3://{BUCKET}/roots/{uuid.uuid4().hex[:12]}"


def _save(root: str, step: int) -> dict:
    """One file of ``step``, written as a rank writes it to this root; its report."""
    state = {"w": torch.full((1024,), float(step))}
    if "://" in root:
        store = open_step_store(root)
        assert isinstance(store, S3Root)
        return upload_torch_file(state, store.writer(step, "actor/m.pt"), "actor/m.pt").to_json()
    path = layout.step_location(root, step, "actor", "m.pt")
    return relative_record(write_torch_file(state, path), step)


def _commit_steps(root: str, steps: list[int]) -> None:
    async def scenario() -> None:
        monitor = CheckpointMonitor(
            default_local_dir=root, metrics_port=None, registry=CollectorRegistry()
        )
        for step in steps:
            rec = _save(root, step)
            await monitor.register_thread_count(step, checkpoint_thread_count=1)
            admitted = await monitor.notify_started(step=step, slot="model", kind="checkpoint")
            await monitor.notify_finished(
                step, ticket=admitted.get("ticket"), slot="model", ok=True, files=[rec]
            )
            await monitor.monitor_step(step)
        await monitor.shutdown()

    asyncio.run(scenario())


def test_committed_steps_read_verified_and_pruned(root: str) -> None:
    _commit_steps(root, [1, 2, 3])
    _save(root, 4)  # written, never committed
    store = open_step_store(root)
    assert isinstance(store, StepStore)
    assert isinstance(store, PosixRoot) == ("://" not in root)
    assert store.committed_steps()["checkpoint"] == 3
    assert store.steps() == [1, 2, 3, 4]
    assert [r.path for r in store.manifest(2) or []] == ["actor/m.pt"]
    assert store.manifest(4) is None
    with pytest.raises(ValueError, match="step 4"):
        store.committed_records(4)
    data = store.read_verified(3, "actor/m.pt")
    assert torch.load(io.BytesIO(bytes(data)))["w"][0] == 3.0
    assert store.verify_step(3) == [] and store.verify_step(3, deep=False) == []
    assert "step 4" in store.verify_step(4)[0]

    removed = store.remove_steps([1, 4])
    assert removed and store.steps() == [2, 3]
    assert store.manifest(1) is None
    if "://" not in root:
        assert not os.path.exists(layout.step_dir(root, 1))
