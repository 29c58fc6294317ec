"""Importing obsckpt changes nothing global: a user's own metrics keep their series."""

from __future__ import annotations

import subprocess
import sys


def test_importing_obsckpt_leaves_created_series_on():
    """prometheus_client's ``*_created`` series stay on for the user's own registry."""
    code = (
        "import obsckpt\n"
        "import obsckpt.monitor\n"
        "from prometheus_client import CollectorRegistry, Counter, generate_latest\n"
        "registry = CollectorRegistry()\n"
        "Counter('user_events', 'the user\\'s own counter', registry=registry).inc()\n"
        "print(generate_latest(registry).decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "user_events_total 1.0" in out
    assert "user_events_created" in out


def test_the_monitor_serves_no_created_series(tmp_path):
    """The monitor's process is obsckpt's own: its metrics carry no ``*_created`` series."""
    code = (
        "import sys\n"
        "from prometheus_client import CollectorRegistry, generate_latest\n"
        "from obsckpt import CheckpointMonitor\n"
        "registry = CollectorRegistry()\n"
        "CheckpointMonitor(default_local_dir=sys.argv[1], metrics_port=None, registry=registry)\n"
        "print(generate_latest(registry).decode())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "root")],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert "obsckpt_step_failures_total" in out
    assert "_created" not in out
