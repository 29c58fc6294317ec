"""CheckpointMonitor: the Ray actor that admits saves, commits whole steps and serves /metrics.

A thin shell around :class:`obsckpt.tracker.CommitTracker` (the state
machine) and :class:`obsckpt.admission.Admission` (the save strategy). It
keeps Trinity-RFT's RPC names and meanings, and adds what a crash-safe,
observable job needs: failures reported as finishes, durable commits,
measurements with every notification, status(), /metrics and file_sd.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

from obsckpt import commit, layout, reader, rootlock, validators
from obsckpt.admission import Admission, SaveStrategy
from obsckpt.errors import PartsMismatchError
from obsckpt.layout import KINDS, FileRecord
from obsckpt.telemetry import tracing
from obsckpt.telemetry.metrics import (
    DEFAULT_MAX_SLOT_LABELS,
    OVERFLOW_SLOT,
    RESULTS,
    Metrics,
    RankSeries,
    SlotLabels,
    check_bytes,
    check_role,
    check_seconds,
    check_sync_labels,
    validate_max_slot_labels,
)
from obsckpt.telemetry.server import (
    publish_file_sd,
    serve_metrics,
    validate_port,
    withdraw_file_sd,
)
from obsckpt.tickets import Ticket, Tickets
from obsckpt.tracker import CommitTracker, Progress, validate_parts
from obsckpt.validators import validate_step

logger = logging.getLogger(__name__)

ACTOR_NAME = "checkpoint_monitor"
FILE_SD_ENV = "OBSCKPT_FILE_SD_PATH"
# The longest a clean shutdown waits for Prometheus's last scrape: above the shipped
# 10 s scrape interval.
_FINAL_SCRAPE_WAIT_S = 15.0


def wall_clock() -> float:
    """Unix time, read only to show a time as a timestamp (status(), *_timestamp_seconds).

    Durations, leases and ages are measured on the monitor's monotonic clock
    (its tracker's): a step of the system clock (NTP, a VM resumed) moves this
    one and would otherwise expire healthy leases or keep dead ones alive.
    """
    return time.time()


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


def _refuse_hdfs(default_hdfs_dir: object) -> None:
    if default_hdfs_dir is not None:
        raise ValueError(
            f"default_hdfs_dir={default_hdfs_dir!r} is not supported: obsckpt does not upload "
            "committed steps to remote storage. Pass default_hdfs_dir=None and copy a "
            "global_step_<N> directory once latest_checkpointed_iteration.txt names it"
        )


def _label(value: object, default: str = "unknown") -> str:
    return default if value is None else str(value)


def _checked_rank(rank: object) -> int | None:
    """``rank`` as an int (None stays None): its label must be one of a bounded set."""
    if rank is None:
        return None
    value = validators.non_negative_int(rank)
    if value is None:
        raise ValueError(
            f"rank must be a non-negative integer (the reporting process's rank) or None, "
            f"got {rank!r}"
        )
    return value


def _storage_hint(exc: OSError, root: str | os.PathLike[str]) -> str:
    """What to do about a commit that failed on the storage, by its cause."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"Free space (or inodes) on the filesystem of {root}"
    elif exc.errno == errno.EROFS:
        what = f"Remount the filesystem of {root} read-write"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        what = f"Let this process create files in {root} and its step directories"
    elif exc.errno == errno.ENOENT:
        what = f"Leave the step directories under {root} in place until they are committed"
    else:
        what = f"Check the filesystem of {root}"
    return f"{what}; the next step commits once it can be written"


class CheckpointMonitor:
    """Commits steps once every registered save has finished; one per job.

    Create it with :meth:`get_actor`; the constructor runs inside the actor.

    Args:
        save_strategy: a :class:`SaveStrategy`, its name or value, or another enum
            naming one (e.g. Trinity-RFT's own), governing admission.
        default_local_dir: the checkpoint root holding the iteration files.
        default_hdfs_dir: must be None: uploading committed steps to remote storage is
            not supported (a ValueError says so rather than ignoring it).
        metrics_port: port for /metrics; 0 picks a free one, None serves nothing.
        metrics_host: interface to bind; a wildcard advertises the node's IP.
        file_sd_path: where to write a Prometheus file_sd JSON naming the endpoint
            (default: the ``OBSCKPT_FILE_SD_PATH`` variable, else none).
        namespace: the job's Ray namespace, written as a label into file_sd.
        trace_exporter: exporter name for this process's spans (default: ``OTEL_*``
            variables; no tracing unless one of them asks for it).
        registry: Prometheus registry (tests pass a fresh one).
        lease_timeout_s: a save whose coordinator sends no heartbeat for this long
            (its process died) is failed and its admission released; None never
            expires a save.
        max_slot_labels: distinct slot names kept as the ``slot`` label of the
            metrics; saves of later new slots are recorded as ``slot="_other"``
            (logged once, counted in ``obsckpt_slot_label_overflows_total``).
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
        lease_timeout_s: float | None = 120.0,
        max_slot_labels: int = DEFAULT_MAX_SLOT_LABELS,
    ) -> None:
        validate_max_slot_labels(max_slot_labels)
        if lease_timeout_s is not None and not validators.positive_seconds(lease_timeout_s):
            raise ValueError(
                f"lease_timeout_s must be positive seconds or None, got {lease_timeout_s!r}"
            )
        self.lease_timeout_s = lease_timeout_s
        self._reaper: asyncio.Task[None] | None = None
        if default_local_dir is None:
            raise ValueError("default_local_dir is required: the checkpoint root directory")
        _refuse_hdfs(default_hdfs_dir)
        self.strategy = SaveStrategy.parse(save_strategy)
        validate_port(metrics_port)
        self.root = commit.ensure_root(default_local_dir)
        restarted = _was_restarted()
        # Taken before reading the root: what this monitor sees of it is then no
        # other monitor's work in progress (a monitor Ray restarted waits for the
        # lock of the process it replaces; see rootlock).
        self._root_lock = rootlock.acquire(
            self.root,
            namespace=namespace,
            wait_s=rootlock.RESTART_WAIT_S if restarted else rootlock.START_WAIT_S,
        )
        try:
            self.default_hdfs_dir = default_hdfs_dir
            self.namespace = namespace
            latest = {k: reader.read_iteration(self.root, k) for k in KINDS}
            self.metrics = Metrics(registry)
            # Bounds on the label values callers send: slot names, and ranks that are gone.
            self._slot_labels = SlotLabels(max_slot_labels, self.metrics.slot_label_overflows)
            self._rank_series = RankSeries(
                self.metrics.rank_last_save_duration,
                self.metrics.staging_bytes,
                self.metrics.staging_pinned_bytes,
            )
            # Every step that fails, on whatever path, is counted here once.
            self.tracker = CommitTracker(
                latest, on_fail=lambda _step, kind: self.metrics.step_failures.labels(kind).inc()
            )
            self.tracker.restarted = restarted
            # Whether this process sees the step directories the workers write: then a
            # step directory missing at commit was removed, not written on another node.
            self._sees_step_dirs = bool(reader.steps_on_disk(self.root))
            self._mark_abandoned_on_disk()
            self.admission = Admission(self.strategy)
            self._tickets = Tickets()
            # Saves on a node Ray reports dead are lost, leased or not (a Trinity caller's is not).
            self._watch_nodes = _in_actor()
            # Commits what is ready, one at a time.
            self._committer: asyncio.Task[None] | None = None
            # When each kind last committed, and when its oldest pending step started:
            # readings of the monotonic clock (_now), shown as Unix time by _unix.
            self._last_commit: dict[str, float | None] = {k: None for k in KINDS}
            self._oldest_pending: dict[str, float | None] = {k: None for k in KINDS}
            # When the last committed step became whole and how long its commit I/O took.
            self._last_commit_detail: dict[str, dict[str, Any]] = {}
            self._setup_tracing(trace_exporter)
            self._gauges_shown: tuple[Any, ...] | None = None  # what _refresh_gauges last set
            # (slot label, kind) with both results' series.
            self._save_series: set[tuple[str, str | None]] = set()
            # Rank -> pid of the process that last reported as it: the one whose death
            # makes the rank's series stale (a replacement may already have taken over).
            self._rank_pids: dict[int, int | None] = {}
            for kind, step in latest.items():
                if step is not None:
                    self.metrics.latest_step.labels(kind).set(step)
                    if not self.tracker.restarted:
                        continue  # a new job (perhaps resumed): its first commit is to come
                    # Ray restarted this monitor within the job: its last commit is the
                    # iteration file's, or a stalled job would go unnoticed until the next.
                    try:
                        when = os.stat(self.root / layout.ITERATION_FILES[kind]).st_mtime
                    except OSError:
                        continue
                    # How long ago, by the wall clock (a file from the future: just now).
                    self._last_commit[kind] = self._now() - max(0.0, wall_clock() - when)
            for kind in KINDS:
                # Worked out at each scrape: after a step of the wall clock, Prometheus's
                # time() minus these is still how long ago they were.
                self.metrics.last_commit_timestamp.labels(kind).set_function(
                    lambda k=kind: self._unix(self._last_commit[k]) or 0.0
                )
                self.metrics.oldest_pending_start.labels(kind).set_function(
                    lambda k=kind: self._unix(self._oldest_pending[k]) or 0.0
                )
            self._refresh_gauges()
            self.server = serve_metrics(self.metrics.registry, metrics_host, metrics_port)
            self.file_sd_path = file_sd_path or os.environ.get(FILE_SD_ENV) or None
            self._file_sd_labels = {"obsckpt_namespace": namespace} if namespace else {}
            if self.file_sd_path:
                try:
                    gone = publish_file_sd(
                        self.file_sd_path,
                        self.server.address,
                        self._file_sd_labels,
                        root=str(self.root),
                    )
                except OSError as exc:
                    logger.error("obsckpt: cannot write file_sd %s: %s", self.file_sd_path, exc)
                else:
                    if gone:
                        logger.warning(
                            "obsckpt: removed %s from file_sd %s: nothing listens there "
                            "(monitors that ended without withdrawing their targets)",
                            ", ".join(gone),
                            self.file_sd_path,
                        )
            logger.info(
                "obsckpt monitor: root=%s strategy=%s latest=%s metrics=%s",
                self.root,
                self.strategy.name,
                latest,
                self.server.address or self.server.error or "off",
            )
        except BaseException:
            self._root_lock.release()
            raise

    def _now(self) -> float:
        """The monitor's monotonic clock: its tracker's, so steps' times and its own compare."""
        return self.tracker.clock()

    def _unix(self, t: float | None) -> float | None:
        """``t``, a reading of :meth:`_now`, as Unix time by the wall clock now (None stays).

        Converted when shown, not stamped when it happened, so that a step of the
        wall clock in between does not change how long ago it reads.
        """
        return None if t is None else wall_clock() - (self._now() - t)

    @staticmethod
    def _setup_tracing(trace_exporter: str | None) -> None:
        if tracing.requested(trace_exporter):
            tracing.setup_tracing("obsckpt-monitor", exporter=trace_exporter)

    def _mark_abandoned_on_disk(self) -> None:
        latest = self.tracker.latest["checkpoint"]
        latest_sd = self.tracker.latest["state_dict"]
        floor = max((s for s in (latest, latest_sd) if s is not None), default=-1)
        for step in reader.steps_on_disk(self.root):
            if step > floor:
                self.tracker.mark_abandoned(
                    step, "on disk but never committed (found when the monitor started)"
                )

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
        lease_timeout_s: float | None = 120.0,
        max_slot_labels: int = DEFAULT_MAX_SLOT_LABELS,
    ) -> Any:
        """The job's monitor actor, named ``checkpoint_monitor`` (created if absent).

        Arguments other than ``namespace`` only matter when the actor is created.
        Without ``default_local_dir`` the running monitor of ``namespace`` is
        returned (as Trinity-RFT's workers ask for it); a ValueError says so when
        none runs. Ray restarts it if its process dies; it recovers the committed
        steps from disk.

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
            try:
                return ray.get_actor(ACTOR_NAME, namespace=namespace or None)
            except ValueError:
                where = f"namespace {namespace!r}" if namespace else "this job's namespace"
                raise ValueError(
                    f"no {ACTOR_NAME} actor runs in {where}, and default_local_dir (the "
                    "checkpoint root) is required to create one. Create it first (the "
                    "trainer does, with default_local_dir=...) or pass default_local_dir"
                ) from None
        strategy = SaveStrategy.parse(save_strategy)
        validate_port(metrics_port)
        validate_max_slot_labels(max_slot_labels)
        _refuse_hdfs(default_hdfs_dir)
        # As the caller sees it: a relative root would otherwise be resolved against the
        # actor's working directory, which on another node is not the caller's.
        default_local_dir = os.path.abspath(os.fspath(default_local_dir))
        # Checked here too, so a bad root fails in the caller, not in a dead actor.
        commit.ensure_root(default_local_dir)
        try:
            ray.get_actor(ACTOR_NAME, namespace=namespace or None)
        except ValueError:
            # None runs in this namespace: a monitor holding the root is another job's
            # (or one this job just killed, whose process is ending).
            rootlock.check_free(default_local_dir, wait_s=rootlock.START_WAIT_S)
        remote_cls = ray.remote(cls)
        options: dict[str, Any] = dict(
            name=ACTOR_NAME,
            get_if_exists=True,
            max_restarts=max_restarts,
            max_concurrency=10_000,
            num_cpus=0,
        )
        if namespace:
            options["namespace"] = namespace
        monitor: Any = remote_cls.options(**options).remote(
            strategy,
            default_local_dir,
            default_hdfs_dir,
            metrics_port=metrics_port,
            metrics_host=metrics_host,
            file_sd_path=os.fspath(file_sd_path) if file_sd_path else None,
            namespace=namespace,
            trace_exporter=trace_exporter,
            lease_timeout_s=lease_timeout_s,
            max_slot_labels=max_slot_labels,
        )
        # get_if_exists hands back a monitor already running under the name, whatever
        # its root: this job's steps would then be committed (or never) under another
        # root, with nothing said. Waiting for the answer also surfaces a monitor that
        # failed to start here rather than at the first save.
        try:
            running: str = ray.get(monitor.checkpoint_root.remote())
        except ray.exceptions.RayActorError:
            # Its constructor failed; the likeliest cause, another job's monitor that
            # took the root since the check above, gets its own error.
            rootlock.check_free(default_local_dir)
            raise
        if os.path.realpath(running) != os.path.realpath(default_local_dir):
            where = f"namespace {namespace!r}" if namespace else "this job's namespace"
            raise ValueError(
                f"a {ACTOR_NAME} actor already runs in {where} with checkpoint root "
                f"{running!r}, not default_local_dir={default_local_dir!r}; it commits only "
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
        notes = self.tracker.register(
            step, state_dict_count=state_dict_thread_count, checkpoint_count=checkpoint_thread_count
        )
        for note in notes:
            logger.info("obsckpt: %s", note)
        await self._after_change()

    async def monitor_step(
        self, step: int, is_state_dict: bool = False, *, trace_context: dict[str, str] | None = None
    ) -> None:
        """Mark ``step`` as submitted; it commits once its saves are all finished.

        Submitting a step that is already committed, or older than the committed
        one, changes nothing (logged).
        """
        kind = layout.kind_of(is_state_dict)
        validate_step(step)
        latest = self.tracker.latest[kind]
        if latest is not None and step < latest:
            logger.info(
                "obsckpt: monitor_step(%d) (%s) ignored: step %d is already committed and the "
                "iteration file never goes backwards",
                step,
                kind,
                latest,
            )
        try:
            self.tracker.submit(step, kind, carrier=trace_context)
        finally:
            await self._after_change()

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
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        validate_parts(part, parts)
        rank = _checked_rank(rank)
        if parts is not None and step is None:
            raise ValueError(
                f"part={part!r}, parts={parts!r} given without step: a save made of parts "
                "must name its step"
            )
        resave = False
        if step is not None:
            validate_step(step)
            if unless_closed and self.tracker.skip_closed(step, kind or "checkpoint"):
                latest = self.tracker.latest[kind or "checkpoint"]
                logger.info(
                    "obsckpt: save %r of step %d (%s) on rank %s not admitted: the step is "
                    "already closed (latest committed is %s) and the caller asked not to "
                    "re-save it",
                    slot,
                    step,
                    kind or "checkpoint",
                    rank,
                    latest,
                )
                return {"skipped": True, "latest": latest}
            try:
                resave = not self.tracker.start(
                    step,
                    kind or "checkpoint",
                    carrier=trace_context,
                    slot=slot,
                    part=part,
                    parts=parts,
                )
            except PartsMismatchError as exc:
                logger.error("obsckpt: %s", exc)
                await self._after_change()
                raise
            if resave:
                logger.info(
                    "obsckpt: save %r of step %d (%s) is a re-save: the step is already "
                    "committed (latest is %s), so it is not counted and commits nothing",
                    slot,
                    step,
                    kind or "checkpoint",
                    self.tracker.latest[kind or "checkpoint"],
                )
        ticket = self._tickets.issue(
            step=step,
            kind=kind,
            slot=slot,
            rank=rank,
            node_id=node_id,
            pid=pid,
            requested=self._now(),
            resave=resave,
            part=part,
            parts=parts,
            lease=bool(lease) and self.lease_timeout_s is not None,
        )
        slot_label = self._slot_labels.label(slot)
        if parts is not None and part == rank and slot_label != OVERFLOW_SLOT:
            # One part per rank: the world of this slot has ``parts`` ranks now.
            self._remove_rank_series(
                lambda r, s: s == slot_label and r.isdigit() and int(r) >= parts,
                f"a save of slot {slot!r} is now made of {parts} parts, one per rank",
            )
        if rank is not None and pid is not None:
            self._rank_pids[rank] = pid
        if slot is not None and (slot_label, kind) not in self._save_series:
            # Both results' series exist from the slot's first save, so a first
            # failure is an increase from 0 that rate() and increase() can see.
            for result in RESULTS:
                self.metrics.saves.labels(slot_label, kind or "checkpoint", result)
            self._save_series.add((slot_label, kind))
        await self._wait_admission(ticket, job_id)
        ticket.admitted = ticket.last_seen = self._now()
        self.metrics.saves_in_flight.labels(_label(kind, "checkpoint")).inc()
        wait = ticket.admitted - ticket.requested
        self.metrics.admission_wait.labels(self.strategy.value).observe(wait)
        if ticket.lease or (self._watch_nodes and ticket.node_id):
            self._ensure_reaper()
        await self._after_change()
        lease_s = self.lease_timeout_s if ticket.lease else None
        heartbeat = lease_s / 4 if lease_s is not None else None
        return {
            "ticket": ticket.ticket,
            "admission_wait_s": wait,
            "heartbeat_s": heartbeat,
            "resave": resave,
        }

    async def _wait_admission(self, ticket: Ticket, job_id: str | None) -> None:
        """Until the save strategy admits ``ticket``'s save."""
        key = self.admission.key_for(
            ticket.ticket, _label(ticket.node_id), _label(job_id), ticket.pid
        )
        admitted = asyncio.get_running_loop().create_future()

        # A wait cancelled before its handler has run is released by that handler;
        # the grant must not raise into the release that made it (another save's finish).
        def grant() -> None:
            if not admitted.done():
                admitted.set_result(None)

        if self.admission.request(ticket.ticket, key, grant):
            return
        try:
            await admitted
        except asyncio.CancelledError:
            # The caller gave up waiting (its RPC was cancelled): the save will not
            # run. Nothing of it may stay behind, and its step cannot be whole.
            self._release(ticket.ticket)
            if ticket.step is not None:
                why = f"save {ticket.slot!r} on rank {ticket.rank} gave up waiting for admission"
                self._fail_ticket(ticket, why, started=True)
                await self._after_change()
            raise

    async def heartbeat(self, tickets: list[int]) -> None:
        """Saves with these tickets are still running (their process is alive)."""
        self._tickets.renew(tickets, self._now())

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_expired())

    async def _reap_expired(self) -> None:
        """Fail saves whose coordinator stopped sending heartbeats (a killed rank), or
        whose node Ray reports dead."""
        lease = self.lease_timeout_s
        interval = 5.0 if lease is None else min(5.0, lease / 4)
        checked = self._now()
        while self._tickets.watched(self._watch_nodes):
            await asyncio.sleep(interval)
            now = self._now()
            if now - checked > 2 * interval:
                # The monitor itself did not run (its process stopped, its loop held):
                # heartbeats sent meanwhile still wait in its queue. Leases are judged
                # from now on, not over a gap that no rank caused.
                self._tickets.renew([t.ticket for t in self._tickets], now)
            checked = now
            for info in self._tickets.stale(now, lease) if lease is not None else ():
                await self._expire(info, now)
            if self._watch_nodes:
                gone = await asyncio.to_thread(_dead_nodes)
                for info in self._tickets.on_nodes(gone):
                    await self._expire(info, now, node_gone=True)

    async def _expire(self, info: Ticket, now: float, *, node_gone: bool = False) -> None:
        who = f"save {info.slot!r} of rank {info.rank} (pid {info.pid} on node {info.node_id})"
        if node_gone:
            why = "runs on a node that Ray reports dead"
        else:
            why = (
                f"sent no heartbeat for {now - info.last_seen:.0f} s (lease_timeout_s="
                f"{self.lease_timeout_s}); its process probably died"
            )
        msg = f"{who} {why}. The step will not be committed"
        if self._release(info.ticket, expired=True) is None:
            return  # it ended while the check ran
        logger.error("obsckpt: %s", msg)
        kind = info.kind or "checkpoint"
        self.metrics.saves.labels(self._slot_labels.label(info.slot), kind, "error").inc()
        if info.rank is not None and self._rank_pids.get(info.rank, info.pid) == info.pid:
            # Its process is gone, and no other has reported as this rank since.
            self._rank_pids.pop(info.rank, None)
            rank = str(info.rank)
            self._remove_rank_series(
                lambda r, _s: r == rank, f"rank {info.rank}'s process is gone ({why})"
            )
        if info.step is not None:
            self._fail_ticket(info, msg, started=False)
        await self._after_change()

    def _fail_ticket(self, info: Ticket, error: str, *, started: bool) -> None:
        """Fail the save ``info`` names in the tracker: its step cannot be whole."""
        if info.step is None:  # a Trinity caller's save names no step
            return
        self.tracker.finish(
            info.step,
            info.kind or "checkpoint",
            ok=False,
            error=error,
            started=started,
            resave=info.resave,
            slot=info.slot,
            part=info.part,
            parts=info.parts,
        )

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
        validate_step(step)
        validate_parts(part, parts)
        rank = _checked_rank(rank)
        # Checked before anything changes: a measurement that failed halfway would
        # leave the save released but never counted, and its step pending for ever.
        check_seconds("duration_s", duration_s)
        check_seconds("join_wait_s", join_wait_s)
        check_bytes("nbytes", nbytes)
        kind = layout.kind_of(is_state_dict)
        if not admitted and ok:
            raise ValueError(
                f"admitted=False reports a save that failed before admission, so ok must "
                f"be False (step {step}, slot {slot!r})"
            )
        if self._tickets.take_expired(ticket):
            # Its lease ran out and the save was already counted as failed; the
            # process was only slow. Its step stays failed.
            logger.warning(
                "obsckpt: save %r of step %d finished after its lease expired", slot, step
            )
            return
        # Without ticket (admitted=False): a Trinity caller's oldest save is not released.
        info = self._release(ticket) if admitted else None
        slot = slot or (info.slot if info else None)
        if info is not None and info.parts is not None:
            part, parts = info.part, info.parts
        started = info is not None and info.step is not None
        records = [FileRecord.from_json(f) for f in files or ()]
        self._observe_save(kind, slot, rank, ok, duration_s, nbytes, join_wait_s, info)
        if info is None and ticket is not None and not self._tickets.issued_here(ticket):
            # Admitted by this monitor's previous incarnation: the step's registrations
            # and earlier finishes are gone, so it can never be known whole.
            reason = f"a save was admitted before the monitor restarted (ticket {ticket})"
            if self.tracker.lose(step, reason):
                logger.warning(
                    "obsckpt: step %d (%s) abandoned: a save admitted before the monitor "
                    "restarted finished; the step cannot be known whole",
                    step,
                    kind,
                )
            await self._after_change()
            return
        resave = info is not None and info.resave
        if not resave and self.tracker.closed(step, kind):
            logger.info(
                "obsckpt: a save of step %d (%s) finished after the step was closed (latest "
                "committed is %s); it commits nothing",
                step,
                kind,
                self.tracker.latest[kind],
            )
        try:
            self.tracker.finish(
                step,
                kind,
                ok=ok,
                error=error,
                files=records,
                started=started,
                resave=resave,
                slot=slot,
                part=part,
                parts=parts,
            )
        except Exception:
            await self._after_change()
            raise
        if not ok:
            logger.error(
                "obsckpt: save %r of step %d (%s) on rank %s failed: %s",
                slot,
                step,
                kind,
                rank,
                error,
            )
        await self._after_change()

    def _release(self, ticket: int | None, *, expired: bool = False) -> Ticket | None:
        """Close ``ticket`` (None: a Trinity caller's) and free its admission."""
        if expired:
            info = self._tickets.expire(ticket) if ticket is not None else None
        else:
            info = self._tickets.close(ticket)
        if info is None:
            return None
        self.admission.release(info.ticket)
        if info.admitted is not None:
            self.metrics.saves_in_flight.labels(_label(info.kind, "checkpoint")).dec()
        return info

    def _observe_save(
        self,
        kind: str,
        slot: str | None,
        rank: int | None,
        ok: bool,
        duration_s: float | None,
        nbytes: int | None,
        join_wait_s: float | None,
        info: Ticket | None,
    ) -> None:
        m = self.metrics
        slot_label = self._slot_labels.label(slot, count=True)
        m.saves.labels(slot_label, kind, "ok" if ok else "error").inc()
        if duration_s is None and info is not None and info.admitted is not None:
            duration_s = self._now() - info.admitted
        if duration_s is not None:
            m.save_duration.labels(slot_label, kind).observe(duration_s)
            if rank is not None:
                self._rank_series.set(m.rank_last_save_duration, str(rank), slot_label, duration_s)
        if ok and nbytes:
            m.save_bytes.labels(slot_label, kind).inc(nbytes)
        if join_wait_s is not None:
            m.join_wait.labels(slot_label).observe(join_wait_s)

    # ------------------------------------------------------------------
    # Commit
    # ------------------------------------------------------------------

    async def _after_change(self) -> None:
        """Commit what became ready; returns when nothing more is (or another call commits)."""
        if self._committer is not None and not self._committer.done():
            # The running committer asks ready() again before it ends (with no await
            # in between), so nothing is missed; waiting here would only hold
            # admissions behind commit I/O.
            self._refresh_gauges()
            return
        if not self.tracker.ready():
            # Nothing is whole (most notifications): no commit task, no trip through
            # the event loop on every RPC.
            self._refresh_gauges()
            return
        self._committer = asyncio.get_running_loop().create_task(self._commit_ready())
        # Shielded: a cancelled RPC must not stop a commit halfway (its step would
        # stay "committing" for ever); the commit runs to its end on its own.
        await asyncio.shield(self._committer)

    async def _commit_ready(self) -> None:
        try:
            # One commit at a time, each chosen as it starts: notifications arrive
            # during a commit's I/O, and a step ready before it may have a new save
            # in flight, or a failed one, by then.
            while (nxt := self.tracker.begin_next_commit()) is not None:
                await self._commit(*nxt)
        finally:
            self._refresh_gauges()

    async def _commit(self, step: int, kind: str, p: Progress) -> None:
        """Commit ``step`` of ``kind``, which the tracker has just marked committing."""
        whole_at = self._now()
        attrs = {"obsckpt.step": step, "obsckpt.kind": kind}
        saves = p.finished
        if kind == "checkpoint":  # a full checkpoint includes its state-dict saves
            saves += self.tracker.progress(step, "state_dict").finished
        if saves == 0 and not layout.step_dir(self.root, step).is_dir():
            # An iteration file must never name a step that is not on disk.
            msg = (
                f"step {step} ({kind}) was submitted with no saves and has no directory: "
                "nothing to commit (register its saves with register_thread_count first)"
            )
            logger.error("obsckpt: %s", msg)
            self.tracker.end_commit(step, kind, ok=False, error=msg)
            return
        try:
            with tracing.span("obsckpt.commit", carrier=p.carrier, attributes=attrs):
                phases: dict[str, float] = {}
                files = self.tracker.reported_files(step, kind)
                await asyncio.to_thread(self._write_commit, step, kind, files, phases)
        except Exception as exc:  # noqa: BLE001 - a failed commit fails the step, not the monitor
            msg = f"commit of step {step} ({kind}) failed: {exc}"
            if isinstance(exc, OSError):
                latest = self.tracker.latest[kind]
                msg += (
                    f"; it is not committed and {layout.ITERATION_FILES[kind]} still names "
                    f"{'no step' if latest is None else f'step {latest}'}. "
                    + _storage_hint(exc, self.root)
                )
            logger.error("obsckpt: %s", msg)
            self.tracker.end_commit(step, kind, ok=False, error=msg)
            return
        now = self._now()
        self.tracker.end_commit(step, kind, ok=True)
        # The step's first save start: a full checkpoint includes its state-dict saves.
        starts = [p.started_at]
        if kind == "checkpoint":
            starts.append(self.tracker.progress(step, "state_dict").first_start)
        started = min((s for s in starts if s is not None), default=None)
        kinds = ("checkpoint", "state_dict") if kind == "checkpoint" else ("state_dict",)
        for k in kinds:
            if self.tracker.latest[k] == step:
                self.metrics.latest_step.labels(k).set(step)
                self._last_commit[k] = now
                if started is not None:  # each iteration file this commit moved
                    self.metrics.commit_lag.labels(k).observe(max(0.0, now - started))
        self._last_commit_detail[kind] = {
            "step": step,
            "whole_at": whole_at,
            "committed_at": now,
            "commit_io_s": now - whole_at,
            # Where the commit's time went (finalize_step's phases, seconds).
            "phases_s": {k: round(v, 6) for k, v in phases.items()},
        }
        logger.info("obsckpt: committed step %d (%s)", step, kind)

    def _write_commit(
        self, step: int, kind: str, files: dict[str, FileRecord], phases: dict[str, float]
    ) -> None:
        sdir = layout.step_dir(self.root, step)
        if sdir.is_dir():
            self._sees_step_dirs = True
        elif files and self._sees_step_dirs:
            # Committing it would name a step that is not on disk.
            raise FileNotFoundError(
                errno.ENOENT,
                f"the step directory was removed or renamed after its saves reported "
                f"{len(files)} file(s) in it",
                str(sdir),
            )
        steps = {kind: step}
        if kind == "checkpoint":
            # A full checkpoint also commits its state dict.
            current = reader.read_iteration(self.root, "state_dict")
            if current is None or current < step:
                steps["state_dict"] = step
        commit.finalize_step(sdir, files, iterations=steps, timings=phases)

    def _remove_rank_series(self, gone: Callable[[str, str], bool], why: str) -> None:
        """Remove the per-rank series of ranks that are gone (``gone(rank, slot)``)."""
        removed = self._rank_series.remove(gone)
        if removed:
            logger.info(
                "obsckpt: removed the per-rank metric series of %s: %s",
                ", ".join(f"rank {r} slot {s!r}" for r, s in removed),
                why,
            )

    def _refresh_gauges(self) -> None:
        """Set the pending/abandoned gauges, if they changed (called after every RPC)."""
        shown = (
            tuple(self.tracker.pending_summary(kind) for kind in KINDS),
            len(self.tracker.abandoned),
        )
        if shown == self._gauges_shown:
            return
        for kind, (pending, oldest) in zip(KINDS, shown[0], strict=True):
            self.metrics.pending_steps.labels(kind).set(pending)
            self._oldest_pending[kind] = oldest
        self.metrics.abandoned_steps.set(shown[1])
        self._gauges_shown = shown

    # ------------------------------------------------------------------
    # Weight-sync measurements (the monitor is the job's one scrape target)
    # ------------------------------------------------------------------

    async def record_broadcast(
        self, backend: str, seconds: float, nbytes: int, method: str = "broadcast"
    ) -> None:
        check_sync_labels(backend, method)
        check_seconds("seconds", seconds)
        check_bytes("nbytes", nbytes)
        self.metrics.broadcast_duration.labels(backend, method).observe(seconds)
        self.metrics.broadcast_bytes.labels(backend, method).inc(nbytes)

    async def record_broadcast_failure(self, backend: str, method: str, reason: str) -> None:
        check_sync_labels(backend, method, reason)
        self.metrics.broadcast_failures.labels(backend, method, reason).inc()

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
        rank = _checked_rank(rank)
        check_bytes("nbytes", nbytes)
        check_bytes("pinned_bytes", pinned_bytes)
        if rank is not None and pid is not None:
            self._rank_pids[rank] = pid
        m = self.metrics
        rank_label, slot_label = _label(rank), self._slot_labels.label(slot, count=True)
        self._rank_series.set(m.staging_bytes, rank_label, slot_label, nbytes)
        self._rank_series.set(m.staging_pinned_bytes, rank_label, slot_label, pinned_bytes)
        if cold:
            m.staging_cold_saves.labels(slot_label).inc()

    async def record_upload(self, seconds: float) -> None:
        check_seconds("seconds", seconds)
        self.metrics.upload_duration.observe(seconds)

    async def record_model_version(self, role: str, version: int) -> None:
        check_role(role)
        self.metrics.model_version.labels(role).set(version)

    # ------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------

    async def latest_steps(self) -> dict[str, int | None]:
        """The latest committed step of each kind (``checkpoint``, ``state_dict``)."""
        return dict(self.tracker.latest)

    async def metrics_address(self) -> str | None:
        """``host:port`` of /metrics, or None when not served (see status() for why)."""
        return self.server.address

    async def checkpoint_root(self) -> str:
        """The directory this monitor commits steps under (``default_local_dir``)."""
        return str(self.root)

    async def status(self) -> dict[str, Any]:
        """Latest committed steps, pending, failed and abandoned steps, saves in flight."""
        t = self.tracker
        return {
            "root": str(self.root),
            "save_strategy": self.strategy.name,
            "latest": dict(t.latest),
            "last_commit_time": {k: self._unix(t) for k, t in self._last_commit.items()},
            "last_commit": {
                kind: {
                    **detail,
                    "whole_at": self._unix(detail["whole_at"]),
                    "committed_at": self._unix(detail["committed_at"]),
                }
                for kind, detail in self._last_commit_detail.items()
            },
            "pending": [
                {
                    "step": step,
                    "kind": kind,
                    "started": self._unix(p.started_at),
                    "registered": p.registered,
                    "finished": p.finished,
                    "in_flight": p.in_flight,
                    "submitted": p.submitted,
                    "state": p.state,
                    # Saves made of parts still missing some: slot -> parts finished / parts.
                    "open_parts": {
                        str(slot): {
                            "parts": g.parts,
                            "finished": sorted(i for i, n in g.done.items() if n > g.counted),
                            "running": g.running,
                        }
                        for slot, g in p.groups.items()
                        if g.open
                    },
                }
                for step, kind, p in t.pending()
            ],
            "failed": [
                {"step": step, "kind": kind, "error": p.error, "at": self._unix(p.resolved_at)}
                for step, kind, p in t.failed()
            ],
            "abandoned": [{"step": s, "reason": r} for s, r in sorted(t.abandoned.items())],
            "restarted": t.restarted,
            "resaves": t.resaves,
            "in_flight": [
                {
                    "ticket": tk.ticket,
                    "step": tk.step,
                    "kind": tk.kind,
                    "slot": tk.slot,
                    "rank": tk.rank,
                    "part": tk.part,
                    "parts": tk.parts,
                    "requested": self._unix(tk.requested),
                    "admitted": self._unix(tk.admitted),
                }
                for tk in self._tickets
            ],
            "admission_waiting": self.admission.waiting,
            "metrics": {"address": self.server.address, "error": self.server.error},
            "span_export_failures": tracing.export_failures(),
        }

    async def debug_spans(self) -> list[dict[str, Any]]:
        """Spans this process recorded with the ``memory`` exporter (for tests)."""
        return tracing.finished_spans()

    async def shutdown(self) -> None:
        """Stop serving /metrics, withdraw the file_sd target and unlock the root.

        End the actor with ray.kill afterwards.

        Only this monitor's entry leaves the file_sd file: other jobs' monitors,
        and one started since on this root, keep theirs.
        """
        address = self.server.address
        # Once the job is done another job may use the root (ray.kill, or the
        # process's end, would drop the lock too).
        self._root_lock.release()
        # Served in one more scrape (while a scraper polls), so that ObsckptMonitorDown
        # tells this clean finish from a lost monitor once the target is withdrawn.
        self.metrics.shutdown_timestamp.set(wall_clock())
        await asyncio.to_thread(self.server.close, final_scrape_timeout_s=_FINAL_SCRAPE_WAIT_S)
        if not (self.file_sd_path and address):
            return
        try:
            withdraw_file_sd(self.file_sd_path, address)
        except (OSError, ValueError) as exc:
            logger.error("obsckpt: cannot withdraw file_sd %s: %s", self.file_sd_path, exc)
