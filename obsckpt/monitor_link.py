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
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from obsckpt import validators
from obsckpt.errors import (
    MonitorCallError,
    MonitorTimeoutError,
    MonitorUnavailableError,
    ObsckptError,
    RayShutDownError,
)
from obsckpt.options import MONITOR_ACTOR_NAME

logger = logging.getLogger(__name__)

# Whether this process has logged that Ray could not tell its identity (once is enough).
_identity_warned = False


def ray_identity() -> tuple[str, str]:
    """(node id, job id) of this process in Ray.

    The save strategies key admission on them (``single_node`` on the node,
    ``single_process`` on node, job and pid), so two processes must never share
    an invented identity: where Ray cannot tell, this host's name and this
    process's pid stand in (logged once per process).
    """
    why = "Ray is not initialized in this process"
    try:
        import ray

        if ray.is_initialized():
            ctx = ray.get_runtime_context()
            node_id, job_id = ctx.get_node_id(), ctx.get_job_id()
            if node_id and job_id:
                return node_id, job_id
            why = f"Ray's runtime context has node id {node_id!r} and job id {job_id!r}"
    except Exception as exc:  # noqa: BLE001 - the fallback below still names this process
        why = f"Ray's runtime context failed: {one_line(exc)}"
    global _identity_warned
    node_id, job_id = f"host:{socket.gethostname()}", f"pid:{os.getpid()}"
    if not _identity_warned:
        _identity_warned = True
        logger.warning(
            "obsckpt: %s; this process reports its saves as node %r, job %r", why, node_id, job_id
        )
    return node_id, job_id


_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line, without terminal colour codes.

    A Ray task error is summarised by its cause: its own text is the remote
    traceback, many lines long.
    """
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and cause is not exc:
        return one_line(cause)
    text = " ".join(strip_colour(str(exc)).split()) or "(no message)"
    return f"{type(exc).__name__}: {text}"


def strip_colour(text: str) -> str:
    """``text`` without terminal colour codes."""
    return _ANSI_RE.sub("", text)


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


def monitor_error(
    exc: BaseException, what: str, monitor: str, timeout: float | None = None
) -> BaseException:
    """What a failed call ``what`` to ``monitor`` raises in its caller, with ``exc`` as its cause.

    Ray's own errors carry the remote traceback (many lines, in colour) in their
    text; the caller gets obsckpt's exception with one line instead:
    :class:`MonitorUnavailableError` (retryable) when the actor cannot be reached,
    :class:`MonitorTimeoutError` when it did not answer in time, the monitor's
    own obsckpt exception when it raised one, else :class:`MonitorCallError`.
    Anything else (not from Ray) is returned as it is.
    """
    from ray import exceptions as rex

    if isinstance(exc, rex.GetTimeoutError):
        error: BaseException = MonitorTimeoutError(
            f"{monitor} did not answer {what} within rpc_timeout={timeout} s (overloaded, "
            "or restarting); the call is retryable"
        )
    elif isinstance(exc, rex.RayActorError):
        state = (
            "is restarting or unreachable"
            if isinstance(exc, rex.ActorUnavailableError)
            else "has died"
        )
        error = MonitorUnavailableError(
            f"{monitor} {state} ({type(exc).__name__}) during {what}; the call is retryable "
            "once the monitor is back (Ray restarts it up to max_restarts times)"
        )
    elif isinstance(exc, rex.RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, ObsckptError) and "\n" not in str(cause):
            return cause
        error = MonitorCallError(f"{monitor} failed {what}: {one_line(exc)}")
    elif isinstance(exc, rex.RayError):
        error = MonitorUnavailableError(
            f"{monitor} could not be reached for {what}: {one_line(exc)}; the call is retryable"
        )
    else:
        return exc
    return error


class MonitorLink:
    """One process's side of the monitor protocol.

    Args:
        monitor: the :class:`~obsckpt.monitor.CheckpointMonitor` actor handle.
        rank: the rank reported with every save (None: unknown).
        rpc_timeout: seconds to wait for an RPC that is not an admission.
        namespace: the monitor's Ray namespace, for error messages (None: not named).

    Raises:
        ValueError: ``rank`` or ``rpc_timeout`` malformed (also when set later).
    """

    def __init__(
        self,
        monitor: Any,
        *,
        rank: int | None,
        rpc_timeout: float,
        namespace: str | None = None,
    ) -> None:
        self.monitor = monitor
        self.rank = rank
        self.rpc_timeout = rpc_timeout
        self._namespace = namespace
        self._root: str | None = None
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

    def describe(self) -> str:
        """The monitor as an error names it: its actor name, Ray handle and namespace if known."""
        where = f", namespace {self._namespace!r}" if self._namespace is not None else ""
        return f"the checkpoint monitor (actor {MONITOR_ACTOR_NAME!r}, {self.monitor!r}{where})"

    def _get(self, ref_of: Any, what: str, timeout: float | None) -> Any:
        """``ray.get`` of the call ``ref_of()`` makes, its failure as obsckpt's (see :func:`monitor_error`)."""
        ray = _connected_ray()
        try:
            return ray.get(ref_of(), timeout=timeout)
        except Exception as exc:
            error = monitor_error(exc, what, self.describe(), timeout)
            if error is exc:
                raise
            raise error from exc

    async def _await(self, ref: Awaitable[Any], what: str) -> Any:
        """``await ref``, its failure as obsckpt's (see :func:`monitor_error`)."""
        try:
            return await ref
        except Exception as exc:
            error = monitor_error(exc, what, self.describe())
            if error is exc:
                raise
            raise error from exc

    def checkpoint_root(self) -> str:
        """The directory the monitor commits steps under (asked once, then remembered)."""
        if self._root is None:
            root = self._get(
                lambda: self.monitor.checkpoint_root.remote(), "checkpoint_root", self.rpc_timeout
            )
            self._root = os.fspath(root)
        return self._root

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
        _connected_ray()
        node_id, job_id = ray_identity()
        reply = self._get(
            lambda: self.monitor.notify_started.remote(
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
            ),
            f"notify_started (slot {slot!r}, step {step})",
            None,
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
            MonitorUnavailableError: the monitor cannot be reached or did not answer in
                time (retryable); the monitor may not have counted the save.
            ObsckptError: the monitor refused the report (its own error, or
                :class:`MonitorCallError`).
        """
        self._get(
            lambda: self.monitor.notify_finished.remote(
                step,
                kind == "state_dict",
                ticket=ticket,
                slot=slot,
                rank=self.rank,
                **_part_kwargs(part, parts),
                **report,
            ),
            f"notify_finished (slot {slot!r}, step {step})",
            self.rpc_timeout,
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
                error=one_line(exc),
                join_wait_s=join_wait,
                admitted=admitted,
            )
        except Exception as report_exc:  # noqa: BLE001 - the monitor may be gone
            logger.error(
                "obsckpt: could not report the failure of %r step %d to the monitor: %s",
                slot,
                step,
                one_line(report_exc),
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
            logger.warning(
                "obsckpt: reporting staging bytes of slot %r failed: %s", slot, one_line(exc)
            )

    # -- a step's calls ------------------------------------------------

    def register_thread_count(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """Register how many saves of each kind ``step`` expects; waits for the monitor."""
        self._get(
            lambda: self._register_thread_count(
                step, state_dict_thread_count, checkpoint_thread_count
            ),
            f"register_thread_count (step {step})",
            self.rpc_timeout,
        )

    async def register_thread_count_async(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """:meth:`register_thread_count`, awaited on the caller's event loop."""
        await self._await(
            self._register_thread_count(step, state_dict_thread_count, checkpoint_thread_count),
            f"register_thread_count (step {step})",
        )

    def monitor_step(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict | None = None
    ) -> None:
        """Submit ``step`` for commit (it commits once its saves finish); waits for the monitor."""
        self._get(
            lambda: self._monitor_step(step, is_state_dict, trace_context),
            f"monitor_step (step {step})",
            self.rpc_timeout,
        )

    async def monitor_step_async(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict | None = None
    ) -> None:
        """:meth:`monitor_step`, awaited on the caller's event loop."""
        await self._await(
            self._monitor_step(step, is_state_dict, trace_context), f"monitor_step (step {step})"
        )

    def latest_steps(self) -> dict[str, int | None]:
        """The monitor's latest committed step of each kind."""
        return self._get(
            lambda: self.monitor.latest_steps.remote(), "latest_steps", self.rpc_timeout
        )

    def status(self) -> dict[str, Any]:
        """The monitor's status view (latest, pending, failed and abandoned steps, ...)."""
        return self._get(lambda: self.monitor.status.remote(), "status", self.rpc_timeout)

    def wait_committed(
        self,
        step: int,
        kind: str,
        timeout_s: float,
        poll_s: float = 0.2,
        on_wait: Callable[[], None] | None = None,
    ) -> tuple[str, str] | None:
        """Poll :meth:`status` until ``step`` of ``kind`` is committed; None once it is.

        Otherwise why it is not: ``("failed", error)``, ``("abandoned", reason)``, or,
        after ``timeout_s`` seconds, ``("timeout", "latest committed: ...; progress:
        ...")``. ``on_wait`` is called once, before the first wait between polls.
        """
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            status = self.status()
            latest = status["latest"].get(kind)
            if latest is not None and latest >= step:
                return None
            failed = [f for f in status["failed"] if f["step"] == step and f["kind"] == kind]
            if failed:
                return "failed", failed[0]["error"]
            abandoned = [a for a in status["abandoned"] if a["step"] == step]
            if abandoned:
                return "abandoned", abandoned[0]["reason"]
            if time.monotonic() >= deadline:
                pending = [p for p in status["pending"] if p["step"] == step]
                return "timeout", f"latest committed: {latest}; progress: {pending}"
            if on_wait is not None and not waited:
                on_wait()
            waited = True
            time.sleep(poll_s)

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
                self._get(
                    lambda t=tickets: self.monitor.heartbeat.remote(t),
                    "heartbeat",
                    self.rpc_timeout,
                )
            except RayShutDownError:
                with self._lock:
                    self._heartbeat = None
                return  # nothing to renew with; a save that ends later fails the same way
            except Exception as exc:  # noqa: BLE001 - the next beat may get through
                logger.warning("obsckpt: heartbeat to the monitor failed: %s", one_line(exc))
