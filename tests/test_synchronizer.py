"""Synchronizer actor: memory sync, checkpoint sync of committed steps only, bad steps skipped."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import ray
import torch
from metrics_helpers import samples, scrape
from reliability_helpers import RunsCode
from workers import kill_named

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy, Synchronizer
from obsckpt.errors import StateDictLoadError
from obsckpt.store import commit, layout
from obsckpt.store.torchfile import write_torch_file
from obsckpt.sync.shards import load_sharded_state_dict, merge_shards, quiet_mesh_unpickling


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(8, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "step_count": torch.tensor([seed], dtype=torch.int64),
    }


def equal(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def shard_path(root, step: int, world: int, rank: int):
    """Where rank ``rank`` of ``world`` keeps its model shard of ``step``."""
    return layout.model_dir(root, step) / layout.shard_name("model", world, rank)


def write_step(root, step: int, shards: dict[int, dict], *, committed: bool = True) -> None:
    """Write a step's per-rank model files, then (optionally) commit it as the monitor does."""
    sdir = layout.step_dir(root, step)
    world = len(shards)
    for rank, sd in shards.items():
        write_torch_file(sd, shard_path(root, step, world, rank))
    if committed:
        commit.finalize_step(sdir)
        commit.write_iteration(root, "state_dict", step)


class TestMemorySync:
    """Versions only move forward; waiters wake on a newer version or return at their timeout."""

    def test_set_get_wait_meta_and_local_metrics(self, namespace):
        sync = Synchronizer.get_actor(namespace=namespace)
        assert ray.get(sync.get_model_state_dict.remote()) == (None, None)
        assert ray.get(sync.get_state_dict_meta.remote()) is None

        first, second = state_dict(1), state_dict(2)
        assert ray.get(sync.set_model_state_dict.remote(first, 3))
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 3 and equal(got, first)
        assert ray.get(sync.get_state_dict_meta.remote()) == [
            ("embed.weight", "float32", (8, 4)),
            ("norm.weight", "bfloat16", (4,)),
            ("step_count", "int64", (1,)),
        ]

        # Already newer: returns at once. Not newer: returns the held version at the timeout.
        assert ray.get(sync.wait_new_model_state_dict.remote(1, timeout=30)) == 3
        t0 = time.monotonic()
        assert ray.get(sync.wait_new_model_state_dict.remote(3, timeout=0.3)) == 3
        assert 0.25 <= time.monotonic() - t0 < 10

        waiter = sync.wait_new_model_state_dict.remote(3, timeout=60)
        time.sleep(0.3)
        assert ray.get(sync.set_model_state_dict.remote(second, 5))
        assert ray.get(waiter, timeout=30) == 5

        # Older steps are refused; the held version is unchanged.
        assert not ray.get(sync.set_model_state_dict.remote(first, 4))
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 5 and equal(got, second)

        # None publishes a version without weights (the rollout's own weights are current).
        assert ray.get(sync.set_model_state_dict.remote(None, 6))
        assert ray.get(sync.get_model_state_dict.remote()) == (None, 6)

        # No monitor in this namespace: the synchronizer keeps the measurements itself.
        ray.get(sync.record_upload.remote(0.42))
        status = ray.get(sync.status.remote())
        assert status["telemetry"] == "local" and status["source"] == "memory"
        m = samples(ray.get(sync.metrics_text.remote()))
        assert m[("obsckpt_model_version", (("role", "trainer"),))] == 6
        assert m[("obsckpt_model_version", (("role", "rollout"),))] == 6
        assert m[("obsckpt_state_dict_upload_duration_seconds_count", ())] == 1

        # get_actor returns the same named actor.
        again = Synchronizer.get_actor(namespace=namespace, watch=False)
        assert ray.get(again.get_version.remote()) == 6


class TestCheckpointSync:
    """Only committed steps are read; the newest committed step becomes the version."""

    def test_a_running_synchronizer_of_another_root_is_refused(self, namespace, tmp_path):
        memory_only = Synchronizer.get_actor(namespace=namespace)
        with pytest.raises(ValueError, match="watches no checkpoint root"):
            Synchronizer.get_actor(namespace=namespace, default_local_dir=tmp_path / "a")
        kill_named(memory_only, "synchronizer", namespace)
        first = Synchronizer.get_actor(
            namespace=namespace, default_local_dir=tmp_path / "a", watch=False
        )
        again = Synchronizer.get_actor(namespace=namespace, default_local_dir=str(tmp_path / "a"))
        assert ray.get(again.checkpoint_root.remote()) == str(tmp_path / "a")
        with pytest.raises(ValueError) as err:
            Synchronizer.get_actor(namespace=namespace, default_local_dir=tmp_path / "b")
        assert str(tmp_path / "a") in str(err.value) and str(tmp_path / "b") in str(err.value)
        ray.kill(first)

    def test_commit_through_the_monitor(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=SaveStrategy.UNRESTRICTED,
            default_local_dir=str(root),
            metrics_port=0,
            metrics_host="127.0.0.1",
        )
        ray.get(monitor.status.remote())
        sync = Synchronizer.get_actor(
            namespace=namespace, default_local_dir=str(root), poll_interval_s=0.1
        )
        full = state_dict(7)
        # Two ranks, each saving its own rows of the embedding (plain tensors: the
        # rank-0 copy of every name is used; DTensor shards are merged in test_verl_fsdp).
        coords = [CheckpointCoordinator(monitor, rank=r) for r in (0, 1)]
        for r, coord in enumerate(coords):
            path = shard_path(root, 4, 2, r)
            coord.save_state_dict_async("model", full, path, 4, is_state_dict=True)
        for coord in coords:
            coord.wait_all(timeout=60)
        # Saved but not yet submitted: nothing is committed, so nothing is read.
        time.sleep(0.5)
        assert ray.get(sync.get_version.remote()) is None

        coord = CheckpointCoordinator(monitor)
        asyncio.run(coord.register_and_monitor(4, is_state_dict=True, state_dict_thread_count=2))
        assert ray.get(sync.wait_new_model_state_dict.remote(None, timeout=60)) == 4
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 4 and equal(got, full)
        status = ray.get(sync.status.remote())
        assert status["source"] == "checkpoint" and status["telemetry"] == "monitor"

        def exported():
            m = scrape(monitor)
            ok = (
                m.get(("obsckpt_model_version", (("role", "trainer"),))) == 4
                and m.get(("obsckpt_model_version", (("role", "rollout"),))) == 4
                and m.get(("obsckpt_state_dict_upload_duration_seconds_count", ())) == 1
            )
            return ok

        wait_for(exported, what="the monitor to export the synchronizer's measurements")

    def test_bad_steps_are_reported_and_skipped(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        sync = Synchronizer.get_actor(namespace=namespace, default_local_dir=str(root), watch=False)
        write_step(root, 2, {0: state_dict(2), 1: state_dict(2)})
        assert ray.get(sync.poll_once.remote()) == 2

        # On disk but not committed: never read.
        write_step(root, 3, {0: state_dict(3), 1: state_dict(3)}, committed=False)
        assert ray.get(sync.poll_once.remote()) == 2

        # Committed, then corrupted in place (same size): the manifest's CRC catches it.
        write_step(root, 4, {0: state_dict(4), 1: state_dict(4)})
        victim = shard_path(root, 4, 2, 1)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        assert ray.get(sync.poll_once.remote()) == 2
        status = ray.get(sync.status.remote())
        assert status["load_failures"] == 1 and "corrupted" in status["failed_steps"][4]

        # Committed with a rank missing and no manifest.
        write_step(root, 5, {0: state_dict(5), 1: state_dict(5)}, committed=False)
        shard_path(root, 5, 2, 1).unlink()
        commit.write_iteration(root, "state_dict", 5)
        assert ray.get(sync.poll_once.remote()) == 2
        status = ray.get(sync.status.remote())
        assert status["load_failures"] == 2 and "ranks [1]" in status["failed_steps"][5]

        # Committed, then its manifest deleted and a shard corrupted: the check does not
        # switch off without a manifest, the step is refused.
        write_step(root, 6, {0: state_dict(6), 1: state_dict(6)})
        (layout.step_dir(root, 6) / layout.MANIFEST_NAME).unlink()
        victim = shard_path(root, 6, 2, 0)
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
        assert ray.get(sync.poll_once.remote()) == 2
        status = ray.get(sync.status.remote())
        assert (
            status["load_failures"] == 3
            and "manifest.json is missing" in (status["failed_steps"][6])
        )

        # A shard replaced by a pickle that runs code, its manifest rewritten to match:
        # refused by name, and the code never runs.
        marker = tmp_path / "code-ran"
        write_step(root, 7, {0: {"w": RunsCode(str(marker))}})
        assert ray.get(sync.poll_once.remote()) == 2
        status = ray.get(sync.status.remote())
        assert status["load_failures"] == 4 and "refers to the global" in status["failed_steps"][7]
        assert not marker.exists()

        # A later good step is picked up; the bad ones are not retried.
        write_step(root, 8, {0: state_dict(8), 1: state_dict(8)})
        assert ray.get(sync.poll_once.remote()) == 8
        got, _ = ray.get(sync.get_model_state_dict.remote())
        assert equal(got, state_dict(8))
        assert ray.get(sync.status.remote())["load_failures"] == 4


class TestShardFiles:
    """Plain-file checks that need no Ray."""

    def test_truncated_file_is_a_load_error(self, tmp_path):
        write_step(tmp_path, 1, {0: state_dict(1)}, committed=True)
        path = shard_path(tmp_path, 1, 1, 0)
        path.write_bytes(path.read_bytes()[:100])
        with pytest.raises(StateDictLoadError, match="is truncated: 100 bytes"):
            load_sharded_state_dict(path.parent)

    def test_dtensor_shards_load_without_torchs_device_mesh_warning(self, tmp_path, caplog):
        """A Synchronizer has no process group: unpickling a DTensor shard's mesh makes
        torch log that process-group lookups will fail (with torch.compile), once per
        file and sync. The load uses the local tensors alone and keeps that record out
        of the logs."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        full = torch.arange(12.0).view(3, 4)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            shard = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
            write_step(tmp_path, 1, {0: {"w": shard}})
        finally:
            dist.destroy_process_group()
        with caplog.at_level(logging.WARNING):
            merged = load_sharded_state_dict(layout.model_dir(tmp_path, 1))
        assert torch.equal(merged["w"], full)
        assert "DeviceMesh" not in caplog.text, caplog.text
        with caplog.at_level(logging.WARNING), quiet_mesh_unpickling():
            logging.getLogger("torch.distributed.device_mesh").warning("another note")
        assert "another note" in caplog.text  # only that record is kept out
        # Loads in two threads at once: the filter stays until the last one ends.
        mesh_logger = logging.getLogger("torch.distributed.device_mesh")
        with quiet_mesh_unpickling():
            with quiet_mesh_unpickling():
                pass
            assert mesh_logger.filters, "the first load's filter went with the second's"
        assert not mesh_logger.filters

    def test_an_uncommitted_step_is_never_loaded(self, tmp_path):
        write_step(tmp_path, 1, {0: state_dict(1)}, committed=False)
        with pytest.raises(StateDictLoadError, match="never committed by obsckpt"):
            load_sharded_state_dict(layout.model_dir(tmp_path, 1))

    def test_mixed_world_sizes_are_refused(self, tmp_path):
        write_step(tmp_path, 1, {0: state_dict(1)}, committed=False)
        write_step(tmp_path, 1, {0: state_dict(1), 1: state_dict(1)}, committed=False)
        with pytest.raises(StateDictLoadError, match="mixes shards"):
            load_sharded_state_dict(layout.model_dir(tmp_path, 1))

    def test_ranks_must_hold_the_same_names(self):
        with pytest.raises(StateDictLoadError, match="different names"):
            merge_shards({0: {"a": torch.zeros(1)}, 1: {"b": torch.zeros(1)}})


class TestTrinityCallShapes:
    """Trinity's calls work as Trinity makes them; obsckpt's own keep their meaning."""

    def test_get_actor_with_a_config_and_no_wait(self, namespace):
        class Config:  # what Trinity passes: its config, carrying the job's namespace
            ray_namespace = namespace

        sync = Synchronizer.get_actor(Config(), watch=False)
        same = ray.get_actor("synchronizer", namespace=namespace)
        assert ray.get(sync.set_model_state_dict.remote(None, 3))
        assert ray.get(same.get_version.remote()) == 3
        assert ray.get(Synchronizer.get_actor(config=Config()).get_version.remote()) == 3

        # Newer Trinity: no_wait, by keyword or in the second place, never waits.
        t0 = time.monotonic()
        assert ray.get(sync.wait_new_model_state_dict.remote(current_version=3, no_wait=True)) == 3
        assert ray.get(sync.wait_new_model_state_dict.remote(3, True)) == 3
        assert time.monotonic() - t0 < 0.9  # a True taken as timeout=1 waited 1 s
        # A number in the second place is still a timeout, as for obsckpt's callers.
        t0 = time.monotonic()
        assert ray.get(sync.wait_new_model_state_dict.remote(3, 0.3)) == 3
        assert time.monotonic() - t0 >= 0.25
        waiter = sync.wait_new_model_state_dict.remote(3, False)  # no_wait=False: waits
        time.sleep(0.3)
        assert ray.get(sync.set_model_state_dict.remote(None, 4))
        assert ray.get(waiter, timeout=30) == 4


class TestGetActorArguments:
    """get_actor takes the arguments it names (Trinity-RFT passes ``config`` and ``namespace``
    only): a misspelt keyword is refused, naming it, never ignored."""

    def test_a_misspelt_keyword_is_a_type_error_naming_it(self):
        with pytest.raises(TypeError, match="poll_intervall_s"):
            Synchronizer.get_actor(namespace="never-created", poll_intervall_s=0.5)
        with pytest.raises(TypeError, match="default_local_directory"):
            Synchronizer.get_actor("never-created", default_local_directory="/ckpt")


class _Rpc:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, args))


class _FakeMonitor:
    """Stands in for the monitor actor: records the RPCs the synchronizer makes."""

    def __init__(self) -> None:
        self.calls: list = []

    def __getattr__(self, name: str) -> _Rpc:
        return _Rpc(self.calls, name)


class TestTelemetryObject:
    """The synchronizer keeps one telemetry object: its warn-once state lasts, and it moves
    to the monitor (from local metrics) once one is found."""

    def test_one_object_for_the_actors_life(self, caplog):
        from prometheus_client import CollectorRegistry

        sync = Synchronizer(None, namespace="no-monitor-here", registry=CollectorRegistry())
        first = sync._telemetry()
        assert sync._telemetry() is first and first.metrics is not None

        # Measurements that fail are warned about once, however many follow.
        first.metrics = object()  # every metric missing: each measurement raises
        with caplog.at_level("WARNING", logger="obsckpt.sync.telemetry"):
            for step in (1, 2, 3):
                assert asyncio.run(sync.set_model_state_dict(None, step))
            asyncio.run(sync.record_upload(0.1))
        warned = [r for r in caplog.records if "weight-sync measurement failed" in r.message]
        assert len(warned) == 1, caplog.text

        # Once the monitor is found, the same object sends there (and no longer locally).
        monitor = _FakeMonitor()
        sync._telemetry_route.monitor = monitor
        assert asyncio.run(sync.set_model_state_dict(None, 4))
        assert sync._telemetry() is first
        assert first.monitor is monitor and first.metrics is None
        assert monitor.calls == [("record_model_version", ("trainer", 4))]
        assert asyncio.run(sync.status())["telemetry"] == "monitor"


class TestVersionRace:
    """A checkpoint load that finishes after a newer memory upload never moves the version back."""

    def test_publish_checks_the_version_under_the_lock(self, tmp_path):
        from prometheus_client import CollectorRegistry

        root = tmp_path / "ckpt"
        write_step(root, 8, {0: state_dict(8)})
        sync = Synchronizer(str(root), namespace="no-monitor-here", registry=CollectorRegistry())

        async def race():
            cond = sync._condition()
            async with cond:  # hold the lock every publish takes
                upload = asyncio.create_task(sync.set_model_state_dict(state_dict(10), 10))
                load = asyncio.create_task(sync.poll_once())
                # Both passed their own version checks once both wait for the lock
                # (asyncio's Lock keeps its waiters in _waiters).
                deadline = time.monotonic() + 30
                while len(cond._lock._waiters or ()) < 2:
                    assert time.monotonic() < deadline, "the load never reached the lock"
                    await asyncio.sleep(0.01)
            return await upload, await load

        uploaded, version = asyncio.run(race())
        assert uploaded is True and version == 10
        assert sync._version == 10 and equal(sync._state_dict, state_dict(10))
        assert asyncio.run(sync.status())["loaded_step"] is None


class TestResume:
    """After a resume the rollout's reported version follows the restarted versions."""

    def test_rollout_version_follows_a_resume(self):
        from prometheus_client import CollectorRegistry

        from obsckpt.sync.synchronizer import Synchronizer as Actor

        sync = Actor(None, namespace="no-monitor-here", registry=CollectorRegistry())

        async def run() -> tuple[dict, str]:
            await sync.set_model_state_dict(None, 10)
            await sync.get_model_state_dict()  # the rollout runs step 10
            await sync.resume_from(5)
            await sync.set_model_state_dict(None, 6)
            await sync.get_model_state_dict()  # and now step 6
            return await sync.status(), await sync.metrics_text()

        status, text = asyncio.run(run())
        assert status["version"] == 6 and status["rollout_version"] == 6, status
        m = samples(text)
        assert m[("obsckpt_model_version", (("role", "rollout"),))] == 6
        assert m[("obsckpt_model_version", (("role", "trainer"),))] == 6


class TestRetentionRace:
    """Retention may delete the step a lagging Synchronizer is loading, once a newer one
    is committed: that step is superseded, not a failed load."""

    def test_a_step_removed_behind_a_newer_commit_is_skipped_quietly(self, tmp_path, caplog):
        from prometheus_client import CollectorRegistry

        from obsckpt.sync.synchronizer import Synchronizer as Actor

        root = tmp_path / "ckpt"
        write_step(root, 1, {0: state_dict(1)})
        write_step(root, 2, {0: state_dict(2)})
        sync = Actor(str(root), namespace="no-monitor-here", registry=CollectorRegistry())

        # The poll read step 1 from the iteration file; by the time it loads, step 2 is
        # committed and retention (max_ckpt_to_keep=1) has deleted step 1.
        layout.step_dir(root, 1).rename(tmp_path / "deleted")
        with caplog.at_level("INFO", logger="obsckpt.sync.step_model"):
            asyncio.run(sync._load_step(sync._steps, 1))
        status = asyncio.run(sync.status())
        assert status["load_failures"] == 0 and status["last_error"] is None, status
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
        assert "superseded by step 2" in caplog.text
        assert asyncio.run(sync.poll_once()) == 2

    def test_a_damaged_step_that_is_still_there_is_a_failure(self, tmp_path):
        from prometheus_client import CollectorRegistry

        from obsckpt.sync.synchronizer import Synchronizer as Actor

        root = tmp_path / "ckpt"
        write_step(root, 1, {0: state_dict(1)})
        write_step(root, 2, {0: state_dict(2)})
        shard = shard_path(root, 1, 1, 0)
        shard.write_bytes(shard.read_bytes()[:-8])
        sync = Actor(str(root), namespace="no-monitor-here", registry=CollectorRegistry())
        asyncio.run(sync._load_step(sync._steps, 1))
        status = asyncio.run(sync.status())
        assert status["load_failures"] == 1 and "step 1:" in status["last_error"], status


class TestShardPublish:
    """Memory sync from each trainer rank's shard: the Synchronizer merges, every rank hears."""

    @staticmethod
    def actor():
        from prometheus_client import CollectorRegistry

        from obsckpt.sync.synchronizer import Synchronizer as Actor

        return Actor(None, namespace="no-monitor-here", registry=CollectorRegistry())

    @staticmethod
    def shards(full: dict[str, torch.Tensor], world: int) -> list[dict]:
        """Each rank's shard as publish_staged_shards sends it: row-sharded pieces over a
        1-D mesh, the plain tensor from rank 0 only."""
        from torch.distributed.tensor import Shard

        from obsckpt.sync.shards import ShardPiece

        mesh = torch.arange(world)
        out = []
        for rank in range(world):
            piece = full["w"].chunk(world)[rank]
            out.append(
                {
                    "w": ShardPiece(piece, (Shard(0),), mesh, tuple(full["w"].shape)),
                    "count": full["count"] if rank == 0 else None,
                }
            )
        return out

    def test_the_last_rank_merges_and_every_rank_gets_the_result(self):
        sync = self.actor()
        full = {"w": torch.randn(6, 3), "count": torch.tensor([7])}

        async def run():
            calls = [sync.set_model_shard(s, 4, r, 3) for r, s in enumerate(self.shards(full, 3))]
            return await asyncio.gather(*calls), await sync.get_model_state_dict()

        results, (published, version) = asyncio.run(run())
        assert results == [True, True, True] and version == 4
        assert equal(published, full)

    def test_a_newer_step_ends_one_missing_ranks_and_names_them(self):
        sync = self.actor()
        old, new = ({"w": torch.randn(4, 2), "count": torch.tensor([i])} for i in (1, 2))

        async def run():
            waiting = asyncio.ensure_future(sync.set_model_shard(self.shards(old, 2)[0], 1, 0, 2))
            await asyncio.sleep(0)
            done = await asyncio.gather(
                *(sync.set_model_shard(s, 2, r, 2) for r, s in enumerate(self.shards(new, 2)))
            )
            with pytest.raises(StateDictLoadError, match=r"step 1's shards .*ranks \[1\] of 2"):
                await waiting
            return done, await sync.get_model_state_dict()

        done, (published, version) = asyncio.run(run())
        assert done == [True, True] and version == 2 and equal(published, new)

    def test_bad_calls_are_refused_by_name(self):
        sync = self.actor()
        full = {"w": torch.randn(4, 2), "count": torch.tensor([0])}
        first, second = self.shards(full, 2)

        async def run():
            waiting = asyncio.ensure_future(sync.set_model_shard(first, 5, 0, 2))
            await asyncio.sleep(0)
            for call, match in (
                (sync.set_model_shard(second, 5, 2, 2), r"rank must be in \[0, 2\), got 2"),
                (sync.set_model_shard(second, 5, 1, 3), "world_size 3, but an earlier .* 2"),
                (sync.set_model_shard(first, 5, 0, 2), "rank 0 sent its shard of step 5 twice"),
                (sync.set_model_shard(second, 4, 1, 2), "step 5 is being gathered"),
            ):
                with pytest.raises(ValueError, match=match):
                    await call
            assert await sync.set_model_shard(second, 5, 1, 2)
            return await waiting, await sync.get_model_state_dict()

        first_result, (published, version) = asyncio.run(run())
        assert first_result and version == 5 and equal(published, full)

    def test_a_piece_pickles_its_bytes_out_of_band(self):
        import pickle

        from torch.distributed.tensor import Shard

        from obsckpt.sync.shards import ShardPiece

        local = torch.arange(1 << 16, dtype=torch.float32)
        piece = ShardPiece(local, (Shard(0),), torch.arange(2), (1 << 17,))
        buffers: list = []
        data = pickle.dumps(piece, protocol=5, buffer_callback=buffers.append)
        assert len(data) < 4096 and sum(b.raw().nbytes for b in buffers) == local.nbytes
        back = pickle.loads(data, buffers=buffers)
        assert torch.equal(back.local, local) and back.shape == (1 << 17,)
        assert back.placements == (Shard(0),)
