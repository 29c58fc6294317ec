"""A coordinator's calls to the monitor actor: admission, leases and reports.

Admission and finish reports are waited for, since a step commits only when
the monitor has counted its saves; staging reports are sent and not waited for
(telemetry never stalls training). While a save runs, one heartbeat thread
per coordinator renews its lease, so the monitor can tell a slow save from a
rank that died.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from obsckpt.errors import RayShutDownError

if TYPE_CHECKING:
    from obsckpt.coordinator import _Save

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


class MonitorLink:
    """One coordinator's side of the monitor protocol.

    Args:
        monitor: the :class:`~obsckpt.monitor.CheckpointMonitor` actor handle.
        rank: the rank reported with every save.
        rpc_timeout: seconds to wait for an RPC that is not an admission.
    """

    def __init__(self, monitor: Any, *, rank: int | None, rpc_timeout: float) -> None:
        self.monitor = monitor
        self.rank = rank
        self.rpc_timeout = rpc_timeout
        self._lock = threading.Lock()
        self._leases: set[int] = set()
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_s: float | None = None

    def admit(self, save: _Save, carrier: dict | None) -> dict:
        """Ask the monitor to admit ``save``; returns its reply once the save may run.

        Not bounded by ``rpc_timeout``: under a save strategy the wait is the
        queueing itself. A reply with a ``heartbeat_s`` takes a lease, which
        heartbeats renew until :meth:`drop_lease`.
        """
        ray = _connected_ray()
        node_id, job_id = ray_identity()
        reply = ray.get(
            self.monitor.notify_started.remote(
                node_id=node_id,
                job_id=job_id,
                step=save.step,
                slot=save.slot,
                kind=save.kind,
                rank=self.rank,
                pid=os.getpid(),
                lease=True,
                trace_context=carrier,
                **save.part_kwargs(),
                **({"unless_closed": True} if save.unless_committed else {}),
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

    def finished(self, save: _Save, ticket: int | None, **report: Any) -> None:
        """Report that ``save`` ended (``ok=True`` or ``ok=False``) with its measurements.

        Raises:
            Exception: the RPC failed or timed out; the monitor may not have counted the save.
        """
        ray = _connected_ray()
        ray.get(
            self.monitor.notify_finished.remote(
                save.step,
                save.kind == "state_dict",
                ticket=ticket,
                slot=save.slot,
                rank=self.rank,
                **save.part_kwargs(),
                **report,
            ),
            timeout=self.rpc_timeout,
        )

    def failed(
        self,
        save: _Save,
        ticket: int | None,
        exc: BaseException,
        join_wait: float | None,
        *,
        admitted: bool = True,
    ) -> None:
        """Report that ``save`` failed with ``exc``; a report that cannot be sent is logged.

        ``admitted=False``: it failed before asking for admission (it holds no ticket).
        """
        try:
            self.finished(
                save,
                ticket,
                ok=False,
                error="".join(traceback.format_exception_only(type(exc), exc)).strip(),
                join_wait_s=join_wait,
                admitted=admitted,
            )
        except Exception as report_exc:  # noqa: BLE001 - the monitor may be gone
            logger.error(
                "obsckpt: could not report the failure of %r step %d to the monitor: %s",
                save.slot,
                save.step,
                report_exc,
            )

    def record_staging(self, slot: str, staging: Any, *, cold: bool = False) -> None:
        """Report slot ``slot``'s staging bytes; sent, not waited for."""
        try:
            _connected_ray()
            self.monitor.record_staging.remote(
                rank=self.rank,
                slot=slot,
                nbytes=staging.bytes_allocated,
                pinned_bytes=staging.pinned_bytes,
                cold=cold,
                pid=os.getpid(),
            )
        except Exception as exc:  # noqa: BLE001 - telemetry never breaks training
            logger.warning("obsckpt: reporting staging bytes of slot %r failed: %s", slot, exc)

    def latest_steps(self) -> dict[str, int | None]:
        """The monitor's latest committed step of each kind."""
        return _connected_ray().get(self.monitor.latest_steps.remote(), timeout=self.rpc_timeout)

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
