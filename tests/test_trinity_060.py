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

from obsckpt import Synchronizer, commit, layout
from obsckpt.errors import AdapterOnlyError, StateDictLoadError, UnverifiedCheckpointError
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
        assert gone("synchronizer", namespace)


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
