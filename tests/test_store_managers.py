"""verl's FSDP checkpoint manager (obsckpt's) on an ``s3://`` root, against SeaweedFS.

Two FSDP2 ranks on gloo (Ray actors) train a tiny Llama and save full checkpoints
straight to the bucket: shards streamed into their objects, the HF metadata and an
HF export written at a local scratch path and uploaded, each rank's resume record.
The monitor commits each step on the store; retention removes old steps' objects
only once a later commit makes them unneeded; a resume loads verified objects only,
bit for bit, and refuses a flipped byte, an uncommitted step and another world size.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
import ray
import torch
from seaweed import BUCKET, SeaweedServer

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.errors import UnverifiedCheckpointError
from obsckpt.store import layout
from obsckpt.store.s3root import open_s3_root
from obsckpt.sync.group import free_port


@ray.remote
class S3Rank:
    def __init__(self, namespace: str, rank: int, port: int) -> None:
        from workers import cpu_fsdp_group, tiny_fsdp_llama

        from obsckpt.integrations import FSDPCheckpointManager

        torch.set_num_threads(1)
        self.model = tiny_fsdp_llama(cpu_fsdp_group(rank, 2, port))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=None,
            checkpoint_config={
                "save_contents": ["model", "optimizer", "extra"],
                "load_contents": ["model", "optimizer", "extra"],
            },
            ray_namespace=namespace,
        )

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        torch.rand(1)

    def save(self, path: str, step: int, keep: int | None, hdfs: str | None = None) -> dict:
        from obsckpt.resume import ResumeRecord

        counts = self.manager.save_checkpoint(
            path, hdfs, global_step=step, max_ckpt_to_keep=keep, save_as_hf=step == 2
        )
        self.manager.save_resume_record(ResumeRecord.capture(step, data={"at": step}))
        self.manager.wait_on_save_thread(timeout=120)
        return counts

    def weights(self) -> dict:
        from torch.distributed.tensor import DTensor

        return {
            n: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach().clone()
            for n, p in self.model.named_parameters()
        }

    def load(self, path: str) -> int:
        self.manager.load_checkpoint(path)
        return self.manager.restore_resume_record(path).data["at"]


def _commit(monitor, step: int) -> None:
    asyncio.run(CheckpointCoordinator(monitor).register_and_monitor(step, is_state_dict=False))


def test_fsdp_manager_saves_commits_and_resumes_on_s3(namespace, seaweed_server: SeaweedServer):
    root = f"s3://{BUCKET}/verl/{uuid.uuid4().hex[:12]}"
    store = open_s3_root(root)
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=root, metrics_port=None
    )
    ray.get(monitor.status.remote())
    port = free_port()
    ranks = [S3Rank.remote(namespace, r, port) for r in range(2)]

    def both(method, *args):
        return ray.get([getattr(r, method).remote(*args) for r in ranks])

    def actor(step: int) -> str:
        return layout.step_location(root, step, "actor")

    for step in (1, 2, 3):
        both("train", step)
        # Step 3 as verl's trainer passes it with default_hdfs_dir on S3: a local path
        # (never written) and the S3 one, where the files go.
        where = ("/nonexistent/local/actor", actor(step)) if step == 3 else (actor(step), None)
        counts = both("save", where[0], step, 1, where[1])
        assert counts[1] == {"state_dict": 1, "checkpoint": 2}
        _commit(monitor, step)
        assert store.committed("checkpoint") == step
    assert not os.path.exists("/nonexistent")
    saved = both("weights")[0]

    listed = {r.path for r in store.committed_records(3)}
    for rank in (0, 1):
        for kind in ("model", "optim", "extra_state"):
            assert f"actor/{kind}_world_size_2_rank_{rank}.pt" in listed
        assert f"resume/rank_{rank}.pt" in listed
    assert {"actor/fsdp_config.json", "actor/huggingface/config.json"} <= listed
    # The HF export of step 2 went through the scratch path: uploaded, listed, and gone
    # from local disk.
    exported = {r.path for r in store.committed_records(2)}
    assert any(p.startswith("actor/huggingface/model") for p in exported), sorted(exported)
    from obsckpt.store.scratch import scratch_path

    assert not os.path.exists(scratch_path(actor(2), 0))
    # max_ckpt_to_keep=1: step 1's objects went once step 2 was committed (at step 3's save).
    assert store.steps() == [2, 3]
    assert store.manifest(1) is None

    both("train", 4)
    assert both("load", actor(3)) == [3, 3]
    resumed = both("weights")[0]
    assert all(torch.equal(saved[n], resumed[n]) for n in saved)

    # A step with no commit is refused, on every rank.
    with pytest.raises(UnverifiedCheckpointError, match="step 7"):
        both("load", actor(7))

    # One flipped byte in a committed shard: refused before anything is deserialised.
    key = store.step_key(3, "actor/model_world_size_2_rank_1.pt")
    blob = store.client.read(key)
    flipped = bytearray(blob.data)
    flipped[len(flipped) // 2] ^= 0x01
    store.client.put(key, bytes(flipped))
    with pytest.raises(UnverifiedCheckpointError, match="model_world_size_2_rank_1.pt"):
        both("load", actor(3))


@pytest.mark.parametrize(
    "kind,where", [("legacy", "default_hdfs_dir"), ("v1", "default_local_dir")]
)
def test_verl_trainer_saves_and_resumes_on_s3(
    kind, where, ray_cluster, seaweed_server: SeaweedServer, tmp_path, monkeypatch, shared_actors
):
    """verl's own trainer code with its checkpoints on S3: ``default_hdfs_dir`` set to an
    ``s3://`` URL (the local directory verl also names receives nothing), or
    ``default_local_dir`` itself an ``s3://`` URL; then verl's resume from the store."""
    from test_verl_install import WorkerGroup, make_trainer, make_workers, params, trainer_class
    from workers import kill_named

    from obsckpt.integrations import verl_install

    verl_install.patch()
    Trainer, _ = trainer_class(kind, monkeypatch)
    root = f"s3://{BUCKET}/trainer/{uuid.uuid4().hex[:12]}"
    local = tmp_path / "ckpt"
    monkeypatch.chdir(tmp_path)  # a URL taken for a relative path would show up here

    def new_trainer(actor_wg=None, critic_wg=None):
        trainer = make_trainer(local, actor_wg, critic_wg, v1=kind == "v1")
        trainer.config.trainer[where] = root
        return trainer

    trainer = new_trainer()
    monitor = verl_install.monitor_for(trainer)
    store = open_s3_root(root)
    try:
        assert ray.get(monitor.checkpoint_root.remote()) == root
        workers = shared_actors("verl workers", make_workers)  # its two cases share them
        ray.get([w.reset.remote() for w in workers], timeout=120)
        actor, critic = workers[:2], workers[2:]
        trainer.actor_rollout_wg, trainer.critic_wg = WorkerGroup(actor), WorkerGroup(critic)
        for step in (1, 2):
            ray.get([w.train.remote(step) for w in workers])
            trainer.global_steps = step
            trainer.train_dataloader.position = step
            Trainer._save_checkpoint(trainer)
            assert verl_install.wait_for_commit(trainer, timeout=120) == step
        saved_actor, _, saved_critic = params(workers)
        listed = {r.path for r in store.committed_records(2)}
        for name in (
            "data.pt",
            "actor/model_world_size_2_rank_1.pt",
            "critic/optim_world_size_1_rank_0.pt",
            "critic/huggingface/config.json",
        ):
            assert name in listed, (name, sorted(listed))
        assert store.committed("checkpoint") == 2
        assert not local.exists() and not (tmp_path / "s3:").exists()
        assert sorted(os.listdir(tmp_path)) == []

        ray.get([w.train.remote(3) for w in workers])
        resumed = new_trainer(WorkerGroup(actor), WorkerGroup(critic))
        Trainer._load_checkpoint(resumed)
        assert resumed.global_steps == 2
        assert resumed.train_dataloader.position == 2
        now = params(workers)
        for saved, current in zip((saved_actor, saved_actor, saved_critic), now, strict=True):
            assert [n for n in saved if not torch.equal(saved[n], current[n])] == []
    finally:
        kill_named(monitor, "checkpoint_monitor")


def test_demo_on_s3(ray_cluster, seaweed_server: SeaweedServer):
    """`obsckpt demo --ckpt-dir s3://...`: checkpoints, checkpoint sync and a resume on
    the store; then `obsckpt verify` and `status` read it."""
    import io
    import json

    from obsckpt.cli import main
    from obsckpt.demo import DemoConfig, run_demo

    root = f"s3://{BUCKET}/demo/{uuid.uuid4().hex[:12]}"
    common = dict(
        sync_method="checkpoint",
        device="cpu",
        ckpt_dir=root,
        metrics_host="127.0.0.1",
        commit_timeout=60.0,
        progress=False,
    )
    err = io.StringIO()
    first = run_demo(
        DemoConfig(steps=3, save_every=2, **common),
        out=io.StringIO(),
        err=err,
        handle_signals=False,
    )
    assert first.exit_code == 0, err.getvalue()
    assert first.checkpoint_steps == [2, 3]
    assert first.committed == {"checkpoint": 3, "state_dict": 3}
    store = open_s3_root(root)
    assert "resume/rank_1.pt" in {r.path for r in store.committed_records(3)}

    err = io.StringIO()
    result = run_demo(
        DemoConfig(steps=2, save_every=2, resume=True, **common),
        out=io.StringIO(),
        err=err,
        handle_signals=False,
    )
    assert result.exit_code == 0, err.getvalue()
    assert (result.resumed_from, result.first_step, result.last_step) == (3, 4, 5)
    assert result.committed == {"checkpoint": 5, "state_dict": 5}
    out = io.StringIO()
    assert main(["verify", root, "--all"], out=out, err=io.StringIO()) == 0, out.getvalue()
    out = io.StringIO()
    assert main(["status", root, "--json"], out=out) == 0
    assert json.loads(out.getvalue())["problems"] == []

    # Not a prefix the demo wrote: refused, and left alone.
    foreign = f"s3://{BUCKET}/demo/{uuid.uuid4().hex[:12]}"
    store.client.put(open_s3_root(foreign).key("notes.txt"), b"mine")
    from obsckpt.errors import DemoError

    with pytest.raises(DemoError, match=r"holds objects the demo did not write \(notes.txt\)"):
        run_demo(
            DemoConfig(steps=1, **dict(common, ckpt_dir=foreign)),
            out=io.StringIO(),
            err=io.StringIO(),
            handle_signals=False,
        )
    assert open_s3_root(foreign).client.read(open_s3_root(foreign).key("notes.txt")) is not None


class TestMegatronOnS3:
    """The Megatron helpers on an ``s3://`` root, against a stand-in engine (Megatron-core
    cannot be installed here; see tests/test_verl_megatron.py): each rank's files are
    written at a scratch path of its own and uploaded; a load downloads the committed
    files under the path, each checked against the manifest, and loads from there."""

    def _manager(self, monitor, rank: int):
        from test_verl_megatron import FakeMcoreEngine, VerlLikeMegatronManager

        from obsckpt.integrations import MegatronCheckpointManager

        engine = FakeMcoreEngine(rank=rank, world_size=2)
        manager = MegatronCheckpointManager(
            engine=engine,
            base_class=VerlLikeMegatronManager,
            monitor=monitor,
            commit_steps=False,
        )
        return engine, manager

    def test_save_commit_retention_and_load(
        self, namespace, seaweed_server: SeaweedServer, tmp_path, monkeypatch
    ):
        from obsckpt.store.scratch import SCRATCH_ENV, scratch_base

        monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "scratch"))
        root = f"s3://{BUCKET}/megatron/{uuid.uuid4().hex[:12]}"
        store = open_s3_root(root)
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=root, metrics_port=None
        )
        ray.get(monitor.status.remote())
        ranks = [self._manager(monitor, r) for r in (0, 1)]  # two ranks on one node
        for step in (1, 2, 3):
            for _, manager in ranks:
                counts = manager.save_checkpoint(
                    layout.step_location(root, step, "actor"), None, step, 1
                )
                assert counts == {"state_dict": 0, "checkpoint": 1}
            if step < 3:  # step 3 is saved but never submitted
                _commit(monitor, step)
        listed = {r.path for r in store.committed_records(2)}
        assert {"actor/model_0.pt", "actor/model_1.pt", "actor/optim_1.pt"} <= listed
        assert store.steps() == [2, 3]  # max_ckpt_to_keep=1: step 1 went after 2 committed
        assert not any(files for _, _, files in os.walk(scratch_base()))

        engine, manager = ranks[1]
        saved = {k: v.clone() for k, v in engine.module.state_dict().items()}
        with torch.no_grad():
            for p in engine.module.parameters():
                p.add_(1)
        with pytest.raises(UnverifiedCheckpointError, match="step 3"):
            manager.load_checkpoint(layout.step_location(root, 3, "actor"))
        manager.load_checkpoint(layout.step_location(root, 2, "actor"))
        assert all(torch.equal(saved[k], v) for k, v in engine.module.state_dict().items())
        assert not any(files for _, _, files in os.walk(scratch_base()))  # the copy is gone

        # An object replaced after the commit: refused while downloading, nothing loaded.
        key = store.step_key(2, "actor/optim_0.pt")
        store.client.put(key, b"not what was committed")
        with pytest.raises(UnverifiedCheckpointError, match="optim_0.pt"):
            manager.load_checkpoint(layout.step_location(root, 2, "actor"))

    def test_checkpoint_sync_saves_each_ranks_part(self, namespace, seaweed_server):
        from obsckpt.integrations import megatron_save_state_dict

        root = f"s3://{BUCKET}/megatron/{uuid.uuid4().hex[:12]}"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=root, metrics_port=None
        )
        ray.get(monitor.status.remote())
        path = layout.step_location(root, 5, "actor")
        for rank in (0, 1):
            engine, _ = self._manager(monitor, rank)
            coord = CheckpointCoordinator(monitor, rank=rank)
            megatron_save_state_dict(engine, path, 5, coord)
        asyncio.run(
            CheckpointCoordinator(monitor).register_and_monitor(
                5, is_state_dict=True, state_dict_thread_count=1
            )
        )
        store = open_s3_root(root)
        assert store.committed("state_dict") == 5
        assert {r.path for r in store.committed_records(5)} == {
            "actor/model_0.pt",
            "actor/model_1.pt",
        }


def test_the_verl_switch_takes_a_mirror(
    ray_cluster, namespace, seaweed_server: SeaweedServer, tmp_path, monkeypatch
):
    """``+obsckpt.mirror=`` / ``OBSCKPT_MIRROR`` (and ``keep_steps``) reach the monitor the
    verl switch creates for a local root; one naming a local path is refused by name."""
    from omegaconf import OmegaConf
    from test_verl_install import make_trainer

    from obsckpt.integrations import verl_install

    mirror = f"s3://{BUCKET}/verl-mirror/{uuid.uuid4().hex[:12]}"
    trainer = make_trainer(tmp_path / "ckpt", None, None)
    trainer.config = OmegaConf.merge(trainer.config, {"obsckpt": {"keep_steps": 2}})
    monkeypatch.setenv("OBSCKPT_MIRROR", mirror)
    monitor = verl_install.monitor_for(trainer)
    try:
        status = ray.get(monitor.status.remote())
        assert status["mirror"]["url"] == mirror and status["mirror"]["fenced"] is None
        assert open_s3_root(mirror).read_pointer() is not None  # the monitor took it
    finally:
        ray.get(monitor.shutdown.remote(final_scrape_wait_s=0), timeout=90)
        ray.kill(monitor)
    monkeypatch.setenv("OBSCKPT_MIRROR", str(tmp_path / "elsewhere"))
    bad = make_trainer(tmp_path / "other", None, None)
    with pytest.raises(ValueError, match="OBSCKPT_MIRROR|is a local path"):
        verl_install.monitor_for(bad)


def test_world_size_of_a_step_of_objects_is_checked_from_its_manifest():
    """The manager's world-size check on S3 reads the names the step's manifest lists
    under its prefix (no listing of the bucket), and refuses another world size by name."""
    from obsckpt.integrations.fsdp_files import check_world_size
    from obsckpt.integrations.object_steps import names_under

    url = f"s3://{BUCKET}/run/global_step_3/actor"
    listed = {f"actor/model_world_size_4_rank_{r}.pt" for r in range(4)} | {"data.pt"}
    names = names_under(url, listed)
    assert names == {f"model_world_size_4_rank_{r}.pt" for r in range(4)}
    check_world_size(url, 4, 1, ["model"], names)
    with pytest.raises(FileNotFoundError, match=r"saved by 4 ranks .* this job runs 2 ranks"):
        check_world_size(url, 2, 0, ["model"], names)
    with pytest.raises(FileNotFoundError, match="optim_world_size_4_rank_1.pt does not exist"):
        check_world_size(url, 4, 1, ["optim"], names)
