"""The monitor's commits: a whole step made durable and named by its iteration file.

:class:`CommitRunner` runs on the monitor actor's event loop and commits one
step at a time; :class:`StepWriter` does the file I/O, in a worker thread.
The state machine that chooses the step is :class:`obsckpt.monitor.core.MonitorCore`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from obsckpt.errors import RootLockLostError
from obsckpt.monitor.core import CommitJob, MonitorCore
from obsckpt.monitor.events import Clock, SystemClock
from obsckpt.store import commit, layout, reader
from obsckpt.store.layout import FileRecord
from obsckpt.telemetry import attributes, tracing

logger = logging.getLogger("obsckpt.monitor")


def storage_hint(exc: OSError, root: str | os.PathLike[str]) -> str:
    """What to do about a commit that failed on the storage, by its cause."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"Free space (or inodes) on the filesystem of {root}"
    elif exc.errno == errno.EROFS:
        what = f"Remount the filesystem of {root} read-write"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = f"Let this process create files in {root} and its step directories"
    elif exc.errno in (errno.EMFILE, errno.ENFILE):
        what = (
            "Raise the monitor's open-file limit (ulimit -n) or find what holds its "
            "descriptors (/proc/<pid>/fd); nothing on disk needs changing"
        )
    elif exc.errno == errno.ENOENT:
        what = f"Leave the step directories under {root} in place until they are committed"
    else:
        what = f"Check the filesystem of {root}"
    return f"{what}; the next step commits once it can be written"


class PhaseObserver(Protocol):
    """Told of each phase of a commit as it starts and ends (from the commit's thread)."""

    def commit_phase_started(self, phase: str, unix_time: float) -> None: ...

    def commit_phase_ended(self, phase: str, seconds: float) -> None: ...


class CommitProgress:
    """Which phase the running commit is in, and since when.

    Moved on from the commit's worker thread (finalize_step's ``on_phase``), read
    by status() on the event loop; each change is told to the observer, so a hung
    fsync shows in the metrics while it hangs.

    Args:
        observer: told of each phase's start and end (None: nobody).
        clock: the monotonic clock for durations, the wall clock for the start time.
    """

    def __init__(self, observer: PhaseObserver | None, clock: Clock) -> None:
        self._observer = observer
        self._clock = clock
        self._lock = threading.Lock()
        self._step: tuple[int, str] | None = None
        self._phase: tuple[str, float, float] | None = None  # name, monotonic, unix

    def begin(self, step: int, kind: str) -> None:
        with self._lock:
            self._step = (step, kind)

    def enter(self, phase: str) -> None:
        """``phase`` starts now (the one before it, if any, ends)."""
        self._leave()
        now, unix = self._clock.monotonic(), self._clock.time()
        with self._lock:
            self._phase = (phase, now, unix)
        if self._observer is not None:
            self._observer.commit_phase_started(phase, unix)

    def end(self) -> None:
        """The commit ended, done or not."""
        self._leave()
        with self._lock:
            self._step = None

    def _leave(self) -> None:
        with self._lock:
            phase, self._phase = self._phase, None
        if phase is not None and self._observer is not None:
            self._observer.commit_phase_ended(phase[0], self._clock.monotonic() - phase[1])

    def current(self) -> dict[str, Any] | None:
        """The running commit (step, kind, phase, when the phase started), or None."""
        with self._lock:
            step, phase = self._step, self._phase
        if step is None:
            return None
        return {
            "step": step[0],
            "kind": step[1],
            "phase": None if phase is None else phase[0],
            "phase_started": None if phase is None else phase[2],
            "phase_s": None if phase is None else self._clock.monotonic() - phase[1],
        }


class StepWriter:
    """Commits steps under one checkpoint root.

    Args:
        root: the checkpoint root.
        fence: makes a context whose entry raises when this monitor may no longer
            commit into ``root`` (:meth:`obsckpt.store.rootlock.RootLock.fenced`); entered
            before a commit writes anything and held around each of its renames.
        fsync_timeout_s: the longest wait for each round of a commit's fsyncs
            (default :data:`obsckpt.store.commit.FSYNC_TIMEOUT_S`).
        keep_steps: after each commit, remove committed steps beyond the newest
            ``keep_steps`` (:func:`obsckpt.store.commit.remove_old_steps`); None: none.
        on_committed: told ``(step, kind)`` after each commit (the mirror's hook).
    """

    def __init__(
        self,
        root: Path | str,
        fence: Callable[[], contextlib.AbstractContextManager[object]] | None = None,
        *,
        fsync_timeout_s: float | None = None,
        keep_steps: int | None = None,
        on_committed: Callable[[int, str], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.on_committed = on_committed
        self.keep_steps = keep_steps
        self.fence = fence if fence is not None else contextlib.nullcontext
        self.fsync_timeout_s = fsync_timeout_s
        # Whether this process sees the step directories the workers write: then a
        # step directory missing at commit was removed, not written on another node.
        self.sees_step_dirs = bool(reader.steps_on_disk(root))

    def has_step_dir(self, step: int) -> bool:
        return layout.step_dir(self.root, step).is_dir()

    def write(
        self,
        step: int,
        kind: str,
        files: dict[str, FileRecord],
        phases: dict[str, float],
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        """fsync ``step``'s files, write its manifest and move the iteration file(s).

        Raises:
            RootLockLostError: this monitor no longer owns the root; nothing was renamed.
            FsyncTimeoutError: the storage did not finish an fsync in time.
            OSError: the step directory is gone or the storage refused a write.
        """
        # A monitor fenced off writes nothing at all, not even a manifest.
        with self.fence():
            pass
        sdir = layout.step_dir(self.root, step)
        if sdir.is_dir():
            self.sees_step_dirs = True
        elif files and self.sees_step_dirs:
            # Committing it would name a step that is not on disk.
            raise FileNotFoundError(
                errno.ENOENT,
                f"the step directory was removed or renamed after its saves reported "
                f"{len(files)} file(s) in it",
                str(sdir),
            )
        steps = {kind: step}
        if kind == "checkpoint":
            # A full checkpoint also commits its state dict.
            current = reader.read_iteration(self.root, "state_dict")
            if current is None or current < step:
                steps["state_dict"] = step
        commit.finalize_step(
            sdir,
            files,
            iterations=steps,
            timings=phases,
            on_phase=on_phase,
            fence=self.fence,
            fsync_timeout_s=self.fsync_timeout_s,
        )
        if self.on_committed is not None:
            self.on_committed(step, kind)
        if self.keep_steps is not None:
            keep = self.keep_steps
            named = {reader.read_iteration(self.root, k) for k in layout.KINDS}
            retain(
                lambda: commit.remove_old_steps(
                    self.root, keep, {s for s in named if s is not None}
                ),
                self.root,
            )


def retain(remove: Callable[[], list[str]], root: object) -> list[str]:
    """Run retention after a commit; its failure is logged, never the commit's."""
    try:
        removed = remove()
    except Exception as exc:  # noqa: BLE001 - the commit stands; the next one tries again
        logger.warning(
            "obsckpt monitor: retention in %s failed (next commit retries): %s", root, exc
        )
        return []
    if removed:
        logger.info(
            "obsckpt monitor: retention removed %d old step(s): %s", len(removed), removed[:10]
        )
    return removed


class CommitRunner:
    """Commits the steps the core finds whole, one at a time, off the event loop.

    Runs on the monitor actor's event loop: each commit's file I/O runs in a
    worker thread (:class:`StepWriter`), so notifications keep arriving while
    a step is made durable.

    Args:
        core: decides which step commits next, and records the outcome.
        writer: the commit I/O.
        phases: told of each commit phase as it starts and ends (the telemetry).
        clock: times the phases (default: the system's clocks).
    """

    def __init__(
        self,
        core: MonitorCore,
        writer: StepWriter,
        *,
        phases: PhaseObserver | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.core = core
        self.writer = writer
        self.progress = CommitProgress(phases, clock if clock is not None else SystemClock())
        self._task: asyncio.Task[None] | None = None

    async def commit_ready(self) -> None:
        """Commit what became ready; returns when nothing more is (or another call commits)."""
        if self._task is not None and not self._task.done():
            # The running committer asks what is ready again before it ends (with no
            # await in between), so nothing is missed; waiting here would only hold
            # admissions behind commit I/O.
            self.core.settle()
            return
        if not self.core.tracker.ready():
            # Nothing is whole (most notifications): no commit task, no trip through
            # the event loop on every RPC.
            self.core.settle()
            return
        self._task = asyncio.get_running_loop().create_task(self._commit_in_order())
        # Shielded: a cancelled RPC must not stop a commit halfway (its step would
        # stay "committing" for ever); the commit runs to its end on its own.
        await asyncio.shield(self._task)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the running commits to end; whether they did."""
        task = self._task
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        return bool(done)

    async def _commit_in_order(self) -> None:
        try:
            # One commit at a time, each chosen as it starts: notifications arrive
            # during a commit's I/O, and a step ready before it may have a new save
            # in flight, or a failed one, by then.
            while (job := self.core.begin_next_commit()) is not None:
                await self._commit(job)
        finally:
            self.core.settle()

    async def _commit(self, job: CommitJob) -> None:
        """Commit ``job``'s step, which the core has just marked committing."""
        step, kind = job.step, job.kind
        if job.saves == 0 and not self.writer.has_step_dir(step):
            # An iteration file must never name a step that is not on disk.
            self.core.commit_failed(
                job,
                f"step {step} ({kind}) was submitted with no saves and has no directory: "
                "nothing to commit (register its saves with register_thread_count first)",
            )
            return
        attrs = {attributes.STEP: step, attributes.KIND: kind}
        phases: dict[str, float] = {}
        iteration_file = layout.ITERATION_FILES[kind]
        latest = self.core.tracker.latest[kind]
        names = f"{iteration_file} still names {'no step' if latest is None else f'step {latest}'}"
        self.progress.begin(step, kind)
        try:
            with tracing.span("obsckpt.commit", carrier=job.record.carrier, attributes=attrs):
                files = self.core.commit_files(job)
                await asyncio.to_thread(
                    self.writer.write, step, kind, files, phases, self.progress.enter
                )
        except RootLockLostError as exc:
            self.core.commit_failed(
                job,
                f"commit of step {step} ({kind}) refused: {exc}. It is not committed and "
                f"{names}. This monitor commits nothing more: end it (ray.kill) and let "
                "one monitor hold the root (`obsckpt status DIR` names the holder)",
            )
            return
        except Exception as exc:  # noqa: BLE001 - a failed commit fails the step, not the monitor
            msg = f"commit of step {step} ({kind}) failed: {exc}"
            if isinstance(exc, OSError):
                msg += f"; it is not committed and {names}. " + storage_hint(exc, self.writer.root)
            self.core.commit_failed(job, msg)
            return
        finally:
            self.progress.end()
        self.core.commit_done(job, phases)
