"""The monitor's tickets: one per save it admits, with the save's lease.

A ticket names a save from its admission to its finish report. Plain Python
with no Ray or asyncio in it: the monitor actor decides what a ticket's end
means for its step and its metrics.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class Ticket:
    """One save, from its admission request to its finish report."""

    ticket: int
    step: int | None
    kind: str | None
    slot: str | None
    rank: int | None
    node_id: str | None
    pid: int | None
    # Times are readings of the monitor's monotonic clock: a lease compares them
    # with each other, never with the wall clock, which NTP or a resumed VM may step.
    requested: float
    admitted: float | None = None
    lease: bool = False
    last_seen: float = 0.0
    resave: bool = False  # into a closed step: not counted by the tracker
    part: int | None = None  # this save's index among ``parts`` parts of one save
    parts: int | None = None


class Tickets:
    """Open tickets by number, and the numbers whose lease ran out.

    Numbers are unique across monitor restarts (a random 31-bit base per
    incarnation), so a finish carrying a ticket of an earlier incarnation is
    recognised (:meth:`issued_here`) instead of ending another save.
    """

    def __init__(self) -> None:
        self._open: dict[int, Ticket] = {}
        self._expired: set[int] = set()
        self._base = secrets.randbits(31) << 32
        self._numbers = itertools.count(self._base + 1)

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Ticket]:
        """The open tickets, oldest first (a copy: closing one while iterating is safe)."""
        return iter(list(self._open.values()))

    def issue(self, **fields: object) -> Ticket:
        """Open a ticket with a new number for a save described by ``fields``."""
        ticket = Ticket(next(self._numbers), **fields)  # type: ignore[arg-type]
        self._open[ticket.ticket] = ticket
        return ticket

    def close(self, number: int | None) -> Ticket | None:
        """Remove and return ticket ``number``; None when it is not open.

        ``number=None`` (a Trinity caller sends no ticket) closes the oldest
        admitted ticket that named no step, as Trinity's saving counter would.
        """
        if number is None:
            anonymous = [t for t in self._open.values() if t.step is None and t.admitted]
            if not anonymous:
                return None
            number = min(anonymous, key=lambda t: t.ticket).ticket
        return self._open.pop(number, None)

    def issued_here(self, number: object) -> bool:
        """Whether ``number`` is one this incarnation could have issued."""
        if isinstance(number, bool) or not isinstance(number, int):
            return False
        return self._base < number < self._base + (1 << 32)

    def renew(self, numbers: list[int], now: float) -> None:
        """A heartbeat: the saves holding these tickets are alive at ``now``."""
        for number in numbers:
            ticket = self._open.get(number)
            if ticket is not None:
                ticket.last_seen = now

    def watched(self, nodes: bool) -> bool:
        """Whether any open ticket holds a lease, or (``nodes``) names the node it runs on."""
        return any(t.lease or (nodes and t.node_id) for t in self._open.values())

    def on_nodes(self, nodes: set[str]) -> list[Ticket]:
        """Open, admitted tickets of saves that run on one of ``nodes``."""
        return [t for t in self._open.values() if t.admitted is not None and t.node_id in nodes]

    def stale(self, now: float, timeout_s: float) -> list[Ticket]:
        """Admitted, leased tickets with no heartbeat for more than ``timeout_s``."""
        return [
            t
            for t in self._open.values()
            if t.lease and t.admitted is not None and now - t.last_seen > timeout_s
        ]

    def expire(self, number: int) -> Ticket | None:
        """Close ticket ``number`` because its lease ran out; its late finish is then ignored."""
        self._expired.add(number)
        return self._open.pop(number, None)

    def take_expired(self, number: object) -> bool:
        """Whether ``number``'s lease ran out (forgotten once asked)."""
        if number in self._expired:
            self._expired.discard(number)
            return True
        return False
