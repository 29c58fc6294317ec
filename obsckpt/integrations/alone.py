"""A checkpoint manager used without a trainer that submits its steps: it commits them itself.

verl's and Trinity-RFT's trainers, switched to obsckpt, register each step's
saves and submit the step once every manager of every rank has saved
(:func:`obsckpt.integrations.verl_install.install`, the Trinity plugin): a
step then commits with the actor's and the critic's files alike. A manager
built directly, with no such trainer (verl's own checkpoint tests, a user's
loop), has nobody to submit its steps, which would never commit, and a load
of one would be refused as uncommitted. Such a manager submits each step it
saves itself, once every rank has registered its saves (a barrier), and a
load of a step this process saved waits for that step's commit first.

Whether a trainer submits is the monitor's to say: verl's and Trinity-RFT's
switched trainers create it with ``trainer_submits=True``
(:func:`trainer_submits`); ``OBSCKPT_MANAGER_COMMITS`` (``1``/``0``) or the
managers' ``commit_steps=`` argument says it outright. Two managers saving
into one step (an actor's and a critic's) need the trainer's submission: the
first to submit would commit the step before the other's saves are registered.

Nothing here imports verl.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from obsckpt.env import OBSCKPT_MANAGER_COMMITS, OBSCKPT_VERL_COMMIT_TIMEOUT_S, from_env_if_absent
from obsckpt.errors import UnverifiedCheckpointError
from obsckpt.store import layout

logger = logging.getLogger(__name__)

# How long a load waits for the commit of a step this process saved (seconds).
DEFAULT_COMMIT_WAIT_S = 1800.0

_lock = threading.Lock()
# (root, step) -> the kind this process saved of it ("checkpoint" wins over "state_dict").
_saved: dict[tuple[str, int], str] = {}


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(
            f"{OBSCKPT_MANAGER_COMMITS}={text!r}: set it to 1 (a checkpoint manager submits "
            "each step it saves) or 0 (the trainer submits them)"
        )
    return text == "1"


def trainer_submits(coordinator: Any) -> bool:
    """Whether the job's trainer submits each step: verl's and Trinity-RFT's switched
    trainers create the monitor saying so (``MonitorOptions.trainer_submits``)."""
    return bool(coordinator.link.status().get("trainer_submits", False))


def commits_steps(value: bool | None, coordinator: Any) -> bool:
    """A manager's ``commit_steps``: the argument, else ``OBSCKPT_MANAGER_COMMITS``, else
    whether no trainer submits the job's steps (asked of the monitor).

    Raises:
        ValueError: the variable holds something other than ``0`` or ``1``.
    """
    if value is None and os.environ.get(OBSCKPT_MANAGER_COMMITS) is None:
        return not trainer_submits(coordinator)
    return from_env_if_absent(value, OBSCKPT_MANAGER_COMMITS, True, _flag)


def submit(
    coordinator: Any,
    step: int,
    kind: str,
    *,
    rank: int,
    barrier: Callable[[], None],
) -> None:
    """Submit ``step`` (``kind``'s saves) once every rank has registered its saves of it
    (rank 0 submits), and remember it: a load of it here waits for its commit
    (:func:`wait_for_saved_step`). A step a trainer submits is not remembered:
    whether it will commit is the trainer's to know."""
    root = _root_key(coordinator.link.checkpoint_root())
    with _lock:
        if _saved.get((root, step)) != "checkpoint":
            _saved[(root, step)] = kind
    barrier()
    if rank == 0:
        coordinator.link.monitor_step(step, is_state_dict=kind == "state_dict", trace_context=None)


def _root_key(root: str) -> str:
    """A root as :data:`_saved` keys it: a URL as it is, a directory resolved."""
    return root.rstrip("/") if "://" in root else os.path.realpath(root)


def wait_for_saved_step(
    coordinator: Any, local_path: str, timeout: float | None = None, poll_s: float = 0.1
) -> int | None:
    """Wait for the commit of the step holding ``local_path`` if this process saved and
    submitted it (:func:`submit`).

    Returns the step waited for (None: ``local_path`` is no such step, which the
    verified load then checks as any other: an uncommitted one is refused at once).

    Raises:
        UnverifiedCheckpointError: the step failed, was abandoned, or was not committed
            within ``timeout`` seconds (default ``OBSCKPT_VERL_COMMIT_TIMEOUT_S`` or 1800),
            naming the step and why.
    """
    if "://" in local_path:
        from obsckpt.integrations.object_steps import step_of

        located: tuple[Any, int] | None = step_of(local_path)
    else:
        located = layout.step_of_path(os.path.abspath(local_path))
    if located is None:
        return None
    root, step = located
    with _lock:
        kind = _saved.get((_root_key(os.fspath(root)), step))
    if kind is None:
        return None
    timeout = from_env_if_absent(
        timeout, OBSCKPT_VERL_COMMIT_TIMEOUT_S, DEFAULT_COMMIT_WAIT_S, float
    )
    outcome = coordinator.link.wait_committed(
        step,
        kind,
        timeout,
        poll_s,
        on_wait=lambda: logger.info(
            "obsckpt: loading %s waits for the commit of step %d", local_path, step
        ),
    )
    if outcome is None:
        return step
    what, detail = outcome
    if what == "timeout":
        raise UnverifiedCheckpointError(
            f"{local_path}: step {step} ({kind}), saved here, was not committed after "
            f"{timeout:g} s, so it is not loaded ({detail}). The wait is "
            f"{OBSCKPT_VERL_COMMIT_TIMEOUT_S} seconds"
        )
    raise UnverifiedCheckpointError(
        f"{local_path}: step {step} was saved here but its {kind} {what}, so it was never "
        f"committed and is not loaded: {detail}"
    )
