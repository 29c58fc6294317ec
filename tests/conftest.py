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


def _s3_env() -> None:
    """Name the session's S3 server (tests/seaweed.py) in the standard AWS variables now,
    before any Ray cluster starts: its workers (a monitor on an s3:// root) inherit them."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from seaweed import S3_PORT_OWNER_VARIABLE, S3_PORT_VARIABLE, reserve_s3_port, session_aws_env

    # With pytest-xdist each worker is a session of its own, with its own server: a port
    # is reused only by the process that chose it and its children (which inherit both
    # variables), never by another worker (which inherits the controller's).
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    inherited = os.environ.get(S3_PORT_VARIABLE)
    if os.environ.get(S3_PORT_OWNER_VARIABLE, "") != worker:
        inherited = None
    port = int(inherited or reserve_s3_port())
    os.environ[S3_PORT_VARIABLE] = str(port)
    os.environ[S3_PORT_OWNER_VARIABLE] = worker
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        os.environ.pop(name, None)
    os.environ.update(session_aws_env(port))


_s3_env()
# One S3 server for the whole session (a fixture imported into two test modules would
# make two, both on the one port the AWS variables name).
from seaweed import seaweed_server_fixture  # noqa: E402,F401 - provides seaweed_server


def worker_env() -> dict[str, str]:
    """Environment for Ray workers: they import test helper modules (tests/workers.py) by name."""
    tests_dir = str(Path(__file__).resolve().parent)
    pythonpath = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    return {"RAY_DEDUP_LOGS": "0", "PYTHONPATH": pythonpath}


def start_session_ray() -> None:
    """Start the session's local cluster (again, after a module that needed its own)."""
    import ray

    if not ray.is_initialized():
        # The workers' environment is the raylet's, which inherits this process's while
        # ray.init starts it: set there, not as a runtime_env, which would start every
        # worker through Ray's setup_worker (0.2 s of CPU per actor, hundreds of actors).
        with pytest.MonkeyPatch.context() as mp:
            for name, value in worker_env().items():
                mp.setenv(name, value)
            ray.init(address="local", num_cpus=32, include_dashboard=False, log_to_driver=True)


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Record on the test whether its call failed (``item.obsckpt_failed``), for fixtures
    that share processes between tests and start them over after a failure."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.obsckpt_failed = report.failed


@pytest.fixture(scope="module")
def _module_actors(ray_cluster):
    held: dict[str, list] = {}
    yield held
    for actors in held.values():
        for actor in actors:
            ray_cluster.kill(actor)


@pytest.fixture
def shared_actors(_module_actors, request, ray_cluster):
    """``get(key, make)``: the actors ``make()`` returns, shared by a module's tests under
    ``key`` (starting processes that import torch and join a gloo group costs more than
    many tests do); made anew after a test that failed, when one may be stuck in a
    collective its peer left. A test that shares them starts them over itself."""
    used: list[str] = []

    def get(key: str, make):
        if key not in _module_actors:
            _module_actors[key] = list(make())
        used.append(key)
        return _module_actors[key]

    yield get
    if getattr(request.node, "obsckpt_failed", True):
        for key in used:
            for actor in _module_actors.pop(key, []):
                ray_cluster.kill(actor)
