"""CheckpointMonitor: the Ray actor that admits saves, commits whole steps and serves /metrics.

A thin shell: the decisions are :class:`~obsckpt.monitor.core.MonitorCore`'s
(no Ray, no asyncio), the metrics and log lines
:class:`~obsckpt.monitor.telemetry.MonitorTelemetry`'s. The shell owns the
event loop: it awaits admissions, runs each commit's I/O in a thread, checks
leases on a timer, and creates or finds the actor (:meth:`get_actor`). It
keeps Trinity-RFT's RPC names and meanings.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import warnings
from typing import Any

from prometheus_client import CollectorRegistry

from obsckpt import commit, layout, reader, rootlock
from obsckpt.admission import SaveStrategy
from obsckpt.layout import KINDS
from obsckpt.monitor.commit_io import StepWriter, storage_hint
from obsckpt.monitor.core import CommitJob, MonitorCore, validate_rank
from obsckpt.monitor.events import Clock, SystemClock
from obsckpt.monitor.status import status_view
from obsckpt.monitor.telemetry import MonitorTelemetry
from obsckpt.options import (
    DEFAULT_LEASE_TIMEOUT_S,
    MONITOR_ACTOR_NAME,
    MonitorOptions,
    lookup_actor,
)
from obsckpt.telemetry import tracing
from obsckpt.telemetry.metrics import DEFAULT_MAX_SLOT_LABELS, disable_created_series

logger = logging.getLogger("obsckpt.monitor")

# The longest a clean shutdown waits for Prometheus's last scrape: above the shipped
# 10 s scrape interval.
_FINAL_SCRAPE_WAIT_S = 15.0


def _was_restarted() -> bool:
    """True inside an actor that Ray restarted after its process died."""
    try:
        import ray

        with warnings.catch_warnings():
            # Ray's implementation of this property reads a deprecated attribute itself.
            warnings.simplefilter("ignore")
            return (
                ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
            )
    except Exception:  # noqa: BLE001 - outside an actor there is nothing to recover
        return False


def _in_actor() -> bool:
    """True inside a Ray actor (a monitor made in-process never asks Ray about nodes)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:  # noqa: BLE001 - outside Ray there are no nodes to watch
        return False


def _dead_nodes() -> set[str]:
    """Ids of the nodes Ray reports dead (empty when it cannot tell)."""
    try:
        import ray

        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:  # noqa: BLE001 - the next check may get through
        return set()


class CheckpointMonitor:
    """Commits steps once every registered save has finished; one per job.

    Create it with :meth:`get_actor`; the constructor runs inside the actor.
    Its arguments are :class:`~obsckpt.options.MonitorOptions`' fields (see
    there), or ``options=`` one; besides them:

    Args:
        registry: Prometheus registry (tests pass a fresh one).
        options: the options, instead of the keywords they replace.
        clock: the monotonic and wall clocks (default: the system's; tests pass
            their own).
    """

    def __init__(
        self,
        save_strategy: SaveStrategy | str | enum.Enum = SaveStrategy.UNRESTRICTED,
        default_local_dir: str | os.PathLike[str] | None = None,
        default_hdfs_dir: str | None = None,
        *,
        metrics_port: int | None = 0,
        metrics_host: str = "0.0.0.0",
        file_sd_path: str | os.PathLike[str] | None = None,
        namespace: str | None = None,
        trace_exporter: str | None = None,
        registry: CollectorRegistry | None = None,
        lease_timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S,
        max_slot_labels: int = DEFAULT_MAX_SLOT_LABELS,
        options: MonitorOptions | None = None,
        clock: Clock | None = None,
    ) -> None:
        if options is None:
            options = MonitorOptions.from_arguments(
                save_strategy,
                default_local_dir,
                default_hdfs_dir=default_hdfs_dir,
                metrics_port=metrics_port,
                metrics_host=metrics_host,
                file_sd_path=file_sd_path,
                namespace=namespace,
                trace_exporter=trace_exporter,
                lease_timeout_s=lease_timeout_s,
                max_slot_labels=max_slot_labels,
            )
        self.options = options
        # The monitor's process is obsckpt's own: its endpoint serves no *_created series.
        disable_created_series()
        self.strategy = options.save_strategy
        self.lease_timeout_s = options.lease_timeout_s
        self.namespace = options.namespace
        self.default_hdfs_dir = options.default_hdfs_dir
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.root = commit.ensure_root(options.default_local_dir)
        restarted = _was_restarted()
        # Taken before reading the root: what this monitor sees of it is then no
        # other monitor's work in progress (a monitor Ray restarted waits for the
        # lock of the process it replaces; see rootlock).
        self._root_lock = rootlock.acquire(
            self.root,
            namespace=options.namespace,
            wait_s=rootlock.RESTART_WAIT_S if restarted else rootlock.START_WAIT_S,
        )
        try:
            self._start(options, registry, restarted)
        except BaseException:
            self._root_lock.release()
            raise

    def _start(
        self, options: MonitorOptions, registry: CollectorRegistry | None, restarted: bool
    ) -> None:
        latest = {k: reader.read_iteration(self.root, k) for k in KINDS}
        self.telemetry = MonitorTelemetry(self.strategy.value, registry, options.max_slot_labels)
        self.metrics = self.telemetry.metrics
        self.core = MonitorCore(
            self.strategy,
            latest=latest,
            lease_timeout_s=options.lease_timeout_s,
            observer=self.telemetry,
            clock=self.clock,
            restarted=restarted,
            # Saves on a node Ray reports dead are lost, leased or not.
            watch_nodes=_in_actor(),
        )
        self._writer = StepWriter(self.root)
        self.core.mark_found_on_disk(reader.steps_on_disk(self.root))
        # Commits what is ready, one at a time.
        self._committer: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        if restarted:
            for kind, step in latest.items():
                if step is None:
                    continue
                # Ray restarted this monitor within the job: its last commit is the
                # iteration file's, or a stalled job would go unnoticed until the next.
                try:
                    when = os.stat(self.root / layout.ITERATION_FILES[kind]).st_mtime
                except OSError:
                    continue
                # How long ago, by the wall clock (a file from the future: just now).
                self.core.set_last_commit_age(kind, self.clock.time() - when)
        self.telemetry.attach(self.core, latest)
        self.core.settle()
        if tracing.requested(options.trace_exporter):
            tracing.setup_tracing("obsckpt-monitor", exporter=options.trace_exporter)
        self.file_sd_path = options.resolved_file_sd_path()
        self.server = self.telemetry.serve(
            options.metrics_host,
            options.metrics_port,
            file_sd_path=self.file_sd_path,
            namespace=options.namespace,
            root=str(self.root),
        )
        logger.info(
            "obsckpt monitor: root=%s strategy=%s latest=%s metrics=%s",
            self.root,
            self.strategy.name,
            latest,
            self.server.address or self.server.error or "off",
        )

    # The core's parts, for in-process callers and tests.
    @property
    def tracker(self):  # noqa: ANN201 - CommitTracker; typed on MonitorCore
        return self.core.tracker

    @property
    def admission(self):  # noqa: ANN201 - Admission; typed on MonitorCore
        return self.core.admission

    # ------------------------------------------------------------------
    # Creation
    # ------------------------------------------------------------------

    @classmethod
    def get_actor(
        cls,
        namespace: str | None = None,
        save_strategy: SaveStrategy | str | enum.Enum = SaveStrategy.UNRESTRICTED,
        default_local_dir: str | os.PathLike[str] | None = None,
        default_hdfs_dir: str | None = None,
        metrics_port: int | None = 0,
        metrics_host: str = "0.0.0.0",
        *,
        file_sd_path: str | os.PathLike[str] | None = None,
        trace_exporter: str | None = None,
        max_restarts: int = -1,
        lease_timeout_s: float | None = DEFAULT_LEASE_TIMEOUT_S,
        max_slot_labels: int = DEFAULT_MAX_SLOT_LABELS,
    ) -> Any:
        """The job's monitor actor, named ``checkpoint_monitor`` (created if absent).

        Arguments other than ``namespace`` only matter when the actor is created
        (see :class:`~obsckpt.options.MonitorOptions`). Without
        ``default_local_dir`` the running monitor of ``namespace`` is returned (as
        Trinity-RFT's workers ask for it); a ValueError says so when none runs.
        Ray restarts it if its process dies; it recovers the committed steps
        from disk.

        Returns:
            The actor's Ray handle: call its methods with ``.remote()``. Typed
            ``Any``, as Ray's own handle types do not describe this class's methods.

        Raises:
            ValueError: no monitor runs and ``default_local_dir`` is None, one runs
                in the namespace under another root, ``default_hdfs_dir`` is set,
                or an argument is invalid.
            RootInUseError: another job's monitor holds ``default_local_dir`` (an
                ``OSError``; it names the holder's host, pid and namespace).
        """
        import ray

        if default_local_dir is None:
            return lookup_actor(
                MONITOR_ACTOR_NAME,
                namespace,
                hint="default_local_dir (the checkpoint root) is required to create one. "
                "Create it first (the trainer does, with default_local_dir=...) or pass "
                "default_local_dir",
            )
        options = MonitorOptions.from_arguments(
            save_strategy,
            # As the caller sees it: a relative root would otherwise be resolved against
            # the actor's working directory, which on another node is not the caller's.
            os.path.abspath(os.fspath(default_local_dir)),
            default_hdfs_dir=default_hdfs_dir,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            file_sd_path=file_sd_path,
            namespace=namespace,
            trace_exporter=trace_exporter,
            lease_timeout_s=lease_timeout_s,
            max_slot_labels=max_slot_labels,
        )
        root = options.default_local_dir
        # Checked here too, so a bad root fails in the caller, not in a dead actor.
        commit.ensure_root(root)
        try:
            ray.get_actor(MONITOR_ACTOR_NAME, namespace=namespace or None)
        except ValueError:
            # None runs in this namespace: a monitor holding the root is another job's
            # (or one this job just killed, whose process is ending).
            rootlock.check_free(root, wait_s=rootlock.START_WAIT_S)
        actor_options: dict[str, Any] = dict(
            name=MONITOR_ACTOR_NAME,
            get_if_exists=True,
            max_restarts=max_restarts,
            max_concurrency=10_000,
            num_cpus=0,
        )
        if namespace:
            actor_options["namespace"] = namespace
        monitor: Any = ray.remote(cls).options(**actor_options).remote(options=options)
        # get_if_exists hands back a monitor already running under the name, whatever
        # its root: this job's steps would then be committed (or never) under another
        # root, with nothing said. Waiting for the answer also surfaces a monitor that
        # failed to start here rather than at the first save.
        try:
            running: str = ray.get(monitor.checkpoint_root.remote())
        except ray.exceptions.RayActorError:
            # Its constructor failed; the likeliest cause, another job's monitor that
            # took the root since the check above, gets its own error.
            rootlock.check_free(root)
            raise
        if os.path.realpath(running) != os.path.realpath(root):
            where = f"namespace {namespace!r}" if namespace else "this job's namespace"
            raise ValueError(
                f"a {MONITOR_ACTOR_NAME} actor already runs in {where} with checkpoint root "
                f"{running!r}, not default_local_dir={root!r}; it commits only "
                "steps under its own root. Give this job a Ray namespace of its own "
                "(namespace=...), or pass the same default_local_dir"
            )
        return monitor

    # ------------------------------------------------------------------
    # Trinity's RPCs
    # ------------------------------------------------------------------

    async def register_thread_count(
        self, step: int, *, state_dict_thread_count: int = 0, checkpoint_thread_count: int = 0
    ) -> None:
        """Expect this many more saves of each kind for ``step`` (ignored for a closed step)."""
        self.core.register(
            step, state_dict_count=state_dict_thread_count, checkpoint_count=checkpoint_thread_count
        )
        await self._commit_ready_steps()

    async def monitor_step(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict[str, str] | None = None
    ) -> None:
        """Mark ``step`` as submitted; it commits once its saves are all finished.

        Submitting a step that is already committed, or older than the committed
        one, changes nothing (logged).
        """
        kind = layout.kind_of(is_state_dict)
        try:
            self.core.submit(step, kind, carrier=trace_context)
        finally:
            await self._commit_ready_steps()

    async def notify_started(
        self,
        node_id: str | None = None,
        job_id: str | None = None,
        *,
        step: int | None = None,
        slot: str | None = None,
        kind: str | None = None,
        rank: int | None = None,
        pid: int | None = None,
        trace_context: dict[str, str] | None = None,
        lease: bool = False,
        part: int | None = None,
        parts: int | None = None,
        unless_closed: bool = False,
    ) -> dict[str, Any]:
        """Admit a save under the strategy; returns once it may run.

        Trinity's callers pass only ``node_id`` and ``job_id``; obsckpt's
        coordinator also passes the step, slot, kind and rank, and gets back
        a ticket to hand to :meth:`notify_finished`. With ``lease=True`` the
        caller promises a :meth:`heartbeat` every ``heartbeat_s`` seconds; a save
        whose heartbeats stop for ``lease_timeout_s`` is failed.

        ``part`` and ``parts`` (with ``step``) make this save part ``part`` of a
        save of ``slot`` made of ``parts`` parts, e.g. one per rank: each part
        is admitted, leased and reported on its own, and the step counts the
        save as finished once every part has finished ok. A part that is its
        rank's (``part == rank``) also tells the slot's world size: the metric
        series of the slot's ranks at or above ``parts`` are removed.

        With ``unless_closed=True`` a save of a step already closed for its kind
        (committed, being committed, or below the committed step) is not
        admitted: the reply is ``{"skipped": True, "latest": <committed step>}``,
        no ticket, and the caller must not write. Decided here, in the order
        the RPCs arrive, it gives every rank of one save the same answer for a
        step that closes while they save.

        Raises:
            PartsMismatchError: ``parts`` differs from an earlier part's (the step fails).
        """
        try:
            ticket = self.core.start(
                node_id=node_id,
                step=step,
                slot=slot,
                kind=kind,
                rank=rank,
                pid=pid,
                carrier=trace_context,
                lease=lease,
                part=part,
                parts=parts,
                unless_closed=unless_closed,
            )
        except Exception:
            await self._commit_ready_steps()
            raise
        if ticket is None:
            return {"skipped": True, "latest": self.core.tracker.latest[kind or "checkpoint"]}
        await self._wait_admission(ticket, job_id)
        reply = self.core.admitted(ticket)
        if self.core.needs_watch(ticket):
            self._ensure_reaper()
        await self._commit_ready_steps()
        return reply

    async def _wait_admission(self, ticket: Any, job_id: str | None) -> None:
        """Until the save strategy admits ``ticket``'s save."""
        admitted = asyncio.get_running_loop().create_future()

        # A wait cancelled before its handler has run is released by that handler;
        # the grant must not raise into the release that made it (another save's finish).
        def grant() -> None:
            if not admitted.done():
                admitted.set_result(None)

        if self.core.request_admission(ticket, job_id, grant):
            return
        try:
            await admitted
        except asyncio.CancelledError:
            # The caller gave up waiting (its RPC was cancelled): the save will not
            # run. Nothing of it may stay behind, and its step cannot be whole.
            self.core.gave_up(ticket)
            if ticket.step is not None:
                await self._commit_ready_steps()
            raise

    async def heartbeat(self, tickets: list[int]) -> None:
        """Saves with these tickets are still running (their process is alive)."""
        self.core.heartbeat(tickets)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._check_leases())

    async def _check_leases(self) -> None:
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
                gone = await asyncio.to_thread(_dead_nodes)
                expired += self.core.expire_on_nodes(gone)
            if expired:
                await self._commit_ready_steps()

    async def notify_finished(
        self,
        step: int,
        is_state_dict: bool = False,
        *,
        ticket: int | None = None,
        slot: str | None = None,
        rank: int | None = None,
        ok: bool = True,
        error: str | None = None,
        duration_s: float | None = None,
        nbytes: int | None = None,
        join_wait_s: float | None = None,
        files: list[dict[str, Any]] | None = None,
        part: int | None = None,
        parts: int | None = None,
        admitted: bool = True,
    ) -> None:
        """A save ended, successfully (``ok``) or not; never leaves the step waiting.

        A part of a save (see :meth:`notify_started`) passes the same ``part``
        and ``parts`` again; its ticket's are used when the ticket is known.
        ``admitted=False`` (with ``ok=False``) reports a save that failed before
        it asked for admission, e.g. its snapshot could not be taken: it
        releases no ticket, and the step it was registered for fails.
        """
        try:
            self.core.finish(
                step,
                layout.kind_of(is_state_dict),
                ticket=ticket,
                slot=slot,
                rank=rank,
                ok=ok,
                error=error,
                duration_s=duration_s,
                nbytes=nbytes,
                join_wait_s=join_wait_s,
                files=files,
                part=part,
                parts=parts,
                admitted=admitted,
            )
        finally:
            await self._commit_ready_steps()

    # ------------------------------------------------------------------
    # Commit
    # ------------------------------------------------------------------

    async def _commit_ready_steps(self) -> None:
        """Commit what became ready; returns when nothing more is (or another call commits)."""
        if self._committer is not None and not self._committer.done():
            # The running committer asks what is ready again before it ends (with no
            # await in between), so nothing is missed; waiting here would only hold
            # admissions behind commit I/O.
            self.core.settle()
            return
        if not self.core.tracker.ready():
            # Nothing is whole (most notifications): no commit task, no trip through
            # the event loop on every RPC.
            self.core.settle()
            return
        self._committer = asyncio.get_running_loop().create_task(self._commit_in_order())
        # Shielded: a cancelled RPC must not stop a commit halfway (its step would
        # stay "committing" for ever); the commit runs to its end on its own.
        await asyncio.shield(self._committer)

    async def _commit_in_order(self) -> None:
        try:
            # One commit at a time, each chosen as it starts: notifications arrive
            # during a commit's I/O, and a step ready before it may have a new save
            # in flight, or a failed one, by then.
            while (job := self.core.begin_next_commit()) is not None:
                await self._commit(job)
        finally:
            self.core.settle()

    async def _commit(self, job: CommitJob) -> None:
        """Commit ``job``'s step, which the core has just marked committing."""
        step, kind = job.step, job.kind
        if job.saves == 0 and not self._writer.has_step_dir(step):
            # An iteration file must never name a step that is not on disk.
            self.core.commit_failed(
                job,
                f"step {step} ({kind}) was submitted with no saves and has no directory: "
                "nothing to commit (register its saves with register_thread_count first)",
            )
            return
        attrs = {"obsckpt.step": step, "obsckpt.kind": kind}
        phases: dict[str, float] = {}
        try:
            with tracing.span("obsckpt.commit", carrier=job.record.carrier, attributes=attrs):
                files = self.core.commit_files(job)
                await asyncio.to_thread(self._writer.write, step, kind, files, phases)
        except Exception as exc:  # noqa: BLE001 - a failed commit fails the step, not the monitor
            msg = f"commit of step {step} ({kind}) failed: {exc}"
            if isinstance(exc, OSError):
                latest = self.core.tracker.latest[kind]
                msg += (
                    f"; it is not committed and {layout.ITERATION_FILES[kind]} still names "
                    f"{'no step' if latest is None else f'step {latest}'}. "
                    + storage_hint(exc, self.root)
                )
            self.core.commit_failed(job, msg)
            return
        self.core.commit_done(job, phases)

    # ------------------------------------------------------------------
    # Weight-sync measurements (the monitor is the job's one scrape target)
    # ------------------------------------------------------------------

    async def record_broadcast(
        self, backend: str, seconds: float, nbytes: int, method: str = "broadcast"
    ) -> None:
        self.telemetry.record_broadcast(backend, seconds, nbytes, method)

    async def record_broadcast_failure(self, backend: str, method: str, reason: str) -> None:
        self.telemetry.record_broadcast_failure(backend, method, reason)

    async def record_staging(
        self,
        *,
        rank: int | None,
        slot: str,
        nbytes: int,
        pinned_bytes: int,
        cold: bool = False,
        pid: int | None = None,
    ) -> None:
        """A worker's staging for ``slot`` changed (allocated, resized or released).

        ``pid``, the worker's process id, is the process whose death (a lease that
        expires, a node that dies) removes ``rank``'s series, as the pid passed to
        :meth:`notify_started` is.
        """
        self.telemetry.record_staging(
            rank=validate_rank(rank),
            slot=slot,
            nbytes=nbytes,
            pinned_bytes=pinned_bytes,
            cold=cold,
            pid=pid,
        )

    async def record_upload(self, seconds: float) -> None:
        self.telemetry.record_upload(seconds)

    async def record_model_version(self, role: str, version: int) -> None:
        self.telemetry.record_model_version(role, version)

    # ------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------

    async def latest_steps(self) -> dict[str, int | None]:
        """The latest committed step of each kind (``checkpoint``, ``state_dict``)."""
        return dict(self.core.tracker.latest)

    async def metrics_address(self) -> str | None:
        """``host:port`` of /metrics, or None when not served (see status() for why)."""
        return self.server.address

    async def checkpoint_root(self) -> str:
        """The directory this monitor commits steps under (``default_local_dir``)."""
        return str(self.root)

    async def status(self) -> dict[str, Any]:
        """Latest committed steps, pending, failed and abandoned steps, saves in flight.

        ``resaves`` counts the notifications about closed steps that changed
        nothing: re-saves, and registrations, submissions and finishes for a step
        already committed (or below the committed one) that were ignored.
        """
        return status_view(self.core, self.root, self.server)

    async def debug_spans(self) -> list[dict[str, Any]]:
        """Spans this process recorded with the ``memory`` exporter (for tests)."""
        return tracing.finished_spans()

    async def shutdown(self) -> None:
        """Stop serving /metrics, withdraw the file_sd target and unlock the root.

        End the actor with ray.kill afterwards.

        Only this monitor's entry leaves the file_sd file: other jobs' monitors,
        and one started since on this root, keep theirs.
        """
        # Once the job is done another job may use the root (ray.kill, or the
        # process's end, would drop the lock too).
        self._root_lock.release()
        await asyncio.to_thread(self.telemetry.close, self.clock.time(), _FINAL_SCRAPE_WAIT_S)
