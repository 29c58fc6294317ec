"""``obsckpt demo``: a small FSDP2 training job that checkpoints through obsckpt while you watch.

See ``docs/demo.md``. The job's pieces:

* :mod:`obsckpt.demo.model`: the tiny Qwen2 model and its synthetic data;
* :mod:`obsckpt.demo.workers`: the trainer-rank and rollout Ray actors;
* :mod:`obsckpt.demo.job`: the driver (:func:`run_demo`);
* :mod:`obsckpt.demo.root`: the checkpoint root it may use, and what it removes;
* :mod:`obsckpt.demo.progress` and :mod:`obsckpt.demo.summary`: what it prints.
"""

from __future__ import annotations

from obsckpt.demo.job import DemoConfig, DemoResult, run_demo
from obsckpt.errors import DemoError

__all__ = ["DemoConfig", "DemoError", "DemoResult", "run_demo"]
