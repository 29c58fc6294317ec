"""Save threads: daemon threads kept between saves, so starting a save costs a queue put.

A submitted job goes to an idle thread if there is one, else to a new
thread, so a job never waits behind another: a hung save keeps its thread
and the next save gets a fresh one. A thread is named for the job it runs
(``obsckpt-save-<slot>-step<N>``) and ``obsckpt-save-idle-<n>`` between jobs.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class SaveThreads:
    """Daemon threads that run saves, kept between saves.

    The number of threads is the most jobs this process has had running at once.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
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
        # Each idle thread is either blocked in get() or about to be, and every
        # claim above is matched by exactly one get(): the item never waits
        # for a busy thread.
        self._work.put((fn, name))

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
            fn, name = self._work.get()
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


THREADS = SaveThreads()
"""The process's save threads, shared by every coordinator in it."""
if hasattr(os, "register_at_fork"):
    # The threads do not exist in a forked child; neither may their queued work.
    os.register_at_fork(after_in_child=THREADS._reset)
