"""Waits with a bound for the weight-sync group: polls, helper threads, and their clean-up.

A collective or a store call that can hang (a peer gone, a lazy communicator
connecting) runs where the caller's deadline still holds; a helper thread left
behind past its deadline is joined, for at most ``ABORT_JOIN_S``, at exit.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable
from typing import Any

from obsckpt.errors import BroadcastError, BroadcastTimeoutError

# How long close(), and the interpreter's exit, wait for a gloo abort still running.
ABORT_JOIN_S = 10.0
# Helper threads that may still be inside gloo (an abort, a connection left
# behind): a process that exits meanwhile dies of SIGABRT, so exit joins them.
_PENDING: list[threading.Thread] = []


def leave_behind(t: threading.Thread) -> None:
    _PENDING[:] = [p for p in _PENDING if p.is_alive()]
    _PENDING.append(t)


@atexit.register
def _join_pending() -> None:
    deadline = time.monotonic() + ABORT_JOIN_S
    while _PENDING:
        _PENDING.pop().join(max(deadline - time.monotonic(), 0.001))


def poll_completed(work: Any, deadline: float) -> bool:
    """Poll ``work.is_completed()`` until ``deadline``; False when it did not complete."""
    pause = 20e-6
    while not work.is_completed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return True


def run_bounded(
    fn: Callable[[], None],
    deadline: float,
    abort: Callable[[], None],
    msg: str,
    grace: float = 0.0,
) -> None:
    """Run ``fn`` on a helper thread; past ``deadline`` (plus ``grace``) call ``abort`` and raise.

    A communicator that connects lazily blocks the calling thread inside its
    first collective; running it aside keeps the caller's deadline. ``grace``
    lets a call bounded by the same deadline end by itself (and report why).
    A thread left behind is joined at exit, like an abort.
    """
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box.append(exc)

    t = threading.Thread(target=run, name="obsckpt-weight-sync-connect", daemon=True)
    t.start()
    t.join(max(deadline - time.monotonic(), 0.001) + grace)
    if t.is_alive():
        abort()  # left behind, the thread ends with its own timeout
        leave_behind(t)
        raise BroadcastTimeoutError(msg)
    if box:
        exc = box[0]
        if isinstance(exc, BroadcastError):
            raise type(exc)(f"{msg}: {exc}") from exc
        raise BroadcastError(f"{msg}: {exc}") from exc
