"""Test-side Ray actors: trainer ranks that save through a CheckpointCoordinator."""

from __future__ import annotations

import os
import threading
import time

import ray


@ray.remote(max_concurrency=8)
class SaveWorker:
    """One trainer rank. Saves can be gated (blocked until released) or made to fail."""

    def __init__(self, namespace: str, rank: int, *, trace: bool = False, save_timeout=None):
        from obsckpt import CheckpointCoordinator
        from obsckpt.telemetry import tracing

        if trace:
            tracing.setup_tracing("test-worker", exporter="memory")
        self.rank = rank
        self.monitor = ray.get_actor("checkpoint_monitor", namespace=namespace)
        self.coord = CheckpointCoordinator(self.monitor, rank=rank, save_timeout=save_timeout)
        self.gates: dict[tuple[str, int], threading.Event] = {}
        self.intervals: list[tuple[str, int, float, float]] = []
        self._lock = threading.Lock()

    def pid(self) -> int:
        return os.getpid()

    def save(
        self,
        root: str,
        step: int,
        slots: list[str],
        *,
        is_state_dict: bool = False,
        gated: bool = False,
        fail_slots: tuple[str, ...] = (),
        sleep: float = 0.0,
        carrier: dict | None = None,
        parts: int | None = None,
    ) -> None:
        """Save ``slots``; with ``parts``, each as this rank's part of a save made of parts."""
        split = {} if parts is None else {"part": self.rank, "parts": parts}
        for slot in slots:
            path = os.path.join(root, f"global_step_{step}", "actor", f"{slot}_rank_{self.rank}.pt")
            gate = None
            if gated:
                gate = self.gates[(slot, step)] = threading.Event()
            self.coord.save_async(
                slot,
                self._save_fn(path, slot, step, gate, slot in fail_slots, sleep),
                step,
                is_state_dict=is_state_dict,
                paths=[path],
                trace_context=carrier,
                **split,
            )

    def _save_fn(self, path, slot, step, gate, fail, sleep):
        def save():
            start = time.monotonic()
            if gate is not None:
                gate.wait(60)
            if sleep:
                time.sleep(sleep)
            if fail:
                raise OSError(28, "No space left on device (injected)")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(f"{slot} rank {self.rank} step {step}\n".encode() * 100)
            with self._lock:
                self.intervals.append((slot, step, start, time.monotonic()))

        return save

    def save_state_dict(
        self, path: str, step: int, value: float, is_state_dict: bool = True, **kwargs
    ) -> bool:
        """A snapshot save (``kwargs`` to save_state_dict_async); returns whether it is staged."""
        import torch

        sd = {"w": torch.full((256, 256), value), "step": step}
        handle = self.coord.save_state_dict_async(
            "model", sd, path, step, is_state_dict=is_state_dict, **kwargs
        )
        handle.wait_staged(60)
        sd["w"].fill_(-1.0)  # must not reach the file
        return handle.staged

    def release(self, slot: str, step: int) -> None:
        self.gates[(slot, step)].set()

    def wait(self, timeout: float = 60.0) -> str | None:
        """wait_all(); returns the raised error's text (None when nothing failed)."""
        try:
            self.coord.wait_all(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return f"{type(exc).__name__}: {exc}"
        return None

    def wait_raising(self, timeout: float = 60.0) -> None:
        """wait_all(), its error left to reach the caller through Ray."""
        self.coord.wait_all(timeout=timeout)

    def get_intervals(self):
        return list(self.intervals)

    def spans(self) -> list[dict]:
        from obsckpt.telemetry import tracing

        return tracing.finished_spans()


def cpu_fsdp_group(rank: int, world_size: int, port: int):
    """Join a gloo group as a rank Ray gave no GPU; returns its CPU DeviceMesh for FSDP2.

    The device is chosen before the group and the mesh: on a machine with CUDA,
    FSDP2's default mesh would otherwise take the accelerator.
    """
    import torch.distributed as dist

    from obsckpt.sync.device import setup_rank_device

    rd = setup_rank_device()
    assert rd.backend == "gloo", rd
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(rd.backend, rank=rank, world_size=world_size)
    return rd.mesh(world_size)


# The smallest Llama that exercises every kind of layer (tests that shard a model).
TINY_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def tiny_fsdp_llama(mesh, *, value_head: bool = False):
    """The tiny Llama (seeded), each layer and then the whole model wrapped with FSDP2.

    ``value_head``: a token-classification head with one label, as verl's critic.
    """
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    torch.manual_seed(0)
    if value_head:
        model = LlamaForTokenClassification(LlamaConfig(num_labels=1, **TINY_LLAMA))
    else:
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def kill_named(actor, name: str, namespace: str | None = None, timeout: float = 30.0) -> None:
    """Kill ``actor`` and wait until its ``name`` is free, so the next get_actor creates one."""
    ray.kill(actor)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
