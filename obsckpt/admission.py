"""Save strategies and the admission queue that enforces them (plain Python, no Ray)."""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


class SaveStrategy(str, enum.Enum):
    """Which saves may run at the same time (Trinity-RFT's meanings).

    SINGLE_THREAD: one save at a time in the whole job.
    SINGLE_PROCESS: saves of one process at a time.
    SINGLE_NODE: saves of one node at a time.
    UNRESTRICTED: every save is admitted at once.
    """

    SINGLE_THREAD = "single_thread"
    SINGLE_PROCESS = "single_process"
    SINGLE_NODE = "single_node"
    UNRESTRICTED = "unrestricted"

    @classmethod
    def _missing_(cls, value: object) -> SaveStrategy | None:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower() or member.name == value.upper():
                    return member
        return None

    @classmethod
    def parse(cls, value: object) -> SaveStrategy:
        """The strategy ``value`` names: a member, its name or value as a string, or
        another enum whose ``name`` or ``value`` names one (e.g. Trinity-RFT's own
        ``SaveStrategy.UNRESTRICTED``)."""
        if isinstance(value, enum.Enum) and not isinstance(value, cls):
            for candidate in (value.value, value.name):
                if isinstance(candidate, str) and (member := cls._missing_(candidate)):
                    return member
        else:
            try:
                return cls(value)
            except ValueError:
                pass
        choices = ", ".join(m.name for m in cls)
        raise ValueError(f"save_strategy must be one of {choices}; got {value!r}") from None


# The strategies' names as metric label values (``strategy``).
STRATEGIES = tuple(s.value for s in SaveStrategy)


@dataclass(slots=True)
class _Waiter:
    ticket: int
    key: Hashable
    on_admit: Callable[[], object]  # called with no arguments when admitted


@dataclass(slots=True)
class Admission:
    """FIFO admission under a save strategy.

    A save asks with a key that identifies what must not overlap (its node,
    its process, or itself); it is admitted when every running save has the
    same key and nobody with a different key queued before it.
    """

    strategy: SaveStrategy
    running: dict[int, Hashable] = field(default_factory=dict)
    _queue: deque[_Waiter] = field(default_factory=deque)

    def key_for(self, ticket: int, node_id: str, job_id: str, pid: int | None) -> Hashable:
        if self.strategy is SaveStrategy.SINGLE_THREAD:
            return ("thread", ticket)
        if self.strategy is SaveStrategy.SINGLE_PROCESS:
            return ("process", node_id, job_id, pid)
        if self.strategy is SaveStrategy.SINGLE_NODE:
            return ("node", node_id)
        return ("any",)

    def _compatible(self, key: Hashable) -> bool:
        # Saves are only admitted next to saves of the same key, so all running
        # keys are equal and one stands for all (O(1) with 1,000 saves in flight).
        return not self.running or next(iter(self.running.values())) == key

    def request(self, ticket: int, key: Hashable, on_admit: Callable[[], object]) -> bool:
        """Admit now (True) or queue ``on_admit`` to be called on admission (False)."""
        if not self._queue and self._compatible(key):
            self.running[ticket] = key
            return True
        self._queue.append(_Waiter(ticket, key, on_admit))
        return False

    def release(self, ticket: int) -> None:
        """A running save finished (or a queued one gave up); admit whoever can go next."""
        if self.running.pop(ticket, None) is None:
            self._queue = deque(w for w in self._queue if w.ticket != ticket)
        while self._queue and self._compatible(self._queue[0].key):
            waiter = self._queue.popleft()
            self.running[waiter.ticket] = waiter.key
            waiter.on_admit()

    @property
    def waiting(self) -> int:
        return len(self._queue)
