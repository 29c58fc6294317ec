"""Device selection: a rank uses the GPU Ray gave it, and the CPU with gloo otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
import torch

from obsckpt.errors import DeviceSelectionError
from obsckpt.sync.device import choose_device, setup_rank_device


class TestChoice:
    """The choice follows Ray's assignment, never merely whether CUDA exists."""

    def test_no_gpu_from_ray_means_cpu_even_with_cuda(self):
        assert choose_device([], 8, visible="0,1,2,3") == torch.device("cpu")

    def test_gpu_from_ray_is_its_position_in_visible_devices(self):
        assert choose_device(["3"], 1, visible="3") == torch.device("cuda", 0)
        assert choose_device(["5"], 2, visible="4,5") == torch.device("cuda", 1)

    def test_physical_id_when_ray_left_visible_devices_alone(self):
        assert choose_device(["2"], 4, visible=None) == torch.device("cuda", 2)

    def test_gpu_from_ray_without_cuda_is_an_error(self):
        with pytest.raises(DeviceSelectionError, match="GPU 1.*CUDA sees no device"):
            choose_device(["1"], 0, visible="")

    def test_outside_ray_local_rank_or_cpu(self):
        assert choose_device(None, 2, local_rank="1") == torch.device("cuda", 1)
        assert choose_device(None, 0, local_rank="1") == torch.device("cpu")
        assert choose_device(None, 2) == torch.device("cpu")
        with pytest.raises(DeviceSelectionError, match="LOCAL_RANK=3"):
            choose_device(None, 2, local_rank="3")


def test_cuda_hidden_process_uses_cpu_and_gloo():
    code = (
        "from obsckpt.sync.device import setup_rank_device as s; r = s([]); "
        "print(r.device, r.backend, r.mesh)"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["cpu", "gloo"]


@ray.remote(num_cpus=0, num_gpus=0)
def _rank_device() -> tuple[str, str, list[str]]:
    from obsckpt.sync.device import ray_gpu_ids

    rd = setup_rank_device()
    return str(rd.device), rd.backend, ray_gpu_ids()


def test_ray_rank_without_gpu_uses_cpu(ray_cluster):
    assert ray.get(_rank_device.remote()) == ("cpu", "gloo", [])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a Ray rank with a GPU needs CUDA")
def test_ray_rank_with_gpu_sets_it(ray_cluster):
    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_rank() -> tuple[str, str, int]:
        rd = setup_rank_device()
        return str(rd.device), rd.backend, torch.cuda.current_device()

    device, backend, current = ray.get(gpu_rank.remote())
    assert device == f"cuda:{current}" and backend == "nccl"
