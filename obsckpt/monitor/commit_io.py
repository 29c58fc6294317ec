"""The monitor's commits: a whole step made durable and named by its iteration file.

:class:`CommitRunner` runs on the monitor actor's event loop and commits one
step at a time; :class:`StepWriter` does the file I/O, in a worker thread.
The state machine that chooses the step is :class:`obsckpt.monitor.core.MonitorCore`.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

from obsckpt import commit, layout, reader
from obsckpt.layout import FileRecord
from obsckpt.monitor.core import CommitJob, MonitorCore
from obsckpt.telemetry import attributes, tracing


def storage_hint(exc: OSError, root: str | os.PathLike[str]) -> str:
    """What to do about a commit that failed on the storage, by its cause."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"Free space (or inodes) on the filesystem of {root}"
    elif exc.errno == errno.EROFS:
        what = f"Remount the filesystem of {root} read-write"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = f"Let this process create files in {root} and its step directories"
    elif exc.errno == errno.ENOENT:
        what = f"Leave the step directories under {root} in place until they are committed"
    else:
        what = f"Check the filesystem of {root}"
    return f"{what}; the next step commits once it can be written"


class StepWriter:
    """Commits steps under one checkpoint root.

    Args:
        root: the checkpoint root.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        # Whether this process sees the step directories the workers write: then a
        # step directory missing at commit was removed, not written on another node.
        self.sees_step_dirs = bool(reader.steps_on_disk(root))

    def has_step_dir(self, step: int) -> bool:
        return layout.step_dir(self.root, step).is_dir()

    def write(
        self, step: int, kind: str, files: dict[str, FileRecord], phases: dict[str, float]
    ) -> None:
        """fsync ``step``'s files, write its manifest and move the iteration file(s).

        Raises:
            OSError: the step directory is gone or the storage refused a write.
        """
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
        commit.finalize_step(sdir, files, iterations=steps, timings=phases)


class CommitRunner:
    """Commits the steps the core finds whole, one at a time, off the event loop.

    Runs on the monitor actor's event loop: each commit's file I/O runs in a
    worker thread (:class:`StepWriter`), so notifications keep arriving while
    a step is made durable.

    Args:
        core: decides which step commits next, and records the outcome.
        writer: the commit I/O.
    """

    def __init__(self, core: MonitorCore, writer: StepWriter) -> None:
        self.core = core
        self.writer = writer
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
        try:
            with tracing.span("obsckpt.commit", carrier=job.record.carrier, attributes=attrs):
                files = self.core.commit_files(job)
                await asyncio.to_thread(self.writer.write, step, kind, files, phases)
        except Exception as exc:  # noqa: BLE001 - a failed commit fails the step, not the monitor
            msg = f"commit of step {step} ({kind}) failed: {exc}"
            if isinstance(exc, OSError):
                latest = self.core.tracker.latest[kind]
                msg += (
                    f"; it is not committed and {layout.ITERATION_FILES[kind]} still names "
                    f"{'no step' if latest is None else f'step {latest}'}. "
                    + storage_hint(exc, self.writer.root)
                )
            self.core.commit_failed(job, msg)
            return
        self.core.commit_done(job, phases)
