"""What SIGINT, SIGTERM and SIGHUP do to a demo run, by phase.

During the start-up a stop signal abandons the run at once
(:class:`StartupStopped`); during training the loop stops after its current
step and the saves in flight then finish and commit (after SIGTERM or SIGHUP
within :data:`STOP_GRACE_S`); a second SIGINT stops at once. The run then exits
128 + the signal's number, as a shell reports a process a signal ended.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# The signals that stop a run; it then exits 128 + the signal's number, as a shell
# reports a process a signal ended (130 SIGINT, 143 SIGTERM, 129 SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After SIGTERM or SIGHUP, how long saves in flight may take to finish and commit.
# Whoever sends them (a job runner, a closing terminal) does not wait long.
STOP_GRACE_S = 10.0


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; ``signal N`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def stop_reason(signum: int) -> str:
    """How the last line names a run a signal stopped: ``interrupted`` (Ctrl-C), else by name."""
    if signum == signal.SIGINT:
        return "interrupted"
    return f"terminated by {signal_name(signum)}"


class StartupStopped(KeyboardInterrupt):
    """A stop signal came before the first step: the start-up is abandoned.

    A KeyboardInterrupt, as Ray cuts short a ``ray.get`` for that one alone (and
    raises a plain KeyboardInterrupt in its place: StopSignals records the signal).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum,), dict(vars(self)))


class StopSignals:
    """What SIGINT, SIGTERM and SIGHUP do to the run, by phase.

    * ``start-up``: nothing is in flight yet, so the start-up is abandoned at once
      (:class:`StartupStopped`), except inside :meth:`held`, which finishes first
      (removing an earlier run's steps is not cut short);
    * ``training``: the loop stops after its current step, and the saves in flight
      finish and commit;
    * ``finishing`` (draining, the summary, shutting down): the run ends as it was
      going to, with the signal's exit status.

    A second SIGINT raises KeyboardInterrupt in any phase (stop at once); a second
    SIGTERM or SIGHUP changes nothing.
    """

    def __init__(self, notify: Callable[[str], None]) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.at: float | None = None  # monotonic time of the first signal
        self.phase = "start-up"
        self._notify = notify
        self._previous: dict[int, Any] = {}
        self._held = False

    def install(self) -> None:
        """Take the stop signals (in the main thread only: Python runs handlers there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def reinstall(self) -> None:
        """Take the signals back if they were taken (ray.init puts in a SIGTERM handler)."""
        if self._previous:
            self.install()

    def record(self, signum: int) -> bool:
        """Note the first stop signal; False when one came before."""
        if self.signum is not None:
            return False
        self.signum = signum
        self.at = time.monotonic()
        self.event.set()
        return True

    def restore(self) -> None:
        """Give the signals back to the handlers they had before :meth:`install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def exit_code(self) -> int:
        """128 + the number of the signal that stopped the run."""
        assert self.signum is not None
        return 128 + self.signum

    def check(self) -> None:
        """Raise StartupStopped if a signal came during the start-up."""
        if self.signum is not None and self.phase == "start-up":
            raise StartupStopped(self.signum)

    @contextmanager
    def held(self) -> Iterator[None]:
        """A start-up section a signal does not interrupt; it takes effect after it."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        self.check()

    def grace_deadline(self, deadline: float) -> float:
        """``deadline``, or sooner once SIGTERM or SIGHUP asked the run to end."""
        if self.signum in (signal.SIGTERM, signal.SIGHUP):
            return min(deadline, self.at + STOP_GRACE_S)
        return deadline

    def _handle(self, signum, _frame) -> None:
        if not self.record(signum):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        if self.phase == "start-up":
            if not self._held:
                raise StartupStopped(signum)
        elif self.phase == "training":
            name = signal.Signals(signum).name
            if signum == signal.SIGINT:
                self._notify(
                    f"received {name}: stopping after this step; saves in flight will finish "
                    "and commit (Ctrl-C again to stop at once, leaving them uncommitted)"
                )
            else:
                self._notify(
                    f"received {name}: stopping after this step; saves in flight get "
                    f"{STOP_GRACE_S:.0f} s to finish and commit"
                )


def own_session() -> bool:
    """Whether this process leads a session without a terminal.

    No terminal's signals reach such a session, so none reach the Ray processes
    it starts either: only a signal sent to the process itself.
    """
    if not hasattr(os, "getsid"):
        return False
    try:
        if os.getsid(0) != os.getpid():
            return False
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return True
    os.close(fd)
    return False
