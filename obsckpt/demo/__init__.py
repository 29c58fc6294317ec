"""``obsckpt demo``: a small FSDP2 training job that checkpoints through obsckpt while you watch.

See ``docs/demo.md``. The job's pieces:

* :mod:`obsckpt.demo.config`: its settings, result and constants (no torch, no Ray);
* :mod:`obsckpt.demo.job`: :func:`run_demo`, the start-up and the run's end;
* :mod:`obsckpt.demo.plan`: device, world size and sync method from the GPUs;
* :mod:`obsckpt.demo.endpoints`: /metrics and file_sd, checked before the start;
* :mod:`obsckpt.demo.cluster`: the Ray cluster, the job's actors, the shutdown;
* :mod:`obsckpt.demo.loop`: the training loop, weight sync and the drain of saves;
* :mod:`obsckpt.demo.signals`: what a stop signal does to a run;
* :mod:`obsckpt.demo.driver`: the driver process ``obsckpt demo`` runs it in;
* :mod:`obsckpt.demo.model`: the tiny Qwen2 model and its synthetic data;
* :mod:`obsckpt.demo.workers`: the trainer-rank and rollout Ray actors;
* :mod:`obsckpt.demo.root`: the checkpoint root it may use, and what it removes;
* :mod:`obsckpt.demo.progress` and :mod:`obsckpt.demo.summary`: what it prints;
* :mod:`obsckpt.demo.result`: its last line and its ``--result-json`` file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from obsckpt.demo.config import DemoConfig, DemoResult
from obsckpt.errors import DemoError

if TYPE_CHECKING:
    from obsckpt.demo.job import run_demo

__all__ = ["DemoConfig", "DemoError", "DemoResult", "run_demo"]


def __getattr__(name: str) -> Any:
    # The job imports the training stack; the settings alone need none of it.
    if name == "run_demo":
        from obsckpt.demo.job import run_demo

        return run_demo
    raise AttributeError(f"module 'obsckpt.demo' has no attribute {name!r}")
