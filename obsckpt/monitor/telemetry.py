"""The monitor's telemetry: its events as metrics and log lines, and the /metrics endpoint.

:class:`MonitorTelemetry` is the :class:`~obsckpt.monitor.events.MonitorObserver`
the monitor actor gives its core. It owns the label policy (slot names
bounded by ``max_slot_labels``, per-rank series removed once their rank is
gone), the gauges read at each scrape, the weight-sync measurements workers
send, the HTTP endpoint and its Prometheus file_sd entry.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from obsckpt.errors import StoreError
from obsckpt.monitor.events import CommitRecord, MonitorObserver
from obsckpt.monitor.labels import RankSeries, SlotLabels
from obsckpt.store.layout import KINDS
from obsckpt.store.uri import parse_root
from obsckpt.telemetry.metrics import Metrics
from obsckpt.telemetry.server import (
    MetricsServer,
    publish_file_sd,
    serve_metrics,
    withdraw_file_sd,
)
from obsckpt.telemetry.vocabulary import (
    OVERFLOW_SLOT,
    RESULTS,
    store_error_labels,
    validate_bytes,
    validate_role,
    validate_seconds,
    validate_sync_labels,
)
from obsckpt.tickets import Ticket

if TYPE_CHECKING:
    from obsckpt.monitor.core import MonitorCore

logger = logging.getLogger("obsckpt.monitor")


def file_sd_root_label(default_local_dir: str | os.PathLike) -> str:
    """The root a monitor of ``default_local_dir`` names in its file_sd entry: the
    ``s3://`` URL, or the local directory as :class:`~pathlib.Path` writes it.

    Whoever starts a monitor knows it before the monitor answers (the monitor publishes
    its entry first): a stop in between leaves the entry for the starter to withdraw.
    """
    root = parse_root(default_local_dir, what="default_local_dir")
    return str(root) if root.is_remote else str(Path(os.fspath(default_local_dir)))


def _label(value: object, default: str = "unknown") -> str:
    return default if value is None else str(value)


def _unix_reader(
    core: MonitorCore, times: dict[str, float | None], kind: str
) -> Callable[[], float]:
    """Reads ``times[kind]`` (a monotonic reading) as Unix time at each scrape (0: none)."""
    return lambda: core.unix(times[kind]) or 0.0


class MonitorTelemetry(MonitorObserver):
    """Metrics and log lines for the monitor's events, and the endpoint serving them.

    Args:
        strategy: the save strategy's value, the ``strategy`` label.
        registry: Prometheus registry (tests pass a fresh one).
        max_slot_labels: distinct slot names kept as the ``slot`` label.
    """

    def __init__(
        self, strategy: str, registry: CollectorRegistry | None, max_slot_labels: int
    ) -> None:
        self.strategy = strategy
        self.metrics = Metrics(registry)
        # Bounds on the label values callers send: slot names, and ranks that are gone.
        self._slot_labels = SlotLabels(max_slot_labels, self.metrics.slot_label_overflows)
        self._rank_series = RankSeries(
            self.metrics.rank_last_save_duration,
            self.metrics.staging_bytes,
            self.metrics.staging_pinned_bytes,
        )
        # (slot label, kind) with both results' series.
        self._save_series: set[tuple[str, str | None]] = set()
        # Rank -> pid of the process that last reported as it: the one whose death
        # makes the rank's series stale (a replacement may already have taken over).
        self._rank_pids: dict[int, int | None] = {}
        # When each kind's oldest pending step started (monotonic readings).
        self._oldest_pending: dict[str, float | None] = {k: None for k in KINDS}
        self.server: MetricsServer | None = None
        self.file_sd_path: str | None = None
        # On an s3:// root, a save's time and bytes are its upload's too.
        self.store_root = False

    def attach(self, core: MonitorCore, latest: dict[str, int | None]) -> None:
        """Read ``core``'s commit times at each scrape; show the ``latest`` steps found."""
        for kind, step in latest.items():
            if step is not None:
                self.metrics.latest_step.labels(kind).set(step)
        for kind in KINDS:
            # Worked out at each scrape: after a step of the wall clock, Prometheus's
            # time() minus these is still how long ago they were.
            self.metrics.last_commit_timestamp.labels(kind).set_function(
                _unix_reader(core, core.last_commit, kind)
            )
            self.metrics.oldest_pending_start.labels(kind).set_function(
                _unix_reader(core, self._oldest_pending, kind)
            )

    def attach_fence(self, lost: Callable[[], str | None]) -> None:
        """Show whether the monitor lost its root (``lost()``: why, or None) at each scrape."""
        self.metrics.monitor_fenced.set_function(lambda: 0.0 if lost() is None else 1.0)

    # -- commit phases (called from the commit's thread) --------------------------

    def commit_phase_started(self, phase: str, unix_time: float) -> None:
        """A commit entered ``phase`` at ``unix_time``."""
        self.metrics.commit_phase_started.labels(phase).set(unix_time)

    def commit_phase_ended(self, phase: str, seconds: float) -> None:
        """A commit left ``phase`` (done, failed or timed out) after ``seconds``."""
        self.metrics.observe("commit_phase", max(0.0, seconds), phase)
        self.metrics.commit_phase_started.labels(phase).set(0)

    def node_query_failed(self) -> None:
        """Ray could not be asked which nodes are dead."""
        self.metrics.node_query_failures.inc()

    def leftovers_swept(self, root: str | os.PathLike[str], removed: list[str]) -> None:
        """The monitor's start removed ``removed`` from ``root``: obsckpt's own temp
        files and scratch directories of writes cut short (none if Ray restarted it)."""
        if not removed:
            return
        self.metrics.leftovers_removed.inc(len(removed))
        logger.info(
            "obsckpt monitor: removed %d leftover temp files of writes cut short in %s: %s",
            len(removed),
            root,
            removed[:10],
        )

    # -- the endpoint ---------------------------------------------------------

    def serve(
        self,
        host: str,
        port: int | None,
        *,
        file_sd_path: str | None,
        namespace: str | None,
        root: str,
    ) -> MetricsServer:
        """Serve /metrics and name the endpoint in ``file_sd_path`` (if given)."""
        self.server = serve_metrics(
            self.metrics.registry, host, port, rejected=self.metrics.metrics_connections_rejected
        )
        self.file_sd_path = file_sd_path
        if not file_sd_path:
            return self.server
        labels = {"obsckpt_namespace": namespace} if namespace else {}
        try:
            gone = publish_file_sd(file_sd_path, self.server.address, labels, root=root)
        except OSError as exc:
            logger.error("obsckpt: cannot write file_sd %s: %s", file_sd_path, exc)
        else:
            if gone:
                logger.warning(
                    "obsckpt: removed %s from file_sd %s: nothing listens there "
                    "(monitors that ended without withdrawing their targets)",
                    ", ".join(gone),
                    file_sd_path,
                )
        return self.server

    def close(self, now_unix: float, final_scrape_wait_s: float) -> None:
        """Stop serving /metrics after one last scrape; withdraw the file_sd target.

        Only this monitor's entry leaves the file_sd file: other jobs' monitors,
        and one started since on this root, keep theirs.
        """
        if self.server is None:
            return
        address = self.server.address
        # Served in one more scrape (while a scraper polls), so that ObsckptMonitorDown
        # tells this clean finish from a lost monitor once the target is withdrawn.
        self.metrics.shutdown_timestamp.set(now_unix)
        self.server.await_final_scrape(final_scrape_wait_s)
        # Withdrawn before the server closes: closing ends the scrapers' connections,
        # which can take seconds, and a stop on a signal may not wait that long.
        if self.file_sd_path and address:
            try:
                withdraw_file_sd(self.file_sd_path, address)
            except (OSError, ValueError) as exc:
                logger.error("obsckpt: cannot withdraw file_sd %s: %s", self.file_sd_path, exc)
        self.server.close()

    # -- per-rank series --------------------------------------------------------

    def _remove_rank_series(self, gone: Callable[[str, str], bool], why: str) -> None:
        """Remove the per-rank series of ranks that are gone (``gone(rank, slot)``)."""
        removed = self._rank_series.remove(gone)
        if removed:
            logger.info(
                "obsckpt: removed the per-rank metric series of %s: %s",
                ", ".join(f"rank {r} slot {s!r}" for r, s in removed),
                why,
            )

    def _saw_rank(self, rank: int | None, pid: int | None) -> None:
        if rank is not None and pid is not None:
            self._rank_pids[rank] = pid

    # -- events: saves ------------------------------------------------------------

    def save_requested(self, ticket: Ticket) -> None:
        slot, parts = ticket.slot, ticket.parts
        slot_label = self._slot_labels.label(slot)
        if parts is not None and ticket.part == ticket.rank and slot_label != OVERFLOW_SLOT:
            # One part per rank: the world of this slot has ``parts`` ranks now.
            self._remove_rank_series(
                lambda r, s: s == slot_label and r.isdigit() and int(r) >= parts,
                f"a save of slot {slot!r} is now made of {parts} parts, one per rank",
            )
        self._saw_rank(ticket.rank, ticket.pid)
        if slot is not None and (slot_label, ticket.kind) not in self._save_series:
            # Both results' series exist from the slot's first save, so a first
            # failure is an increase from 0 that rate() and increase() can see.
            for result in RESULTS:
                self.metrics.saves.labels(slot_label, ticket.kind or "checkpoint", result)
            self._save_series.add((slot_label, ticket.kind))

    def save_skipped(
        self, step: int, kind: str, slot: str | None, rank: int | None, latest: int | None
    ) -> None:
        logger.info(
            "obsckpt: save %r of step %d (%s) on rank %s not admitted: the step is "
            "already closed (latest committed is %s) and the caller asked not to "
            "re-save it",
            slot,
            step,
            kind,
            rank,
            latest,
        )

    def resave_started(self, step: int, kind: str, slot: str | None, latest: int | None) -> None:
        logger.info(
            "obsckpt: save %r of step %d (%s) is a re-save: the step is already "
            "committed (latest is %s), so it is not counted and commits nothing",
            slot,
            step,
            kind,
            latest,
        )

    def save_admitted(self, ticket: Ticket, wait_s: float) -> None:
        self.metrics.saves_in_flight.labels(_label(ticket.kind, "checkpoint")).inc()
        self.metrics.observe("admission_wait", wait_s, self.strategy)

    def save_released(self, ticket: Ticket) -> None:
        self.metrics.saves_in_flight.labels(_label(ticket.kind, "checkpoint")).dec()

    def save_finished(
        self,
        kind: str,
        slot: str | None,
        rank: int | None,
        *,
        ok: bool,
        error: str | None,
        step: int,
        duration_s: float | None,
        nbytes: int | None,
        join_wait_s: float | None,
    ) -> None:
        m = self.metrics
        slot_label = self._slot_labels.label(slot, count=True)
        m.saves.labels(slot_label, kind, "ok" if ok else "error").inc()
        if duration_s is not None:
            m.observe("save_duration", duration_s, slot_label, kind)
            if rank is not None:
                self._rank_series.set(m.rank_last_save_duration, str(rank), slot_label, duration_s)
        if ok and nbytes:
            m.save_bytes.labels(slot_label, kind).inc(nbytes)
        if ok and self.store_root:
            m.add("store_upload_bytes", nbytes or 0, slot_label)
            if duration_s is not None:
                m.observe("store_upload_seconds", duration_s, slot_label)
        if join_wait_s is not None:
            m.observe("join_wait", join_wait_s, slot_label)
        if not ok:
            logger.error(
                "obsckpt: save %r of step %d (%s) on rank %s failed: %s",
                slot,
                step,
                kind,
                rank,
                error,
            )

    def late_finish(self, step: int, slot: str | None) -> None:
        logger.warning("obsckpt: save %r of step %d finished after its lease expired", slot, step)

    def finished_after_close(self, step: int, kind: str, latest: int | None) -> None:
        logger.info(
            "obsckpt: a save of step %d (%s) finished after the step was closed (latest "
            "committed is %s); it commits nothing",
            step,
            kind,
            latest,
        )

    def lease_expired(self, ticket: Ticket, message: str, why: str) -> None:
        logger.error("obsckpt: %s", message)
        kind = ticket.kind or "checkpoint"
        self.metrics.saves.labels(self._slot_labels.label(ticket.slot), kind, "error").inc()
        rank = ticket.rank
        if rank is not None and self._rank_pids.get(rank, ticket.pid) == ticket.pid:
            # Its process is gone, and no other has reported as this rank since.
            self._rank_pids.pop(rank, None)
            self._remove_rank_series(
                lambda r, _s: r == str(rank), f"rank {rank}'s process is gone ({why})"
            )

    def parts_mismatch(self, error: Exception) -> None:
        logger.error("obsckpt: %s", error)

    def note(self, message: str) -> None:
        logger.info("obsckpt: %s", message)

    # -- events: steps --------------------------------------------------------------

    def step_failed(self, step: int, kind: str) -> None:
        self.metrics.step_failures.labels(kind).inc()

    def step_abandoned(self, step: int, kind: str, reason: str) -> None:
        logger.warning(
            "obsckpt: step %d (%s) abandoned: %s; the step cannot be known whole",
            step,
            kind,
            reason,
        )

    def submit_ignored(self, step: int, kind: str, latest: int) -> None:
        logger.info(
            "obsckpt: monitor_step(%d) (%s) ignored: step %d is already committed and the "
            "iteration file never goes backwards",
            step,
            kind,
            latest,
        )

    def step_committed(self, record: CommitRecord) -> None:
        for kind in record.moved:
            self.metrics.latest_step.labels(kind).set(record.step)
            if record.started_at is not None:  # each iteration file this commit moved
                lag = max(0.0, record.committed_at - record.started_at)
                self.metrics.observe("commit_lag", lag, kind)
        logger.info("obsckpt: committed step %d (%s)", record.step, record.kind)

    def commit_failed(self, step: int, kind: str, message: str) -> None:
        logger.error("obsckpt: %s", message)

    def pending_changed(self, pending: dict[str, tuple[int, float | None]], abandoned: int) -> None:
        for kind, (count, oldest) in pending.items():
            self.metrics.pending_steps.labels(kind).set(count)
            self._oldest_pending[kind] = oldest
        self.metrics.abandoned_steps.set(abandoned)

    # -- weight-sync and staging measurements (the monitor is the job's one scrape target) --

    def record_broadcast(self, backend: str, seconds: float, nbytes: int, method: str) -> None:
        validate_sync_labels(backend, method)
        validate_seconds("seconds", seconds)
        validate_bytes("nbytes", nbytes)
        self.metrics.observe("broadcast_duration", seconds, backend, method)
        self.metrics.add("broadcast_bytes", nbytes, backend, method)

    def record_weight_sync(self, report: Mapping[str, Any]) -> None:
        self.metrics.weight_sync(report)

    def record_broadcast_failure(self, backend: str, method: str, reason: str) -> None:
        validate_sync_labels(backend, method, reason)
        self.metrics.broadcast_failures.labels(backend, method, reason).inc()

    def record_staging(
        self,
        *,
        rank: int | None,
        slot: str,
        nbytes: int,
        pinned_bytes: int,
        cold: bool,
        pid: int | None,
    ) -> None:
        validate_bytes("nbytes", nbytes)
        validate_bytes("pinned_bytes", pinned_bytes)
        self._saw_rank(rank, pid)
        m = self.metrics
        rank_label, slot_label = _label(rank), self._slot_labels.label(slot, count=True)
        self._rank_series.set(m.staging_bytes, rank_label, slot_label, nbytes)
        self._rank_series.set(m.staging_pinned_bytes, rank_label, slot_label, pinned_bytes)
        if cold:
            m.staging_cold_saves.labels(slot_label).inc()

    # -- an s3:// root ----------------------------------------------------------

    def watch_store(self, store: Any) -> None:
        """Count ``store``'s failed requests and settled compare-and-swap races (an
        :class:`~obsckpt.store.s3root.S3Root`: the monitor's root or its mirror)."""
        store.client.on_error = self.store_request_failed
        store.pointer.on_conflict = self.store_cas_conflict

    def store_request_failed(self, err: StoreError) -> None:
        """A request to the root's endpoint failed (from the request's thread)."""
        self.metrics.store_request_errors.labels(*store_error_labels(err.operation, err.code)).inc()

    def store_cas_conflict(self) -> None:
        """A conditional write of a commit lost a race (412) or met a 409, and was settled."""
        self.metrics.store_cas_conflicts.inc()

    def store_commit_fenced(self) -> None:
        """A commit was refused: another monitor took the root."""
        self.metrics.store_fenced_commits.inc()

    def mirror_committed(self, kind: str, step: int) -> None:
        """The mirror committed ``step`` of ``kind`` (from the mirror's thread)."""
        self.metrics.mirror_latest_step.labels(kind).set(step)

    def mirror_step_copied(self, seconds: float, uploaded_bytes: int) -> None:
        self.metrics.observe("mirror_copy_seconds", seconds)
        self.metrics.mirror_upload_bytes.inc(uploaded_bytes)

    def mirror_failed(self) -> None:
        self.metrics.mirror_failures.inc()

    def record_upload(self, seconds: float) -> None:
        validate_seconds("seconds", seconds)
        self.metrics.observe("upload_duration", seconds)

    def record_model_version(self, role: str, version: int) -> None:
        validate_role(role)
        self.metrics.model_version.labels(role).set(version)
