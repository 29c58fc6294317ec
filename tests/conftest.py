"""Shared fixtures: one local Ray cluster for the whole test session."""

from __future__ import annotations

import os
import uuid

import pytest

# Workers inherit the driver's environment; keep Ray quiet and small.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test that needs one."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            num_cpus=32,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture
def namespace(ray_cluster) -> str:
    """A fresh Ray namespace per test, so named actors never collide."""
    return f"test-{uuid.uuid4().hex[:10]}"
