"""The RPCs workers send measurements with: weight syncs, staging, uploads, versions.

The monitor is the job's one scrape target, so measurements taken in the
trainer's and rollout's processes reach /metrics through it.
"""

from __future__ import annotations

from typing import Any

from obsckpt.monitor.core import validate_rank
from obsckpt.monitor.telemetry import MonitorTelemetry


class MeasurementRPCs:
    """The monitor actor's measurement RPCs, recorded by its telemetry."""

    telemetry: MonitorTelemetry

    async def record_broadcast(
        self, backend: str, seconds: float, nbytes: int, method: str = "broadcast"
    ) -> None:
        self.telemetry.record_broadcast(backend, seconds, nbytes, method)

    async def record_weight_sync(self, report: dict[str, Any]) -> None:
        """One delta-capable weight sync (:class:`~obsckpt.sync.delta_broadcast.DeltaSyncResult`)."""
        self.telemetry.record_weight_sync(report)

    async def record_broadcast_failure(self, backend: str, method: str, reason: str) -> None:
        self.telemetry.record_broadcast_failure(backend, method, reason)

    async def record_staging(
        self,
        *,
        rank: int | None,
        slot: str,
        nbytes: int,
        pinned_bytes: int,
        cold: bool = False,
        pid: int | None = None,
    ) -> None:
        """A worker's staging for ``slot`` changed (allocated, resized or released).

        ``pid``, the worker's process id, is the process whose death (a lease that
        expires, a node that dies) removes ``rank``'s series, as the pid passed to
        :meth:`notify_started` is.
        """
        self.telemetry.record_staging(
            rank=validate_rank(rank),
            slot=slot,
            nbytes=nbytes,
            pinned_bytes=pinned_bytes,
            cold=cold,
            pid=pid,
        )

    async def record_upload(self, seconds: float) -> None:
        self.telemetry.record_upload(seconds)

    async def record_model_version(self, role: str, version: int) -> None:
        self.telemetry.record_model_version(role, version)
