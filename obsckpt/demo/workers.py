"""The demo's Ray actors: FSDP2 trainer ranks and a rollout stand-in.

:class:`TrainerRank` is one rank of a small FSDP2 job (``fully_shard`` on
every decoder layer and the root; gloo on CPU, NCCL on GPU). It saves full
checkpoints (model, optimizer, extra state) in the background with obsckpt's
verl integration (:class:`obsckpt.integrations.FSDPCheckpointManager`, which
saves through a :class:`obsckpt.CheckpointCoordinator` and registers each
save with the monitor), and sends its weights to the rollout side with
:func:`obsckpt.integrations.fsdp_sync_weight_nccl` (broadcast) or the
manager's ``upload_state_dict`` (memory sync).

:class:`Rollout` stands in for an inference engine: it holds the weights it
was last sent and the version (training step) they belong to, and checks
each new version against the one the trainer says it sent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from obsckpt.options import MONITOR_ACTOR_NAME, lookup_actor
from obsckpt.store import layout

logger = logging.getLogger(__name__)

# The demo's driver starts the monitor before any worker: a miss means it has gone.
_NO_MONITOR = "the demo's monitor has stopped; see the driver's output for why"

# Small buckets: the demo's model is a few MB, the library default is 256 MiB.
BUCKET_BYTES = 4 << 20


def _setup_worker_tracing(service: str) -> None:
    from obsckpt.telemetry import tracing

    if tracing.requested():
        tracing.setup_tracing(service)


def _flush_tracing() -> None:
    from obsckpt.telemetry import tracing

    # Bounded: with an unreachable collector the SDK's own flush can take minutes.
    tracing.flush(5.0)


class TrainerRank:
    """One FSDP2 rank of the demo job (a Ray actor; see :func:`obsckpt.demo.job.run_demo`)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        namespace: str,
        spec: dict,
        lr: float,
        seed: int,
        device: str,
        threads: int,
    ) -> None:
        from obsckpt.demo.model import ModelSpec

        torch.set_num_threads(max(1, threads))
        self.rank = rank
        self.world_size = world_size
        self.namespace = namespace
        self.spec = ModelSpec(**spec)
        self.lr = lr
        self.seed = seed
        self.device = torch.device(device)
        self.model = None
        self.manager: Any = None
        self.data: Any = None
        # User state in the resume record: what this rank has trained on.
        self.tokens_seen = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.sync_group = None
        self.broadcaster = None
        _setup_worker_tracing("obsckpt-demo-trainer")

    def node_address(self) -> str:
        import ray.util

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        from obsckpt.sync.group import free_port

        return free_port("0.0.0.0")

    def setup(self, master_addr: str, master_port: int) -> dict:
        """Join the job's process group, build and shard the model; returns its description."""
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from obsckpt import CheckpointCoordinator
        from obsckpt.demo.data import DemoData, seed_rank
        from obsckpt.demo.model import build_model, count_parameters
        from obsckpt.integrations.fsdp_checkpoint_manager import FSDPCheckpointManager
        from obsckpt.sync.device import setup_rank_device

        # The GPU Ray gave this rank, set before the process group and the mesh;
        # the CPU (and gloo) when it got none, even on a machine with CUDA.
        rd = setup_rank_device()
        if rd.device.type != self.device.type:
            raise RuntimeError(
                f"the demo asked for {self.device.type} but Ray gave this rank "
                f"{rd.describe()} (GPU ids {list(rd.gpu_ids)})"
            )
        self.device = rd.device
        backend = rd.backend
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master_addr}:{master_port}",
            rank=self.rank,
            world_size=self.world_size,
        )
        model = build_model(self.spec, seed=self.seed).to(self.device)
        params = count_parameters(model)
        mesh = rd.mesh(self.world_size)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / 5)
        )
        # After the model (whose initial weights every rank must share): each rank's own
        # RNGs, and its data, both in the resume record.
        seed_rank(self.seed, self.rank)
        self.data = DemoData(self.spec, seed=self.seed, rank=self.rank)
        self.monitor = lookup_actor(MONITOR_ACTOR_NAME, self.namespace, hint=_NO_MONITOR)
        self.coordinator = CheckpointCoordinator(self.monitor, rank=self.rank)
        self.manager = FSDPCheckpointManager(
            model=model,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            ray_namespace=self.namespace,
            monitor=self.monitor,
            coordinator=self.coordinator,
            commit_steps=False,  # the demo's driver submits each step, as a trainer does
        )
        return {"parameters": params, "backend": backend, "device": rd.describe()}

    # -- training --------------------------------------------------------

    def train_step(self, step: int) -> tuple[float, str]:
        """One optimizer step on this rank's next batch; (mean loss over ranks, the batch's CRC32)."""
        import torch.distributed as dist

        from obsckpt.demo.data import digest

        batch = self.data.next_batch()
        tokens = batch.to(self.device)
        out = self.model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss = out.loss.detach().reshape(1).clone()
        self.tokens_seen += tokens.numel()
        self.loss_sum += loss.to("cpu", torch.float64)[0]
        dist.all_reduce(loss)
        return float(loss.item()) / self.world_size, digest(batch)

    # -- checkpoints -----------------------------------------------------

    def save_checkpoint(
        self,
        root: str,
        step: int,
        trace_context: dict | None,
        keep: int | None,
        weight_version: int | None = None,
    ) -> dict[str, int]:
        """Start a full checkpoint of ``step`` and its resume record in the background;
        returns the saves it registered."""
        from obsckpt.resume import ResumeRecord, save_resume_record
        from obsckpt.telemetry import tracing

        # Taken first: the state after this step's training, before anything else runs.
        record = ResumeRecord.capture(
            step,
            data=self.data,
            weight_version=weight_version,
            user={"tokens_seen": self.tokens_seen, "loss_sum": self.loss_sum},
        )
        path = layout.step_location(root, step, layout.MODEL_SUBDIR)
        # The manager's saves take the current context: make it the step's trace.
        token = tracing.attach(trace_context)
        try:
            counts = self.manager.save_checkpoint(
                path, global_step=step, max_ckpt_to_keep=keep or None
            )
            # One more save of the step: it does not commit without the record.
            save_resume_record(self.coordinator, record)
            return {**counts, "resume": 1}
        finally:
            tracing.detach(token)

    def save_model_state_dict(self, root: str, step: int, trace_context: dict | None) -> int:
        """Start a state-dict save (this rank's model shard) of ``step``; returns how many."""
        from obsckpt.telemetry import tracing

        path = layout.step_location(root, step, layout.MODEL_SUBDIR)
        token = tracing.attach(trace_context)
        try:
            return self.manager.save_state_dict(path, global_step=step)
        finally:
            tracing.detach(token)

    def start_state_dict_sync(self, step: int) -> None:
        """Checkpoint sync: the manager's first state-dict call, before the first step.

        It saves nothing (the rollout's weights are current at ``step``) and
        announces ``step`` to the Synchronizer; only later calls save. Made by
        the first trained step instead, it would leave that step without files.
        """
        self.manager.save_state_dict(None, global_step=step)

    def load_checkpoint(self, root: str, step: int) -> int | None:
        """Load ``step``'s checkpoint and restore its resume record; returns its weight version."""
        from obsckpt.resume import restore_resume_record

        path = layout.step_location(root, step, layout.MODEL_SUBDIR)
        self.manager.load_checkpoint(path)
        # After verl's load, which sets the RNGs from its extra state: the record's win.
        record = restore_resume_record(root, step, self.rank, data_loader=self.data)
        self.tokens_seen = int(record.user["tokens_seen"])
        self.loss_sum = record.user["loss_sum"]
        return record.weight_version

    def state_digest(self) -> dict[str, str | None]:
        """CRC32s of this rank's whole training state (every rank must call it: it gathers)."""
        from obsckpt.demo.model import state_crc
        from obsckpt.resume import capture_rng

        return {
            "weights": self.fingerprint(),
            "optimizer": f"{state_crc(self.optimizer.state_dict()):08x}",
            "lr_scheduler": f"{state_crc(self.lr_scheduler.state_dict()):08x}",
            "rng": f"{state_crc(capture_rng()):08x}",
            "data_position": f"{state_crc(self.data.state_dict()):08x}",
            "user": f"{state_crc([self.tokens_seen, self.loss_sum]):08x}",
        }

    def pid(self) -> tuple[str, int]:
        """(node address, process id): where --kill-at sends SIGKILL."""
        return self.node_address(), os.getpid()

    def wait_saves(self, timeout: float) -> str | None:
        """Join every background save; the first failure's text, or None."""
        try:
            self.manager.wait_on_save_thread(timeout)
        except Exception as exc:  # noqa: BLE001 - reported by the driver
            return f"{type(exc).__name__}: {exc}"
        return None

    # -- weight sync -----------------------------------------------------

    def fingerprint(self) -> str | None:
        """CRC32 of the full weights, on rank 0 (every rank must call it: it gathers)."""
        from obsckpt.demo.model import fingerprint

        full = self._full_weights()
        return fingerprint(full) if self.rank == 0 else None

    def join_weight_sync(self, host: str, port: int, backend: str) -> None:
        from obsckpt.sync.delta_broadcast import DeltaBroadcaster
        from obsckpt.sync.group import WeightSyncGroup

        self.sync_group = WeightSyncGroup(
            host=host, port=port, rank=0, world_size=2, backend=backend, timeout_s=120.0
        )
        # Deltas against the version the rollout holds (a full state first, after a
        # failed check, and every full_every versions), checked after the apply.
        self.broadcaster = DeltaBroadcaster(
            self.sync_group, bucket_bytes=BUCKET_BYTES, monitor=self.monitor
        )

    def _full_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The full weights (every rank must call it: each DTensor is gathered)."""
        from torch.distributed.tensor import DTensor

        return [
            (name, value.full_tensor() if isinstance(value, DTensor) else value.detach())
            for name, value in self.model.state_dict().items()
        ]

    def broadcast_weights(self, step: int, trace_context: dict | None) -> None:
        """Sync the weights to the rollout from rank 0 (a delta when it holds the last
        version); every rank must call it."""
        full = self._full_weights()
        if self.rank == 0:
            self.broadcaster.send(dict(full), step=step, trace_context=trace_context)

    def make_ipc_sender(self) -> None:
        """Colocated sync: rank 0 hands the rollout CUDA IPC handles (or shared-memory buckets)."""
        from obsckpt.sync.ipc import IpcWeightSender

        self.ipc_sender = IpcWeightSender(
            device=self.device, bucket_bytes=BUCKET_BYTES, timeout_s=120.0, monitor=self.monitor
        )

    def ipc_weights(self, step: int, rollout, trace_context: dict | None) -> None:
        """Gather the full weights (every rank must call it); rank 0 hands them to the rollout."""
        full = self._full_weights()
        if self.rank == 0:
            self.ipc_sender.send(
                full,
                lambda payload: rollout.receive_ipc.remote(payload, step),
                step=step,
                trace_context=trace_context,
            )

    def upload_weights(self, step: int) -> float | None:
        """Memory sync: hand the full weights to the Synchronizer; every rank must call it."""
        return self.manager.upload_state_dict(step)

    def close(self) -> None:
        import torch.distributed as dist

        if self.broadcaster is not None:
            self.broadcaster.telemetry.flush(10.0)
        if getattr(self, "ipc_sender", None) is not None:
            self.ipc_sender.close()
        if self.sync_group is not None:
            self.sync_group.close()
        _flush_tracing()
        if dist.is_initialized():
            dist.destroy_process_group()


class Rollout:
    """Holds the weights it was last sent and their version; checks each new version."""

    def __init__(self, *, namespace: str, device: str) -> None:
        from obsckpt.sync.device import setup_rank_device

        self.namespace = namespace
        # The GPU Ray gave the rollout (the trainer's, when colocated), else the CPU.
        self.device = setup_rank_device().device if device == "cuda" else torch.device("cpu")
        self.weights: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.versions: list[int] = []
        self.sync_group = None
        self.broadcaster = None
        self.ipc_receiver = None
        self.memory_client: Any = None  # a MemorySyncClient, made at the first pull
        self._accepted: tuple[int, str] | None = None
        self._monitor = None
        _setup_worker_tracing("obsckpt-demo-rollout")

    def _report(self, version: int) -> None:

        if self._monitor is None:
            self._monitor = lookup_actor(MONITOR_ACTOR_NAME, self.namespace, hint=_NO_MONITOR)
        self._monitor.record_model_version.remote("rollout", version)

    def _accept(self, got: int | None, expected: int) -> tuple[int, str]:
        from obsckpt.demo.model import fingerprint

        if got != expected:
            raise RuntimeError(
                f"the rollout received model version {got}, but the trainer sent step {expected}"
            )
        self.version = got
        self.versions.append(got)
        self._report(got)
        return got, fingerprint(self.weights.items())

    def join_weight_sync(self, host: str, port: int, backend: str) -> None:
        from obsckpt.sync.delta_broadcast import DeltaBroadcaster
        from obsckpt.sync.group import WeightSyncGroup

        self.sync_group = WeightSyncGroup(
            host=host, port=port, rank=1, world_size=2, backend=backend, timeout_s=120.0
        )
        self.broadcaster = DeltaBroadcaster(self.sync_group, bucket_bytes=BUCKET_BYTES)

    def receive_broadcast(self, expected: int) -> tuple[int, str]:
        """Receive one sync (whole, or a delta applied in place, each checked) into the
        held weights; returns (version, fingerprint)."""
        # The broadcaster holds the weights (on the group's device) and applies each
        # delta to them in place.
        self.weights = self.broadcaster.recv()
        return self._accept(self.broadcaster.last_step, expected)

    def receive_ipc(self, payload, expected: int) -> dict:
        """Colocated sync: copy the weights out of the trainer's buffers; returns the ack."""
        from obsckpt.sync.ipc import IpcWeightReceiver

        if self.ipc_receiver is None:
            self.ipc_receiver = IpcWeightReceiver(device=self.device)
        ack, got = self.ipc_receiver.recv(
            payload, into=self.weights or None, clone=not self.weights
        )
        if not self.weights:
            self.weights = got
        self._accepted = self._accept(payload.step, expected)
        return ack

    def accepted(self) -> tuple[int, str]:
        """The (version, fingerprint) of the last colocated sync."""
        if self._accepted is None:
            raise RuntimeError("the rollout has not received any weights by ipc yet")
        return self._accepted

    def pull(self, synchronizer, expected: int, timeout: float) -> tuple[int, str]:
        """Wait for the Synchronizer to hold ``expected`` (or newer), take its weights."""
        import ray

        current = self.version
        deadline = time.monotonic() + timeout
        held = None
        while time.monotonic() < deadline:
            held = ray.get(synchronizer.wait_new_model_state_dict.remote(current, 1.0))
            if held is not None and held >= expected:
                break
        if self.memory_client is None:
            from obsckpt.sync.delta_memory import MemorySyncClient

            self.memory_client = MemorySyncClient(synchronizer, timeout=timeout)
        # The whole state first, then what changed since the version held (checked).
        version = self.memory_client.update()
        if self.memory_client.weights is not None:
            self.weights = {k: v.to(self.device) for k, v in self.memory_client.weights.items()}
        if version is None or version < expected:
            raise RuntimeError(
                f"the synchronizer holds version {version} after {timeout:.0f} s; the trainer "
                f"is at step {expected} (is the step's commit stuck? see `obsckpt status`)"
            )
        return self._accept(version, expected)

    def pid(self) -> tuple[str, int]:
        """(node address, process id): where --kill-at sends SIGKILL."""
        import ray.util

        return ray.util.get_node_ip_address(), os.getpid()

    def received_versions(self) -> list[int]:
        return list(self.versions)

    def close(self) -> None:
        if self.sync_group is not None:
            self.sync_group.close()
        if self.ipc_receiver is not None:
            self.ipc_receiver.close()
        _flush_tracing()
