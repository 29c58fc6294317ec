"""The commit state machine: which steps are whole, which may be committed.

Plain Python with no Ray and no I/O, so it can be driven exhaustively by
tests. The monitor actor feeds it notifications, asks :meth:`CommitTracker.ready`
what to commit, performs the durable writes, and reports back with
:meth:`CommitTracker.end_commit`.

Per step and kind (``checkpoint`` or ``state_dict``) it counts registered,
finished and in-flight saves. A step of a kind is committed once it was
submitted (``monitor_step``), every registered save finished, none is in
flight and none failed. A full checkpoint also needs its step's state-dict
saves, and committing it commits that step's state dict too. The committed
step of a kind never goes backwards: a step that becomes whole after a later
one was committed is *superseded*, never named by the iteration file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from obsckpt.commit import KINDS, FileRecord, validate_step
from obsckpt.errors import NotificationError, StepOrderError

PENDING = "pending"
COMMITTING = "committing"
COMMITTED = "committed"
FAILED = "failed"
SUPERSEDED = "superseded"
ABANDONED = "abandoned"
_OPEN = (PENDING, COMMITTING)
# Resolved steps kept for status(); older ones are forgotten.
_KEEP_RESOLVED = 64


@dataclass(slots=True)
class Progress:
    """What the monitor knows of one step of one kind."""

    registered: int = 0
    finished: int = 0
    in_flight: int = 0
    submitted: bool = False
    state: str = PENDING
    error: str | None = None
    first_seen: float | None = None
    first_start: float | None = None
    resolved_at: float | None = None
    carrier: dict | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)

    @property
    def balanced(self) -> bool:
        return self.finished == self.registered and self.in_flight == 0

    @property
    def active(self) -> bool:
        return bool(self.registered or self.finished or self.in_flight or self.submitted)

    @property
    def started_at(self) -> float | None:
        return self.first_start if self.first_start is not None else self.first_seen


def _kind(is_state_dict: bool) -> str:
    return "state_dict" if is_state_dict else "checkpoint"


class CommitTracker:
    """Counts saves per step and decides what may be committed.

    Args:
        latest: the committed step per kind found on disk (None for none).
        clock: wall-clock source, for timestamps in status and metrics.
    """

    def __init__(
        self,
        latest: dict[str, int | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.latest: dict[str, int | None] = {k: None for k in KINDS}
        self.latest.update(latest or {})
        self.clock = clock
        self.steps: dict[int, dict[str, Progress]] = {}
        self.abandoned: dict[int, str] = {}
        # True in a monitor that Ray restarted: registrations made before are gone.
        self.restarted = False

    # -- helpers ---------------------------------------------------------

    def progress(self, step: int, kind: str) -> Progress:
        kinds = self.steps.get(step)
        if kinds is None:
            kinds = self.steps[step] = {k: Progress() for k in KINDS}
        p = kinds[kind]
        if p.first_seen is None:
            p.first_seen = self.clock()
        return p

    def _is_committed(self, step: int, kind: str) -> bool:
        latest = self.latest[kind]
        if latest is None or step > latest:
            return False
        p = self.steps.get(step, {}).get(kind)
        # A step at or below latest we know nothing of was committed by an
        # earlier incarnation or superseded; either way it is closed.
        return p is None or p.state in (COMMITTED, SUPERSEDED) or step == latest

    def _fail(self, step: int, kind: str, error: str) -> list[tuple[int, str]]:
        """Mark a step failed; returns the (step, kind) pairs that newly failed."""
        failed = []
        p = self.progress(step, kind)
        if p.state in _OPEN:
            p.state, p.error, p.resolved_at = FAILED, error, self.clock()
            failed.append((step, kind))
        # A full checkpoint includes its step's state-dict saves.
        if kind == "state_dict":
            ck = self.progress(step, "checkpoint")
            if ck.state == PENDING and ck.active:
                ck.state, ck.resolved_at = FAILED, self.clock()
                ck.error = f"a state-dict save of step {step} failed: {error}"
                failed.append((step, "checkpoint"))
        return failed

    # -- notifications -----------------------------------------------------

    def register(self, step: int, *, state_dict_count: int = 0, checkpoint_count: int = 0) -> None:
        validate_step(step)
        for name, count in (
            ("state_dict_thread_count", state_dict_count),
            ("checkpoint_thread_count", checkpoint_count),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {count!r}")
        for kind, count in (("state_dict", state_dict_count), ("checkpoint", checkpoint_count)):
            if not count:
                continue
            latest = self.latest[kind]
            if latest is not None and step < latest:
                raise StepOrderError(
                    f"cannot register saves for step {step} ({kind}): step {latest} is already "
                    "committed and steps must not go backwards"
                )
            p = self.progress(step, kind)
            if p.state in (COMMITTED, COMMITTING):
                raise NotificationError(
                    f"step {step} ({kind}) is already {p.state}; register its saves before "
                    "calling monitor_step"
                )
            p.registered += count
            self._revive(step)

    def submit(self, step: int, kind: str, carrier: dict | None = None) -> list[tuple[int, str]]:
        """``monitor_step``: the trainer has dispatched every save of this step.

        Returns the (step, kind) pairs that failed as a result.
        Raises:
            StepOrderError: the step is older than the committed one.
            NotificationError: more saves finished than were registered.
        """
        validate_step(step)
        latest = self.latest[kind]
        if latest is not None and step < latest:
            raise StepOrderError(
                f"step {step} was already committed (latest is {latest}); steps must not go "
                "backwards. Submit steps in increasing order"
            )
        p = self.progress(step, kind)
        if carrier:  # the trainer's step span wins over any worker's context
            p.carrier = dict(carrier)
        if latest is not None and step == latest:
            p.submitted = True
            if p.state == PENDING and not p.active:
                p.state = COMMITTED
            return []
        p.submitted = True
        self._revive(step)
        if self.restarted and p.state == PENDING and p.registered == 0:
            # Its registrations went to the monitor's previous incarnation: how many
            # saves to wait for is unknown, so committing could name a partial step.
            self.lose(
                step,
                "submitted to the restarted monitor with no registered saves; they were "
                "registered before the restart",
            )
            return []
        self._check_not_over_finished(step, kind, p)
        return []

    def _check_not_over_finished(self, step: int, kind: str, p: Progress) -> None:
        """After submission, more finishes than registrations fail the step and raise."""
        if p.finished > p.registered and p.state in _OPEN:
            msg = (
                f"step {step} ({kind}): {p.finished} saves finished but only {p.registered} "
                "were registered; register every save with register_thread_count before "
                "monitor_step"
            )
            self._fail(step, kind, msg)
            raise NotificationError(msg)

    def start(self, step: int, kind: str, carrier: dict | None = None) -> None:
        validate_step(step)
        p = self.progress(step, kind)
        if p.state == COMMITTED or (p.state == PENDING and self._is_committed(step, kind)):
            raise StepOrderError(
                f"step {step} ({kind}) is already committed (latest is {self.latest[kind]}); "
                "a save into it would change files the iteration file vouches for. "
                "Save into a new step"
            )
        p.in_flight += 1
        now = self.clock()
        if p.first_start is None:
            p.first_start = now
        if carrier and not p.carrier:
            p.carrier = dict(carrier)
        self._revive(step)

    def finish(
        self,
        step: int,
        kind: str,
        *,
        ok: bool = True,
        error: str | None = None,
        files: Iterable[FileRecord] = (),
        started: bool = True,
    ) -> list[tuple[int, str]]:
        """A save finished (``ok``) or failed. Returns the (step, kind) pairs that failed.

        ``started`` is False for callers that never told which step their
        ``notify_started`` was for (Trinity's own coordinator).

        Raises:
            NotificationError: more finishes than registrations after submission,
                or a finish for a step that is already committed.
        """
        validate_step(step)
        p = self.progress(step, kind)
        if started and p.in_flight > 0:
            p.in_flight -= 1
        if p.state in (COMMITTED, COMMITTING, SUPERSEDED):
            raise NotificationError(
                f"a save of step {step} ({kind}) finished after the step was {p.state}; "
                "register every save with register_thread_count before monitor_step"
            )
        p.finished += 1
        for rec in files:
            p.files[rec.path] = rec
        if not ok:
            return self._fail(step, kind, error or "save failed")
        if p.submitted:
            self._check_not_over_finished(step, kind, p)
        return []

    # -- commits -----------------------------------------------------------

    def ready(self) -> list[tuple[int, str]]:
        """(step, kind) pairs that are whole and may be committed now, in step order.

        Steps that became whole below the committed one are marked superseded.
        """
        out = []
        for step in sorted(self.steps):
            kinds = self.steps[step]
            for kind in KINDS:
                p = kinds[kind]
                if p.state != PENDING or not p.submitted or not p.balanced:
                    continue
                if kind == "checkpoint":
                    sd = kinds["state_dict"]
                    if sd.state == FAILED:
                        self._fail(step, "state_dict", sd.error or "state-dict save failed")
                        continue
                    if not sd.balanced:
                        continue
                latest = self.latest[kind]
                if latest is not None and step <= latest:
                    p.state, p.resolved_at = SUPERSEDED, self.clock()
                    continue
                out.append((step, kind))
        return out

    def begin_commit(self, step: int, kind: str) -> Progress:
        p = self.progress(step, kind)
        p.state = COMMITTING
        return p

    def end_commit(self, step: int, kind: str, *, ok: bool, error: str | None = None) -> None:
        p = self.progress(step, kind)
        now = self.clock()
        if not ok:
            p.state = PENDING  # _fail only moves open steps
            self._fail(step, kind, error or "commit failed")
            return
        p.state, p.resolved_at = COMMITTED, now
        self.latest[kind] = step
        closed = [kind]
        if kind == "checkpoint":
            sd = self.progress(step, "state_dict")
            if sd.state in _OPEN:
                sd.state, sd.resolved_at = COMMITTED, now
            if self.latest["state_dict"] is None or step > self.latest["state_dict"]:
                self.latest["state_dict"] = step
                closed.append("state_dict")
        self._close_older(step, closed)
        self._forget_resolved()

    def _close_older(self, committed: int, kinds: list[str]) -> None:
        # An open step below a committed one can never be named by the iteration
        # file; leaving it pending would show a stall that no save can end.
        for step, by_kind in self.steps.items():
            if step >= committed:
                continue
            for kind in kinds:
                p = by_kind[kind]
                if p.state == PENDING and p.active:
                    p.state, p.resolved_at = ABANDONED, self.clock()
                    p.error = f"step {committed} was committed first"
                    self.abandoned.setdefault(step, p.error)

    def _forget_resolved(self) -> None:
        resolved = [
            s
            for s, kinds in self.steps.items()
            if all(p.state not in _OPEN or not p.active for p in kinds.values())
        ]
        for step in sorted(resolved)[:-_KEEP_RESOLVED]:
            del self.steps[step]

    # -- views -------------------------------------------------------------

    def pending(self, kind: str | None = None) -> list[tuple[int, str, Progress]]:
        out = []
        for step in sorted(self.steps):
            for k, p in self.steps[step].items():
                if (kind is None or k == kind) and p.state in _OPEN and p.active:
                    out.append((step, k, p))
        return out

    def failed(self) -> list[tuple[int, str, Progress]]:
        return [
            (step, k, p)
            for step in sorted(self.steps)
            for k, p in self.steps[step].items()
            if p.state == FAILED
        ]

    def oldest_pending_start(self, kind: str) -> float | None:
        return self.pending_summary(kind)[1]

    def pending_summary(self, kind: str) -> tuple[int, float | None]:
        """How many steps of ``kind`` are pending, and when the oldest one started."""
        pending = self.pending(kind)
        starts = [p.started_at for _, _, p in pending if p.started_at is not None]
        return len(pending), min(starts, default=None)

    def mark_abandoned(self, step: int, reason: str) -> None:
        """A step found on disk uncommitted; new saves into it take it up again."""
        self.abandoned[step] = reason

    def lose(self, step: int, reason: str) -> list[tuple[int, str]]:
        """This monitor lost track of ``step`` (it restarted while the step was open).

        The step will never commit: its open kinds become abandoned and leave
        the pending views; later notifications about it are accepted and change
        nothing. A step at or below the committed one is left as it is.
        Returns the (step, kind) pairs newly abandoned.
        """
        validate_step(step)
        newly = []
        for kind in KINDS:
            latest = self.latest[kind]
            if latest is not None and step <= latest:
                continue
            p = self.progress(step, kind)
            if p.state in _OPEN:
                p.state, p.error, p.resolved_at = ABANDONED, reason, self.clock()
                newly.append((step, kind))
        if any(p.state == ABANDONED for p in self.steps.get(step, {}).values()):
            self.abandoned[step] = reason
        return newly

    def _revive(self, step: int) -> None:
        # A step found on disk at startup is taken up again by new saves; one this
        # monitor lost track of stays abandoned.
        if not any(p.state == ABANDONED for p in self.steps.get(step, {}).values()):
            self.abandoned.pop(step, None)
