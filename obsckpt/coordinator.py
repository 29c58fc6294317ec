"""CheckpointCoordinator: background saves per slot, reported to the monitor.

Worker side (FSDP / Megatron ranks): each save runs on a background thread,
named ``obsckpt-save-<slot>-step<N>`` while it runs; threads are kept and
reused, so submitting a save costs the caller a queue put, not a thread
start. A new save of a slot first joins the previous one, so two writes to
one destination never overlap. The monitor is told when a save starts
(admission under the save strategy) and when it ends, successfully or not,
with its measurements (see :mod:`obsckpt.save_job`). A failure is stored and
raised once by the next :meth:`CheckpointCoordinator.wait_all`.

State-dict saves copy into one staging arena per slot (see
:mod:`obsckpt.slot_staging`): :meth:`CheckpointCoordinator.prepare` makes it before
the first save, ``overlap=True`` copies next to the caller's next step, and
:meth:`CheckpointCoordinator.close` releases it.

Trainer side: :meth:`CheckpointCoordinator.register_and_monitor` registers the
expected saves of a step and submits it for commit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any

from obsckpt import validators
from obsckpt.coordinator_targets import TargetChecks
from obsckpt.errors import SaveError, SaveTimeoutError
from obsckpt.monitor_link import DEFAULT_RPC_TIMEOUT_S, MonitorLink, default_rank
from obsckpt.save_job import SaveErrors, SaveJob, wait_jobs
from obsckpt.save_threads import STALL_TIMEOUT_S, STALL_WARNING_S, THREADS, wait_watched
from obsckpt.slot_staging import SlotStaging, StagedSave
from obsckpt.store import layout
from obsckpt.store.file_records import object_destination, path_list, run_and_record
from obsckpt.telemetry import tracing
from obsckpt.validators import validate_parts, validate_slot, validate_step

logger = logging.getLogger(__name__)


class CheckpointCoordinator(TargetChecks):
    """Runs saves in background threads and coordinates them with the monitor.

    Args:
        checkpoint_monitor: the :class:`CheckpointMonitor` actor handle.
        rank: this process's rank, reported with measurements (default: from
            ``RANK`` or torch.distributed).
        save_timeout: seconds after which a running save is reported failed (its
            step never commits) and a join on its slot gives up; None: saves run
            as long as they take (waits on them are bounded by ``stall_timeout_s``).
        rpc_timeout: seconds to wait for a monitor RPC that is not an admission.
        stall_warning_s: while a wait on a save lasts (a slot's join and
            :meth:`wait_all` under ``save_timeout=None``, a save or :meth:`prepare`
            waiting for a slot's prepare, :meth:`close`), a warning naming the slot,
            the step and the time waited is logged every this many seconds.
        stall_timeout_s: such a wait raises :class:`SaveTimeoutError` (a prepare's
            :class:`WaitTimeoutError`) naming what it waited for after this many
            seconds (default 2 h; :meth:`close` gives up silently); None: never.

    A save writes only into its own step's directory, ``<root>/global_step_<N>``
    under the monitor's root: a ``path`` or ``paths=`` entry anywhere else (another
    step's directory, the root's own files, a directory outside any step) is
    refused with :class:`SavePathError` before anything is written, and the step
    it was to save fails (it never waits for that save). A background save
    (:meth:`save_async`, :meth:`save_state_dict_async`) of a step the monitor has
    already committed for its kind writes nothing: the monitor decides when it
    admits the save, the skip is logged and counted as a re-save, and the
    committed files stay as the manifest lists them.
    """

    def __init__(
        self,
        checkpoint_monitor: Any,
        *,
        rank: int | None = None,
        save_timeout: float | None = None,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_S,
        stall_warning_s: float = STALL_WARNING_S,
        stall_timeout_s: float | None = STALL_TIMEOUT_S,
    ) -> None:
        for arg, value in (("save_timeout", save_timeout), ("stall_timeout_s", stall_timeout_s)):
            if value is not None and not validators.positive_seconds(value):
                raise ValueError(f"{arg} must be positive seconds or None, got {value!r}")
        if not validators.positive_seconds(stall_warning_s):
            raise ValueError(f"stall_warning_s must be positive seconds, got {stall_warning_s!r}")
        self.stall_warning_s = stall_warning_s
        self.stall_timeout_s = stall_timeout_s
        self._monitor = checkpoint_monitor
        # The link holds the rank and rpc_timeout it reports with (properties below).
        self._link = MonitorLink(
            checkpoint_monitor,
            rank=rank if rank is not None else default_rank(),
            rpc_timeout=rpc_timeout,
        )
        self.save_timeout = save_timeout
        # The slot table: each slot's latest save, whose writes must end before the
        # slot's next save starts. The lock guards exactly ``_saves``; it is held to
        # read or change the table only, never across a wait, an RPC or a call into
        # ``_staging`` (whose own lock is taken first when it asks if a slot is busy).
        self._lock = threading.Lock()
        self._saves: dict[str, SaveJob] = {}
        self._errors = SaveErrors()  # background failures not yet raised by wait_all
        self._staging = SlotStaging(
            self._link,
            save_running=self._save_running,
            logger=logger,
            stall_warning_s=stall_warning_s,
            stall_timeout_s=stall_timeout_s,
        )
        self._logger = logger

    def __enter__(self) -> CheckpointCoordinator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def logger(self) -> logging.Logger:
        """Where this coordinator logs failed saves, cold saves and staging take-overs."""
        return self._logger

    @logger.setter
    def logger(self, value: logging.Logger) -> None:
        self._logger = value
        self._staging.logger = value

    @property
    def monitor(self) -> Any:
        """The :class:`~obsckpt.monitor.CheckpointMonitor` actor handle this coordinator reports to."""
        return self._monitor

    @property
    def link(self) -> MonitorLink:
        """The :class:`MonitorLink` through which this process calls the monitor."""
        return self._link

    @property
    def rank(self) -> int | None:
        """This process's rank, reported with every save."""
        return self._link.rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._link.rank = value

    @property
    def rpc_timeout(self) -> float:
        """Seconds to wait for a monitor RPC that is not an admission."""
        return self._link.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        self._link.rpc_timeout = value

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def save_async(
        self,
        name: str,
        save_fn: Callable[[], Any],
        global_step: int,
        is_state_dict: bool = False,
        *,
        paths: Iterable[str | os.PathLike] | None = None,
        trace_context: dict | None = None,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
    ) -> None:
        """Run ``save_fn`` in a background thread, reported to the monitor.

        Joins the previous save of slot ``name`` first. Files named in
        ``paths`` are fsynced and checksummed here, on the node that wrote
        them, so the monitor's commit does not have to read them back (nor
        can miss them when it runs on another node).

        Args:
            name: the save slot (e.g. ``"model"``); safe in file names.
            save_fn: zero-argument callable doing the I/O.
            global_step: the training step.
            is_state_dict: True for state-dict (weight sync) saves.
            paths: files ``save_fn`` writes (optional), each inside this step's
                directory (else :class:`SavePathError` before ``save_fn`` runs). A
                directory stands for every file under it: name one only if this
                save alone writes into it (not a directory that other ranks' saves share).
            trace_context: W3C carrier of the step's trace (default: the current context).
            part: this save's index among ``parts`` (e.g. the rank), for a save
                made of several parts, one per process; with ``parts``.
            parts: how many parts make up the save (e.g. the world size). Every
                part is reported with its own files; the step counts the save
                as ONE finished save once every part has finished ok.
            unless_committed: kept for callers that pass it: a background save
                never runs ``save_fn`` if, when the monitor admits it, the step of
                this kind is already committed (or being committed, or below the
                committed step). The monitor decides for every rank at one point,
                so no rank rewrites a file the iteration file vouches for while
                another rank skips. Logged and counted as a re-save; nothing is
                written and no error raised.

        Raises:
            ValueError: ``part``/``parts`` malformed (both or neither; 0 <= part < parts).
            SavePathError: a ``paths`` entry lies outside this step's directory
                (the step fails; nothing ran).
        """
        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        files = path_list(paths)
        self._require_monitor()
        self._check_targets(files, name, global_step, is_state_dict, part, parts)
        job = self._job(name, global_step, is_state_dict, part, parts, unless_committed)
        root = self._link.checkpoint_root() if files else None
        self._submit(job, lambda: run_and_record(save_fn, files, root, self.rank), trace_context)

    def save_sync(
        self,
        save_fn: Callable[[], Any],
        global_step: int,
        is_state_dict: bool = False,
        *,
        name: str = "sync",
        paths: Iterable[str | os.PathLike] | None = None,
        trace_context: dict | None = None,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
    ) -> bool:
        """Run ``save_fn`` on this thread with monitor notifications (for saves with barriers).

        ``part``/``parts`` mark one part of a save made of several (see
        :meth:`save_async`). ``save_fn`` runs on the caller's thread, where it may
        hold collectives with ranks that save without obsckpt, so a step already
        committed is skipped only with ``unless_committed=True`` (pass it when
        every rank saves through obsckpt). Returns False when it skipped, else True.
        A ``paths`` entry outside this step's directory raises :class:`SavePathError`
        before ``save_fn`` runs. What
        ``save_fn`` raises (or checking ``paths`` raises) is raised as it is,
        after the failure is reported, with a note naming the slot and step; a
        failure of the save around it (the monitor unreachable, ``save_timeout``
        passed) raises :class:`SaveError`.
        """
        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        files = path_list(paths)
        self._require_monitor()
        self._check_targets(files, name, global_step, is_state_dict, part, parts)
        job = self._job(
            name, global_step, is_state_dict, part, parts, unless_committed, background=False
        )
        carrier = trace_context if trace_context is not None else tracing.inject()
        root = self._link.checkpoint_root() if files else None
        job.run(lambda: run_and_record(save_fn, files, root, self.rank), carrier, 0.0)
        return job.result()

    def save_state_dict_async(
        self,
        name: str,
        state_dict: Any,
        path: str | os.PathLike,
        global_step: int,
        is_state_dict: bool = False,
        *,
        trace_context: dict | None = None,
        overlap: bool = False,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
        staged: StagedSave | None = None,
    ) -> StagedSave:
        """Snapshot ``state_dict`` into staging buffers, then write it in the background.

        Without ``overlap``, returns once every tensor is copied into the
        slot's staging buffers (one arena per slot, pinned when CUDA is
        present, reused across calls while the shapes match), so the caller
        may change its tensors right away. With ``overlap``, returns at once: a
        copy thread queues the CUDA tensors' copies on a side stream, ordered
        after the work the caller had queued, and copies CPU tensors itself; the
        caller must call :meth:`StagedSave.wait_staged` on the result before
        changing the tensors in place (forward and backward passes do not
        change the weights; the optimizer step does). A tensor changed before
        its copy finished fails the save with ``TensorMutatedError``.

        The background thread writes a file ``torch.load`` reads, fsyncs it
        and renames it into place. A save that had to allocate its staging
        (no :meth:`prepare` for these shapes) is logged and counted in
        ``obsckpt_staging_cold_saves_total``. ``part``/``parts`` mark one part
        of a save made of several, e.g. each rank's shard; a step already
        committed is not written (see :meth:`save_async`). ``staged``, what
        :meth:`stage` returned for this slot and step and not staged over since,
        is written as it is: no second copy.

        Raises:
            SavePathError: ``path`` lies outside this step's directory, checked
                before anything is copied or written (the step fails).
        """
        # torch is imported here, not at module load: the monitor actor never needs it.
        from obsckpt.store.torchfile import upload_torch_file, write_torch_file

        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        path = os.fspath(path)
        self._require_monitor()
        self._check_targets(
            [path], name, global_step, is_state_dict, part, parts, through_temp=True
        )
        try:
            snapshot = self._staging.reusable(staged, name, global_step)
            copier, join_wait = None, 0.0
            if snapshot is None:
                join_wait = self._join(name, trace_context, global_step)
                snapshot, copier = self._staging.snapshot(
                    name, state_dict, global_step, overlap=overlap
                )
        except BaseException as exc:
            # Ctrl-C during the snapshot too: a step that registered this save would
            # otherwise wait for it (no lease was taken) until a later step commits.
            self._job(name, global_step, is_state_dict, part, parts).fail_unstarted(exc)
            raise

        destination = object_destination(self._link.checkpoint_root(), path)

        def write() -> list[layout.FileRecord]:
            if copier is not None:
                copier.finish()
            if destination is not None:
                store, step, rel = destination
                return [upload_torch_file(snapshot, store.writer(step, rel), rel)]
            return [write_torch_file(snapshot, path)]

        job = self._job(
            name,
            global_step,
            is_state_dict,
            part,
            parts,
            unless_committed,
            # Not written: the slot's staging is free once the copies have ended.
            on_skip=copier.settle if copier is not None else None,
        )
        self._submit(job, write, trace_context, join_wait=join_wait)
        return StagedSave(
            name, global_step, copier, snapshot, self._staging, self._staging.generation(name)
        )

    def stage(self, name: str, state_dict: Any, global_step: int) -> StagedSave:
        """Snapshot ``state_dict`` into slot ``name``'s staging, written by nothing yet.

        Publish it (:meth:`StagedSave.hold`), then pass it to the slot's save
        of the step (``save_state_dict_async(..., staged=)``): the state leaves
        the device once for both. Not saved, it is staged over by the slot's next save.
        """
        validate_slot(name)
        validate_step(global_step)
        self._join(name, None, global_step)
        return self._staging.stage_ahead(name, state_dict, global_step)

    def prepare(self, name: str, state_dict: Any, *, background: bool = False) -> Future:
        """Allocate, pin and pre-fault slot ``name``'s staging for ``state_dict``'s shapes.

        Call it at start-up (or with ``background=True`` while the first steps
        train) so the first save of the slot stalls no longer than a later one:
        the staging arena is mapped and its pages faulted in (registered with
        CUDA when pinned), and save threads are started. Only shapes and
        dtypes are read (``meta`` tensors will do). A save of the slot waits for
        a background prepare of it to finish, and a prepare for an earlier one;
        these waits have no bound (allocating and pinning take as long as they
        take) but are watched: every ``stall_warning_s`` a warning names the
        slot and the time waited.

        Returns:
            A future, done when the slot is prepared; its result is the bytes staged.
        """
        return self._staging.prepare(name, state_dict, background=background)

    def staging_bytes(self, name: str | None = None) -> tuple[int, int]:
        """(staging bytes, of which pinned) held for slot ``name`` (or all slots)."""
        return self._staging.nbytes(name)

    def close(self, timeout: float | None = None) -> None:
        """Wait for running saves, then release every slot's staging (unregistering pinned memory).

        Errors of failed saves stay for :meth:`wait_all`. A slot whose save is
        still running after ``timeout`` keeps its staging.
        """
        timeout = timeout if timeout is not None else self.stall_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = dict(self._saves)
        self._staging.wait_prepared(deadline)
        for job in jobs.values():
            wait_watched(
                job.wait_ended,
                _left(deadline),
                lambda job=job: f"slot {job.slot!r} to finish its save of step {job.step} (close)",
                warn_every=self.stall_warning_s,
                log=self.logger,
            )
        self._staging.release(keep={n for n, job in jobs.items() if not job.ended()})

    def wait_all(self, timeout: float | None = None) -> None:
        """Join every slot; raise the first background failure (once), with slot and step.

        A save that ran past ``save_timeout`` is not waited for: its
        :class:`SaveTimeoutError` is raised (it keeps its slot until it returns).
        ``timeout=None`` waits up to ``stall_timeout_s``; every ``stall_warning_s``
        it logs a warning naming the saves still running and the time waited.

        Raises:
            SaveTimeoutError: saves still running after ``timeout`` seconds (or
                ``stall_timeout_s``), or past ``save_timeout``.
            SaveError: a background save failed since the last call.
        """
        with self._lock:
            jobs = list(self._saves.values())
        bound = "timeout" if timeout is not None else "stall_timeout_s"
        timeout = timeout if timeout is not None else self.stall_timeout_s
        wait_jobs(jobs, timeout, bound, warn_every=self.stall_warning_s, log=self.logger)
        with self._lock:
            for name, job in list(self._saves.items()):
                if job.ended():
                    del self._saves[name]
        errors = self._errors.take()
        if errors:
            if len(errors) > 1:
                self.logger.error("obsckpt: %d saves failed; raising the first", len(errors))
            raise errors[0]

    def pending_errors(self) -> list[SaveError]:
        """Failures not yet raised by wait_all (without clearing them)."""
        return self._errors.pending()

    def committed_step(self, is_state_dict: bool = False) -> int | None:
        """The latest step of this kind the monitor has committed (None for none)."""
        return self._link.latest_steps().get(layout.kind_of(is_state_dict))

    # ------------------------------------------------------------------
    # Trainer side
    # ------------------------------------------------------------------

    async def register_and_monitor(
        self,
        global_step: int,
        is_state_dict: bool = False,
        state_dict_thread_count: int = 0,
        checkpoint_thread_count: int = 0,
    ) -> None:
        """Register the step's expected saves and submit it; it commits when they finish.

        For a step that is already committed (a checkpoint-sync and a full save of
        one step, a final save repeating the last step, a resume behind the
        iteration file) both calls change nothing; the monitor logs them.

        Called inside :func:`obsckpt.telemetry.tracing.checkpoint_span`, the
        commit joins that step's trace.
        """
        validate_step(global_step)
        self._require_monitor()
        if state_dict_thread_count or checkpoint_thread_count:
            await self._link.register_thread_count_async(
                global_step,
                state_dict_thread_count=state_dict_thread_count,
                checkpoint_thread_count=checkpoint_thread_count,
            )
        await self._link.monitor_step_async(
            global_step, is_state_dict=is_state_dict, trace_context=tracing.inject() or None
        )

    # ------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------

    def _require_monitor(self) -> None:
        if self._monitor is None:
            raise ValueError(
                "this CheckpointCoordinator has no monitor (checkpoint_monitor=None), so its "
                "saves could never commit; create it with the monitor actor handle, e.g. "
                "CheckpointCoordinator(CheckpointMonitor.get_actor(namespace=..., "
                "default_local_dir=...))"
            )

    def _join(self, name: str, trace_context: dict | None = None, step: int | None = None) -> float:
        """Wait for the previous save of ``name`` (see :meth:`SaveJob.join`); seconds waited.

        Bounded by ``save_timeout``, else ``stall_timeout_s``; watched (a warning
        every ``stall_warning_s`` names the slot, both steps and the time waited).
        """
        with self._lock:
            prev = self._saves.get(name)
        if prev is None:
            return 0.0
        timeout: float | None = self.save_timeout
        bound = "save_timeout"
        if timeout is None:
            timeout, bound = self.stall_timeout_s, "stall_timeout_s"
        return prev.join(
            trace_context, timeout, warn_every=self.stall_warning_s, next_step=step, bound=bound
        )

    def _job(
        self,
        name: str,
        step: int,
        is_state_dict: bool,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
        *,
        on_skip: Callable[[], None] | None = None,
        background: bool = True,
    ) -> SaveJob:
        """A save of slot ``name``; a ``background`` one's failure waits for :meth:`wait_all`,
        and it is not written into a step already committed for its kind."""
        return SaveJob(
            name,
            step,
            layout.kind_of(is_state_dict),
            link=self._link,
            logger=self.logger,
            save_timeout=self.save_timeout,
            part=part,
            parts=parts,
            # A background save never writes into a committed step: nothing waits on
            # it that could hang (a synchronous save's function may hold collectives).
            unless_committed=unless_committed or background,
            on_skip=on_skip,
            on_error=self._errors.add if background else None,
        )

    def _submit(
        self,
        job: SaveJob,
        fn: Callable[[], list[layout.FileRecord]],
        trace_context: dict | None,
        *,
        join_wait: float | None = None,
    ) -> None:
        """Run ``job`` on a save thread once the slot's previous save has ended."""
        if join_wait is None:
            try:
                join_wait = self._join(job.slot, trace_context, job.step)
            except SaveTimeoutError as exc:
                job.fail_unstarted(exc)
                raise
        # The caller's context is captured here and formatted as a carrier on the
        # save thread: the caller pays one context read, not the formatting.
        parent = trace_context if trace_context is not None else tracing.capture()
        with self._lock:
            self._saves[job.slot] = job
        try:
            THREADS.submit(
                lambda: job.run(fn, parent, join_wait), f"obsckpt-save-{job.slot}-step{job.step}"
            )
        except BaseException:
            # No thread will run it: the slot must not wait for it.
            with self._lock:
                if self._saves.get(job.slot) is job:
                    del self._saves[job.slot]
            raise

    def _save_running(self, name: str) -> bool:
        """Whether slot ``name``'s latest save has not returned yet."""
        with self._lock:
            job = self._saves.get(name)
        return job is not None and not job.ended()


def _left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (``time.monotonic()``), at least 0; None for no deadline."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
