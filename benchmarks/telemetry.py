"""Telemetry overhead: a trivial ``save_async`` with metrics and tracing on, vs everything off.

Each configuration runs in a Ray actor of its own (a tracer provider is
per process and cannot be removed once installed), against a monitor of its
own: "on" is the production setup (the monitor's Prometheus metrics and
/metrics endpoint; tracing with a batch span processor and the step's trace
context passed in); "off" is a monitor whose metrics are a no-op object, no
endpoint and no tracer provider. A save is a full cycle, ``save_async`` →
background thread (admission RPC, save, finish RPC) → ``wait_all``, so every
span and metric update of a save is inside it.

A save cycle (a thread start and two Ray RPCs) takes milliseconds on a 2-core
machine and its wall-clock time drifts with the load of other processes by
more than the telemetry costs, so the two configurations alternate in small
batches many times over, and the overhead is the difference of the medians of
all their save cycles. The in-process cost of the telemetry code itself (the
worker's spans, the monitor's metric updates per save) is measured too and
reported alongside, as the floor under that difference.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.common import Result, Sizes, median

_SLOT = "bench"
_STEP = 1  # one step that is never submitted: the monitor's state stays the same size


class _Null:
    """Stands in for every metric: ``labels()`` returns itself, updates do nothing."""

    def labels(self, *args, **kwargs):
        return self

    def inc(self, *args, **kwargs) -> None:
        pass

    dec = set = observe = inc


class _NullMetrics:
    def __init__(self) -> None:
        self.registry = None

    def __getattr__(self, name: str) -> Any:
        return _Null()


def _monitor_classes():
    from obsckpt.monitor import CheckpointMonitor

    class QuietMonitor(CheckpointMonitor):
        """The monitor with its metrics replaced by no-ops (telemetry off)."""

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.metrics = _NullMetrics()

    return QuietMonitor


def _noop() -> None:
    return None


class SaveLoop:
    """A worker process doing trivial saves, with telemetry on or off."""

    def __init__(self, monitor: Any, telemetry: bool) -> None:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        from obsckpt import CheckpointCoordinator
        from obsckpt.telemetry import tracing

        self.carrier = None
        if telemetry:

            class Discard(SpanExporter):
                def export(self, spans):
                    return SpanExportResult.SUCCESS

            tracing.setup_tracing("obsckpt-bench", exporter=Discard())
            with tracing.checkpoint_span(_STEP) as carrier:
                self.carrier = carrier
        self.coord = CheckpointCoordinator(monitor, rank=0)

    def run(self, n: int) -> tuple[list[float], list[float]]:
        """(seconds in ``save_async``, seconds of the save cycle) per save."""
        coord = self.coord
        calls, cycles = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            coord.save_async(_SLOT, _noop, _STEP, trace_context=self.carrier)
            t1 = time.perf_counter()
            coord.wait_all()
            t2 = time.perf_counter()
            calls.append(t1 - t0)
            cycles.append(t2 - t0)
        return calls, cycles

    def telemetry_code_us(self, n: int) -> dict[str, float]:
        """Microseconds per save of the telemetry code alone, as the worker and monitor run it."""
        from prometheus_client import CollectorRegistry

        from obsckpt.telemetry import tracing
        from obsckpt.telemetry.metrics import Metrics

        attrs = {
            "obsckpt.step": _STEP,
            "obsckpt.slot": _SLOT,
            "obsckpt.kind": "checkpoint",
            "obsckpt.rank": 0,
        }

        def spans() -> None:  # what CheckpointCoordinator._run adds around one save
            with tracing.span("obsckpt.save", carrier=self.carrier, attributes=attrs) as sp:
                with tracing.span("obsckpt.admission_wait", attributes=attrs):
                    tracing.inject()
                sp.set_attribute("obsckpt.bytes", 0)

        m = Metrics(CollectorRegistry())

        def metrics() -> None:  # what the monitor records for one save (two notifications)
            m.saves_in_flight.labels("checkpoint").inc()
            m.admission_wait.labels("unrestricted").observe(0.0)
            m.saves_in_flight.labels("checkpoint").dec()
            m.saves.labels(_SLOT, "checkpoint", "ok").inc()
            m.save_duration.labels(_SLOT, "checkpoint").observe(0.001)
            m.rank_last_save_duration.labels("0", _SLOT).set(0.001)
            m.join_wait.labels(_SLOT).observe(0.0)
            for _ in range(2):  # gauges refreshed after each notification
                for kind in ("checkpoint", "state_dict"):
                    m.pending_steps.labels(kind).set(1)
                    m.oldest_pending_start.labels(kind).set(0)

        out = {}
        for name, fn in (("spans_us", spans), ("metrics_us", metrics)):
            for _ in range(200):
                fn()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[name] = (time.perf_counter() - t0) / n * 1e6
        return out


def run_telemetry_overhead(sizes: Sizes, bench_dir: str, namespace: str, log) -> Result:
    import ray

    from obsckpt.monitor import CheckpointMonitor

    quiet_cls = _monitor_classes()
    root_on = os.path.join(bench_dir, "telemetry-on")
    root_off = os.path.join(bench_dir, "telemetry-off")
    options = dict(max_concurrency=10_000, num_cpus=0)
    mon_on = (
        ray.remote(CheckpointMonitor)
        .options(name="checkpoint_monitor", namespace=f"{namespace}-on", **options)
        .remote("unrestricted", root_on, None, metrics_port=0, trace_exporter="memory")
    )
    mon_off = (
        ray.remote(quiet_cls)
        .options(name="checkpoint_monitor", namespace=f"{namespace}-off", **options)
        .remote("unrestricted", root_off, None, metrics_port=None)
    )
    loop_cls = ray.remote(num_cpus=0)(SaveLoop)
    on = loop_cls.remote(mon_on, True)
    off = loop_cls.remote(mon_off, False)
    warm = max(5, sizes.telemetry_calls // 5)
    ray.get([on.run.remote(warm), off.run.remote(warm)])
    samples: dict[str, dict[str, list[float]]] = {
        "on": {"call": [], "cycle": []},
        "off": {"call": [], "cycle": []},
    }
    batch = min(50, sizes.telemetry_calls)
    batches = max(1, sizes.telemetry_calls * sizes.telemetry_reps // batch)
    for i in range(batches):
        for name, actor in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
            calls, cycles = ray.get(actor.run.remote(batch))
            samples[name]["call"].extend(calls)
            samples[name]["cycle"].extend(cycles)
        if (i + 1) % max(1, batches // 4) == 0:
            log(
                f"  telemetry {i + 1}/{batches} batches: save cycle median on "
                f"{median(samples['on']['cycle']) * 1e6:.0f} us, off "
                f"{median(samples['off']['cycle']) * 1e6:.0f} us"
            )
    code = ray.get(on.telemetry_code_us.remote(min(2000, 10 * sizes.telemetry_calls)))
    for handle in (on, off, mon_on, mon_off):
        ray.kill(handle)
    med = {k: {m: median(v[m]) * 1e6 for m in v} for k, v in samples.items()}
    return Result(
        "telemetry_overhead_us",
        med["on"]["cycle"] - med["off"]["cycle"],
        "<=",
        50,
        unit="us/save",
        limit="Python-level span and metric work per save (2 Ray RPCs per save are common to both)",
        details={
            "measure": "median save cycle (save_async to wait_all) with telemetry on minus off",
            "saves_per_config": len(samples["on"]["cycle"]),
            "batches": batches,
            "in_process_spans_us": round(code["spans_us"], 1),
            "in_process_metrics_us": round(code["metrics_us"], 1),
            "save_cycle_on_us": round(med["on"]["cycle"], 1),
            "save_cycle_off_us": round(med["off"]["cycle"], 1),
            "save_async_call_on_us": round(med["on"]["call"], 1),
            "save_async_call_off_us": round(med["off"]["call"], 1),
            "save_async_call_extra_us": round(med["on"]["call"] - med["off"]["call"], 1),
            "on": "Prometheus metrics + /metrics endpoint in the monitor; OTel tracing "
            "(BatchSpanProcessor) in the worker, step trace context passed",
            "off": "no-op metrics, no endpoint, no tracer provider",
        },
    )
