"""Metrics, tracing and the /metrics endpoint."""

from __future__ import annotations

from obsckpt.telemetry.metrics import METRICS, SPANS, Metrics
from obsckpt.telemetry.tracing import checkpoint_span, setup_tracing

__all__ = ["METRICS", "SPANS", "Metrics", "checkpoint_span", "setup_tracing"]
