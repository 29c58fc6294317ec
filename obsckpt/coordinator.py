"""CheckpointCoordinator: background saves per slot, reported to the monitor.

Worker side (FSDP / Megatron ranks): each save runs on a background thread,
named ``obsckpt-save-<slot>-step<N>`` while it runs; threads are kept and
reused, so submitting a save costs the caller a queue put, not a thread
start. A new save of a slot first joins the previous one, so two writes to
one destination never overlap. The monitor is told when a save starts (admission under the save strategy) and
when it ends, successfully or not, with its measurements. A failure is
stored and raised once by the next :meth:`CheckpointCoordinator.wait_all`.

State-dict saves copy into one staging arena per slot (see
:mod:`obsckpt.staging`): :meth:`CheckpointCoordinator.prepare` makes it before
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
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from obsckpt import commit, layout, reader, validators
from obsckpt.errors import SaveError, SaveTimeoutError
from obsckpt.layout import FileRecord
from obsckpt.monitor_link import MonitorLink
from obsckpt.save_threads import THREADS
from obsckpt.telemetry import tracing
from obsckpt.tracker import validate_parts
from obsckpt.validators import validate_slot, validate_step

logger = logging.getLogger(__name__)


def _default_rank() -> int | None:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return None


def _checked_rpc_timeout(value: object) -> float:
    if not validators.positive_seconds(value) or value == float("inf"):
        raise ValueError(
            f"rpc_timeout must be a positive, finite number of seconds, got {value!r} "
            "(the default is 300)"
        )
    return float(value)


def _checked_rank(value: object) -> int:
    rank = validators.non_negative_int(value)  # an int, or one numpy's integer types say is one
    if rank is None:
        raise ValueError(
            f"rank must be a non-negative integer (this process's rank) or None to take "
            f"it from RANK or torch.distributed, got {value!r}"
        )
    return rank


@dataclass(slots=True)
class _Save:
    slot: str
    step: int
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    # Set when the save's outcome is known to the caller: it ended (``done``), or the
    # watchdog reported it timed out while it still runs (``timeout_error``).
    settled: threading.Event = field(default_factory=threading.Event)
    reported: bool = False
    timeout_error: SaveTimeoutError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    part: int | None = None  # index among ``parts`` parts of one save (e.g. the rank)
    parts: int | None = None
    # Not written when the monitor finds the step of its kind closed at admission.
    unless_committed: bool = False
    # Run instead of the I/O when it is not written (e.g. let a staging copy finish).
    on_skip: Callable[[], None] | None = None
    skipped: bool = False
    # What the save's own I/O raised (not an admission, report or timeout failure).
    fn_error: BaseException | None = None

    def part_kwargs(self) -> dict[str, int | None]:
        """``part``/``parts`` for the monitor's RPCs; nothing for an unsplit save."""
        return {} if self.parts is None else {"part": self.part, "parts": self.parts}


class StagedSave:
    """What :meth:`CheckpointCoordinator.save_state_dict_async` returns.

    Call :meth:`wait_staged` before changing the saved tensors in place (the
    optimizer step). Without ``overlap`` the state is staged before the save
    call returns, and it returns at once.
    """

    __slots__ = ("slot", "step", "_copy")

    def __init__(self, slot: str, step: int, copy: Any = None) -> None:
        self.slot = slot
        self.step = step
        self._copy = copy  # staging.StagingCopy of an overlapped save

    @property
    def staged(self) -> bool:
        """Whether every copy has finished (a failed copy counts as finished)."""
        return self._copy is None or self._copy.finished()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Until the snapshot's copies are done, then the caller may change its tensors.

        CUDA sources: the caller's current stream waits for the side stream's
        copies (an event; the host does not block). CPU sources: blocks until
        the copy thread has finished.

        Raises:
            SaveTimeoutError: the copies did not finish within ``timeout`` seconds.
            TensorMutatedError: a tensor was changed in place before its copy
                finished; this save fails (its step never commits).
        """
        if self._copy is None:
            return
        if not self._copy.wait(timeout):
            raise SaveTimeoutError(
                f"staging of slot {self.slot!r} step {self.step} did not finish within "
                f"{timeout} s ({len(self._copy.copies)} tensors)",
                slot=self.slot,
                step=self.step,
            )


class CheckpointCoordinator:
    """Runs saves in background threads and coordinates them with the monitor.

    Args:
        checkpoint_monitor: the :class:`CheckpointMonitor` actor handle.
        rank: this process's rank, reported with measurements (default: from
            ``RANK`` or torch.distributed).
        save_timeout: seconds after which a running save is reported failed (its
            step never commits) and a join on its slot gives up; None waits forever.
        rpc_timeout: seconds to wait for a monitor RPC that is not an admission.
    """

    def __init__(
        self,
        checkpoint_monitor: Any,
        *,
        rank: int | None = None,
        save_timeout: float | None = None,
        rpc_timeout: float = 300.0,
    ) -> None:
        if save_timeout is not None and not validators.positive_seconds(save_timeout):
            raise ValueError(f"save_timeout must be positive seconds or None, got {save_timeout!r}")
        self._monitor = checkpoint_monitor
        # The link holds the rank and rpc_timeout it reports with (properties below).
        self._link = MonitorLink(
            checkpoint_monitor,
            rank=_checked_rank(rank) if rank is not None else _default_rank(),
            rpc_timeout=_checked_rpc_timeout(rpc_timeout),
        )
        self.save_timeout = save_timeout
        self._saves: dict[str, _Save] = {}
        self._errors: list[SaveError] = []
        self._lock = threading.Lock()
        self._staging: dict[str, Any] = {}  # slot -> staging.StagingBuffers
        self._staged_at: dict[str, int] = {}  # slot -> step of its last save's snapshot
        self._took_over = False  # whether a slot took over another's staging (logged once)
        self._preparing: dict[str, Future] = {}  # slot -> prepare() running in the background
        self.logger = logger

    @property
    def monitor(self) -> Any:
        """The :class:`~obsckpt.monitor.CheckpointMonitor` actor handle this coordinator reports to."""
        return self._monitor

    @property
    def rank(self) -> int | None:
        """This process's rank, reported with every save."""
        return self._link.rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._link.rank = None if value is None else _checked_rank(value)

    @property
    def rpc_timeout(self) -> float:
        """Seconds to wait for a monitor RPC that is not an admission."""
        return self._link.rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        self._link.rpc_timeout = _checked_rpc_timeout(value)

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
            paths: files ``save_fn`` writes (optional). A directory stands for
                every file under it: name one only if this save alone writes
                into it (not a directory that other ranks' saves share).
            trace_context: W3C carrier of the step's trace (default: the current context).
            part: this save's index among ``parts`` (e.g. the rank), for a save
                made of several parts, one per process; with ``parts``.
            parts: how many parts make up the save (e.g. the world size). Every
                part is reported with its own files; the step counts the save
                as ONE finished save once every part has finished ok.
            unless_committed: do not run ``save_fn`` if, when the monitor admits
                the save, the step of this kind is already committed (or being
                committed, or below the committed step): the monitor decides
                for every rank at one point, so no rank rewrites a file the
                iteration file vouches for while another rank skips. Logged and
                counted as a re-save; nothing is written and no error raised.

        Raises:
            ValueError: ``part``/``parts`` malformed (both or neither; 0 <= part < parts).
        """
        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        path_list = _path_list(paths)
        self._require_monitor()
        self._submit(
            name,
            lambda: _run_and_record(save_fn, path_list),
            global_step,
            is_state_dict,
            trace_context,
            part=part,
            parts=parts,
            unless_committed=unless_committed,
        )

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

        ``part``/``parts`` mark one part of a save made of several, and
        ``unless_committed`` skips a step already committed (see :meth:`save_async`).
        Returns False when ``unless_committed`` skipped it, else True. What
        ``save_fn`` raises (or checking ``paths`` raises) is raised as it is,
        after the failure is reported, with a note naming the slot and step; a
        failure of the save around it (the monitor unreachable, ``save_timeout``
        passed) raises :class:`SaveError`.
        """
        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        path_list = _path_list(paths)
        self._require_monitor()
        save = _Save(
            name,
            global_step,
            layout.kind_of(is_state_dict),
            part=part,
            parts=parts,
            unless_committed=unless_committed,
        )
        carrier = trace_context if trace_context is not None else tracing.inject()
        error = self._run(save, lambda: _run_and_record(save_fn, path_list), carrier, 0.0)
        # A save that ran past save_timeout was reported failed by the watchdog, even
        # if it returned since: the caller learns it here, not from a later wait_all.
        error = error or save.timeout_error
        if error is not None:
            with self._lock:
                self._errors = [e for e in self._errors if e is not error]
            own = save.fn_error
            cause = error.__cause__
            if own is not None and cause is own:
                # What save_fn raised, as a direct call of it would: callers catch its type.
                own.add_note(f"obsckpt: {error} (the monitor was told; the step fails)")
                raise own
            if cause is not None and not isinstance(cause, Exception):
                # Ctrl-C (or sys.exit) while waiting for admission or reporting: the caller's
                # `except Exception` around the save must not swallow it as a failed save.
                cause.add_note(f"obsckpt: {error} (the step fails)")
                raise cause
            raise error
        return not save.skipped

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
        of a save made of several, e.g. each rank's shard, and
        ``unless_committed`` skips a step already committed (see :meth:`save_async`).
        """
        # torch is imported here, not at module load: the monitor actor never needs it.
        from obsckpt.staging import StagingCopy
        from obsckpt.torchfile import write_torch_file

        validate_slot(name)
        validate_step(global_step)
        validate_parts(part, parts)
        path = os.fspath(path)
        self._require_monitor()
        try:
            join_wait = self._join(name, trace_context)
            staging = self._staging_for(name, state=state_dict, step=global_step)
            allocations = staging.allocations
            copier = None
            if overlap:
                snapshot, copies = staging.plan(state_dict)
                copier = StagingCopy(staging, copies)
            else:
                snapshot = staging.stage(state_dict)
            if staging.allocations != allocations:
                self._cold_save(name, global_step, staging)
            if copier is not None:
                # Kept threads: the copy thread costs a queue put, not a thread start.
                copier.start(
                    lambda run: THREADS.submit(run, f"obsckpt-stage-{name}-step{global_step}")
                )
        except BaseException as exc:
            # Ctrl-C during the snapshot too: a step that registered this save would
            # otherwise wait for it (no lease was taken) until a later step commits.
            self._report_unstarted(name, global_step, is_state_dict, exc, part=part, parts=parts)
            raise

        def write() -> list[FileRecord]:
            if copier is not None:
                copier.finish()
            return [write_torch_file(snapshot, path)]

        self._submit(
            name,
            write,
            global_step,
            is_state_dict,
            trace_context,
            join_wait=join_wait,
            part=part,
            parts=parts,
            unless_committed=unless_committed,
            # Not written: the slot's staging is free once the copies have ended.
            on_skip=copier.settle if copier is not None else None,
        )
        return StagedSave(name, global_step, copier)

    def prepare(self, name: str, state_dict: Any, *, background: bool = False) -> Future:
        """Allocate, pin and pre-fault slot ``name``'s staging for ``state_dict``'s shapes.

        Call it at start-up (or with ``background=True`` while the first steps
        train) so the first save of the slot stalls no longer than a later one:
        the staging arena is mapped and its pages faulted in (registered with
        CUDA when pinned), and save threads are started. Only shapes and
        dtypes are read (``meta`` tensors will do). A save of the slot waits for
        a background prepare of it to finish.

        Returns:
            A future, done when the slot is prepared; its result is the bytes staged.
        """
        import obsckpt.staging  # noqa: F401 - the import (torch, the writer) is part of what is prepared

        validate_slot(name)
        future: Future = Future()

        def run() -> None:
            try:
                THREADS.warm(2)  # a save and an overlapped copy start no thread
                staging = self._staging_for(name, wait_prepare=False)
                staging.prepare(state_dict)
                self._record_staging(name, staging)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)
            else:
                future.set_result(staging.bytes_allocated)

        with self._lock:
            previous = self._preparing.get(name)
            self._preparing[name] = future
        if previous is not None:
            previous.exception()  # one prepare of a slot at a time
        if background:
            threading.Thread(target=run, name=f"obsckpt-prepare-{name}", daemon=True).start()
        else:
            run()
            future.result()
        return future

    def staging_bytes(self, name: str | None = None) -> tuple[int, int]:
        """(staging bytes, of which pinned) held for slot ``name`` (or all slots)."""
        with self._lock:
            slots = [s for n, s in self._staging.items() if name is None or n == name]
        return sum(s.bytes_allocated for s in slots), sum(s.pinned_bytes for s in slots)

    def close(self, timeout: float | None = None) -> None:
        """Wait for running saves, then release every slot's staging (unregistering pinned memory).

        Errors of failed saves stay for :meth:`wait_all`. A slot whose save is
        still running after ``timeout`` keeps its staging.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            saves = dict(self._saves)
            preparing = list(self._preparing.values())
        for future in preparing:
            try:
                future.exception(
                    None if deadline is None else max(0.0, deadline - time.monotonic())
                )
            except FutureTimeoutError:
                pass  # its slot is still being prepared; it keeps its staging below
        for save in saves.values():
            save.done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            busy = {n for n, f in self._preparing.items() if not f.done()}
            busy |= {n for n, save in saves.items() if not save.done.is_set()}
            names = [n for n in self._staging if n not in busy]
            released = [(n, self._staging.pop(n)) for n in names]
        for name, staging in released:
            staging.release()
            self._record_staging(name, staging)

    def _staging_for(
        self, name: str, *, wait_prepare: bool = True, state: Any = None, step: int | None = None
    ) -> Any:
        """Slot ``name``'s staging. A save (``state`` of ``step``) of a slot that has none
        takes over the staging of an idle slot of the same layout last saved at an
        earlier step (see :meth:`_take_over`)."""
        from obsckpt.staging import StagingBuffers

        if wait_prepare:
            with self._lock:
                future = self._preparing.pop(name, None)
            if future is not None and future.exception() is not None:
                self.logger.warning(
                    "obsckpt: prepare() of slot %r failed (%s); the save allocates its staging",
                    name,
                    future.exception(),
                )
        with self._lock:
            staging = self._staging.get(name)
            if step is not None:
                self._staged_at[name] = step
        if staging is None:
            staging = StagingBuffers()
            if state is not None and step is not None:
                staging = self._take_over(name, staging, staging.layout_of(state), step)
            with self._lock:
                staging = self._staging.setdefault(name, staging)
        return staging

    def _take_over(self, name: str, fresh: Any, layout: Any, step: int) -> Any:
        """The staging of an idle slot that fits ``layout``, moved to ``name``; else ``fresh``.

        Slot names that change every step (``model_<N>``) would otherwise keep one
        arena the size of the state per step until :meth:`close`. Only a slot
        whose last save is finished and was a snapshot of an earlier step is
        taken over: a slot prepared and not saved yet, or one saved in this
        step, keeps its staging.
        """
        with self._lock:
            for old, staging in self._staging.items():
                if self._staged_at.get(old, step) >= step or self._slot_busy(old):
                    continue
                if staging.fits(layout):
                    del self._staging[old]
                    self._staged_at.pop(old, None)
                    self._staging[name] = staging
                    break
            else:
                return fresh
            first = not self._took_over
            self._took_over = True
        (self.logger.warning if first else self.logger.debug)(
            "obsckpt: slot %r takes over the staging of slot %r (%.1f MiB, same shapes, idle "
            "since an earlier step) instead of allocating its own. Slot names that change "
            "every step would otherwise hold one staging arena per step; name slots by what "
            'they hold ("model", "optimizer")',
            name,
            old,
            staging.bytes_allocated / (1 << 20),
        )
        self._link.record_staging(old, fresh)  # the old slot holds nothing now
        self._record_staging(name, staging)
        return staging

    def _slot_busy(self, name: str) -> bool:
        """Whether slot ``name`` has a save or a prepare() running (caller holds the lock)."""
        preparing = self._preparing.get(name)
        if preparing is not None and not preparing.done():
            return True
        save = self._saves.get(name)
        return save is not None and not save.done.is_set()

    def _cold_save(self, name: str, step: int, staging: Any) -> None:
        self.logger.info(
            "obsckpt: save of slot %r step %d allocated its staging (%.1f MiB in %.3f s) on the "
            "caller's path; call prepare() at start-up to take this out of the first save",
            name,
            step,
            staging.bytes_allocated / (1 << 20),
            staging.last_allocation_s,
        )
        self._record_staging(name, staging, cold=True)

    def _record_staging(self, name: str, staging: Any, *, cold: bool = False) -> None:
        # Sent only when a slot's staging changes (prepare, a cold save, close), not per save.
        self._link.record_staging(name, staging, cold=cold)

    def wait_all(self, timeout: float | None = None) -> None:
        """Join every slot; raise the first background failure (once), with slot and step.

        A save that ran past ``save_timeout`` is not waited for: its
        :class:`SaveTimeoutError` is raised (it keeps its slot until it returns).

        Raises:
            SaveTimeoutError: saves still running after ``timeout`` seconds, or past
                ``save_timeout``.
            SaveError: a background save failed since the last call.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            saves = list(self._saves.values())
        for save in saves:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            save.settled.wait(remaining)
        running = [s for s in saves if not s.settled.is_set()]
        if running:
            names = ", ".join(f"{s.slot!r} (step {s.step})" for s in running)
            raise SaveTimeoutError(
                f"{len(saves) - len(running)} of {len(saves)} saves finished after "
                f"{timeout:.1f} s; still running: {names}",
                slot=running[0].slot,
                step=running[0].step,
            )
        with self._lock:
            for name, save in list(self._saves.items()):
                if save.done.is_set():
                    del self._saves[name]
            errors, self._errors = self._errors, []
        if errors:
            if len(errors) > 1:
                self.logger.error("obsckpt: %d saves failed; raising the first", len(errors))
            raise errors[0]

    def pending_errors(self) -> list[SaveError]:
        """Failures not yet raised by wait_all (without clearing them)."""
        with self._lock:
            return list(self._errors)

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
            await self._monitor.register_thread_count.remote(
                global_step,
                state_dict_thread_count=state_dict_thread_count,
                checkpoint_thread_count=checkpoint_thread_count,
            )
        await self._monitor.monitor_step.remote(
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

    def _join(self, name: str, trace_context: dict | None = None) -> float:
        """Wait for the previous save of ``name``; returns seconds waited.

        The wait's span joins the caller's ``trace_context`` (else the current context).
        """
        with self._lock:
            prev = self._saves.get(name)
        if prev is None or prev.done.is_set():
            return 0.0
        t0 = time.perf_counter()
        attrs = {"obsckpt.slot": name, "obsckpt.step": prev.step, "obsckpt.rank": self.rank}
        with tracing.span("obsckpt.join_wait", carrier=trace_context, attributes=attrs):
            finished = prev.done.wait(self.save_timeout)
        waited = time.perf_counter() - t0
        if not finished:
            raise SaveTimeoutError(
                f"slot {name!r} is still busy with step {prev.step} after {waited:.1f} s "
                f"(save_timeout); a new save cannot share its destination. Check the stuck save "
                "(py-spy dump) or give this save another slot name",
                slot=name,
                step=prev.step,
            )
        return waited

    def _report_unstarted(
        self,
        name: str,
        step: int,
        is_state_dict: bool,
        exc: BaseException,
        *,
        part: int | None = None,
        parts: int | None = None,
    ) -> None:
        """Tell the monitor that a save failed before it started (the caller gets ``exc``).

        Its step may have registered it already: the step fails now, instead of
        waiting for a save that will never come.
        """
        save = _Save(name, step, layout.kind_of(is_state_dict), part=part, parts=parts)
        self._link.failed(save, None, exc, None, admitted=False)

    def _submit(
        self,
        name: str,
        fn: Callable[[], list[FileRecord]],
        step: int,
        is_state_dict: bool,
        trace_context: dict | None,
        *,
        join_wait: float | None = None,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        if join_wait is None:
            try:
                join_wait = self._join(name, trace_context)
            except SaveTimeoutError as exc:
                self._report_unstarted(name, step, is_state_dict, exc, part=part, parts=parts)
                raise
        save = _Save(
            name,
            step,
            layout.kind_of(is_state_dict),
            part=part,
            parts=parts,
            unless_committed=unless_committed,
            on_skip=on_skip,
        )
        # The caller's context is captured here and formatted as a carrier on the
        # save thread: the caller pays one context read, not the formatting.
        parent = trace_context if trace_context is not None else tracing.capture()
        with self._lock:
            self._saves[name] = save
        try:
            THREADS.submit(
                lambda: self._run(save, fn, parent, join_wait, background=True),
                f"obsckpt-save-{name}-step{step}",
            )
        except BaseException:
            # No thread will run it: the slot must not wait for it.
            with self._lock:
                if self._saves.get(name) is save:
                    del self._saves[name]
            raise

    def _run(
        self,
        save: _Save,
        fn: Callable[[], list[FileRecord]],
        carrier: dict | otel_context.Context | None,
        join_wait: float,
        *,
        background: bool = False,
    ) -> SaveError | None:
        """Body of a save: admission, I/O, report. Returns the error, also stored.

        ``carrier`` is the step's W3C carrier, or a context from :func:`tracing.capture`.
        ``background``: on a save thread, so the error waits for ``wait_all()``.
        """
        carrier = tracing.as_carrier(carrier)
        attrs = {
            "obsckpt.step": save.step,
            "obsckpt.slot": save.slot,
            "obsckpt.kind": save.kind,
            "obsckpt.rank": self.rank,
        }
        ticket = None
        timer = None
        error: SaveError | None = None
        reporting = False  # this thread claimed the report of a save that ran ok
        writing = False  # fn has been called
        try:
            with tracing.span("obsckpt.save", carrier=carrier, attributes=attrs) as span:
                # The step's context goes with the admission, so the monitor's commit
                # span joins the step's trace even if the trainer never submits one.
                admitted = self._link.admit(save, carrier or tracing.inject() or None)
                ticket = admitted.get("ticket")
                if admitted.get("skipped"):
                    span.set_attribute("obsckpt.skipped", True)
                    self._skip(save, admitted.get("latest"))
                    return None
                if admitted.get("admission_wait_s"):
                    # The monitor's own measure of the queueing, without the RPC's latency.
                    end = time.time_ns()
                    start = end - int(admitted["admission_wait_s"] * 1e9)
                    tracing.record_wait("obsckpt.admission_wait", start, end, attrs)
                if self.save_timeout is not None:
                    timer = threading.Timer(
                        self.save_timeout, self._on_timeout, (save, ticket, join_wait)
                    )
                    timer.daemon = True
                    timer.name = f"obsckpt-watchdog-{save.slot}-step{save.step}"
                    timer.start()
                t0 = time.perf_counter()
                writing = True
                try:
                    records = fn() or []
                except BaseException as exc:
                    save.fn_error = exc
                    span.set_attribute("obsckpt.error", type(exc).__name__)
                    raise
                if save.reported:
                    # The watchdog already reported this save as timed out; the trace agrees.
                    span.set_attribute("obsckpt.error", SaveTimeoutError.__name__)
                    span.set_status(
                        Status(StatusCode.ERROR, f"exceeded save_timeout={self.save_timeout} s")
                    )
                duration = time.perf_counter() - t0
                nbytes = sum(r.size for r in records)
                span.set_attribute("obsckpt.bytes", nbytes)
            if timer is not None:
                timer.cancel()
            reporting = self._claim_report(save)
            if reporting:
                self._link.finished(
                    save,
                    ticket,
                    ok=True,
                    duration_s=duration,
                    nbytes=nbytes,
                    join_wait_s=join_wait,
                    files=[_relative(r, save.step) for r in records],
                )
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised by wait_all
            if timer is not None:
                timer.cancel()
            if not writing and save.on_skip is not None:
                # Nothing will write this snapshot (its admission failed): let its staging
                # copy end here, so the slot's buffers and the caller's tensors are let go.
                try:
                    save.on_skip()
                except BaseException:  # noqa: BLE001 - the admission's error is the one raised
                    self.logger.exception(
                        "obsckpt: ending the staging copy of %r failed", save.slot
                    )
            what = f"background save {save.slot!r} of step {save.step} ({save.kind})"
            if reporting:
                # The files are written, but the monitor may not have counted the
                # save, so its step may never commit: the caller hears of it.
                what += " finished, but reporting it to the monitor failed"
            else:
                what += " failed"
            error = SaveError(
                f"{what}: {type(exc).__name__}: {exc}", slot=save.slot, step=save.step
            )
            error.__cause__ = exc
            self.logger.error("obsckpt: %s", error, exc_info=exc)
            if not reporting:
                if self._claim_report(save):
                    self._link.failed(save, ticket, exc, join_wait)
                else:
                    error = None  # the watchdog already reported and stored a timeout
        finally:
            self._link.drop_lease(ticket)
            save.done.set()
            save.settled.set()
        if error is not None:
            with self._lock:
                if background and self._errors:
                    # Only the first stored failure is raised; the others were logged with
                    # their tracebacks. A traceback keeps its frames, and they keep what the
                    # save was writing (save_fn's closure, a snapshot): until wait_all(), a
                    # job that waits rarely would hold one copy per failed save.
                    _drop_tracebacks(error)
                self._errors.append(error)
        return error

    def _skip(self, save: _Save, latest: int | None) -> None:
        """The monitor did not admit ``save`` (``unless_committed``, step closed): write nothing."""
        self.logger.info(
            "obsckpt: save %r of step %d (%s) not written: the monitor has committed step %s "
            "of this kind, and a re-save would change files the iteration file vouches for",
            save.slot,
            save.step,
            save.kind,
            latest,
        )
        save.skipped = True
        if save.on_skip is not None:
            save.on_skip()

    @staticmethod
    def _claim_report(save: _Save) -> bool:
        with save.lock:
            if save.reported:
                return False
            save.reported = True
            return True

    def _on_timeout(self, save: _Save, ticket, join_wait: float) -> None:
        if not self._claim_report(save):
            return
        exc = SaveTimeoutError(
            f"background save {save.slot!r} of step {save.step} ({save.kind}) did not finish "
            f"within save_timeout={self.save_timeout} s; the step will not be committed",
            slot=save.slot,
            step=save.step,
        )
        self.logger.error("obsckpt: %s", exc)
        save.timeout_error = exc
        with self._lock:
            self._errors.append(exc)
        self._link.failed(save, ticket, exc, join_wait)
        save.settled.set()


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Let go of the tracebacks of ``exc`` and of its causes (their messages stay)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _path_list(paths: Iterable[str | os.PathLike] | None) -> list[str] | None:
    if paths is None:
        return None
    if isinstance(paths, (str, bytes, os.PathLike)):
        raise ValueError(
            f"paths must be a list of files or directories, got the single path {paths!r}; "
            "pass [path]"
        )
    return [os.fspath(p) for p in paths]


def _run_and_record(save_fn: Callable[[], Any], paths: list[str] | None) -> list[FileRecord]:
    """Run ``save_fn``, then make what it wrote under ``paths`` durable and checksum it.

    A path that is a directory stands for every file under it (temp files of
    unfinished writes excepted); its directories are fsynced too.
    """
    save_fn()
    if not paths:
        return []
    files: list[str] = []
    dirs: set[str] = set()
    for path in map(os.path.abspath, paths):
        if os.path.isdir(path):
            for dirpath, names in reader.walk_files(path):
                files += [os.path.join(dirpath, n) for n in names]
                dirs.add(dirpath)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(
                f"{path} is named in paths= but the save function did not write it (or it "
                "is not a regular file or directory): name only what the save writes"
            )
        dirs.add(os.path.dirname(path))
    files = list(dict.fromkeys(files))  # a file named and inside a named directory: once
    # Concurrent fsyncs share journal commits; the checksums then read the page cache.
    commit.fsync_many([(f, False) for f in files] + [(d, True) for d in sorted(dirs)])
    records = []
    for path in files:
        size, crc = reader.file_crc32(path)
        records.append(FileRecord(path=path, size=size, crc32=crc))
    return records


def _relative(rec: FileRecord, step: int) -> dict:
    """A record whose path is relative to its ``global_step_<step>`` directory, if inside one."""
    located = layout.step_of_path(rec.path)
    path = rec.path
    if located is not None and located[1] == step:
        path = os.path.relpath(os.path.abspath(rec.path), layout.step_dir(*located))
    return FileRecord(path=path, size=rec.size, crc32=rec.crc32).to_json()
