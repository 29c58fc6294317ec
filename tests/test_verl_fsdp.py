"""FSDP2 on gloo, two trainer ranks and a rollout actor: every weight-sync path is bit-exact."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from metrics_helpers import scrape

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy, Synchronizer
from obsckpt.store import commit, layout, reader
from obsckpt.sync.group import free_port


def build_model() -> torch.nn.Module:
    """Odd sizes (uneven shards) and mixed dtypes: float32, bfloat16, and an int64 buffer."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 6),
        torch.nn.Linear(6, 7),
        torch.nn.Linear(7, 5, bias=False).to(torch.bfloat16),
    )
    model.register_buffer("position_ids", torch.arange(9, dtype=torch.int64))
    return model


class Engine:
    """The slice of verl's FSDPEngine the helpers use: ``module`` and ``get_per_tensor_param``."""

    def __init__(self, module: torch.nn.Module, rank: int) -> None:
        self.module = module
        self.rank = rank

    def get_per_tensor_param(self):
        from torch.distributed.tensor import DTensor

        params = self.module.state_dict()
        gen = ((n, t.full_tensor() if isinstance(t, DTensor) else t) for n, t in params.items())
        return gen, None  # verl 0.9's shape: (iterator, peft_config)


@ray.remote
class TrainerRank:
    """One FSDP2 rank (gloo) with a coordinator reporting to the job's monitor."""

    def __init__(self, namespace: str, rank: int, world_size: int, port: int) -> None:
        from torch.distributed.fsdp import fully_shard
        from workers import cpu_fsdp_group

        from obsckpt.telemetry import tracing

        tracing.setup_tracing("trainer", exporter="memory")
        torch.set_num_threads(1)
        # No GPU from Ray: CPU, gloo and a CPU mesh, even on a machine with CUDA.
        mesh = cpu_fsdp_group(rank, world_size, port)
        model = build_model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.engine = Engine(model, rank)
        self.rank = rank
        self.monitor = ray.get_actor("checkpoint_monitor", namespace=namespace)
        self.synchronizer = ray.get_actor("synchronizer", namespace=namespace)
        self.coordinator = CheckpointCoordinator(self.monitor, rank=rank)
        self.group = None
        self.log = logging.getLogger(f"trainer{rank}")

    def train_step(self, step: int) -> None:
        """Change every local shard deterministically (stands in for an optimizer step)."""
        with torch.no_grad():
            for p in self.engine.module.parameters():
                local = p.to_local()
                local.add_(torch.full_like(local, 0.25 * step + self.rank))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        gen, _ = self.engine.get_per_tensor_param()
        return {n: t.detach().clone() for n, t in gen}

    def save_state_dict(self, root: str, step: int) -> int:
        from obsckpt.integrations import fsdp_save_state_dict

        path = str(layout.model_dir(root, step))
        n = fsdp_save_state_dict(self.engine, path, step, self.coordinator, self.log)
        self.train_step(step)  # the snapshot must not see this
        self.coordinator.wait_all(timeout=120)
        return n

    def upload(self, step: int) -> float | None:
        from obsckpt.integrations import fsdp_upload_state_dict

        return fsdp_upload_state_dict(self.engine, self.synchronizer, step, self.log)

    def join_group(self, port: int) -> None:
        from obsckpt.sync.group import WeightSyncGroup

        if self.rank == 0:
            self.group = WeightSyncGroup(
                host="127.0.0.1", port=port, rank=0, world_size=2, backend="gloo", timeout_s=60
            )

    def broadcast(self, step: int) -> int | None:
        from obsckpt.integrations import fsdp_sync_weight_nccl

        result = fsdp_sync_weight_nccl(
            self.engine, self.group, step=step, monitor=self.monitor if self.rank == 0 else None
        )
        return None if result is None else result.nbytes

    def spans(self) -> list[tuple[str, dict]]:
        from obsckpt.telemetry import tracing

        return [(s["name"], s["attributes"]) for s in tracing.finished_spans()]


@ray.remote
class Rollout:
    """The rollout side: receives broadcasts into its own weights."""

    def __init__(self, port: int) -> None:
        from obsckpt.sync.broadcast import WeightBroadcaster
        from obsckpt.sync.group import WeightSyncGroup
        from obsckpt.telemetry import tracing

        tracing.setup_tracing("rollout", exporter="memory")
        torch.set_num_threads(1)
        self.port = port
        self.weights = {k: torch.zeros_like(v) for k, v in build_model().state_dict().items()}
        self._make = lambda: WeightBroadcaster(
            WeightSyncGroup(
                host="127.0.0.1", port=port, rank=1, world_size=2, backend="gloo", timeout_s=60
            )
        )
        self.receiver = None

    def join_group(self) -> None:
        self.receiver = self._make()

    def receive(self) -> dict[str, torch.Tensor]:
        out = self.receiver.recv(into=self.weights)
        return {k: v.clone() for k, v in out.items()}

    def spans(self) -> list[tuple[str, dict]]:
        from obsckpt.telemetry import tracing

        return [(s["name"], s["attributes"]) for s in tracing.finished_spans()]


def full_state_dict(trainers) -> dict[str, torch.Tensor]:
    """The trainer's full parameters (gathering is a collective: every rank takes part)."""
    return ray.get([t.full_state_dict.remote() for t in trainers])[0]


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names that differ in dtype, shape or bits (empty when identical)."""
    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(k)
        elif not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(k)
    return bad


PORTS: dict[str, int] = {}


@pytest.fixture
def job(namespace, tmp_path):
    PORTS.update(trainer=free_port(), weight_sync=free_port())
    root = tmp_path / "ckpt"
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=SaveStrategy.UNRESTRICTED,
        default_local_dir=str(root),
        metrics_port=0,
        metrics_host="127.0.0.1",
    )
    sync = Synchronizer.get_actor(
        namespace=namespace,
        default_local_dir=str(root),
        poll_interval_s=0.1,
        trace_exporter="memory",
    )
    trainers = [TrainerRank.remote(namespace, r, 2, PORTS["trainer"]) for r in range(2)]
    rollout = Rollout.remote(PORTS["weight_sync"])
    return root, monitor, sync, trainers, rollout


def test_fsdp2_checkpoint_memory_and_broadcast_sync(job):
    """After each path the rollout side holds exactly the trainer's full parameters."""
    root, monitor, sync, trainers, rollout = job

    # Checkpoint sync: shards saved in the background, committed by the monitor,
    # merged by the synchronizer. The weights change right after the snapshot.
    expected_1 = full_state_dict(trainers)
    # Every rank's shard is a part of one save: 1 on rank 0 and 0 elsewhere, summing to
    # the one state-dict save per step that Trinity-RFT registers.
    assert ray.get([t.save_state_dict.remote(str(root), 1) for t in trainers]) == [1, 0]
    coord = CheckpointCoordinator(monitor)
    asyncio.run(coord.register_and_monitor(1, is_state_dict=True, state_dict_thread_count=1))
    assert ray.get(sync.wait_new_model_state_dict.remote(None, timeout=60)) == 1
    got, version = ray.get(sync.get_model_state_dict.remote())
    assert version == 1 and bits_equal(expected_1, got) == []
    assert (layout.model_dir(root, 1) / "fsdp_config.json").is_file()
    assert (root / "latest_state_dict_iteration.txt").read_text().strip() == "1"
    manifest = reader.read_manifest(layout.step_dir(root, 1))
    assert sorted(r.path for r in manifest if "/model_world_size_" in r.path) == [
        f"{layout.MODEL_SUBDIR}/{layout.shard_name('model', 2, rank)}" for rank in range(2)
    ]
    assert reader.verify_step(layout.step_dir(root, 1)) == []

    # Memory sync: every rank gathers, rank 0 uploads.
    ray.get([t.train_step.remote(2) for t in trainers])
    expected_2 = full_state_dict(trainers)
    assert bits_equal(expected_1, expected_2) != []
    uploads = ray.get([t.upload.remote(2) for t in trainers])
    assert uploads[0] is not None and uploads[1] is None
    got, version = ray.get(sync.get_model_state_dict.remote())
    assert version == 2 and bits_equal(expected_2, got) == []

    # Broadcast: trainer rank 0 -> rollout over a group of their own (gloo here).
    ray.get([t.train_step.remote(3) for t in trainers])
    expected_3 = full_state_dict(trainers)
    port = PORTS["weight_sync"]
    ray.get([rollout.join_group.remote(), *[t.join_group.remote(port) for t in trainers]])
    received, *sent = ray.get(
        [rollout.receive.remote(), *[t.broadcast.remote(3) for t in trainers]]
    )
    assert bits_equal(expected_3, received) == []
    nbytes = sum(v.numel() * v.element_size() for v in expected_3.values())
    assert sent == [nbytes, None]

    # Telemetry: the monitor (the job's one scrape target) has every measurement.
    want = {
        ("obsckpt_broadcast_bytes_total", (("backend", "gloo"), ("method", "broadcast"))): nbytes,
        (
            "obsckpt_broadcast_duration_seconds_count",
            (("backend", "gloo"), ("method", "broadcast")),
        ): 1,
        ("obsckpt_state_dict_upload_duration_seconds_count", ()): 2,  # load + upload
        ("obsckpt_model_version", (("role", "trainer"),)): 2,
        ("obsckpt_model_version", (("role", "rollout"),)): 2,
        ("obsckpt_latest_step", (("kind", "state_dict"),)): 1,
    }
    deadline = time.monotonic() + 30
    while True:
        m = scrape(monitor)
        got_metrics = {k: m.get(k) for k in want}
        if got_metrics == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got_metrics == want

    # Spans: saves and the upload and broadcast on trainer rank 0, the load on the
    # synchronizer, the broadcast on the rollout side.
    names = [n for n, _ in ray.get(trainers[0].spans.remote())]
    assert {"obsckpt.save", "obsckpt.upload", "obsckpt.broadcast"} <= set(names)
    bcast = [a for n, a in ray.get(trainers[0].spans.remote()) if n == "obsckpt.broadcast"]
    assert bcast[0]["obsckpt.bytes"] == nbytes and bcast[0]["obsckpt.step"] == 3
    assert any(s["name"] == "obsckpt.upload" for s in ray.get(sync.debug_spans.remote()))
    assert "obsckpt.broadcast" in [n for n, _ in ray.get(rollout.spans.remote())]


CUSTOM_MODEL_CODE = """
from transformers import LlamaConfig, LlamaForCausalLM


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny-custom"


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""


class TestHFMetadata:
    """Rank 0 writes next to the shards what verl's own manager writes there, durably.

    verl's model merger rebuilds the HF model from it: the generation config of a
    pretrained model (else generation falls back to one derived from the model config),
    a custom model's code (else its config cannot be loaded), and a LoRA model's rank
    and alpha (else the merged adapter gets lora_alpha=0 and does nothing).
    """

    def test_generation_config_of_a_pretrained_model(self, tmp_path):
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
        from workers import TINY_LLAMA

        from obsckpt.integrations.verl_fsdp import save_hf_metadata

        src = tmp_path / "pretrained"
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        model.generation_config = GenerationConfig(
            eos_token_id=[3, 7], do_sample=True, temperature=0.6
        )
        model.save_pretrained(src)
        out = tmp_path / "actor"
        out.mkdir()
        hf_dir = save_hf_metadata(LlamaForCausalLM.from_pretrained(src), str(out))
        got = GenerationConfig.from_pretrained(hf_dir)
        assert got.eos_token_id == [3, 7] and got.temperature == 0.6
        assert json.loads((out / "fsdp_config.json").read_text()) == {
            "FSDP_version": 0,
            "world_size": 1,
        }

    def test_custom_model_code(self, tmp_path, monkeypatch):
        from transformers import AutoConfig

        from obsckpt.integrations.verl_fsdp import save_hf_metadata

        (tmp_path / "tiny_custom.py").write_text(CUSTOM_MODEL_CODE)
        monkeypatch.syspath_prepend(str(tmp_path))
        import tiny_custom
        from workers import TINY_LLAMA

        config = tiny_custom.TinyCustomConfig(**TINY_LLAMA)
        config.auto_map = {
            "AutoConfig": "tiny_custom.TinyCustomConfig",
            "AutoModelForCausalLM": "tiny_custom.TinyCustomForCausalLM",
        }
        out = tmp_path / "actor"
        out.mkdir()
        hf_dir = save_hf_metadata(tiny_custom.TinyCustomForCausalLM(config), str(out))
        assert (Path(hf_dir) / "tiny_custom.py").read_text() == CUSTOM_MODEL_CODE
        monkeypatch.delitem(sys.modules, "tiny_custom")
        monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
        loaded = AutoConfig.from_pretrained(hf_dir, trust_remote_code=True)
        assert type(loaded).__name__ == "TinyCustomConfig"

    def test_lora_rank_and_alpha(self, tmp_path):
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        from workers import TINY_LLAMA

        from obsckpt.integrations.verl_fsdp import save_hf_metadata

        lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj"], task_type="CAUSAL_LM")
        model = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), lora)
        out = tmp_path / "actor"
        out.mkdir()
        hf_dir = save_hf_metadata(model, str(out))
        assert (Path(hf_dir) / "config.json").is_file()
        assert json.loads((out / "lora_train_meta.json").read_text()) == {
            "r": 4,
            "lora_alpha": 16,
            "task_type": "CAUSAL_LM",
        }

    def test_every_file_is_fsynced_and_renamed_into_place(self, tmp_path, monkeypatch):
        """The step commits once its shards are durable: these files must be durable first."""
        from transformers import LlamaConfig, LlamaForCausalLM
        from workers import TINY_LLAMA

        from obsckpt.integrations.verl_fsdp import save_hf_metadata

        synced: list[str] = []
        original = commit.fsync_file

        def fsync_file(path):
            synced.append(os.path.abspath(os.fspath(path)))
            original(path)

        monkeypatch.setattr(commit, "fsync_file", fsync_file)
        out = tmp_path / "actor"
        out.mkdir()
        save_hf_metadata(LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)), str(out))
        written = sorted(str(p) for p in out.rglob("*") if p.is_file())
        assert written == sorted(
            str(out / name) for name in ("fsdp_config.json", "huggingface/config.json")
        )
        # Each file was synced where it was written, before it was renamed into place.
        assert sorted(os.path.basename(p) for p in synced) == ["config.json", "fsdp_config.json"]


def plain(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Tensors as plain bytes: safe on a queue after the sending process exits.

    A CPU tensor put on a multiprocessing queue travels as a file descriptor of
    shared memory, which is gone if the sender exits before the receiver reads.
    """
    return {
        k: (
            str(v.dtype).removeprefix("torch."),
            tuple(v.shape),
            v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
        for k, v in tensors.items()
    }


def unplain(data: dict[str, tuple[str, tuple[int, ...], bytes]]) -> dict[str, torch.Tensor]:
    return {
        k: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dt)).view(shape)
        if raw
        else torch.empty(shape, dtype=getattr(torch, dt))
        for k, (dt, shape, raw) in data.items()
    }


def _local_numel(t) -> int:
    """Elements this rank holds: a DTensor's or ShardedTensor's local part; NO_SHARD's whole tensor."""
    if hasattr(t, "to_local"):
        return t.to_local().numel()
    if hasattr(t, "local_shards"):
        return sum(s.tensor.numel() for s in t.local_shards())
    return t.numel()


def _gpu_fsdp1(rank: int, world_size: int, port: int, shard_dir: str, results) -> None:
    """One GPU per rank: FSDP1 shards (saved and merged as the Synchronizer does), gathered
    parameters, and an NCCL weight-sync group (rank 0 -> rank 1 when there are two)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from obsckpt.integrations.verl_fsdp import full_params, sharded_model_state_dict
    from obsckpt.sync.broadcast import WeightBroadcaster
    from obsckpt.sync.device import setup_rank_device
    from obsckpt.sync.group import WeightSyncGroup
    from obsckpt.sync.shards import load_sharded_state_dict

    try:
        rd = setup_rank_device([str(rank)])  # as Ray would give it
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group(rd.backend, rank=rank, world_size=world_size)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Linear(7, 5)).to(rd.device)
        reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        strategy = ShardingStrategy.FULL_SHARD if world_size > 1 else ShardingStrategy.NO_SHARD
        fsdp = FSDP(model, device_id=rd.device, use_orig_params=True, sharding_strategy=strategy)
        shard = sharded_model_state_dict(fsdp)
        local_numel = sum(_local_numel(v) for v in shard.values())
        torch.save(shard, os.path.join(shard_dir, layout.shard_name("model", world_size, rank)))
        dist.barrier()
        merged = load_sharded_state_dict(shard_dir) if rank == 0 else {}
        with full_params(fsdp) as (meta, named):
            gathered = {n: t.cpu().clone() for n, t in named}
            names = [m.name for m in meta]
        # The weight-sync group next to the default group: header and buckets
        # go through NCCL on device tensors, polled against the deadline.
        group = WeightSyncGroup(
            host="127.0.0.1",
            port=port + 1,
            rank=rank,
            world_size=world_size,
            backend="nccl",
            timeout_s=60,
        )
        b = WeightBroadcaster(group, bucket_bytes=1 << 8)
        received = {}
        if rank == 0:
            b.send(model.state_dict() if world_size == 1 else gathered)
        else:
            received = b.recv(clone=True)
        group.close()
        results.put(
            (
                rank,
                {
                    "merged": plain(merged),
                    "gathered": plain(gathered),
                    "received": plain(received),
                    "names": names,
                    "reference": plain(reference),
                    "local_numel": local_numel,
                    "backend": group.backend,
                },
            )
        )
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback

        results.put((rank, traceback.format_exc()))


def _nccl_pair(rank: int, port: int, results) -> None:
    from obsckpt.sync.broadcast import WeightBroadcaster
    from obsckpt.sync.device import setup_rank_device
    from obsckpt.sync.group import WeightSyncGroup

    setup_rank_device([str(rank)])  # as Ray would give it
    group = WeightSyncGroup(
        host="127.0.0.1", port=port, rank=rank, world_size=2, backend="nccl", timeout_s=60
    )
    b = WeightBroadcaster(group, bucket_bytes=1 << 10)
    model = build_model().cuda()
    if rank == 0:
        b.send(model.state_dict())
    else:
        results.put({k: v.cpu().clone() for k, v in b.recv().items()})
    group.close()


def _run_spawned(target, args_per_proc, results, n_results: int) -> list:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args) for args in args_per_proc]
    for p in procs:
        p.start()
    try:
        return [results.get(timeout=300) for _ in range(n_results)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "world_size",
    [
        pytest.param(
            1,
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(),
                reason="FSDP1 and NCCL need a CUDA device; the FSDP2/gloo test above covers "
                "the same paths on CPU",
            ),
        ),
        pytest.param(
            2,
            marks=pytest.mark.skipif(
                torch.cuda.device_count() < 2,
                reason="sharded FSDP1 needs two NCCL ranks, and NCCL needs a GPU per rank; "
                "with one GPU only world size 1 (NO_SHARD) runs",
            ),
        ),
    ],
)
def test_fsdp1_shards_gather_and_nccl_group(world_size, tmp_path):
    """FSDP1 shards merge to the model; full_params gathers it per tensor; NCCL sends."""
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Queue()
    port = free_port()
    out = dict(
        _run_spawned(
            _gpu_fsdp1,
            [(r, world_size, port, str(tmp_path), results) for r in range(world_size)],
            results,
            world_size,
        )
    )
    for rank, value in out.items():
        assert isinstance(value, dict), f"rank {rank} failed:\n{value}"
    first = out[0]
    reference = unplain(first["reference"])
    assert bits_equal(reference, unplain(first["merged"])) == []
    assert first["names"] == list(reference)
    assert bits_equal(reference, unplain(first["gathered"])) == []
    assert first["backend"] == "nccl"
    total = sum(v.numel() for v in reference.values())
    if world_size > 1:
        # Sharded: each rank holds part of the parameters; rank 1 got them over NCCL.
        assert all(out[r]["local_numel"] < total for r in out)
        assert sum(out[r]["local_numel"] for r in out) >= total
        assert bits_equal(reference, unplain(out[1]["received"])) == []
    else:
        assert first["local_numel"] == total


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="FSDP1 and NCCL need a CUDA device; an NCCL pair needs two (one per rank); the "
    "gloo tests cover the same protocol on CPU",
)
def test_nccl_broadcast_between_two_gpus():
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").Queue()
    port = free_port()
    (received,) = _run_spawned(_nccl_pair, [(0, port, results), (1, port, results)], results, 1)
    assert bits_equal(build_model().state_dict(), received) == []
