"""The environment variables obsckpt reads, and the one helper that reads them.

Every ``OBSCKPT_*`` variable is named here; :func:`from_env_if_absent` gives
an argument, else the variable, else the default (the OpenTelemetry SDK's
order). :mod:`obsckpt.options` re-exports both beside the options they set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

# Where the monitor writes a Prometheus file_sd JSON naming its /metrics endpoint.
OBSCKPT_FILE_SD_PATH = "OBSCKPT_FILE_SD_PATH"
# "0" writes torch files through the page cache instead of with O_DIRECT.
OBSCKPT_DIRECT_IO = "OBSCKPT_DIRECT_IO"
# How long a process waits at exit for its saves in flight (seconds).
OBSCKPT_EXIT_WAIT_S = "OBSCKPT_EXIT_WAIT_S"
# How long verl's patched trainer waits for a step's commit (seconds).
OBSCKPT_VERL_COMMIT_TIMEOUT_S = "OBSCKPT_VERL_COMMIT_TIMEOUT_S"
# "1": a checkpoint manager's save_checkpoint returns only once its files are durable.
OBSCKPT_SYNC_SAVE = "OBSCKPT_SYNC_SAVE"
# "1": a checkpoint manager submits each step it saves (no trainer does); "0": the trainer does.
OBSCKPT_MANAGER_COMMITS = "OBSCKPT_MANAGER_COMMITS"
# Set in `obsckpt demo`'s driver process: the id of the process that started it.
OBSCKPT_DEMO_DRIVER = "OBSCKPT_DEMO_DRIVER"

# The monitor's options for a job switched on from its host's config (verl, Trinity-RFT):
# each overrides the option of the same name (MonitorOptions.from_settings).
OBSCKPT_METRICS_PORT = "OBSCKPT_METRICS_PORT"
OBSCKPT_METRICS_HOST = "OBSCKPT_METRICS_HOST"
OBSCKPT_SAVE_STRATEGY = "OBSCKPT_SAVE_STRATEGY"
OBSCKPT_LEASE_TIMEOUT_S = "OBSCKPT_LEASE_TIMEOUT_S"
OBSCKPT_MAX_SLOT_LABELS = "OBSCKPT_MAX_SLOT_LABELS"
OBSCKPT_ON_BAD_ITERATION = "OBSCKPT_ON_BAD_ITERATION"
OBSCKPT_TRACE_EXPORTER = "OBSCKPT_TRACE_EXPORTER"
# An s3:// root that keeps a committed copy of every step of a local root.
OBSCKPT_MIRROR = "OBSCKPT_MIRROR"
OBSCKPT_KEEP_STEPS = "OBSCKPT_KEEP_STEPS"

VARIABLES = (
    OBSCKPT_FILE_SD_PATH,
    OBSCKPT_DIRECT_IO,
    OBSCKPT_EXIT_WAIT_S,
    OBSCKPT_VERL_COMMIT_TIMEOUT_S,
    OBSCKPT_SYNC_SAVE,
    OBSCKPT_MANAGER_COMMITS,
    OBSCKPT_DEMO_DRIVER,
    OBSCKPT_METRICS_PORT,
    OBSCKPT_METRICS_HOST,
    OBSCKPT_SAVE_STRATEGY,
    OBSCKPT_LEASE_TIMEOUT_S,
    OBSCKPT_MAX_SLOT_LABELS,
    OBSCKPT_ON_BAD_ITERATION,
    OBSCKPT_TRACE_EXPORTER,
    OBSCKPT_MIRROR,
    OBSCKPT_KEEP_STEPS,
)


def from_env_if_absent(
    value: _T | None,
    env: str,
    default: _T,
    parse: Callable[[str], _T] | None = None,
) -> _T:
    """``value`` if given, else the environment variable ``env`` parsed, else ``default``.

    An empty variable counts as unset.

    Raises:
        ValueError: the variable is set but ``parse`` refuses it (names the variable).
    """
    if value is not None:
        return value
    raw = os.environ.get(env)
    if not raw:
        return default
    if parse is None:
        return raw  # type: ignore[return-value]
    try:
        return parse(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {env}={raw!r} is invalid: {exc}") from None
