"""The monitor actor's life in Ray: created or found by name, restarted, its nodes watched.

Ray is imported inside the functions: a monitor made in-process (tests) and
``import obsckpt`` never need it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from obsckpt.errors import IterationFileError, MonitorCallError
from obsckpt.monitor.core import MonitorCore
from obsckpt.monitor_link import strip_colour
from obsckpt.options import MONITOR_ACTOR_NAME, MonitorOptions
from obsckpt.store import commit, layout, reader, repair, rootlock
from obsckpt.store.uri import is_remote

logger = logging.getLogger("obsckpt.monitor")


def was_restarted() -> bool:
    """True inside an actor that Ray restarted after its process died."""
    try:
        import ray

        with warnings.catch_warnings():
            # Ray's implementation of this property reads a deprecated attribute itself.
            warnings.simplefilter("ignore")
            return (
                ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
            )
    except Exception:  # noqa: BLE001 - outside an actor there is nothing to recover
        return False


def in_actor() -> bool:
    """True inside a Ray actor (a monitor made in-process never asks Ray about nodes)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - outside Ray there are no nodes to watch
        return False


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    return ray.nodes()


class DeadNodes:
    """Ids of the nodes Ray reports dead; the last ones known while Ray cannot be asked.

    A failed query is counted (``failures``, and ``on_failure``) and logged once
    per run of failures, not at every lease check; it never reads as "no node is
    dead", which would keep the saves of a dead node running until their leases
    run out.

    Args:
        list_nodes: Ray's node table (default ``ray.nodes``; tests pass their own).
        on_failure: called at each failed query (the monitor counts it in a metric).
    """

    def __init__(
        self,
        list_nodes: Callable[[], list[dict[str, Any]]] | None = None,
        on_failure: Callable[[], None] | None = None,
    ) -> None:
        self._list_nodes = list_nodes if list_nodes is not None else _ray_nodes
        self._on_failure = on_failure if on_failure is not None else (lambda: None)
        self.known: set[str] = set()
        self.failures = 0
        self._failing = False

    def __call__(self) -> set[str]:
        try:
            dead = {n["NodeID"] for n in self._list_nodes() if not n.get("Alive", True)}
        except Exception as exc:  # noqa: BLE001 - the next check may get through
            self.failures += 1
            self._on_failure()
            if not self._failing:
                self._failing = True
                logger.warning(
                    "obsckpt monitor: cannot ask Ray which nodes are dead (%s: %s); keeping "
                    "the %d dead node(s) known so far and asking again at each lease check "
                    "(saves on a node that dies meanwhile fail when their leases run out)",
                    type(exc).__name__,
                    exc,
                    len(self.known),
                )
            return set(self.known)
        if self._failing:
            self._failing = False
            logger.info(
                "obsckpt monitor: Ray answers which nodes are dead again (%d failed "
                "queries so far)",
                self.failures,
            )
        self.known = dead
        return set(dead)


def recover_last_commits(
    core: MonitorCore, root: Path | str, latest: dict[str, int | None]
) -> None:
    """When each kind last committed, from its iteration file's mtime (after a restart)."""
    for kind, step in latest.items():
        if step is None:
            continue
        when = reader.iteration_mtime(root, kind)
        if when is None:
            continue
        # How long ago, by the wall clock (a file from the future: just now).
        core.set_last_commit_age(kind, core.clock.time() - when)


def read_local_root(
    root: Path | str, on_bad_iteration: str, restarted: bool
) -> tuple[dict[str, int | None], list[str], list[str]]:
    """A monitor's start on a local ``root`` (under its lock): the committed steps, the
    iteration files rewound, and obsckpt's leftover temp files removed.

    A job's start checks that the iteration files name whole steps, and removes temp
    files older than the last commit: before any save is admitted, no writer can still
    be using one. A monitor Ray restarted within its job does neither: its iteration
    files were written by the one it replaces, and the job's saves may be writing.
    """
    repairs = [] if restarted else check_iterations_at_start(root, on_bad_iteration)
    latest = {k: reader.read_iteration(root, k) for k in layout.KINDS}
    removed = [] if restarted else commit.sweep_leftovers(root)
    return latest, repairs, removed


def read_root(
    root: Path | str, store: Any, lock: Any, on_bad_iteration: str, restarted: bool
) -> tuple[dict[str, int | None], list[str], list[str], list[str]]:
    """A monitor's start on its root (under its lock or epoch): the committed steps, the
    iteration files rewound, the leftovers removed and the dangling uploads aborted
    (:func:`read_local_root`, or on an ``s3://`` ``store``
    :func:`~obsckpt.monitor.s3_commit.read_s3_root`)."""
    if store is None:
        latest, repairs, removed = read_local_root(root, on_bad_iteration, restarted)
        return latest, repairs, removed, []
    from obsckpt.monitor.s3_commit import read_s3_root

    latest, removed, aborted = read_s3_root(store, lock, restarted)
    return latest, [], removed, aborted


def check_iterations_at_start(root: str | os.PathLike[str], on_bad: str) -> list[str]:
    """Check that ``root``'s iteration files name whole steps; what was rewound, if anything.

    With ``on_bad="rewind"`` a file naming a step that is not whole is pointed at
    the latest whole one (:func:`obsckpt.store.repair.rewind`, which deletes nothing).

    Raises:
        IterationFileError: one names a step that is not whole and ``on_bad`` is
            ``"refuse"``; one line naming the file, the step, the latest whole
            step and the two ways to repair it.
    """
    bad = repair.check_iterations(root)
    if not bad:
        return []
    if on_bad == "rewind":
        return repair.rewind(root)
    raise IterationFileError(
        f"{bad[0].describe()}. A monitor started on it would take every newer save for a "
        "re-save of a committed step, and a resume would load a step that is not whole. "
        f"Run `obsckpt repair {root}`, or start the monitor with on_bad_iteration='rewind', "
        "to point it at the latest whole step (nothing is deleted)"
    )


def start_actor(cls: type, options: MonitorOptions, *, max_restarts: int = -1) -> Any:
    """The monitor actor of ``options.namespace``, created from ``cls`` if none runs.

    Raises:
        ValueError: one runs in the namespace under another root.
        RootInUseError: another job's monitor holds the root.
    """
    import ray

    namespace = options.namespace
    root = options.default_local_dir
    remote = is_remote(root)
    if not remote:
        # Checked here too, so a bad root fails in the caller, not in a dead actor.
        commit.ensure_root(root)
    try:
        ray.get_actor(MONITOR_ACTOR_NAME, namespace=namespace or None)
    except ValueError:
        # None runs in this namespace: a monitor holding the root is another job's
        # (or one this job just killed, whose process is ending). On S3 the new
        # monitor fences the one before by the pointer's epoch instead.
        if not remote:
            rootlock.check_free(root, wait_s=rootlock.START_WAIT_S)
            if options.on_bad_iteration == "refuse":  # the actor checks again, under the lock
                check_iterations_at_start(root, "refuse")
    actor_options: dict[str, Any] = dict(
        name=MONITOR_ACTOR_NAME,
        get_if_exists=True,
        max_restarts=max_restarts,
        max_concurrency=10_000,
        num_cpus=0,
    )
    if namespace:
        actor_options["namespace"] = namespace
    monitor: Any = ray.remote(cls).options(**actor_options).remote(options=options)
    # get_if_exists hands back a monitor already running under the name, whatever
    # its root: this job's steps would then be committed (or never) under another
    # root, with nothing said. Waiting for the answer also surfaces a monitor that
    # failed to start here rather than at the first save.
    try:
        running: str = ray.get(monitor.checkpoint_root.remote())
    except ray.exceptions.RayActorError as exc:
        # Its constructor failed; the likeliest cause, another job's monitor that
        # took the root since the check above, gets its own error.
        if not remote:
            rootlock.check_free(root)
        raise _start_error(exc, root) from exc
    if (running != root) if remote or is_remote(running) else not _same_dir(running, root):
        where = f"namespace {namespace!r}" if namespace else "this job's namespace"
        raise ValueError(
            f"a {MONITOR_ACTOR_NAME} actor already runs in {where} with checkpoint root "
            f"{running!r}, not default_local_dir={root!r}; it commits only "
            "steps under its own root. Give this job a Ray namespace of its own "
            "(namespace=...), or pass the same default_local_dir"
        )
    return monitor


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _start_error(exc: BaseException, root: str) -> MonitorCallError:
    """One line for a monitor whose constructor failed: Ray's text ends with its error."""
    text = strip_colour(getattr(exc, "error_msg", "") or str(exc))
    lines = [line for line in text.splitlines() if line.strip()]
    last = lines[-1].strip() if lines else type(exc).__name__
    return MonitorCallError(
        f"the {MONITOR_ACTOR_NAME} actor for checkpoint root {root!r} failed to start: {last}"
    )


def commit_writer(
    root: Path | str,
    root_lock: Any,
    store: Any,
    telemetry: Any,
    keep_steps: int | None,
    mirror: Any = None,
) -> Any:
    """The monitor's commit I/O: on a local root a :class:`StepWriter` (fenced by the root's
    lock, telling ``mirror`` of each commit), on an ``s3://`` ``store`` an
    :class:`~obsckpt.monitor.s3_commit.S3StepWriter` (fenced by the pointer's epoch)."""
    from obsckpt.monitor.commit_io import StepWriter
    from obsckpt.monitor.s3_commit import S3StepWriter

    if store is not None:
        return S3StepWriter(store, root_lock, telemetry.store_commit_fenced, keep_steps)
    return StepWriter(
        root,
        root_lock.fenced,
        keep_steps=keep_steps,
        on_committed=None if mirror is None else mirror.committed_locally,
    )
