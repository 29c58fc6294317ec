"""The monitor's core: notifications in, tracker calls and events out.

No Ray, no asyncio, no file I/O. :class:`MonitorCore` holds the commit state
machine (:class:`~obsckpt.tracker.CommitTracker`), the save strategy's queue
(:class:`~obsckpt.admission.Admission`) and the saves' tickets and leases
(:class:`~obsckpt.tickets.Tickets`). It reads time from an injected clock and
reports what happens to a :class:`~obsckpt.monitor.events.MonitorObserver`,
so a lease's expiry is tested by advancing a fake clock and calling
:meth:`MonitorCore.expire_stale_leases`. The Ray actor
(:class:`~obsckpt.monitor.CheckpointMonitor`) awaits admissions, runs the
commit I/O and the lease checks on its event loop, and calls in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from obsckpt import validators
from obsckpt.admission import Admission, SaveStrategy
from obsckpt.errors import NotificationError, PartsMismatchError
from obsckpt.monitor.events import Clock, CommitRecord, MonitorObserver, SystemClock
from obsckpt.store.layout import KINDS, FileRecord
from obsckpt.telemetry.metrics import validate_bytes, validate_seconds
from obsckpt.tickets import Ticket, Tickets
from obsckpt.tracker import COMMITTING, CommitTracker, StepRecord
from obsckpt.validators import validate_parts, validate_step

# The longest between two lease checks: a node's death is noticed this soon.
MAX_CHECK_INTERVAL_S = 5.0


def validate_rank(rank: object) -> int | None:
    """``rank`` as an int (None stays None): its label must be one of a bounded set."""
    return validators.validate_rank(rank, whose="the reporting process's rank", none="")


def _label(value: object, default: str = "unknown") -> str:
    return default if value is None else str(value)


@dataclass(slots=True)
class CommitJob:
    """A step the tracker has just marked committing, with what its commit needs."""

    step: int
    kind: str
    record: StepRecord
    # Monotonic reading when the step was found whole.
    whole_at: float
    # Finished saves counted for it (a full checkpoint's include its state-dict saves).
    saves: int


def _file_records(
    files: list[dict[str, Any]] | None, step: int, slot: str | None
) -> tuple[list[FileRecord], str | None]:
    """The records a report names, or none and why they are refused (one line)."""
    try:
        return [FileRecord.from_json(f) for f in files or ()], None
    except ValueError as exc:
        return [], (
            f"save {slot!r} of step {step} reported a file the monitor refuses ({exc}); "
            "a save reports only files inside its own step directory. The step will not "
            "be committed"
        )


class MonitorCore:
    """Admits, leases and counts saves, and says which step to commit next.

    Args:
        strategy: the save strategy admissions follow.
        latest: the committed step per kind found on disk (None for none).
        lease_timeout_s: a leased save with no heartbeat for this long is failed;
            None never expires one.
        observer: told of every event (default: one that ignores them).
        clock: the monotonic and wall clocks (default: the system's).
        restarted: True when Ray restarted the monitor (registrations made before are gone).
        watch_nodes: whether saves are failed when their node dies (inside Ray only).
    """

    def __init__(
        self,
        strategy: SaveStrategy = SaveStrategy.UNRESTRICTED,
        *,
        latest: dict[str, int | None] | None = None,
        lease_timeout_s: float | None = 120.0,
        observer: MonitorObserver | None = None,
        clock: Clock | None = None,
        restarted: bool = False,
        watch_nodes: bool = False,
    ) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.observer = observer if observer is not None else MonitorObserver()
        self.strategy = strategy
        self.lease_timeout_s = lease_timeout_s
        self.watch_nodes = watch_nodes
        # Every step that fails, on whatever path, is reported here once.
        self.tracker = CommitTracker(
            latest, clock=self.clock.monotonic, on_fail=self.observer.step_failed
        )
        self.tracker.restarted = restarted
        self.admission = Admission(strategy)
        self.tickets = Tickets()
        # When each kind last committed (monotonic readings), and the last commit's detail.
        self.last_commit: dict[str, float | None] = {k: None for k in KINDS}
        self.last_commit_detail: dict[str, dict[str, Any]] = {}
        self._pending_shown: tuple[Any, ...] | None = None

    # -- time ---------------------------------------------------------------

    def now(self) -> float:
        """The monotonic clock: the tracker's, so steps' times and tickets' compare."""
        return self.tracker.clock()

    def unix(self, t: float | None) -> float | None:
        """``t``, a reading of :meth:`now`, as Unix time by the wall clock now (None stays).

        Converted when shown, not stamped when it happened, so that a step of the
        wall clock in between does not change how long ago it reads.
        """
        return None if t is None else self.clock.time() - (self.now() - t)

    def set_last_commit_age(self, kind: str, age_s: float) -> None:
        """``kind`` last committed ``age_s`` seconds ago (recovered after a restart)."""
        self.last_commit[kind] = self.now() - max(0.0, age_s)

    def mark_found_on_disk(self, steps: Iterable[int]) -> None:
        """Step directories found on disk above every committed step: abandoned."""
        floor = max((s for s in self.tracker.latest.values() if s is not None), default=-1)
        for step in steps:
            if step > floor:
                self.tracker.mark_abandoned(
                    step, "on disk but never committed (found when the monitor started)"
                )

    # -- notifications --------------------------------------------------------

    def register(self, step: int, *, state_dict_count: int = 0, checkpoint_count: int = 0) -> None:
        """Expect this many more saves of each kind for ``step``."""
        for note in self.tracker.register(
            step, state_dict_count=state_dict_count, checkpoint_count=checkpoint_count
        ):
            self.observer.note(note)

    def submit(self, step: int, kind: str, carrier: dict[str, str] | None = None) -> None:
        """``step`` of ``kind`` was submitted: it commits once its saves are whole."""
        validate_step(step)
        latest = self.tracker.latest[kind]
        if latest is not None and step < latest:
            self.observer.submit_ignored(step, kind, latest)
        self.tracker.submit(step, kind, carrier=carrier)

    def start(
        self,
        *,
        node_id: str | None,
        step: int | None,
        slot: str | None,
        kind: str | None,
        rank: object,
        pid: int | None,
        carrier: dict[str, str] | None,
        lease: bool,
        part: int | None,
        parts: int | None,
        unless_closed: bool,
    ) -> Ticket | None:
        """Open a ticket for a save asking for admission; None when it is skipped.

        Raises:
            ValueError: an argument is malformed.
            PartsMismatchError: ``parts`` differs from an earlier part's (the step fails).
        """
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        validate_parts(part, parts)
        rank = validate_rank(rank)
        if parts is not None and step is None:
            raise ValueError(
                f"part={part!r}, parts={parts!r} given without step: a save made of parts "
                "must name its step"
            )
        counted_kind = kind or "checkpoint"
        resave = False
        if step is not None:
            validate_step(step)
            if unless_closed and self.tracker.skip_if_closed(step, counted_kind):
                self.observer.save_skipped(
                    step, counted_kind, slot, rank, self.tracker.latest[counted_kind]
                )
                return None
            try:
                resave = not self.tracker.start(
                    step, counted_kind, carrier=carrier, slot=slot, part=part, parts=parts
                )
            except PartsMismatchError as exc:
                self.observer.parts_mismatch(exc)
                raise
            if resave:
                self.observer.resave_started(
                    step, counted_kind, slot, self.tracker.latest[counted_kind]
                )
        ticket = self.tickets.issue(
            step=step,
            kind=kind,
            slot=slot,
            rank=rank,
            node_id=node_id,
            pid=pid,
            requested=self.now(),
            resave=resave,
            part=part,
            parts=parts,
            lease=bool(lease) and self.lease_timeout_s is not None,
        )
        self.observer.save_requested(ticket)
        return ticket

    def settled(self, step: int) -> bool:
        """Whether nothing more will be written into ``step``'s directory for a commit.

        True when no save of ``step`` holds a ticket and no kind of it has saves
        registered, running or finished that its commit still waits for: every
        file in the directory that its manifest does not list is then a stray
        (a host's temp file of a skipped re-save, say), not a file on its way.
        """
        if self.committing(step) or any(t.step == step for t in self.tickets):
            return False  # a commit lists the directory; a ticket's save writes into it
        for kind, rec in self.tracker.steps.get(step, {}).items():
            if rec.resaving or (rec.active and not self.tracker.closed(step, kind)):
                return False
        return True

    def committing(self, step: int) -> bool:
        """Whether a commit of ``step`` (of either kind) is under way."""
        return any(r.state == COMMITTING for r in self.tracker.steps.get(step, {}).values())

    def request_admission(
        self, ticket: Ticket, job_id: str | None, on_admit: Callable[[], object]
    ) -> bool:
        """Admit ``ticket`` now (True), or call ``on_admit`` once it is (False)."""
        key = self.admission.key_for(
            ticket.ticket, _label(ticket.node_id), _label(job_id), ticket.pid
        )
        return self.admission.request(ticket.ticket, key, on_admit)

    def admitted(self, ticket: Ticket) -> dict[str, Any]:
        """``ticket``'s save was admitted: its lease starts. Returns notify_started's reply."""
        ticket.admitted = ticket.last_seen = self.now()
        wait = ticket.admitted - ticket.requested
        self.observer.save_admitted(ticket, wait)
        lease_s = self.lease_timeout_s if ticket.lease else None
        return {
            "ticket": ticket.ticket,
            "admission_wait_s": wait,
            "heartbeat_s": lease_s / 4 if lease_s is not None else None,
            "resave": ticket.resave,
        }

    def gave_up(self, ticket: Ticket) -> None:
        """The caller stopped waiting for admission: the save will not run."""
        self.release(ticket.ticket)
        if ticket.step is not None:
            why = f"save {ticket.slot!r} on rank {ticket.rank} gave up waiting for admission"
            self._fail_ticket(ticket, why, started=True)

    def heartbeat(self, tickets: list[int]) -> None:
        """Saves with these tickets are still running (their process is alive)."""
        self.tickets.renew(tickets, self.now())

    def finish(
        self,
        step: int,
        kind: str,
        *,
        ticket: int | None,
        slot: str | None,
        rank: object,
        ok: bool,
        error: str | None,
        duration_s: float | None,
        nbytes: int | None,
        join_wait_s: float | None,
        files: list[dict[str, Any]] | None,
        part: int | None,
        parts: int | None,
        admitted: bool,
    ) -> None:
        """A save ended, successfully (``ok``) or not (notify_finished's arguments).

        A report naming a file outside the step's directory (an absolute path, a
        ``..``) is refused, but only once the save is counted as failed: its
        admission is released and its step fails, as for any failed save, so
        the step never stays pending with the save counted as running.

        Raises:
            NotificationError: ``files`` names a file outside the step's directory.
        """
        validate_step(step)
        validate_parts(part, parts)
        rank = validate_rank(rank)
        # Checked before anything changes: a measurement that failed halfway would
        # leave the save released but never counted, and its step pending for ever.
        validate_seconds("duration_s", duration_s)
        validate_seconds("join_wait_s", join_wait_s)
        validate_bytes("nbytes", nbytes)
        if not admitted and ok:
            raise ValueError(
                f"admitted=False reports a save that failed before admission, so ok must "
                f"be False (step {step}, slot {slot!r})"
            )
        # Parsed before anything changes; a bad record turns the report into a failure.
        records, refused = _file_records(files, step, slot)
        if refused is not None:
            ok, error = False, refused
        if self.tickets.take_expired(ticket):
            # Its lease ran out and the save was already counted as failed; the
            # process was only slow. Its step stays failed.
            self.observer.late_finish(step, slot)
            return
        # Without ticket (admitted=False): a Trinity caller's oldest save is not released.
        info = self.release(ticket) if admitted else None
        slot = slot or (info.slot if info else None)
        if info is not None and info.parts is not None:
            part, parts = info.part, info.parts
        started = info is not None and info.step is not None
        if duration_s is None and info is not None and info.admitted is not None:
            duration_s = self.now() - info.admitted
        self.observer.save_finished(
            kind,
            slot,
            rank,
            ok=ok,
            error=error,
            step=step,
            duration_s=duration_s,
            nbytes=nbytes,
            join_wait_s=join_wait_s,
        )
        if info is None and ticket is not None and not self.tickets.issued_here(ticket):
            # Admitted by this monitor's previous incarnation: the step's registrations
            # and earlier finishes are gone, so it can never be known whole.
            reason = f"a save was admitted before the monitor restarted (ticket {ticket})"
            if self.tracker.lose(step, reason):
                self.observer.step_abandoned(step, kind, reason)
            if refused is not None:
                raise NotificationError(refused)
            return
        resave = info is not None and info.resave
        if not resave and self.tracker.closed(step, kind):
            self.observer.finished_after_close(step, kind, self.tracker.latest[kind])
        self.tracker.finish(
            step,
            kind,
            ok=ok,
            error=error,
            files=records,
            started=started,
            resave=resave,
            slot=slot,
            part=part,
            parts=parts,
        )
        if refused is not None:
            raise NotificationError(refused)

    def release(self, ticket: int | None, *, expired: bool = False) -> Ticket | None:
        """Close ``ticket`` (None: a Trinity caller's) and free its admission."""
        if expired:
            info = self.tickets.expire(ticket) if ticket is not None else None
        else:
            info = self.tickets.close(ticket)
        if info is None:
            return None
        self.admission.release(info.ticket)
        if info.admitted is not None:
            self.observer.save_released(info)
        return info

    def _fail_ticket(self, info: Ticket, error: str, *, started: bool) -> None:
        """Fail the save ``info`` names in the tracker: its step cannot be whole."""
        if info.step is None:  # a Trinity caller's save names no step
            return
        self.tracker.finish(
            info.step,
            info.kind or "checkpoint",
            ok=False,
            error=error,
            started=started,
            resave=info.resave,
            slot=info.slot,
            part=info.part,
            parts=info.parts,
        )

    # -- leases ---------------------------------------------------------------

    @property
    def check_interval_s(self) -> float:
        """How often leases (and nodes) are checked: four times per lease."""
        lease = self.lease_timeout_s
        return MAX_CHECK_INTERVAL_S if lease is None else min(MAX_CHECK_INTERVAL_S, lease / 4)

    def watched(self) -> bool:
        """Whether any open save holds a lease or runs on a node that is watched."""
        return self.tickets.watched(self.watch_nodes)

    def needs_watch(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s save needs lease (or node) checks."""
        return ticket.lease or bool(self.watch_nodes and ticket.node_id)

    def renew_all_leases(self) -> None:
        """Judge every lease from now on: the monitor itself did not run for a while.

        Heartbeats sent meanwhile still wait in its queue; a gap that no rank
        caused must not expire their saves.
        """
        self.tickets.renew([t.ticket for t in self.tickets], self.now())

    def expire_stale_leases(self) -> list[Ticket]:
        """Fail the leased saves with no heartbeat for ``lease_timeout_s``; returns them."""
        if self.lease_timeout_s is None:
            return []
        now = self.now()
        stale = self.tickets.stale(now, self.lease_timeout_s)
        return [info for info in stale if self._expire(info, now, node_gone=False)]

    def expire_on_nodes(self, nodes: set[str]) -> list[Ticket]:
        """Fail the admitted saves running on ``nodes`` (Ray reports them dead)."""
        now = self.now()
        return [info for info in self.tickets.on_nodes(nodes) if self._expire(info, now)]

    def _expire(self, info: Ticket, now: float, *, node_gone: bool = True) -> bool:
        who = f"save {info.slot!r} of rank {info.rank} (pid {info.pid} on node {info.node_id})"
        if node_gone:
            why = "runs on a node that Ray reports dead"
        else:
            why = (
                f"sent no heartbeat for {now - info.last_seen:.0f} s (lease_timeout_s="
                f"{self.lease_timeout_s}); its process probably died"
            )
        msg = f"{who} {why}. The step will not be committed"
        if self.release(info.ticket, expired=True) is None:
            return False  # it ended while the check ran
        self.observer.lease_expired(info, msg, why)
        if info.step is not None:
            self._fail_ticket(info, msg, started=False)
        return True

    # -- commits --------------------------------------------------------------

    def begin_next_commit(self) -> CommitJob | None:
        """Mark the next whole step committing and return it; None when none is whole."""
        nxt = self.tracker.begin_next_commit()
        if nxt is None:
            return None
        step, kind, record = nxt
        saves = record.finished
        if kind == "checkpoint":  # a full checkpoint includes its state-dict saves
            saves += self.tracker.progress(step, "state_dict").finished
        return CommitJob(step, kind, record, whole_at=self.now(), saves=saves)

    def commit_files(self, job: CommitJob) -> dict[str, FileRecord]:
        """The files ``job``'s saves reported, for its commit to trust unread."""
        return self.tracker.reported_files(job.step, job.kind)

    def commit_failed(self, job: CommitJob, message: str) -> None:
        """``job``'s commit failed: its step fails, the iteration file is unchanged."""
        self.observer.commit_failed(job.step, job.kind, message)
        self.tracker.end_commit(job.step, job.kind, ok=False, error=message)

    def commit_done(self, job: CommitJob, phases: dict[str, float]) -> CommitRecord:
        """``job``'s commit went through (``phases``: where its time went)."""
        now = self.now()
        step, kind = job.step, job.kind
        self.tracker.end_commit(step, kind, ok=True)
        # The step's first save start: a full checkpoint includes its state-dict saves.
        starts = [job.record.started_at]
        if kind == "checkpoint":
            starts.append(self.tracker.progress(step, "state_dict").first_start)
        kinds = ("checkpoint", "state_dict") if kind == "checkpoint" else ("state_dict",)
        record = CommitRecord(
            step=step,
            kind=kind,
            whole_at=job.whole_at,
            committed_at=now,
            started_at=min((s for s in starts if s is not None), default=None),
            moved=tuple(k for k in kinds if self.tracker.latest[k] == step),
            phases_s=dict(phases),
        )
        for k in record.moved:
            self.last_commit[k] = now
        self.last_commit_detail[kind] = record.detail()
        self.observer.step_committed(record)
        return record

    def settle(self) -> None:
        """Tell the observer of changed pending/abandoned counts (after every notification)."""
        shown = (
            tuple(self.tracker.pending_summary(kind) for kind in KINDS),
            len(self.tracker.abandoned),
        )
        if shown == self._pending_shown:
            return
        self._pending_shown = shown
        self.observer.pending_changed(dict(zip(KINDS, shown[0], strict=True)), shown[1])
