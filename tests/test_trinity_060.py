"""obsckpt's Synchronizer as Trinity-RFT 0.6.0's: its methods, lifetime, versions and waits.

The first part drives a real Synchronizer actor with Trinity 0.6.0's calls, as
its trainer, explorer and rollout models make them, from a config shaped as
Trinity's (``config.synchronizer``, ``.trainer``, ``.explorer``). The second
part (``make test-trinity``, where ``trinity-rft==0.6.0`` is installed) runs
Trinity's own trainer and explorer code against obsckpt's Synchronizer, and
Trinity's own Synchronizer against the same script, comparing the answers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import ray
import torch
from workers import kill_named

from obsckpt import Synchronizer
from obsckpt.errors import AdapterOnlyError, StateDictLoadError, UnverifiedCheckpointError
from obsckpt.store import commit, layout
from obsckpt.sync.step_model import load_step_model
from obsckpt.sync.trinity_api import RoleStates, TrinitySettings


def trinity_config(namespace: str, root: Path | None = None, **sync: object):
    """A config with the fields Trinity 0.6.0's synchronizer reads, as Trinity's Config has them."""
    synchronizer = dict(
        sync_method="memory",
        sync_timeout=30,
        group_name="rollout_weight_sync",
        explorer_world_size=1,
    )
    synchronizer.update(sync)
    return types.SimpleNamespace(
        ray_namespace=namespace,
        mode="both",
        checkpoint_job_dir=str(root) if root is not None else None,
        synchronizer=types.SimpleNamespace(**synchronizer),
        trainer=types.SimpleNamespace(name="trainer", trainer_type="verl"),
        explorer=types.SimpleNamespace(
            name="explorer", rollout_model=types.SimpleNamespace(enable_lora=False)
        ),
    )


def state_dict(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(6, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
    }


def equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def gone(name: str, namespace: str, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def trinity_sync(namespace, tmp_path):
    """A Trinity 0.6.0-form synchronizer (detached), shut down after the test."""
    made = []

    def make(**sync):
        actor = Synchronizer.get_actor(trinity_config(namespace, tmp_path, **sync))
        made.append(actor)
        return actor

    yield make
    for actor in made:
        try:
            ray.get(actor.shutdown.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            pass
    assert gone("synchronizer", namespace)


def write_safetensors_step(root: Path, step: int, sd: dict, *, committed: bool = True) -> Path:
    """Write Trinity 0.6.0's checkpoint-sync file of ``step``, then commit it as the monitor does."""
    from safetensors.torch import save_file

    path = layout.model_dir(root, step) / "model.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))
    if committed:
        commit.finalize_step(layout.step_dir(root, step))
        commit.write_iteration(root, "state_dict", step)
    return path


class TestVersionsAndWaits:
    """The 0.6.0 form holds version 0 first, and its waits end when notified, when the
    trainer stops, or at sync_timeout; obsckpt's own form keeps None and its timeouts."""

    def test_first_version_and_the_wait(self, trinity_sync, namespace, tmp_path):
        sync = trinity_sync(sync_timeout=1)
        assert ray.get(sync.get_model_state_dict.remote()) == (None, 0)
        assert ray.get(sync.get_latest_model_version.remote()) == 0
        assert ray.get(sync.get_latest_model_path.remote()) is None
        # The trainer has not started (Trinity's trainer starts STOPPED): no wait.
        assert ray.get(sync.wait_new_model_state_dict.remote(current_version=0)) == 0
        # The explorer starts at -1: version 0 is newer.
        assert ray.get(sync.wait_new_model_state_dict.remote(current_version=-1)) == 0

        ray.get(sync.set_trainer_status.remote("running"))
        assert ray.get(sync.trainer_requires_weight_sync.remote()) is False
        ray.get(sync.set_explorer_status.remote("running"))
        waiting = sync.wait_new_model_state_dict.remote(current_version=0)
        deadline = time.monotonic() + 10
        while not ray.get(sync.explorer_requires_sync.remote()):
            assert time.monotonic() < deadline, "the waiting explorer never required a sync"
            time.sleep(0.05)
        ray.get(sync.notify_no_new_model_state_dict.remote())
        assert ray.get(waiting, timeout=30) == 0
        assert ray.get(sync.explorer_requires_sync.remote()) is False

        # Nothing newer and nobody notifies: asyncio.TimeoutError after sync_timeout (1 s).
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            ray.get(sync.wait_new_model_state_dict.remote(current_version=0), timeout=30)
        assert 0.9 <= time.monotonic() - t0 < 20
        assert ray.get(sync.status.remote())["roles"]["explorers"] == {
            "running": 1,
            "require_sync": 0,
            "stopped": 0,
        }

        waiting = sync.wait_new_model_state_dict.remote(current_version=0)
        time.sleep(0.2)
        sd = state_dict(1)
        ray.get(sync.set_model_state_dict.remote(sd, 1))
        assert ray.get(waiting, timeout=30) == 1
        assert ray.get(sync.get_latest_model_path.remote()) == str(layout.model_dir(tmp_path, 1))
        assert ray.get(sync.get_latest_model_path.remote(use_huggingface=True)) == str(
            layout.model_dir(tmp_path, 1) / "huggingface"
        )
        # A stopping trainer wakes a waiter at once.
        waiting = sync.wait_new_model_state_dict.remote(current_version=1)
        time.sleep(0.2)
        ray.get(sync.set_trainer_status.remote("stopped"))
        assert ray.get(waiting, timeout=30) == 1
        assert ray.get(sync.trainer_requires_weight_sync.remote()) is None
        # An explorer ahead of the synchronizer is refused by name, as Trinity asserts.
        with pytest.raises(ValueError, match="newer than the synchronizer's 1"):
            ray.get(sync.wait_new_model_state_dict.remote(current_version=5))
        # obsckpt's own keywords keep their meaning on the same actor.
        assert ray.get(sync.wait_new_model_state_dict.remote(1, timeout=0.2)) == 1
        assert ray.get(sync.wait_new_model_state_dict.remote(1, no_wait=True)) == 1

    def test_obsckpt_form_keeps_none_and_is_not_detached(self, namespace):
        sync = Synchronizer.get_actor(namespace=namespace)
        assert ray.get(sync.get_model_state_dict.remote()) == (None, None)
        status = ray.get(sync.status.remote())
        assert status["api"] == "obsckpt" and status["roles"]["trainer"] == "stopped"
        kill_named(sync, "synchronizer", namespace)

    def test_a_tinker_sampler_path_is_published_as_it_is(self, trinity_sync):
        sync = trinity_sync()
        ray.get(sync.set_model_state_dict.remote("tinker://run-1/sampler-3", 3))
        assert ray.get(sync.get_model_state_dict.remote()) == ("tinker://run-1/sampler-3", 3)
        assert ray.get(sync.get_state_dict_meta.remote()) is None
        with pytest.raises(ValueError, match="holds a str, not a state dict"):
            for ref in sync.get_model_state_dict_iterator.remote():
                ray.get(ref)


class TestStateDictIterator:
    """get_model_state_dict_iterator streams the held weights, one Ray object per tensor,
    as Trinity's vLLM extension consumes them."""

    def test_streams_the_held_tensors(self, trinity_sync):
        sync = trinity_sync()
        assert [ray.get(r) for r in sync.get_model_state_dict_iterator.remote()] == []
        sd = state_dict(4)
        ray.get(sync.set_model_state_dict.remote(sd, 4))
        got = dict(ray.get(ref) for ref in sync.get_model_state_dict_iterator.remote())
        assert equal(got, sd)


class TestNcclHandshake:
    """ready_to_nccl_sync meets the trainer and one explorer; a stopped side makes it None."""

    def test_trainer_and_explorer_meet(self, trinity_sync):
        sync = trinity_sync(sync_timeout=5)
        with pytest.raises(ValueError, match="exactly one explorer"):
            ray.get(sync.ready_to_nccl_sync.remote("trainer", 1))
        ray.get(sync.set_trainer_status.remote("running"))
        ray.get(sync.set_explorer_status.remote("running"))

        trainer = sync.ready_to_nccl_sync.remote("trainer", 7)
        deadline = time.monotonic() + 10
        while not ray.get(sync.trainer_requires_weight_sync.remote()):
            assert time.monotonic() < deadline, "the trainer never required a sync"
            time.sleep(0.05)
        explorer = sync.ready_to_nccl_sync.remote("explorer", 0)
        assert ray.get([trainer, explorer], timeout=30) == [7, 7]
        assert ray.get(sync.trainer_requires_weight_sync.remote()) is False
        assert ray.get(sync.get_latest_model_version.remote()) == 7

        # The explorer first, the trainer after: the same meeting.
        explorer = sync.ready_to_nccl_sync.remote("explorer", 7)
        time.sleep(0.2)
        assert ray.get(sync.explorer_requires_sync.remote()) is True
        assert ray.get(sync.ready_to_nccl_sync.remote("trainer", 8), timeout=30) == 8
        assert ray.get(explorer, timeout=30) == 8

        # The explorer stops while the trainer waits: None at once, not at the timeout.
        trainer = sync.ready_to_nccl_sync.remote("trainer", 9)
        time.sleep(0.2)
        t0 = time.monotonic()
        ray.get(sync.set_explorer_status.remote("stopped", old_status="running"))
        assert ray.get(trainer, timeout=30) is None
        assert time.monotonic() - t0 < 4
        assert ray.get(sync.trainer_requires_weight_sync.remote()) is False

    def test_role_states_refuse_impossible_moves(self):
        roles = RoleStates()
        with pytest.raises(ValueError, match="no explorer is 'running'"):
            roles.move_explorer("require_sync", "running")
        roles.move_explorer("running")
        with pytest.raises(ValueError, match="to itself"):
            roles.move_explorer("running", "running")
        with pytest.raises(ValueError, match="RunningStatus"):
            roles.set_trainer("paused")


@ray.remote(num_cpus=0)
class _Side:
    """A trainer or explorer actor with the methods Trinity's synchronizer calls on it."""

    def __init__(self) -> None:
        self.calls: list = []

    def get_weight_sync_info(self):
        self.calls.append(("get_weight_sync_info",))
        return "10.0.0.1", 29500, [("w", "float32", (2,))]

    def setup_weight_sync_group(self, *args):
        self.calls.append(("setup_weight_sync_group", *args))

    def set_state_dict_meta(self, meta):
        self.calls.append(("set_state_dict_meta", meta))

    def teardown_weight_sync_group(self):
        self.calls.append(("teardown_weight_sync_group",))

    def is_alive(self) -> bool:
        return True

    def ask_for_synchronizer(self, config) -> None:
        Synchronizer.get_actor(config)

    def recorded(self) -> list:
        return self.calls


class TestGroupCoordination:
    """coordinate_weight_sync_setup/teardown and setup_weight_sync_group call the trainer
    and explorer actors named in the config, with Trinity's arguments and order."""

    def test_setup_and_teardown(self, trinity_sync, namespace):
        sync = trinity_sync(sync_timeout=12, explorer_world_size=2)
        trainer = _Side.options(name="trainer", namespace=namespace).remote()
        explorer = _Side.options(name="explorer", namespace=namespace).remote()
        ray.get(sync.coordinate_weight_sync_setup.remote())
        meta = [("w", "float32", (2,))]
        assert ray.get(trainer.recorded.remote()) == [
            ("get_weight_sync_info",),
            ("setup_weight_sync_group", "10.0.0.1", 29500, 3, "rollout_weight_sync", 12),
        ]
        assert ray.get(explorer.recorded.remote()) == [
            ("setup_weight_sync_group", "10.0.0.1", 29500, 3, "rollout_weight_sync", 12),
            ("set_state_dict_meta", meta),
        ]
        ray.get(sync.setup_weight_sync_group.remote("10.0.0.2", 29501, meta))
        assert ray.get(explorer.recorded.remote())[-2:] == [
            ("setup_weight_sync_group", "10.0.0.2", 29501),
            ("set_state_dict_meta", meta),
        ]
        ray.kill(explorer)
        ray.get(sync.coordinate_weight_sync_teardown.remote())  # the explorer is gone: skipped
        assert ray.get(trainer.recorded.remote())[-1] == ("teardown_weight_sync_group",)
        ray.kill(trainer)

    def test_obsckpt_form_names_what_it_lacks(self, namespace):
        sync = Synchronizer.get_actor(namespace=namespace)
        with pytest.raises(ValueError, match=r"get_actor\(config\)"):
            ray.get(sync.coordinate_weight_sync_setup.remote())
        kill_named(sync, "synchronizer", namespace)


class TestDetachedLifetime:
    """The 0.6.0 form is detached: it outlives the actor that created it, ends once every
    module that asked for it is dead, and ends on shutdown() or the documented command."""

    def test_outlives_its_creator_and_ends_with_its_last_module(self, namespace, tmp_path):
        config = trinity_config(namespace, tmp_path)
        creator, other = _Side.remote(), _Side.remote()
        ray.get(creator.ask_for_synchronizer.remote(config))
        ray.get(other.ask_for_synchronizer.remote(config))
        sync = ray.get_actor("synchronizer", namespace=namespace)
        assert ray.get(sync.status.remote())["modules"] == 2
        ray.kill(creator)  # a non-detached actor would die with the actor that created it
        time.sleep(3)
        assert ray.get(sync.get_latest_model_version.remote(), timeout=30) == 0
        assert ray.get(sync.status.remote())["modules"] == 1
        ray.kill(other)
        assert gone("synchronizer", namespace), "the synchronizer outlived its last module"

    def test_the_stop_command(self, namespace, tmp_path):
        Synchronizer.get_actor(trinity_config(namespace, tmp_path))  # from the driver: no module
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "obsckpt.sync.lifetime",
                "--namespace",
                namespace,
                "--address",
                ray.get_runtime_context().gcs_address,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert out.returncode == 0, out.stderr
        assert "ended" in out.stdout
        assert "RuntimeWarning" not in out.stderr  # nothing imports the command's module
        assert gone("synchronizer", namespace)

    def test_the_stop_command_on_an_unreachable_cluster_says_so_in_one_line(self):
        from obsckpt.sync.group import free_port

        address = f"127.0.0.1:{free_port()}"  # nothing listens there
        t0 = time.monotonic()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "obsckpt.sync.lifetime",
                "--namespace",
                "x",
                "--address",
                address,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)),
        )
        assert time.monotonic() - t0 < 60
        assert out.returncode == 2 and out.stdout == ""
        (line,) = out.stderr.strip().splitlines()
        assert f"cannot reach the Ray cluster at {address}" in line and "--address" in line


class TestSafetensorsCheckpointSync:
    """Checkpoint sync reads Trinity 0.6.0's actor/model.safetensors, only through the
    step's manifest: a committed, matching file is published; anything else is not."""

    def test_loads_only_a_committed_matching_file(self, tmp_path):
        root = tmp_path / "ckpt"
        sd = state_dict(3)
        path = write_safetensors_step(root, 3, sd)
        assert equal(load_step_model(path.parent), sd)

        write_safetensors_step(root, 4, state_dict(4), committed=False)
        with pytest.raises(UnverifiedCheckpointError, match="never committed"):
            load_step_model(layout.model_dir(root, 4))

        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(UnverifiedCheckpointError, match="corrupted"):
            load_step_model(path.parent)

    def test_adapter_only_is_refused(self, tmp_path):
        path = write_safetensors_step(tmp_path, 1, {"q.lora_A.weight": torch.ones(2, 2)})
        with pytest.raises(AdapterOnlyError):
            load_step_model(path.parent)

    def test_the_synchronizer_follows_the_committed_steps(self, trinity_sync, tmp_path):
        sd = state_dict(2)
        write_safetensors_step(tmp_path, 2, sd)
        sync = trinity_sync(sync_method="checkpoint")
        deadline = time.monotonic() + 30
        while ray.get(sync.get_latest_model_version.remote()) != 2:
            assert time.monotonic() < deadline, ray.get(sync.status.remote())
            time.sleep(0.1)
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 2 and equal(got, sd)
        status = ray.get(sync.status.remote())
        assert status["root"] == str(tmp_path) and status["api"] == "trinity-0.6"
        # A damaged step is skipped and recorded, never published.
        path = write_safetensors_step(tmp_path, 3, state_dict(3))
        path.write_bytes(path.read_bytes()[:-4] + b"\0\0\0\0")
        deadline = time.monotonic() + 30
        while 3 not in ray.get(sync.status.remote())["failed_steps"]:
            assert time.monotonic() < deadline, ray.get(sync.status.remote())
            time.sleep(0.1)
        assert ray.get(sync.get_latest_model_version.remote()) == 2

    def test_settings_from_a_config(self, tmp_path):
        settings = TrinitySettings.from_config(
            trinity_config("ns", tmp_path, sync_method="checkpoint", sync_timeout=7)
        )
        assert settings.watch_root == str(tmp_path) and settings.sync_timeout_s == 7.0
        memory = TrinitySettings.from_config(trinity_config("ns", tmp_path))
        assert memory.watch_root is None and memory.checkpoint_job_dir == str(tmp_path)
        with pytest.raises(ValueError, match="sync_timeout"):
            TrinitySettings(sync_timeout_s=0)
        with pytest.raises(StateDictLoadError):
            load_step_model(tmp_path / "nothing")


# ----------------------------------------------------------------------
# Trinity-RFT 0.6.0's own code (make test-trinity installs it)
# ----------------------------------------------------------------------


def _import_trinity():
    """Trinity's trainer, explorer and synchronizer modules, or a skip where it is absent.

    Trinity's explorer module imports vLLM's config types for its rollout models;
    vLLM is a GPU inference engine that does not install on a CPU machine, so its
    modules are empty stand-ins for that import only (no vLLM code runs in the
    paths tested here: the explorers have no rollout models).
    """
    pytest.importorskip("trinity", reason="trinity-rft is not installed (make test-trinity)")
    import importlib.abc
    import importlib.machinery
    import importlib.util

    class _Anything(types.ModuleType):
        __path__: list[str] = []

        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class _NoVllm(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "vllm" or name.startswith("vllm."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return _Anything(spec.name)

        def exec_module(self, module):
            pass

    finder = None
    if importlib.util.find_spec("vllm") is None:
        finder = _NoVllm()
        sys.meta_path.insert(0, finder)
    try:
        import trinity.explorer.explorer as explorer
        import trinity.manager.synchronizer as synchronizer
        import trinity.trainer.trainer as trainer
        from trinity.common import config, constants
    finally:
        if finder is not None:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
                del sys.modules[name]
    return types.SimpleNamespace(
        Trainer=trainer.Trainer,
        Explorer=explorer.Explorer,
        TrinitySynchronizer=synchronizer.Synchronizer,
        Config=config.Config,
        RunningStatus=constants.RunningStatus,
        SyncMethod=constants.SyncMethod,
        SyncStyle=constants.SyncStyle,
    )


@pytest.fixture(scope="module")
def trinity():
    return _import_trinity()


def real_config(trinity, namespace: str, root: Path, method: str = "memory", timeout: int = 20):
    config = trinity.Config()
    config.ray_namespace = namespace
    config.checkpoint_job_dir = str(root)
    config.synchronizer.sync_method = trinity.SyncMethod(method)
    config.synchronizer.sync_timeout = timeout
    config.synchronizer.explorer_world_size = 1
    return config


class _UploadingEngine:
    """The trainer's engine as Trinity's MEMORY sync uses it: upload_state_dict publishes."""

    def __init__(self, synchronizer, step_of) -> None:
        self.synchronizer, self.step_of = synchronizer, step_of
        self.nccl_syncs = 0

    async def upload_state_dict(self) -> None:
        step = self.step_of()
        await self.synchronizer.set_model_state_dict.remote(state_dict(step), step)

    def sync_weight_nccl(self) -> None:
        self.nccl_syncs += 1


def trainer_self(trinity, synchronizer, method: str, style: str):
    """The attributes Trinity's Trainer.need_sync / sync_weight read (its engine stands in)."""
    me = types.SimpleNamespace(
        synchronizer=synchronizer,
        sync_method=trinity.SyncMethod(method),
        sync_style=trinity.SyncStyle(style),
        sync_interval=1,
        last_sync_step=0,
        last_sync_time=None,
        train_step_num=0,
        logger=__import__("logging").getLogger("trinity-trainer"),
    )
    me.engine = _UploadingEngine(synchronizer, lambda: me.train_step_num)
    return me


def explorer_self(trinity, synchronizer, config, style: str):
    """The attributes Trinity's Explorer sync methods read (no rollout models)."""

    async def finish_current_steps() -> None:
        pass

    return types.SimpleNamespace(
        synchronizer=synchronizer,
        config=config,
        models=[],
        model_version=-1,
        explore_step_num=1,
        sync_offset=0,
        sync_interval=1,
        sync_method=config.synchronizer.sync_method,
        sync_style=trinity.SyncStyle(style),
        finish_current_steps=finish_current_steps,
        logger=__import__("logging").getLogger("trinity-explorer"),
    )


class TestTrinityCodeAgainstObsckpt:
    """Trinity 0.6.0's own trainer and explorer methods, run against obsckpt's Synchronizer
    (created by get_actor with Trinity's real Config), sync as they do against Trinity's."""

    def test_explorer_driven_memory_sync(self, trinity, namespace, tmp_path):
        config = real_config(trinity, namespace, tmp_path)
        sync = Synchronizer.get_actor(config)
        Trainer, Explorer, Status = trinity.Trainer, trinity.Explorer, trinity.RunningStatus
        trainer = trainer_self(trinity, sync, "memory", "explorer_driven")
        explorer = explorer_self(trinity, sync, config, "explorer_driven")

        async def run() -> None:
            await sync.set_trainer_status.remote(Status.RUNNING)
            await sync.set_explorer_status.remote(Status.RUNNING)
            await Explorer._pull_latest_weights(explorer)  # version 0 is newer than -1
            assert explorer.model_version == 0
            pulling = asyncio.ensure_future(Explorer._pull_latest_weights(explorer))
            trainer.train_step_num = 1
            deadline = time.monotonic() + 20
            while not await Trainer.need_sync(trainer):
                assert time.monotonic() < deadline, "the explorer never asked for a sync"
                await asyncio.sleep(0.05)
            await Trainer.sync_weight(trainer)
            await asyncio.wait_for(pulling, 30)
            assert explorer.model_version == 1 and trainer.last_sync_step == 1
            # Nothing newer: the trainer says so, and the waiting explorer goes on at once.
            pulling = asyncio.ensure_future(Explorer._pull_latest_weights(explorer))
            await asyncio.sleep(0.3)
            assert await Trainer.need_sync(trainer) is False
            await asyncio.wait_for(pulling, 30)
            assert explorer.model_version == 1
            await sync.set_trainer_status.remote(Status.STOPPED)

        asyncio.run(run())
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 1 and equal(got, state_dict(1))
        ray.get(sync.shutdown.remote())
        assert gone("synchronizer", namespace)

    def test_trainer_driven_nccl_sync(self, trinity, namespace, tmp_path):
        config = real_config(trinity, namespace, tmp_path, method="nccl", timeout=20)
        sync = Synchronizer.get_actor(config)
        Trainer, Explorer, Status = trinity.Trainer, trinity.Explorer, trinity.RunningStatus
        trainer = trainer_self(trinity, sync, "nccl", "trainer_driven")
        explorer = explorer_self(trinity, sync, config, "trainer_driven")

        async def run() -> None:
            await sync.set_trainer_status.remote(Status.RUNNING)
            await sync.set_explorer_status.remote(Status.RUNNING)
            assert await Explorer.need_sync(explorer) is False  # the trainer is not waiting
            trainer.train_step_num = 2
            syncing = asyncio.ensure_future(Trainer.sync_weight(trainer))
            deadline = time.monotonic() + 20
            while not await Explorer.need_sync(explorer):
                assert time.monotonic() < deadline, "the trainer never required a sync"
                await asyncio.sleep(0.05)
            await Explorer._nccl_weights_update(explorer)
            await asyncio.wait_for(syncing, 30)
            assert explorer.model_version == 2 and trainer.engine.nccl_syncs == 1
            # The explorer stops: the trainer's next NCCL sync is skipped, not hung.
            await sync.set_explorer_status.remote(Status.STOPPED, old_status=Status.RUNNING)
            trainer.train_step_num = 3
            await asyncio.wait_for(Trainer.sync_weight(trainer), 30)
            assert trainer.engine.nccl_syncs == 1
            await sync.set_trainer_status.remote(Status.STOPPED)
            assert await sync.trainer_requires_weight_sync.remote() is None

        asyncio.run(run())
        ray.get(sync.shutdown.remote())
        assert gone("synchronizer", namespace)


async def _script(sync, Status, tmp_path: Path) -> list:
    """One sequence of Trinity 0.6.0's calls; what each returns."""
    out: list = []

    async def until(call) -> None:
        deadline = time.monotonic() + 20
        while not await call.remote():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)

    out.append(await sync.get_model_state_dict.remote())
    out.append(await sync.get_latest_model_path.remote())
    await sync.set_trainer_status.remote(Status.RUNNING)
    await sync.set_explorer_status.remote(Status.RUNNING)
    out.append(await sync.trainer_requires_weight_sync.remote())
    out.append(await sync.explorer_requires_sync.remote())
    out.append(await sync.wait_new_model_state_dict.remote(current_version=-1))
    waiting = sync.wait_new_model_state_dict.remote(current_version=0)
    await until(sync.explorer_requires_sync)
    await sync.notify_no_new_model_state_dict.remote()
    out.append(await waiting)
    waiting = sync.wait_new_model_state_dict.remote(current_version=0)
    await until(sync.explorer_requires_sync)
    await sync.set_model_state_dict.remote(state_dict(1), 1)
    out.append(await waiting)
    out.append(await sync.get_latest_model_version.remote())
    out.append(await sync.get_latest_model_path.remote())
    out.append(await sync.get_latest_model_path.remote(use_huggingface=True))
    out.append(await sync.get_state_dict_meta.remote())
    trainer = sync.ready_to_nccl_sync.remote("trainer", 2)
    await until(sync.trainer_requires_weight_sync)
    out.append(await sync.ready_to_nccl_sync.remote("explorer", 1))
    out.append(await trainer)
    await sync.set_trainer_status.remote(Status.STOPPED)
    out.append(await sync.trainer_requires_weight_sync.remote())
    out.append(await sync.wait_new_model_state_dict.remote(current_version=2))
    await sync.set_explorer_status.remote(Status.STOPPED, old_status=Status.RUNNING)
    # The explorer is gone: no sync (and the trainer is taken to run again, as Trinity does).
    out.append(await sync.ready_to_nccl_sync.remote("trainer", 3))
    out.append(await sync.trainer_requires_weight_sync.remote())
    return out


class TestSameAnswersAsTrinity:
    """The same script of Trinity 0.6.0's calls gets the same answers from Trinity's own
    Synchronizer and from obsckpt's."""

    def test_script(self, trinity, namespace, tmp_path):
        theirs_ns, ours_ns = f"{namespace}-trinity", f"{namespace}-obsckpt"
        theirs = (
            ray.remote(trinity.TrinitySynchronizer)
            .options(name="synchronizer", namespace=theirs_ns)
            .remote(real_config(trinity, theirs_ns, tmp_path), module_ref=None)
        )
        ours = Synchronizer.get_actor(real_config(trinity, ours_ns, tmp_path))
        try:
            expected = asyncio.run(_script(theirs, trinity.RunningStatus, tmp_path))
            got = asyncio.run(_script(ours, trinity.RunningStatus, tmp_path))
        finally:
            ray.kill(theirs)
            ray.get(ours.shutdown.remote())
        assert got == expected
        assert expected[-4:] == [None, 2, None, False]
