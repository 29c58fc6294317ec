"""How long a detached Synchronizer lives, and how one is ended.

Trinity-RFT 0.6.0's synchronizer is a detached actor: it outlives the job
that created it, and ends once every module that asked for it (the trainer
and explorer actors, ``add_module``) is dead. :class:`ModuleWatch` does the
same for obsckpt's. A synchronizer created outside an actor tracks no module;
it ends with its owner's ``shutdown()`` call, or with :func:`stop`, which
``python -m obsckpt.sync.lifetime`` runs (:mod:`obsckpt.sync.lifetime`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

# As Trinity: look every second; a module that does not answer within 5 s is kept.
CHECK_INTERVAL_S = 1.0
ANSWER_TIMEOUT_S = 5.0


class ModuleWatch:
    """The actors a detached synchronizer serves; ``on_empty`` runs once none is alive."""

    def __init__(
        self,
        on_empty: Callable[[], Awaitable[None]],
        *,
        interval_s: float = CHECK_INTERVAL_S,
        answer_timeout_s: float = ANSWER_TIMEOUT_S,
    ) -> None:
        self._on_empty = on_empty
        self._interval_s = interval_s
        self._answer_timeout_s = answer_timeout_s
        self.modules: set[Any] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, module: Any) -> None:
        """Track ``module`` (a Ray actor handle); the watch starts with the first one."""
        if module is None:
            return
        self.modules.add(module)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name="obsckpt-synchronizer-modules"
            )

    def cancel(self) -> None:
        """Stop watching (not from inside the watch itself: its ``on_empty`` is running)."""
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _alive(self, module: Any) -> bool:
        import ray

        method = getattr(module, "is_alive", None) or module.__ray_ready__
        ref = method.remote()
        try:
            await asyncio.wait_for(ref, self._answer_timeout_s)
        except ray.exceptions.RayActorError:
            return False
        except asyncio.TimeoutError:
            ray.cancel(ref)
        return True

    async def _run(self) -> None:
        while self.modules:
            checked = list(self.modules)
            alive = await asyncio.gather(*(self._alive(m) for m in checked))
            for module, ok in zip(checked, alive, strict=True):
                if not ok:
                    self.modules.discard(module)
            if self.modules:
                await asyncio.sleep(self._interval_s)
        logger.info("obsckpt: every module the synchronizer served is gone; it ends")
        await self._on_empty()


def current_actor() -> Any:
    """This process's actor handle, or None outside an actor (a driver, a test)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


def exit_this_actor() -> None:
    """End this actor (and free its name); nothing outside an actor."""
    actor = current_actor()
    if actor is not None:
        import ray

        ray.kill(actor, no_restart=True)


def stop(namespace: str | None, *, timeout_s: float = 30.0) -> bool:
    """End the ``synchronizer`` actor of ``namespace`` (its ``shutdown()``, then ``ray.kill``).

    Returns:
        False when none runs there.
    """
    import ray

    from obsckpt.options import SYNCHRONIZER_ACTOR_NAME

    try:
        actor = ray.get_actor(SYNCHRONIZER_ACTOR_NAME, namespace=namespace)
    except ValueError:
        return False
    try:
        ray.get(actor.shutdown.remote(), timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        pass
    ray.kill(actor, no_restart=True)
    return True
