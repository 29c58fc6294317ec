"""OpenTelemetry tracing: setup from the standard ``OTEL_*`` variables, spans, carriers.

Nothing here installs a tracer provider unless :func:`setup_tracing` is
called and an exporter is asked for; until then every span is OpenTelemetry's
non-recording span and :func:`inject` returns an empty carrier, so the cost is
a few attribute lookups. Exporter failures are logged and counted, never
raised into training.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    OTEL_SDK_DISABLED,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from obsckpt.telemetry import attributes as span_attr

logger = logging.getLogger(__name__)

TRACER_NAME = "obsckpt"
_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_enabled = False
_memory: InMemorySpanExporter | None = None
_safe_exporters: list[SafeExporter] = []
# Exporters this process's provider already has (names, or ids of exporter objects):
# a second setup_tracing must not export every span twice.
_installed: set[str | int] = set()
# The provider setup_tracing created; any other SDK provider was configured elsewhere.
_own_provider: TracerProvider | None = None


@dataclass(frozen=True, slots=True)
class TraceSettings:
    """What the standard ``OTEL_*`` variables ask of tracing; read in one place.

    Attributes:
        disabled: ``OTEL_SDK_DISABLED=true``.
        exporters: the names in ``OTEL_TRACES_EXPORTER`` (lower case), empty when unset.
        endpoint: the traces endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
            ``OTEL_EXPORTER_OTLP_ENDPOINT``), None when neither is set.
        protocol: the OTLP protocol asked for (``grpc``, ``http/protobuf``), "" when unset.
    """

    disabled: bool = False
    exporters: tuple[str, ...] = ()
    endpoint: str | None = None
    protocol: str = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TraceSettings:
        env = os.environ if environ is None else environ
        spec = env.get(OTEL_TRACES_EXPORTER, "")
        return cls(
            disabled=env.get(OTEL_SDK_DISABLED, "").strip().lower() == "true",
            exporters=tuple(n.strip().lower() for n in spec.split(",") if n.strip()),
            endpoint=env.get(OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)
            or env.get(OTEL_EXPORTER_OTLP_ENDPOINT)
            or None,
            protocol=env.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)
            or env.get(OTEL_EXPORTER_OTLP_PROTOCOL, ""),
        )

    def requested(self) -> list[str]:
        """The exporter names asked for: ``OTEL_TRACES_EXPORTER``, else otlp for an endpoint.

        OpenTelemetry's own default would be otlp to localhost:4318. In a Ray job
        localhost is each process's own node, and where no collector listens every
        batch is retried and the process waits on the retries at exit. So tracing
        is on only when asked for, the rule the monitor and the workers follow too.
        """
        if self.exporters:
            return list(self.exporters)
        return ["otlp"] if self.endpoint else []


class SafeExporter(SpanExporter):
    """Wraps an exporter so that its failures are logged and counted, not raised."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failures = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
            why = "it returned FAILURE"
        except Exception as exc:  # noqa: BLE001 - telemetry must never break training
            result = SpanExportResult.FAILURE
            why = f"{type(exc).__name__}: {exc}"
        if result is not SpanExportResult.SUCCESS:
            if self.failures == 0:
                # Once: an unreachable collector fails every batch, for hours.
                logger.warning(
                    "obsckpt: span export by %s failed (%s); its spans are dropped. Later "
                    "failures are counted, not logged: tracing.export_failures(), and "
                    "status()['span_export_failures'] of the monitor",
                    _describe(self.inner),
                    why,
                )
            self.failures += 1
        return result

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        except Exception as exc:  # noqa: BLE001
            logger.warning("obsckpt: span exporter shutdown failed: %s", exc)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        try:
            return self.inner.force_flush(timeout_millis)
        except Exception:  # noqa: BLE001
            return False


def _describe(exporter: SpanExporter) -> str:
    endpoint = getattr(exporter, "_endpoint", None)
    name = type(exporter).__name__
    return f"{name} to {endpoint}" if endpoint else name


def _otlp_exporter(protocol: str) -> SpanExporter | None:
    otlp_exporter: type[SpanExporter]
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as otlp_exporter,
            )
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as otlp_exporter,
            )
    except ImportError as exc:
        logger.warning(
            "obsckpt: OTEL_TRACES_EXPORTER asks for otlp but the exporter cannot be imported "
            "(%s); install obsckpt[otlp] to send traces",
            exc,
        )
        return None
    try:
        return otlp_exporter()
    except Exception as exc:  # noqa: BLE001 - a bad OTEL_* value must not stop the job
        logger.warning(
            "obsckpt: the OTLP span exporter cannot be built from the OTEL_EXPORTER_OTLP_* "
            "variables (%s: %s); spans are not sent. Correct the variable to send traces",
            type(exc).__name__,
            exc,
        )
        return None


def _requested(
    exporter: SpanExporter | str | None, settings: TraceSettings
) -> list[str | SpanExporter]:
    """The exporters asked for: the argument, else the variables (:class:`TraceSettings`)."""
    if isinstance(exporter, SpanExporter):
        return [exporter]
    if exporter and exporter.strip():
        return [n.strip().lower() for n in exporter.split(",") if n.strip()]
    return list(settings.requested())


def requested(exporter: SpanExporter | str | None = None) -> bool:
    """Whether :func:`setup_tracing` with ``exporter`` would install an exporter.

    Processes that trace only when asked call this first, so a process with
    nothing configured does not even log that it sends nothing.
    """
    settings = TraceSettings.from_env()
    if settings.disabled:
        return False
    return [n for n in _requested(exporter, settings) if n != "none"] != []


def _resource(service_name: str | None) -> Resource:
    resource = Resource.create()
    # service_name is a default: OTEL_SERVICE_NAME or a service.name in
    # OTEL_RESOURCE_ATTRIBUTES is the user's choice and wins.
    if service_name and str(resource.attributes.get("service.name", "")).startswith(
        "unknown_service"
    ):
        resource = resource.merge(Resource({"service.name": service_name}))
    return resource


class _PrivateIdGenerator(RandomIdGenerator):
    """Span and trace ids from a generator of obsckpt's own.

    The SDK's default draws them from Python's global ``random``: every span a
    background save makes would then move the training job's Python RNG stream,
    so a job resumed from its saved RNG state would not draw what it would have
    drawn (docs/reliability.md, "The resume record").
    """

    def __init__(self) -> None:
        self._random = random.Random(int.from_bytes(os.urandom(16), "big"))
        self._lock = threading.Lock()

    def generate_span_id(self) -> int:
        return self._valid_bits(64, trace.INVALID_SPAN_ID)

    def generate_trace_id(self) -> int:
        return self._valid_bits(128, trace.INVALID_TRACE_ID)

    def _valid_bits(self, bits: int, invalid: int) -> int:
        with self._lock:
            value = self._random.getrandbits(bits)
            while value == invalid:
                value = self._random.getrandbits(bits)
        return value


def setup_tracing(
    service_name: str | None = None, *, exporter: SpanExporter | str | None = None
) -> bool:
    """Install a tracer provider configured by the standard ``OTEL_*`` variables.

    Tracing is on when asked for: by ``exporter``, by ``OTEL_TRACES_EXPORTER``
    (``otlp``, ``console`` and ``memory``, an in-process InMemorySpanExporter for
    tests and debugging; comma-separated), or by an OTLP endpoint
    (``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``),
    which alone means ``otlp``. With none of them set, nothing is installed.
    ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` turns tracing
    off. The OTLP exporter reads its endpoint, headers and protocol from
    ``OTEL_EXPORTER_OTLP_*`` itself. Calling this again adds only exporters not
    installed yet. An SDK tracer provider set up before (by
    ``opentelemetry-instrument`` or the application) is used as it is: its own
    exporters send obsckpt's spans, and only an explicit ``exporter`` is added.

    Args:
        service_name: ``service.name`` unless ``OTEL_SERVICE_NAME`` or
            ``OTEL_RESOURCE_ATTRIBUTES`` names one.
        exporter: an exporter object or exporter name to use instead of the variables.

    Returns:
        True when spans will be recorded in this process.
    """
    global _enabled, _memory, _own_provider
    settings = TraceSettings.from_env()
    if settings.disabled:
        return False
    wanted = _requested(exporter, settings)
    if not wanted:
        logger.info(
            "obsckpt: no spans are sent: set OTEL_TRACES_EXPORTER or "
            "OTEL_EXPORTER_OTLP_ENDPOINT to trace"
        )
    if not wanted or wanted == ["none"]:
        return enabled()
    current = trace.get_tracer_provider()
    if exporter is None and isinstance(current, TracerProvider) and current is not _own_provider:
        # opentelemetry-instrument (or the application) built this provider from the
        # same OTEL_* variables: exporters of our own would send every span twice.
        logger.info(
            "obsckpt: spans go to the tracer provider configured by the application; "
            "its exporters, not OTEL_TRACES_EXPORTER again, send them"
        )
        return True
    with _lock:
        processors: list[SpanProcessor] = []
        for name in wanted:
            key = id(name) if isinstance(name, SpanExporter) else name
            if key in _installed:
                continue
            if isinstance(name, SpanExporter):
                processors.append(BatchSpanProcessor(_safe(name)))
            elif name == "memory":
                _memory = InMemorySpanExporter()
                processors.append(SimpleSpanProcessor(_memory))
            elif name == "console":
                processors.append(SimpleSpanProcessor(_safe(ConsoleSpanExporter())))
            elif name == "otlp":
                otlp = _otlp_exporter(settings.protocol)
                if otlp is None:
                    continue
                processors.append(BatchSpanProcessor(_safe(otlp)))
            else:
                if name != "none":
                    logger.warning(
                        "obsckpt: unknown trace exporter %r ignored; known: otlp, console, "
                        "memory, none",
                        name,
                    )
                continue
            _installed.add(key)
        provider = trace.get_tracer_provider()
        if not processors:
            # Recording spans that no exporter takes would cost without showing anything.
            return enabled()
        if not isinstance(provider, TracerProvider):
            provider = _own_provider = TracerProvider(
                resource=_resource(service_name), id_generator=_PrivateIdGenerator()
            )
            trace.set_tracer_provider(provider)
        for processor in processors:
            provider.add_span_processor(processor)
        _enabled = True
    return True


def _safe(exporter: SpanExporter) -> SafeExporter:
    safe = SafeExporter(exporter)
    _safe_exporters.append(safe)
    return safe


def enabled() -> bool:
    """True when this process records spans (setup_tracing or an SDK provider installed)."""
    return _enabled or isinstance(trace.get_tracer_provider(), TracerProvider)


def export_failures() -> int:
    """How many span batches this process failed to export."""
    return sum(e.failures for e in _safe_exporters)


_tracer: tuple[object, trace.Tracer] | None = None


def tracer() -> trace.Tracer:
    """obsckpt's tracer from the current provider (kept: making one costs more than a span)."""
    global _tracer
    provider = trace.get_tracer_provider()
    cached = _tracer
    if cached is None or cached[0] is not provider:
        cached = _tracer = (provider, provider.get_tracer(TRACER_NAME))
    return cached[1]


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """The W3C trace-context carrier for ``ctx`` (default: the current context)."""
    if not enabled():
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def capture() -> otel_context.Context | None:
    """The current context, to :func:`inject` later on another thread (None when off).

    Cheaper than :func:`inject` on a hot path: one context-variable read; the
    carrier's formatting is left to the thread that needs it.
    """
    return otel_context.get_current() if enabled() else None


# The last context formatted by as_carrier and its carrier: every save of a step
# captures the same context object, so the step's saves format it once.
_last_carrier: tuple[otel_context.Context, dict[str, str]] | None = None


def as_carrier(parent: Mapping[str, str] | otel_context.Context | None) -> dict[str, str]:
    """A W3C carrier from a carrier, a captured context (see :func:`capture`) or None."""
    global _last_carrier
    if parent is None:
        return {}
    if isinstance(parent, otel_context.Context):  # a Context is a Mapping too
        last = _last_carrier  # one read: save threads run this concurrently
        if last is not None and last[0] is parent:
            return dict(last[1])
        carrier = inject(parent)
        _last_carrier = (parent, carrier)
        return dict(carrier)
    return dict(parent)


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a carrier names, or None for an empty carrier."""
    if not carrier:
        return None
    # Every save of a step carries the same step context: parse it once.
    return _extract_cached(tuple(sorted(carrier.items())))


@functools.lru_cache(maxsize=256)
def _extract_cached(items: tuple[tuple[str, str], ...]) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(items))


@contextmanager
def span(
    name: str,
    *,
    carrier: Mapping[str, str] | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span]:
    """A span that is current inside the block; its parent comes from ``carrier`` if given.

    Exceptions raised in the block are recorded on the span and re-raised.
    """
    if not enabled():
        yield trace.INVALID_SPAN
        return
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    # start_span + attach by hand: start_as_current_span nests two more context
    # managers, a tenth of a span's cost on a save's path.
    s = tracer().start_span(name, context=extract(carrier), attributes=attrs)
    token = otel_context.attach(trace.set_span_in_context(s))
    try:
        yield s
    except BaseException as exc:
        s.record_exception(exc)
        s.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
        s.end()


# Waits shorter than this are not worth a span of their own: an uncontended
# admission costs far less than recording it would.
MIN_WAIT_SPAN_S = 0.001


def record_wait(
    name: str, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None
) -> None:
    """Record a finished wait as a child of the current span, if it lasted ``MIN_WAIT_SPAN_S``."""
    if not enabled() or end_ns - start_ns < MIN_WAIT_SPAN_S * 1e9:
        return
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    tracer().start_span(name, attributes=attrs, start_time=start_ns).end(end_time=end_ns)


@contextmanager
def checkpoint_span(step: int, *, is_state_dict: bool = False) -> Iterator[dict[str, str]]:
    """Trainer side: the root ``obsckpt.checkpoint`` span of one step.

    Yields the W3C carrier to pass to workers' saves (``trace_context=``);
    :meth:`CheckpointCoordinator.register_and_monitor` called inside the block
    passes it to the monitor, so the commit joins the same trace.
    """
    kind = "state_dict" if is_state_dict else "checkpoint"
    with span("obsckpt.checkpoint", attributes={span_attr.STEP: step, span_attr.KIND: kind}):
        yield inject()


def flush(timeout_s: float = 5.0) -> bool:
    """Export the spans this process has queued, waiting at most ``timeout_s``.

    Returns True when every queued span was handed to its exporter in time.
    The SDK's batch processor does not bound its own flush (it exports
    everything, each batch waiting out the exporter's timeout when the
    collector is unreachable), so the flush runs on a daemon thread that is
    left behind, still exporting, when the time is up.
    """
    flush_provider = getattr(trace.get_tracer_provider(), "force_flush", None)
    if flush_provider is None:
        return True
    done = threading.Event()
    flushed = [False]  # the provider's own answer (older SDKs give up on time, saying False)

    def run() -> None:
        try:
            flushed[0] = flush_provider(int(timeout_s * 1000)) is not False
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks the job
            logger.warning("obsckpt: flushing spans failed: %s", exc)
        finally:
            done.set()

    threading.Thread(target=run, name="obsckpt-span-flush", daemon=True).start()
    if done.wait(timeout_s) and flushed[0]:
        return True
    logger.warning(
        "obsckpt: queued spans were not exported within %.1f s (is the collector "
        "reachable?); going on without them",
        timeout_s,
    )
    return False


def attach(carrier: Mapping[str, str] | None) -> object | None:
    """Make the carrier's context current; returns a token for :func:`detach`."""
    ctx = extract(carrier)
    return otel_context.attach(ctx) if ctx is not None else None


def detach(token: Any) -> None:
    """Restore the context :func:`attach` replaced (a None token: nothing was attached)."""
    if token is not None:
        otel_context.detach(token)


def finished_spans() -> list[dict[str, Any]]:
    """Spans recorded by the ``memory`` exporter of this process, as plain dicts."""
    if _memory is None:
        return []
    return [span_to_dict(s) for s in _memory.get_finished_spans()]


def clear_finished_spans() -> None:
    """Forget the spans the ``memory`` exporter recorded so far."""
    if _memory is not None:
        _memory.clear()


def span_to_dict(s: ReadableSpan) -> dict[str, Any]:
    """A finished span as a plain dict: name, ids (hex), parent, attributes, status, times."""
    ctx = s.get_span_context()
    return {
        "name": s.name,
        "trace_id": format(ctx.trace_id, "032x") if ctx is not None else None,
        "span_id": format(ctx.span_id, "016x") if ctx is not None else None,
        "parent_span_id": format(s.parent.span_id, "016x") if s.parent else None,
        "attributes": dict(s.attributes or {}),
        "status": s.status.status_code.name,
        "start_time": s.start_time,
        "end_time": s.end_time,
    }
