"""Megatron helpers against a stand-in engine (Megatron-core cannot be installed here).

``FakeMcoreEngine`` has the interface of verl's ``McoreEngine`` that the helpers
use: ``module``, ``get_per_tensor_param()`` returning ``(iterator, peft_config)``,
``save_checkpoint`` / ``load_checkpoint`` delegating to a checkpoint manager
with ``checkpoint_save_contents`` (reached as ``checkpoint_mananager``, verl's
spelling). The monitor, coordinator, Synchronizer and gloo broadcast are real.
"""

from __future__ import annotations

import asyncio
import os
import threading
import types

import pytest
import ray
import torch
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointCoordinator, CheckpointMonitor, Synchronizer
from obsckpt.errors import SavePathError, UnverifiedCheckpointError
from obsckpt.integrations import (
    megatron_save_state_dict,
    megatron_sync_weight_nccl,
    megatron_upload_state_dict,
)
from obsckpt.store import layout
from obsckpt.sync.broadcast import WeightBroadcaster
from obsckpt.sync.group import WeightSyncGroup, free_port
from obsckpt.telemetry.metrics import Metrics


class FakeCheckpointManager:
    def __init__(self, engine: FakeMcoreEngine) -> None:
        self.engine = engine
        self.checkpoint_save_contents = ["model", "optimizer", "extra"]
        self.calls: list[list[str]] = []
        self.fail = False

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.calls.append(list(self.checkpoint_save_contents))
        if self.fail:
            raise OSError("disk full")
        os.makedirs(local_path, exist_ok=True)
        rank = self.engine.rank
        if "model" in self.checkpoint_save_contents:
            torch.save(
                self.engine.module.state_dict(), os.path.join(local_path, f"model_{rank}.pt")
            )
        if "optimizer" in self.checkpoint_save_contents:
            torch.save({}, os.path.join(local_path, f"optim_{rank}.pt"))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        sd = torch.load(os.path.join(local_path, f"model_{self.engine.rank}.pt"))
        self.engine.module.load_state_dict(sd)


class FakeMcoreEngine:
    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        torch.manual_seed(0)
        self.rank = rank
        self.world_size = world_size
        self.module = torch.nn.Sequential(
            torch.nn.Linear(5, 3), torch.nn.Linear(3, 2).to(torch.bfloat16)
        )
        self.checkpoint_mananager = FakeCheckpointManager(self)
        self.exported = 0

    def get_per_tensor_param(self, **kwargs):
        def gen():
            for name, p in self.module.state_dict().items():
                self.exported += 1
                yield f"model.{name}", p.detach()

        return gen(), None

    # As McoreEngine calls its manager: with keywords.
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.checkpoint_mananager.save_checkpoint(
            local_path=local_path,
            hdfs_path=hdfs_path,
            global_step=global_step,
            max_ckpt_to_keep=max_ckpt_to_keep,
        )

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True):
        self.checkpoint_mananager.load_checkpoint(
            local_path=local_path, hdfs_path=hdfs_path, del_local_after_load=del_local_after_load
        )


def hf_state_dict(engine: FakeMcoreEngine) -> dict[str, torch.Tensor]:
    return {f"model.{k}": v for k, v in engine.module.state_dict().items()}


@pytest.fixture
def monitor(namespace, tmp_path):
    m = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(tmp_path / "ckpt"), metrics_port=None
    )
    ray.get(m.status.remote())
    return m


class TestSaveStateDict:
    """Only the model is saved, the contents are restored afterwards, and the monitor commits it."""

    def test_model_only_then_committed(self, monitor, tmp_path):
        engine = FakeMcoreEngine()
        coord = CheckpointCoordinator(monitor, rank=0)
        path = layout.model_dir(tmp_path / "ckpt", 3)
        assert megatron_save_state_dict(engine, str(path), 3, coord, None) == 1
        manager = engine.checkpoint_mananager
        assert manager.calls == [["model"]]
        assert manager.checkpoint_save_contents == ["model", "optimizer", "extra"]
        assert sorted(os.listdir(path)) == ["model_0.pt"]
        asyncio.run(coord.register_and_monitor(3, is_state_dict=True, state_dict_thread_count=1))
        assert (tmp_path / "ckpt" / "latest_state_dict_iteration.txt").read_text().strip() == "3"

        # A rank whose "already committed?" check ran before the commit: the monitor
        # does not admit its part, and nothing is saved into the committed step.
        class CheckedBeforeTheCommit(CheckpointCoordinator):
            def committed_step(self, is_state_dict: bool = False) -> None:
                return None

        committed = (path / "model_0.pt").read_bytes()
        late = CheckedBeforeTheCommit(monitor, rank=0)
        assert megatron_save_state_dict(engine, str(path), 3, late, None) == 0
        assert manager.calls == [["model"]] and (path / "model_0.pt").read_bytes() == committed

        # The saved weights load back into a fresh engine.
        other = FakeMcoreEngine()
        with torch.no_grad():
            for p in other.module.parameters():
                p.zero_()
        other.load_checkpoint(str(path))
        assert all(
            torch.equal(a, b)
            for a, b in zip(
                hf_state_dict(engine).values(), hf_state_dict(other).values(), strict=True
            )
        )

    def test_failure_is_reported_and_contents_restored(self, monitor, tmp_path):
        engine = FakeMcoreEngine()
        engine.checkpoint_mananager.fail = True
        coord = CheckpointCoordinator(monitor, rank=0)
        with pytest.raises(OSError, match="disk full") as raised:
            megatron_save_state_dict(
                engine, str(layout.model_dir(tmp_path / "ckpt", 4)), 4, coord, None
            )
        # What the engine raised, as a direct call raises it, with a note naming the save.
        assert type(raised.value) is OSError
        assert "of step 4 (state_dict) failed" in raised.value.__notes__[0]
        assert engine.checkpoint_mananager.checkpoint_save_contents == [
            "model",
            "optimizer",
            "extra",
        ]
        asyncio.run(coord.register_and_monitor(4, is_state_dict=True, state_dict_thread_count=1))
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [4]
        assert not (tmp_path / "ckpt" / "latest_state_dict_iteration.txt").exists()

    def test_a_failed_rank_fails_the_step(self, monitor, tmp_path):
        """Each rank's save is a part of one save: rank 0's success does not cover rank 1."""
        path = str(layout.model_dir(tmp_path / "ckpt", 5))
        failing = FakeMcoreEngine(rank=1, world_size=2)
        failing.checkpoint_mananager.fail = True
        coord = CheckpointCoordinator(monitor, rank=1)
        with pytest.raises(OSError, match="disk full") as raised:
            megatron_save_state_dict(failing, path, 5, coord, None)
        assert "the step fails" in raised.value.__notes__[0]
        rank0 = CheckpointCoordinator(monitor, rank=0)
        assert megatron_save_state_dict(FakeMcoreEngine(rank=0, world_size=2), path, 5, rank0) == 1
        asyncio.run(rank0.register_and_monitor(5, is_state_dict=True, state_dict_thread_count=1))
        status = ray.get(monitor.status.remote())
        [failed] = status["failed"]
        assert failed["step"] == 5 and "disk full" in failed["error"]
        assert status["pending"] == []
        assert not (tmp_path / "ckpt" / "latest_state_dict_iteration.txt").exists()


def test_upload_state_dict_from_rank_0_only(namespace):
    """Every rank iterates the export (a collective in Megatron); only rank 0 uploads."""
    sync = Synchronizer.get_actor(namespace=namespace, watch=False)
    rank0, rank1 = FakeMcoreEngine(rank=0), FakeMcoreEngine(rank=1)
    assert megatron_upload_state_dict(rank1, sync, 5, None) is None
    assert rank1.exported == 4
    assert ray.get(sync.get_version.remote()) is None
    assert megatron_upload_state_dict(rank0, sync, 5, None) > 0
    got, version = ray.get(sync.get_model_state_dict.remote())
    expected = hf_state_dict(rank0)
    assert version == 5 and list(got) == list(expected)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in expected.items())


@ray.remote
class _SlowSynchronizer:
    """Takes a state dict only once released (a rollout side that has not finished)."""

    def __init__(self):
        self.taken = None

    async def set_model_state_dict(self, state_dict, step):
        import asyncio

        while not self.taken:
            await asyncio.sleep(0.05)
        return step

    def release(self):
        self.taken = True

    def record_upload(self, seconds):
        pass


def test_a_stuck_upload_is_named_in_the_log(monkeypatch, caplog):
    """The upload waits as long as the Synchronizer takes, but says what it waits for."""
    import logging

    from obsckpt.integrations import _common

    monkeypatch.setattr(_common, "STALL_WARNING_S", 0.1)
    sync = _SlowSynchronizer.remote()
    threading.Timer(0.5, lambda: sync.release.remote()).start()
    with caplog.at_level(logging.WARNING, logger="obsckpt"):
        assert megatron_upload_state_dict(FakeMcoreEngine(rank=0), sync, 7, None) > 0
    assert "still waiting for the Synchronizer to take the weights of step 7 after" in caplog.text


def test_sync_weight_over_gloo_bucketed():
    """Trainer rank 0 broadcasts the exported tensors; the receiver gets the same bits."""
    port = free_port()
    received: dict = {}

    def receiver() -> None:
        group = WeightSyncGroup(
            host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=30
        )
        received.update(WeightBroadcaster(group).recv(clone=True))
        group.close()

    t = threading.Thread(target=receiver, name="receiver")
    t.start()
    group = WeightSyncGroup(
        host="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo", timeout_s=30
    )
    engine = FakeMcoreEngine()
    metrics = Metrics(CollectorRegistry())
    result = megatron_sync_weight_nccl(engine, group, step=6, metrics=metrics)
    t.join(timeout=60)
    group.close()
    expected = hf_state_dict(engine)
    assert list(received) == list(expected)
    assert all(
        torch.equal(received[k], v) and received[k].dtype == v.dtype for k, v in expected.items()
    )
    assert result.nbytes == sum(v.numel() * v.element_size() for v in expected.values())
    assert (
        metrics.registry.get_sample_value(
            "obsckpt_broadcast_bytes_total", {"backend": "gloo", "method": "broadcast"}
        )
        == result.nbytes
    )


def test_integrations_do_not_import_verl():
    """obsckpt's core and the FSDP/Megatron helpers never import verl (it takes seconds)."""
    import subprocess
    import sys

    code = (
        "import sys, obsckpt, obsckpt.integrations as i\n"
        "i.fsdp_save_state_dict, i.megatron_save_state_dict\n"
        "assert 'verl' not in sys.modules, 'verl was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_verl_the_managers_say_what_to_install():
    """The helpers work without verl; the managers, which need it, say how to get it."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class NoVerl:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'verl':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoVerl())\n"
        "import obsckpt.integrations as i\n"
        "i.fsdp_save_state_dict, i.megatron_save_state_dict\n"
        "for make in (lambda: i.FSDPCheckpointManager, "
        "lambda: i.MegatronCheckpointManager(monitor=object())):\n"
        "    try:\n"
        "        make()\n"
        "    except ModuleNotFoundError as exc:\n"
        "        print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    for what, line in zip(
        ("FSDPCheckpointManager", "MegatronCheckpointManager"), lines, strict=True
    ):
        assert what in line and "pip install 'obsckpt[verl]'" in line, line

    def test_a_path_into_another_step_is_refused_before_megatron_writes(self, monitor, tmp_path):
        """Megatron writes local_path in place, a directory every rank shares: a path into
        committed step 3 for step 4 is refused before the engine runs, and step 4 fails."""
        engine = FakeMcoreEngine()
        coord = CheckpointCoordinator(monitor, rank=0)
        path = layout.model_dir(tmp_path / "ckpt", 3)
        assert megatron_save_state_dict(engine, str(path), 3, coord, None) == 1
        asyncio.run(coord.register_and_monitor(3, is_state_dict=True, state_dict_thread_count=1))
        committed = (path / "model_0.pt").read_bytes()

        with pytest.raises(SavePathError, match=r"step 4 refused .*\(step 3\)"):
            megatron_save_state_dict(engine, str(path), 4, coord, None)
        assert engine.checkpoint_mananager.calls == [["model"]]  # the engine never ran
        assert (path / "model_0.pt").read_bytes() == committed
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [4]
        assert status["pending"] == [] and status["in_flight"] == []


class VerlLikeMegatronManager(FakeCheckpointManager):
    """verl's MegatronCheckpointManager interface: built with keywords, knows its rank."""

    def __init__(self, *, engine: FakeMcoreEngine, checkpoint_config=None, **kwargs) -> None:
        super().__init__(engine)
        self.checkpoint_config = checkpoint_config
        self.rank = engine.rank
        self.kwargs = kwargs
        self.keep_args: list = []

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.keep_args.append(max_ckpt_to_keep)
        super().save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)


class TestMegatronCheckpointManager:
    """Saves are registered and reported, commit only when submitted, and retention is safe."""

    def make(self, monitor, **kwargs):
        from obsckpt.integrations import MegatronCheckpointManager

        engine = FakeMcoreEngine()
        kwargs.setdefault("commit_steps", False)  # the tests submit, as the trainer does
        manager = MegatronCheckpointManager(
            engine=engine,
            base_class=VerlLikeMegatronManager,
            monitor=monitor,
            role="actor",
            **kwargs,
        )
        return engine, manager

    def test_used_alone_it_commits_its_own_saves(self, monitor, tmp_path):
        """No trainer submits (this monitor was made by none): the manager submits the
        step it saved, and a load of it waits for that commit."""
        engine, manager = self.make(monitor, commit_steps=None)
        assert manager.commit_steps is True
        path = layout.model_dir(tmp_path / "ckpt", 4)
        assert manager.save_checkpoint(str(path), None, 4)["checkpoint"] == 1
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1)
        manager.load_checkpoint(str(path))
        assert all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
        assert ray.get(monitor.status.remote())["latest"]["checkpoint"] == 4

    @pytest.mark.parametrize(
        "config",
        [{"async_save": True}, types.SimpleNamespace(async_save=True)],
        ids=["dict", "dataclass"],
    )
    def test_async_save_is_refused_by_name(self, monitor, config):
        """Megatron's asynchronous save returns before its files exist: the step would
        commit too early, and verl would write the iteration file itself."""
        with pytest.raises(ValueError, match=r"checkpoint\.async_save=True.*async_save=false"):
            self.make(monitor, checkpoint_config=config)
        _, manager = self.make(monitor, checkpoint_config={"async_save": False})
        assert manager.checkpoint_config == {"async_save": False}

    def test_attribute_writes_reach_verls_manager(self, monitor):
        """verl's properties read verl's attributes: a write through the manager must land there."""
        _, manager = self.make(monitor)
        manager.checkpoint_save_contents = ["model"]
        assert manager.base.checkpoint_save_contents == ["model"]
        assert "checkpoint_save_contents" not in vars(manager)

    def test_checkpoint_sync_through_the_managers_engine(self, monitor, tmp_path):
        """megatron_save_state_dict on an engine that holds this manager (what verl_install
        builds): only the model is saved, and the step has no checkpoint save left open."""
        engine, manager = self.make(monitor)
        engine.checkpoint_mananager = manager
        coord = CheckpointCoordinator(monitor, rank=0)
        path = layout.model_dir(tmp_path / "ckpt", 7)
        assert megatron_save_state_dict(engine, str(path), 7, coord) == 1
        assert manager.base.calls == [["model"]]
        assert sorted(os.listdir(path)) == ["model_0.pt"]
        asyncio.run(coord.register_and_monitor(7, is_state_dict=True, state_dict_thread_count=1))
        status = ray.get(monitor.status.remote())
        assert status["latest"]["state_dict"] == 7
        assert status["pending"] == [] and status["failed"] == []

    def test_save_commit_retention_and_load(self, monitor, tmp_path):
        engine, manager = self.make(monitor)
        root = tmp_path / "ckpt"
        assert manager.kwargs == {"role": "actor"}  # verl's attributes pass through
        coord = CheckpointCoordinator(monitor, rank=0)
        for step in (1, 2, 3):
            path = layout.model_dir(root, step)
            assert manager.save_checkpoint(str(path), None, step, max_ckpt_to_keep=1) == {
                "state_dict": 0,
                "checkpoint": 1,
            }
            if step < 3:  # step 3 is saved but never submitted
                asyncio.run(coord.register_and_monitor(step))
                assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
        # verl's rotation never runs (it would delete before the commit); ours kept the
        # committed step 2 and the uncommitted step 3, and removed step 1.
        assert manager.keep_args == [None, None, None]
        assert not layout.step_dir(root, 1).exists()
        assert (layout.model_dir(root, 2) / "model_0.pt").exists()
        assert (layout.model_dir(root, 3) / "model_0.pt").exists()
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1)
        # Step 3 was never committed: nothing of it is loaded.
        with pytest.raises(UnverifiedCheckpointError, match="step 3 was never committed"):
            manager.load_checkpoint(str(layout.model_dir(root, 3)))
        manager.load_checkpoint(str(layout.model_dir(root, 2)))
        assert all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
        # A file put into the committed step afterwards is refused by name.
        (layout.model_dir(root, 2) / "extra.pt").write_bytes(b"x")
        with pytest.raises(UnverifiedCheckpointError, match="extra.pt is not listed"):
            manager.load_checkpoint(str(layout.model_dir(root, 2)))

    def test_unreadable_iteration_file_skips_retention_not_the_save(self, monitor, tmp_path):
        """Retention cannot tell which step is committed: it deletes nothing, and the save
        that succeeded is not reported as failed (as the FSDP manager does)."""
        _, manager = self.make(monitor)
        root = tmp_path / "ckpt"  # the monitor's root, created with it
        (root / "latest_checkpointed_iteration.txt").write_text("half-written\n")
        for step in (1, 2):
            path = layout.model_dir(root, step)
            assert manager.save_checkpoint(str(path), None, step, max_ckpt_to_keep=1) == {
                "state_dict": 0,
                "checkpoint": 1,
            }
        assert (layout.model_dir(root, 1) / "model_0.pt").exists()

    def test_failed_save_raises_and_never_commits(self, monitor, tmp_path):
        _, manager = self.make(monitor)
        manager.base.fail = True
        root = tmp_path / "ckpt"
        with pytest.raises(OSError, match="disk full") as raised:
            manager.save_checkpoint(str(layout.model_dir(root, 4)), None, 4)
        assert "'megatron_checkpoint' of step 4" in raised.value.__notes__[0]
        asyncio.run(CheckpointCoordinator(monitor, rank=0).register_and_monitor(4))
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [4]
        assert not (root / "latest_checkpointed_iteration.txt").exists()

    def test_resave_of_a_committed_checkpoint_writes_nothing(self, monitor, tmp_path):
        """A job resumed from an older step retrains steps whose checkpoints are committed:
        Megatron writes its files in place, so a re-save would change (and a crash during it
        tear) a checkpoint the iteration file vouches for. verl's save is not run at all."""
        from obsckpt.store import reader

        engine, manager = self.make(monitor)
        root = tmp_path / "ckpt"
        path = layout.model_dir(root, 5)
        manager.save_checkpoint(str(path), None, 5)
        asyncio.run(CheckpointCoordinator(monitor, rank=0).register_and_monitor(5))
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
        committed = (path / "model_0.pt").read_bytes()

        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1)  # the rerun's weights
        counts = manager.save_checkpoint(str(path), None, 5)
        assert (path / "model_0.pt").read_bytes() == committed
        assert reader.verify_step(layout.step_dir(root, 5)) == []
        assert counts == {"state_dict": 0, "checkpoint": 0}
        assert len(manager.base.calls) == 1

    def test_a_path_into_another_step_is_refused_before_verl_saves(self, monitor, tmp_path):
        _, manager = self.make(monitor)
        root = tmp_path / "ckpt"
        path = layout.model_dir(root, 5)
        manager.save_checkpoint(str(path), None, 5)
        asyncio.run(CheckpointCoordinator(monitor, rank=0).register_and_monitor(5))
        committed = (path / "model_0.pt").read_bytes()

        with pytest.raises(SavePathError, match=r"'megatron_checkpoint' of step 6 refused"):
            manager.save_checkpoint(str(path), None, 6)
        assert len(manager.base.calls) == 1 and (path / "model_0.pt").read_bytes() == committed
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [6]
        assert status["pending"] == [] and status["in_flight"] == []


# What verl's Megatron manager writes under a role's directory, by verl release: the model's
# distributed checkpoint (Megatron's torch_dist files) and, on rank 0, its transformer config.
DIST_CKPT_LAYOUTS = {
    "verl-0.7": ("dist_ckpt", ["transformer_config.json"]),
    "verl-0.9": (
        os.path.join("model", "dist_ckpt"),
        ["transformer_config.json", "ckpt_contents.json"],
    ),
}


class DistCheckpointManager(VerlLikeMegatronManager):
    """Saves as verl's Megatron manager lays its files out (``layout``: a verl release)."""

    def __init__(self, *, layout: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.layout = layout

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        self.calls.append(list(self.checkpoint_save_contents))
        subdir, rank0_files = DIST_CKPT_LAYOUTS[self.layout]
        dist_dir = os.path.join(local_path, subdir)
        os.makedirs(dist_dir, exist_ok=True)
        rank = self.engine.rank
        torch.save(self.engine.module.state_dict(), os.path.join(dist_dir, f"__{rank}_0.distcp"))
        if rank == 0:
            torch.save({}, os.path.join(dist_dir, "common.pt"))
            for name in ["metadata.json", *rank0_files]:
                target = dist_dir if name == "metadata.json" else local_path
                with open(os.path.join(target, name), "w") as f:
                    f.write('{"sharded_backend": "torch_dist"}')


class TestCheckpointSyncOfMegatronSteps:
    """The Synchronizer refuses a step Megatron wrote by name, saying to use memory sync.

    Checkpoint sync reads FSDP shards (``model_world_size_<W>_rank_<R>.pt``);
    a step holding Megatron's distributed checkpoint is reported as such, with
    what to do, not as a step that merely lacks those files.
    """

    def test_synchronizer_names_the_layout(self, monitor, tmp_path):
        from obsckpt.integrations import MegatronCheckpointManager

        engine = FakeMcoreEngine()
        engine.checkpoint_mananager = MegatronCheckpointManager(
            engine=engine, base_class=DistCheckpointManager, monitor=monitor, layout="verl-0.9"
        )
        root = tmp_path / "ckpt"
        coord = CheckpointCoordinator(monitor, rank=0)
        assert megatron_save_state_dict(engine, str(layout.model_dir(root, 3)), 3, coord)
        asyncio.run(coord.register_and_monitor(3, is_state_dict=True, state_dict_thread_count=1))
        assert (root / "latest_state_dict_iteration.txt").read_text().strip() == "3"

        async def synchronizer_status() -> dict:
            sync = Synchronizer(
                str(root), namespace="no-monitor-here", registry=CollectorRegistry()
            )
            await sync.poll_once()
            return await sync.status()

        status = asyncio.run(synchronizer_status())
        assert status["version"] is None
        error = status["failed_steps"][3]
        assert f"holds a Megatron checkpoint ({os.path.join('model', 'dist_ckpt')})" in error
        assert "cannot read Megatron's distributed-checkpoint layout" in error
        assert "megatron_upload_state_dict" in error and "set_model_state_dict" in error

    @pytest.mark.parametrize("layout", sorted(DIST_CKPT_LAYOUTS))
    def test_either_layout_is_named(self, layout, tmp_path):
        from obsckpt.errors import MegatronLayoutError
        from obsckpt.sync.shards import load_sharded_state_dict

        engine = FakeMcoreEngine()
        DistCheckpointManager(engine=engine, layout=layout).save_checkpoint(str(tmp_path))
        with pytest.raises(MegatronLayoutError, match=rf"\({DIST_CKPT_LAYOUTS[layout][0]}\)"):
            load_sharded_state_dict(tmp_path)
        # The directory of the distributed checkpoint itself, too.
        with pytest.raises(MegatronLayoutError, match=r"\(__0_0\.distcp\)"):
            load_sharded_state_dict(tmp_path / DIST_CKPT_LAYOUTS[layout][0])


class TestSharedHelpers:
    """The Megatron helpers share the upload and the broadcast with the FSDP helpers through
    ``_common``, not by importing ``verl_fsdp``; what ``verl_fsdp`` offered stays importable."""

    def test_megatron_does_not_import_the_fsdp_module(self):
        import ast

        from obsckpt.integrations import verl_megatron

        with open(verl_megatron.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        assert "obsckpt.integrations.verl_fsdp" not in imported
        assert "obsckpt.integrations._common" in imported

    def test_shared_names_stay_importable_from_verl_fsdp(self):
        from obsckpt.integrations import _common, verl_fsdp, verl_megatron

        shared = [
            "already_committed",
            "broadcast_named_tensors",
            "broadcaster_for",
            "dist_rank",
            "dist_world_size",
            "gather_full_state_dict",
            "per_tensor_params",
            "upload_state_dict",
        ]
        assert [n for n in shared if getattr(verl_fsdp, n) is not getattr(_common, n)] == []
        # One upload for both engines.
        assert verl_fsdp.upload_engine_state_dict is verl_megatron.upload_engine_state_dict
