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
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from obsckpt.admission import Admission, SaveStrategy
from obsckpt.errors import RootLockLostError
from obsckpt.monitor.commit_io import CommitRunner
from obsckpt.monitor.core import MonitorCore
from obsckpt.monitor.events import Clock, SystemClock
from obsckpt.monitor.lease_watch import LeaseWatch
from obsckpt.monitor.lifecycle import (
    DeadNodes,
    commit_writer,
    in_actor,
    read_root,
    recover_last_commits,
    start_actor,
    was_restarted,
)
from obsckpt.monitor.measurements import MeasurementRPCs
from obsckpt.monitor.mirror import SettleRPC, StepMirror, start_mirror, take_mirror
from obsckpt.monitor.s3_commit import S3Ownership
from obsckpt.monitor.status import status_view
from obsckpt.monitor.telemetry import MonitorTelemetry, file_sd_root_label
from obsckpt.options import (
    DEFAULT_LEASE_TIMEOUT_S,
    MONITOR_ACTOR_NAME,
    MonitorOptions,
    lookup_actor,
)
from obsckpt.store import commit, layout, reader, rootlock
from obsckpt.store.s3root import S3Root, open_s3_root
from obsckpt.store.uri import is_remote
from obsckpt.telemetry import tracing
from obsckpt.telemetry.metrics import DEFAULT_MAX_SLOT_LABELS, Metrics, disable_created_series
from obsckpt.tickets import Ticket
from obsckpt.tracker import CommitTracker

logger = logging.getLogger("obsckpt.monitor")

# The longest a clean shutdown waits for Prometheus's last scrape: above the shipped
# 10 s scrape interval.
_FINAL_SCRAPE_WAIT_S = 15.0
# The longest a shutdown waits for a running commit before it releases the root (that
# commit is then refused at its rename: the root may have another owner by then).
_COMMIT_DRAIN_S = 30.0
# The longest status() waits to check the root's lock file (a hung filesystem).
_FENCE_CHECK_S = 5.0
# The longest a shutdown waits for the mirror's copies of the steps committed last.
_MIRROR_DRAIN_S = 60.0


class CheckpointMonitor(MeasurementRPCs, SettleRPC):
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
        on_bad_iteration: str = "refuse",
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
                on_bad_iteration=on_bad_iteration,
            )
        self.options = options
        # The monitor's process is obsckpt's own: its endpoint serves no *_created series.
        disable_created_series()
        self.strategy = options.save_strategy
        self.lease_timeout_s = options.lease_timeout_s
        self.namespace = options.namespace
        self.default_hdfs_dir = options.default_hdfs_dir
        self.clock: Clock = clock if clock is not None else SystemClock()
        restarted = was_restarted()
        self.store: S3Root | None = None
        self.mirror: StepMirror | None = None
        self.root: Path | str
        if is_remote(options.default_local_dir):
            # An s3:// root: owned by moving its pointer to a new epoch (which fences
            # the monitor before), once the endpoint is known to enforce conditional writes.
            self.store = open_s3_root(options.default_local_dir)
            self.root = self.store.url
            self._root_lock: Any = S3Ownership(self.store, options.namespace)
        else:
            self.root = commit.ensure_root(options.default_local_dir)
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
        # Taken (and restored from, into a root with no committed step) before the root
        # is read: the restored steps are then this root's committed ones.
        mirror = take_mirror(options.mirror, self.root, options.namespace, restarted=restarted)
        # The committed steps, after the start's checks and sweep of the root.
        latest, self.iteration_repairs, self.leftovers_removed, self.uploads_aborted = read_root(
            self.root, self.store, self._root_lock, options.on_bad_iteration, restarted
        )
        self.telemetry = MonitorTelemetry(self.strategy.value, registry, options.max_slot_labels)
        self.telemetry.leftovers_swept(self.root, self.leftovers_removed + self.uploads_aborted)
        # A save's time and bytes are its upload's on an s3:// root (not to a mirror).
        self.telemetry.store_root = self.store is not None
        if self.store is not None:
            self.telemetry.watch_store(self.store)
        self.mirror = start_mirror(mirror, self.root, self.telemetry, options.keep_steps, latest)
        self.core = MonitorCore(
            self.strategy,
            latest=latest,
            lease_timeout_s=options.lease_timeout_s,
            observer=self.telemetry,
            clock=self.clock,
            restarted=restarted,
            # Saves on a node Ray reports dead are lost, leased or not.
            watch_nodes=in_actor(),
        )
        # Commits what is ready, one at a time, each proving first that this monitor
        # still owns the root (the lock's fence).
        writer = commit_writer(
            self.root, self._root_lock, self.store, self.telemetry, options.keep_steps, self.mirror
        )
        self._committer = CommitRunner(self.core, writer, phases=self.telemetry, clock=self.clock)
        self.telemetry.attach_fence(lambda: self._root_lock.lost)
        # Between commits too: a lock file deleted while the job runs is made anew.
        self._root_lock.watch()
        self.core.mark_found_on_disk(
            reader.steps_on_disk(self.root) if self.store is None else self.store.steps()
        )
        self._dead_nodes = DeadNodes(on_failure=self.telemetry.node_query_failed)
        self._lease_watch = LeaseWatch(self.core, self._commit_ready_steps, self._dead_nodes)
        if restarted and self.store is None:
            # Ray restarted this monitor within the job: its last commit is the
            # iteration file's, or a stalled job would go unnoticed until the next.
            recover_last_commits(self.core, self.root, latest)
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
            root=file_sd_root_label(options.default_local_dir),  # as its starter names it
        )
        logger.info(
            "obsckpt monitor: root=%s strategy=%s latest=%s metrics=%s",
            self.root,
            self.strategy.name,
            latest,
            self.server.address or self.server.error or "off",
        )

    @property
    def metrics(self) -> Metrics:
        """The monitor's metric objects (its telemetry's)."""
        return self.telemetry.metrics

    @metrics.setter
    def metrics(self, metrics: Metrics) -> None:
        # Replaceable, e.g. by no-op metrics to time the monitor without telemetry.
        self.telemetry.metrics = metrics

    # The core's parts, for in-process callers and tests.
    @property
    def tracker(self) -> CommitTracker:
        return self.core.tracker

    @property
    def admission(self) -> Admission:
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
        on_bad_iteration: str = "refuse",
        trainer_submits: bool = False,
        keep_steps: int | None = None,
        mirror: str | None = None,
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
            # Made absolute here, as the caller sees it (MonitorOptions does, refusing a
            # URL): against the actor's working directory, on another node, it would not be.
            default_local_dir,
            default_hdfs_dir=default_hdfs_dir,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            file_sd_path=file_sd_path,
            namespace=namespace,
            trace_exporter=trace_exporter,
            lease_timeout_s=lease_timeout_s,
            max_slot_labels=max_slot_labels,
            on_bad_iteration=on_bad_iteration,
            trainer_submits=trainer_submits,
            keep_steps=keep_steps,
            mirror=mirror,
        )
        return start_actor(cls, options, max_restarts=max_restarts)

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
        admitted: the reply is ``{"skipped": True, "latest": <committed step>,
        "settled": <bool>}``, no ticket, and the caller must not write;
        ``settled`` says that no other save of the step is on its way (see
        :meth:`MonitorCore.settled`), so files its manifest does not list are
        strays. Decided here, in the order the RPCs arrive, it gives every rank
        of one save the same answer for a step that closes while they save.

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
            if step is not None and self.core.committing(step):
                # Whether the host left strays is known once the commit has listed
                # the directory: the skipped save waits for it (nothing waits on it).
                await self._committer.wait_idle(3 * commit.FSYNC_TIMEOUT_S)  # its 3 rounds
            return {
                "skipped": True,
                "latest": self.core.tracker.latest[kind or "checkpoint"],
                "settled": step is not None and self.core.settled(step),
            }
        await self._wait_admission(ticket, job_id)
        reply = self.core.admitted(ticket)
        if self.core.needs_watch(ticket):
            self._lease_watch.ensure_running()
        await self._commit_ready_steps()
        return reply

    async def _wait_admission(self, ticket: Ticket, job_id: str | None) -> None:
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
        await self._committer.commit_ready()

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
        # A lock file deleted or replaced while no commit ran is found here too.
        try:
            await asyncio.wait_for(asyncio.to_thread(self._root_lock.check), _FENCE_CHECK_S)
        except (RootLockLostError, TimeoutError):
            pass  # shown below as "fenced" (a check that hung shows nothing new)
        view = status_view(
            self.core,
            self.root,
            self.server,
            leftovers_removed=len(self.leftovers_removed),
            fenced=self._root_lock.lost,
            lock_recreated=self._root_lock.recreated,
            committing=self._committer.progress.current(),
            node_queries_failed=self._dead_nodes.failures,
            iteration_repairs=self.iteration_repairs,
            trainer_submits=self.options.trainer_submits,
        )
        # The s3:// root that keeps a copy of this root's committed steps (None: none).
        view["mirror"] = None if self.mirror is None else self.mirror.status()
        return view

    async def debug_spans(self) -> list[dict[str, Any]]:
        """Spans this process recorded with the ``memory`` exporter (for tests)."""
        return tracing.finished_spans()

    async def shutdown(self, final_scrape_wait_s: float | None = None) -> None:
        """Stop serving /metrics, withdraw the file_sd target and unlock the root.

        ``final_scrape_wait_s``: the longest wait for a polling scraper's last scrape
        (default 15 s); a stop on a signal, which must end within seconds, gives less.

        End the actor with ray.kill afterwards. From the release on, this monitor
        commits nothing: a step that becomes whole later fails, its iteration file
        unmoved, and status() says ``fenced``.

        Only this monitor's entry leaves the file_sd file: other jobs' monitors,
        and one started since on this root, keep theirs.
        """
        # Once the job is done another job may use the root (ray.kill, or the
        # process's end, would drop the lock too). A commit still running is given
        # a while to end; after the release, every commit is refused at its rename.
        if not await self._committer.wait_idle(_COMMIT_DRAIN_S):
            logger.warning(
                "obsckpt monitor: a commit still runs %.0f s into shutdown (%s); releasing "
                "the root anyway: that commit will be refused before its rename",
                _COMMIT_DRAIN_S,
                self._committer.progress.current(),
            )
        if self.mirror is not None:
            await asyncio.to_thread(self.mirror.close, _MIRROR_DRAIN_S)
        self._root_lock.release()
        wait_s = _FINAL_SCRAPE_WAIT_S if final_scrape_wait_s is None else final_scrape_wait_s
        await asyncio.to_thread(self.telemetry.close, self.clock.time(), wait_s)
