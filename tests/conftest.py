"""Shared fixtures: one local Ray cluster for the whole test session."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

# Workers inherit the driver's environment; keep Ray quiet and small.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A test process (or Ray worker) that exits with a deliberately hung save waits this
# long for it, not the default minute.
os.environ.setdefault("OBSCKPT_EXIT_WAIT_S", "5")


def worker_env() -> dict[str, str]:
    """Environment for Ray workers: they import test helper modules (tests/workers.py) by name."""
    tests_dir = str(Path(__file__).resolve().parent)
    pythonpath = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    return {"RAY_DEDUP_LOGS": "0", "PYTHONPATH": pythonpath}


def start_session_ray() -> None:
    """Start the session's local cluster (again, after a module that needed its own)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=32,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": worker_env()},
        )


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs one."""
    import ray

    start_session_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def namespace(ray_cluster) -> str:
    """A fresh Ray namespace per test, so named actors never collide."""
    return f"test-{uuid.uuid4().hex[:10]}"
