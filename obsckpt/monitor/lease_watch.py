"""The monitor actor's lease checks: a timer on its event loop that asks the core.

The policy (what a stale lease is, what its expiry does) is
:class:`~obsckpt.monitor.core.MonitorCore`'s; this runs it every
``check_interval_s`` while any save is watched, and asks Ray for dead nodes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from obsckpt.monitor.core import MonitorCore
from obsckpt.monitor.lifecycle import DeadNodes


class LeaseWatch:
    """Runs the core's lease (and node) checks while any save is watched.

    Args:
        core: the monitor's core.
        after_expiry: awaited after a check that failed saves (commits what it unblocked).
        dead_nodes: the dead nodes' ids, asked in a thread (default: Ray's, see DeadNodes).
    """

    def __init__(
        self,
        core: MonitorCore,
        after_expiry: Callable[[], Awaitable[None]],
        dead_nodes: Callable[[], set[str]] | None = None,
    ) -> None:
        self.core = core
        self._after_expiry = after_expiry
        self.dead_nodes = dead_nodes if dead_nodes is not None else DeadNodes()
        self._task: asyncio.Task[None] | None = None

    def ensure_running(self) -> None:
        """Start the checks if they are not running (they stop when nothing is watched)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        """Fail saves whose coordinator stopped sending heartbeats (a killed rank), or
        whose node Ray reports dead, while any save is watched."""
        interval = self.core.check_interval_s
        checked = self.core.now()
        while self.core.watched():
            await asyncio.sleep(interval)
            now = self.core.now()
            if now - checked > 2 * interval:
                # This loop itself did not run (the process stopped, the loop was held).
                self.core.renew_all_leases()
            checked = now
            expired = self.core.expire_stale_leases()
            if self.core.watch_nodes:
                gone = await asyncio.to_thread(self.dead_nodes)
                expired += self.core.expire_on_nodes(gone)
            if expired:
                await self._after_expiry()
