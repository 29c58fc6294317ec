"""A local root mirrored to an ``s3://`` root, against a real S3 server (SeaweedFS).

The monitor commits each step under its local root, then its mirror thread copies
the step's files to the mirror (each checked against the manifest as it is read)
and commits it there (HEAD checks, create-only manifest, pointer swap under the
monitor's own epoch). A monitor starting on an empty local root restores the
mirror's committed steps, read through the verified path, so a host that reads
its checkpoints by local path (Trinity-RFT) resumes from them.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
import zlib
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from seaweed import BUCKET, SeaweedServer

from obsckpt import CheckpointMonitor, MirrorError
from obsckpt.monitor import mirror as mirror_module
from obsckpt.options import MonitorOptions
from obsckpt.store import layout, reader
from obsckpt.store.layout import FileRecord
from obsckpt.store.s3root import S3Root, open_s3_root

MIB = 1 << 20


@pytest.fixture
def mirror_url(seaweed_server: SeaweedServer) -> str:
    return f"s3://{BUCKET}/mirrors/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(mirror_url: str) -> S3Root:
    return open_s3_root(mirror_url)


def _monitor(
    root: Path, mirror_url: str, registry: CollectorRegistry | None = None, **options
) -> CheckpointMonitor:
    return CheckpointMonitor(
        options=MonitorOptions(
            default_local_dir=str(root), mirror=mirror_url, metrics_port=None, **options
        ),
        registry=registry or CollectorRegistry(),
    )


def _write(root: Path, step: int, path: str, data: bytes) -> dict:
    target = layout.step_dir(root, step) / path
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as f:
        f.write(data)
        os.fsync(f.fileno())
    return FileRecord(path=path, size=len(data), crc32=zlib.crc32(data)).to_json()


async def _commit(monitor, root: Path, step: int, files: dict[str, bytes], kind: str) -> None:
    is_sd = kind == "state_dict"
    counts = {"state_dict_thread_count" if is_sd else "checkpoint_thread_count": 1}
    await monitor.register_thread_count(step, **counts)
    admitted = await monitor.notify_started(step=step, slot="model", kind=kind)
    reported = [_write(root, step, path, data) for path, data in files.items()]
    await monitor.notify_finished(
        step, is_sd, ticket=admitted.get("ticket"), slot="model", ok=True, files=reported
    )
    await monitor.monitor_step(step, is_sd)


async def _mirrored(monitor, kind: str, step: int, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        mirror = (await monitor.status())["mirror"]
        if mirror["committed"][kind] == step and mirror["copying"] is None:
            return mirror
        assert time.monotonic() < deadline, mirror
        await asyncio.sleep(0.05)


def _commit_one_mirrored(root: Path, mirror_url: str, files: dict[str, bytes]) -> None:
    """A monitor with the mirror commits step 1 of ``files`` under ``root``, sees it on the
    mirror, and shuts down."""

    async def scenario() -> None:
        monitor = _monitor(root, mirror_url)
        await _commit(monitor, root, 1, files, "checkpoint")
        await _mirrored(monitor, "checkpoint", 1)
        await monitor.shutdown(final_scrape_wait_s=0)

    asyncio.run(scenario())


def _blob(step: int, size: int) -> bytes:
    return bytes([step % 251]) * (size - 8) + step.to_bytes(8, "little")


class TestCopies:
    def test_each_commit_reaches_the_mirror_whole(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """Trinity's pattern: a step's state dict, then its full checkpoint (which
        extends its manifest); the big file goes in parts, the state dict's file once."""
        registry = CollectorRegistry()
        root = tmp_path / "root"

        async def scenario() -> None:
            monitor = _monitor(root, mirror_url, registry)
            big = _blob(1, 21 * MIB)
            await _commit(monitor, root, 1, {"actor/model.safetensors": b"w" * 1000}, "state_dict")
            await _mirrored(monitor, "state_dict", 1)
            await _commit(
                monitor, root, 1, {"actor/model_world_size_1_rank_0.pt": big}, "checkpoint"
            )
            status = await _mirrored(monitor, "checkpoint", 1)
            assert status["error"] is None and status["failures"] == 0, status
            assert status["committed"] == {"checkpoint": 1, "state_dict": 1}
            await monitor.shutdown(final_scrape_wait_s=0)

        asyncio.run(scenario())
        pointer = store.read_pointer()
        assert (pointer.checkpoint_step, pointer.state_dict_step) == (1, 1)
        assert store.verify_step(1) == []
        local = {r.path: r for r in reader.read_manifest(layout.step_dir(root, 1))}
        there = {r.path: r for r in store.manifest(1)}
        assert (
            set(there)
            == set(local)
            == {
                "actor/model.safetensors",
                "actor/model_world_size_1_rank_0.pt",
            }
        )
        assert all((there[p].size, there[p].crc32) == (r.size, r.crc32) for p, r in local.items())
        # The iteration objects verl's and Trinity's readers expect are there too.
        for name in layout.ITERATION_FILES.values():
            assert store.client.read(store.key(name)).data.strip() == b"1"
        uploaded = registry.get_sample_value("obsckpt_mirror_upload_bytes_total")
        assert uploaded == 1000 + 21 * MIB  # the state dict's file was not sent twice
        assert registry.get_sample_value("obsckpt_mirror_latest_step", {"kind": "checkpoint"}) == 1
        assert registry.get_sample_value("obsckpt_mirror_latest_step", {"kind": "state_dict"}) == 1
        assert registry.get_sample_value("obsckpt_mirror_copy_seconds_count") == 2
        assert registry.get_sample_value("obsckpt_last_mirror_copy_seconds") > 0
        assert registry.get_sample_value("obsckpt_mirror_failures_total") == 0

    def test_retention_and_a_changed_file(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """keep_steps holds on the mirror too; a file changed after its commit is not
        copied (named in status and counted), and the next step is."""
        registry = CollectorRegistry()
        root = tmp_path / "root"

        async def scenario() -> None:
            monitor = _monitor(root, mirror_url, registry, keep_steps=2)
            for step in (1, 2, 3):
                await _commit(monitor, root, step, {"model.pt": _blob(step, MIB)}, "checkpoint")
                await _mirrored(monitor, "checkpoint", step)
            # Step 4's file changes on disk between its commit and its copy.
            real = mirror_module.StepMirror._upload

            def tampered(self, sdir, step, rec):
                with open(sdir / rec.path, "r+b") as f:
                    f.write(b"X")
                return real(self, sdir, step, rec)

            mirror_module.StepMirror._upload = tampered
            try:
                await _commit(monitor, root, 4, {"model.pt": _blob(4, MIB)}, "checkpoint")
                deadline = time.monotonic() + 30
                while (await monitor.status())["mirror"]["failures"] == 0:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
            finally:
                mirror_module.StepMirror._upload = real
            status = (await monitor.status())["mirror"]
            assert "changed after its commit" in status["error"], status
            assert "global_step_4" in status["error"] and status["committed"]["checkpoint"] == 3
            await _commit(monitor, root, 5, {"model.pt": _blob(5, MIB)}, "checkpoint")
            status = await _mirrored(monitor, "checkpoint", 5)
            assert status["error"] is None, status
            await monitor.shutdown(final_scrape_wait_s=0)

        asyncio.run(scenario())
        assert store.read_pointer().checkpoint_step == 5
        assert [s for s in store.steps() if store.manifest(s) is not None] == [3, 5]
        assert registry.get_sample_value("obsckpt_mirror_failures_total") == 1

    def test_a_later_monitor_catches_up_and_a_stale_one_is_fenced(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """Steps committed while the mirror was away reach it at the next monitor's start;
        a monitor whose mirror another one took copies nothing more."""
        root = tmp_path / "root"
        registry = CollectorRegistry()

        async def scenario() -> None:
            plain = CheckpointMonitor(
                default_local_dir=str(root), metrics_port=None, registry=CollectorRegistry()
            )
            await _commit(plain, root, 1, {"model.pt": _blob(1, MIB)}, "checkpoint")
            await plain.shutdown(final_scrape_wait_s=0)
            first = _monitor(root, mirror_url, registry)
            # An empty mirror holds no step yet (-1), then catches up at the monitor's start.
            sample = registry.get_sample_value
            assert sample("obsckpt_mirror_latest_step", {"kind": "checkpoint"}) in (-1, 1)
            await _mirrored(first, "checkpoint", 1)
            assert sample("obsckpt_mirror_latest_step", {"kind": "checkpoint"}) == 1
            other = _monitor(tmp_path / "elsewhere", mirror_url)
            await _commit(first, root, 2, {"model.pt": _blob(2, MIB)}, "checkpoint")
            deadline = time.monotonic() + 30
            while (status := (await first.status())["mirror"])["fenced"] is None:
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            assert status["committed"]["checkpoint"] == 1 and "epoch" in status["fenced"]
            assert (await first.status())["latest"]["checkpoint"] == 2  # locally, all is well
            await other.shutdown(final_scrape_wait_s=0)
            await first.shutdown(final_scrape_wait_s=0)

        asyncio.run(scenario())
        assert store.read_pointer().checkpoint_step == 1
        assert store.manifest(2) is None
        assert registry.get_sample_value("obsckpt_store_fenced_commits_total") == 1

    def test_a_copy_cut_short_is_swept_at_the_next_start(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """A monitor killed mid-copy leaves an upload and the objects of a step the mirror
        never committed; the next monitor aborts and removes them, then copies the step."""
        root = tmp_path / "root"

        _commit_one_mirrored(root, mirror_url, {"model.pt": _blob(1, MIB)})
        store.client.put(store.step_key(2, "model.pt"), b"half a copy")
        upload = store.client.begin_multipart(store.step_key(2, "optim.pt"))
        plain = CheckpointMonitor(
            default_local_dir=str(root), metrics_port=None, registry=CollectorRegistry()
        )

        async def meanwhile() -> None:  # step 2 commits locally while no mirror runs
            await _commit(plain, root, 2, {"model.pt": _blob(2, MIB)}, "checkpoint")
            await plain.shutdown(final_scrape_wait_s=0)

        asyncio.run(meanwhile())

        async def second() -> None:
            monitor = _monitor(root, mirror_url)
            assert (await monitor.status())["mirror"]["swept"] == 2
            await _mirrored(monitor, "checkpoint", 2)
            await monitor.shutdown(final_scrape_wait_s=0)

        asyncio.run(second())
        assert not [
            u for u in store.client.list_multipart_uploads(store.key()) if u.upload_id == upload
        ]
        assert {r.path for r in store.manifest(2)} == {"model.pt"}
        assert store.verify_step(2) == []
        assert [o.key for o in store.client.list(store.step_key(2) + "/")] == [
            store.step_key(2, "manifest.json"),
            store.step_key(2, "model.pt"),
        ]


class TestRestore:
    def test_an_empty_root_starts_from_the_mirrors_steps(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        first, second = tmp_path / "first", tmp_path / "second"
        files = {"actor/model.pt": _blob(3, 6 * MIB), "actor/extra.pt": b"e" * 10}

        async def scenario() -> None:
            monitor = _monitor(first, mirror_url)
            await _commit(monitor, first, 2, {"actor/model.pt": _blob(2, MIB)}, "checkpoint")
            await _commit(monitor, first, 3, files, "checkpoint")
            await _commit(monitor, first, 4, {"actor/model.safetensors": b"s" * 99}, "state_dict")
            await _mirrored(monitor, "state_dict", 4)
            await monitor.shutdown(final_scrape_wait_s=0)
            restored = _monitor(second, mirror_url)
            status = await restored.status()
            assert status["latest"] == {"checkpoint": 3, "state_dict": 4}, status
            assert status["mirror"]["restored"] == {"checkpoint": 3, "state_dict": 4}
            await restored.shutdown(final_scrape_wait_s=0)

        asyncio.run(scenario())
        assert reader.read_iteration(second, "checkpoint") == 3
        assert reader.read_iteration(second, "state_dict") == 4
        for step in (3, 4):
            assert reader.verify_step(layout.step_dir(second, step)) == []
        for path, data in files.items():
            assert (layout.step_dir(second, 3) / path).read_bytes() == data
        assert not layout.step_dir(second, 2).exists()  # only the committed steps
        assert sorted(os.listdir(second)) == sorted(
            [".obsckpt-monitor.lock", "global_step_3", "global_step_4"]
            + list(layout.ITERATION_FILES.values())
        )

    def test_a_file_is_downloaded_in_parts_and_checked(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """The restore's read: parts written at their offsets (a few in memory), the whole
        checked against the manifest; an object replaced since its commit is refused."""
        root = tmp_path / "root"
        data = _blob(7, 7 * MIB + 12345)

        _commit_one_mirrored(root, mirror_url, {"a/model.pt": data})
        dest = tmp_path / "copy.pt"
        store.download_verified(1, "a/model.pt", dest, part_size=MIB, concurrency=3)
        assert dest.read_bytes() == data
        records = store.committed_records(1)
        store.client.put(store.step_key(1, "a/model.pt"), data[:-1] + b"X")  # same size
        with pytest.raises(ValueError, match="replaced since its commit"):
            store.download_verified(1, "a/model.pt", tmp_path / "again.pt", records=records)

    def test_a_corrupted_object_or_an_uncommitted_directory_is_refused(
        self, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        root = tmp_path / "root"

        _commit_one_mirrored(root, mirror_url, {"model.pt": _blob(1, MIB)})
        # A directory of that step, never committed, in a root with no iteration file.
        stale = tmp_path / "stale"
        (stale / "global_step_1").mkdir(parents=True)
        with pytest.raises(MirrorError, match="global_step_1 exists.*move it away"):
            _monitor(stale, mirror_url)
        # The object replaced behind the manifest's back: its ETag no longer matches.
        store.client.put(store.step_key(1, "model.pt"), b"not the weights")
        with pytest.raises(MirrorError, match="cannot be restored.*model.pt"):
            _monitor(tmp_path / "fresh", mirror_url)
        assert not (tmp_path / "fresh" / "global_step_1").exists()
        assert reader.read_iteration(tmp_path / "fresh", "checkpoint") is None


class TestTrainerStop:
    def test_the_trainers_stop_returns_once_the_last_step_is_on_the_mirror(
        self, ray_cluster, namespace, tmp_path: Path, mirror_url: str, store: S3Root
    ) -> None:
        """Trinity's trainer sets its status STOPPED after its final save, and its job may
        end right after: the Synchronizer's answer waits for the commit and the copy."""
        import torch

        from obsckpt import CheckpointCoordinator, Synchronizer

        ray = ray_cluster
        root = tmp_path / "root"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None, mirror=mirror_url
        )
        sync = Synchronizer.get_actor(namespace=namespace)
        coord = CheckpointCoordinator(monitor, rpc_timeout=30, save_timeout=60)
        try:
            ray.get(monitor.register_thread_count.remote(1, checkpoint_thread_count=1))
            state = {"w": torch.randn(8 << 20, generator=torch.Generator().manual_seed(1))}
            coord.save_state_dict_async("model", state, str(root / "global_step_1/m.pt"), 1)
            coord.wait_all(60)
            ray.get(monitor.monitor_step.remote(1))
            ray.get(sync.set_trainer_status.remote("stopped"), timeout=120)
            # No waiting here: the stop returned once the step was committed and copied.
            pointer = store.read_pointer()
            assert pointer is not None and pointer.checkpoint_step == 1
            assert store.verify_step(1) == []
            status = ray.get(monitor.status.remote())
            assert status["mirror"]["committed"]["checkpoint"] == 1 and status["pending"] == []
        finally:
            coord.close()
            ray.kill(sync)
            ray.get(monitor.shutdown.remote(final_scrape_wait_s=0), timeout=90)
            ray.kill(monitor)


class TestOptions:
    def test_the_mirror_setting(self, monkeypatch, tmp_path) -> None:
        monkeypatch.setenv("OBSCKPT_MIRROR", "s3://bkt//run/")
        monkeypatch.setenv("OBSCKPT_KEEP_STEPS", "3")
        options = MonitorOptions.from_settings(tmp_path)
        assert (options.mirror, options.keep_steps) == ("s3://bkt/run", 3)
        monkeypatch.setenv("OBSCKPT_MIRROR", "gs://bkt/run")
        with pytest.raises(ValueError, match="OBSCKPT_MIRROR|gs://"):
            MonitorOptions.from_settings(tmp_path)
        with pytest.raises(ValueError, match="a root on S3 is committed there already"):
            MonitorOptions(default_local_dir="s3://bkt/a", mirror="s3://bkt/b")
        with pytest.raises(ValueError, match="is a local path"):
            MonitorOptions(default_local_dir=str(tmp_path), mirror=str(tmp_path / "b"))


class TestServerStops:
    """The mirror's endpoint goes away and comes back: the copy fails in one line naming the
    endpoint, the local commits go on, and the mirror catches up once it is back.

    Last in the module: it stops and restarts the session's server.
    """

    def test_copies_fail_then_catch_up(
        self, tmp_path: Path, mirror_url: str, store: S3Root, seaweed_server, monkeypatch
    ) -> None:
        from obsckpt.store import stream

        monkeypatch.setattr(stream, "UNAVAILABLE_RETRY_S", 1.0)
        monkeypatch.setattr(mirror_module, "RETRY_FIRST_S", 0.5)
        registry = CollectorRegistry()
        root = tmp_path / "root"

        async def scenario() -> None:
            monitor = _monitor(root, mirror_url, registry)
            await _commit(monitor, root, 1, {"model.pt": _blob(1, 6 * MIB)}, "checkpoint")
            await _mirrored(monitor, "checkpoint", 1)
            try:
                seaweed_server.stop()
                await _commit(monitor, root, 2, {"model.pt": _blob(2, 6 * MIB)}, "checkpoint")
                assert (await monitor.status())["latest"]["checkpoint"] == 2  # locally, at once
                deadline = time.monotonic() + 120
                while (mirror := (await monitor.status())["mirror"])["failures"] == 0:
                    assert time.monotonic() < deadline, mirror
                    await asyncio.sleep(0.1)
                assert seaweed_server.endpoint in mirror["error"], mirror["error"]
                assert "\n" not in mirror["error"] and "checkpoint step 2" in mirror["error"]
                assert mirror["committed"]["checkpoint"] == 1
            finally:
                if seaweed_server.process is None:
                    seaweed_server.start()
            status = await _mirrored(monitor, "checkpoint", 2, timeout=120)
            assert status["error"] is None, status
            await monitor.shutdown(final_scrape_wait_s=0)

        asyncio.run(scenario())
        assert store.read_pointer().checkpoint_step == 2
        assert store.verify_step(1) == [] and store.verify_step(2) == []
        assert registry.get_sample_value("obsckpt_mirror_failures_total") >= 1
        errors = [
            s
            for m in registry.collect()
            if m.name == "obsckpt_store_request_errors"
            for s in m.samples
            if s.name.endswith("_total")
        ]
        assert errors and all(s.value > 0 for s in errors), errors
