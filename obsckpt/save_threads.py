"""Save threads: daemon threads kept between saves, so starting a save costs a queue put.

A submitted job goes to an idle thread if there is one, else to a new
thread, so a job never waits behind another: a hung save keeps its thread
and the next save gets a fresh one. A thread is named for the job it runs
(``obsckpt-save-<slot>-step<N>``) and ``obsckpt-save-idle-<n>`` between jobs.

The threads are daemons, so a hung save never keeps a process alive; at
interpreter exit the process waits up to ``OBSCKPT_EXIT_WAIT_S`` seconds
(default 60) for the jobs still running, since a process that exits without
``wait_all()`` (an uncaught exception, ``sys.exit``, Ctrl-C, Ray's SIGTERM
handler) would otherwise drop its saves halfway. The wait runs first thing at
shutdown, while the thread pools a save uses still take work and before
``atexit`` handlers (Ray's ``ray.shutdown`` among them) run; a Ctrl-C during
it stops the wait, and the saves still running are left uncommitted.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from obsckpt.env import OBSCKPT_EXIT_WAIT_S, from_env_if_absent

logger = logging.getLogger(__name__)

EXIT_WAIT_ENV = OBSCKPT_EXIT_WAIT_S
_EXIT_WAIT_S = 60.0


# Seconds between the warnings of a wait that has no bound (a slot's join, wait_all,
# a prepare): a stuck save shows in the log, named, instead of as a silent hang.
STALL_WARNING_S = 60.0
# The longest such a wait lasts (a CheckpointCoordinator's ``stall_timeout_s``): past
# it the wait raises, naming what it waited for and for how long, instead of hanging
# the training loop for good behind a save that never returns.
STALL_TIMEOUT_S = 7200.0


def wait_watched(
    wait: Callable[[float | None], bool],
    timeout: float | None,
    what: Callable[[], str],
    *,
    warn_every: float = STALL_WARNING_S,
    log: logging.Logger | None = None,
) -> bool:
    """Wait with ``wait(seconds)`` (True once done) up to ``timeout`` (None: no limit).

    Every ``warn_every`` seconds still waiting it logs a warning: ``what()``
    (e.g. "slot 'model' (step 4)") and how long it has waited. Returns whether
    the wait ended before ``timeout``.
    """
    start = time.monotonic()
    deadline = None if timeout is None else start + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        chunk = warn_every if left is None else min(warn_every, left)
        if wait(chunk):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        (log or logger).warning(
            "obsckpt: still waiting for %s after %.0f s%s",
            what(),
            time.monotonic() - start,
            "" if timeout is None else f" (gives up after {timeout:.0f} s)",
        )


def _exit_wait_s() -> float:
    """Seconds to wait at exit for running saves: ``OBSCKPT_EXIT_WAIT_S``, read now, else 60."""
    try:
        return from_env_if_absent(None, EXIT_WAIT_ENV, _EXIT_WAIT_S, float)
    except ValueError:
        return _EXIT_WAIT_S


class SaveThreads:
    """Daemon threads that run saves, kept between saves.

    The number of threads is the most jobs this process has had running at once.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)  # notified when a job ends
        self._running: dict[int, str] = {}  # submitted jobs not ended: number -> name
        self._jobs = 0
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._started = 0

    def submit(self, fn: Callable[[], Any], name: str) -> None:
        with self._lock:
            spawn = self._idle == 0
            if spawn:
                self._started += 1
                number = self._started
            else:
                self._idle -= 1
        if spawn:
            # Started before the work is queued: if the thread cannot start, the
            # caller gets the error and nothing is left in the queue.
            self._spawn(number, idle=False)
        with self._lock:
            self._jobs += 1
            job = self._jobs
            self._running[job] = name  # from now: a process exiting right away waits for it
        # Each idle thread is either blocked in get() or about to be, and every
        # claim above is matched by exactly one get(): the item never waits
        # for a busy thread.
        self._work.put((fn, name, job))

    def warm(self, idle: int) -> None:
        """Start threads until at least ``idle`` are idle, so the next saves start none."""
        while True:
            with self._lock:
                if self._idle >= idle:
                    return
                self._started += 1
                self._idle += 1
                number = self._started
            self._spawn(number, idle=True)

    def _spawn(self, number: int, *, idle: bool) -> None:
        """Start thread ``number``, already counted (as idle, if ``idle``); uncount it on failure."""
        try:
            threading.Thread(
                target=self._serve, name=f"obsckpt-save-idle-{number}", daemon=True
            ).start()
        except BaseException:
            with self._lock:
                self._started -= 1
                if idle:
                    self._idle -= 1
            raise

    def _serve(self) -> None:
        me = threading.current_thread()
        idle_name = me.name
        while True:
            fn, name, job = self._work.get()
            me.name = name
            try:
                fn()
            except BaseException:  # noqa: BLE001 - a save records its own errors
                logger.exception("obsckpt: unexpected error in save thread %s", name)
            finally:
                # An idle thread holds nothing of its last save: the job's closure
                # keeps the snapshot (views of the slot's arena), which close() frees.
                fn = None
                me.name = idle_name
                with self._lock:
                    self._idle += 1
                    self._running.pop(job, None)
                    self._ended.notify_all()

    def running(self) -> list[str]:
        """The names of the jobs submitted and not ended."""
        with self._lock:
            return sorted(self._running.values())

    def drain(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` seconds until every job has ended; returns the ones still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._running and (left := deadline - time.monotonic()) > 0:
                self._ended.wait(left)
            return sorted(self._running.values())


THREADS = SaveThreads()
"""The process's save threads, shared by every coordinator in it."""
if hasattr(os, "register_at_fork"):
    # The threads do not exist in a forked child; neither may their queued work.
    os.register_at_fork(after_in_child=THREADS._reset)


def _wait_at_exit() -> None:
    running = THREADS.running()
    if not running:
        return
    timeout = _exit_wait_s()
    logger.warning(
        "obsckpt: the process is exiting with %d saves running (%s); waiting up to %.0f s "
        "(%s; Ctrl-C to stop waiting). Call wait_all() before exiting",
        len(running),
        ", ".join(running),
        timeout,
        EXIT_WAIT_ENV,
    )
    try:
        left = THREADS.drain(timeout)
    except KeyboardInterrupt:
        # Raised out of the interpreter's shutdown, it would skip the hooks after this one.
        logger.error(
            "obsckpt: interrupted while waiting for saves at exit; exiting with saves still "
            "running (%s): their steps will not commit",
            ", ".join(THREADS.running()),
        )
        return
    if left:
        logger.error(
            "obsckpt: exiting with saves still running (%s): their steps will not commit",
            ", ".join(left),
        )


def _run_first_at_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook`` at the very start of the interpreter's shutdown, else at ``atexit``.

    A save still running at exit needs what ``atexit`` is too late for:
    concurrent.futures refuses new work (the fsyncs of a save submit to a pool)
    from an exit hook of the threading module, which runs before any ``atexit``
    handler; and ``ray.shutdown()`` is an ``atexit`` handler, after which a save
    that reports would start a Ray instance of its own. Only the threading
    module's own hook list (``threading._register_atexit``, CPython 3.9+; last
    registered runs first, so after concurrent.futures' import ours runs before
    its hook) runs at that point; there is no public API for it. Without it the
    hook runs at ``atexit``, where a save that has yet to fsync or report fails.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(hook)
            return
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(hook)


_run_first_at_shutdown(_wait_at_exit)
