"""Where the Synchronizer's measurements go: the job's monitor, else local metrics."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from obsckpt.options import MONITOR_ACTOR_NAME
from obsckpt.sync.telemetry import WeightSyncTelemetry

if TYPE_CHECKING:
    from obsckpt.telemetry.metrics import Metrics

# How often to look for a monitor that was not there yet.
MONITOR_RETRY_S = 5.0


class TelemetryRoute:
    """The Synchronizer's one :class:`WeightSyncTelemetry`, kept for the actor's life.

    Its measurements go to the job's monitor once one is found in the
    namespace (looked up again at most every ``MONITOR_RETRY_S``), and to
    local metrics (:meth:`Synchronizer.metrics_text`) until then. Being one
    object, its warn-once state and the monitor call that confirms the
    measurements sent so far last from one measurement to the next.
    """

    def __init__(self, namespace: str | None, registry: Any) -> None:
        self.namespace = namespace
        self._registry = registry
        self.local_metrics: Metrics | None = None
        self.monitor: Any = None  # the job's monitor actor, once found
        self._checked = 0.0
        self._telemetry = WeightSyncTelemetry()

    def get(self) -> WeightSyncTelemetry:
        """The telemetry, sent to the monitor if there is one (now), else to local metrics."""
        telemetry = self._telemetry
        if telemetry.monitor is None:
            monitor = self._find_monitor()
            if monitor is not None:
                telemetry.monitor, telemetry.metrics = monitor, None
            elif telemetry.metrics is None:
                telemetry.metrics = self._local()
        return telemetry

    def _local(self) -> Metrics:
        if self.local_metrics is None:
            from prometheus_client import CollectorRegistry

            from obsckpt.telemetry.metrics import Metrics

            self.local_metrics = Metrics(self._registry or CollectorRegistry())
        return self.local_metrics

    def _find_monitor(self) -> Any:
        if self.monitor is not None:
            return self.monitor
        now = time.monotonic()
        if now - self._checked < MONITOR_RETRY_S and self._checked:
            return None
        self._checked = now
        try:
            import ray

            if not ray.is_initialized():
                return None
            # An actor's runtime namespace is its job's, not the one it is named in.
            namespace = self.namespace or ray.get_runtime_context().namespace
            self.monitor = ray.get_actor(MONITOR_ACTOR_NAME, namespace=namespace)
        except Exception:  # noqa: BLE001 - no monitor in this namespace (yet)
            return None
        return self.monitor
