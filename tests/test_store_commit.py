"""An ``s3://`` checkpoint root end to end, against a real S3 server (SeaweedFS).

A monitor actor on the local Ray takes the root (the endpoint's conditional writes
probed, the pointer moved to its epoch), ranks' saves go straight to the bucket as
multipart uploads with their size, CRC32 and ETag in the report, and the commit
checks each object with HEAD, writes the manifest create-only and swaps the pointer.
A second monitor fences the first; a step whose object changed after its report is
not committed; a rank's upload cut off is aborted by the next monitor's sweep; reads
check size and CRC32 against the manifest.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid

import pytest
import torch
from prometheus_client import CollectorRegistry
from seaweed import BUCKET, SeaweedServer

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.store import S3Client
from obsckpt.store.layout import FileRecord
from obsckpt.store.s3root import S3Root, open_s3_root
from obsckpt.store.stream import ObjectWriter
from obsckpt.store.torchfile import upload_torch_file

MIB = 1 << 20


@pytest.fixture
def root_url(seaweed_server: SeaweedServer) -> str:
    return f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def store(root_url: str) -> S3Root:
    return open_s3_root(root_url, part_size=5 * MIB, concurrency=4)


def _state(step: int, nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(nbytes // 4, generator=g),
        "b": torch.full((7,), float(step)),
        "n": torch.tensor(step),
    }


def _sample(address: str, name: str, **labels: str) -> float | None:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" + want + "}" if want else " ")) or (
            not want and line.startswith(name + " ")
        ):
            return float(line.rsplit(" ", 1)[1])
    return None


class TestObjectWriter:
    """The streaming upload: parts in parallel, one PUT when small, CRC32 of the whole."""

    @pytest.mark.parametrize("size", [0, 1000, 5 * MIB, 12 * MIB + 3])
    def test_sizes_round_trip(self, store: S3Root, size: int) -> None:
        data = torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes()
        writer = store.writer(1, f"blob-{size}")
        for lo in range(0, size, 3 * MIB + 17):  # writes that straddle parts
            writer.write(data[lo : lo + 3 * MIB + 17])
        done = writer.finish()
        import zlib

        assert (done.size, done.crc32) == (size, zlib.crc32(data))
        assert done.parts == max(1, -(-size // (5 * MIB))) if size >= 5 * MIB else 1
        assert store.client.get(store.step_key(1, f"blob-{size}")) == data
        assert store.client.head(store.step_key(1, f"blob-{size}")).etag == done.etag

    def test_abort_leaves_no_upload(self, store: S3Root) -> None:
        writer = store.writer(2, "cut")
        writer.write(b"x" * (11 * MIB))  # two parts sent
        writer.abort()
        assert store.client.list_multipart_uploads(store.step_key(2)) == []
        assert store.client.head(store.step_key(2, "cut")) is None

    def test_torch_file_loads_back(self, store: S3Root) -> None:
        state = _state(3, 6 * MIB)
        rec = upload_torch_file(state, store.writer(3, "actor/model.pt"), "actor/model.pt")
        assert rec.etag and rec.path == "actor/model.pt"
        data = store.client.get(store.step_key(3, "actor/model.pt"))
        import io

        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in state.items())


class TestMonitorOnS3:
    """The monitor actor commits an s3:// root; the ranks write straight to it."""

    def test_saves_commit_and_read_back_verified(self, ray_cluster, namespace, root_url) -> None:
        ray = ray_cluster
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root_url)
        coord = CheckpointCoordinator(monitor, rpc_timeout=30, save_timeout=60)
        address = ray.get(monitor.metrics_address.remote())
        assert ray.get(monitor.checkpoint_root.remote()) == root_url
        states = {}
        for step in (1, 2):
            ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=2))
            for rank in (0, 1):
                states[step, rank] = _state(10 * step + rank, 7 * MIB)
                coord.save_state_dict_async(
                    f"model{rank}",
                    states[step, rank],
                    f"{root_url}/global_step_{step}/actor/model_rank{rank}.pt",
                    step,
                )
            coord.wait_all(60)
            ray.get(monitor.monitor_step.remote(step))
        status = ray.get(monitor.status.remote())
        assert status["latest"]["checkpoint"] == 2, status
        assert not status.get("fenced"), status
        store = open_s3_root(root_url)
        pointer = store.read_pointer()
        assert pointer is not None and pointer.checkpoint_step == 2
        assert pointer.state_dict_step == 2 and pointer.epoch >= 1
        assert store.client.get(store.key("latest_checkpointed_iteration.txt")).strip() == b"2"
        records = store.manifest(2)
        assert sorted(r.path for r in records) == [
            "actor/model_rank0.pt",
            "actor/model_rank1.pt",
        ]
        assert all(r.etag for r in records)
        assert store.verify_step(1) == [] and store.verify_step(2) == []
        import io

        for rank in (0, 1):
            data = store.read_verified(2, f"actor/model_rank{rank}.pt")
            loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
            assert torch.equal(loaded["w"], states[2, rank]["w"])
        # The commit's phases on S3, and the uploads per slot, are in the metrics.
        for phase in ("head_check", "manifest_put", "pointer_cas"):
            assert _sample(address, "obsckpt_commit_phase_seconds_count", phase=phase) == 2
        assert _sample(address, "obsckpt_store_upload_bytes_total", slot="model0") > 2 * 7 * MIB
        assert 0 < _sample(address, "obsckpt_last_store_upload_seconds", slot="model1") < 60
        assert _sample(address, "obsckpt_store_fenced_commits_total") == 0
        coord.close()
        ray.get(monitor.shutdown.remote(final_scrape_wait_s=0))
        ray.kill(monitor)

    def test_a_path_outside_the_step_is_refused(self, ray_cluster, namespace, root_url) -> None:
        from obsckpt.errors import SavePathError

        ray = ray_cluster
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root_url)
        coord = CheckpointCoordinator(monitor, rpc_timeout=30, save_timeout=60)
        ray.get(monitor.register_thread_count.remote(1, checkpoint_thread_count=1))
        for bad in (f"{root_url}/global_step_2/x.pt", "/tmp/x.pt", f"{root_url}/x.pt"):
            with pytest.raises(SavePathError, match="s3://"):
                coord.save_state_dict_async("m", {"a": torch.ones(2)}, bad, 1)
        coord.close()
        ray.kill(monitor)


def _monitor(root_url: str, registry: CollectorRegistry | None = None) -> CheckpointMonitor:
    return CheckpointMonitor(
        default_local_dir=root_url,
        metrics_port=None,
        registry=registry or CollectorRegistry(),
    )


def _report(store: S3Root, step: int, path: str, nbytes: int) -> FileRecord:
    rec = upload_torch_file(_state(step, nbytes), store.writer(step, path), path)
    return rec


async def _commit(monitor: CheckpointMonitor, step: int, rec: FileRecord) -> None:
    admitted = await monitor.notify_started(step=step, slot="model", kind="checkpoint")
    await monitor.notify_finished(
        step, ticket=admitted.get("ticket"), slot="model", ok=True, files=[rec.to_json()]
    )
    await monitor.monitor_step(step)


class TestFencing:
    """Two monitors on one root: the later one's epoch fences the earlier."""

    def test_stale_monitor_commits_nothing(self, root_url: str, store: S3Root) -> None:
        registry = CollectorRegistry()

        async def scenario() -> None:
            first = _monitor(root_url, registry)
            await first.register_thread_count(1, checkpoint_thread_count=1)
            await _commit(first, 1, _report(store, 1, "model.pt", MIB))
            assert (await first.status())["latest"]["checkpoint"] == 1
            second = _monitor(root_url)
            assert second._root_lock.epoch == first._root_lock.epoch + 1
            await first.register_thread_count(2, checkpoint_thread_count=1)
            await _commit(first, 2, _report(store, 2, "model.pt", MIB))
            status = await first.status()
            assert status["latest"]["checkpoint"] == 1
            assert status["fenced"] and "epoch" in status["fenced"], status
            assert 2 in [s["step"] for s in status["failed"]] or status["failed"], status
            assert store.manifest(2) is None  # not even the manifest was written
            pointer = store.read_pointer()
            assert (pointer.checkpoint_step, pointer.epoch) == (1, second._root_lock.epoch)
            # The new owner commits.
            await second.register_thread_count(2, checkpoint_thread_count=1)
            await _commit(second, 2, _report(store, 2, "model.pt", MIB))
            assert store.read_pointer().checkpoint_step == 2

        asyncio.run(scenario())
        assert registry.get_sample_value("obsckpt_store_fenced_commits_total") == 1
        assert registry.get_sample_value("obsckpt_monitor_fenced") == 1

    def test_object_changed_after_report_is_not_committed(
        self, root_url: str, store: S3Root
    ) -> None:
        async def scenario() -> None:
            monitor = _monitor(root_url)
            await monitor.register_thread_count(1, checkpoint_thread_count=1)
            rec = _report(store, 1, "model.pt", MIB)
            store.client.put(store.step_key(1, "model.pt"), b"rewritten")
            await _commit(monitor, 1, rec)
            status = await monitor.status()
            assert status["latest"]["checkpoint"] is None
            text = json.dumps(status)
            assert "model.pt" in text and "the rank reported" in text, text
            assert store.read_pointer().checkpoint_step is None

        asyncio.run(scenario())

    def test_many_files_are_checked_by_listing(self, root_url: str, store: S3Root) -> None:
        """Past LIST_ABOVE files the commit lists the step's prefix instead of a HEAD each;
        a rewritten object and a missing one are still named."""
        from obsckpt.store.s3root import LIST_ABOVE

        files = {}
        for i in range(LIST_ABOVE + 8):
            path = f"r{i}/m.pt"
            files[path] = store.record(1, path, b"rank %d" % i)
        assert store.check_reported(1, files) == []
        store.client.put(store.step_key(1, "r3/m.pt"), b"rewritten")
        store.client.delete([store.step_key(1, "r7/m.pt")])
        problems = store.check_reported(1, files)
        assert len(problems) == 2, problems
        assert any("r3/m.pt" in p and "bytes" in p for p in problems)
        assert any("r7/m.pt: missing" in p for p in problems)

    def test_sweep_aborts_a_cut_upload_and_orphans(self, root_url: str, store: S3Root) -> None:
        async def scenario() -> None:
            monitor = _monitor(root_url)
            await monitor.register_thread_count(1, checkpoint_thread_count=1)
            await _commit(monitor, 1, _report(store, 1, "model.pt", MIB))
            # A rank killed mid-upload of step 2: its parts sent, never completed.
            cut = ObjectWriter(store.client, store.step_key(2, "model.pt"), part_size=5 * MIB)
            cut.write(b"y" * (11 * MIB))
            assert store.client.list_multipart_uploads(store.step_key(2))
            store.client.put(store.step_key(2, "other.pt"), b"orphan")
            assert store.read_pointer().checkpoint_step == 1  # unchanged
            again = _monitor(root_url)
            assert store.client.list_multipart_uploads(store.key()) == []
            assert store.client.head(store.step_key(2, "other.pt")) is None
            assert store.verify_step(1) == []  # the committed step is untouched
            assert len(again.leftovers_removed) == 1 and len(again.uploads_aborted) == 1

        asyncio.run(scenario())


class TestReads:
    def test_corruption_is_caught_before_deserialising(self, root_url, store) -> None:
        async def scenario() -> None:
            monitor = _monitor(root_url)
            await monitor.register_thread_count(1, checkpoint_thread_count=1)
            await _commit(monitor, 1, _report(store, 1, "model.pt", MIB))

        asyncio.run(scenario())
        assert store.verify_step(1) == []
        key = store.step_key(1, "model.pt")
        data = bytearray(store.client.get(key))
        data[100] ^= 0xFF
        store.client.put(key, bytes(data))
        problems = store.verify_step(1)
        assert len(problems) == 1 and "model.pt" in problems[0]
        with pytest.raises(Exception, match="ETag|corrupted|precondition"):
            store.read_verified(1, "model.pt")

    def test_client_errors_are_counted(self, root_url: str) -> None:
        import boto3
        from seaweed import ACCESS_KEY

        from obsckpt.store import StoreError

        registry = CollectorRegistry()
        monitor = _monitor(root_url, registry)
        wrong = boto3.session.Session(
            aws_access_key_id=ACCESS_KEY, aws_secret_access_key="not-the-secret"
        )
        client = S3Client(BUCKET, session=wrong)
        client.on_error = monitor.telemetry.store_request_failed
        with pytest.raises(StoreError, match="403"):
            client.put("runs/x", b"x")
        value = registry.get_sample_value(
            "obsckpt_store_request_errors_total", {"operation": "put", "code": "403"}
        )
        assert value == 1


class TestCommandLine:
    """``obsckpt status`` and ``verify`` read an s3:// root through its pointer and manifests."""

    def _run(self, *argv: str) -> tuple[int, str, str]:
        import io

        from obsckpt.cli import main

        out, err = io.StringIO(), io.StringIO()
        code = main(list(argv), out=out, err=err)
        return code, out.getvalue(), err.getvalue()

    def test_status_and_verify(self, root_url: str, store: S3Root) -> None:
        async def scenario() -> None:
            monitor = _monitor(root_url)
            for step in (1, 2):
                await monitor.register_thread_count(step, checkpoint_thread_count=1)
                await _commit(monitor, step, _report(store, step, "model.pt", MIB))

        asyncio.run(scenario())
        store.client.put(store.step_key(3, "half.pt"), b"never committed")
        code, out, _ = self._run("status", root_url)
        assert code == 0, out
        assert "latest checkpoint: 2" in out and "epoch 1" in out
        assert "global_step_3: not whole" in out and "no problems" in out
        code, out, err = self._run("verify", root_url, "--all")
        assert code == 1  # step 3 is not obsckpt's to vouch for
        assert "step 1: OK" in out and "step 2: OK" in out and "step 3: NOT VERIFIABLE" in out
        code, out, _ = self._run("verify", root_url, "--json")
        doc = json.loads(out)
        assert code == 0 and doc["ok"] and [s["step"] for s in doc["steps"]] == [2]
        # A committed object damaged: verify and status say so, exit 1.
        key = store.step_key(2, "model.pt")
        data = bytearray(store.client.get(key))
        data[-1] ^= 0xFF
        store.client.put(key, bytes(data))
        code, out, err = self._run("verify", root_url)
        assert code == 1 and "step 2: FAILED" in out and "model.pt" in err
        code, out, _ = self._run("status", root_url, "--json")
        assert code == 1 and json.loads(out)["problems"]
        code, _, err = self._run("repair", root_url)
        assert code == 2 and "needs no repair" in err

    def test_unreachable_or_empty_root_is_one_line(self, root_url: str) -> None:
        code, _, err = self._run("status", root_url)
        assert code == 2 and "not a checkpoint root" in err and err.count("\n") == 1


class TestResume:
    """Readers load committed objects only, verified; an unfinished commit is abandoned."""

    def test_load_verifies_and_refuses_uncommitted(self, root_url: str, store: S3Root) -> None:
        from obsckpt.errors import UnverifiedCheckpointError
        from obsckpt.store.layout import manifest_bytes
        from obsckpt.store.loading import load

        async def scenario() -> None:
            monitor = _monitor(root_url)
            await monitor.register_thread_count(1, checkpoint_thread_count=1)
            await _commit(monitor, 1, _report(store, 1, "actor/model.pt", 6 * MIB))

        asyncio.run(scenario())
        loaded = load(f"{root_url}/global_step_1/actor/model.pt")
        assert torch.equal(loaded["w"], _state(1, 6 * MIB)["w"])
        # The monitor stopped between step 2's manifest and its pointer swap.
        rec = _report(store, 2, "actor/model.pt", MIB)
        store.client.put_create_only(store.step_key(2, "manifest.json"), manifest_bytes([rec]))
        with pytest.raises(UnverifiedCheckpointError, match="did not finish"):
            load(f"{root_url}/global_step_2/actor/model.pt")
        assert "did not finish" in store.verify_step(2)[0]
        # A corrupted object is refused before deserialising.
        key = store.step_key(1, "actor/model.pt")
        data = bytearray(store.client.get(key))
        data[len(data) // 2] ^= 0x01
        store.client.put(key, bytes(data))
        with pytest.raises(UnverifiedCheckpointError, match="replaced since its commit"):
            load(f"{root_url}/global_step_1/actor/model.pt")

    def test_next_monitor_abandons_an_unfinished_commit(self, root_url: str, store: S3Root) -> None:
        from obsckpt.store.layout import manifest_bytes

        async def scenario() -> None:
            monitor = _monitor(root_url)
            await monitor.register_thread_count(1, checkpoint_thread_count=1)
            await _commit(monitor, 1, _report(store, 1, "model.pt", MIB))
            rec = _report(store, 2, "model.pt", MIB)
            store.client.put_create_only(store.step_key(2, "manifest.json"), manifest_bytes([rec]))
            # The next job's monitor: step 2 was never committed; it is removed, and the
            # job, resumed from step 1, commits its own step 2.
            again = _monitor(root_url)
            assert store.manifest(2) is None and not store.has_objects(2)
            assert store.read_pointer().checkpoint_step == 1
            await again.register_thread_count(2, checkpoint_thread_count=1)
            await _commit(again, 2, _report(store, 2, "model.pt", 2 * MIB))
            assert store.read_pointer().checkpoint_step == 2
            assert store.verify_step(2) == []

        asyncio.run(scenario())


class TestServerStops:
    """The store goes away during a save and comes back: that step fails in one line naming
    the endpoint, nothing committed is touched, and the next step commits.

    Last in the module: it stops and restarts the session's server.
    """

    def test_save_fails_then_next_step_commits(
        self, ray_cluster, namespace, root_url, seaweed_server: SeaweedServer, monkeypatch
    ) -> None:
        from obsckpt.errors import SaveError
        from obsckpt.store import stream

        # A part is sent again for this long while the endpoint does not answer.
        monkeypatch.setattr(stream, "UNAVAILABLE_RETRY_S", 2.0)
        ray = ray_cluster
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root_url)
        coord = CheckpointCoordinator(monitor, rpc_timeout=30, save_timeout=120)

        def save(step: int) -> None:
            ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=1))
            coord.save_state_dict_async(
                "model", _state(step, 6 * MIB), f"{root_url}/global_step_{step}/m.pt", step
            )

        save(1)
        coord.wait_all(60)
        ray.get(monitor.monitor_step.remote(1))
        try:
            seaweed_server.stop()
            save(2)
            with pytest.raises(SaveError) as info:
                coord.wait_all(120)
            message = str(info.value)
            assert seaweed_server.endpoint in message and "\n" not in message, message
            assert "global_step_2/m.pt" in message
        finally:
            if seaweed_server.process is None:
                seaweed_server.start()
        ray.get(monitor.monitor_step.remote(2))
        save(3)
        coord.wait_all(60)
        ray.get(monitor.monitor_step.remote(3))
        status = ray.get(monitor.status.remote())
        assert status["latest"]["checkpoint"] == 3, status
        assert 2 in [f["step"] for f in status["failed"]], status["failed"]
        store = open_s3_root(root_url)
        assert store.verify_step(1) == [] and store.verify_step(3) == []
        coord.close()
        ray.kill(monitor)

    def test_upload_survives_a_server_restart(
        self, root_url: str, store: S3Root, seaweed_server: SeaweedServer
    ) -> None:
        """Parts sent before a restart and after it make one object (the upload id is the
        server's, kept across its restart); the CRC32 covers all of it."""
        import zlib

        data = torch.randint(0, 256, (17 * MIB,), dtype=torch.uint8).numpy().tobytes()
        writer = store.writer(1, "restarted.bin")
        writer.write(data[: 11 * MIB])  # two parts sent (5 MiB each), one filling
        try:
            seaweed_server.stop()
            seaweed_server.start()
        finally:
            if seaweed_server.process is None:
                seaweed_server.start()
        writer.write(data[11 * MIB :])
        done = writer.finish()
        assert (done.size, done.crc32) == (len(data), zlib.crc32(data))
        assert store.client.get(store.step_key(1, "restarted.bin")) == data
