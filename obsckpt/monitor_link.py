"""Every call a worker or trainer process makes to the monitor actor.

A save's calls (admission, leases, finish reports, staging reports) and the
trainer's (registering a step's saves, submitting it, reading what is
committed) go through one :class:`MonitorLink`, which takes plain values (slot,
step, kind, part) and knows nothing of the coordinator's types.

Admission and finish reports are waited for, since a step commits only when
the monitor has counted its saves; staging reports are sent and not waited for
(telemetry never stalls training). While a save runs, one heartbeat thread
per link renews its lease, so the monitor can tell a slow save from a rank
that died.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any

from obsckpt import validators
from obsckpt.errors import RayShutDownError

logger = logging.getLogger(__name__)


def ray_identity() -> tuple[str, str]:
    """(node id, job id) of this process in Ray, or ("local", "local") outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            return ctx.get_node_id(), ctx.get_job_id()
    except Exception:  # noqa: BLE001 - identity is informational
        pass
    return "local", "local"


def default_rank() -> int | None:
    """This process's rank from ``RANK``, ``LOCAL_RANK`` or torch.distributed; None if none says."""
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - no torch, or no process group: the rank is unknown
        pass
    return None


def _connected_ray() -> Any:
    """The ``ray`` module, once this process is connected to its cluster.

    An actor call after ``ray.shutdown()`` (a save still running when the job
    shut Ray down, or at exit) would start a new local Ray instance, whose
    processes outlive this one, and then fail anyway: it is refused here.

    Raises:
        RayShutDownError: Ray is not initialized in this process.
    """
    import ray

    if not ray.is_initialized():
        raise RayShutDownError(
            "Ray is not initialized in this process (ray.shutdown() ran, or the process is "
            "exiting), so the checkpoint monitor cannot be reached and this save cannot "
            "commit; call wait_all() (or close()) on the coordinator before ray.shutdown()"
        )
    return ray


def _part_kwargs(part: int | None, parts: int | None) -> dict[str, int | None]:
    """``part``/``parts`` for the monitor's RPCs; nothing for an unsplit save."""
    return {} if parts is None else {"part": part, "parts": parts}


# Seconds a call waits for the monitor's answer, where the caller does not say.
DEFAULT_RPC_TIMEOUT_S = 300.0


class MonitorLink:
    """One process's side of the monitor protocol.

    Args:
        monitor: the :class:`~obsckpt.monitor.CheckpointMonitor` actor handle.
        rank: the rank reported with every save (None: unknown).
        rpc_timeout: seconds to wait for an RPC that is not an admission.

    Raises:
        ValueError: ``rank`` or ``rpc_timeout`` malformed (also when set later).
    """

    def __init__(self, monitor: Any, *, rank: int | None, rpc_timeout: float) -> None:
        self.monitor = monitor
        self.rank = rank
        self.rpc_timeout = rpc_timeout
        self._lock = threading.Lock()
        self._leases: set[int] = set()
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_s: float | None = None

    @property
    def rank(self) -> int | None:
        """The rank reported with every save."""
        return self._rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        self._rank = validators.validate_rank(value)

    @property
    def rpc_timeout(self) -> float:
        """Seconds to wait for an RPC that is not an admission."""
        return self._rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        self._rpc_timeout = validators.validate_rpc_timeout(value)

    # -- a save's calls ------------------------------------------------

    def admit(
        self,
        slot: str,
        step: int,
        kind: str,
        *,
        carrier: dict | None,
        part: int | None = None,
        parts: int | None = None,
        unless_closed: bool = False,
    ) -> dict:
        """Ask the monitor to admit a save; returns its reply once the save may run.

        Not bounded by ``rpc_timeout``: under a save strategy the wait is the
        queueing itself. A reply with a ``heartbeat_s`` takes a lease, which
        heartbeats renew until :meth:`drop_lease`. ``unless_closed``: the
        monitor skips the save if the step of its kind is already closed.
        """
        ray = _connected_ray()
        node_id, job_id = ray_identity()
        reply = ray.get(
            self.monitor.notify_started.remote(
                node_id=node_id,
                job_id=job_id,
                step=step,
                slot=slot,
                kind=kind,
                rank=self.rank,
                pid=os.getpid(),
                lease=True,
                trace_context=carrier,
                **_part_kwargs(part, parts),
                **({"unless_closed": True} if unless_closed else {}),
            )
        )
        reply = reply if isinstance(reply, dict) else {}
        if reply.get("heartbeat_s") and reply.get("ticket") is not None:
            self._hold_lease(reply["ticket"], reply["heartbeat_s"])
        return reply

    def drop_lease(self, ticket: int | None) -> None:
        """Stop renewing ``ticket``'s lease (its save has ended)."""
        with self._lock:
            self._leases.discard(ticket)

    def finished(
        self,
        slot: str,
        step: int,
        kind: str,
        ticket: int | None,
        *,
        part: int | None = None,
        parts: int | None = None,
        **report: Any,
    ) -> None:
        """Report that a save ended (``ok=True`` or ``ok=False``) with its measurements.

        Raises:
            Exception: the RPC failed or timed out; the monitor may not have counted the save.
        """
        ray = _connected_ray()
        ray.get(
            self.monitor.notify_finished.remote(
                step,
                kind == "state_dict",
                ticket=ticket,
                slot=slot,
                rank=self.rank,
                **_part_kwargs(part, parts),
                **report,
            ),
            timeout=self.rpc_timeout,
        )

    def failed(
        self,
        slot: str,
        step: int,
        kind: str,
        ticket: int | None,
        exc: BaseException,
        *,
        join_wait: float | None,
        part: int | None = None,
        parts: int | None = None,
        admitted: bool = True,
    ) -> None:
        """Report that a save failed with ``exc``; a report that cannot be sent is logged.

        ``admitted=False``: it failed before asking for admission (it holds no ticket).
        """
        try:
            self.finished(
                slot,
                step,
                kind,
                ticket,
                part=part,
                parts=parts,
                ok=False,
                error="".join(traceback.format_exception_only(type(exc), exc)).strip(),
                join_wait_s=join_wait,
                admitted=admitted,
            )
        except Exception as report_exc:  # noqa: BLE001 - the monitor may be gone
            logger.error(
                "obsckpt: could not report the failure of %r step %d to the monitor: %s",
                slot,
                step,
                report_exc,
            )

    def record_staging(
        self, slot: str, *, nbytes: int, pinned_bytes: int, cold: bool = False
    ) -> None:
        """Report slot ``slot``'s staging bytes; sent, not waited for."""
        try:
            _connected_ray()
            self.monitor.record_staging.remote(
                rank=self.rank,
                slot=slot,
                nbytes=nbytes,
                pinned_bytes=pinned_bytes,
                cold=cold,
                pid=os.getpid(),
            )
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            logger.warning("obsckpt: reporting staging bytes of slot %r failed: %s", slot, exc)

    # -- a step's calls ------------------------------------------------

    def register_thread_count(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """Register how many saves of each kind ``step`` expects; waits for the monitor."""
        _connected_ray().get(
            self._register_thread_count(step, state_dict_thread_count, checkpoint_thread_count),
            timeout=self.rpc_timeout,
        )

    async def register_thread_count_async(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """:meth:`register_thread_count`, awaited on the caller's event loop."""
        await self._register_thread_count(step, state_dict_thread_count, checkpoint_thread_count)

    def monitor_step(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict | None = None
    ) -> None:
        """Submit ``step`` for commit (it commits once its saves finish); waits for the monitor."""
        _connected_ray().get(
            self._monitor_step(step, is_state_dict, trace_context), timeout=self.rpc_timeout
        )

    async def monitor_step_async(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict | None = None
    ) -> None:
        """:meth:`monitor_step`, awaited on the caller's event loop."""
        await self._monitor_step(step, is_state_dict, trace_context)

    def latest_steps(self) -> dict[str, int | None]:
        """The monitor's latest committed step of each kind."""
        return _connected_ray().get(self.monitor.latest_steps.remote(), timeout=self.rpc_timeout)

    def status(self) -> dict[str, Any]:
        """The monitor's status view (latest, pending, failed and abandoned steps, ...)."""
        return _connected_ray().get(self.monitor.status.remote(), timeout=self.rpc_timeout)

    def _register_thread_count(self, step: int, state_dict: int, checkpoint: int) -> Any:
        return self.monitor.register_thread_count.remote(
            step, state_dict_thread_count=state_dict, checkpoint_thread_count=checkpoint
        )

    def _monitor_step(self, step: int, is_state_dict: bool, trace_context: dict | None) -> Any:
        return self.monitor.monitor_step.remote(
            step, is_state_dict=is_state_dict, trace_context=trace_context
        )

    # -- leases --------------------------------------------------------

    def _hold_lease(self, ticket: int, interval: float) -> None:
        with self._lock:
            self._leases.add(ticket)
            self._heartbeat_s = interval
            if self._heartbeat is None or not self._heartbeat.is_alive():
                self._heartbeat = threading.Thread(
                    target=self._send_heartbeats, name="obsckpt-heartbeat", daemon=True
                )
                self._heartbeat.start()

    def _send_heartbeats(self) -> None:
        while True:
            time.sleep(self._heartbeat_s or 1.0)
            with self._lock:
                tickets = list(self._leases)
                if not tickets:
                    self._heartbeat = None
                    return
            try:
                ray = _connected_ray()
                ray.get(self.monitor.heartbeat.remote(tickets), timeout=self.rpc_timeout)
            except RayShutDownError:
                with self._lock:
                    self._heartbeat = None
                return  # nothing to renew with; a save that ends later fails the same way
            except Exception as exc:  # noqa: BLE001 - the next beat may get through
                logger.warning("obsckpt: heartbeat to the monitor failed: %s", exc)
