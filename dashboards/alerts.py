"""Prometheus alert rules for obsckpt, generated from code.

Thresholds are arguments of :func:`alert_rules`, so the committed rules file
(production defaults) and the end-to-end test (seconds instead of minutes) come
from the same expressions.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from obsckpt import __version__, assets, validators

# Alertmanager shows runbook_url as a link: it must be absolute. The default is
# the runbook of this version in the project's repository; a deployment with its
# own copy (a wiki, an internal Git host) sets OBSCKPT_RUNBOOK_URL when it builds
# the rules (make dashboards) or exports them (obsckpt dashboards export).
RUNBOOK_URL_ENV = assets.RUNBOOK_URL_ENV
DEFAULT_RUNBOOK_URL = f"https://github.com/obsckpt/obsckpt/blob/v{__version__}/docs/runbook.md"
DEFAULT_JOB = "obsckpt"


def runbook_url_from_env(value: str | None = None) -> str:
    """The runbook URL: ``value``, else $OBSCKPT_RUNBOOK_URL, else the project's."""
    return assets.runbook_url(value, DEFAULT_RUNBOOK_URL)


@dataclass(kw_only=True, slots=True)
class AlertThresholds:
    """When each alert fires.

    Attributes:
        commit_stall_seconds: age of the oldest pending step beyond which a commit
            counts as stalled.
        commit_stall_for: how long the stall must persist before firing.
        no_commit_seconds: time without any commit (after a first one) that is
            worth a warning.
        no_commit_for: how long that must persist.
        failure_window: window over which failed saves and failed steps count.
        monitor_down_for: how long the scrape target may be down or absent.
        monitor_job: Prometheus job name of the monitor's scrape target.
        weight_sync_max_lag: trainer minus rollout model version above which the
            rollout side counts as lagging.
        weight_sync_for: how long the lag must persist.
        missed_scrape_window: how long a gauge's last scraped value stands in for
            it when scrapes fail (a failed scrape marks the target's series stale),
            so a missed scrape does not reset the ``for`` timer of the alerts that
            read gauges; longer than the scrape interval.
        finished_quiet_for: how long after a monitor's clean shutdown (the end of
            a job) ObsckptMonitorDown stays quiet about the scrape job having no
            target at all.
        commit_phase_stuck_seconds: how long one phase of a running commit (an fsync
            round, a rename) may take before it counts as hung; below the fsync
            timeout (obsckpt.store.commit.FSYNC_TIMEOUT_S), so the alert fires while it hangs.
        commit_phase_stuck_for: how long that must persist.
        weight_sync_failure_window: window over which a failed weight sync fires
            ObsckptWeightSyncFailures.
        rollout_stale_window: how long the rollout side's model version may stay
            unchanged while the trainer's is ahead before its weights count as stale.
        rollout_stale_for: how long that must persist.
        rollout_version_max_lag: versions the receiver furthest behind may lag the
            trainer after a delta-capable sync before ObsckptRolloutVersionLag counts it.
        rollout_version_lag_for: how long that must persist.
        weight_sync_corrupt_window: window over which a failed integrity check fires
            ObsckptWeightSyncCorrupt.
        mirror_behind_for: how long a monitor's mirror may stay behind its local root
            (copies failing, or slower than the steps come) before ObsckptMirrorBehind.
        runbook_base: absolute URL of docs/runbook.md; anchors are appended.
    """

    commit_stall_seconds: float = 900.0
    commit_stall_for: str = "1m"
    no_commit_seconds: float = 7200.0
    no_commit_for: str = "5m"
    failure_window: str = "15m"
    monitor_down_for: str = "2m"
    monitor_job: str = DEFAULT_JOB
    weight_sync_max_lag: float = 4.0
    weight_sync_for: str = "10m"
    missed_scrape_window: str = "2m"
    finished_quiet_for: str = "7d"
    commit_phase_stuck_seconds: float = 600.0
    commit_phase_stuck_for: str = "1m"
    weight_sync_failure_window: str = "15m"
    rollout_stale_window: str = "30m"
    rollout_stale_for: str = "5m"
    rollout_version_max_lag: float = 2.0
    rollout_version_lag_for: str = "10m"
    weight_sync_corrupt_window: str = "1h"
    mirror_behind_for: str = "30m"
    runbook_base: str = DEFAULT_RUNBOOK_URL

    def __post_init__(self) -> None:
        for name in (
            "commit_stall_seconds",
            "no_commit_seconds",
            "weight_sync_max_lag",
            "commit_phase_stuck_seconds",
            "rollout_version_max_lag",
        ):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
            ):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            lags = ("weight_sync_max_lag", "rollout_version_max_lag")
            if value < 0 or (value == 0 and name not in lags):
                limit = "not be negative" if name in lags else "be positive"
                raise ValueError(f"{name} must {limit}, got {value!r}")
        for name in (
            "commit_stall_for",
            "no_commit_for",
            "monitor_down_for",
            "weight_sync_for",
            "commit_phase_stuck_for",
            "rollout_stale_for",
            "rollout_version_lag_for",
            "mirror_behind_for",
        ):
            _check_duration(name, getattr(self, name))
        # A range of 0 is a PromQL error: the whole rule file would fail to load.
        for name in (
            "failure_window",
            "missed_scrape_window",
            "finished_quiet_for",
            "weight_sync_failure_window",
            "rollout_stale_window",
            "weight_sync_corrupt_window",
        ):
            if _check_duration(name, getattr(self, name)) == 0:
                raise ValueError(f"{name} must be longer than 0, got {getattr(self, name)!r}")
        if not isinstance(self.monitor_job, str) or not self.monitor_job:
            raise ValueError(f"monitor_job must be a job name, got {self.monitor_job!r}")
        validators.validate_url(self.runbook_base, "runbook_base", example=DEFAULT_RUNBOOK_URL)


# Prometheus' duration syntax: units largest first, each at most once ("1h30m", "90s").
_DURATION = re.compile(
    r"(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?"
)
_UNIT_SECONDS = (365 * 86400, 7 * 86400, 86400, 3600, 60, 1, 0.001)


def duration_seconds(duration: str) -> float:
    """Seconds in a Prometheus duration such as ``"15m"`` or ``"1h30m"``.

    Raises:
        ValueError: ``duration`` is not one Prometheus accepts.
    """
    match = _DURATION.fullmatch(duration) if isinstance(duration, str) else None
    if not duration or match is None:
        raise ValueError(
            f"{duration!r} is not a Prometheus duration: write an integer and a unit, "
            'largest first, e.g. "90s", "15m" or "1h30m" (units ms, s, m, h, d, w, y)'
        )
    return sum(int(n) * unit for n, unit in zip(match.groups(), _UNIT_SECONDS, strict=True) if n)


def _check_duration(name: str, value: object) -> float:
    try:
        return duration_seconds(value)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _num(value: float) -> str:
    """A threshold as PromQL writes it, exactly: 900, not 900.0 or 9e+02."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def runbook_anchor(alert: str) -> str:
    """The anchor of an alert's section: GitHub's slug of the heading ``## <alert>``."""
    return alert.lower()


def alert_rules(thresholds: AlertThresholds | None = None) -> list[dict]:
    """The alerting rules, as dicts in Prometheus' rule file format."""
    t = thresholds if thresholds is not None else AlertThresholds()
    stall = _num(t.commit_stall_seconds)
    no_commit = _num(t.no_commit_seconds)
    lag = _num(t.weight_sync_max_lag)
    stuck = _num(t.commit_phase_stuck_seconds)
    job = t.monitor_job
    window = t.missed_scrape_window

    def last(selector: str) -> str:
        """A gauge's last value in the window: a failed scrape leaves no gap in it."""
        return f"last_over_time({selector}[{window}])"

    trainer = last('obsckpt_model_version{role="trainer"}')
    rollout = last('obsckpt_model_version{role="rollout"}')
    # A monitor's target labels: the file_sd entry it writes adds its Ray namespace.
    by = "job, instance, obsckpt_namespace, kind"

    def runbook(alert: str) -> str:
        return f"{t.runbook_base}#{runbook_anchor(alert)}"

    sync_window = t.weight_sync_failure_window
    failures = "obsckpt_broadcast_failures_total"
    sync_by = "job, instance, obsckpt_namespace, method, reason"
    stale_window = t.rollout_stale_window
    store_errors = "obsckpt_store_request_errors_total"
    store_by = "job, instance, obsckpt_namespace, operation, code"
    fenced = "obsckpt_store_fenced_commits_total"
    corrupt = "obsckpt_weight_sync_corrupt_total"
    corrupt_window = t.weight_sync_corrupt_window
    version_lag = last("obsckpt_weight_sync_version_lag")
    max_version_lag = _num(t.rollout_version_max_lag)

    return [
        {
            "alert": "ObsckptCommitStalled",
            # The start timestamp is 0 when nothing is pending; without the guard
            # time() - 0 would read as a 55-year-old step.
            "expr": (
                f"(time() - {last('obsckpt_oldest_pending_step_start_timestamp_seconds')})"
                f" > {stall}\n"
                f"and {last('obsckpt_oldest_pending_step_start_timestamp_seconds')} > 0\n"
                f"and {last('obsckpt_pending_steps')} > 0\n"
            ),
            "for": t.commit_stall_for,
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": "Checkpoint commit stalled ({{ $labels.kind }}, job {{ $labels.job }})",
                "description": (
                    "The oldest pending {{ $labels.kind }} step of job {{ $labels.job }} "
                    'started {{ $value | printf "%.0f" }} s ago and is not committed '
                    f"(threshold {stall} s). A save is hung or never reported back; "
                    "until it finishes, latest_*_iteration.txt stays on the previous step."
                ),
                "runbook_url": runbook("ObsckptCommitStalled"),
            },
        },
        {
            "alert": "ObsckptNoRecentCommit",
            # Only after a first commit: a kind the job never saves keeps its
            # timestamp at 0 and must not fire.
            "expr": (
                f"(time() - {last('obsckpt_last_commit_timestamp_seconds')}) > {no_commit}\n"
                f"and {last('obsckpt_last_commit_timestamp_seconds')} > 0\n"
            ),
            "for": t.no_commit_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": "No {{ $labels.kind }} commit recently (job {{ $labels.job }})",
                "description": (
                    "Job {{ $labels.job }} last committed a {{ $labels.kind }} step "
                    '{{ $value | printf "%.0f" }} s ago '
                    f"(threshold {no_commit} s). Training may have stopped "
                    "checkpointing; a crash now loses everything since then."
                ),
                "runbook_url": runbook("ObsckptNoRecentCommit"),
            },
        },
        {
            "alert": "ObsckptSaveFailures",
            # Per monitor: several training jobs share the scrape job, and the on-call
            # needs to know which one fails. The last term: an error series that
            # appeared within the window already counting (a slot's first save
            # failed), which increase() reads as 0. An old series missing a window ago
            # only because that scrape failed (or Prometheus was down) is not new: the
            # target must have been scraped then, or be new itself (no target a window
            # ago, while Prometheus scraped others: a job whose first saves failed
            # before its first scrape).
            "expr": (
                f"sum by ({by}) ("
                f"increase(obsckpt_step_failures_total[{t.failure_window}])) > 0\n"
                f"or sum by ({by}) ("
                f'increase(obsckpt_saves_total{{result="error"}}[{t.failure_window}])) > 0\n'
                f"or sum by ({by}) (\n"
                f'  (obsckpt_saves_total{{result="error"}} > 0\n'
                f'    unless obsckpt_saves_total{{result="error"}} offset {t.failure_window})\n'
                f"  and on (job, instance) (\n"
                f"    up offset {t.failure_window} == 1\n"
                f"    or ((up unless on (job, instance) up offset {t.failure_window})\n"
                f"      and on () (count(up offset {t.failure_window}) > 0)))) > 0\n"
            ),
            "for": "0m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Checkpoint saves failing ({{ $labels.kind }}, job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The training job whose monitor is {{ $labels.instance }} had failed "
                    "{{ $labels.kind }} saves or steps "
                    f"in the last {t.failure_window}. A failed step is never committed; "
                    "the iteration file stays on the last whole step."
                ),
                "runbook_url": runbook("ObsckptSaveFailures"),
            },
        },
        {
            "alert": "ObsckptMonitorDown",
            # No target at all is quiet for a while after a clean shutdown: the
            # monitor withdraws its target then, after a last scrape that carries
            # its shutdown timestamp.
            "expr": (
                f'up{{job="{job}"}} == 0\n'
                f'or (absent(up{{job="{job}"}})\n'
                "  unless on () max(last_over_time("
                f'obsckpt_monitor_shutdown_timestamp_seconds{{job="{job}"}}'
                f"[{t.finished_quiet_for}])) > 0)\n"
            ),
            "for": t.monitor_down_for,
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": f"obsckpt monitor not scraped (job {job})",
                "description": (
                    f"Prometheus has no healthy target for job {job}: the checkpoint "
                    "monitor actor is down, its /metrics endpoint is unreachable, or "
                    "its file_sd file was never written. Checkpoint state is unobserved. "
                    "(A job that finished cleanly does not count: its monitor reported its "
                    "shutdown before withdrawing its target.)"
                ),
                "runbook_url": runbook("ObsckptMonitorDown"),
            },
        },
        {
            "alert": "ObsckptWeightSyncLagging",
            # Each monitor (one per training job) on its own: several jobs share the
            # scrape job. Guarded on a first sync, so a job without a rollout side
            # stays quiet.
            "expr": (
                f"{trainer}\n- ignoring (role) {rollout}\n> {lag}\n"
                f"and ignoring (role) {rollout} > 0\n"
            ),
            "for": t.weight_sync_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Rollout weights lag the trainer (job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The rollout side of the training job whose monitor is "
                    "{{ $labels.instance }} is "
                    '{{ $value | printf "%.0f" }} model versions behind the trainer '
                    f"(threshold {lag}). Rollouts are generated with stale weights."
                ),
                "runbook_url": runbook("ObsckptWeightSyncLagging"),
            },
        },
        {
            "alert": "ObsckptCommitPhaseStuck",
            # A commit's phase start is 0 except while that phase runs: the alert sees a
            # hung fsync while it hangs, before the fsync timeout fails the step.
            "expr": (
                "(time() - "
                f"{last('obsckpt_commit_phase_started_timestamp_seconds')}) > {stuck}\n"
                f"and {last('obsckpt_commit_phase_started_timestamp_seconds')} > 0\n"
            ),
            "for": t.commit_phase_stuck_for,
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": (
                    "Checkpoint commit stuck in {{ $labels.phase }} (job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The commit running in the monitor {{ $labels.instance }} has been in its "
                    '{{ $labels.phase }} phase for {{ $value | printf "%.0f" }} s '
                    f"(threshold {stuck} s): an fsync or rename on the checkpoint storage "
                    "is not returning (a hung network filesystem?). Commits run one at a "
                    "time, so no later step commits until it returns or its fsync times out."
                ),
                "runbook_url": runbook("ObsckptCommitPhaseStuck"),
            },
        },
        {
            "alert": "ObsckptWeightSyncFailures",
            # A failure's series appears with its first failure (labels method and
            # reason), already at 1, which increase() reads as 0: the last term
            # counts a series new within the window, as ObsckptSaveFailures does (a
            # target scraped a window ago, or new itself; not one that merely
            # missed that scrape).
            "expr": (
                f"sum by ({sync_by}) (increase({failures}[{sync_window}])) > 0\n"
                f"or sum by ({sync_by}) (\n"
                f"  ({failures} > 0 unless {failures} offset {sync_window})\n"
                f"  and on (job, instance) (\n"
                f"    up offset {sync_window} == 1\n"
                f"    or ((up unless on (job, instance) up offset {sync_window})\n"
                f"      and on () (count(up offset {sync_window}) > 0)))) > 0\n"
            ),
            "for": "0m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Weight sync failing ({{ $labels.reason }}, job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "A {{ $labels.method }} weight sync of the training job whose monitor is "
                    "{{ $labels.instance }} raised ({{ $labels.reason }}) in the last "
                    f"{sync_window}: a peer died, stalled past the timeout or broke the "
                    "protocol. The group is broken and formed again for the next sync; "
                    "until one succeeds the rollout side keeps its old weights."
                ),
                "runbook_url": runbook("ObsckptWeightSyncFailures"),
            },
        },
        {
            "alert": "ObsckptRolloutWeightsStale",
            # Lagging counts versions; this one counts time: a slow trainer one version
            # ahead for an hour never trips the version gap, and its rollouts still run
            # on old weights. Guarded on a first sync, as the lag alert.
            "expr": (
                f"{trainer}\n- ignoring (role) {rollout}\n> 0\n"
                f'and ignoring (role) changes(obsckpt_model_version{{role="rollout"}}'
                f"[{stale_window}]) == 0\n"
                f"and ignoring (role) {rollout} > 0\n"
                # The rollout side has held its version for the whole window, not
                # only since its first sync a moment ago.
                f'and ignoring (role) present_over_time(obsckpt_model_version{{role="rollout"}}'
                f"[{window}] offset {stale_window})\n"
            ),
            "for": t.rollout_stale_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Rollout weights stale (job {{ $labels.job }}, monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The rollout side of the training job whose monitor is "
                    "{{ $labels.instance }} has not received new weights for "
                    f"{stale_window} while the trainer is "
                    '{{ $value | printf "%.0f" }} model versions ahead: weight syncs are '
                    "failing or not being made."
                ),
                "runbook_url": runbook("ObsckptRolloutWeightsStale"),
            },
        },
        {
            "alert": "ObsckptWeightSyncCorrupt",
            # The series exist at 0 from the monitor's start (one per check), so
            # increase() sees a first failure.
            "expr": (
                f"sum by (job, instance, obsckpt_namespace, method, check) "
                f"(increase({corrupt}[{corrupt_window}])) > 0\n"
            ),
            "for": "0m",
            "labels": {"severity": "critical"},
            "annotations": {
                "summary": (
                    "Weight sync corrupt ({{ $labels.check }}, job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "A {{ $labels.method }} weight sync of the training job whose monitor is "
                    "{{ $labels.instance }} failed its {{ $labels.check }} check on a "
                    f"receiver in the last {corrupt_window} (checksum: a chunk damaged on "
                    "the way, caught before it was applied; digest: the receiver's weights "
                    "differed from the trainer's after the apply). That receiver kept its "
                    "version and the next sync was a full one; repeated failures point at "
                    "the network, the host's memory, or a rollout writing into its weights."
                ),
                "runbook_url": runbook("ObsckptWeightSyncCorrupt"),
            },
        },
        {
            "alert": "ObsckptRolloutVersionLag",
            # Set by the trainer at each delta-capable sync and kept until the next, so
            # it holds however rarely weights sync.
            "expr": f"{version_lag} > {max_version_lag}\n",
            "for": t.rollout_version_lag_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "A rollout receiver lags the trainer (job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "After the last weight sync of the training job whose monitor is "
                    "{{ $labels.instance }}, the receiver furthest behind is "
                    '{{ $value | printf "%.0f" }} versions behind the trainer (threshold '
                    f"{max_version_lag}): it failed or refused the syncs since. Its "
                    "rollouts use old weights."
                ),
                "runbook_url": runbook("ObsckptRolloutVersionLag"),
            },
        },
        {
            "alert": "ObsckptStoreErrors",
            # Requests to an s3:// root's endpoint that failed, and commits refused
            # because another monitor took the root. An error's series appears with
            # its first error, already at 1: the second term counts a series new within
            # the window, as ObsckptWeightSyncFailures does.
            "expr": (
                f"sum by ({store_by}) (increase({store_errors}[{t.failure_window}])) > 0\n"
                f"or sum by ({store_by}) (\n"
                f"  ({store_errors} > 0 unless {store_errors} offset {t.failure_window})\n"
                f"  and on (job, instance) (\n"
                f"    up offset {t.failure_window} == 1\n"
                f"    or ((up unless on (job, instance) up offset {t.failure_window})\n"
                f"      and on () (count(up offset {t.failure_window}) > 0)))) > 0\n"
                f"or sum by (job, instance, obsckpt_namespace) "
                f"(increase({fenced}[{t.failure_window}])) > 0\n"
            ),
            "for": "0m",
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Checkpoint store errors (job {{ $labels.job }}, monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The monitor {{ $labels.instance }} met failing requests to its s3:// "
                    f"root's endpoint in the last {t.failure_window} (which operations and "
                    "codes: obsckpt_store_request_errors_total), or had a commit refused "
                    "because another monitor took the root. Steps whose commit failed are "
                    "not committed; the pointer still names the last whole step."
                ),
                "runbook_url": runbook("ObsckptStoreErrors"),
            },
        },
        {
            "alert": "ObsckptMirrorBehind",
            # The mirror's step is -1 until it holds one of the kind; a kind the job
            # never committed (its timestamp 0) is not behind.
            "expr": (
                f"{last('obsckpt_latest_step')}\n"
                f"  > on ({by}) {last('obsckpt_mirror_latest_step')}\n"
                f"and on ({by}) {last('obsckpt_last_commit_timestamp_seconds')} > 0\n"
            ),
            "for": t.mirror_behind_for,
            "labels": {"severity": "warning"},
            "annotations": {
                "summary": (
                    "Checkpoint mirror behind ({{ $labels.kind }}, job {{ $labels.job }}, "
                    "monitor {{ $labels.instance }})"
                ),
                "description": (
                    "The local root of the monitor {{ $labels.instance }} has committed "
                    '{{ $labels.kind }} step {{ $value | printf "%.0f" }}, and its s3:// '
                    "mirror has not "
                    f"caught up for {t.mirror_behind_for}: its copies fail, or take longer "
                    "than the steps come. A job restored from the mirror now would resume "
                    "from an older step (status()['mirror'] says which and why)."
                ),
                "runbook_url": runbook("ObsckptMirrorBehind"),
            },
        },
    ]


def rule_groups(thresholds: AlertThresholds | None = None) -> dict:
    """A whole rule file: one group holding every alert."""
    return {"groups": [{"name": "obsckpt", "rules": alert_rules(thresholds)}]}


ALERT_NAMES = tuple(rule["alert"] for rule in alert_rules())
