"""The job's checkpoint monitor, in three parts.

- :mod:`obsckpt.monitor.core`: the decisions (admission, leases, which step
  commits), with no Ray, asyncio or I/O, driven by an injected clock;
- :mod:`obsckpt.monitor.telemetry`: its events as metrics and log lines, and
  the /metrics endpoint;
- :mod:`obsckpt.monitor.actor`: :class:`CheckpointMonitor`, the Ray actor
  that awaits, commits (:mod:`obsckpt.monitor.commit_io`) and answers RPCs.
"""

from __future__ import annotations

from obsckpt.monitor.actor import CheckpointMonitor
from obsckpt.monitor.core import CommitJob, MonitorCore
from obsckpt.monitor.events import Clock, CommitRecord, MonitorObserver, SystemClock
from obsckpt.monitor.telemetry import MonitorTelemetry
from obsckpt.options import ACTOR_NAME, OBSCKPT_FILE_SD_PATH, MonitorOptions

# The variable naming the file_sd file, under the name this module has always exported.
FILE_SD_ENV = OBSCKPT_FILE_SD_PATH

__all__ = [
    "ACTOR_NAME",
    "FILE_SD_ENV",
    "CheckpointMonitor",
    "Clock",
    "CommitJob",
    "CommitRecord",
    "MonitorCore",
    "MonitorObserver",
    "MonitorOptions",
    "MonitorTelemetry",
    "SystemClock",
]
