"""The commit state machine: which steps are whole, which may be committed.

Plain Python with no Ray and no I/O. The monitor's core feeds it
notifications, takes the next step with :meth:`CommitTracker.begin_next_commit`,
and reports the durable writes' outcome with :meth:`CommitTracker.end_commit`.

Per step and kind (``checkpoint`` or ``state_dict``) it counts registered,
finished and in-flight saves. A step of a kind commits once it was submitted
(``monitor_step``), every registered save finished, none is in flight and none
failed; a full checkpoint also needs its step's state-dict saves, and commits
that state dict too. The committed step never goes backwards: a step whole
after a later one committed is *superseded*. A step at or below the committed
one is closed: notifications about it (a checkpoint-sync and a full save of
one step, a final save repeating the last step, a resume behind the state-dict
iteration file) change nothing and are counted in :attr:`CommitTracker.resaves`.

A save may be made of *parts* (one per rank, each with its own ticket, files
and checksums): the parts of one step, kind and slot count as ONE finished
save once every part finished ok. The first part to start fixes the number
of parts, so a late part holds the step back instead of letting it commit
partially; a failed part, or parts disagreeing on their number, fail the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from obsckpt.errors import NotificationError, PartsMismatchError
from obsckpt.store.layout import KINDS, FileRecord
from obsckpt.validators import validate_parts, validate_step

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
class Parts:
    """The parts of one logical save (one step, kind and slot) seen so far."""

    parts: int
    # Part index -> how many times that part finished ok.
    done: dict[int, int] = field(default_factory=dict)
    running: int = 0
    # Whole rounds (every part finished once more) already counted as finished saves.
    counted: int = 0

    @property
    def whole(self) -> int:
        return min(self.done.get(i, 0) for i in range(self.parts))

    @property
    def open(self) -> bool:
        """A part runs, or some parts finished that do not yet make a whole save."""
        return self.running > 0 or sum(self.done.values()) != self.counted * self.parts


@dataclass(slots=True)
class StepRecord:
    """What the monitor knows of one step of one kind: its saves, state and files."""

    registered: int = 0
    finished: int = 0
    in_flight: int = 0
    # Re-saves into this (closed) state dict while its step's checkpoint is open:
    # the checkpoint waits for them, as they write into its directory.
    resaving: int = 0
    submitted: bool = False
    state: str = PENDING
    error: str | None = None
    # Readings of the tracker's (monotonic) clock.
    first_seen: float | None = None
    first_start: float | None = None
    resolved_at: float | None = None
    carrier: dict[str, str] | None = None
    files: dict[str, FileRecord] = field(default_factory=dict)
    # Files two saves reported differently (both wrote them): only the file on
    # disk tells which write is there, so the commit checksums it itself.
    contested: set[str] = field(default_factory=set)
    # The first counted save of this step and kind that failed, kept even when the
    # step was already closed (abandoned): its step's checkpoint must not commit.
    save_failure: str | None = None
    # Saves made of several parts, by slot.
    groups: dict[str | None, Parts] = field(default_factory=dict)

    @property
    def open_parts(self) -> bool:
        return any(g.open for g in self.groups.values())

    @property
    def balanced(self) -> bool:
        return self.finished == self.registered and self.in_flight == 0 and not self.open_parts

    @property
    def active(self) -> bool:
        return bool(
            self.registered or self.finished or self.in_flight or self.submitted or self.open_parts
        )

    @property
    def started_at(self) -> float | None:
        return self.first_start if self.first_start is not None else self.first_seen

    def add_files(self, files: Iterable[FileRecord]) -> None:
        """Record files a save reported; one reported differently before becomes contested."""
        for rec in files:
            known = self.files.get(rec.path, rec)
            if known != rec or rec.path in self.contested:
                self.files.pop(rec.path, None)
                self.contested.add(rec.path)
            else:
                self.files[rec.path] = rec


def _parts_mismatch(
    step: int, kind: str, slot: str | None, part: int | None, parts: int, known: int
) -> str:
    return (
        f"step {step} ({kind}), slot {slot!r}: part {part} says the save has {parts} "
        f"parts but an earlier part said {known}; every part of one save must pass the "
        "same parts= (the number of ranks saving it). The step will not be committed"
    )


def _agreed_files(records: list[StepRecord]) -> dict[str, FileRecord]:
    """The files ``records`` reported, less those two saves reported differently."""
    merged: dict[str, FileRecord] = {}
    contested: set[str] = set()
    for p in records:
        contested |= p.contested
        for path, rec in p.files.items():
            if merged.setdefault(path, rec) != rec:
                contested.add(path)
    return {path: rec for path, rec in merged.items() if path not in contested}


class CommitTracker:
    """Counts saves per step and decides what may be committed.

    Args:
        latest: the committed step per kind found on disk (None for none).
        clock: a monotonic clock, for when steps start and resolve: ages and the
            commit lag are differences of its readings, which a step of the system
            clock leaves alone (the monitor shows them as Unix time).
        on_fail: called with ``(step, kind)`` each time a step of a kind becomes
            failed, whatever the path (a failed save, a failed commit, parts
            that disagree, a checkpoint whose state dict failed): the one
            place failures are counted.
    """

    def __init__(
        self,
        latest: dict[str, int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_fail: Callable[[int, str], None] | None = None,
    ) -> None:
        self.latest: dict[str, int | None] = {k: None for k in KINDS}
        self.latest.update(latest or {})
        self.clock = clock
        self.on_fail = on_fail
        self.steps: dict[int, dict[str, StepRecord]] = {}
        self.abandoned: dict[int, str] = {}
        # True in a monitor that Ray restarted: registrations made before are gone.
        self.restarted = False
        # Notifications about closed steps that were accepted and changed nothing.
        self.resaves = 0
        # A step failed since resolved steps were last forgotten: a job whose saves
        # keep failing commits nothing, so the commit's own pruning never runs.
        self._forget_due = False

    def closed(self, step: int, kind: str) -> bool:
        """True when ``step`` of ``kind`` is committed, being committed, or below the
        committed step: nothing done to it now can change what the iteration file names."""
        latest = self.latest[kind]
        if latest is not None and step <= latest:
            return True
        kinds = self.steps.get(step, {})
        p = kinds.get(kind)
        if p is not None and p.state in (COMMITTED, COMMITTING, SUPERSEDED):
            return True
        # A checkpoint being committed commits its step's state dict with it: a
        # state-dict save starting now would write into a step being sealed.
        ck = kinds.get("checkpoint")
        return kind == "state_dict" and ck is not None and ck.state == COMMITTING

    def skip_if_closed(self, step: int, kind: str) -> bool:
        """True (counted as a re-save) when ``step`` of ``kind`` is closed: its saver
        asked not to write into a closed step, so nothing of it is tracked."""
        validate_step(step)
        if not self.closed(step, kind):
            return False
        self.resaves += 1
        return True

    def _resave(self, step: int, kind: str, what: str) -> str:
        self.resaves += 1
        latest = self.latest[kind]
        return (
            f"{what} of step {step} ({kind}) ignored: the step is already closed "
            f"(latest committed is {latest}); the iteration file stays where it is"
        )

    # -- helpers ---------------------------------------------------------

    def progress(self, step: int, kind: str) -> StepRecord:
        kinds = self.steps.get(step)
        if kinds is None:
            kinds = self.steps[step] = {k: StepRecord() for k in KINDS}
        p = kinds[kind]
        if p.first_seen is None:
            p.first_seen = self.clock()
        return p

    def reported_files(self, step: int, kind: str) -> dict[str, FileRecord]:
        """The files the saves of ``step`` reported, for its ``kind`` commit to trust unread.

        A full checkpoint's directory also holds its state-dict saves' files, so
        their reports count too. A file reported differently by two saves (both
        wrote it) is left out: the commit checksums what is on disk.
        """
        kinds = ("state_dict", "checkpoint") if kind == "checkpoint" else (kind,)
        # A kind with no record has reported nothing (not created here: it would show
        # as pending).
        by_kind = self.steps.get(step, {})
        return _agreed_files([by_kind[k] for k in kinds if k in by_kind])

    def _fail(self, step: int, kind: str, error: str) -> list[tuple[int, str]]:
        """Mark a step failed; returns the (step, kind) pairs that newly failed."""
        failed = []
        p = self.progress(step, kind)
        if p.state in _OPEN:
            self._set_failed(step, kind, p, error)
            failed.append((step, kind))
        # A full checkpoint includes its step's state-dict saves.
        if kind == "state_dict":
            ck = self.progress(step, "checkpoint")
            if ck.state == PENDING and ck.active:
                self._set_failed(
                    step, "checkpoint", ck, f"a state-dict save of step {step} failed: {error}"
                )
                failed.append((step, "checkpoint"))
        return failed

    def _set_failed(self, step: int, kind: str, p: StepRecord, error: str) -> None:
        """The one transition into FAILED (so ``on_fail`` sees every failure once)."""
        p.state, p.error, p.resolved_at = FAILED, error, self.clock()
        self._forget_due = True
        if self.on_fail is not None:
            self.on_fail(step, kind)

    # -- notifications -----------------------------------------------------

    def register(
        self, step: int, *, state_dict_count: int = 0, checkpoint_count: int = 0
    ) -> list[str]:
        """Expect more saves of ``step``. Returns a note per kind whose step is already
        closed (those registrations are ignored)."""
        validate_step(step)
        for name, count in (
            ("state_dict_thread_count", state_dict_count),
            ("checkpoint_thread_count", checkpoint_count),
        ):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {count!r}")
        notes = []
        for kind, count in (("state_dict", state_dict_count), ("checkpoint", checkpoint_count)):
            if not count:
                continue
            if self.closed(step, kind):
                notes.append(self._resave(step, kind, f"registering {count} save(s)"))
                continue
            p = self.progress(step, kind)
            p.registered += count
            self._revive(step)
        return notes

    def submit(
        self, step: int, kind: str, carrier: dict[str, str] | None = None
    ) -> list[tuple[int, str]]:
        """``monitor_step``: the trainer has dispatched every save of this step.

        Returns the (step, kind) pairs that failed as a result. Submitting a step
        below the committed one changes nothing (see :meth:`closed`).

        Raises:
            NotificationError: more saves finished than were registered.
        """
        validate_step(step)
        latest = self.latest[kind]
        if latest is not None and step < latest:
            self.resaves += 1
            return []
        p = self.progress(step, kind)
        if carrier:  # the trainer's step span wins over any worker's context
            p.carrier = dict(carrier)
        if latest is not None and step == latest:
            self.resaves += 1
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

    def _check_not_over_finished(self, step: int, kind: str, p: StepRecord) -> None:
        """After submission, more finishes than registrations fail the step and raise."""
        if p.finished > p.registered and p.state in _OPEN:
            msg = (
                f"step {step} ({kind}): {p.finished} saves finished but only {p.registered} "
                "were registered; register every save with register_thread_count before "
                "monitor_step"
            )
            self._fail(step, kind, msg)
            raise NotificationError(msg)

    def start(
        self,
        step: int,
        kind: str,
        carrier: dict[str, str] | None = None,
        *,
        slot: str | None = None,
        part: int | None = None,
        parts: int | None = None,
    ) -> bool:
        """A save of ``step`` started. Returns False for a re-save into a closed step:
        it is not counted (report its finish with ``resave=True``), except that an
        open checkpoint of the same step waits for a state-dict re-save (both write
        into the step's directory).

        ``part`` and ``parts`` mark one part of a save of ``slot`` made of
        ``parts`` parts; the first part to start fixes the number of parts.

        Raises:
            ValueError: ``part`` or ``parts`` is malformed.
            PartsMismatchError: ``parts`` differs from what an earlier part of the
                same step, kind and slot said (the step fails; the part is not counted).
        """
        validate_step(step)
        validate_parts(part, parts)
        if self.closed(step, kind):
            self.resaves += 1
            if kind == "state_dict" and not self.closed(step, "checkpoint"):
                self.progress(step, kind).resaving += 1
            return False
        p = self.progress(step, kind)
        if parts is not None:
            group = p.groups.get(slot)
            if group is None:
                group = p.groups[slot] = Parts(parts)
            elif group.parts != parts:
                msg = _parts_mismatch(step, kind, slot, part, parts, group.parts)
                raise PartsMismatchError(msg, failed=self._fail(step, kind, msg))
            group.running += 1
        p.in_flight += 1
        now = self.clock()
        if p.first_start is None:
            p.first_start = now
        if carrier and not p.carrier:
            p.carrier = dict(carrier)
        self._revive(step)
        return True

    def finish(
        self,
        step: int,
        kind: str,
        *,
        ok: bool = True,
        error: str | None = None,
        files: Iterable[FileRecord] = (),
        started: bool = True,
        resave: bool = False,
        slot: str | None = None,
        part: int | None = None,
        parts: int | None = None,
    ) -> list[tuple[int, str]]:
        """A save finished (``ok``) or failed. Returns the (step, kind) pairs that failed.

        ``started`` is False for callers that never told which step their
        ``notify_started`` was for (Trinity's own coordinator); ``resave`` is True
        for a save whose :meth:`start` returned False. A finish for a closed step
        commits nothing; a failed one still fails its step's open checkpoint.
        More finishes than registrations fail the step only when it is submitted
        (:meth:`submit`), not here.

        A part (``part``/``parts`` given) adds its files; the save it belongs to
        counts as finished once every one of its parts finished ok. A failed
        part, or one whose ``parts`` contradicts an earlier part, fails the step.
        """
        validate_step(step)
        validate_parts(part, parts)
        if resave:
            return self._finish_resave(step, kind, ok=ok, error=error)
        p = self.progress(step, kind)
        if started and p.in_flight > 0:
            p.in_flight -= 1
        group = p.groups.get(slot) if parts is not None else None
        if group is not None and started and group.running > 0 and group.parts == parts:
            group.running -= 1
        if not ok and p.save_failure is None:
            p.save_failure = error or "save failed"
        if self.closed(step, kind):
            self.resaves += 1
            return [] if ok else self._fail(step, kind, error or "save failed")
        p.add_files(files)
        if parts is None or part is None:  # validate_parts: both or neither
            p.finished += 1
        else:
            if group is None:  # a part whose start this tracker never saw
                group = p.groups[slot] = Parts(parts)
            elif group.parts != parts:
                return self._fail(
                    step, kind, _parts_mismatch(step, kind, slot, part, parts, group.parts)
                )
            if ok:
                group.done[part] = group.done.get(part, 0) + 1
                whole = group.whole
                p.finished += whole - group.counted
                group.counted = whole
        if not ok:
            return self._fail(step, kind, error or "save failed")
        # More finishes than registrations after submission are not failed here:
        # Trinity-RFT registers a full save's state-dict save after it ran, so the
        # step waits (unbalanced) for that registration instead.
        return []

    def _finish_resave(
        self, step: int, kind: str, *, ok: bool, error: str | None
    ) -> list[tuple[int, str]]:
        self.resaves += 1
        if kind != "state_dict":
            return []
        p = self.steps.get(step, {}).get(kind)
        if p is None or p.resaving == 0:
            return []
        p.resaving -= 1
        ck = self.progress(step, "checkpoint")
        if ok or ck.state != PENDING or not ck.active:
            return []
        # The re-save wrote into the open checkpoint's directory and failed.
        why = f"a state-dict re-save of step {step} failed: {error or 'save failed'}"
        self._set_failed(step, "checkpoint", ck, why)
        return [(step, "checkpoint")]

    # -- commits -----------------------------------------------------------

    def ready(self) -> list[tuple[int, str]]:
        """(step, kind) pairs that are whole and may be committed now, in step order.

        Steps that became whole below the committed one are marked superseded.
        """
        if self._forget_due:
            # Here, not where the step fails: that may be inside a walk over the steps.
            self._forget_resolved()
        out = []
        for step in sorted(self.steps):
            kinds = self.steps[step]
            for kind in KINDS:
                p = kinds[kind]
                if p.state != PENDING or not p.submitted or not p.balanced:
                    continue
                if kind == "checkpoint":
                    sd = kinds["state_dict"]
                    if sd.state == FAILED or sd.save_failure is not None:
                        # Also when the state dict was abandoned before its save failed.
                        why = sd.error if sd.state == FAILED else sd.save_failure
                        self._fail(step, "state_dict", why or "state-dict save failed")
                        continue
                    if not sd.balanced or sd.resaving:
                        continue
                latest = self.latest[kind]
                if latest is not None and step <= latest:
                    p.state, p.resolved_at = SUPERSEDED, self.clock()
                    continue
                out.append((step, kind))
        return out

    def begin_next_commit(self) -> tuple[int, str, StepRecord] | None:
        """Start committing the first step :meth:`ready` names; None when nothing is ready.

        Choosing and starting are one call: notifications arrive while a commit
        runs, so a list of ready steps taken before it could be stale.
        """
        ready = self.ready()
        if not ready:
            return None
        step, kind = ready[0]
        p = self.progress(step, kind)
        p.state = COMMITTING
        return step, kind, p

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
        self._forget_due = False
        resolved = [
            s
            for s, kinds in self.steps.items()
            if all(p.state not in _OPEN or not p.active for p in kinds.values())
        ]
        for step in sorted(resolved)[:-_KEEP_RESOLVED]:
            del self.steps[step]
        # Abandoned steps at or below every kind's committed step can never be taken
        # up again: the newest are kept for status and the gauge, not every one a
        # long job ever left behind.
        floor = min((s for s in self.latest.values() if s is not None), default=None)
        if floor is not None and len(self.abandoned) > _KEEP_RESOLVED:
            below = sorted(s for s in self.abandoned if s <= floor)
            for step in below[:-_KEEP_RESOLVED]:
                del self.abandoned[step]

    # -- views -------------------------------------------------------------

    def pending(self, kind: str | None = None) -> list[tuple[int, str, StepRecord]]:
        out = []
        for step in sorted(self.steps):
            for k, p in self.steps[step].items():
                if (kind is None or k == kind) and p.state in _OPEN and p.active:
                    out.append((step, k, p))
        return out

    def failed(self) -> list[tuple[int, str, StepRecord]]:
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
