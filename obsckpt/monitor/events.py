"""What the monitor's core reports as it runs, and the clock it reads.

:class:`MonitorCore` calls one :class:`MonitorObserver` method per event
instead of updating metrics or logging itself; the telemetry adapter
(:class:`obsckpt.monitor.telemetry.MonitorTelemetry`) turns events into
metrics and log lines, and tests pass a recording observer. Every method of
the base class does nothing, so an observer implements only what it needs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from obsckpt.tickets import Ticket


class Clock(Protocol):
    """The two clocks the monitor reads."""

    def monotonic(self) -> float:
        """Seconds on a clock that never steps: durations, leases and ages."""
        ...

    def time(self) -> float:
        """Unix time, read only to show a time as a timestamp."""
        ...


class SystemClock:
    """The process's clocks: ``time.monotonic`` and ``time.time``.

    Durations, leases and ages are measured on the monotonic clock: a step of
    the system clock (NTP, a VM resumed) moves the wall clock and would
    otherwise expire healthy leases or keep dead ones alive.
    """

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


@dataclass(slots=True)
class CommitRecord:
    """A step's commit that went through, as the observer and status() see it.

    Times are readings of the monitor's monotonic clock.
    """

    step: int
    kind: str
    whole_at: float
    committed_at: float
    # When the step's first save started (a full checkpoint's includes its state-dict saves).
    started_at: float | None
    # The kinds whose iteration file this commit moved.
    moved: tuple[str, ...]
    # Where the commit's time went (finalize_step's phases, seconds).
    phases_s: dict[str, float] = field(default_factory=dict)

    def detail(self) -> dict[str, Any]:
        """The ``last_commit`` entry of status() (times still monotonic readings)."""
        return {
            "step": self.step,
            "whole_at": self.whole_at,
            "committed_at": self.committed_at,
            "commit_io_s": self.committed_at - self.whole_at,
            "phases_s": {k: round(v, 6) for k, v in self.phases_s.items()},
        }


class MonitorObserver:
    """Callbacks for what happens in the monitor's core; each does nothing here.

    Saves are described by their :class:`~obsckpt.tickets.Ticket` where the
    core has one. An observer must not raise: the core calls it mid-transition.
    """

    # -- saves ------------------------------------------------------------

    def save_requested(self, ticket: Ticket) -> None:
        """A save asked for admission (its ticket is open, not yet admitted)."""

    def save_skipped(
        self, step: int, kind: str, slot: str | None, rank: int | None, latest: int | None
    ) -> None:
        """A save asked not to write into a closed step, and was not admitted."""

    def resave_started(self, step: int, kind: str, slot: str | None, latest: int | None) -> None:
        """A save of a step already committed started: it is not counted."""

    def save_admitted(self, ticket: Ticket, wait_s: float) -> None:
        """The save strategy admitted a save after ``wait_s`` seconds."""

    def save_released(self, ticket: Ticket) -> None:
        """A save's ticket closed (finished, expired or given up); its admission is free."""

    def save_finished(
        self,
        kind: str,
        slot: str | None,
        rank: int | None,
        *,
        ok: bool,
        error: str | None,
        step: int,
        duration_s: float | None,
        nbytes: int | None,
        join_wait_s: float | None,
    ) -> None:
        """A save reported its end (``duration_s`` is its own, or admission to now)."""

    def late_finish(self, step: int, slot: str | None) -> None:
        """A save finished after its lease expired; its step stays failed."""

    def finished_after_close(self, step: int, kind: str, latest: int | None) -> None:
        """A save finished after its step was closed: it commits nothing."""

    def lease_expired(self, ticket: Ticket, message: str, why: str) -> None:
        """A save was failed: its heartbeats stopped, or its node died (``why``)."""

    def parts_mismatch(self, error: Exception) -> None:
        """Parts of one save disagreed on the number of parts (the step failed)."""

    def note(self, message: str) -> None:
        """Something the operator may want to read that changes nothing (e.g. a re-save)."""

    # -- steps ------------------------------------------------------------

    def step_failed(self, step: int, kind: str) -> None:
        """A step of a kind became failed (every path, once each)."""

    def step_abandoned(self, step: int, kind: str, reason: str) -> None:
        """The monitor lost track of an open step; it will never commit."""

    def submit_ignored(self, step: int, kind: str, latest: int) -> None:
        """A step older than the committed one was submitted; nothing changes."""

    def step_committed(self, record: CommitRecord) -> None:
        """A step's commit went through."""

    def commit_failed(self, step: int, kind: str, message: str) -> None:
        """A step's commit failed (it is failed, the iteration file unchanged)."""

    def pending_changed(self, pending: dict[str, tuple[int, float | None]], abandoned: int) -> None:
        """Pending steps (count, oldest start) per kind, or the abandoned count, changed."""
