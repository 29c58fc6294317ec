"""Telemetry overhead: what metrics and tracing add to a trivial ``save_async``, vs everything off.

Each configuration runs in a Ray actor of its own (a tracer provider is
per process and cannot be removed once installed), against a monitor of its
own: "on" is the production setup (the monitor's Prometheus metrics and
/metrics endpoint; tracing with a batch span processor, the worker inside the
step's span so ``save_async`` captures a real context); "off" is a monitor
whose metrics are a no-op object, no endpoint and no tracer provider.

The reported value is the total extra cost per save, wherever it is paid:

(a) caller: how long ``save_async`` blocks the calling thread (the training
    loop), on minus off, median over many calls in alternating batches. Its
    telemetry is capturing the trace context (formatted as a W3C carrier on
    the save thread).
(b) the background thread's ``obsckpt.save`` span (with the admission-wait
    check: a span is recorded only for waits of ``MIN_WAIT_SPAN_S`` or more,
    and an unrestricted admission never waits that long), timed directly in
    loops of ``telemetry_code_iters`` iterations in all, alternating batches,
    median of the batches, on minus off;
(c) the monitor: its real ``notify_started`` + ``notify_finished`` handlers
    for one save, run in this process on two monitor instances (Prometheus
    registry vs no-op metrics), alternating batches, on minus off.

Not in the value: exporting the spans (the exporter here sends nothing). What
OTLP's protobuf encoding of each ``obsckpt.save`` span costs the batch span
processor's thread is timed directly on the spans the run made and reported
beside the value.

A full save cycle (``save_async`` → background thread with two Ray RPCs →
``wait_all``) takes milliseconds on a 2-core machine and drifts with the load
of other processes by more than telemetry costs; its on-minus-off difference
is reported as a noisy cross-check, not as the value.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

from benchmarks.common import Result, Sizes, median

_SLOT = "bench"
_STEP = 1  # one step that is never submitted: the monitor's state stays the same size
_CODE_BATCHES = 10  # batches of the directly timed code paths, per configuration
_ENCODE_SPANS = 512  # the batch span processor's default export batch


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

    def observe(self, *args: Any, **kwargs: Any) -> None:
        """Metrics.observe (a histogram and its last-value gauge): nothing."""


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


def _per_call_us(fn, n: int) -> float:
    for _ in range(min(500, n)):
        fn()
    t0 = time.perf_counter_ns()
    for _ in range(n):
        fn()
    return (time.perf_counter_ns() - t0) / n / 1e3


class SaveLoop:
    """A worker process doing trivial saves, with telemetry on or off."""

    def __init__(self, monitor: Any, telemetry: bool) -> None:
        from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

        from obsckpt import CheckpointCoordinator
        from obsckpt.telemetry import tracing

        self.parent: Any = None
        self._spans: list = []
        if telemetry:
            kept = self._spans

            class Discard(SpanExporter):
                """Sends nothing; keeps the last spans, for timing their OTLP encoding."""

                def export(self, spans):
                    kept.extend(spans)
                    del kept[:-_ENCODE_SPANS]
                    return SpanExportResult.SUCCESS

            tracing.setup_tracing("obsckpt-bench", exporter=Discard())
            # The worker runs inside the step's span, as a traced training loop would:
            # save_async then captures a real context.
            self._step_span = tracing.checkpoint_span(_STEP)
            self._step_span.__enter__()
            self.parent = tracing.capture()
        self.coord = CheckpointCoordinator(monitor, rank=0)

    def run(self, n: int) -> tuple[list[int], list[int]]:
        """(ns blocked in ``save_async``, ns of the whole save cycle) per save."""
        coord = self.coord
        clock = time.perf_counter_ns
        calls, cycles = [], []
        for _ in range(n):
            t0 = clock()
            coord.save_async(_SLOT, _noop, _STEP)
            t1 = clock()
            coord.wait_all()
            t2 = clock()
            calls.append(t1 - t0)
            cycles.append(t2 - t0)
        return calls, cycles

    def telemetry_code_us(self, n: int) -> dict[str, float]:
        """Microseconds per save of each telemetry code path, as this process runs it."""
        from obsckpt.telemetry import tracing

        attrs = {
            "obsckpt.step": _STEP,
            "obsckpt.slot": _SLOT,
            "obsckpt.kind": "checkpoint",
            "obsckpt.rank": 0,
        }
        parent = self.parent

        def capture() -> None:  # save_async, on the caller's thread (part of (a))
            tracing.capture()

        def save_span(waited_ns: int) -> None:  # CheckpointCoordinator._run around one save
            carrier = tracing.as_carrier(parent)  # the save thread formats the carrier
            with tracing.span("obsckpt.save", carrier=carrier, attributes=attrs) as sp:
                end = time.time_ns()
                tracing.record_wait("obsckpt.admission_wait", end - waited_ns, end, attrs)
                sp.set_attribute("obsckpt.bytes", 0)

        out = {}
        spans = [sp for sp in self._spans if sp.name == "obsckpt.save"]
        if spans:
            try:
                from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
            except ImportError:  # the otlp extra is not installed
                encode_spans = None
            if encode_spans is not None:
                rounds = max(1, n // len(spans))
                t0 = time.perf_counter_ns()
                for _ in range(rounds):
                    encode_spans(spans).SerializePartialToString()
                out["otlp_encode_us"] = (time.perf_counter_ns() - t0) / rounds / len(spans) / 1e3
        return out | {
            "capture_us": _per_call_us(capture, n),
            # Uncontended (no admission-wait span), and a save that queued >= MIN_WAIT_SPAN_S.
            "save_span_us": _per_call_us(lambda: save_span(20_000), n),
            "save_span_with_wait_us": _per_call_us(lambda: save_span(5_000_000), n),
        }


def _monitor_handlers_us(root: str, iters: int, batches: int = 20) -> dict[str, float]:
    """Microseconds per save of the monitor's two handlers, real metrics and no-op metrics.

    Both monitors live in this process (no endpoint, no tracing: the monitor's
    only span is the commit's, once per step) and take turns in batches, so
    drift in the machine's load hits both alike. The step is never submitted,
    so the monitors' state stays the same size.
    """
    import asyncio

    from obsckpt.monitor import CheckpointMonitor

    quiet_cls = _monitor_classes()
    monitors = {
        "on": CheckpointMonitor("unrestricted", os.path.join(root, "on"), None, metrics_port=None),
        "off": quiet_cls("unrestricted", os.path.join(root, "off"), None, metrics_port=None),
    }
    pid = os.getpid()

    async def cycles(mon: Any, n: int) -> int:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            admitted = await mon.notify_started(
                "node",
                "job",
                step=_STEP,
                slot=_SLOT,
                kind="checkpoint",
                rank=0,
                pid=pid,
                lease=False,
            )
            await mon.notify_finished(
                _STEP,
                False,
                ticket=admitted["ticket"],
                slot=_SLOT,
                rank=0,
                ok=True,
                duration_s=0.001,
                nbytes=0,
                join_wait_s=0.0,
                files=[],
            )
        return time.perf_counter_ns() - t0

    async def measure() -> dict[str, float]:
        per = max(50, iters // batches)
        for mon in monitors.values():
            await cycles(mon, min(500, per))
        spent = {"on": [], "off": []}
        for i in range(batches):
            for name in ("on", "off") if i % 2 == 0 else ("off", "on"):
                spent[name].append(await cycles(monitors[name], per) / per / 1e3)
        return {name: median(v) for name, v in spent.items()}

    try:
        return asyncio.run(measure())
    finally:
        for mon in monitors.values():
            mon.server.close()


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
    samples: dict[str, dict[str, list[int]]] = {
        "on": {"call": [], "cycle": []},
        "off": {"call": [], "cycle": []},
    }
    batch = min(50, sizes.telemetry_calls)
    batches = max(2, sizes.telemetry_calls * sizes.telemetry_reps // batch)
    for i in range(batches):
        for name, actor in (("off", off), ("on", on)) if i % 2 == 0 else (("on", on), ("off", off)):
            calls, cycles = ray.get(actor.run.remote(batch))
            samples[name]["call"].extend(calls)
            samples[name]["cycle"].extend(cycles)
        if (i + 1) % max(1, batches // 4) == 0:
            log(
                f"  telemetry {i + 1}/{batches} batches: save_async blocks on "
                f"{median(samples['on']['call']) / 1e3:.1f} us, off "
                f"{median(samples['off']['call']) / 1e3:.1f} us"
            )
    # One actor at a time: the two loops must not compete for the cores. Alternating
    # batches, as the calls above: a burst of load on the machine then hits both
    # configurations, not whichever ran during it.
    iters = sizes.telemetry_code_iters
    code_runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    per_batch = max(50, iters // _CODE_BATCHES)
    for i in range(_CODE_BATCHES):
        for name, actor in (("on", on), ("off", off)) if i % 2 == 0 else (("off", off), ("on", on)):
            code_runs[name].append(ray.get(actor.telemetry_code_us.remote(per_batch)))
    # Encoding runs only where spans were made (telemetry on): not an on-minus-off part.
    encodes = [run.pop("otlp_encode_us") for run in code_runs["on"] if "otlp_encode_us" in run]
    code_on, code_off = (
        {k: median([run[k] for run in code_runs[name]]) for k in code_runs[name][0]}
        for name in ("on", "off")
    )
    for handle in (on, off, mon_on, mon_off):
        ray.kill(handle)
    handlers = _monitor_handlers_us(os.path.join(bench_dir, "telemetry-handlers"), iters)
    for root in (root_on, root_off, os.path.join(bench_dir, "telemetry-handlers")):
        shutil.rmtree(root, ignore_errors=True)

    med = {k: {m: median(v[m]) / 1e3 for m in v} for k, v in samples.items()}
    extra = {k: code_on[k] - code_off[k] for k in code_on}
    caller_us = med["on"]["call"] - med["off"]["call"]
    background_us = extra["save_span_us"]
    monitor_us = handlers["on"] - handlers["off"]
    # A part measured below zero is noise, not a saving: it does not reduce the total.
    total = max(0.0, caller_us) + max(0.0, background_us) + max(0.0, monitor_us)
    log(
        f"  telemetry per save: caller {caller_us:.1f} us + save thread {background_us:.1f} us "
        f"+ monitor {monitor_us:.1f} us = {total:.1f} us"
    )
    r1 = lambda x: round(x, 1)  # noqa: E731
    return Result(
        "telemetry_overhead_us",
        total,
        "<=",
        50,
        unit="us/save",
        limit="Python work of the OTel SDK span and prometheus_client updates per save",
        details={
            "measure": "caller_extra_us + save_thread_extra_us + monitor_extra_us (a part "
            "measured below zero counts as 0): what telemetry adds per save, on the caller's "
            "thread, the save thread and the monitor",
            "caller_extra_us": r1(caller_us),
            "caller_note": "median time save_async blocks the caller, on minus off. Its own "
            "telemetry is one context read (capture_extra_us, timed directly); the carrier "
            "is formatted on the save thread (in save_thread_extra_us). The save goes to a "
            "kept thread through a queue, so the caller does not wait for the save thread",
            "save_async_on_us": r1(med["on"]["call"]),
            "save_async_off_us": r1(med["off"]["call"]),
            "save_thread_extra_us": r1(background_us),
            "save_thread_note": "formatting the carrier, the obsckpt.save span (batch span "
            "processor), the admission-wait check (no span below MIN_WAIT_SPAN_S) and its attributes, timed "
            f"directly in {_CODE_BATCHES} alternating batches of {per_batch} iterations per "
            "configuration, median of the batches, on minus off",
            "save_thread_on_samples_us": [r1(r["save_span_us"]) for r in code_runs["on"]],
            "save_thread_off_samples_us": [r1(r["save_span_us"]) for r in code_runs["off"]],
            "monitor_extra_us": r1(monitor_us),
            "monitor_note": "the monitor's notify_started + notify_finished handlers for "
            "one save, run in-process on two monitors (Prometheus registry vs no-op "
            "metrics) in alternating batches, on minus off",
            "monitor_handlers_on_us": r1(handlers["on"]),
            "monitor_handlers_off_us": r1(handlers["off"]),
            "otlp_export_encode_us": r1(median(encodes)) if encodes else None,
            "total_with_otlp_encode_us": r1(total + median(encodes)) if encodes else None,
            "export_note": "not in the value: spans go to an exporter that sends nothing. "
            "With OTLP, the batch span processor's thread also encodes each obsckpt.save "
            "span to protobuf (otlp_export_encode_us, timed directly on the spans this "
            f"run made, in batches of up to {_ENCODE_SPANS}) and sends it, in the trainer's "
            "process and under its GIL",
            "capture_extra_us": r1(extra["capture_us"]),
            "save_span_with_wait_extra_us": r1(extra["save_span_with_wait_us"]),
            "code_on_us": {k: r1(v) for k, v in code_on.items()},
            "code_off_us": {k: r1(v) for k, v in code_off.items()},
            "save_cycle_extra_us": r1(med["on"]["cycle"] - med["off"]["cycle"]),
            "save_cycle_on_us": r1(med["on"]["cycle"]),
            "save_cycle_off_us": r1(med["off"]["cycle"]),
            "save_cycle_note": "save_async to wait_all (a thread start and two Ray RPCs): "
            "the wall-clock difference drifts with machine load by more than telemetry "
            "costs; a cross-check only",
            "saves_per_config": len(samples["on"]["cycle"]),
            "batches": batches,
            "on": "Prometheus metrics + /metrics endpoint in the monitor; OTel tracing "
            "(BatchSpanProcessor) in the worker, inside the step's span",
            "off": "no-op metrics, no endpoint, no tracer provider",
        },
    )
