"""A stock verl 0.9 job switched to obsckpt by ``verl_install.install()``.

verl's own code runs the save and resume: the trainer's ``_save_checkpoint``
and ``_load_checkpoint`` (the methods of verl 0.9's default V1 ``PPOTrainer``
and of ``RayPPOTrainer``, which ``trainer.use_v1=false`` runs, on a minimal
trainer object: config, step, dataloader, worker groups), the workers' engine
``FSDPEngine.save_checkpoint`` / ``load_checkpoint``, and the manager each
engine builds from the name in ``verl.workers.engine.fsdp.transformer_impl``.
The workers are Ray actors training FSDP2 models on gloo (an actor on two
ranks, a critic on one); building a real ``FSDPEngine`` needs a GPU and a
model from the hub, so the engine methods run on an object holding what they
read (module, manager, offload flags).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import ray
import torch
from reliability_helpers import RunsCode, rewrite_manifest
from workers import kill_named

from obsckpt.errors import UnsafeCheckpointError
from obsckpt.integrations import verl_install
from obsckpt.sync.group import free_port


@ray.remote
class VerlWorker:
    """One rank of a verl worker group, as the hook leaves it: verl's names patched."""

    def __init__(self, role: str, rank: int, world_size: int, port: int) -> None:
        verl_install.worker_setup()  # what Ray runs in each worker process after install()
        from workers import cpu_fsdp_group

        torch.set_num_threads(1)
        self.role = role
        self.mesh = cpu_fsdp_group(rank, world_size, port)

    def reset(self) -> None:
        """A new job on this process (the tests share the workers): the seeded model, a new
        optimizer, scheduler and checkpoint manager, and file writes no longer held."""
        from verl.workers.engine.fsdp import transformer_impl
        from workers import tiny_fsdp_llama

        import obsckpt.store.torchfile as torchfile

        self.unheld = getattr(self, "unheld", torchfile.write_torch_file)
        torchfile.write_torch_file = self.unheld  # block_writes() of a previous job undone
        if hasattr(self, "engine"):
            self.engine.checkpoint_manager.coordinator.close(timeout=60)
        role = self.role
        # verl's critic: a token-classification value head
        model = tiny_fsdp_llama(self.mesh, value_head=role == "critic")
        contents = ["model", "optimizer", "extra"] + (["hf_model"] if role == "critic" else [])
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.9)
        # As FSDPEngine.initialize builds it: the module-level name, verl's arguments.
        manager = transformer_impl.FSDPCheckpointManager(
            model=model,
            optimizer=self.optimizer,
            lr_scheduler=self.scheduler,
            processing_class=None,
            checkpoint_config={"save_contents": contents, "load_contents": contents[:3]},
            trust_remote_code=False,
        )
        self.manager_class = f"{type(manager).__module__}.{type(manager).__name__}"
        self.engine = types.SimpleNamespace(
            module=model,
            checkpoint_manager=manager,
            _is_offload_param=False,
            _is_offload_optimizer=False,
            _uses_fsdp2_cpu_offload_policy=True,  # the model stays where it is (CPU)
        )

    def info(self) -> str:
        return self.manager_class

    def train(self, step: int) -> None:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (2, 8), generator=g)
        out = self.model(input_ids=ids)
        out.logits.float().pow(2).mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()

    def save_checkpoint(self, *args, **kwargs) -> None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        FSDPEngine.save_checkpoint(self.engine, *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs) -> None:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        FSDPEngine.load_checkpoint(self.engine, *args, **kwargs)

    def block_writes(self, flag: str) -> None:
        """Hold every file write of this process until ``flag`` exists."""
        import time

        import obsckpt.store.torchfile as torchfile

        original = torchfile.write_torch_file

        def held(obj, path):
            while not os.path.exists(flag):
                time.sleep(0.05)
            return original(obj, path)

        torchfile.write_torch_file = held

    def params(self) -> dict:
        from torch.distributed.tensor import DTensor

        return {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in self.model.named_parameters()
        }


class WorkerGroup:
    """verl's ``ONE_TO_ALL`` dispatch: every rank runs the call; the group returns when all did."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    def _all(self, method: str, *args, **kwargs) -> list:
        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def save_checkpoint(self, *args, **kwargs) -> None:
        self._all("save_checkpoint", *args, **kwargs)

    def load_checkpoint(self, *args, **kwargs) -> None:
        self._all("load_checkpoint", *args, **kwargs)


class DataLoader:
    def __init__(self) -> None:
        self.position = 0

    def __len__(self) -> int:
        return 100

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]


def make_trainer(root, actor_wg, critic_wg, *, v1: bool = False):
    """What verl's trainers read when they save and resume (V1: sync mode, with its callback)."""
    from omegaconf import OmegaConf

    config = OmegaConf.create(
        {
            "trainer": {
                "default_local_dir": str(root),
                "default_hdfs_dir": None,
                "resume_mode": "auto",
                "del_local_ckpt_after_load": False,
                "max_actor_ckpt_to_keep": None,
                "max_critic_ckpt_to_keep": None,
            },
            "actor_rollout_ref": {"actor": {"checkpoint": {}}},
        }
    )
    trainer = types.SimpleNamespace(
        config=config,
        global_steps=0,
        use_critic=True,
        actor_rollout_wg=actor_wg,
        critic_wg=critic_wg,
        train_dataloader=DataLoader(),
    )
    if v1:
        from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

        trainer.trainer_mode = "sync"
        trainer.checkpoint_callback = CheckpointCallback(config)
    return trainer


class RecordingCallback:
    """A ``trainer.checkpoint_callback_class``: notes what the iteration file said at ``on_save``."""

    def __init__(self, root) -> None:
        self.root = root
        self.seen: list[tuple[int, str | None]] = []

    def on_save(self, trainer, global_step: int, checkpoint_dir: str, **kwargs) -> None:
        self.seen.append((global_step, iteration(self.root)))


class _AnyNames(types.ModuleType):
    """A module with a placeholder class for every name imported from it."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def trainer_class(kind: str, monkeypatch):
    """verl 0.9's default trainer (``trainer.use_v1``) or the one ``use_v1=false`` runs."""
    if kind == "legacy":
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        return RayPPOTrainer, "verl.trainer.ppo.ray_trainer"
    import importlib.util

    import verl

    if importlib.util.find_spec("verl.trainer.ppo.v1") is None:
        pytest.skip(f"verl {verl.__version__} has no V1 trainer")
    try:
        import transfer_queue  # noqa: F401
    except ImportError:
        # verl lists TransferQueue under its verl-core extra; only the asynchronous
        # modes use it, so a stand-in lets the sync mode's module load without it.
        monkeypatch.setitem(sys.modules, "transfer_queue", _AnyNames("transfer_queue"))
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer, "verl.trainer.ppo.v1.trainer_base"


def params(workers: list) -> list[dict]:
    """Every worker's full parameters (gathering is a collective: all ranks at once)."""
    return ray.get([w.params.remote() for w in workers])


def iteration(root) -> str | None:
    path = root / "latest_checkpointed_iteration.txt"
    return path.read_text().strip() if path.exists() else None


def test_install_refuses_once_ray_is_running(ray_cluster):
    with pytest.raises(RuntimeError, match="must run before ray.init"):
        verl_install.install()


def test_runtime_env_adds_the_hook_and_refuses_to_replace_another():
    env = verl_install.runtime_env({"env_vars": {"A": "1"}})
    assert env == {"env_vars": {"A": "1"}, "worker_process_setup_hook": verl_install.HOOK}
    assert verl_install.runtime_env(env) == env
    with pytest.raises(ValueError, match="worker_process_setup_hook='mine.setup'"):
        verl_install.runtime_env({"worker_process_setup_hook": "mine.setup"})


DRIVER = """
import json, sys, ray
from obsckpt.integrations import verl_install
verl_install.install()
ray.init(address=sys.argv[1], runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})

@ray.remote(num_cpus=0)
def probe():
    from verl.trainer.ppo import ray_trainer
    from verl.workers.engine.fsdp import transformer_impl
    return [transformer_impl.FSDPCheckpointManager.__module__,
            getattr(ray_trainer.RayPPOTrainer._save_checkpoint, "obsckpt", False),
            getattr(ray_trainer.RayPPOTrainer.fit, "obsckpt", False)]

print(json.dumps(ray.get(probe.remote())))
"""


def test_install_reaches_ray_workers_of_the_job(ray_cluster):
    """install() before ray.init: a worker process of that job builds obsckpt's manager."""
    address = ray.get_runtime_context().gcs_address
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, address],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("[")][-1]
    assert json.loads(line) == [
        "obsckpt.integrations.fsdp_checkpoint_manager",
        True,
        True,
    ]


def make_workers() -> list:
    """verl's actor (two FSDP2 ranks) and critic (one), in processes the tests share."""
    port = free_port()
    actor = [VerlWorker.remote("actor", r, 2, port) for r in (0, 1)]
    return actor + [VerlWorker.remote("critic", 0, 1, free_port())]


@pytest.mark.parametrize("kind", ["v1", "legacy"])
def test_verl_trainer_saves_and_resumes_through_obsckpt(
    kind, ray_cluster, tmp_path, monkeypatch, shared_actors
):
    verl_install.patch()  # install() does this in the driver
    Trainer, module = trainer_class(kind, monkeypatch)

    assert verl_install.is_patched(module)
    root = tmp_path / "ckpt"
    flag = tmp_path / "release"
    trainer = make_trainer(root, None, None, v1=kind == "v1")
    monitor = verl_install.monitor_for(trainer)  # init_workers does this before the workers
    try:
        workers = shared_actors("verl workers", make_workers)
        ray.get([w.reset.remote() for w in workers], timeout=120)
        actor, critic = workers[:2], workers[2:]
        assert set(ray.get([w.info.remote() for w in workers])) == {
            "obsckpt.integrations.fsdp_checkpoint_manager.FSDPCheckpointManager"
        }
        trainer.actor_rollout_wg, trainer.critic_wg = WorkerGroup(actor), WorkerGroup(critic)

        def train_and_save(step: int) -> None:
            ray.get([w.train.remote(step) for w in workers])
            trainer.global_steps = step
            trainer.train_dataloader.position = step
            Trainer._save_checkpoint(trainer)

        if kind == "v1":
            # A checkpoint callback is told of a save once it is committed, as verl promises
            # (async_save=False: durable); verl's no-op default does not make the save wait.
            default_callback = trainer.checkpoint_callback
            trainer.checkpoint_callback = recorder = RecordingCallback(root)
        train_and_save(1)
        assert verl_install.wait_for_commit(trainer, timeout=120) == 1
        assert iteration(root) == "1"
        if kind == "v1":
            assert recorder.seen == [(1, "1")]
            trainer.checkpoint_callback = default_callback

        # Step 2's writes are held: verl's trainer has returned, its data.pt is
        # there, but the iteration file still names the committed step.
        ray.get([w.block_writes.remote(str(flag)) for w in workers])
        train_and_save(2)
        assert (root / "global_step_2" / "data.pt").exists()
        assert iteration(root) == "1"
        with pytest.raises(TimeoutError, match="step 2 not committed"):
            verl_install.wait_for_commit(trainer, timeout=1.0)
        saved_actor, _, saved_critic = params(workers)
        flag.touch()
        assert verl_install.wait_for_commit(trainer, timeout=120) == 2  # what fit() waits for
        assert iteration(root) == "2"
        step_dir = root / "global_step_2"
        from obsckpt.store.reader import read_manifest

        listed = {r.path for r in read_manifest(step_dir)}
        for name in ("actor/model_world_size_2_rank_1.pt", "critic/optim_world_size_1_rank_0.pt"):
            assert any(p.endswith(name) for p in listed), name

        # The critic's HF export is verl's: a token-classification model.
        from transformers import AutoConfig, AutoModelForTokenClassification

        hf_dir = step_dir / "critic" / "huggingface"
        assert AutoConfig.from_pretrained(hf_dir).architectures == ["LlamaForTokenClassification"]
        exported = AutoModelForTokenClassification.from_pretrained(
            hf_dir, torch_dtype=torch.float32
        )
        for name, value in exported.named_parameters():
            assert torch.equal(value, saved_critic[name]), name

        # Training goes on (step 3 not saved); then a new trainer resumes with verl's code.
        ray.get([w.train.remote(3) for w in workers])
        moved = params(workers)[0]
        assert any(not torch.equal(moved[n], saved_actor[n]) for n in saved_actor)
        resumed = make_trainer(root, WorkerGroup(actor), WorkerGroup(critic), v1=kind == "v1")
        Trainer._load_checkpoint(resumed)
        assert resumed.global_steps == 2
        assert resumed.train_dataloader.position == 2
        now = params(workers)
        for saved, current in zip((saved_actor, saved_actor, saved_critic), now, strict=True):
            assert [n for n in saved if not torch.equal(saved[n], current[n])] == []

        # verl's own resume reads data.pt with weights_only=False: replaced by a pickle
        # that runs code (its manifest rewritten to match), it is refused and never runs.
        marker = tmp_path / "code-ran"
        torch.save({"position": RunsCode(str(marker))}, step_dir / "data.pt")
        rewrite_manifest(step_dir)
        again = make_trainer(root, WorkerGroup(actor), WorkerGroup(critic), v1=kind == "v1")
        with pytest.raises(UnsafeCheckpointError, match="data.pt refers to the global"):
            Trainer._load_checkpoint(again)
        assert not marker.exists()
    finally:
        kill_named(monitor, "checkpoint_monitor")


class HeldSaves:
    """A worker group whose ranks save in the background through a real coordinator.

    Each save registers with the monitor, as the managers do, and its write
    waits until ``release`` is set.
    """

    def __init__(self, monitor) -> None:
        import threading

        from obsckpt import CheckpointCoordinator

        self.monitor = monitor
        self.coordinator = CheckpointCoordinator(monitor)
        self.release = threading.Event()

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        ray.get(self.monitor.register_thread_count.remote(global_step, checkpoint_thread_count=1))
        os.makedirs(local_path, exist_ok=True)
        path = os.path.join(local_path, "model_world_size_1_rank_0.pt")

        def write() -> None:
            self.release.wait(120)
            torch.save({"step": global_step}, path)

        self.coordinator.save_async(f"model_{global_step}", write, global_step, paths=[path])


def recipe_trainer(asynchronous: bool):
    """A trainer subclass as verl's experimental trainers and recipes (DAPO) write them.

    It overrides the methods verl_install wraps without calling verl's: its own
    ``init_workers``, a ``fit`` that never calls ``RayPPOTrainer.fit``, and a copy
    of ``_save_checkpoint`` that saves at a version number of its own (not
    ``global_steps``) and writes the iteration file itself. Defined after
    ``patch()``, as a job's trainer module is imported after verl's.
    """
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class RecipeTrainer(RayPPOTrainer):
        def __init__(self, root) -> None:
            self.config = make_trainer(root, None, None).config
            self.global_steps = 0
            self.version = 0

        def _build(self) -> None:
            # The workers' managers look the monitor up when they are built.
            self.actor_rollout_wg = HeldSaves(ray.get_actor("checkpoint_monitor"))

        def _train(self) -> None:
            for _ in range(2):
                self.version += 1
                self._save_checkpoint()

        def _save_checkpoint(self) -> None:
            root = self.config.trainer.default_local_dir
            folder = os.path.join(root, f"global_step_{self.version}")
            self.actor_rollout_wg.save_checkpoint(os.path.join(folder, "actor"), None, self.version)
            with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(self.version))

    if asynchronous:

        class AsyncRecipeTrainer(RecipeTrainer):
            async def init_workers(self) -> None:
                self._build()

            async def fit(self) -> None:
                self._train()

        return AsyncRecipeTrainer

    class SyncRecipeTrainer(RecipeTrainer):
        def init_workers(self) -> None:
            self._build()

        def fit(self) -> None:
            self._train()

    return SyncRecipeTrainer


class TestTrainerSubclasses:
    """A trainer subclass that overrides fit, _save_checkpoint or init_workers is covered too.

    Its iteration file names a step only once that step is committed, the
    monitor exists before its workers are built, and fit returns only once the
    last saved step is committed (else the job exits while the saves are written).
    """

    @pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
    def test_overrides_are_wrapped(self, asynchronous, ray_cluster, tmp_path):
        import asyncio
        import threading

        from obsckpt.store.reader import read_manifest

        verl_install.patch()
        root = tmp_path / "ckpt"
        trainer = recipe_trainer(asynchronous)(root)

        def call(method):
            result = method()
            return asyncio.run(result) if asynchronous else result

        call(trainer.init_workers)
        monitor = ray.get_actor("checkpoint_monitor")
        try:
            assert ray.get(monitor.status.remote())["root"] == str(root)
            done = threading.Event()
            fit = threading.Thread(target=lambda: (call(trainer.fit), done.set()), daemon=True)
            fit.start()
            # Both saves were dispatched and are held: the trainer's own write of the
            # iteration file went nowhere, and fit has not returned.
            assert not done.wait(2.0)
            assert iteration(root) is None
            trainer.actor_rollout_wg.release.set()
            assert done.wait(120)
            assert iteration(root) == "2"  # the trainer's version, not its global_steps (0)
            listed = {r.path for r in read_manifest(root / "global_step_2")}
            assert "actor/model_world_size_1_rank_0.pt" in listed
        finally:
            trainer.actor_rollout_wg.release.set()
            kill_named(monitor, "checkpoint_monitor")


class SkipCommittedSaves:
    """A worker group whose ranks save as the managers do: nothing for a committed step.

    One rank in this process, saving its model file in the background through
    a real coordinator, registered with the monitor first.
    """

    def __init__(self, monitor) -> None:
        from obsckpt import CheckpointCoordinator

        self.monitor = monitor
        self.coordinator = CheckpointCoordinator(monitor)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        import logging

        from obsckpt.integrations.verl_fsdp import already_committed

        log = logging.getLogger(__name__)
        if already_committed(self.coordinator, global_step, log, is_state_dict=False):
            return
        ray.get(self.monitor.register_thread_count.remote(global_step, checkpoint_thread_count=1))
        os.makedirs(local_path, exist_ok=True)
        path = os.path.join(local_path, "model_world_size_1_rank_0.pt")
        self.coordinator.save_async(
            "model", lambda: torch.save({"step": global_step}, path), global_step, paths=[path]
        )
        self.coordinator.wait_all(60)


class Unpicklable:
    """Part of a dataloader state that fails once torch.save has started writing the file."""

    def __reduce__(self):
        raise RuntimeError("the trainer died while writing data.pt")


class TestDataFile:
    """The trainer's ``data.pt`` never changes in a committed step and is never torn.

    verl's ``_save_checkpoint`` writes it with ``torch.save`` into the step
    directory itself. A job resumed from an older step (``resume_from_path``)
    retrains steps whose checkpoints are committed: their ``data.pt`` stays
    the committed one (the step still verifies against its manifest). A
    write that fails halfway leaves no file behind.
    """

    @pytest.mark.parametrize("kind", ["v1", "legacy"])
    def test_retrained_committed_step(self, kind, ray_cluster, tmp_path, monkeypatch):
        from obsckpt.store import layout, reader

        verl_install.patch()
        Trainer, _ = trainer_class(kind, monkeypatch)
        root = tmp_path / "ckpt"
        first = make_trainer(root, None, None, v1=kind == "v1")
        monitor = verl_install.monitor_for(first)
        try:

            def save(step: int, position: int, dataloader=None):
                trainer = make_trainer(root, SkipCommittedSaves(monitor), None, v1=kind == "v1")
                trainer._obsckpt_monitor = monitor  # one job's monitor
                trainer.use_critic = False
                trainer.global_steps = step
                trainer.train_dataloader = dataloader or DataLoader()
                trainer.train_dataloader.position = position
                Trainer._save_checkpoint(trainer)
                return verl_install.wait_for_commit(trainer, timeout=60)

            assert save(1, 1) == 1 and save(2, 2) == 2
            step_dir = layout.step_dir(root, 2)
            data = step_dir / "data.pt"
            committed = data.read_bytes()
            assert reader.verify_step(step_dir) == []

            # The resumed job's dataloader is elsewhere when it saves step 2 again.
            assert save(2, 7) == 2
            assert data.read_bytes() == committed and torch.load(data) == {"position": 2}
            assert reader.verify_step(step_dir) == []
            assert iteration(root) == "2"

            broken = DataLoader()
            broken.state_dict = lambda: {"position": 3, "sampler": Unpicklable()}
            with pytest.raises(RuntimeError, match="died while writing data.pt"):
                save(3, 3, broken)
            assert sorted(os.listdir(root / "global_step_3")) == ["actor"]
        finally:
            kill_named(monitor, "checkpoint_monitor")


IMPORT_ORDERS = {
    "install, then verl's module": (
        "verl_install.install()\n"
        "from verl.utils.checkpoint import fsdp_checkpoint_manager as verl_mod\n"
        "import obsckpt.integrations.fsdp_checkpoint_manager as ours\n"
    ),
    "obsckpt's module, then install": (
        "import obsckpt.integrations.fsdp_checkpoint_manager as ours\n"
        "verl_install.install()\n"
        "from verl.utils.checkpoint import fsdp_checkpoint_manager as verl_mod\n"
    ),
    "install, then obsckpt's module (which imports verl's)": (
        "verl_install.install()\n"
        "import obsckpt.integrations.fsdp_checkpoint_manager as ours\n"
        "from verl.utils.checkpoint import fsdp_checkpoint_manager as verl_mod\n"
    ),
}
CHECK_NAMES = (
    "from verl.workers.engine.fsdp import transformer_impl\n"
    "from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager as named\n"
    "assert named is ours.FSDPCheckpointManager, named\n"
    "assert verl_mod.FSDPCheckpointManager is ours.FSDPCheckpointManager\n"
    "assert transformer_impl.FSDPCheckpointManager is ours.FSDPCheckpointManager\n"
    "base = ours.FSDPCheckpointManager.__mro__[1]\n"
    "assert base is verl_install.original(verl_mod.__name__, 'FSDPCheckpointManager')\n"
    "assert base.__module__ == verl_mod.__name__ and base is not ours.FSDPCheckpointManager\n"
    "print('ok')\n"
)


@pytest.mark.parametrize("order", list(IMPORT_ORDERS))
def test_install_works_in_any_import_order(order):
    """Every name verl's code imports the manager by is obsckpt's, whichever of install(),
    verl's module and obsckpt's module comes first; obsckpt's class still builds on verl's."""
    script = "from obsckpt.integrations import verl_install\n" + IMPORT_ORDERS[order] + CHECK_NAMES
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")


def test_monitor_options_come_from_the_jobs_config_and_the_environment(
    ray_cluster, tmp_path, monkeypatch
):
    """`+obsckpt.<option>=...` on verl's command line sets the monitor's options; an
    OBSCKPT_* variable wins over it; a misspelt option is refused by name."""
    from omegaconf import OmegaConf

    port = free_port()
    trainer = make_trainer(tmp_path / "ckpt", None, None)
    trainer.config = OmegaConf.merge(
        trainer.config,
        {
            "obsckpt": {
                "metrics_port": 1,
                "metrics_host": "127.0.0.1",
                "save_strategy": "single_thread",
            }
        },
    )
    monkeypatch.setenv("OBSCKPT_METRICS_PORT", str(port))  # the container's setting wins
    monitor = verl_install.monitor_for(trainer)
    try:
        status = ray.get(monitor.status.remote())
        assert status["save_strategy"] == "SINGLE_THREAD"
        assert ray.get(monitor.metrics_address.remote()) == f"127.0.0.1:{port}"
    finally:
        ray.kill(monitor)
    bad = make_trainer(tmp_path / "other", None, None)
    bad.config = OmegaConf.merge(bad.config, {"obsckpt": {"metric_port": 9400}})
    with pytest.raises(ValueError, match=r"\['metric_port'\] are not monitor options"):
        verl_install.monitor_for(bad)


def test_verls_logger_gets_the_save_stall_and_the_commit(ray_cluster, namespace, tmp_path, capsys):
    """verl's Tracking.log (trainer.logger) carries obsckpt's numbers beside verl's timings."""
    import asyncio

    from obsckpt import CheckpointCoordinator, CheckpointMonitor
    from obsckpt.integrations import verl_trainer
    from obsckpt.monitor_link import MonitorLink

    verl_install.patch()
    from verl.utils.tracking import Tracking

    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_port=None
    )
    try:
        coord = CheckpointCoordinator(monitor, rank=0)
        path = root / "global_step_1" / "actor" / "model_world_size_1_rank_0.pt"
        coord.save_state_dict_async("model", {"w": torch.ones(2)}, str(path), 1)
        coord.wait_all(timeout=60)
        asyncio.run(coord.register_and_monitor(1, checkpoint_thread_count=1))
        verl_trainer.LOGGER_METRICS.saved(MonitorLink(monitor, rank=None, rpc_timeout=30), 0.25, 1)
        for _ in range(100):
            if ray.get(monitor.status.remote())["latest"]["checkpoint"] == 1:
                break
        tracking = Tracking(project_name="p", experiment_name="e", default_backend=["console"])
        tracking.log({"timing_s/save_checkpoint": 0.3}, step=1)
        tracking.log({"timing_s/step": 1.0}, step=2)
    finally:
        ray.kill(monitor)
    first, second = [ln for ln in capsys.readouterr().out.splitlines() if "step:" in ln][-2:]
    for key in ("obsckpt/save_stall_s:0.25", "obsckpt/committed_step:1", "obsckpt/commit_lag_s"):
        assert key in first, first
    assert "obsckpt/" not in second  # each number is logged once
