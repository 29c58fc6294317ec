"""The run's plan: device, world size and sync method from the GPUs there are, and its line.

Explicit settings are kept, and checked against the GPUs, before anything starts.
"""

from __future__ import annotations

import dataclasses

from obsckpt.demo.config import DemoConfig
from obsckpt.errors import DemoError


def resolve_plan(cfg: DemoConfig, gpus: int | None = None) -> DemoConfig:
    """Fill in the device, world size and sync method from the GPUs this machine has.

    No GPU (or ``device="cpu"``): the CPU, gloo, 2 ranks, broadcast. One GPU:
    one rank on it and the rollout beside it, weights handed over by CUDA IPC
    (``ipc``). Two or more: a GPU per rank and one for the rollout, NCCL
    broadcast. Explicit settings are kept, and checked against the GPUs.
    """
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 0
    if cfg.device == "cuda" and gpus == 0:
        raise DemoError("--device cuda, but no CUDA device is visible; use --device cpu")
    if cfg.device == "cpu" or gpus == 0:
        return dataclasses.replace(
            cfg,
            device="cpu",
            world_size=cfg.world_size or 2,
            sync_method=cfg.sync_method or "broadcast",
        )
    sync = cfg.sync_method or ("ipc" if gpus == 1 else "broadcast")
    if sync == "ipc":
        world = cfg.world_size or 1
        if world != 1:
            raise DemoError(
                f"--sync-method ipc on GPUs runs one trainer rank sharing its GPU with the "
                f"rollout; got --world-size {world} (use 1, or --sync-method broadcast)"
            )
    elif sync == "broadcast":
        world = cfg.world_size or max(1, min(2, gpus - 1))
        if world + 1 > gpus:
            raise DemoError(
                f"--sync-method broadcast over NCCL needs a GPU per trainer rank and one for "
                f"the rollout ({world + 1}); this machine has {gpus}. Use --sync-method ipc "
                "(one rank), fewer ranks, or --device cpu"
            )
    else:
        world = cfg.world_size or min(2, gpus)
        if world > gpus:
            raise DemoError(
                f"{world} trainer ranks need {world} GPUs (NCCL needs one per rank); this "
                f"machine has {gpus}"
            )
    return dataclasses.replace(cfg, device="cuda", world_size=world, sync_method=sync)


def plan_line(cfg: DemoConfig, info: dict) -> str:
    """The first line about the job: ranks, device, model size, sync, save interval."""
    ranks = "1 FSDP2 rank" if cfg.world_size == 1 else f"{cfg.world_size} FSDP2 ranks"
    return (
        f"obsckpt demo: {ranks} ({info['backend']}, {info['device']}), "
        f"Qwen2 with {info['parameters'] / 1e6:.2f} M parameters, weight sync "
        f"{_sync_name(cfg, info)}, full checkpoint every "
        f"{'step' if cfg.save_every == 1 else f'{cfg.save_every} steps'}"
    )


def _sync_name(cfg: DemoConfig, info: dict) -> str:
    if cfg.sync_method == "broadcast":
        return f"broadcast over {info['backend']}"
    if cfg.sync_method == "ipc":
        return "ipc (CUDA IPC, colocated)" if cfg.device == "cuda" else "ipc (shared memory)"
    return cfg.sync_method
