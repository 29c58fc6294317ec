"""The obsckpt Grafana dashboard and Prometheus alert rules, as code.

``python -m dashboards.build`` (``make dashboards``) writes the committed
``dashboards/obsckpt.json``, ``deploy/prometheus/rules/obsckpt-alerts.yml`` and
its promtool test file; a test fails when they differ from what this code makes.
"""

from __future__ import annotations

from dashboards.alerts import ALERT_NAMES, AlertThresholds, alert_rules, rule_groups
from dashboards.dashboard import PanelQuery, build_dashboard, expand, panel_queries

__all__ = [
    "ALERT_NAMES",
    "AlertThresholds",
    "PanelQuery",
    "alert_rules",
    "build_dashboard",
    "expand",
    "panel_queries",
    "rule_groups",
]
