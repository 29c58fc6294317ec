"""The monitor's retention (``keep_steps``): after each commit, committed steps beyond the
newest ``keep_steps`` are removed, manifest first; a step an iteration file or the pointer
names, and one newer than the last commit, never is. On a local root and on an s3:// root
(SeaweedFS)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor
from obsckpt.options import MonitorOptions
from obsckpt.store import commit, layout, reader
from obsckpt.store.s3root import open_s3_root
from obsckpt.store.torchfile import upload_torch_file


def _monitor(root: str, keep: int | None) -> CheckpointMonitor:
    return CheckpointMonitor(
        options=MonitorOptions(default_local_dir=root, metrics_port=None, keep_steps=keep),
        registry=CollectorRegistry(),
    )


def test_steps_beyond_keeps_the_newest_and_the_protected() -> None:
    assert commit.steps_beyond([1, 2, 3, 4, 5], 2, set()) == [1, 2, 3]
    assert commit.steps_beyond([5, 1, 3], 2, {1}) == []
    assert commit.steps_beyond([1, 2], 5, set()) == []


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_keep_steps_must_be_a_positive_count(bad, tmp_path) -> None:
    with pytest.raises(ValueError, match="keep_steps"):
        MonitorOptions(default_local_dir=str(tmp_path), keep_steps=bad)


def test_local_root(tmp_path) -> None:
    root = tmp_path / "ckpt"

    async def scenario() -> None:
        monitor = _monitor(str(root), 2)
        for step in range(1, 6):
            sdir = layout.step_dir(root, step)
            sdir.mkdir(parents=True)
            (sdir / "model.pt").write_bytes(b"step %d" % step)
            await monitor.monitor_step(step)
        # A step written but never committed, older than the kept ones, is not removed.
        await monitor.shutdown(final_scrape_wait_s=0)

    layout.step_dir(root, 0).mkdir(parents=True)
    (layout.step_dir(root, 0) / "partial.pt").write_bytes(b"x")
    asyncio.run(scenario())
    assert reader.steps_on_disk(root) == [0, 4, 5]
    assert reader.read_iteration(root, "checkpoint") == 5
    assert reader.verify_step(layout.step_dir(root, 4)) == []


def test_local_root_without_keep_removes_nothing(tmp_path) -> None:
    root = tmp_path / "ckpt"

    async def scenario() -> None:
        monitor = _monitor(str(root), None)
        for step in (1, 2, 3):
            layout.step_dir(root, step).mkdir(parents=True)
            (layout.step_dir(root, step) / "m.pt").write_bytes(b"m")
            await monitor.monitor_step(step)

    asyncio.run(scenario())
    assert reader.steps_on_disk(root) == [1, 2, 3]


def test_s3_root(seaweed_server) -> None:
    from seaweed import BUCKET

    url = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"
    store = open_s3_root(url)

    async def scenario() -> None:
        monitor = _monitor(url, 2)
        for step in range(1, 5):
            await monitor.register_thread_count(step, checkpoint_thread_count=1)
            rec = upload_torch_file({"step": step}, store.writer(step, "m.pt"), "m.pt")
            reply = await monitor.notify_started(step=step, slot="m", kind="checkpoint")
            await monitor.notify_finished(
                step, ticket=reply["ticket"], slot="m", files=[rec.to_json()]
            )
            await monitor.monitor_step(step)

    asyncio.run(scenario())
    assert store.steps() == [3, 4]
    assert store.read_pointer().checkpoint_step == 4
    assert store.verify_step(3) == [] and store.verify_step(4) == []
