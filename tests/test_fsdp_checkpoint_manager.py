"""obsckpt's FSDPCheckpointManager on verl 0.9.1: background saves, resume, safe retention.

Two FSDP2 ranks on gloo (Ray actors) train a tiny Llama causal LM built from a
config; the monitor commits the steps; the manager's retention never deletes
the latest committed step.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import numpy as np
import pytest
import ray
import torch
from reliability_helpers import RunsCode, rewrite_manifest

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.errors import UnsafeCheckpointError, UnverifiedCheckpointError
from obsckpt.sync.group import free_port


@ray.remote
class Rank:
    """One of two FSDP2 ranks on gloo, shared by this module's jobs (``start_job``): each
    job starts it over (:meth:`reset`), as a new job's worker starts."""

    def __init__(self, rank: int, port: int) -> None:
        from workers import cpu_fsdp_group

        torch.set_num_threads(1)
        self.mesh = cpu_fsdp_group(rank, 2, port)
        self.manager = None

    def reset(self, namespace: str) -> None:
        """A new job on this process: the seeded model, a new optimizer and scheduler, and a
        manager of ``namespace``'s monitor; the previous job's manager is closed first."""
        from workers import tiny_fsdp_llama

        if self.manager is not None:
            self.manager.coordinator.close(timeout=60)
        self.manager = None
        model = tiny_fsdp_llama(self.mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        self.namespace = namespace
        self.restart_manager()

    def restart_manager(self, sync_save: bool | None = None) -> None:
        """A new manager, as a restarted worker builds it: it knows nothing of earlier saves."""
        from obsckpt.integrations import FSDPCheckpointManager

        self.manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            sync_save=sync_save,
            model=self.model,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            checkpoint_config={
                "save_contents": ["model", "optimizer", "extra"],
                "load_contents": ["model", "optimizer", "extra"],
            },
            ray_namespace=self.namespace,
        )

    def train(self, step: int) -> float:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        # What dropout and data shuffling draw: the RNGs verl's extra state restores.
        torch.rand(1)
        np.random.rand()
        random.random()
        return float(loss)

    def save(self, root: str, step: int, keep: int) -> dict:
        path = os.path.join(root, f"global_step_{step}", "actor")
        counts = self.manager.save_checkpoint(path, global_step=step, max_ckpt_to_keep=keep)
        self.manager.wait_on_save_thread(timeout=120)
        return counts

    def save_and_list(self, root: str, step: int) -> list[str]:
        """Save, then at once (no wait) this rank's files that are already in place."""
        from obsckpt.store import layout

        path = os.path.join(root, f"global_step_{step}", "actor")
        self.manager.save_checkpoint(path, global_step=step, max_ckpt_to_keep=None)
        mine = [layout.shard_name(k, 2, self.manager.rank) for k in layout.SHARD_KINDS]
        return sorted(n for n in os.listdir(path) if n in mine)

    def save_state_dict(self, root: str, step: int) -> int:
        path = os.path.join(root, f"global_step_{step}", "actor")
        n = self.manager.save_state_dict(path, global_step=step)
        self.manager.wait_on_save_thread(timeout=120)
        return n

    def upload_then_save(self, root: str, step: int, save_step: int) -> dict:
        """Trinity's order at a step that syncs and saves: the memory sync, then the checkpoint
        (of ``save_step``; training in between when they differ). How many snapshots the
        model's slot took for both."""
        from obsckpt.integrations.verl_fsdp import MODEL_SLOT

        staging = self.manager.coordinator._staging
        before = staging.generation(MODEL_SLOT)
        self.manager.upload_state_dict(step)
        if save_step != step:
            self.train(save_step)
        path = os.path.join(root, f"global_step_{save_step}", "actor")
        self.manager.save_checkpoint(path, global_step=save_step, max_ckpt_to_keep=None)
        self.manager.wait_on_save_thread(timeout=120)
        return {"snapshots": staging.generation(MODEL_SLOT) - before}

    def upload(self, step: int) -> float | None:
        return self.manager.upload_state_dict(step)

    def prepared_slots(self) -> dict:
        """Each save slot's staging bytes once its background prepare has ended, and the slots
        whose save has had to allocate (a cold save) since the manager was built."""
        coordinator = self.manager.coordinator
        coordinator._staging.wait_prepared(time.monotonic() + 60)
        slots = ("model_state_dict", "optim", "extra_state")
        return {s: coordinator.staging_bytes(s)[0] for s in slots} | {"cold": list(self.cold)}

    def restart_manager_counting_cold_saves(self) -> None:
        self.restart_manager()
        staging = self.manager.coordinator._staging
        self.cold: list[str] = []
        allocated = staging._cold_save

        def counted(slot, step, buffers):
            self.cold.append(slot)
            allocated(slot, step, buffers)

        staging._cold_save = counted

    def save_with_record(self, root: str, step: int) -> list[float]:
        """A checkpoint and this rank's resume record; what torch draws next."""
        from obsckpt.resume import ResumeRecord

        path = os.path.join(root, f"global_step_{step}", "actor")
        self.manager.save_checkpoint(path, global_step=step, max_ckpt_to_keep=None)
        record = ResumeRecord.capture(step, data={"position": 4 * step}, weight_version=step)
        self.manager.save_resume_record(record)
        self.manager.wait_on_save_thread(timeout=120)
        return torch.rand(3).tolist()

    def restore_record(self, root: str, step: int) -> tuple:
        class Loader:  # a data loader's state interface
            state = None

            def load_state_dict(self, state: dict) -> None:
                self.state = state

        torch.rand(5)  # the RNG moves on before the restore
        loader = Loader()
        path = os.path.join(root, f"global_step_{step}", "actor")
        record = self.manager.restore_resume_record(path, data_loader=loader)
        return record.weight_version, loader.state, torch.rand(3).tolist()

    def snapshot(self) -> dict:
        """Full parameters, optimizer, scheduler and RNG states (collectives: call on both ranks)."""
        from torch.distributed.tensor import DTensor

        def full(t):
            return t.full_tensor() if isinstance(t, DTensor) else t.clone()

        params = {n: full(p.detach()) for n, p in self.model.named_parameters()}
        state = self.optimizer.state_dict()["state"]
        optim = {(i, k): full(v) for i, s in state.items() for k, v in s.items()}
        rng = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
        return {"params": params, "optim": optim, "lr": self.scheduler.get_last_lr(), "rng": rng}

    def load(self, root: str, step: int) -> None:
        self.manager.load_checkpoint(os.path.join(root, f"global_step_{step}", "actor"))


@ray.remote
class WholeStateSynchronizer:
    """A Synchronizer of whole state dicts only (no ``set_model_shard``)."""

    def __init__(self) -> None:
        self.state = self.version = None

    def set_model_state_dict(self, state: dict, step: int) -> bool:
        self.state, self.version = state, step
        return True

    def record_upload(self, seconds: float) -> None:
        pass

    def held(self) -> tuple:
        return self.state, self.version


def commit(monitor, step: int) -> None:
    asyncio.run(CheckpointCoordinator(monitor).register_and_monitor(step, is_state_dict=False))


def same(a: dict, b: dict) -> list:
    return [k for k in a if not torch.equal(a[k], b[k])]


# A rank call that has not returned in this long is stuck (a peer left a collective).
RANK_CALL_S = 300.0


@pytest.fixture
def ranks(shared_actors):
    """The two ranks this module's jobs share (each job starts them over: ``start_job``)."""
    port = free_port()
    return shared_actors("fsdp ranks", lambda: [Rank.remote(r, port) for r in range(2)])


@pytest.fixture
def own_ranks(ray_cluster):
    """Two ranks of the test's own, for a test whose loads fail on some ranks only (their
    gloo group is then out of step, and no later job could use it)."""
    port = free_port()
    made = [Rank.remote(r, port) for r in range(2)]
    yield made
    for r in made:
        ray.kill(r)


def start_job(namespace, root, ranks):
    """The monitor at ``root`` and the two ranks started over for it; returns the monitor
    and ``both(method, *args)``."""
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())

    def both(method, *args):
        return ray.get([getattr(r, method).remote(*args) for r in ranks], timeout=RANK_CALL_S)

    both("reset", namespace)
    return monitor, both


def test_save_resume_and_retention(namespace, tmp_path, own_ranks):
    root = tmp_path / "ckpt"
    monitor, both = start_job(namespace, root, own_ranks)
    # With no prepare() call in the trainer (verl's and Trinity's make none), the manager
    # prepares its model and extra-state slots when built and its optimizer's after the
    # first step, so no first save allocates its staging on the training path.
    both("restart_manager_counting_cold_saves")
    built = both("prepared_slots")
    assert all(s["model_state_dict"] > 0 and s["extra_state"] > 0 for s in built), built
    assert all(s["optim"] == 0 for s in built), built  # no optimizer state yet

    def step_files(step):
        return sorted(os.listdir(root / f"global_step_{step}" / "actor"))

    for step in (1, 2, 3):
        both("train", step)
        if step == 1:
            assert all(s["optim"] > 0 for s in both("prepared_slots"))
        counts = both("save", str(root), step, 1)
        assert counts == [{"state_dict": 1, "checkpoint": 2}] * 2
        commit(monitor, step)
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    assert [s["cold"] for s in both("prepared_slots")] == [[], []]  # three saves, none cold
    saved = both("snapshot")[0]

    files = step_files(3)
    for rank in (0, 1):
        for prefix in ("model", "optim", "extra_state"):
            assert f"{prefix}_world_size_2_rank_{rank}.pt" in files
    assert "config.json" in os.listdir(root / "global_step_3" / "actor" / "huggingface")
    # max_ckpt_to_keep=1: step 1 went once step 2 was committed; step 2 is the
    # previous commit and is removed at the next save.
    assert not (root / "global_step_1").exists()  # the whole step dir, manifest included

    # Step 4 is saved but never committed: the latest committed step (3) stays,
    # although it is beyond max_ckpt_to_keep.
    both("train", 4)
    both("save", str(root), 4, 1)
    assert not (root / "global_step_2").exists()
    assert (root / "global_step_3" / "actor").is_dir()
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    changed = both("snapshot")[0]
    assert same(saved["params"], changed["params"])  # training moved the weights

    both("load", str(root), 3)
    resumed = both("snapshot")[0]
    assert same(saved["params"], resumed["params"]) == []
    assert saved["optim"].keys() == resumed["optim"].keys()
    assert same(saved["optim"], resumed["optim"]) == []
    assert resumed["lr"] == pytest.approx(saved["lr"])
    assert not torch.equal(changed["rng"][0], saved["rng"][0])
    assert torch.equal(resumed["rng"][0], saved["rng"][0])
    assert (resumed["rng"][1] == saved["rng"][1]).all() and resumed["rng"][2] == saved["rng"][2]

    # A step saved by another number of ranks (a resume on other GPUs) is refused by name
    # on every rank, before verl's load reaches its barrier.
    other = root / "global_step_9" / "actor"
    other.mkdir(parents=True)
    for rank in range(4):
        (other / f"model_world_size_4_rank_{rank}.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"saved by 4 ranks .* this job runs 2 ranks"):
        both("load", str(root), 9)

    # sync_save: save_checkpoint returns with this rank's files in place, as verl's does.
    both("restart_manager", True)
    both("train", 5)
    for rank, names in enumerate(both("save_and_list", str(root), 5)):
        assert names == sorted(
            f"{k}_world_size_2_rank_{rank}.pt" for k in ("model", "optim", "extra_state")
        )

    # Step 4 was saved but never committed: nothing of it is loaded.
    with pytest.raises(UnverifiedCheckpointError, match="step 4 in .* is not committed|never"):
        both("load", str(root), 4)

    # One flipped byte in a committed model shard: refused, not trained on.
    sdir = root / "global_step_3"
    shard = sdir / "actor" / "model_world_size_2_rank_1.pt"
    good = shard.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 0x01
    shard.write_bytes(bytes(flipped))
    with pytest.raises(
        UnverifiedCheckpointError, match=r"model_world_size_2_rank_1.pt is corrupted"
    ):
        both("load", str(root), 3)
    shard.write_bytes(good)

    # Someone who can write the step replaces a file with a pickle that runs code, and
    # rewrites the manifest to match: the load refuses it, and its code never runs.
    marker = tmp_path / "code-ran"
    extra = sdir / "actor" / "extra_state_world_size_2_rank_0.pt"
    torch.save({"rng": RunsCode(str(marker)), "lr_scheduler": None}, extra)
    rewrite_manifest(sdir)
    with pytest.raises(UnsafeCheckpointError, match="extra_state_world_size_2_rank_0.pt refers"):
        both("load", str(root), 3)
    assert not marker.exists()


class TestCommittedFilesStay:
    """A save of a step whose state dict is committed never rewrites that step's model files.

    A restarted job retrains steps the Synchronizer has already loaded (it resumes from the
    last full checkpoint, behind the state-dict iteration file); the files the iteration
    file and the manifest vouch for must stay as they were committed.
    """

    def test_resave_behind_the_state_dict_iteration_file(self, namespace, tmp_path, ranks):
        from obsckpt.store import layout, reader

        root = tmp_path / "ckpt"
        monitor, both = start_job(namespace, root, ranks)
        assert both("save_state_dict", str(root), 0) == [0, 0]  # the trainer's first sync
        both("train", 1)
        assert both("save_state_dict", str(root), 1) == [1, 1]
        # Each rank's manager registered its own save.
        asyncio.run(CheckpointCoordinator(monitor).register_and_monitor(1, is_state_dict=True))
        assert (root / "latest_state_dict_iteration.txt").read_text().strip() == "1"
        step_dir = layout.step_dir(root, 1)
        model_files = sorted((step_dir / "actor").glob("model_world_size_2_rank_*.pt"))
        committed = {p.name: p.read_bytes() for p in model_files}
        assert len(committed) == 2 and reader.verify_step(step_dir) == []

        # The restarted job: new managers, weights that differ from the committed ones.
        both("restart_manager")
        assert both("save_state_dict", str(root), 0) == [0, 0]  # its first sync
        both("train", 2)
        assert both("save_state_dict", str(root), 1) == [0, 0]
        assert {p.name: p.read_bytes() for p in model_files} == committed
        # A full checkpoint of that step saves optimizer and extra state; the model it
        # holds is the committed one.
        counts = both("save", str(root), 1, None)
        assert counts == [{"state_dict": 0, "checkpoint": 2}] * 2
        commit(monitor, 1)
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
        assert {p.name: p.read_bytes() for p in model_files} == committed
        assert reader.verify_step(step_dir) == []
        assert (step_dir / "actor" / "optim_world_size_2_rank_1.pt").is_file()

    def test_first_sync_saves_nothing_and_announces_the_step(self, namespace, tmp_path, ranks):
        """As Trinity's: a manager's first save_state_dict (the trainer's prepare) writes
        and registers nothing; rank 0 tells the Synchronizer the step is current, so a
        resumed job's rollout versions restart at the resumed step."""
        from obsckpt import Synchronizer

        root = tmp_path / "ckpt"
        sync = Synchronizer.get_actor(namespace=namespace)
        assert ray.get(sync.set_model_state_dict.remote(None, 6))  # the run before the resume
        monitor, both = start_job(namespace, root, ranks)
        assert both("save_state_dict", str(root), 4) == [0, 0]
        assert not (root / "global_step_4").exists()
        assert ray.get(sync.get_version.remote()) == 4
        assert ray.get(monitor.status.remote())["pending"] == []
        both("train", 1)
        assert both("save_state_dict", str(root), 5) == [1, 1]  # later syncs save
        ray.kill(sync)

    def test_memory_sync_and_save_of_a_step_share_one_snapshot(self, namespace, tmp_path, ranks):
        """FSDP2: each rank publishes its own shard (the Synchronizer merges them) from a host
        snapshot that the step's save then writes as it is: one snapshot for both, and the
        rollout's weights, the committed files and the trainer's all equal. A save of a later
        step stages its own (the published snapshot is not written as that step)."""
        from obsckpt import Synchronizer
        from obsckpt.store import reader
        from obsckpt.sync.shards import load_sharded_state_dict

        root = tmp_path / "ckpt"
        sync = Synchronizer.get_actor(namespace=namespace)
        monitor, both = start_job(namespace, root, ranks)
        both("train", 1)
        shared = both("upload_then_save", str(root), 1, 1)
        assert [r["snapshots"] for r in shared] == [1, 1], shared
        commit(monitor, 1)
        trained = both("snapshot")[0]["params"]
        published, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 1
        assert same(trained, published) == [] and set(published) >= set(trained)
        step_dir = root / "global_step_1"
        assert reader.verify_step(step_dir) == []
        saved = load_sharded_state_dict(step_dir / "actor")
        assert same(trained, saved) == []

        later = both("upload_then_save", str(root), 2, 3)  # synced at 2, trained, saved at 3
        assert [r["snapshots"] for r in later] == [2, 2], later
        commit(monitor, 3)
        trained = both("snapshot")[0]["params"]
        assert same(trained, load_sharded_state_dict(root / "global_step_3" / "actor")) == []
        published, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 2 and same(trained, published) != []  # step 2's weights, not 3's
        ray.kill(sync)

        # A Synchronizer that takes whole state dicts only: the ranks gather, as before.
        whole = WholeStateSynchronizer.options(name="synchronizer", namespace=namespace).remote()
        both("restart_manager")  # looks the new one up
        assert both("upload", 4)[0] is not None  # rank 0 reports its seconds
        got, version = ray.get(whole.held.remote())
        assert version == 4 and same(trained, got) == [] and set(got) >= set(trained)
        ray.kill(whole)

    def test_resave_of_a_committed_checkpoint(self, namespace, tmp_path, ranks):
        """A job resumed from an older step (``resume_from_path``) retrains steps whose
        checkpoints are committed: their optimizer and extra state stay the committed ones,
        so such a step never holds one run's model with another run's optimizer."""
        from obsckpt.store import layout, reader

        root = tmp_path / "ckpt"
        monitor, both = start_job(namespace, root, ranks)
        both("train", 1)
        both("save", str(root), 1, None)
        commit(monitor, 1)
        step_dir = layout.step_dir(root, 1)
        committed = {p: p.read_bytes() for p in sorted((step_dir / "actor").glob("*.pt"))}
        assert len(committed) == 6 and reader.verify_step(step_dir) == []

        both("restart_manager")
        both("train", 5)  # the rerun's weights, optimizer and RNG differ from the first run's
        counts = both("save", str(root), 1, None)
        assert reader.verify_step(step_dir) == []
        assert {p: p.read_bytes() for p in committed} == committed
        assert counts == [{"state_dict": 0, "checkpoint": 0}] * 2


@ray.remote
class PretrainedRank:
    """One FSDP2 rank (gloo) whose model was loaded from a pretrained directory, as verl's is."""

    def __init__(self, namespace: str, port: int, src: str) -> None:
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaForCausalLM
        from workers import cpu_fsdp_group

        from obsckpt.integrations import FSDPCheckpointManager

        torch.set_num_threads(1)
        mesh = cpu_fsdp_group(0, 1, port)
        model = LlamaForCausalLM.from_pretrained(src)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            model=model,
            checkpoint_config={"save_contents": ["model", "hf_model"], "load_contents": ["model"]},
            ray_namespace=namespace,
        )

    def save(self, path: str, step: int) -> dict:
        counts = self.manager.save_checkpoint(path, global_step=step)
        self.manager.wait_on_save_thread(timeout=120)
        return counts

    def save_as_hf_positionally(self, path: str, step: int) -> dict:
        """Trinity's positional order: (local_path, global_step, max_ckpt_to_keep, save_as_hf)."""
        self.manager.checkpoint_save_contents = ["model"]
        counts = self.manager.save_checkpoint(path, step, None, True)
        self.manager.wait_on_save_thread(timeout=120)
        return counts


def test_hf_export_keeps_the_pretrained_generation_config(namespace, tmp_path):
    """As verl's manager: huggingface/ carries the model's own generation config (its stop
    tokens and sampling defaults), not one derived from the model config, also once the
    HF model is exported there."""
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from workers import TINY_LLAMA

    src = tmp_path / "pretrained"
    torch.manual_seed(0)
    pretrained = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    pretrained.generation_config = GenerationConfig(
        eos_token_id=[3, 7], do_sample=True, temperature=0.6
    )
    pretrained.save_pretrained(src)
    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    rank = PretrainedRank.remote(namespace, free_port(), str(src))
    path = root / "global_step_1" / "actor"
    assert ray.get(rank.save.remote(str(path), 1)) == {"state_dict": 1, "checkpoint": 1}
    commit(monitor, 1)
    hf_dir = path / "huggingface"
    got = GenerationConfig.from_pretrained(hf_dir)
    assert got.eos_token_id == [3, 7] and got.temperature == 0.6
    exported = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    assert same(dict(pretrained.named_parameters()), dict(exported.named_parameters())) == []

    # Trinity's save_as_hf, given positionally, asks for the export as hf_model does.
    path = root / "global_step_2" / "actor"
    assert ray.get(rank.save_as_hf_positionally.remote(str(path), 2)) == {
        "state_dict": 1,
        "checkpoint": 1,
    }
    commit(monitor, 2)
    assert (path / "huggingface" / "model.safetensors").is_file()


@ray.remote
class ShardedRank:
    """A gloo rank holding ShardedTensors shaped as FSDP1's SHARDED_STATE_DICT gives them."""

    def __init__(self, rank: int, port: int) -> None:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        self.rank = rank

    def state(self) -> dict:
        """Row-sharded 5x3 weight (3 rows on rank 0, 2 on rank 1), as FSDP1 chunks it."""
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

        def sharded(base: float):
            rows = (3, 2)[self.rank]
            offset = (0, 3)[self.rank]
            local = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + base
            md = ShardMetadata([offset, 0], [rows, 3], f"rank:{self.rank}/cpu")
            return init_from_local_shards([Shard(local, md)], [5, 3])

        model = {"layer.weight": sharded(100.0 * self.rank), "layer.bias": torch.ones(3)}
        optim = {
            "state": {"layer.weight": {"exp_avg": sharded(7.0), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": ["layer.weight"]}],
        }
        return {"model": model, "optim": optim}

    def stage_write_and_load(self, directory: str) -> dict:
        from obsckpt.staging import StagingBuffers
        from obsckpt.store.torchfile import write_torch_file

        state = self.state()
        expected = {
            "weight": state["model"]["layer.weight"].local_shards()[0].tensor.clone(),
            "exp_avg": state["optim"]["state"]["layer.weight"]["exp_avg"]
            .local_shards()[0]
            .tensor.clone(),
        }
        staged = {k: StagingBuffers().stage(v) for k, v in state.items()}
        # Training changes the originals right after the snapshot.
        state["model"]["layer.weight"].local_shards()[0].tensor.add_(1)
        state["optim"]["state"]["layer.weight"]["exp_avg"].local_shards()[0].tensor.mul_(0)
        out = {}
        for kind, value in staged.items():
            path = os.path.join(directory, f"{kind}_world_size_2_rank_{self.rank}.pt")
            write_torch_file(value, path)
            out[kind] = torch.load(path, weights_only=False)
        weight = out["model"]["layer.weight"]
        exp_avg = out["optim"]["state"]["layer.weight"]["exp_avg"]
        return {
            "weight_equal": torch.equal(weight.local_shards()[0].tensor, expected["weight"]),
            "exp_avg_equal": torch.equal(exp_avg.local_shards()[0].tensor, expected["exp_avg"]),
            "global_shape": list(weight.size()),
            "offsets": [list(m.shard_offsets) for m in weight.metadata().shards_metadata],
            "bias": out["model"]["layer.bias"].tolist(),
            "step": float(out["optim"]["state"]["layer.weight"]["step"]),
        }


def test_sharded_tensor_staging(ray_cluster, tmp_path):
    """FSDP1 ShardedTensors are staged through their local shards and written as verl loads them."""
    port = free_port()
    ranks = [ShardedRank.remote(r, port) for r in range(2)]
    results = ray.get([r.stage_write_and_load.remote(str(tmp_path)) for r in ranks])
    for result in results:
        assert result["weight_equal"] and result["exp_avg_equal"]
        assert result["global_shape"] == [5, 3]
        assert result["offsets"] == [[0, 0], [3, 0]]
        assert result["bias"] == [1.0, 1.0, 1.0] and result["step"] == 3.0


@ray.remote(num_gpus=1)
class FSDP1Rank:
    """One process, one GPU: a real FSDP1 model with verl's manager subclass."""

    def __init__(self, namespace: str, port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        from obsckpt.integrations import FSDPCheckpointManager

        torch.cuda.set_device(0)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5)).cuda()
        self.model = FSDP(inner, device_id=0, use_orig_params=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.model(torch.randn(2, 6, device="cuda")).sum().backward()
        self.optimizer.step()
        self.manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            model=self.model,
            optimizer=self.optimizer,
            checkpoint_config={
                "save_contents": ["model", "optimizer", "extra"],
                "load_contents": ["model", "optimizer", "extra"],
            },
            ray_namespace=namespace,
        )

    def full(self) -> dict:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model):
            return {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}

    def save(self, path: str) -> dict:
        counts = self.manager.save_checkpoint(path, global_step=1)
        self.manager.wait_on_save_thread(timeout=120)
        return counts

    def zero_and_load(self, path: str) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(self.model, writeback=True), torch.no_grad():
            for p in self.model.parameters():
                p.zero_()
        self.manager.load_checkpoint(path)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="FSDP1 (FullyShardedDataParallel) needs a CUDA device; its ShardedTensor staging "
    "is covered on CPU by test_sharded_tensor_staging",
)
def test_fsdp1_manager_on_gpu(namespace, tmp_path):
    """A real FSDP1 model saved through the manager commits and loads back the same parameters."""
    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    rank = FSDP1Rank.remote(namespace, free_port())
    path = str(root / "global_step_1" / "actor")
    saved = ray.get(rank.full.remote())
    assert ray.get(rank.save.remote(path)) == {"state_dict": 1, "checkpoint": 2}
    commit(monitor, 1)
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    ray.get(rank.zero_and_load.remote(path))
    assert same(saved, ray.get(rank.full.remote())) == []


@pytest.fixture
def one_rank():
    """This process as the only rank of a gloo group; yields its CPU mesh for FSDP2."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def fsdp2(model, mesh, layers):
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_params(model) -> dict:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def started_monitor(namespace, root):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    ray.get(monitor.status.remote())
    return monitor


async def synchronizer_status(root) -> dict:
    """What a Synchronizer watching ``root`` makes of its latest state-dict step."""
    from prometheus_client import CollectorRegistry

    from obsckpt import Synchronizer

    sync = Synchronizer(str(root), namespace="no-monitor-here", registry=CollectorRegistry())
    await sync.poll_once()
    return await sync.status()


class TestLoraOnly:
    """verl 0.9's ``checkpoint.save_lora_only`` keeps the same keys verl's own manager keeps.

    A LoRA model's checkpoint then holds its adapter weights only, verl's
    loader reads it back (adapters restored, base weights as they are), and
    the Synchronizer refuses such a step by name instead of publishing the
    adapters as the whole model. verl 0.7 has no such setting: both managers
    save the whole model there.
    """

    def test_adapter_weights_only(self, namespace, tmp_path, one_rank):
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        from workers import TINY_LLAMA

        from obsckpt.integrations import FSDPCheckpointManager
        from obsckpt.integrations.verl_install import original

        # verl's own class, also where verl_install has rebound the name (another test).
        VerlManager = original(
            "verl.utils.checkpoint.fsdp_checkpoint_manager", "FSDPCheckpointManager"
        )

        lora_only = hasattr(VerlManager, "should_save_lora_only")
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(base, lora)
        fsdp2(model, one_rank, base.model.layers)
        config = {"save_contents": ["model"], "load_contents": ["model"], "save_lora_only": True}
        shard = "model_world_size_1_rank_0.pt"
        VerlManager(model=model, checkpoint_config=config).save_checkpoint(
            str(tmp_path / "verl"), global_step=1
        )
        expected = torch.load(tmp_path / "verl" / shard, weights_only=False)

        root = tmp_path / "ckpt"
        monitor = started_monitor(namespace, root)
        manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            model=model,
            checkpoint_config=config,
            ray_namespace=namespace,
        )
        path = root / "global_step_1" / "actor"
        assert manager.save_checkpoint(str(path), global_step=1) == {
            "state_dict": 1,
            "checkpoint": 0,
        }
        manager.wait_on_save_thread(timeout=60)
        commit(monitor, 1)
        saved = torch.load(path / shard, weights_only=False)
        assert sorted(saved) == sorted(expected)
        # q and v projections, A and B, 2 layers; or all the model's entries
        assert len(model.state_dict()) == 29 and len(saved) == (8 if lora_only else 29)
        assert all("lora_" in name for name in saved) is lora_only
        for name, value in saved.items():
            assert torch.equal(value.to_local(), expected[name].to_local()), name

        saved_params = full_params(model)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        manager.load_checkpoint(str(path))  # verl's loader: strict=False for adapter-only files
        loaded = full_params(model)
        for name, value in saved_params.items():
            restored = lora_only is False or "lora_" in name
            assert torch.equal(loaded[name], value if restored else value + 1.0), name

        status = asyncio.run(synchronizer_status(root))
        if lora_only:
            assert status["version"] is None
            error = status["failed_steps"][1]
            assert "only LoRA adapter weights (8 tensors" in error, error
            assert "save_lora_only" in error and "upload_state_dict" in error, error
        else:
            assert status["version"] == 1 and status["failed_steps"] == {}

    def test_no_adapter_weights_is_refused_before_registering(self, namespace, tmp_path, one_rank):
        """A model with a peft_config but no adapter weights raises as verl raises, and no
        save is left registered with the monitor (the step would wait for it forever)."""
        from peft import LoraConfig
        from transformers import LlamaConfig, LlamaForCausalLM
        from verl.utils.checkpoint.fsdp_checkpoint_manager import (
            FSDPCheckpointManager as VerlManager,
        )
        from workers import TINY_LLAMA

        from obsckpt.integrations import FSDPCheckpointManager

        if not hasattr(VerlManager, "should_save_lora_only"):
            pytest.skip("this verl has no checkpoint.save_lora_only")
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        model.peft_config = {"default": LoraConfig(r=4)}
        fsdp2(model, one_rank, model.model.layers)
        monitor = started_monitor(namespace, tmp_path / "ckpt")
        manager = FSDPCheckpointManager(
            commit_steps=False,  # the test submits each step, as the trainer does
            model=model,
            checkpoint_config={"save_contents": ["model"], "save_lora_only": True},
            ray_namespace=namespace,
        )
        path = tmp_path / "ckpt" / "global_step_1" / "actor"
        with pytest.raises(ValueError, match=r"save_lora_only=True .* none of its 21 state-dict"):
            manager.save_checkpoint(str(path), global_step=1)
        status = ray.get(monitor.status.remote())
        assert status["pending"] == [] and status["failed"] == []


class TestHFExportKeepsCommittedFiles:
    """An HF export never changes a file of ``huggingface/`` that the step's manifest lists.

    A job resumed from an older step retrains a step whose state dict an
    earlier run committed, export included, but whose checkpoint it never
    committed: the export files of that step stay as committed (they match
    its committed model files), and once the checkpoint is committed a re-save
    writes nothing at all.
    """

    def test_resaved_step(self, namespace, tmp_path, one_rank):
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
        from workers import TINY_LLAMA

        from obsckpt.integrations import FSDPCheckpointManager
        from obsckpt.store import layout, reader

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        fsdp2(model, one_rank, model.model.layers)
        root = tmp_path / "ckpt"
        monitor = started_monitor(namespace, root)
        config = {"save_contents": ["model", "hf_model"], "load_contents": ["model"]}

        def save() -> dict:
            manager = FSDPCheckpointManager(
                commit_steps=False,  # the test submits each step, as the trainer does
                model=model,
                checkpoint_config=config,
                ray_namespace=namespace,
            )
            counts = manager.save_checkpoint(str(path), global_step=1)
            manager.wait_on_save_thread(timeout=60)
            return counts

        path = root / "global_step_1" / "actor"
        saved = full_params(model)
        assert save() == {"state_dict": 1, "checkpoint": 1}
        asyncio.run(CheckpointCoordinator(monitor).register_and_monitor(1, is_state_dict=True))
        step_dir = layout.step_dir(root, 1)
        hf_dir = path / "huggingface"
        committed = {p: p.read_bytes() for p in sorted(hf_dir.iterdir())}
        assert hf_dir / "model.safetensors" in committed and reader.verify_step(step_dir) == []

        with torch.no_grad():  # the retrained step's weights differ from the committed ones
            for p in model.parameters():
                p.add_(1.0)
        assert save() == {"state_dict": 0, "checkpoint": 1}
        assert reader.verify_step(step_dir) == []
        assert {p: p.read_bytes() for p in sorted(hf_dir.iterdir())} == committed
        commit(monitor, 1)
        assert reader.verify_step(step_dir) == []
        exported = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
        for name, value in exported.named_parameters():
            assert torch.equal(value, saved[name]), name

        assert save() == {"state_dict": 0, "checkpoint": 0}
        assert {p: p.read_bytes() for p in sorted(hf_dir.iterdir())} == committed
        assert reader.verify_step(step_dir) == []


def test_a_misspelled_keyword_is_refused_by_name():
    """save_checkpoint takes verl's and Trinity-RFT's keywords; any other raises, naming it."""
    from obsckpt.integrations.fsdp_checkpoint_manager import FSDPCheckpointManager

    with pytest.raises(TypeError, match="max_ckpt_to_kep"):
        FSDPCheckpointManager.save_checkpoint(object(), "/x", global_step=1, max_ckpt_to_kep=2)


def test_load_of_no_path_returns_at_once_as_verls_does(namespace, tmp_path):
    """load_checkpoint(None) loads nothing and returns, as verl's does: a save that failed
    meanwhile is raised by the next wait or save, not by this unrelated call."""
    import types

    from obsckpt.errors import SaveError
    from obsckpt.integrations.fsdp_checkpoint_manager import FSDPCheckpointManager

    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(tmp_path), metrics_port=None
    )
    coordinator = CheckpointCoordinator(monitor)

    def fails() -> None:
        raise OSError("disk gone")

    coordinator.save_async("model", fails, 1)
    manager = types.SimpleNamespace(coordinator=coordinator)
    assert FSDPCheckpointManager.load_checkpoint(manager, None) is None
    with pytest.raises(SaveError, match="disk gone"):
        coordinator.wait_all(timeout=60)


def test_resume_record_through_the_manager(namespace, tmp_path, ranks):
    """save_resume_record commits the record with the step; restore_resume_record, given
    the path load_checkpoint takes, brings back the RNGs, data position and weight version."""
    from obsckpt.store import layout, reader

    root = tmp_path / "ckpt"
    monitor, both = start_job(namespace, root, ranks)
    both("train", 1)
    next_draws = both("save_with_record", str(root), 1)
    commit(monitor, 1)
    step_dir = layout.step_dir(root, 1)
    deadline = time.monotonic() + 60
    while reader.read_iteration(str(root), "checkpoint") != 1:
        assert time.monotonic() < deadline, "step 1 never committed"
        time.sleep(0.1)
    listed = {r.path for r in reader.read_manifest(step_dir)}
    assert {f"resume/rank_{r}.pt" for r in (0, 1)} <= listed
    restored = both("restore_record", str(root), 1)
    assert restored == [(1, {"position": 4}, next_draws[r]) for r in (0, 1)]


class TestUsedAlone:
    """The manager with no trainer submitting its steps (verl's own tests, a user's loop):
    it submits each step it saves, and a load of a step this process saved waits for
    the step's commit instead of refusing it as uncommitted."""

    def make(self, one_rank, namespace, **kwargs):
        from obsckpt.integrations import FSDPCheckpointManager

        torch.manual_seed(0)
        model = fsdp2(
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), one_rank, []
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        contents = ["model", "optimizer", "extra"]
        manager = FSDPCheckpointManager(
            model=model,
            optimizer=optimizer,
            checkpoint_config={"save_contents": contents, "load_contents": contents},
            ray_namespace=namespace,
            **kwargs,
        )
        return model, manager

    def test_saves_commit_and_a_load_waits_for_the_commit(
        self, namespace, tmp_path, one_rank, monkeypatch
    ):

        monkeypatch.delenv("OBSCKPT_MANAGER_COMMITS", raising=False)
        root = tmp_path / "ckpt"
        monitor = started_monitor(namespace, root)
        model, manager = self.make(one_rank, namespace)
        assert manager.commit_steps is True  # this monitor was made by no trainer
        saved = full_params(model)
        path = root / "global_step_1" / "actor"
        assert manager.save_checkpoint(str(path), global_step=1) == {
            "state_dict": 1,
            "checkpoint": 2,
        }
        # A second manager of this process (verl's tests build one to load): the load
        # waits for step 1's commit, which nothing but the saving manager submitted.
        other, loader = self.make(one_rank, namespace)
        with torch.no_grad():
            for p in other.parameters():
                p.zero_()
        loader.load_checkpoint(str(path))
        assert same(saved, full_params(other)) == []
        status = ray.get(monitor.status.remote())
        assert status["latest"] == {"checkpoint": 1, "state_dict": 1}
        assert status["resaves"] == 0  # submitted once
        from obsckpt.store import reader

        assert reader.verify_step(root / "global_step_1") == []

    def test_a_step_the_trainer_did_not_submit_is_refused_at_once(
        self, namespace, tmp_path, one_rank
    ):
        """With commit_steps=False the trainer submits: a load of a step it never
        submitted waits for nothing and is refused as uncommitted, at once."""
        root = tmp_path / "ckpt"
        monitor = started_monitor(namespace, root)  # held: the actor lives while its handle does
        _model, manager = self.make(one_rank, namespace, commit_steps=False)
        path = root / "global_step_3" / "actor"
        manager.save_checkpoint(str(path), global_step=3)
        t0 = time.monotonic()
        with pytest.raises(UnverifiedCheckpointError, match="step 3 was never committed"):
            manager.load_checkpoint(str(path))
        assert time.monotonic() - t0 < 30
        assert ray.get(monitor.status.remote())["latest"]["checkpoint"] is None

    def test_the_default_follows_the_monitor_and_the_variable(
        self, namespace, tmp_path, monkeypatch
    ):
        """A monitor a switched trainer made (trainer_submits=True) keeps submitting to
        the trainer; OBSCKPT_MANAGER_COMMITS and the argument say it outright."""
        from obsckpt.integrations import alone

        monkeypatch.delenv("OBSCKPT_MANAGER_COMMITS", raising=False)
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            default_local_dir=str(tmp_path),
            metrics_port=None,
            trainer_submits=True,
        )
        coordinator = CheckpointCoordinator(monitor)
        assert ray.get(monitor.status.remote())["trainer_submits"] is True
        assert alone.commits_steps(None, coordinator) is False
        assert alone.commits_steps(True, coordinator) is True
        monkeypatch.setenv("OBSCKPT_MANAGER_COMMITS", "1")
        assert alone.commits_steps(None, coordinator) is True
        monkeypatch.setenv("OBSCKPT_MANAGER_COMMITS", "yes")
        with pytest.raises(ValueError, match="OBSCKPT_MANAGER_COMMITS='yes'"):
            alone.commits_steps(None, coordinator)
