"""Trinity-RFT's checkpoint calls, made as its trainer, workers and synchronizer make them.

The trainer creates the monitor with Trinity's own ``SaveStrategy`` enum and
registers one state-dict save per step; the workers (two FSDP2 ranks on gloo)
find the monitor with ``get_actor(namespace=...)`` alone and save through the
coordinator and ``fsdp_save_state_dict``; the synchronizer watches the
state-dict iteration file. Checkpoint-sync and a full save of one step, the
final save repeating the last step, and a resume behind the state-dict
iteration file are all accepted; the iteration files never go backwards and
no committed file changes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy, Synchronizer
from obsckpt.store import layout, reader
from obsckpt.sync.group import free_port


class TrinitySaveStrategy(str, enum.Enum):
    """The shape of Trinity-RFT's own ``trinity.common.constants.SaveStrategy``."""

    SINGLE_THREAD = "single_thread"
    SINGLE_PROCESS = "single_process"
    SINGLE_NODE = "single_node"
    UNRESTRICTED = "unrestricted"


class NamedOnly(enum.Enum):
    """A foreign enum whose names, not values, name the strategies."""

    SINGLE_NODE = 1
    FAST = 2


class TestStrategyNames:
    """Any enum or string naming a strategy is accepted; anything else is named in the error."""

    @pytest.mark.parametrize(
        "value,expected",
        [
            (TrinitySaveStrategy.UNRESTRICTED, SaveStrategy.UNRESTRICTED),
            (TrinitySaveStrategy.SINGLE_THREAD, SaveStrategy.SINGLE_THREAD),
            (NamedOnly.SINGLE_NODE, SaveStrategy.SINGLE_NODE),
            ("SINGLE_PROCESS", SaveStrategy.SINGLE_PROCESS),
            ("single_process", SaveStrategy.SINGLE_PROCESS),
            (SaveStrategy.SINGLE_NODE, SaveStrategy.SINGLE_NODE),
        ],
        ids=repr,
    )
    def test_accepted(self, value, expected):
        assert SaveStrategy.parse(value) is expected

    def test_foreign_member_naming_nothing(self):
        with pytest.raises(ValueError, match=r"save_strategy must be one of .*NamedOnly.FAST"):
            SaveStrategy.parse(NamedOnly.FAST)


class TestMonitorLookup:
    """Workers find the trainer's monitor by namespace alone."""

    def test_no_monitor_running_is_a_clear_error(self, namespace):
        with pytest.raises(
            ValueError, match=f"no checkpoint_monitor actor runs in namespace '{namespace}'"
        ):
            CheckpointMonitor.get_actor(namespace=namespace)

    def test_finds_the_running_monitor(self, namespace, tmp_path):
        created = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=TrinitySaveStrategy.UNRESTRICTED,
            default_local_dir=str(tmp_path / "ckpt"),
            default_hdfs_dir=None,
            metrics_port=None,
        )
        found = CheckpointMonitor.get_actor(namespace=namespace)
        assert found._actor_id == created._actor_id
        assert ray.get(found.status.remote())["root"] == str(tmp_path / "ckpt")

    def test_hdfs_dir_is_refused_by_name(self, namespace, tmp_path):
        with pytest.raises(ValueError, match=r"default_hdfs_dir='hdfs://nn/ckpt' is not supported"):
            CheckpointMonitor.get_actor(
                namespace=namespace,
                default_local_dir=str(tmp_path / "ckpt"),
                default_hdfs_dir="hdfs://nn/ckpt",
            )
        with pytest.raises(ValueError, match="default_hdfs_dir"):
            CheckpointMonitor(
                default_local_dir=tmp_path / "ckpt", default_hdfs_dir="s3://b", metrics_port=None
            )


# ---------------------------------------------------------------------------
# The replay
# ---------------------------------------------------------------------------


class Engine:
    """The slice of verl's FSDPEngine the helpers use."""

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        self.module = module
        self.rank = rank


@ray.remote
class Worker:
    """One rank of Trinity's actor worker: saves as its save_state_dict / save_checkpoint do."""

    def __init__(self, rank: int, world_size: int, port: int) -> None:
        from workers import cpu_fsdp_group

        torch.set_num_threads(1)
        self.mesh = cpu_fsdp_group(rank, world_size, port)
        self.rank, self.world = rank, world_size
        self.coordinator = None
        self.log = logging.getLogger(f"worker{rank}")

    def reset(self, namespace: str) -> None:
        """A new job on this process (the tests share the workers): the seeded model, and
        no coordinator until the job's first save (the previous job's is closed)."""
        from torch.distributed.fsdp import fully_shard

        if self.coordinator is not None:
            self.coordinator.close(timeout=60)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5))
        for layer in model:
            fully_shard(layer, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self.engine = Engine(model, self.rank)
        self.namespace = namespace
        self.coordinator = None
        self.previous_state_dict_step: int | None = None

    def _get_coordinator(self) -> CheckpointCoordinator:
        if self.coordinator is None:
            # As Trinity's worker: the namespace only; the trainer created the monitor.
            monitor = CheckpointMonitor.get_actor(namespace=self.namespace)
            self.coordinator = CheckpointCoordinator(monitor)
        return self.coordinator

    def train_step(self, step: int) -> None:
        with torch.no_grad():
            for p in self.engine.module.parameters():
                p.to_local().add_(0.5 * step + self.rank)

    def full(self) -> dict[str, torch.Tensor]:
        return {n: t.full_tensor().clone() for n, t in self.engine.module.state_dict().items()}

    def save_state_dict(self, local_path: str, global_step: int, gate: str | None = None) -> int:
        import time

        from obsckpt.integrations import fsdp_save_state_dict

        if gate is not None:  # a rank that starts late: only once the test creates ``gate``
            deadline = time.monotonic() + 60
            while not os.path.exists(gate):
                assert time.monotonic() < deadline, f"{gate} never appeared"
                time.sleep(0.02)
        self.previous_state_dict_step = global_step
        return fsdp_save_state_dict(
            self.engine, local_path, global_step, self._get_coordinator(), self.log
        )

    def save_checkpoint(self, local_path: str, global_step: int) -> None:
        """Rank 0 saves through ``save_sync(..., is_state_dict=True)``, the others directly.

        As Trinity's FSDP checkpoint manager, the model is not written again when
        checkpoint sync already saved this step's state dict.
        """
        import torch.distributed as dist

        def save() -> None:
            os.makedirs(local_path, exist_ok=True)
            if self.previous_state_dict_step != global_step:
                sd = self.engine.module.state_dict()
                torch.save(sd, os.path.join(local_path, f"model_world_size_2_rank_{self.rank}.pt"))
            torch.save(
                {"step": global_step}, os.path.join(local_path, f"optim_rank_{self.rank}.pt")
            )
            dist.barrier()

        if self.rank == 0:
            self._get_coordinator().save_sync(save, global_step, is_state_dict=True)
        else:
            save()

    def upload_state_dict(self, synchronizer, global_step: int) -> None:
        from obsckpt.integrations import fsdp_upload_state_dict

        class _E:
            module = self.engine.module

            def get_per_tensor_param(_self):
                return ((n, t.full_tensor()) for n, t in self.engine.module.state_dict().items())

        fsdp_upload_state_dict(_E(), synchronizer, global_step, self.log)

    def forget_monitor(self) -> None:
        self.coordinator = None

    def wait_on_save_thread(self) -> None:
        if self.coordinator is not None:
            self.coordinator.wait_all(timeout=120)


class Trainer:
    """Trinity's trainer side: register_and_monitor after dispatching each save to the workers."""

    def __init__(self, namespace: str, root: Path, workers: list) -> None:
        self.root = root
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=TrinitySaveStrategy.UNRESTRICTED,
            default_local_dir=str(root),
            default_hdfs_dir=None,
            metrics_port=None,
        )
        self.monitor = monitor
        self.coordinator = CheckpointCoordinator(monitor)
        self.workers = workers
        self.global_steps = 0

    def actor_path(self, step: int) -> str:
        return str(self.root / f"global_step_{step}" / "actor")

    def train_step(self) -> None:
        self.global_steps += 1
        ray.get([w.train_step.remote(self.global_steps) for w in self.workers])

    async def save_state_dict(self) -> list[int]:
        step = self.global_steps
        counts = ray.get(
            [w.save_state_dict.remote(self.actor_path(step), step) for w in self.workers]
        )
        await self.coordinator.register_and_monitor(
            step, is_state_dict=True, state_dict_thread_count=1
        )
        return counts

    async def save_checkpoint(self, block_until_saved: bool = False) -> None:
        step = self.global_steps
        folder = self.root / f"global_step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".full_checkpoint").write_text("")
        ray.get([w.save_checkpoint.remote(self.actor_path(step), step) for w in self.workers])
        await self.coordinator.register_and_monitor(step, state_dict_thread_count=1)
        if block_until_saved:
            ray.get([w.wait_on_save_thread.remote() for w in self.workers])


def wait_until(predicate, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def workers(shared_actors, namespace):
    """Two ranks of Trinity's actor worker, shared by this module's jobs, started over."""
    port = free_port()
    made = shared_actors("workers", lambda: [Worker.remote(r, 2, port) for r in range(2)])
    ray.get([w.reset.remote(namespace) for w in made], timeout=120)
    return made


def test_trinity_call_sequence_with_resave_final_save_and_resume(namespace, tmp_path, workers):
    root = tmp_path / "ckpt"
    trainer = Trainer(namespace, root, workers)
    sync = Synchronizer.get_actor(
        namespace=namespace, default_local_dir=str(root), poll_interval_s=0.05
    )

    async def run_one() -> None:
        # Steps 1-4: checkpoint sync every step, a full save every 2 steps (after the sync,
        # so the full save re-saves a committed state dict), then train()'s final save.
        for _ in range(4):
            trainer.train_step()
            assert await trainer.save_state_dict() == [1, 0]  # one report per step
            step = trainer.global_steps
            wait_until(lambda s=step: reader.read_iteration(root, "state_dict") == s)
            if step % 2 == 0:
                await trainer.save_checkpoint()
                wait_until(lambda s=step: reader.read_iteration(root, "checkpoint") == s)
        await trainer.save_checkpoint(block_until_saved=True)  # repeats step 4

    asyncio.run(run_one())
    assert reader.read_iteration(root, "checkpoint") == 4
    assert reader.read_iteration(root, "state_dict") == 4
    assert ray.get(sync.wait_new_model_state_dict.remote(3, timeout=60)) == 4
    expected_4 = ray.get([w.full.remote() for w in workers])[0]
    got, version = ray.get(sync.get_model_state_dict.remote())
    assert version == 4 and all(torch.equal(got[k], v) for k, v in expected_4.items())
    status = ray.get(trainer.monitor.status.remote())
    assert status["failed"] == [] and status["pending"] == [] and status["resaves"] > 0

    # Steps 5 and 6 are checkpoint-synced, then the job stops before the next full save.
    async def run_on() -> None:
        for _ in range(2):
            trainer.train_step()
            await trainer.save_state_dict()
        wait_until(lambda: reader.read_iteration(root, "state_dict") == 6)

    asyncio.run(run_on())
    assert ray.get(sync.wait_new_model_state_dict.remote(5, timeout=60)) == 6
    committed_6 = file_bytes(root / "global_step_6" / "actor")
    ray.kill(trainer.monitor, no_restart=True)

    # The resumed job: a new monitor, the step from latest_checkpointed_iteration.txt,
    # the synchronizer told (as Trinity's first sync does) that the trainer is at step 4.
    resumed = Trainer(namespace, root, workers)
    resumed.global_steps = reader.read_iteration(root, "checkpoint")
    assert resumed.global_steps == 4
    assert ray.get(sync.set_model_state_dict.remote(None, resumed.global_steps))
    assert ray.get(sync.get_version.remote()) == 4  # versions restart at the resumed step

    async def resume() -> None:
        for step in (5, 6):
            resumed.train_step()
            # Behind the state-dict iteration file (6): not saved again, not an error.
            assert await resumed.save_state_dict() == [0, 0]
            ray.get([w.upload_state_dict.remote(sync, step) for w in workers])
            assert ray.get(sync.get_version.remote()) == step
        resumed.train_step()
        assert await resumed.save_state_dict() == [1, 0]
        await resumed.save_checkpoint(block_until_saved=True)

    # Fresh workers' coordinators: the old monitor is gone.
    ray.get([w.forget_monitor.remote() for w in workers])
    asyncio.run(resume())
    wait_until(lambda: reader.read_iteration(root, "checkpoint") == 7)
    assert reader.read_iteration(root, "state_dict") == 7
    assert file_bytes(root / "global_step_6" / "actor") == committed_6  # nothing committed lost
    assert ray.get(sync.wait_new_model_state_dict.remote(6, timeout=60)) == 7
    expected_7 = ray.get([w.full.remote() for w in workers])[0]
    got, version = ray.get(sync.get_model_state_dict.remote())
    assert version == 7 and all(torch.equal(got[k], v) for k, v in expected_7.items())
    status = ray.get(resumed.monitor.status.remote())
    assert status["failed"] == [] and status["pending"] == []
    assert status["latest"] == {"checkpoint": 7, "state_dict": 7}


def test_late_rank_neither_errors_nor_commits_a_partial_step(namespace, tmp_path, workers):
    """The trainer registers and submits while rank 1 has not even started its save.

    Rank 0's shard is written and reported first; the step stays open until
    rank 1's part is durable too, and then every shard is in the manifest.
    """
    root = tmp_path / "ckpt"
    trainer = Trainer(namespace, root, workers)
    path = trainer.actor_path(1)
    gate = tmp_path / "rank1_may_start"
    refs = [
        workers[0].save_state_dict.remote(path, 1),
        workers[1].save_state_dict.remote(path, 1, gate=str(gate)),
    ]
    asyncio.run(
        trainer.coordinator.register_and_monitor(1, is_state_dict=True, state_dict_thread_count=1)
    )
    # Rank 0's part is written and reported (its report returns after the monitor
    # has acted on it): the registered count of one is met by number, yet the
    # save is not whole, so nothing is committed.
    assert ray.get(refs[0]) == 1
    ray.get(workers[0].wait_on_save_thread.remote())
    late_shard = Path(path) / "model_world_size_2_rank_1.pt"
    assert not late_shard.exists()
    assert reader.read_iteration(root, "state_dict") is None
    [pending] = ray.get(trainer.monitor.status.remote())["pending"]
    assert pending["step"] == 1 and pending["open_parts"] == {
        "model_state_dict": {"parts": 2, "finished": [0], "running": 0}
    }
    gate.touch()
    assert ray.get(refs[1]) == 0
    # The pointer is swapped before the monitor closes the step's record, so
    # wait on both: the pointer, then the record leaving "committing".
    wait_until(lambda: reader.read_iteration(root, "state_dict") == 1)
    wait_until(lambda: ray.get(trainer.monitor.status.remote())["pending"] == [])
    assert late_shard.is_file()
    status = ray.get(trainer.monitor.status.remote())
    assert status["failed"] == [] and status["pending"] == []
    # Every rank's shard is in the step's manifest, with its checksum.
    step_dir = layout.step_dir(root, 1)
    manifest = reader.read_manifest(step_dir)
    assert sorted(r.path for r in manifest if "/model_world_size_" in r.path) == [
        f"actor/model_world_size_2_rank_{rank}.pt" for rank in range(2)
    ]
    assert reader.verify_step(step_dir) == []
    from obsckpt.sync.shards import load_sharded_state_dict

    merged = load_sharded_state_dict(path, manifest_dir=step_dir)
    expected = ray.get([w.full.remote() for w in workers])[0]
    assert all(torch.equal(merged[k], v) for k, v in expected.items())


class TestMegatronReportsOnce:
    """megatron_save_state_dict: every rank reports a part of one save; a committed step is
    not re-saved."""

    def test_ranks_and_resave(self, namespace, tmp_path):
        from test_verl_megatron import FakeMcoreEngine

        from obsckpt.integrations import megatron_save_state_dict

        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=TrinitySaveStrategy.SINGLE_NODE,
            default_local_dir=str(root),
            metrics_port=None,
        )
        coord = CheckpointCoordinator(CheckpointMonitor.get_actor(namespace=namespace))
        path = str(root / "global_step_2" / "actor")
        # Every rank saves and reports its part; the step waits for both parts, and the
        # helper's return values (0 on rank 1, 1 on rank 0) sum to the one registration.
        assert megatron_save_state_dict(FakeMcoreEngine(rank=1, world_size=2), path, 2, coord) == 0
        asyncio.run(coord.register_and_monitor(2, is_state_dict=True, state_dict_thread_count=1))
        [pending] = ray.get(monitor.status.remote())["pending"]
        assert pending["open_parts"]["megatron_state_dict"]["finished"] == [1]
        assert reader.read_iteration(root, "state_dict") is None
        assert megatron_save_state_dict(FakeMcoreEngine(rank=0, world_size=2), path, 2, coord) == 1
        wait_until(lambda: reader.read_iteration(root, "state_dict") == 2)
        before = file_bytes(Path(path))
        assert sorted(before) == ["model_0.pt", "model_1.pt"]

        # Checkpoint sync of the committed step again: nothing written, nothing counted.
        other = FakeMcoreEngine(rank=0, world_size=2)
        with torch.no_grad():
            for p in other.module.parameters():
                p.add_(1.0)
        assert megatron_save_state_dict(other, path, 2, coord, None) == 0
        assert other.checkpoint_mananager.calls == []
        asyncio.run(coord.register_and_monitor(2, is_state_dict=True, state_dict_thread_count=1))
        assert file_bytes(Path(path)) == before
        status = ray.get(monitor.status.remote())
        assert status["pending"] == [] and status["failed"] == []
        assert status["latest"]["state_dict"] == 2 and status["resaves"] >= 2


# ---------------------------------------------------------------------------
# Name by name: Trinity-RFT's signatures, and its call sequences as written
# ---------------------------------------------------------------------------


def _positional(fn) -> list[tuple[str, object]]:
    """(name, default) of the parameters a caller may pass by position, ``self`` excluded."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [
        (p.name, p.default)
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


def _new_params_are_optional(fn, trinity: list[str]) -> list[str]:
    """Parameters beyond Trinity's that a Trinity call would leave out but must pass."""
    import inspect

    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.name not in trinity
        and p.name not in ("self", "cls")
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.default is inspect.Parameter.empty
    ]


_EMPTY = object()  # "no default" in the tables below


def _signature_cases():
    from obsckpt.integrations import verl_fsdp, verl_megatron

    c, m = CheckpointCoordinator, CheckpointMonitor
    return {
        "CheckpointCoordinator": (c.__init__, [("checkpoint_monitor", _EMPTY)]),
        "save_async": (
            c.save_async,
            [
                ("name", _EMPTY),
                ("save_fn", _EMPTY),
                ("global_step", _EMPTY),
                ("is_state_dict", False),
            ],
        ),
        "save_sync": (
            c.save_sync,
            [("save_fn", _EMPTY), ("global_step", _EMPTY), ("is_state_dict", False)],
        ),
        "wait_all": (c.wait_all, [("timeout", None)]),
        "register_and_monitor": (
            c.register_and_monitor,
            [
                ("global_step", _EMPTY),
                ("is_state_dict", False),
                ("state_dict_thread_count", 0),
                ("checkpoint_thread_count", 0),
            ],
        ),
        "monitor_step": (m.monitor_step, [("step", _EMPTY), ("is_state_dict", False)]),
        "notify_finished": (m.notify_finished, [("step", _EMPTY), ("is_state_dict", False)]),
        "register_thread_count": (m.register_thread_count, [("step", _EMPTY)]),
        "fsdp_save_state_dict": (
            verl_fsdp.fsdp_save_state_dict,
            [
                ("engine", _EMPTY),
                ("local_path", _EMPTY),
                ("global_step", _EMPTY),
                ("coordinator", _EMPTY),
                ("logger", None),
            ],
        ),
        "fsdp_upload_state_dict": (
            verl_fsdp.fsdp_upload_state_dict,
            [
                ("engine", _EMPTY),
                ("synchronizer", _EMPTY),
                ("global_step", _EMPTY),
                ("logger", None),
            ],
        ),
        "fsdp_sync_weight_nccl": (
            verl_fsdp.fsdp_sync_weight_nccl,
            [("engine", _EMPTY), ("model_update_group", _EMPTY)],
        ),
        "megatron_save_state_dict": (
            verl_megatron.megatron_save_state_dict,
            [
                ("engine", _EMPTY),
                ("local_path", _EMPTY),
                ("global_step", _EMPTY),
                ("coordinator", _EMPTY),
                ("logger", None),
            ],
        ),
        "megatron_upload_state_dict": (
            verl_megatron.megatron_upload_state_dict,
            [
                ("engine", _EMPTY),
                ("synchronizer", _EMPTY),
                ("global_step", _EMPTY),
                ("logger", None),
            ],
        ),
        "megatron_sync_weight_nccl": (
            verl_megatron.megatron_sync_weight_nccl,
            [("engine", _EMPTY), ("model_update_group", _EMPTY)],
        ),
    }


class TestTrinitySignatures:
    """Every Trinity-RFT call keeps its positions, names and defaults; additions are optional.

    A Trinity caller's positional and keyword arguments land where they land in
    Trinity (only an optional trailing parameter may be added: ``wait_all``'s
    ``timeout``, the helpers' ``logger`` default), and no new parameter is
    required.
    """

    @pytest.mark.parametrize("name", sorted(_signature_cases()))
    def test_positions_names_defaults(self, name):
        import inspect

        fn, trinity = _signature_cases()[name]
        got = [(n, _EMPTY if d is inspect.Parameter.empty else d) for n, d in _positional(fn)]
        assert got == trinity
        assert _new_params_are_optional(fn, [n for n, _ in trinity]) == []

    def test_register_thread_count_counts_are_keywords_defaulting_to_zero(self):
        import inspect

        params = inspect.signature(CheckpointMonitor.register_thread_count).parameters
        for count in ("state_dict_thread_count", "checkpoint_thread_count"):
            assert params[count].kind is inspect.Parameter.KEYWORD_ONLY
            assert params[count].default == 0

    def test_notify_started_takes_node_and_job_by_keyword(self):
        params = _positional(CheckpointMonitor.notify_started)
        assert [n for n, _ in params] == ["node_id", "job_id"]

    def test_register_and_monitor_is_a_coroutine_function(self):
        import inspect

        assert inspect.iscoroutinefunction(CheckpointCoordinator.register_and_monitor)

    def test_monitor_get_actor_keeps_trinitys_order(self):
        names = [n for n, _ in _positional(CheckpointMonitor.get_actor)]
        assert names[:4] == ["namespace", "save_strategy", "default_local_dir", "default_hdfs_dir"]

    def test_synchronizer_calls(self):
        from obsckpt.sync.synchronizer import Synchronizer as SynchronizerClass

        assert [n for n, _ in _positional(SynchronizerClass.set_model_state_dict)] == [
            "model_state_dict",
            "trainer_step",
        ]
        assert _positional(SynchronizerClass.get_model_state_dict) == []
        assert _positional(SynchronizerClass.wait_new_model_state_dict)[0][0] == "current_version"


class TestTrinityTrainerInThreads:
    """A trainer saving state dicts and checkpoints in threads, then registering and
    submitting the step, all with positional arguments as Trinity's pages show them,
    under Trinity's own SINGLE_THREAD strategy: every call returns None (``save_sync``
    True), and both iteration files name the step."""

    def test_positional_sequence_commits(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace, TrinitySaveStrategy.SINGLE_THREAD, str(root), None, metrics_port=None
        )
        coordinator = CheckpointCoordinator(monitor)
        actor = root / "global_step_1" / "actor"
        actor.mkdir(parents=True)
        sd = {"w": torch.arange(4.0)}
        assert (
            coordinator.save_async("model", lambda: torch.save(sd, actor / "m.pt"), 1, True) is None
        )
        assert coordinator.save_async("optim", lambda: torch.save(sd, actor / "o.pt"), 1) is None
        assert coordinator.save_sync(lambda: torch.save(sd, actor / "e.pt"), 1, False) is True
        assert coordinator.wait_all() is None
        assert asyncio.run(coordinator.register_and_monitor(1, False, 1, 2)) is None
        wait_until(lambda: reader.read_iteration(root, "checkpoint") == 1)
        assert reader.read_iteration(root, "state_dict") == 1
        assert torch.equal(torch.load(actor / "m.pt")["w"], sd["w"])
        # The pointer is swapped before the monitor closes the step's record.
        wait_until(lambda: ray.get(monitor.status.remote())["pending"] == [])
        assert ray.get(monitor.status.remote())["failed"] == []


class TestTrinityRawMonitorCalls:
    """The monitor RPCs exactly as Trinity's FSDP checkpoint manager makes them
    (``notify_started(node_id=, job_id=)``, ``notify_finished(step, True)`` and
    ``notify_finished(step)``, ``register_thread_count`` after the saves) commit
    the step; under SINGLE_THREAD a Trinity finish releases the admission."""

    def test_manager_call_shape(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=TrinitySaveStrategy.SINGLE_THREAD,
            default_local_dir=str(root),
            default_hdfs_dir=None,
            metrics_port=None,
        )
        ctx = ray.get_runtime_context()
        ids = {"node_id": ctx.get_node_id(), "job_id": ctx.get_job_id()}
        (root / "global_step_2").mkdir()
        ray.get(monitor.notify_started.remote(**ids), timeout=30)
        second = monitor.notify_started.remote(**ids)
        assert ray.wait([second], timeout=0.3)[0] == []  # one save at a time
        (root / "global_step_2" / "model.pt").write_bytes(b"m")
        assert ray.get(monitor.notify_finished.remote(2, True)) is None
        ray.get(second, timeout=30)
        (root / "global_step_2" / "optim.pt").write_bytes(b"o")
        ray.get(monitor.notify_finished.remote(2))
        ray.get(monitor.register_thread_count.remote(2, state_dict_thread_count=1))
        ray.get(monitor.register_thread_count.remote(2, checkpoint_thread_count=1))
        assert ray.get(monitor.monitor_step.remote(2, is_state_dict=False)) is None
        wait_until(lambda: reader.read_iteration(root, "checkpoint") == 2)
        assert reader.read_iteration(root, "state_dict") == 2
        # An older step submitted later is a no-op: the iteration file never goes back.
        ray.get(monitor.monitor_step.remote(1, True))
        assert reader.read_iteration(root, "state_dict") == 2


class TestDocumentedDifferences:
    """What a Trinity caller sees where obsckpt differs on purpose (docs/design.md)."""

    @pytest.fixture
    def job(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None
        )
        return root, monitor, CheckpointCoordinator(monitor)

    def test_wait_all_raises_a_background_failure_once(self, job):
        from obsckpt import SaveError

        root, _, coordinator = job

        def full_disk() -> None:
            raise OSError(28, "No space left on device")

        coordinator.save_async("model", full_disk, 3, True)
        with pytest.raises(SaveError, match="'model' of step 3") as caught:
            coordinator.wait_all()
        assert isinstance(caught.value, RuntimeError)
        assert isinstance(caught.value.__cause__, OSError) and caught.value.step == 3
        assert coordinator.wait_all() is None  # raised once

    def test_save_sync_raises_what_save_fn_raised(self, job):
        _, monitor, coordinator = job

        def full_disk() -> None:
            raise OSError(28, "No space left on device")

        with pytest.raises(OSError, match="No space left"):
            coordinator.save_sync(full_disk, 4)
        wait_until(lambda: ray.get(monitor.status.remote())["failed"] != [])

    @pytest.mark.parametrize("name", ["hf model", "actor/model", ""])
    def test_slot_names_must_be_file_name_safe(self, job, name):
        *_, coordinator = job
        with pytest.raises(ValueError, match="slot name"):
            coordinator.save_async(name, lambda: None, 1)

    @pytest.mark.parametrize("step", [5.0, -1, True])
    def test_steps_must_be_integers(self, job, step):
        *_, coordinator = job
        with pytest.raises(ValueError, match="global_step must be a non-negative integer"):
            coordinator.save_async("model", lambda: None, step)
        with pytest.raises(ValueError, match="global_step must be a non-negative integer"):
            asyncio.run(coordinator.register_and_monitor(step, True))
        assert coordinator.save_async("model", lambda: None, int(abs(step)), True) is None
        coordinator.wait_all()

    def test_a_numpy_integer_step_is_a_step(self, job):
        """As the hosts accept it (a step read from a dataloader or an array)."""
        *_, coordinator = job
        assert coordinator.save_async("model", lambda: None, np.int64(5), True) is None
        coordinator.wait_all()

    def test_submitting_a_step_with_no_saves_and_no_directory_commits_nothing(self, job):
        root, monitor, coordinator = job
        asyncio.run(coordinator.register_and_monitor(6, True))
        wait_until(lambda: ray.get(monitor.status.remote())["failed"] != [])
        [failed] = ray.get(monitor.status.remote())["failed"]
        assert failed["step"] == 6 and "no saves and has no directory" in failed["error"]
        assert reader.read_iteration(root, "state_dict") is None
        # With its directory on disk the same call commits it.
        (root / "global_step_7").mkdir()
        asyncio.run(coordinator.register_and_monitor(7, True))
        wait_until(lambda: reader.read_iteration(root, "state_dict") == 7)

    def test_notify_started_returns_a_dict(self, job):
        _, monitor, _ = job
        answer = ray.get(monitor.notify_started.remote(node_id="n", job_id="j"))
        assert isinstance(answer, dict) and "ticket" in answer
        ray.get(monitor.notify_finished.remote(8, True))


class TestTrinitySynchronizerCalls:
    """The synchronizer's set/wait/get calls in Trinity's shapes: ``get_actor(config)``,
    ``set_model_state_dict(None, step)`` first, ``wait_new_model_state_dict(version)``
    and its positional ``no_wait``, ``get_model_state_dict()`` as ``(state_dict, version)``."""

    def test_memory_sync_shapes(self, namespace):
        import types

        sync = Synchronizer.get_actor(types.SimpleNamespace(ray_namespace=namespace))
        assert Synchronizer.get_actor(namespace=namespace)._actor_id == sync._actor_id
        ray.get(sync.set_model_state_dict.remote(None, 0))
        assert ray.get(sync.get_model_state_dict.remote()) == (None, 0)
        assert ray.get(sync.wait_new_model_state_dict.remote(0, True)) == 0  # no_wait
        waiting = sync.wait_new_model_state_dict.remote(0)
        assert ray.wait([waiting], timeout=0.3)[0] == []
        sd = {"w": torch.ones(3)}
        ray.get(sync.set_model_state_dict.remote(sd, 1))
        assert ray.get(waiting, timeout=30) == 1
        assert ray.get(sync.wait_new_model_state_dict.remote(1, no_wait=True)) == 1
        got, version = ray.get(sync.get_model_state_dict.remote())
        assert version == 1 and torch.equal(got["w"], sd["w"])
        ray.kill(sync)
