"""One save of a slot at a step: admission, I/O under a watchdog, one report.

A save's outcome is one :class:`concurrent.futures.Future`. Two parties may
settle it: the save itself when its I/O ends, and the ``save_timeout``
watchdog while the I/O still runs. Each first claims the future (moving it
from pending to running, which succeeds once); the one that claims it reports
to the monitor and then sets the result or exception, the other does nothing.
So the monitor hears of every save exactly once, and a caller waiting on the
future learns the outcome the monitor was told.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.trace import Status, StatusCode

from obsckpt.errors import SaveError, SaveTimeoutError
from obsckpt.monitor_link import MonitorLink, one_line
from obsckpt.save_threads import STALL_WARNING_S, wait_watched
from obsckpt.store import commit, layout
from obsckpt.store.file_records import relative_record
from obsckpt.store.layout import FileRecord
from obsckpt.store.uri import is_remote
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing


@dataclass(frozen=True, slots=True)
class _Written:
    """What a save's I/O produced, for its report."""

    records: list[FileRecord]
    duration_s: float
    nbytes: int


class SaveJob:
    """One save of slot ``slot`` at step ``step``, run by :meth:`run` on one thread.

    Its outcome is :attr:`outcome`: True once written and reported, False when
    the monitor skipped it at admission (``unless_committed``), or the
    :class:`SaveError` it failed with (:class:`SaveTimeoutError` when it ran past
    ``save_timeout``). A save that timed out keeps running, and its slot, until
    :meth:`wait_ended` says it returned.

    Args:
        slot: the save slot (e.g. ``"model"``).
        step: the training step.
        kind: ``"checkpoint"`` or ``"state_dict"`` (see :func:`obsckpt.store.layout.kind_of`).
        link: the monitor link that admits and hears of the save.
        logger: where failures are logged.
        save_timeout: seconds of I/O after which the watchdog fails the save; None: no watchdog.
        part: this save's index among ``parts`` (e.g. the rank), for a split save.
        parts: how many parts make up the save.
        unless_committed: not written when the monitor finds its step committed at admission.
        on_skip: run instead of the I/O when it is not written (e.g. let a staging copy end).
        on_error: called with the failure before :attr:`outcome` is set, so a
            caller woken by the future finds it already stored.
    """

    def __init__(
        self,
        slot: str,
        step: int,
        kind: str,
        *,
        link: MonitorLink,
        logger: logging.Logger,
        save_timeout: float | None = None,
        part: int | None = None,
        parts: int | None = None,
        unless_committed: bool = False,
        on_skip: Callable[[], None] | None = None,
        on_error: Callable[[SaveError], None] | None = None,
    ) -> None:
        self.slot = slot
        self.step = step
        self.kind = kind
        self.part = part
        self.parts = parts
        self.unless_committed = unless_committed
        self.outcome: Future[bool] = Future()
        # What the save's own I/O raised (not an admission, report or timeout failure).
        self.fn_error: BaseException | None = None
        self._link = link
        self._logger = logger
        self._save_timeout = save_timeout
        self._on_skip = on_skip
        self._on_error = on_error
        self._ticket: int | None = None
        self._ended = threading.Event()  # run() has returned: the slot's destination is free

    def result(self) -> bool:
        """The outcome for a caller that ran :meth:`run` on its own thread.

        Returns whether the save was written (False: skipped at admission).
        What the save's own I/O raised is raised as it is, as a direct call of
        it would (callers catch its type), with a note naming the slot and step;
        Ctrl-C or ``sys.exit`` while waiting for admission or reporting too.
        Any other failure raises its :class:`SaveError`. A save the watchdog
        failed raises :class:`SaveTimeoutError`, even if it returned since.
        """
        error = self.outcome.exception()
        if error is None:
            return self.outcome.result()
        cause = error.__cause__
        if self.fn_error is not None and cause is self.fn_error:
            self.fn_error.add_note(f"obsckpt: {error} (the monitor was told; the step fails)")
            raise self.fn_error
        if cause is not None and not isinstance(cause, Exception):
            # The caller's `except Exception` around the save must not swallow it as a
            # failed save.
            cause.add_note(f"obsckpt: {error} (the step fails)")
            raise cause
        raise error

    def join(
        self,
        trace_context: dict | None,
        timeout: float | None,
        *,
        warn_every: float = STALL_WARNING_S,
        next_step: int | None = None,
        bound: str = "save_timeout",
    ) -> float:
        """Wait for :meth:`run` to return before another save writes to the slot.

        The wait's span joins the caller's ``trace_context`` (else the current
        context). Returns the seconds waited. A long wait (``timeout`` None
        included) logs a warning every ``warn_every`` seconds naming the slot,
        this save's step, the waiting save's ``next_step`` and the time waited.

        Raises:
            SaveTimeoutError: still running after ``timeout`` seconds (the setting
                named ``bound``).
        """
        if self.ended():
            return 0.0
        t0 = time.perf_counter()
        attrs = {
            span_attr.SLOT: self.slot,
            span_attr.STEP: self.step,
            span_attr.RANK: self._link.rank,
        }
        with tracing.span("obsckpt.join_wait", carrier=trace_context, attributes=attrs):
            waiter = "" if next_step is None else f"; its save of step {next_step} waits"
            finished = wait_watched(
                self.wait_ended,
                timeout,
                lambda: f"slot {self.slot!r} to finish its save of step {self.step}{waiter}",
                warn_every=warn_every,
                log=self._logger,
            )
        waited = time.perf_counter() - t0
        if not finished:
            raise SaveTimeoutError(
                f"slot {self.slot!r} is still busy with step {self.step} after {waited:.1f} s "
                f"({bound}); a new save cannot share its destination. Check the stuck save "
                "(py-spy dump) or give this save another slot name",
                slot=self.slot,
                step=self.step,
            )
        return waited

    def fail_unstarted(self, exc: BaseException) -> None:
        """Tell the monitor the save failed with ``exc`` before it asked for admission.

        Its step may have registered it already: the step fails now, instead of
        waiting for a save that will never come. The caller raises ``exc``.
        """
        self._link.failed(
            self.slot,
            self.step,
            self.kind,
            None,
            exc,
            join_wait=None,
            part=self.part,
            parts=self.parts,
            admitted=False,
        )

    def ended(self) -> bool:
        """Whether :meth:`run` has returned (a timed-out save may still be running)."""
        return self._ended.is_set()

    def wait_ended(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`run` to return; whether it did."""
        return self._ended.wait(timeout)

    def run(
        self,
        fn: Callable[[], list[FileRecord]],
        carrier: dict | otel_context.Context | None,
        join_wait: float,
    ) -> None:
        """Admission, ``fn`` (the I/O), report; settles :attr:`outcome` unless the watchdog did.

        ``carrier`` is the step's W3C carrier, or a context from :func:`tracing.capture`;
        ``join_wait`` the seconds this save waited for the slot's previous one.
        """
        outcome: bool | SaveError | None = None  # None: the watchdog settled it
        try:
            try:
                written = self._write(fn, tracing.as_carrier(carrier), join_wait)
            except BaseException as exc:  # noqa: BLE001 - the outcome carries it
                outcome = self._failure(exc, join_wait, reporting=False)
            else:
                outcome = self._report(written, join_wait)
        finally:
            self._link.drop_lease(self._ticket)
            if isinstance(outcome, SaveError) and self._on_error is not None:
                self._on_error(outcome)
            self._ended.set()
            if isinstance(outcome, SaveError):
                self.outcome.set_exception(outcome)
            elif outcome is not None:
                self.outcome.set_result(outcome)

    def _write(
        self, fn: Callable[[], list[FileRecord]], carrier: dict | None, join_wait: float
    ) -> _Written | None:
        """Admission, then ``fn`` under the watchdog; None when the monitor skipped the save."""
        attrs = {
            span_attr.STEP: self.step,
            span_attr.SLOT: self.slot,
            span_attr.KIND: self.kind,
            span_attr.RANK: self._link.rank,
        }
        watchdog = None
        with tracing.span("obsckpt.save", carrier=carrier, attributes=attrs) as span:
            try:
                admitted = self._admit(carrier, attrs)
                if not admitted.get("skipped"):
                    watchdog = self._start_watchdog(join_wait)
            except BaseException:
                # Nothing will write this snapshot: let its staging copy end here, so the
                # slot's buffers and the caller's tensors are let go.
                self._end_snapshot()
                raise
            if admitted.get("skipped"):
                span.set_attribute(span_attr.SKIPPED, True)
                self._skip(admitted.get("latest"), bool(admitted.get("settled")))
                return None
            try:
                t0 = time.perf_counter()
                try:
                    records = fn() or []
                except BaseException as exc:
                    self.fn_error = exc
                    span.set_attribute(span_attr.ERROR, type(exc).__name__)
                    raise
                if self._claimed():
                    # The watchdog already reported this save as timed out; the trace agrees.
                    span.set_attribute(span_attr.ERROR, SaveTimeoutError.__name__)
                    span.set_status(
                        Status(StatusCode.ERROR, f"exceeded save_timeout={self._save_timeout} s")
                    )
                duration = time.perf_counter() - t0
                nbytes = sum(r.size for r in records)
                span.set_attribute(span_attr.BYTES, nbytes)
            finally:
                if watchdog is not None:
                    watchdog.cancel()
        return _Written(records, duration, nbytes)

    def _admit(self, carrier: dict | None, attrs: dict[str, Any]) -> dict:
        # The step's context goes with the admission, so the monitor's commit span
        # joins the step's trace even if the trainer never submits one.
        admitted = self._link.admit(
            self.slot,
            self.step,
            self.kind,
            carrier=carrier or tracing.inject() or None,
            part=self.part,
            parts=self.parts,
            unless_closed=self.unless_committed,
        )
        self._ticket = admitted.get("ticket")
        if admitted.get("admission_wait_s"):
            # The monitor's own measure of the queueing, without the RPC's latency.
            end = time.time_ns()
            start = end - int(admitted["admission_wait_s"] * 1e9)
            tracing.record_wait("obsckpt.admission_wait", start, end, attrs)
        return admitted

    def _report(self, written: _Written | None, join_wait: float) -> bool | SaveError | None:
        """Report a save that ran ok; its outcome (None if the watchdog reported it first)."""
        if written is None:
            return False  # skipped at admission: the monitor decided, nothing to report
        if not self._claim():
            return None
        try:
            self._link.finished(
                self.slot,
                self.step,
                self.kind,
                self._ticket,
                part=self.part,
                parts=self.parts,
                ok=True,
                duration_s=written.duration_s,
                nbytes=written.nbytes,
                join_wait_s=join_wait,
                files=[relative_record(r, self.step) for r in written.records],
            )
        except BaseException as exc:  # noqa: BLE001 - the outcome carries it
            return self._failure(exc, join_wait, reporting=True)
        return True

    def _failure(
        self, exc: BaseException, join_wait: float, *, reporting: bool
    ) -> SaveError | None:
        """The save's :class:`SaveError` for ``exc``, reported to the monitor.

        ``reporting``: ``exc`` is what reporting a save that ran ok raised. None
        when the watchdog already reported (and stored) a timeout.
        """
        what = f"background save {self.slot!r} of step {self.step} ({self.kind})"
        if reporting:
            # The files are written, but the monitor may not have counted the
            # save, so its step may never commit: the caller hears of it.
            what += " finished, but reporting it to the monitor failed"
        else:
            what += " failed"
        # One line: a Ray error's own text is the remote traceback, in colour.
        error = SaveError(f"{what}: {one_line(exc)}", slot=self.slot, step=self.step)
        error.__cause__ = exc
        self._logger.error("obsckpt: %s", error, exc_info=exc)
        if reporting:
            return error
        if not self._claim():
            return None
        self._report_failed(exc, join_wait)
        return error

    def _skip(self, latest: int | None, settled: bool) -> None:
        """The monitor did not admit the save (``unless_committed``, step closed): write nothing.

        ``settled``: no other save of the step is on its way, so what the host wrote
        into the committed step before handing this save over is removed.
        """
        self._logger.info(
            "obsckpt: save %r of step %d (%s) not written: the monitor has committed step %s "
            "of this kind, and a re-save would change files the iteration file vouches for",
            self.slot,
            self.step,
            self.kind,
            latest,
        )
        if settled:
            self._remove_strays()
        if self._on_skip is not None:
            self._on_skip()

    def _remove_strays(self) -> None:
        """Remove the files the committed step's manifest does not list (the host's own
        temp files of this skipped save), so the step stays as its manifest says."""
        try:
            root = self._link.checkpoint_root()
            if is_remote(root):
                return  # nothing is written to an object before the save runs
            removed = commit.remove_strays(layout.step_dir(root, self.step))
        except Exception as exc:  # noqa: BLE001 - the commit stands; this is tidying
            self._logger.warning(
                "obsckpt: could not remove unlisted files from committed step %d: %s",
                self.step,
                one_line(exc),
            )
            return
        if removed:
            self._logger.warning(
                "obsckpt: removed %d file(s) from committed step %d that its manifest does "
                "not list (written before save %r was handed over, which was not written "
                "as the step is committed): %s",
                len(removed),
                self.step,
                self.slot,
                ", ".join(removed),
            )

    def _end_snapshot(self) -> None:
        if self._on_skip is None:
            return
        try:
            self._on_skip()
        except BaseException:  # noqa: BLE001 - the admission's error is the one raised
            self._logger.exception("obsckpt: ending the staging copy of %r failed", self.slot)

    def _start_watchdog(self, join_wait: float) -> threading.Timer | None:
        if self._save_timeout is None:
            return None
        timer = threading.Timer(self._save_timeout, self._time_out, (join_wait,))
        timer.daemon = True
        timer.name = f"obsckpt-watchdog-{self.slot}-step{self.step}"
        timer.start()
        return timer

    def _time_out(self, join_wait: float) -> None:
        """The watchdog: fail the save, unless it has ended (and claimed its outcome) first."""
        if not self._claim():
            return
        exc = SaveTimeoutError(
            f"background save {self.slot!r} of step {self.step} ({self.kind}) did not finish "
            f"within save_timeout={self._save_timeout} s; the step will not be committed",
            slot=self.slot,
            step=self.step,
        )
        self._logger.error("obsckpt: %s", exc)
        if self._on_error is not None:
            self._on_error(exc)
        try:
            self._report_failed(exc, join_wait)
        finally:
            self.outcome.set_exception(exc)

    def _report_failed(self, exc: BaseException, join_wait: float) -> None:
        """Tell the monitor this admitted save failed with ``exc`` (the step fails)."""
        self._link.failed(
            self.slot,
            self.step,
            self.kind,
            self._ticket,
            exc,
            join_wait=join_wait,
            part=self.part,
            parts=self.parts,
        )

    def _claim(self) -> bool:
        """Take the right to report and settle :attr:`outcome`; False if already taken."""
        try:
            return self.outcome.set_running_or_notify_cancel()
        except RuntimeError:  # running or settled: the other party claimed it first
            return False

    def _claimed(self) -> bool:
        return self.outcome.running() or self.outcome.done()


class SaveErrors:
    """Failures of background saves, kept until the caller hears of them.

    :meth:`take` hands them over once (the caller raises the first, as Orbax's
    ``check_for_errors`` does). Only the first keeps its traceback: a traceback
    keeps its frames, and they keep what the save was writing (the save
    function's closure, a snapshot), so a job that waits rarely would otherwise
    hold one copy per failed save. The others were logged with theirs.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._errors: list[SaveError] = []

    def add(self, error: SaveError) -> None:
        """Keep ``error``, in the order the failures happened."""
        with self._lock:
            if self._errors:
                _drop_tracebacks(error)
            self._errors.append(error)

    def pending(self) -> list[SaveError]:
        """The failures kept, without handing them over."""
        with self._lock:
            return list(self._errors)

    def take(self) -> list[SaveError]:
        """The failures kept, handed over: the next call returns only later ones."""
        with self._lock:
            errors, self._errors = self._errors, []
        return errors


def _drop_tracebacks(exc: BaseException | None) -> None:
    """Let go of the tracebacks of ``exc`` and of its causes (their messages stay)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def wait_jobs(
    jobs: list[SaveJob],
    timeout: float | None,
    bound: str,
    *,
    warn_every: float = STALL_WARNING_S,
    log: logging.Logger | None = None,
) -> None:
    """Wait for every job's outcome, up to ``timeout`` (the setting named ``bound``).

    Every ``warn_every`` seconds still waiting it logs the saves still running.

    Raises:
        SaveTimeoutError: saves still running after ``timeout``, named with the time.
    """
    outcomes = [job.outcome for job in jobs]

    def still_running() -> str:
        left = [f"{j.slot!r} (step {j.step})" for j in jobs if not j.outcome.done()]
        return f"{len(left)} of {len(jobs)} saves in wait_all: {', '.join(left)}"

    wait_watched(
        lambda t: not wait_futures(outcomes, t).not_done,
        timeout,
        still_running,
        warn_every=warn_every,
        log=log,
    )
    running = [job for job in jobs if not job.outcome.done()]
    if running:
        names = ", ".join(f"{job.slot!r} (step {job.step})" for job in running)
        raise SaveTimeoutError(
            f"{len(jobs) - len(running)} of {len(jobs)} saves finished after "
            f"{timeout:.1f} s ({bound}); still running: {names}",
            slot=running[0].slot,
            step=running[0].step,
        )
