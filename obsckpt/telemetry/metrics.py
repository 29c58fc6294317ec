"""Every Prometheus metric and OpenTelemetry span obsckpt emits, defined once.

Dashboards, alert rules and users' own queries depend on these names; they
change only deliberately. ``python -m obsckpt.telemetry.reference`` prints the
reference page ``docs/metrics.md`` from the definitions below (``make metrics-doc``).
The label values and the checks on what callers send are
:mod:`obsckpt.telemetry.vocabulary`'s; they are importable from here too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from obsckpt.telemetry.vocabulary import (
    BACKENDS,
    BROADCAST_BACKENDS,
    CUDA_IPC,
    DEFAULT_MAX_SLOT_LABELS,
    DELTA_METHODS,
    FAILURE_REASONS,
    GLOO,
    IPC_BACKENDS,
    KNOWN_LABELS,
    NCCL,
    OVERFLOW_SLOT,
    RESULTS,
    ROLES,
    ROLLOUT,
    SHM,
    SYNC_CHECKS,
    SYNC_ENCODINGS,
    SYNC_METHODS,
    SYNC_PHASES,
    TRAINER,
    validate_bytes,
    validate_max_slot_labels,
    validate_role,
    validate_seconds,
    validate_sync_labels,
    validate_weight_sync,
)

__all__ = [
    "BACKENDS",
    "BROADCAST_BACKENDS",
    "CUDA_IPC",
    "DEFAULT_MAX_SLOT_LABELS",
    "DELTA_METHODS",
    "DURATION_BUCKETS",
    "FAILURE_REASONS",
    "GLOO",
    "IPC_BACKENDS",
    "METRICS",
    "NCCL",
    "OVERFLOW_SLOT",
    "RESULTS",
    "ROLES",
    "ROLLOUT",
    "SHM",
    "SPANS",
    "SYNC_CHECKS",
    "SYNC_ENCODINGS",
    "SYNC_METHODS",
    "SYNC_PHASES",
    "TRAINER",
    "MetricSpec",
    "Metrics",
    "SpanSpec",
    "UnlabelledLastValue",
    "disable_created_series",
    "validate_bytes",
    "validate_max_slot_labels",
    "validate_role",
    "validate_seconds",
    "validate_sync_labels",
]

from obsckpt.telemetry.specs import DURATION_BUCKETS, METRICS, SPANS, MetricSpec, SpanSpec

_TYPES = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class UnlabelledLastValue(Collector):
    """An unlabelled gauge with no sample until its first :meth:`set`.

    prometheus_client's ``Gauge`` without labels is served at 0 from its creation,
    which for a last-value gauge would read as a measurement of 0 s. Labelled
    last-value gauges are plain ``Gauge`` objects: a labelled series exists only
    once ``labels()`` is called.
    """

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self._name = name
        self._documentation = documentation
        self._value: float | None = None
        self._lock = threading.Lock()
        registry.register(self)

    def set(self, value: float) -> None:
        with self._lock:
            self._value = float(value)

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [GaugeMetricFamily(self._name, self._documentation)]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._documentation)
        with self._lock:
            if self._value is not None:
                family.add_metric([], self._value)
        return [family]


def disable_created_series() -> None:
    """Stop prometheus_client from exporting ``*_created`` series in this process.

    They double every counter and histogram and no dashboard uses them. The
    switch is global to the process, so only processes obsckpt owns (its
    actors) call this; importing obsckpt leaves a user's own metrics alone.
    """
    prometheus_client.disable_created_metrics()


class Metrics:
    """The metric objects of one registry; the monitor owns one of these.

    Args:
        registry: where to register; tests pass a fresh ``CollectorRegistry()``.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        # Histogram (or counter) attr -> the gauge holding its last observation.
        self._last: dict[str, Gauge | UnlabelledLastValue] = {}
        for spec in METRICS:
            if spec.last_of is not None and not spec.labels:
                metric = UnlabelledLastValue(spec.name, spec.help, self.registry)
            else:
                cls = _TYPES[spec.type]
                # prometheus_client appends _total itself; pass the stem.
                name = spec.name.removesuffix("_total") if spec.type == "counter" else spec.name
                kwargs = {"buckets": DURATION_BUCKETS} if spec.type == "histogram" else {}
                metric = cls(name, spec.help, spec.labels, registry=self.registry, **kwargs)
            setattr(self, spec.attr, metric)
            if spec.last_of is not None:
                self._last[spec.last_of] = metric
            else:
                self._zero_known_series(spec, metric)

    def observe(self, histogram: str, seconds: float, *labels: str) -> None:
        """Observe ``seconds`` in the histogram named by its attr, e.g. ``"commit_lag"``,
        under ``labels``; its last-value gauge, if it has one, is set to ``seconds`` too.
        """
        metric = getattr(self, histogram)
        (metric.labels(*labels) if labels else metric).observe(seconds)
        self._set_last(histogram, seconds, labels)

    def add(self, counter: str, amount: float, *labels: str) -> None:
        """Add ``amount`` to the counter named by its attr, e.g. ``"broadcast_bytes"``,
        under ``labels``; its last-value gauge, if it has one, is set to ``amount`` too.
        """
        metric = getattr(self, counter)
        (metric.labels(*labels) if labels else metric).inc(amount)
        self._set_last(counter, amount, labels)

    def weight_sync(self, report: Mapping[str, Any]) -> None:
        """Record one delta-capable weight sync (a :class:`~obsckpt.sync.DeltaSyncResult`'s report).

        Raises:
            ValueError: a field a metric cannot take (:func:`validate_weight_sync`).
        """
        validate_weight_sync(report)
        method, encoding = report["method"], report["encoding"]
        for phase, seconds in (report.get("phases") or {}).items():
            self.observe("weight_sync_phase", seconds, method, phase)
        self.add("weight_sync_sent_bytes", report["sent_bytes"], method, encoding)
        self.add("weight_sync_state_bytes", report["state_bytes"], method, encoding)
        if report.get("changed_fraction") is not None:
            self.weight_sync_changed_fraction.labels(method).set(report["changed_fraction"])
        self.observe("rollout_pause", report.get("pause_s") or 0.0, method)
        if report.get("corrupt") is not None:
            self.weight_sync_corrupt.labels(method, report["corrupt"]).inc()
        step, rollout = report.get("step"), report.get("rollout_version")
        if step is not None:
            self.model_version.labels(TRAINER).set(step)
        if step is not None and rollout is not None:
            # A receiver that holds no version at all lags by every version so far.
            self.weight_sync_version_lag.labels(method).set(max(0, step - max(rollout, -1)))
            if rollout >= 0:
                self.model_version.labels(ROLLOUT).set(rollout)

    def _set_last(self, attr: str, value: float, labels: tuple[str, ...]) -> None:
        last = self._last.get(attr)
        if isinstance(last, Gauge):
            last.labels(*labels).set(value)
        elif last is not None:
            last.set(value)

    @staticmethod
    def _zero_known_series(spec: MetricSpec, metric) -> None:
        if not spec.labels:
            return
        if spec.labels[:2] == ("backend", "method"):
            pairs = [(b, m) for m, backends in SYNC_METHODS.items() for b in backends]
            rest = [()] if len(spec.labels) == 2 else [(r,) for r in FAILURE_REASONS]
            for pair in pairs:
                for tail in rest:
                    metric.labels(*pair, *tail)
            return
        if spec.labels == ("method", "check"):  # integrity failures: alerted on from zero
            for method in DELTA_METHODS:
                for check in SYNC_CHECKS:
                    metric.labels(method, check)
            return
        if spec.attr == "mirror_latest_step":
            return  # a monitor without a mirror has no such step, not step 0
        if not all(label in KNOWN_LABELS for label in spec.labels):
            return  # slot and rank values are only known once a worker reports them
        (label,) = spec.labels
        for value in KNOWN_LABELS[label]:
            metric.labels(value)

    # Typed attributes, filled in by __init__ from METRICS.
    save_duration: Histogram
    saves: Counter
    save_bytes: Counter
    saves_in_flight: Gauge
    join_wait: Histogram
    last_join_wait: Gauge
    admission_wait: Histogram
    last_admission_wait: Gauge
    commit_lag: Histogram
    last_commit_lag: Gauge
    latest_step: Gauge
    last_commit_timestamp: Gauge
    pending_steps: Gauge
    oldest_pending_start: Gauge
    abandoned_steps: Gauge
    shutdown_timestamp: Gauge
    step_failures: Counter
    rank_last_save_duration: Gauge
    staging_bytes: Gauge
    staging_pinned_bytes: Gauge
    staging_cold_saves: Counter
    slot_label_overflows: Counter
    broadcast_duration: Histogram
    last_broadcast_duration: Gauge
    broadcast_bytes: Counter
    last_broadcast_bytes: Gauge
    broadcast_failures: Counter
    weight_sync_phase: Histogram
    last_weight_sync_phase: Gauge
    weight_sync_sent_bytes: Counter
    last_weight_sync_sent_bytes: Gauge
    weight_sync_state_bytes: Counter
    last_weight_sync_state_bytes: Gauge
    weight_sync_changed_fraction: Gauge
    rollout_pause: Histogram
    last_rollout_pause: Gauge
    weight_sync_corrupt: Counter
    weight_sync_version_lag: Gauge
    upload_duration: Histogram
    last_upload_duration: UnlabelledLastValue
    model_version: Gauge
    commit_phase: Histogram
    last_commit_phase: Gauge
    commit_phase_started: Gauge
    monitor_fenced: Gauge
    store_request_errors: Counter
    store_cas_conflicts: Counter
    store_fenced_commits: Counter
    store_upload_bytes: Counter
    store_upload_seconds: Histogram
    store_last_upload_seconds: Gauge
    mirror_latest_step: Gauge
    mirror_upload_bytes: Counter
    mirror_copy_seconds: Histogram
    last_mirror_copy_seconds: UnlabelledLastValue
    mirror_failures: Counter
    node_query_failures: Counter
    leftovers_removed: Counter
    metrics_connections_rejected: Counter
