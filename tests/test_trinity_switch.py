"""The one-step switch for Trinity-RFT: obsckpt's plugin, loaded by Trinity's own loader.

The first part needs no Trinity: the rebinding machinery (on real modules
imported from disk, in either order) and ``python -m obsckpt.trinity``'s
handling of plugin directories. The second part (``make test-trinity``, where
``trinity-rft==0.6.0`` is installed) runs Trinity's own code: its plugin loader
loads obsckpt's plugin, the job is started the way Trinity's launcher starts
it, and Trinity's own trainer and worker methods save steps, which obsckpt's
monitor commits, in a worker process that loaded no plugin at all; saving a
committed step again (as Trinity's training loop does at its end) leaves its
files as they were committed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from obsckpt import trinity as trinity_cli
from obsckpt.integrations import trinity_install
from obsckpt.integrations._rebind import Rebinder, original
from obsckpt.sync.group import free_port


def _host_package(tmp_path: Path) -> Path:
    """A stand-in host package on disk: ``hostpkg.core`` defines ``Thing``, ``hostpkg.user``
    imports it by name (as Trinity's modules import ``Synchronizer``)."""
    pkg = tmp_path / "hostpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "core.py").write_text("class Thing:\n    pass\n")
    (pkg / "user.py").write_text("from hostpkg.core import Thing\n")
    (tmp_path / "mine.py").write_text("class Mine:\n    pass\n")
    return tmp_path


def _run(code: str, path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=path,
        env={**os.environ, "PYTHONPATH": str(path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


REBIND = """
    import json, sys
    from obsckpt.integrations._rebind import Rebinder, original
    rebinder = Rebinder({{
        "hostpkg.core": {{"Thing": "mine:Mine"}},
        "hostpkg.user": {{"Thing": "mine:Mine"}},
    }})
    {before}
    rebinder.patch()
    {after}
    import hostpkg.core, hostpkg.user, mine
    print(json.dumps({{
        "core": hostpkg.core.Thing is mine.Mine,
        "user": hostpkg.user.Thing is mine.Mine,
        "original": original("hostpkg.core", "Thing").__module__,
        "original_user": original("hostpkg.user", "Thing").__module__,
    }}))
"""


class TestRebinder:
    """Names are rebound whether the host's modules are imported before or after patch()."""

    @pytest.mark.parametrize("order", ["host first", "patch first", "one before, one after"])
    def test_any_import_order(self, tmp_path, order):
        path = _host_package(tmp_path)
        before, after = {
            "host first": ("import hostpkg.user", ""),
            "patch first": ("", "import hostpkg.user"),
            "one before, one after": ("import hostpkg.core", "import hostpkg.user"),
        }[order]
        got = _run(REBIND.format(before=before, after=after), path)
        assert got == {
            "core": True,
            "user": True,
            "original": "hostpkg.core",
            "original_user": "hostpkg.core",
        }

    def test_patch_is_idempotent_and_a_missing_name_is_left_alone(self, tmp_path):
        path = _host_package(tmp_path)
        sys.path.insert(0, str(path))
        try:
            import hostpkg.core  # noqa: F401 - imported for the rebinder to find
            import mine

            rebinder = Rebinder({"hostpkg.core": {"Thing": "mine:Mine", "NotThere": "mine:Mine"}})
            rebinder.patch()
            rebinder.patch()
            assert sys.modules["hostpkg.core"].Thing is mine.Mine
            assert not hasattr(sys.modules["hostpkg.core"], "NotThere")
            assert original("hostpkg.core", "Thing").__name__ == "Thing"
            assert rebinder.is_patched("hostpkg.core")
        finally:
            sys.path.remove(str(path))
            for name in ("hostpkg", "hostpkg.core", "mine"):
                sys.modules.pop(name, None)


class TestPluginDirectories:
    def test_obsckpts_directory_comes_first_once_and_the_users_stay(self):
        mine = trinity_install.PLUGIN_DIR
        assert trinity_cli.with_obsckpt_plugin(None) == mine
        assert trinity_cli.with_obsckpt_plugin(f"/a{os.pathsep}{mine}{os.pathsep}/b") == (
            os.pathsep.join([mine, "/a", "/b"])
        )
        args = trinity_cli._with_plugin_option(["run", "--config", "c.yaml", "--plugin-dir", "/p"])
        assert args[-1] == os.pathsep.join([mine, "/p"])
        args = trinity_cli._with_plugin_option(["run", "--plugin-dir=/p"])
        assert args[-1] == "--plugin-dir=" + os.pathsep.join([mine, "/p"])

    def test_the_plugin_directory_holds_only_obsckpts_plugin(self):
        files = sorted(p.name for p in Path(trinity_install.PLUGIN_DIR).glob("*.py"))
        assert files == ["obsckpt_switch.py"]

    def test_print_the_directory(self):
        out = subprocess.run(
            [sys.executable, "-m", "obsckpt.trinity", "--plugin-dir-path"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.strip() == trinity_install.PLUGIN_DIR

    def test_runtime_env_forwards_obsckpt_variables_and_keeps_the_callers(self, monkeypatch):
        monkeypatch.setenv("OBSCKPT_METRICS_PORT", "9400")
        monkeypatch.setenv("OBSCKPT_SAVE_STRATEGY", "single_node")
        env = trinity_install.runtime_env({"env_vars": {"OBSCKPT_SAVE_STRATEGY": "unrestricted"}})
        assert env["worker_process_setup_hook"] == trinity_install.HOOK
        assert env["env_vars"]["OBSCKPT_METRICS_PORT"] == "9400"
        assert env["env_vars"]["OBSCKPT_SAVE_STRATEGY"] == "unrestricted"
        with pytest.raises(ValueError, match="worker_process_setup_hook"):
            trinity_install.runtime_env({"worker_process_setup_hook": "theirs.hook"})

    def test_runtime_env_forwards_aws_variables_only_with_a_mirror(self, monkeypatch):
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:8333")
        monkeypatch.delenv("OBSCKPT_MIRROR", raising=False)
        assert "AWS_ENDPOINT_URL" not in trinity_install.runtime_env()["env_vars"]
        monkeypatch.setenv("OBSCKPT_MIRROR", "s3://ckpt/run")
        forwarded = trinity_install.runtime_env()["env_vars"]
        assert forwarded["AWS_ENDPOINT_URL"] == "http://127.0.0.1:8333"
        assert forwarded["OBSCKPT_MIRROR"] == "s3://ckpt/run"


# ----------------------------------------------------------------------
# Trinity-RFT 0.6.0's own code (make test-trinity installs it)
# ----------------------------------------------------------------------

# What both jobs share: Trinity's modules through its plugin loader, Ray as Trinity's
# launcher starts it, a process of Trinity's worker class, and a worker group for it.
JOB_PRELUDE = r"""
import asyncio, json, logging, os, sys, time, types
import ray, torch

# Trinity's trainer module first, as a user's own code may import it before anything.
import trinity.trainer.trainer as trinity_trainer
from trinity.common.config import load_config
from trinity.utils.plugin_loader import load_plugins

config_path, namespace = sys.argv[1], sys.argv[2]
load_plugins()  # Trinity's own loader; TRINITY_PLUGIN_DIRS names obsckpt's plugin

from obsckpt.coordinator import CheckpointCoordinator
from obsckpt.integrations import trinity_install
from obsckpt.sync.synchronizer import Synchronizer

report = {"driver_synchronizer": trinity_trainer.Synchronizer is Synchronizer}
config = load_config(config_path)  # the user's own config file, read by Trinity
# What Trinity's check_and_update derives (its full check needs a model and GPUs).
config.checkpoint_job_dir = root = config.get_checkpoint_job_dir()
config.ray_namespace = namespace  # one per test
# As Trinity's launcher (run_stage) starts the job.
ray.init(
    address=os.environ["RAY_ADDRESS"],
    ignore_reinit_error=True,
    namespace=config.ray_namespace,
    runtime_env={"env_vars": config.get_envs()},
)
import trinity.trainer.verl.trainer as verl_trainer  # imported after the plugin

report["monitor_class"] = verl_trainer.CheckpointMonitor is trinity_install.TrinityCheckpointMonitor
report["coordinator_class"] = verl_trainer.CheckpointCoordinator is CheckpointCoordinator


@ray.remote
class WorkerProcess:
    # A process of the job that loads no plugin, as the trainer's verl workers.

    def __init__(self, namespace, init_method):
        import torch.distributed as dist
        from trinity.trainer.verl.workers import TrinityActorRolloutRefWorker

        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=1)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)

        def per_tensor():  # what verl's FSDP engine yields (full tensors, one at a time)
            return ((n, t.detach()) for n, t in model.state_dict().items()), None

        def full_save(local_path, global_step):  # what verl's FSDP manager writes, per rank
            os.makedirs(local_path, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(local_path, "model_world_size_1_rank_0.pt"))
            torch.save({"step": global_step}, os.path.join(local_path, "extra_state_world_size_1_rank_0.pt"))

        worker = object.__new__(TrinityActorRolloutRefWorker)
        worker._coordinator = None
        worker._ray_namespace = namespace
        worker.logger = logging.getLogger("worker")
        worker.actor = types.SimpleNamespace(
            engine=types.SimpleNamespace(module=model, get_per_tensor_param=per_tensor),
            save_checkpoint=full_save,
        )
        worker._cache_state_dict_meta()  # Trinity's own, as its init_model does
        self.cls, self.worker = TrinityActorRolloutRefWorker, worker

    def facts(self):
        return {
            "hooked": trinity_install.is_patched("trinity.trainer.verl.workers"),
            "metrics_port_env": os.environ.get("OBSCKPT_METRICS_PORT"),
            "coordinator": type(self.worker._get_coordinator()).__module__,
        }

    def save_state_dict(self, local_path, global_step):
        self.cls.save_state_dict(self.worker, local_path, global_step=global_step)

    def save_checkpoint(self, local_path, global_step, save_as_hf=False):
        self.cls.save_checkpoint(self.worker, local_path, global_step=global_step, save_as_hf=save_as_hf)

    def wait_on_save_thread(self):
        self.cls.wait_on_save_thread(self.worker)


class WorkerGroup:  # verl's worker group, for one worker
    def __init__(self, worker):
        self.worker = worker

    def save_state_dict(self, local_path, global_step):
        ray.get(self.worker.save_state_dict.remote(local_path, global_step))

    def save_checkpoint(self, local_path, global_step, save_as_hf=False):
        ray.get(self.worker.save_checkpoint.remote(local_path, global_step, save_as_hf))

    def wait_on_save_thread(self):
        ray.get(self.worker.wait_on_save_thread.remote())


def trinity_trainer(job_config, monitor, worker):
    # The attributes Trinity's VERLTrainer save methods read, as its __init__ sets them.
    trainer = types.SimpleNamespace(
        global_config=job_config,
        checkpoint_coordinator=verl_trainer.CheckpointCoordinator(monitor),
        actor_rollout_wg=WorkerGroup(worker),
        use_critic=False,
        logger=logging.getLogger("trainer"),
        _saved_checkpoint_paths=[],
    )
    trainer._retain_checkpoints = lambda p: verl_trainer.VERLTrainer._retain_checkpoints(trainer, p)
    trainer.wait_for_save = lambda: verl_trainer.VERLTrainer.wait_for_save(trainer)
    return trainer


def committed(name, step, job_root=None):
    path = os.path.join(job_root or root, name)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(path) and open(path).read().strip() == str(step):
            return True
        time.sleep(0.1)
    return False
"""

JOB = (
    JOB_PRELUDE
    + r"""
dist_port = int(sys.argv[3])
# As VERLTrainer.__init__ builds them, through the names Trinity's module binds.
monitor = verl_trainer.CheckpointMonitor.get_actor(
    namespace=config.synchronizer.ray_namespace or namespace,
    save_strategy=config.trainer.save_strategy,
    default_local_dir=config.checkpoint_job_dir,
    default_hdfs_dir=None,
)
worker = WorkerProcess.remote(namespace, f"tcp://127.0.0.1:{dist_port}")
report.update(ray.get(worker.facts.remote()))
trainer = trinity_trainer(config, monitor, worker)


# Checkpoint sync at steps 1 and 2 (VERLTrainer.save_state_dict and its worker's).
for step in (1, 2):
    trainer.global_steps = step
    asyncio.run(verl_trainer.VERLTrainer.save_state_dict(trainer))
trainer.actor_rollout_wg.wait_on_save_thread()
report["state_dict_committed"] = committed("latest_state_dict_iteration.txt", 2)
# A full checkpoint of step 2 (VERLTrainer.save_checkpoint: the worker's save_sync path) ...
asyncio.run(verl_trainer.VERLTrainer.save_checkpoint(trainer, block_until_saved=True))
report["checkpoint_committed"] = committed("latest_checkpointed_iteration.txt", 2)
shard = os.path.join(root, "global_step_2", "actor", "model_world_size_1_rank_0.pt")
before = os.stat(shard)
# ... and the same step again, as Trinity's train() does at its end: nothing changes.
asyncio.run(verl_trainer.VERLTrainer.save_checkpoint(trainer, block_until_saved=True))
after = os.stat(shard)
report["resave_left_the_shard"] = (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)
status = ray.get(monitor.status.remote())
report["committed_state_dict"] = status["latest"].get("state_dict")
report["save_strategy"] = status["save_strategy"]
address = status["metrics"]["address"]
report["metrics_port"] = (
    int(address[1]) if isinstance(address, (list, tuple)) else int(str(address).rsplit(":", 1)[1])
)
if os.environ.get("OBSCKPT_MIRROR"):  # the mirror's copy of the last step, then the end
    deadline = time.monotonic() + 60
    while (m := ray.get(monitor.status.remote())["mirror"])["committed"]["checkpoint"] != 2:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
ray.kill(monitor)
print(json.dumps(report))
"""
)


@pytest.fixture
def trinity_plugin_copy():
    """Trinity's loader copies each plugin it loads into its own ``trinity/plugins``
    directory (which it loads by default); the test removes the copy it caused."""
    trinity = pytest.importorskip(
        "trinity", reason="trinity-rft is not installed (make test-trinity)"
    )
    copy = Path(trinity.__file__).parent / "plugins" / "obsckpt_switch.py"
    existed = copy.exists()
    yield copy
    if not existed:
        copy.unlink(missing_ok=True)


def run_trinity_job(
    ray_cluster, script: str, *args: object, env: dict[str, str] | None = None, timeout: int = 300
) -> tuple[Any, str]:
    """``script`` (one of the jobs above) run as a process of Trinity's launcher on the
    session's cluster with obsckpt's plugin (``env``: more variables); the JSON of its
    last line of output, and the tail of its log for assertion messages."""
    out = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        env={
            **os.environ,
            "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address,
            "TRINITY_PLUGIN_DIRS": trinity_cli.with_obsckpt_plugin(None),
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr[-4000:]


TRINITY_CONFIG = """\
project: switch
name: run
mode: train
checkpoint_root_dir: {root}
trainer:
  save_strategy: single_node
synchronizer:
  sync_method: checkpoint
"""


def test_trinity_runs_obsckpt_through_its_plugin(
    ray_cluster, namespace, tmp_path, trinity_plugin_copy
):
    """From a Trinity config file and OBSCKPT_METRICS_PORT, as a user's job has them."""
    config = tmp_path / "trinity.yaml"
    config.write_text(TRINITY_CONFIG.format(root=tmp_path / "ckpt"))
    job_dir = tmp_path / "ckpt" / "switch" / "run"  # Trinity's <root>/<project>/<name>
    port = free_port()
    report, log = run_trinity_job(
        ray_cluster, JOB, config, namespace, free_port(), env={"OBSCKPT_METRICS_PORT": str(port)}
    )
    assert report == {
        "driver_synchronizer": True,
        "monitor_class": True,
        "coordinator_class": True,
        "hooked": True,
        "metrics_port_env": str(port),
        "coordinator": "obsckpt.coordinator",
        "state_dict_committed": True,
        "checkpoint_committed": True,
        "resave_left_the_shard": True,
        "committed_state_dict": 2,
        "save_strategy": "SINGLE_NODE",
        "metrics_port": port,
    }, log
    from obsckpt.store import reader

    for step in (1, 2):
        problems = reader.verify_step(job_dir / f"global_step_{step}")
        assert problems == [], problems
        listed = {r.path for r in reader.read_manifest(job_dir / f"global_step_{step}")}
        assert os.path.join("actor", "model.safetensors") in listed
    assert os.path.join("actor", "model_world_size_1_rank_0.pt") in listed  # step 2's full save


# Trinity's trainer resumed at step 2 and run on to step 4, under every save strategy:
# each run is a new monitor and a new worker process, as a resumed job has them.
RESUME_JOB = (
    JOB_PRELUDE
    + r"""
import copy
from trinity.common.constants import SaveStrategy
from obsckpt.store import reader

init_dir = sys.argv[3]
results = {}


def run(strategy, job_root, steps, workers):
    job_config = copy.deepcopy(config)
    job_config.checkpoint_job_dir = job_root
    job_config.trainer.save_strategy = SaveStrategy(strategy)
    monitor = verl_trainer.CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=job_config.trainer.save_strategy,
        default_local_dir=job_root,
        default_hdfs_dir=None,
    )
    worker = WorkerProcess.remote(namespace, f"file://{init_dir}/{strategy}-{workers}")
    trainer = trinity_trainer(job_config, monitor, worker)
    last = steps[-1]
    for step in steps:
        trainer.global_steps = step
        if step % 2 == 1:
            # Trinity's train(): a step that saves a checkpoint skips that step's
            # checkpoint sync, which then runs while the next batch is sampled.
            asyncio.run(verl_trainer.VERLTrainer.save_checkpoint(trainer))
            asyncio.run(verl_trainer.VERLTrainer.save_state_dict(trainer))
        else:
            asyncio.run(verl_trainer.VERLTrainer.save_state_dict(trainer))
            asyncio.run(verl_trainer.VERLTrainer.save_checkpoint(trainer, block_until_saved=step == last))
    # The end of train(): the last step saved again.
    asyncio.run(verl_trainer.VERLTrainer.save_checkpoint(trainer, block_until_saved=True))
    trainer.actor_rollout_wg.wait_on_save_thread()
    ok = committed("latest_checkpointed_iteration.txt", last, job_root)
    ok = ok and committed("latest_state_dict_iteration.txt", last, job_root)
    ray.kill(worker)
    ray.kill(monitor)
    return ok


for strategy in ("single_thread", "single_process", "single_node", "unrestricted"):
    job_root = os.path.join(root, strategy)
    first = run(strategy, job_root, [1, 2], 0)
    resumed = run(strategy, job_root, [3, 4], 1)  # resumed at step 2, on to step 4
    steps = sorted(reader.steps_on_disk(job_root))
    results[strategy] = {
        "committed": [first, resumed],
        "steps": steps,
        "problems": {s: reader.verify_step(os.path.join(job_root, f"global_step_{s}")) for s in steps},
    }
print(json.dumps(results))
"""
)


def test_trinity_resumed_and_continued_leaves_only_listed_files(
    ray_cluster, namespace, tmp_path, trinity_plugin_copy
):
    """Trinity's trainer saves a checkpoint at odd steps and syncs that step's state dict
    afterwards (its train() loop): the sync's streamed ``model.safetensors.tmp`` lands in
    a step already committed, and obsckpt skips that save. Every committed step still
    holds only the files its manifest lists, under every save strategy, across a resume."""
    config = tmp_path / "trinity.yaml"
    config.write_text(TRINITY_CONFIG.format(root=tmp_path / "ckpt"))
    init_dir = tmp_path / "init"
    init_dir.mkdir()
    results, log = run_trinity_job(
        ray_cluster, RESUME_JOB, config, namespace, init_dir, timeout=500
    )
    assert set(results) == {"single_thread", "single_process", "single_node", "unrestricted"}
    for strategy, result in results.items():
        assert result["committed"] == [True, True], (strategy, log)
        assert result["steps"] == [1, 2, 3, 4], strategy
        assert result["problems"] == {str(s): [] for s in (1, 2, 3, 4)}, (strategy, result)


# Trinity's trainer on a fresh machine: an empty job directory and the mirror of the
# first job's; Trinity's own _load_checkpoint then finds the mirror's step locally.
RESTORE_JOB = (
    JOB_PRELUDE
    + r"""
monitor = verl_trainer.CheckpointMonitor.get_actor(
    namespace=namespace,
    save_strategy=config.trainer.save_strategy,
    default_local_dir=config.checkpoint_job_dir,
    default_hdfs_dir=None,
)
loaded = []
config.continue_from_checkpoint = True
trainer = types.SimpleNamespace(
    global_config=config,
    logger=logging.getLogger("trainer"),
    use_critic=False,
    actor_rollout_wg=types.SimpleNamespace(
        load_checkpoint=lambda path, del_local_after_load: loaded.append(path)
    ),
)
verl_trainer.VERLTrainer._load_checkpoint(trainer)
status = ray.get(monitor.status.remote())
report["global_steps"] = trainer.global_steps
report["loaded"] = [os.path.relpath(p, root) for p in loaded]
report["restored"] = status["mirror"]["restored"]
ray.kill(monitor)
print(json.dumps(report))
"""
)


def test_trinity_keeps_its_checkpoints_on_s3_through_a_mirror(
    ray_cluster, namespace, tmp_path, trinity_plugin_copy, seaweed_server
):
    """OBSCKPT_MIRROR beside a local checkpoint_root_dir: every step Trinity's trainer
    commits is committed on S3 too, and a job started on an empty directory resumes
    from it through Trinity's own _load_checkpoint."""
    from seaweed import BUCKET

    from obsckpt.store.s3root import open_s3_root

    mirror = f"s3://{BUCKET}/trinity/{namespace}"
    first = tmp_path / "first.yaml"
    first.write_text(TRINITY_CONFIG.format(root=tmp_path / "ckpt"))
    report, _ = run_trinity_job(
        ray_cluster,
        JOB,
        first,
        namespace,
        free_port(),
        env={"OBSCKPT_MIRROR": mirror, "OBSCKPT_METRICS_PORT": str(free_port())},
    )
    assert report["checkpoint_committed"] is True
    store = open_s3_root(mirror)
    pointer = store.read_pointer()
    assert (pointer.checkpoint_step, pointer.state_dict_step) == (2, 2)
    assert store.verify_step(1) == [] and store.verify_step(2) == []
    listed = {r.path for r in store.manifest(2)}
    assert {"actor/model.safetensors", "actor/model_world_size_1_rank_0.pt"} <= listed

    second = tmp_path / "second.yaml"
    second.write_text(TRINITY_CONFIG.format(root=tmp_path / "fresh"))
    report, log = run_trinity_job(
        ray_cluster, RESTORE_JOB, second, f"{namespace}-fresh", env={"OBSCKPT_MIRROR": mirror}
    )
    assert report["restored"] == {"checkpoint": 2, "state_dict": 2}, log
    assert report["global_steps"] == 2
    assert report["loaded"] == [os.path.join("global_step_2", "actor")]
    from obsckpt.store import reader

    job_dir = tmp_path / "fresh" / "switch" / "run"
    assert reader.verify_step(job_dir / "global_step_2") == []
    shard = job_dir / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt"
    original_shard = tmp_path / "ckpt" / "switch" / "run" / "global_step_2" / "actor" / shard.name
    assert shard.read_bytes() == original_shard.read_bytes()
