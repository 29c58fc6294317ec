"""Spans: one trace per step across trainer, worker threads and the monitor actor."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
import ray
from opentelemetry.sdk.trace.export import SpanExportResult
from workers import SaveWorker

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy
from obsckpt.store import reader
from obsckpt.telemetry import tracing
from obsckpt.telemetry.tracing import SafeExporter


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter whose only OTEL_* variables are ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )


def wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def by_name(spans, name):
    return [s for s in spans if s["name"] == name]


class TestTraceAcrossRay:
    """The monitor's commit and every rank's save are children of the trainer's step span."""

    def test_parent_child_across_ray_calls(self, namespace, tmp_path):
        assert tracing.setup_tracing("test-trainer", exporter="memory")
        tracing.clear_finished_spans()
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            save_strategy=SaveStrategy.SINGLE_THREAD,  # the second rank waits its turn
            default_local_dir=str(root),
            metrics_port=None,
            trace_exporter="memory",
        )
        workers = [SaveWorker.remote(namespace, rank, trace=True) for rank in range(2)]
        coord = CheckpointCoordinator(monitor)
        with tracing.checkpoint_span(3) as carrier:
            assert "traceparent" in carrier
            # Rank 0 holds the only admission until rank 1 is seen queueing behind it.
            ray.get(workers[0].save.remote(str(root), 3, ["model"], carrier=carrier, gated=True))
            wait_for(lambda: ray.get(monitor.status.remote())["in_flight"], "rank 0 admitted")
            ray.get(workers[1].save.remote(str(root), 3, ["model"], carrier=carrier))
            wait_for(lambda: ray.get(monitor.status.remote())["admission_waiting"], "rank 1 queued")
            time.sleep(0.1)
            ray.get(workers[0].release.remote("model", 3))
            asyncio.run(coord.register_and_monitor(3, checkpoint_thread_count=2))
        assert ray.get([w.wait.remote() for w in workers]) == [None, None]
        assert reader.read_iteration(root, "checkpoint") == 3

        [step_span] = by_name(tracing.finished_spans(), "obsckpt.checkpoint")
        assert step_span["attributes"] == {"obsckpt.step": 3, "obsckpt.kind": "checkpoint"}
        worker_spans = [s for w in workers for s in ray.get(w.spans.remote())]
        saves = by_name(worker_spans, "obsckpt.save")
        assert len(saves) == 2
        for save in saves:
            assert save["trace_id"] == step_span["trace_id"]
            assert save["parent_span_id"] == step_span["span_id"]
            attrs = save["attributes"]
            assert attrs["obsckpt.step"] == 3 and attrs["obsckpt.slot"] == "model"
            assert attrs["obsckpt.kind"] == "checkpoint" and attrs["obsckpt.bytes"] > 0
        assert sorted(s["attributes"]["obsckpt.rank"] for s in saves) == [0, 1]
        # Only a wait that lasted is recorded: the rank that queued behind the other, and
        # rank 0's own admission only if a loaded machine made it last (>= 1 ms).
        rank_of = {s["span_id"]: s["attributes"]["obsckpt.rank"] for s in saves}
        waits = by_name(worker_spans, "obsckpt.admission_wait")
        lasted = {rank_of[w["parent_span_id"]]: w["end_time"] - w["start_time"] for w in waits}
        assert len(lasted) == len(waits) and lasted.get(1, 0) >= 0.1e9, lasted
        assert all(ns >= tracing.MIN_WAIT_SPAN_S * 1e9 for ns in lasted.values()), lasted

        [commit_span] = by_name(ray.get(monitor.debug_spans.remote()), "obsckpt.commit")
        assert commit_span["trace_id"] == step_span["trace_id"]
        assert commit_span["parent_span_id"] == step_span["span_id"]
        assert commit_span["attributes"] == {"obsckpt.step": 3, "obsckpt.kind": "checkpoint"}

    def test_failed_save_span_has_error_status(self, namespace, tmp_path):
        tracing.setup_tracing("test-trainer", exporter="memory")
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(root), metrics_port=None
        )
        worker = SaveWorker.remote(namespace, 0, trace=True)
        ray.get(worker.save.remote(str(root), 1, ["optim"], fail_slots=("optim",)))
        assert "No space left" in ray.get(worker.wait.remote())
        [save] = by_name(ray.get(worker.spans.remote()), "obsckpt.save")
        assert save["status"] == "ERROR"
        [failed] = ray.get(monitor.status.remote())["failed"]
        assert failed["step"] == 1 and "No space left" in failed["error"]


class TestNoTracing:
    """Without setup_tracing no provider is installed and spans cost next to nothing."""

    def test_fresh_process_has_no_provider(self):
        code = (
            "from opentelemetry import trace\n"
            "from opentelemetry.trace import ProxyTracerProvider\n"
            "from obsckpt.telemetry import tracing\n"
            "import obsckpt\n"
            "assert not tracing.enabled()\n"
            "assert tracing.inject() == {}\n"
            "with tracing.span('obsckpt.save') as s: assert not s.is_recording()\n"
            "assert isinstance(trace.get_tracer_provider(), ProxyTracerProvider)\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    def test_disabled_by_environment(self):
        code = (
            "import os\n"
            "os.environ['OTEL_SDK_DISABLED'] = 'true'\n"
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing() is False and not tracing.enabled()\n"
            "os.environ['OTEL_SDK_DISABLED'] = ''\n"
            "os.environ['OTEL_TRACES_EXPORTER'] = 'none'\n"
            "assert tracing.setup_tracing() is False and not tracing.enabled()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

    def test_setup_without_configuration_sends_nothing(self):
        # The monitor and the demo's workers trace only when an OTEL_* variable asks;
        # the trainer's setup_tracing() follows the same rule, or a job without a
        # collector retries exports to localhost:4318 and waits on them at exit.
        code = (
            "import logging, time\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('trainer') is False\n"
            "assert not tracing.enabled() and tracing.inject() == {}\n"
            "with tracing.checkpoint_span(1) as carrier: assert carrier == {}\n"
            "print(time.monotonic())\n"
        )
        proc = run_python(code)
        exited = time.monotonic()
        assert "4318" not in proc.stderr and "Transient error" not in proc.stderr, proc.stderr
        assert exited - float(proc.stdout.split()[-1]) < 3.0

    def test_endpoint_alone_turns_tracing_on(self):
        code = (
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('trainer') is True\n"
            "with tracing.checkpoint_span(1) as carrier: assert 'traceparent' in carrier\n"
        )
        run_python(
            code,
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT="http://127.0.0.1:9/v1/traces",
            OTEL_EXPORTER_OTLP_TIMEOUT="1",
        )


class TestSetupTracing:
    """setup_tracing honours the OTEL_* variables and can be called more than once."""

    def test_second_call_does_not_export_spans_twice(self):
        code = (
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('trainer', exporter='console')\n"
            "assert tracing.setup_tracing('trainer', exporter='console')\n"
            "with tracing.span('obsckpt.save'): pass\n"
        )
        out = run_python(code).stdout
        assert out.count('"name": "obsckpt.save"') == 1, out

    def test_provider_configured_by_the_application_exports_once(self):
        # opentelemetry-instrument builds its provider from the same OTEL_* variables;
        # exporters added for them again would send every span twice.
        code = (
            "from opentelemetry import trace\n"
            "from opentelemetry.sdk.trace import TracerProvider\n"
            "from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor\n"
            "from opentelemetry.sdk.trace.export.in_memory_span_exporter import (\n"
            "    InMemorySpanExporter)\n"
            "provider = TracerProvider()\n"
            "provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))\n"
            "trace.set_tracer_provider(provider)\n"
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('trainer') is True\n"
            "assert tracing.setup_tracing('trainer') is True\n"
            "with tracing.checkpoint_span(1) as carrier: assert 'traceparent' in carrier\n"
            "explicit = InMemorySpanExporter()\n"
            "assert tracing.setup_tracing('trainer', exporter=explicit)\n"
            "with tracing.span('obsckpt.save'): pass\n"
            "provider.force_flush()\n"
            "assert [s.name for s in explicit.get_finished_spans()] == ['obsckpt.save']\n"
        )
        out = run_python(code, OTEL_TRACES_EXPORTER="console").stdout
        assert out.count('"name": "obsckpt.checkpoint"') == 1, out
        assert out.count('"name": "obsckpt.save"') == 1, out

    def test_service_name_from_resource_attributes(self):
        code = (
            "from opentelemetry import trace\n"
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('obsckpt-monitor', exporter='memory')\n"
            "print(trace.get_tracer_provider().resource.attributes['service.name'])\n"
        )
        out = run_python(code, OTEL_RESOURCE_ATTRIBUTES="service.name=rl-job,team=infra").stdout
        assert out.split() == ["rl-job"]
        assert run_python(code).stdout.split() == ["obsckpt-monitor"]

    def test_exporter_that_cannot_be_built_is_logged_not_raised(self):
        code = (
            "from obsckpt.telemetry import tracing\n"
            "assert tracing.setup_tracing('obsckpt-monitor') is False\n"
            "with tracing.span('obsckpt.save') as s: assert not s.is_recording()\n"
        )
        proc = run_python(
            code,
            OTEL_TRACES_EXPORTER="otlp",
            OTEL_EXPORTER_OTLP_PROTOCOL="grpc",
            OTEL_EXPORTER_OTLP_COMPRESSION="zstd-9",
        )
        assert "obsckpt" in proc.stderr and "zstd-9" in proc.stderr, proc.stderr


class TestExporterFailures:
    """An exporter that raises is logged and counted, never raised into training."""

    def test_safe_exporter_swallows_and_counts(self):
        class Broken:
            def export(self, spans):
                raise ConnectionError("collector unreachable")

            def shutdown(self):
                raise ConnectionError("still unreachable")

        safe = SafeExporter(Broken())
        assert safe.export([]).name == "FAILURE"
        assert safe.export([]).name == "FAILURE"
        assert safe.failures == 2
        safe.shutdown()  # does not raise

    def test_failed_result_is_logged_once_and_counted(self, caplog):
        class Refused:
            def export(self, spans):
                return SpanExportResult.FAILURE

        safe = SafeExporter(Refused())
        with caplog.at_level(logging.WARNING, logger="obsckpt.telemetry.tracing"):
            for _ in range(3):
                assert safe.export([]) is SpanExportResult.FAILURE
        assert safe.failures == 3
        [record] = caplog.records
        assert "Refused" in record.getMessage()


class TestRequested:
    """requested() says whether setup_tracing would install an exporter."""

    @pytest.mark.parametrize(
        ("env", "exporter", "expected"),
        [
            ({}, None, False),
            ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, None, True),
            ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, None, True),
            ({"OTEL_TRACES_EXPORTER": "console"}, None, True),
            ({"OTEL_TRACES_EXPORTER": "none"}, None, False),
            (
                {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"},
                None,
                False,
            ),
            ({}, "memory", True),
            ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, None, False),
        ],
    )
    def test_rule(self, monkeypatch, env, exporter, expected):
        for name in (
            "OTEL_SDK_DISABLED",
            "OTEL_TRACES_EXPORTER",
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        ):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert tracing.requested(exporter) is expected


class TestFlush:
    """tracing.flush() returns within its timeout, even when the exporter hangs."""

    def test_flush_with_a_hung_exporter_returns_in_time(self):
        code = """
import os, threading, time
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from obsckpt.telemetry import tracing

class Hung(SpanExporter):  # a collector that accepts the connection and never answers
    def export(self, spans):
        threading.Event().wait(60)
        return SpanExportResult.SUCCESS

tracing.setup_tracing("flush-test", exporter=Hung())
for i in range(2000):
    with tracing.span("obsckpt.save", attributes={"i": i}):
        pass
t0 = time.monotonic()
ok = tracing.flush(0.5)
print(ok, round(time.monotonic() - t0, 2), flush=True)
os._exit(0)  # the SDK's exit hook would flush again, into the same hung exporter
"""
        out = run_python(code).stdout.split()
        assert out[0] == "False"
        assert float(out[1]) < 3.0, out

    def test_a_provider_that_gives_up_in_time_is_not_taken_as_flushed(self, monkeypatch):
        # Older SDKs' force_flush returns on time, saying False, for spans it could not send.
        class GivesUp:
            def force_flush(self, timeout_millis: int = 30000) -> bool:
                return False

        monkeypatch.setattr(tracing.trace, "get_tracer_provider", lambda: GivesUp())
        assert tracing.flush(2.0) is False

    def test_flush_with_a_working_exporter_exports_everything(self):
        code = """
import os
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from obsckpt.telemetry import tracing

got = []
class Keep(SpanExporter):
    def export(self, spans):
        got.extend(spans)
        return SpanExportResult.SUCCESS

tracing.setup_tracing("flush-test", exporter=Keep())
for i in range(1500):
    with tracing.span("obsckpt.save", attributes={"i": i}):
        pass
print(tracing.flush(10.0), len(got), flush=True)
os._exit(0)
"""
        assert run_python(code).stdout.split() == ["True", "1500"]


class TestCarriers:
    """as_carrier gives each captured context its own carrier, however often it is asked."""

    def test_each_context_gets_its_own_carrier(self):
        code = """
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from obsckpt.telemetry import tracing

class Discard(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS

tracing.setup_tracing("carrier-test", exporter=Discard())
contexts = []
for step in (1, 2):
    with tracing.checkpoint_span(step):
        contexts.append(tracing.capture())
seen = [tracing.as_carrier(c)["traceparent"] for c in contexts + contexts[::-1] + contexts]
expected = [tracing.inject(c)["traceparent"] for c in contexts + contexts[::-1] + contexts]
carrier = tracing.as_carrier(contexts[0])
carrier["traceparent"] = "changed by the caller"
print(seen == expected, len(set(seen)), tracing.as_carrier(contexts[0]) != carrier)
"""
        assert run_python(code).stdout.split() == ["True", "2", "True"]


def test_spans_leave_the_jobs_python_rng_alone():
    """Span ids come from obsckpt's own generator, not Python's global ``random``: a span
    made by a background save must not move the training job's RNG stream (a resumed job
    would otherwise draw other numbers than the uninterrupted one)."""
    script = (
        "import random\n"
        "from obsckpt.telemetry import tracing\n"
        "assert tracing.setup_tracing(exporter='memory')\n"
        "random.seed(1); want = [random.random() for _ in range(3)]\n"
        "random.seed(1)\n"
        "with tracing.span('obsckpt.save'):\n"
        "    pass\n"
        "assert [random.random() for _ in range(3)] == want\n"
        "assert len(tracing.finished_spans()) == 1\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
