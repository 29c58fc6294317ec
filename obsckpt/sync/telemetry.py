"""Where weight-sync measurements go, for the broadcaster, the ipc sender and the Synchronizer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class WeightSyncTelemetry:
    """Where weight-sync measurements go: a local :class:`Metrics`, the monitor actor, or both.

    The monitor owns the job's registry (one scrape target); its RPCs are
    fire-and-forget here. Failures are logged, never raised into training.
    """

    def __init__(self, *, metrics: Any = None, monitor: Any = None) -> None:
        self.metrics = metrics
        self.monitor = monitor
        self._last_ref = None
        self._warned = False

    def __bool__(self) -> bool:
        return self.metrics is not None or self.monitor is not None

    def broadcast(
        self, backend: str, seconds: float, nbytes: int, method: str = "broadcast"
    ) -> None:
        m = self.metrics
        if m is not None:
            self._safe(lambda: m.observe("broadcast_duration", seconds, backend, method))
            self._safe(lambda: m.add("broadcast_bytes", nbytes, backend, method))
        self._rpc("record_broadcast", backend, seconds, nbytes, method)

    def weight_sync(self, report: dict[str, Any]) -> None:
        """One delta-capable sync's report (phases, bytes, changed fraction, checks, versions)."""
        m = self.metrics
        if m is not None:
            self._safe(lambda: m.weight_sync(report))
        self._rpc("record_weight_sync", report)

    def failure(self, backend: str, method: str, exc: BaseException) -> None:
        """Count one weight sync that raised (``reason``: ``timeout`` or ``error``)."""
        reason = "timeout" if isinstance(exc, TimeoutError) else "error"
        m = self.metrics
        if m is not None:
            self._safe(lambda: m.broadcast_failures.labels(backend, method, reason).inc())
        self._rpc("record_broadcast_failure", backend, method, reason)

    def upload(self, seconds: float) -> None:
        if self.metrics is not None:
            self._safe(lambda: self.metrics.observe("upload_duration", seconds))
        self._rpc("record_upload", seconds)

    def model_version(self, role: str, version: int) -> None:
        if self.metrics is not None:
            self._safe(lambda: self.metrics.model_version.labels(role).set(version))
        self._rpc("record_model_version", role, version)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the monitor has applied every measurement sent so far."""
        ref, self._last_ref = self._last_ref, None
        if ref is None:
            return
        try:
            import ray

            ray.get(ref, timeout=timeout)
        except Exception as exc:  # noqa: BLE001
            logger.warning(
                "obsckpt: weight-sync measurements not confirmed by the monitor: %s", exc
            )

    def _rpc(self, method: str, *args: Any) -> None:
        if self.monitor is None:
            return
        try:
            # Calls from one caller run in order, so the last one confirms all.
            self._last_ref = getattr(self.monitor, method).remote(*args)
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            self._warn(exc)

    def _safe(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    def _warn(self, exc: BaseException) -> None:
        if not self._warned:
            self._warned = True
            logger.warning("obsckpt: recording a weight-sync measurement failed: %s", exc)
