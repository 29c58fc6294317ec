"""Which device a rank trains and syncs on: the GPU Ray gave it, else the CPU.

A rank must select its CUDA device before it makes a process group, a
DeviceMesh or an FSDP wrap: otherwise every rank of a node lands on device 0
(NCCL refuses duplicate devices, DeviceMesh set-up crashes). A rank that Ray
did not give a GPU uses the CPU and gloo, even on a machine with CUDA, and
builds its DeviceMesh on the CPU explicitly (FSDP2's default mesh takes the
machine's accelerator).

Call :func:`setup_rank_device` first thing in a rank's actor::

    rd = setup_rank_device()
    dist.init_process_group(rd.backend, ...)
    mesh = rd.mesh(world_size)
    fully_shard(model, mesh=mesh)
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from obsckpt.errors import DeviceSelectionError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class _Default(enum.Enum):
    FROM_RAY = enum.auto()  # setup_rank_device's default: ask Ray


_FROM_RAY = _Default.FROM_RAY


@dataclass(frozen=True, slots=True)
class RankDevice:
    """A rank's device and the collective backend that goes with it."""

    device: torch.device
    gpu_ids: tuple[str, ...]

    @property
    def backend(self) -> str:
        """``nccl`` on a GPU, ``gloo`` on the CPU."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    @property
    def is_cuda(self) -> bool:
        """Whether the device is a GPU."""
        return self.device.type == "cuda"

    def mesh(self, world_size: int) -> DeviceMesh:
        """A one-dimensional DeviceMesh over the default process group, on this device's type."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (world_size,))

    def describe(self) -> str:
        """The device for a log line: ``cpu``, or ``cuda:N (<GPU name>)``."""
        if not self.is_cuda:
            return "cpu"
        name = torch.cuda.get_device_name(self.device)
        return f"{self.device} ({name})"


def ray_gpu_ids() -> list[str] | None:
    """The GPU ids Ray assigned to this process, or None outside a Ray worker."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    try:
        if ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
            return None  # the driver: Ray assigns it nothing
    except AttributeError:
        pass
    return [str(g) for g in ray.get_gpu_ids()]


def choose_device(
    gpu_ids: Sequence[str] | None,
    cuda_device_count: int,
    *,
    visible: str | None = None,
    local_rank: str | None = None,
) -> torch.device:
    """The device for a rank (pure: no CUDA call), from what Ray gave it and what CUDA sees.

    Args:
        gpu_ids: Ray's GPU ids for this rank (``[]``: none), or None outside Ray.
        cuda_device_count: ``torch.cuda.device_count()`` in this process.
        visible: ``CUDA_VISIBLE_DEVICES`` as Ray set it (its position of
            ``gpu_ids[0]`` is the local index), or None when unset.
        local_rank: ``LOCAL_RANK`` outside Ray (torchrun); None for the CPU.
    """
    if gpu_ids is None:
        if local_rank is None or cuda_device_count == 0:
            return torch.device("cpu")
        index = int(local_rank)
        if index >= cuda_device_count:
            raise DeviceSelectionError(
                f"LOCAL_RANK={local_rank} but this process sees {cuda_device_count} CUDA "
                "devices; start one rank per visible GPU"
            )
        return torch.device("cuda", index)
    if not gpu_ids:
        return torch.device("cpu")
    if cuda_device_count == 0:
        raise DeviceSelectionError(
            f"Ray gave this rank GPU {', '.join(gpu_ids)}, but CUDA sees no device in this "
            f"process (CUDA_VISIBLE_DEVICES={visible!r}); check the node's driver, or ask "
            "Ray for num_gpus=0 to train on the CPU"
        )
    index = 0
    if visible:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if gpu_ids[0] in ids:
            index = ids.index(gpu_ids[0])
        elif gpu_ids[0].isdigit() and int(gpu_ids[0]) < cuda_device_count:
            index = int(gpu_ids[0])  # Ray was told not to set CUDA_VISIBLE_DEVICES
    elif gpu_ids[0].isdigit() and int(gpu_ids[0]) < cuda_device_count:
        index = int(gpu_ids[0])
    if index >= cuda_device_count:
        raise DeviceSelectionError(
            f"Ray gave this rank GPU {gpu_ids[0]}, local index {index}, but this process sees "
            f"{cuda_device_count} CUDA devices"
        )
    return torch.device("cuda", index)


def setup_rank_device(gpu_ids: Sequence[str] | None | _Default = _FROM_RAY) -> RankDevice:
    """Choose this rank's device and make it the current CUDA device (if it is one).

    Call it before any process group, DeviceMesh or FSDP wrap. ``gpu_ids``
    defaults to what Ray gave this worker (:func:`ray_gpu_ids`).
    """
    ids = ray_gpu_ids() if gpu_ids is _FROM_RAY else gpu_ids
    count = torch.cuda.device_count() if ids or os.environ.get("LOCAL_RANK") else 0
    device = choose_device(
        None if ids is None else list(ids),
        count,
        visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        local_rank=os.environ.get("LOCAL_RANK"),
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return RankDevice(device, tuple(ids or ()))
