"""The obsckpt Grafana dashboard, built with grafana-foundation-sdk.

Panels are declared as data (:data:`ROWS`) and turned into SDK builders by
:func:`build_dashboard`; :func:`panel_queries` lists every query of the result
so a test can run each one against a real Prometheus.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import bargauge, stat, timeseries
from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from dashboards.alerts import AlertThresholds

UID = "obsckpt"
TITLE = "obsckpt: checkpointing"
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
TEMPO_UID = "tempo"

# Every query carries these matchers, so several monitors (training jobs) in one
# scrape job, or in one Ray namespace, are told apart; a test checks it. A target
# without the namespace label (a static scrape config) matches the "All" value .*.
JOB = 'job=~"$job", instance=~"$instance", obsckpt_namespace=~"$namespace"'
RATE = "$__rate_interval"
# Latencies are histograms observed once per save: a rate over $__rate_interval
# (about a minute) is empty between saves, so a job saving every 10 minutes or every
# hour would show no latency at all. They are read over $window (default 2h,
# longer than the longest save interval worth supporting) instead.
WINDOW = "$window"
WINDOWS = ("2h", "15m", "1h", "6h", "1d")
QUANTILES = (0.5, 0.95, 0.99)
# Alert thresholds drawn on the panels they refer to.
ALERTS = AlertThresholds()


def m(metric: str, *matchers: str) -> str:
    """A selector of ``metric`` in the selected job, with extra label matchers."""
    return f"{metric}{{{', '.join((JOB, *matchers))}}}"


def quantiles(metric: str, by: tuple[str, ...], legend: str) -> list[tuple[str, str]]:
    """Mean and p50/p95/p99 targets of a histogram over ``$window``, by ``by``."""
    keys = ", ".join(("le", *by))
    group = f"sum by ({', '.join(by)})" if by else "sum"
    mean = (
        f"{group} (increase({m(metric + '_sum')}[{WINDOW}]))"
        f" / {group} (increase({m(metric + '_count')}[{WINDOW}]))"
    )
    return [(mean, f"mean {legend}".rstrip())] + [
        (
            f"histogram_quantile({q:g}, sum by ({keys}) (increase({m(metric + '_bucket')}[{WINDOW}])))",
            f"p{round(q * 100)} {legend}".rstrip(),
        )
        for q in QUANTILES
    ]


def last(gauge: str, by: tuple[str, ...], legend: str) -> tuple[str, str]:
    """A last-value gauge's target, the largest of the selected monitors' by ``by``."""
    group = f"max by ({', '.join(by)})" if by else "max"
    return f"{group} ({m(gauge)})", f"last {legend}".rstrip()


def latency(metric: str, by: tuple[str, ...], legend: str) -> list[tuple[str, str]]:
    """A histogram's last observation (``obsckpt_last_*``, kept until the next, so it
    shows at any save interval) and its mean and percentiles over ``$window``."""
    return [last(metric.replace("obsckpt_", "obsckpt_last_", 1), by, legend)] + quantiles(
        metric, by, legend
    )


# The last weight sync's bytes over its duration (both gauges kept until the next
# sync, so it needs no window), per monitor, then the largest of the selected ones.
LAST_SYNC_BANDWIDTH = (
    f"max by (backend, method) ({m('obsckpt_last_broadcast_bytes')}"
    f" / ({m('obsckpt_last_broadcast_duration_seconds')} > 0))",
    "last {{backend}}",
)
FAILED_SAVES = m("obsckpt_saves_total", 'result="error"')
TRAINER_VERSION = m("obsckpt_model_version", 'role="trainer"')
ROLLOUT_VERSION = m("obsckpt_model_version", 'role="rollout"')


@dataclass(frozen=True, slots=True)
class PanelSpec:
    """One panel: its visualisation, unit, size and (expr, legend) targets."""

    title: str
    description: str
    unit: str
    targets: list[tuple[str, str]]
    viz: str = "timeseries"  # timeseries | stat | bargauge
    width: int = 12
    height: int = 8
    instant: bool = False
    # (value, colour) steps, the first from -infinity (value None): a stat panel is
    # coloured by them, a time series draws them as lines. None: a stat panel shows
    # its value uncoloured (a step number, a count, a timestamp), a time series
    # draws no line.
    thresholds: tuple[tuple[float | None, str], ...] | None = None
    extra: dict = field(default_factory=dict)


# Red as soon as anything failed; green at 0.
FAILURES_RED = ((None, "green"), (1, "red"))


def alert_line(seconds: float, colour: str = "red") -> tuple[tuple[float | None, str], ...]:
    """Green below an alert's threshold, ``colour`` at and above it."""
    return ((None, "green"), (seconds, colour))


ROWS: list[tuple[str, list[PanelSpec]]] = [
    (
        "Overview",
        [
            PanelSpec(
                "Latest committed step",
                "Step named by latest_*_iteration.txt, per monitor (one per training job).",
                "none",
                [
                    (
                        f"max by (instance, kind) ({m('obsckpt_latest_step')})",
                        "{{instance}} {{kind}}",
                    )
                ],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Time since last commit",
                "Of the monitors scraped, the one that committed least recently (the one "
                "ObsckptNoRecentCommit fires for first); empty for a kind not committed yet "
                "(its timestamp is 0).",
                "s",
                [
                    (
                        # Filter the 0 before aggregating: a monitor yet to commit is
                        # not the least recent one.
                        f"time() - min by (kind) ({m('obsckpt_last_commit_timestamp_seconds')} > 0)",
                        "{{kind}}",
                    )
                ],
                viz="stat",
                thresholds=alert_line(ALERTS.no_commit_seconds, "orange"),
                width=4,
                height=5,
            ),
            PanelSpec(
                "Pending steps",
                "Steps with saves started or registered that are not committed, failed or superseded.",
                "none",
                [
                    (
                        f"sum by (instance, kind) ({m('obsckpt_pending_steps')})",
                        "{{instance}} {{kind}}",
                    )
                ],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Oldest pending step age",
                "Of the monitors scraped, the oldest pending step; red past the threshold of "
                "ObsckptCommitStalled. Empty when nothing is pending (the start timestamp is 0).",
                "s",
                [
                    (
                        "time() - (min by (kind) "
                        f"({m('obsckpt_oldest_pending_step_start_timestamp_seconds')} > 0))",
                        "{{kind}}",
                    )
                ],
                viz="stat",
                thresholds=alert_line(ALERTS.commit_stall_seconds),
                width=4,
                height=5,
            ),
            PanelSpec(
                "Saves in flight",
                "Saves admitted by the monitor and not yet finished.",
                "none",
                [
                    (
                        f"sum by (instance, kind) ({m('obsckpt_saves_in_flight')})",
                        "{{instance}} {{kind}}",
                    )
                ],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Failed steps",
                "Steps that will never commit because a save failed, since the monitor started.",
                "none",
                [
                    (
                        f"sum by (instance, kind) ({m('obsckpt_step_failures_total')})",
                        "{{instance}} {{kind}}",
                    )
                ],
                viz="stat",
                thresholds=FAILURES_RED,
                width=4,
                height=5,
            ),
        ],
    ),
    (
        "Saves",
        [
            PanelSpec(
                "Save latency by slot and kind",
                "Admission to fsync of one background save: the last save (its slowest rank, "
                "kept until the next save), and the mean and percentiles over $window.",
                "s",
                [
                    last("obsckpt_rank_last_save_duration_seconds", ("slot",), "{{slot}}"),
                    *quantiles(
                        "obsckpt_save_duration_seconds", ("slot", "kind"), "{{slot}} {{kind}}"
                    ),
                ],
            ),
            PanelSpec(
                "Save throughput",
                "Bytes written by successful saves.",
                "Bps",
                [
                    (
                        f"sum by (slot, kind) (rate({m('obsckpt_save_bytes_total')}[{RATE}]))",
                        "{{slot}} {{kind}}",
                    )
                ],
            ),
            PanelSpec(
                "Saves by result",
                "Finished saves per second, successful and failed.",
                "ops",
                [
                    (
                        f"sum by (slot, kind, result) (rate({m('obsckpt_saves_total')}[{RATE}]))",
                        "{{slot}} {{kind}} {{result}}",
                    )
                ],
                width=6,
            ),
            PanelSpec(
                "Saves in flight",
                "Saves admitted and not yet finished.",
                "none",
                [(f"sum by (kind) ({m('obsckpt_saves_in_flight')})", "{{kind}}")],
                width=6,
            ),
            PanelSpec(
                "Thread-join waits",
                "A new save waiting for the previous save of the same slot: saves outpace the "
                "disk. The last wait reported (kept until the next), and the mean and "
                "percentiles over $window.",
                "s",
                latency("obsckpt_thread_join_wait_seconds", ("slot",), "{{slot}}"),
                width=6,
            ),
            PanelSpec(
                "Admission waits",
                "A save waiting for admission under the save strategy: the last wait (kept "
                "until the next), and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_save_admission_wait_seconds", ("strategy",), "{{strategy}}"),
                width=6,
            ),
        ],
    ),
    (
        "Commits",
        [
            PanelSpec(
                "Commit lag",
                "From a step's first save start to its iteration file commit: the last "
                "commit's (kept until the next), and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_commit_lag_seconds", ("kind",), "{{kind}}"),
            ),
            PanelSpec(
                "Latest committed step",
                "Step named by latest_*_iteration.txt, per monitor (one per training job).",
                "none",
                [
                    (
                        f"max by (instance, kind) ({m('obsckpt_latest_step')})",
                        "{{instance}} {{kind}}",
                    )
                ],
            ),
            PanelSpec(
                "Time since last commit",
                "Per monitor (one per training job); empty until its first commit of a kind. "
                "The line: ObsckptNoRecentCommit's threshold.",
                "s",
                [
                    (
                        "time() - max by (instance, kind) "
                        f"({m('obsckpt_last_commit_timestamp_seconds')} > 0)",
                        "{{instance}} {{kind}}",
                    )
                ],
                width=8,
                thresholds=alert_line(ALERTS.no_commit_seconds, "orange"),
            ),
            PanelSpec(
                "Pending and abandoned steps",
                "Steps waiting for their saves to finish, and steps that will never commit "
                "(found uncommitted at monitor start, lost by a monitor restart, or overtaken "
                "by a later commit).",
                "none",
                [
                    (
                        f"sum by (instance, kind) ({m('obsckpt_pending_steps')})",
                        "pending {{instance}} {{kind}}",
                    ),
                    (
                        f"sum by (instance) ({m('obsckpt_abandoned_steps')})",
                        "abandoned {{instance}}",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "Oldest pending step age",
                "Per monitor; grows until the step commits. ObsckptCommitStalled fires past "
                "the line (its threshold).",
                "s",
                [
                    (
                        "time() - (max by (instance, kind) "
                        f"({m('obsckpt_oldest_pending_step_start_timestamp_seconds')} > 0))",
                        "{{instance}} {{kind}}",
                    )
                ],
                width=8,
                thresholds=alert_line(ALERTS.commit_stall_seconds),
            ),
            PanelSpec(
                "Clean monitor shutdowns",
                "When each monitor of the last day shut down cleanly (the end of its job) and "
                "withdrew its target; ObsckptMonitorDown does not count a scrape job left "
                "without targets after one as a lost monitor.",
                "dateTimeAsIso",
                [
                    (
                        "max by (instance) (last_over_time("
                        f"{m('obsckpt_monitor_shutdown_timestamp_seconds')}[1d]) > 0) * 1000",
                        "{{instance}}",
                    )
                ],
                viz="stat",
                width=24,
                height=4,
                instant=True,
            ),
            PanelSpec(
                "Commit phase time",
                "Where a commit's time goes: scan, fsync_files, manifest, rename_iteration on "
                "a local root; head_check, manifest_put, pointer_cas on an s3:// one (failed "
                "and timed-out phases included): the last commit's (kept until the next), "
                "and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_commit_phase_seconds", ("phase",), "{{phase}}"),
                width=8,
            ),
            PanelSpec(
                "Commit phase in progress",
                "How long the running commit has been in its phase, per monitor; empty while "
                "none runs (the start timestamp is 0). ObsckptCommitPhaseStuck fires past its "
                "threshold (a hung fsync).",
                "s",
                [
                    (
                        "time() - max by (instance, phase) "
                        f"({m('obsckpt_commit_phase_started_timestamp_seconds')} > 0)",
                        "{{instance}} {{phase}}",
                    )
                ],
                width=8,
                thresholds=alert_line(ALERTS.commit_phase_stuck_seconds),
            ),
            PanelSpec(
                "Fenced monitors and failed node queries",
                "Monitors that no longer own their root and commit nothing (shut down, or "
                "their lock file replaced by another monitor's), and failed asks of Ray for "
                "dead nodes.",
                "none",
                [
                    (f"max by (instance) ({m('obsckpt_monitor_fenced')})", "fenced {{instance}}"),
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_node_queries_failed_total')}[{RATE}]))",
                        "node queries failed {{instance}}",
                    ),
                ],
                width=8,
            ),
        ],
    ),
    (
        "Failures and stragglers",
        [
            PanelSpec(
                "Failures",
                "Failed saves per slot and steps that will never commit.",
                "none",
                [
                    (
                        f"sum by (slot, kind) (increase({FAILED_SAVES}[{RATE}]))",
                        "failed saves {{slot}} {{kind}}",
                    ),
                    (
                        f"sum by (kind) (increase({m('obsckpt_step_failures_total')}[{RATE}]))",
                        "failed steps {{kind}}",
                    ),
                ],
            ),
            PanelSpec(
                "Slowest ranks (last save)",
                "The ten ranks whose last save took longest, per slot.",
                "s",
                [
                    (
                        "topk(10, max by (rank, slot) "
                        f"({m('obsckpt_rank_last_save_duration_seconds')}))",
                        "rank {{rank}} {{slot}}",
                    )
                ],
                viz="bargauge",
                instant=True,
            ),
            PanelSpec(
                "Staging memory",
                "Host memory held for staging per slot in the worker processes, and the "
                "pinned (CUDA-registered) part of it.",
                "bytes",
                [
                    (f"sum by (slot) ({m('obsckpt_staging_bytes')})", "staging {{slot}}"),
                    (f"sum by (slot) ({m('obsckpt_staging_pinned_bytes')})", "pinned {{slot}}"),
                ],
            ),
            PanelSpec(
                "Cold saves",
                "Saves that allocated their staging on the training path (no prepare() for "
                "these shapes): their stall includes allocation and page faults.",
                "none",
                [
                    (
                        f"sum by (slot) (increase({m('obsckpt_staging_cold_saves_total')}[{RATE}]))",
                        "{{slot}}",
                    )
                ],
                width=6,
            ),
            PanelSpec(
                "Saves past the slot limit",
                'Saves recorded under slot="_other": their slot was not among the first '
                "max_slot_labels slots of its monitor (slot names that carry a step or a "
                "time do this). The monitor's log names the first such slot.",
                "none",
                [
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_slot_label_overflows_total')}[{RATE}]))",
                        "{{instance}}",
                    )
                ],
                width=6,
            ),
            PanelSpec(
                "Rejected /metrics connections",
                "Scrapes this monitor's /metrics endpoint refused (too many open at once, or "
                "out of file descriptors): Prometheus sees failed scrapes, and "
                "ObsckptMonitorDown may follow.",
                "none",
                [
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_metrics_connections_rejected_total')}[{RATE}]))",
                        "{{instance}}",
                    )
                ],
                height=6,
            ),
            PanelSpec(
                "Leftovers removed at start",
                "obsckpt's own temp files and scratch directories of writes cut short (a "
                "killed rank or monitor) that each monitor removed at its start; the "
                "monitor's log names them.",
                "none",
                [(f"max by (instance) ({m('obsckpt_leftovers_removed_total')})", "{{instance}}")],
                height=6,
            ),
        ],
    ),
    (
        "Weight sync",
        [
            PanelSpec(
                "Broadcast duration",
                "One weight sync from trainer rank 0 to the rollout side: the last one "
                "(kept until the next), and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_broadcast_duration_seconds", ("backend",), "{{backend}}"),
                width=8,
            ),
            PanelSpec(
                "Broadcast bandwidth",
                "Bytes per second: the last weight sync's (its bytes over its duration, kept "
                "until the next, so it shows at any sync interval), and over $window, "
                "averaged over time and while a broadcast runs.",
                "Bps",
                [
                    LAST_SYNC_BANDWIDTH,
                    (
                        f"sum by (backend) (rate({m('obsckpt_broadcast_bytes_total')}[{WINDOW}]))",
                        "{{backend}} average",
                    ),
                    (
                        f"sum by (backend) (increase({m('obsckpt_broadcast_bytes_total')}[{WINDOW}]))"
                        " / sum by (backend) "
                        f"(increase({m('obsckpt_broadcast_duration_seconds_sum')}[{WINDOW}]))",
                        "{{backend}} while broadcasting",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "State dict upload duration",
                "One state dict upload to the Synchronizer: the last one (kept until the "
                "next), and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_state_dict_upload_duration_seconds", (), ""),
                width=8,
            ),
            PanelSpec(
                "Trainer vs rollout model version",
                "Model version held by each side and the gap between them, per monitor "
                "(one per training job).",
                "none",
                [
                    (
                        f"max by (instance, role) ({m('obsckpt_model_version')})",
                        "{{instance}} {{role}}",
                    ),
                    (
                        f"{TRAINER_VERSION} - ignoring (role) {ROLLOUT_VERSION}",
                        "{{instance}} lag (versions)",
                    ),
                ],
                width=16,
            ),
            PanelSpec(
                "Weight-sync failures",
                "Weight syncs that raised (peer died or stalled past the timeout) per "
                "monitor, over $window; each breaks its group, which is formed again for the "
                "next sync. ObsckptWeightSyncFailures fires on any.",
                "none",
                [
                    (
                        "sum by (instance, backend, method, reason) "
                        f"(increase({m('obsckpt_broadcast_failures_total')}[{WINDOW}]))",
                        "{{instance}} {{method}} {{backend}} {{reason}}",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "Rollout pause",
                "How long the slowest receiver was inside one delta-capable sync (from its "
                "start to its weights applied and verified): the last one (kept until the "
                "next, so it shows however rarely weights sync), and the mean and "
                "percentiles over $window.",
                "s",
                latency("obsckpt_rollout_pause_seconds", ("method",), "{{method}}"),
                width=8,
            ),
            PanelSpec(
                "Sync phases",
                "Seconds each phase of a delta-capable sync took: snapshot (the trainer's "
                "host copy, the next delta's base), encode, wire, apply (the slowest "
                "receiver), verify. The last sync's (kept until the next), and the mean and "
                "percentiles over $window.",
                "s",
                latency("obsckpt_weight_sync_phase_seconds", ("sync_phase",), "{{sync_phase}}"),
                width=8,
            ),
            PanelSpec(
                "Bytes sent vs full state",
                "The last sync's bytes on the wire over the whole state's (1 for a full "
                "sync) and the fraction of values that changed at the last delta, both kept "
                "until the next sync; and the bytes sent over the state's over $window.",
                "percentunit",
                [
                    (
                        f"max by (instance, encoding) ({m('obsckpt_last_weight_sync_sent_bytes')}"
                        f" / ({m('obsckpt_last_weight_sync_state_bytes')} > 0))",
                        "{{instance}} sent / full ({{encoding}})",
                    ),
                    (
                        f"max by (instance) ({m('obsckpt_weight_sync_changed_fraction')})",
                        "{{instance}} changed values",
                    ),
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_weight_sync_sent_bytes_total')}[{WINDOW}]))"
                        " / sum by (instance) "
                        f"(increase({m('obsckpt_weight_sync_state_bytes_total')}[{WINDOW}]) > 0)",
                        "{{instance}} sent / full over $window",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "Integrity failures",
                "Delta-capable syncs that failed a check on a receiver, per monitor: "
                "checksum (a chunk damaged on the way, nothing applied) or digest (weights "
                "differing from the trainer's after the apply); each receiver keeps its "
                "version and the next sync is full. Totals since the monitor started, so "
                "one failure a day still shows. ObsckptWeightSyncCorrupt fires on any.",
                "none",
                [
                    (
                        f"max by (instance, check) ({m('obsckpt_weight_sync_corrupt_total')})",
                        "{{instance}} {{check}}",
                    ),
                ],
                width=12,
                thresholds=FAILURES_RED,
            ),
            PanelSpec(
                "Rollout version lag",
                "After the last delta-capable sync, how many versions the receiver furthest "
                "behind lags the trainer (kept until the next sync). "
                "ObsckptRolloutVersionLag fires past the line.",
                "none",
                [
                    (
                        f"max by (instance) ({m('obsckpt_weight_sync_version_lag')})",
                        "{{instance}}",
                    ),
                ],
                width=12,
                thresholds=alert_line(ALERTS.rollout_version_max_lag),
            ),
        ],
    ),
    (
        "Checkpoint store (s3:// roots)",
        [
            PanelSpec(
                "Uploads per slot",
                "How long one save's upload to the s3:// root took, per slot (serialising, "
                "every part, completing the object): the last one's (kept until the next, "
                "so it shows however rarely a job saves) and the mean and percentiles over "
                "$window.",
                "s",
                latency("obsckpt_store_upload_seconds", ("slot",), "{{slot}}"),
                width=8,
            ),
            PanelSpec(
                "Upload throughput per slot",
                "Bytes the ranks' saves uploaded per second over $window, per slot.",
                "Bps",
                [
                    (
                        f"sum by (slot) (rate({m('obsckpt_store_upload_bytes_total')}[{WINDOW}]))",
                        "{{slot}}",
                    )
                ],
                width=8,
            ),
            PanelSpec(
                "Store errors, conflicts and fenced commits",
                "Requests to the endpoint that failed, by operation and code (ObsckptStoreErrors "
                "fires on any); compare-and-swap races settled by reading the pointer; commits "
                "refused because another monitor took the root. Over $window, so one error "
                "an hour still shows.",
                "none",
                [
                    (
                        "sum by (instance, operation, code) "
                        f"(increase({m('obsckpt_store_request_errors_total')}[{WINDOW}]))",
                        "{{instance}} {{operation}} {{code}}",
                    ),
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_store_cas_conflicts_total')}[{WINDOW}]))",
                        "CAS conflicts {{instance}}",
                    ),
                    (
                        "sum by (instance) "
                        f"(increase({m('obsckpt_store_fenced_commits_total')}[{WINDOW}]))",
                        "fenced commits {{instance}}",
                    ),
                ],
                width=8,
                thresholds=FAILURES_RED,
            ),
            PanelSpec(
                "Mirror: steps committed locally and on S3",
                "For a local root with a mirror (OBSCKPT_MIRROR): the step each kind's "
                "iteration file names, and the step the mirror has committed. The mirror "
                "trails while it copies; a gap that stays means its copies fail (next panel).",
                "none",
                [
                    (
                        f"max by (instance, kind) ({m('obsckpt_mirror_latest_step')})",
                        "mirror {{kind}} {{instance}}",
                    ),
                    (
                        f"max by (instance, kind) ({m('obsckpt_latest_step')} "
                        f"and on (instance, kind) {m('obsckpt_mirror_latest_step')})",
                        "local {{kind}} {{instance}}",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "Mirror copies",
                "Time to copy one committed step to the mirror and commit it there: the "
                "last one's (kept until the next) and the mean and percentiles over $window.",
                "s",
                latency("obsckpt_mirror_copy_seconds", (), "copy"),
                width=8,
            ),
            PanelSpec(
                "Mirror throughput and failures",
                "Bytes uploaded to the mirror per second over $window, and steps whose copy "
                "failed over $window (status()['mirror']['error'] says why).",
                "none",
                [
                    (
                        f"sum by (instance) (rate({m('obsckpt_mirror_upload_bytes_total')}"
                        f"[{WINDOW}]))",
                        "bytes/s {{instance}}",
                    ),
                    (
                        f"sum by (instance) (increase({m('obsckpt_mirror_failures_total')}"
                        f"[{WINDOW}]))",
                        "failed copies {{instance}}",
                    ),
                ],
                width=8,
                thresholds=FAILURES_RED,
            ),
        ],
    ),
]


def _target(ref: str, expr: str, legend: str, instant: bool) -> prom_b.Dataquery:
    query = prom_b.Dataquery().ref_id(ref).expr(expr).legend_format(legend).datasource(DATASOURCE)
    return query.instant() if instant else query.range()


def _thresholds(steps: tuple[tuple[float | None, str], ...]) -> dash_b.ThresholdsConfig:
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=value, color=colour) for value, colour in steps])
    )


def _panel(spec: PanelSpec, panel_id: int):
    if spec.viz == "stat":
        # Without thresholds of its own a stat panel gets Grafana's default (red at
        # 80): a step number or a timestamp would read as an alarm. Those show
        # uncoloured; the others are coloured by the alert they refer to.
        colour = spec.thresholds is not None
        panel = (
            stat.Panel()
            .graph_mode(common_m.BigValueGraphMode.AREA)
            .color_mode(
                common_m.BigValueColorMode.VALUE if colour else common_m.BigValueColorMode.NONE
            )
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
            .thresholds(_thresholds(spec.thresholds if colour else ((None, "text"),)))
        )
    elif spec.viz == "bargauge":
        panel = (
            bargauge.Panel()
            .display_mode(common_m.BarGaugeDisplayMode.GRADIENT)
            .orientation(common_m.VizOrientation.HORIZONTAL)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    elif spec.viz == "timeseries":
        panel = (
            timeseries.Panel()
            .legend(
                common_b.VizLegendOptions()
                .show_legend(True)
                .display_mode(common_m.LegendDisplayMode.TABLE)
                .placement(common_m.LegendPlacement.BOTTOM)
                .calcs(["lastNotNull", "max"])
            )
            .tooltip(
                common_b.VizTooltipOptions()
                .mode(common_m.TooltipDisplayMode.MULTI)
                .sort(common_m.SortOrder.DESCENDING)
            )
            .fill_opacity(10)
        )
        if spec.thresholds is not None:
            panel = panel.thresholds(_thresholds(spec.thresholds)).thresholds_style(
                common_b.GraphThresholdsStyleConfig().mode(common_m.GraphTresholdsStyleMode.DASHED)
            )
    else:
        raise ValueError(f"panel {spec.title!r}: unknown viz {spec.viz!r}")
    panel = (
        panel.id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DATASOURCE)
        .unit(spec.unit)
        .span(spec.width)
        .height(spec.height)
    )
    for i, (expr, legend) in enumerate(spec.targets):
        panel = panel.with_target(_target(chr(ord("A") + i), expr, legend, spec.instant))
    return panel


def _alert_list(panel_id: int) -> dash_b.Panel:
    """The obsckpt alerts Prometheus evaluates, firing and pending, for the selected job."""
    return (
        dash_b.Panel()
        .type("alertlist")
        .id(panel_id)
        .title("obsckpt alerts")
        .description(
            "Alert rules of deploy/prometheus/rules (data source-managed) that are firing or "
            "pending for the selected jobs; each links its runbook section."
        )
        .span(24)
        .height(6)
        .options(
            {
                "viewMode": "list",
                "groupMode": "default",
                "groupBy": [],
                "maxItems": 20,
                "sortOrder": 1,
                "dashboardAlerts": False,
                "alertName": "Obsckpt",
                # Grafana fills in the variables here; the "datasource" option (a data
                # source name) is left out: it would not be.
                "alertInstanceLabelFilter": '{job=~"$job"}',
                "showInstances": True,
                "stateFilter": {
                    "firing": True,
                    "pending": True,
                    "noData": False,
                    "normal": False,
                    "error": True,
                },
            }
        )
    )


def _traces_link() -> dash_b.DashboardLink:
    pane = {
        "datasource": TEMPO_UID,
        "queries": [
            {
                "refId": "A",
                "datasource": {"type": "tempo", "uid": TEMPO_UID},
                "queryType": "traceql",
                "query": '{ name = "obsckpt.checkpoint" }',
            }
        ],
        "range": {"from": "now-1h", "to": "now"},
    }
    query = urllib.parse.quote(json.dumps(pane, separators=(",", ":"), sort_keys=True))
    return (
        dash_b.DashboardLink("Checkpoint traces (Tempo)")
        .type(dash_m.DashboardLinkType.LINK)
        .url(f"/explore?left={query}")
        .icon("external link")
        .target_blank(True)
        .keep_time(True)
    )


def _all_of(name: str, label: str, query: str) -> dash_b.QueryVariable:
    """A multi-value variable whose "All" matches every value, and no label at all."""
    return (
        dash_b.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(query)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .current(dash_m.VariableOption(selected=True, text="All", value="$__all"))
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )


def build_dashboard() -> dict:
    """The dashboard as the JSON object Grafana provisions."""
    builder = (
        dash_b.Dashboard(TITLE)
        .uid(UID)
        .description("Asynchronous checkpoint saves, commits and weight sync of obsckpt jobs.")
        .tags(["obsckpt", "checkpointing", "ray"])
        .editable()
        .refresh("10s")
        .time("now-1h", "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
        .link(_traces_link())
        .with_variable(
            dash_b.DatasourceVariable("datasource").label("Data source").type("prometheus")
        )
        .with_variable(
            dash_b.QueryVariable("job")
            .label("Job")
            .datasource(DATASOURCE)
            .query("label_values(obsckpt_latest_step, job)")
            .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        )
        .with_variable(
            _all_of(
                "namespace",
                "Ray namespace",
                'label_values(obsckpt_latest_step{job=~"$job"}, obsckpt_namespace)',
            )
        )
        .with_variable(
            _all_of(
                "instance",
                "Monitor",
                "label_values(obsckpt_latest_step"
                '{job=~"$job", obsckpt_namespace=~"$namespace"}, instance)',
            )
        )
        .with_variable(
            dash_b.IntervalVariable("window")
            .label("Latency window")
            .description(
                "Window of the latency percentiles: longer than the save interval, or "
                "the panels are empty between saves."
            )
            .values(",".join(WINDOWS))
            .current(dash_m.VariableOption(selected=True, text=WINDOWS[0], value=WINDOWS[0]))
        )
    )
    panel_id = 1
    for title, specs in ROWS:
        builder = builder.with_row(dash_b.Row(title).id(panel_id))
        panel_id += 1
        for spec in specs:
            builder = builder.with_panel(_panel(spec, panel_id))
            panel_id += 1
        if title == "Overview":
            builder = builder.with_panel(_alert_list(panel_id))
            panel_id += 1
    # Round-trip through JSON: the SDK's objects serialise themselves via to_json.
    return json.loads(json.dumps(builder.build(), cls=JSONEncoder))


def dashboard_json() -> str:
    """The text of dashboards/obsckpt.json."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True, slots=True)
class PanelQuery:
    """One query of one panel, as written in the dashboard (variables unexpanded)."""

    panel: str
    ref_id: str
    expr: str
    legend: str


def panel_queries(dashboard: dict | None = None) -> list[PanelQuery]:
    """Every Prometheus query of the dashboard, in panel order."""
    board = dashboard if dashboard is not None else build_dashboard()
    return [
        PanelQuery(panel["title"], target["refId"], target["expr"], target.get("legendFormat", ""))
        for panel in board["panels"]
        if panel.get("type") != "row"
        for target in panel.get("targets", [])
    ]


def expand(
    expr: str,
    *,
    job: str = ".+",
    instance: str = ".*",
    namespace: str = ".*",
    window: str = WINDOWS[0],
    rate_interval: str = "1m",
) -> str:
    """``expr`` with the dashboard variables replaced, ready for Prometheus' HTTP API."""
    out = (
        expr.replace("$__rate_interval", rate_interval)
        .replace("$job", job)
        .replace("$instance", instance)
        .replace("$namespace", namespace)
        .replace("$window", window)
    )
    leftover = re.findall(r"\$\w+", out)
    if leftover:
        raise ValueError(f"query still has variables {leftover} after expansion: {out}")
    return out
