"""Telemetry faults never touch training: an unreachable OTLP endpoint, a metrics port
that is taken, and a Prometheus that never scrapes."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid

import pytest
import ray
from metrics_helpers import closed_port
from reliability_helpers import (
    assert_root_consistent,
    rank_worker_class,
    report,
    scrape,
    trials,
    wait_for,
)

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy
from obsckpt.monitor import ACTOR_NAME
from obsckpt.store import layout, reader


def _latest(monitor) -> int | None:
    return ray.get(monitor.status.remote())["latest"]["checkpoint"]


class TestUnreachableCollector:
    """With OTEL_EXPORTER_OTLP_ENDPOINT pointing at a closed port, in the monitor and in a
    rank, every step commits on time; export failures are counted, not raised."""

    def test_steps_commit_while_exports_fail(self, ray_cluster, tmp_path):
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError as exc:
            pytest.fail(f"the OTLP exporter cannot be imported ({exc}): install the otlp extra")
        namespace = f"otlp-{uuid.uuid4().hex[:8]}"
        root = str(tmp_path / "root")
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed_port()}",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "1",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        options = dict(
            name=ACTOR_NAME,
            namespace=namespace,
            max_restarts=-1,
            max_concurrency=10_000,
            num_cpus=0,
            runtime_env={"env_vars": env},
        )
        monitor = (
            ray.remote(CheckpointMonitor)
            .options(**options)
            .remote(SaveStrategy.UNRESTRICTED, root, None, metrics_port=0, namespace=namespace)
        )
        worker = (
            rank_worker_class()
            .options(runtime_env={"env_vars": env})
            .remote(monitor, root, 0, 1, 1 << 16, trace=True)
        )
        ray.get(worker.pid.remote())  # started before the clock does
        trainer = CheckpointCoordinator(monitor)
        n_steps = trials(6)
        lags = []
        # Nothing scrapes /metrics during the run: Prometheus never scraping changes nothing.
        for step in range(1, n_steps + 1):
            t0 = time.monotonic()
            asyncio.run(trainer.register_and_monitor(step, checkpoint_thread_count=1))
            ray.get(worker.save.remote(step))
            assert ray.get(worker.wait.remote()) is None
            wait_for(lambda step=step: _latest(monitor) == step, 30, f"step {step} to commit")
            lags.append(time.monotonic() - t0)
        assert assert_root_consistent(root)["checkpoint"] == n_steps
        failures = wait_for(
            lambda: ray.get(monitor.status.remote())["span_export_failures"],
            30,
            "the monitor to count a failed span export",
        )
        s = scrape(ray.get(monitor.metrics_address.remote()))
        assert s.value("obsckpt_latest_step", kind="checkpoint") == n_steps
        assert s.total("obsckpt_saves_total", result="error") == 0
        report(
            "telemetry_otlp_unreachable",
            steps=n_steps,
            committed=n_steps,
            max_step_seconds=round(max(lags), 3),
            median_step_seconds=round(sorted(lags)[len(lags) // 2], 3),
            monitor_export_failures=failures,
        )
        ray.kill(worker, no_restart=True)
        ray.kill(monitor, no_restart=True)


class TestUnusableTracingConfiguration:
    """An OTLP exporter that cannot be built from the OTEL_* variables leaves the monitor
    without traces, not without a monitor: it starts and commits."""

    def test_monitor_starts_and_commits(self, ray_cluster, tmp_path):
        namespace = f"otlp-{uuid.uuid4().hex[:8]}"
        root = str(tmp_path / "root")
        env = {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd-9",  # not a value the exporter knows
        }
        monitor = (
            ray.remote(CheckpointMonitor)
            .options(
                name=ACTOR_NAME,
                namespace=namespace,
                max_restarts=0,
                num_cpus=0,
                runtime_env={"env_vars": env},
            )
            .remote(SaveStrategy.UNRESTRICTED, root, None, metrics_port=None, namespace=namespace)
        )
        assert _latest(monitor) is None
        coord = CheckpointCoordinator(monitor)
        asyncio.run(coord.register_and_monitor(1, checkpoint_thread_count=1))
        path = layout.step_dir(root, 1) / "model.bin"

        def save():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * 1024)

        coord.save_async("model", save, 1, paths=[path])
        coord.wait_all(timeout=30)
        wait_for(lambda: _latest(monitor) == 1, 30, "step 1 to commit")
        ray.kill(monitor, no_restart=True)


class TestMetricsPortTaken:
    """A metrics port already in use is reported in status(); the job runs without /metrics."""

    def test_port_in_use(self, ray_cluster, namespace, tmp_path):
        root = str(tmp_path / "root")
        with socket.socket() as blocker:
            blocker.bind(("0.0.0.0", 0))
            blocker.listen()
            port = blocker.getsockname()[1]
            monitor = CheckpointMonitor.get_actor(
                namespace=namespace, default_local_dir=root, metrics_port=port
            )
            status = ray.get(monitor.status.remote())
            assert ray.get(monitor.metrics_address.remote()) is None
            assert status["metrics"]["address"] is None
            error = status["metrics"]["error"]
            assert f"metrics port {port}" in error and "already in use" in error, error
            coord = CheckpointCoordinator(monitor)
            for step in (1, 2):
                asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=1))
                path = layout.step_dir(root, step) / "model.bin"

                def save(path=path):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(b"x" * 1024)

                coord.save_async("model", save, step, paths=[path])
                coord.wait_all(timeout=30)
                wait_for(lambda step=step: _latest(monitor) == step, 30, f"step {step} to commit")
            assert reader.verify_step(layout.step_dir(root, 2)) == []
        ray.kill(monitor, no_restart=True)
