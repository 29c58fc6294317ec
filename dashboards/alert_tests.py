"""``promtool test rules`` cases for the alert rules, generated from the same code.

Each alert gets a synthetic series that makes it fire and one (or more) healthy
series where it must stay quiet. Series and evaluation times are derived from
the thresholds, so the cases keep testing the edges when a default changes.
Expected annotations are rendered here because promtool compares them exactly.
"""

from __future__ import annotations

import math
import re

from dashboards.alerts import AlertThresholds, alert_rules, duration_seconds

JOB = "obsckpt"
INSTANCE = "obsckpt:9400"
_TARGET = f'job="{JOB}",instance="{INSTANCE}"'
# Monitors of other training jobs, discovered into the same scrape job.
OTHER_INSTANCE = "obsckpt-b:9400"
_OTHER = f'job="{JOB}",instance="{OTHER_INSTANCE}"'
_THIRD = f'job="{JOB}",instance="obsckpt-c:9400"'


def _render(template: str, labels: dict[str, str], value: float | None) -> str:
    """Expand the two template forms the rules use: $labels.<name> and $value."""
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
    if value is not None:
        out = out.replace('{{ $value | printf "%.0f" }}', f"{value:.0f}")
    if "{{" in out:
        raise ValueError(f"template form not supported by the test renderer: {template!r}")
    return out


def _expected(
    alert: str, rules: dict[str, dict], labels: dict[str, str], value: float | None = None
) -> dict:
    rule = rules[alert]
    return {
        "exp_labels": {**labels, **rule["labels"]},
        "exp_annotations": {k: _render(v, labels, value) for k, v in rule["annotations"].items()},
    }


def _check(eval_minutes: int, alert: str, *expected: dict) -> dict:
    return {"eval_time": f"{eval_minutes}m", "alertname": alert, "exp_alerts": list(expected)}


def _series(name: str, labels: str, values: str) -> dict:
    return {"series": f"{name}{{{labels}}}", "values": values}


def alert_unit_tests(thresholds: AlertThresholds | None = None, rules_file: str = "") -> dict:
    """A promtool rule-test file exercising every alert of :func:`alert_rules`.

    Args:
        thresholds: the thresholds the rules file was generated with.
        rules_file: path of the rules file, relative to the test file.
    """
    t = thresholds if thresholds is not None else AlertThresholds()
    rules = {rule["alert"]: rule for rule in alert_rules(t)}
    ckpt = {"job": JOB, "instance": INSTANCE, "kind": "checkpoint"}
    ckpt_labels = f'{_TARGET},kind="checkpoint"'
    sd_labels = f'{_TARGET},kind="state_dict"'

    # ObsckptCommitStalled: a step starts at t=60 s and never commits.
    start = 60
    stall_min = math.ceil(t.commit_stall_seconds / 60)
    stall_fire = stall_min + 2 + math.ceil(duration_seconds(t.commit_stall_for) / 60) + 1
    stall_len = stall_fire + 5

    # A failed scrape (a staleness marker on every series of the target) exactly when
    # an alert is due: the alert fires on time all the same. Minutes at which a
    # condition first holds and an alert is first due:
    def due(first_true: int, for_: str) -> int:
        return first_true + math.ceil(duration_seconds(for_) / 60)

    gap_window_min = math.ceil(duration_seconds(t.missed_scrape_window) / 60)
    stall_due = due((start + int(t.commit_stall_seconds)) // 60 + 1, t.commit_stall_for)

    # ObsckptNoRecentCommit: one commit at t=300 s, then none.
    commit_at = 300
    quiet_min = math.ceil((commit_at + t.no_commit_seconds) / 60) - 1
    no_commit_fire = quiet_min + 2 + math.ceil(duration_seconds(t.no_commit_for) / 60) + 1

    # ObsckptSaveFailures: one failure after minute 10.
    window_min = math.ceil(duration_seconds(t.failure_window) / 60)
    # ... or one at minute 5, then a failed scrape, then Prometheus down for a while.
    gap_at = window_min + 20
    outage_at = gap_at + 2 * window_min + 10
    outage_end = outage_at + 2 * window_min

    def failing(instance: str) -> dict:
        """The failures alert firing for the checkpoint kind of the monitor at ``instance``."""
        labels = {"job": JOB, "instance": instance, "kind": "checkpoint"}
        return _expected("ObsckptSaveFailures", rules, labels)

    # ObsckptMonitorDown: target down from minute 6.
    down_for_min = math.ceil(duration_seconds(t.monitor_down_for) / 60)

    # ObsckptWeightSyncLagging: rollout falls behind after minute 10.
    behind = int(t.weight_sync_max_lag) + 6
    lag_fire = 11 + math.ceil(duration_seconds(t.weight_sync_for) / 60) + 3

    no_commit_due = due((commit_at + int(t.no_commit_seconds)) // 60 + 1, t.no_commit_for)
    lag_due = due(11, t.weight_sync_for)

    # ObsckptCommitPhaseStuck: a commit enters fsync_files at t=60 s and its fsync hangs.
    stuck_min = math.ceil(t.commit_phase_stuck_seconds / 60)
    stuck_fire = stuck_min + 2 + math.ceil(duration_seconds(t.commit_phase_stuck_for) / 60) + 1
    stuck_len = stuck_fire + 5
    stuck_due = due((start + int(t.commit_phase_stuck_seconds)) // 60 + 1, t.commit_phase_stuck_for)
    phase_gauge = "obsckpt_commit_phase_started_timestamp_seconds"
    hung = {"job": JOB, "instance": INSTANCE, "phase": "fsync_files"}

    def phase_labels(phase: str) -> str:
        return f'{_TARGET},phase="{phase}"'

    def stuck(minute: int) -> dict:
        """The stuck alert firing for the hung fsync_files phase at ``minute``."""
        alert = "ObsckptCommitPhaseStuck"
        return _check(minute, alert, _expected(alert, rules, hung, minute * 60 - start))

    def lagging(instance: str) -> dict:
        """The lag alert firing for the monitor at ``instance``, ``behind`` versions behind."""
        alert = "ObsckptWeightSyncLagging"
        labels = {"job": JOB, "instance": instance}
        return _check(lag_fire, alert, _expected(alert, rules, labels, behind))

    # ObsckptWeightSyncFailures: a sync of the monitor at INSTANCE times out.
    sync_min = math.ceil(duration_seconds(t.weight_sync_failure_window) / 60)
    sync_len = sync_min + 40
    sync_labels = f'{_TARGET},backend="nccl",method="broadcast",reason="timeout"'

    def sync_failing(minute: int) -> dict:
        labels = {"job": JOB, "instance": INSTANCE, "method": "broadcast", "reason": "timeout"}
        alert = "ObsckptWeightSyncFailures"
        return _check(minute, alert, _expected(alert, rules, labels))

    # ObsckptRolloutWeightsStale: the trainer moves one version ahead at minute 10 and
    # the rollout side, synced since minute 0, never catches up.
    stale_min = math.ceil(duration_seconds(t.rollout_stale_window) / 60)
    stale_for_min = math.ceil(duration_seconds(t.rollout_stale_for) / 60)
    stale_due = max(10, stale_min) + stale_for_min
    stale_len = stale_due + 20
    # ... or a rollout side that first syncs at minute 20, one version behind.
    late_start = 20
    late_due = late_start + stale_min + stale_for_min

    def stale(minute: int) -> dict:
        alert = "ObsckptRolloutWeightsStale"
        return _check(minute, alert, _expected(alert, rules, {"job": JOB, "instance": INSTANCE}, 1))

    # ObsckptStoreErrors: a first PUT error, or a fenced commit, a window and 10 minutes in
    # (a new series counts once its target has been scraped a window ago).
    store_min = math.ceil(duration_seconds(t.failure_window) / 60)
    store_at = store_min + 10
    store_len = store_at + store_min + 30
    store_labels = f'{_TARGET},operation="put",code="503"'

    def store_failing(minute: int, **extra: str) -> dict:
        labels = {"job": JOB, "instance": INSTANCE, **extra}
        return _check(minute, "ObsckptStoreErrors", _expected("ObsckptStoreErrors", rules, labels))

    # ObsckptWeightSyncCorrupt: a digest failure 20 minutes in, its series at 0 before.
    corrupt_min = math.ceil(duration_seconds(t.weight_sync_corrupt_window) / 60)
    corrupt_at = 20
    corrupt_len = corrupt_at + corrupt_min + 20
    corrupt_labels = f'{_TARGET},method="broadcast",check="digest"'

    def corrupt_fires(minute: int) -> dict:
        labels = {"job": JOB, "instance": INSTANCE, "method": "broadcast", "check": "digest"}
        return _check(
            minute, "ObsckptWeightSyncCorrupt", _expected("ObsckptWeightSyncCorrupt", rules, labels)
        )

    # ObsckptRolloutVersionLag: a receiver falls behind at minute 10 and stays there.
    vlag = int(t.rollout_version_max_lag) + 1
    vlag_due = 10 + math.ceil(duration_seconds(t.rollout_version_lag_for) / 60)
    vlag_labels = f'{_TARGET},method="broadcast"'

    def vlag_fires(minute: int) -> dict:
        labels = {"job": JOB, "instance": INSTANCE, "method": "broadcast"}
        return _check(
            minute,
            "ObsckptRolloutVersionLag",
            _expected("ObsckptRolloutVersionLag", rules, labels, vlag),
        )

    # ObsckptMirrorBehind: the local root commits step 4 at minute 10; the mirror stays
    # on step 3. Beside it, a mirror that follows each step 5 minutes late stays quiet.
    mirror_for = math.ceil(duration_seconds(t.mirror_behind_for) / 60)
    mirror_due = 10 + mirror_for
    mirror_len = mirror_due + 10
    keeping_up = " ".join(str(max(1, m // 10 + (m % 10 >= 5))) for m in range(mirror_len))

    def mirror_series(labels: str, local: str, mirrored: str, committed_at: int) -> list[dict]:
        """A monitor's local step, its mirror's step, and its last commit time (0: never)."""
        return [
            _series("obsckpt_latest_step", labels, local),
            _series("obsckpt_mirror_latest_step", labels, mirrored),
            _series(
                "obsckpt_last_commit_timestamp_seconds", labels, f"{committed_at}x{mirror_len}"
            ),
        ]

    def mirror_behind(minute: int) -> dict:
        alert = "ObsckptMirrorBehind"
        return _check(minute, alert, _expected(alert, rules, ckpt, 4))

    tests = [
        {
            "name": "mirror behind: a mirror stuck behind the local root fires after the for "
            "time; one that keeps up a few minutes late, or a kind never committed, does not",
            "interval": "1m",
            "input_series": [
                *mirror_series(ckpt_labels, f"3x10 4x{mirror_len - 10}", f"3x{mirror_len}", 60),
                # Another monitor: steps every 10 minutes, each on the mirror 5 minutes later.
                *mirror_series(
                    f'{_OTHER},kind="checkpoint"',
                    " ".join(str(m // 10 + 1) for m in range(mirror_len)),
                    keeping_up,
                    60,
                ),
                # A kind the job never commits: its step 0, the mirror's -1.
                *mirror_series(sd_labels, f"0x{mirror_len}", f"-1x{mirror_len}", 0),
            ],
            "alert_rule_test": [
                _check(mirror_due - 1, "ObsckptMirrorBehind"),
                mirror_behind(mirror_due + 1),
                mirror_behind(mirror_len - 1),
            ],
        },
        {
            "name": "mirror behind: a mirror that catches up before the for time stays quiet",
            "interval": "1m",
            "input_series": mirror_series(
                ckpt_labels,
                f"3x10 4x{mirror_len - 10}",
                f"3x{mirror_due - 2} 4x{mirror_len - mirror_due + 2}",
                60,
            ),
            "alert_rule_test": [
                _check(minute, "ObsckptMirrorBehind")
                for minute in (mirror_due - 3, mirror_due + 1, mirror_len - 1)
            ],
        },
        {
            "name": "store errors: a first failed request (its series starts at 1) fires, "
            "then ends",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{store_len}"),
                _series(
                    "obsckpt_store_request_errors_total",
                    store_labels,
                    f"_x{store_at} 1x{store_len - store_at}",
                ),
            ],
            "alert_rule_test": [
                _check(store_at - 1, "ObsckptStoreErrors"),
                store_failing(store_at + 2, operation="put", code="503"),
                _check(store_at + store_min + 5, "ObsckptStoreErrors"),
            ],
        },
        {
            "name": "store errors: a commit refused because another monitor took the root fires",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{store_len}"),
                _series(
                    "obsckpt_store_fenced_commits_total",
                    _TARGET,
                    f"0x{store_at} 1x{store_len - store_at}",
                ),
            ],
            "alert_rule_test": [
                _check(store_at - 1, "ObsckptStoreErrors"),
                store_failing(store_at + 2),
                _check(store_at + store_min + 5, "ObsckptStoreErrors"),
            ],
        },
        {
            "name": "weight sync corrupt: a first failed check fires, then ends",
            "interval": "1m",
            "input_series": [
                _series(
                    "obsckpt_weight_sync_corrupt_total",
                    corrupt_labels,
                    f"0x{corrupt_at} 1x{corrupt_len - corrupt_at}",
                ),
                _series(
                    "obsckpt_weight_sync_corrupt_total",
                    f'{_TARGET},method="broadcast",check="checksum"',
                    f"0x{corrupt_len}",
                ),
            ],
            "alert_rule_test": [
                _check(corrupt_at - 1, "ObsckptWeightSyncCorrupt"),
                corrupt_fires(corrupt_at + 1),
                _check(corrupt_at + corrupt_min + 5, "ObsckptWeightSyncCorrupt"),
            ],
        },
        {
            "name": "rollout version lag: a receiver held behind fires after the for time",
            "interval": "1m",
            "input_series": [
                _series(
                    "obsckpt_weight_sync_version_lag",
                    vlag_labels,
                    f"0x10 {vlag}x{vlag_due + 10 - 10}",
                ),
            ],
            "alert_rule_test": [
                _check(vlag_due - 1, "ObsckptRolloutVersionLag"),
                vlag_fires(vlag_due + 1),
            ],
        },
        {
            "name": "rollout version lag: one failed sync (lag 1, then 0) stays quiet",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_weight_sync_version_lag", vlag_labels, "0x10 1x30 0x20"),
            ],
            "alert_rule_test": [
                _check(minute, "ObsckptRolloutVersionLag") for minute in (15, 30, 45)
            ],
        },
        {
            "name": "commit stalled: a pending step older than the threshold fires",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_pending_steps", ckpt_labels, f"1x{stall_len}"),
                _series(
                    "obsckpt_oldest_pending_step_start_timestamp_seconds",
                    ckpt_labels,
                    f"{start}x{stall_len}",
                ),
            ],
            "alert_rule_test": [
                _check(stall_min, "ObsckptCommitStalled"),
                _check(
                    stall_fire,
                    "ObsckptCommitStalled",
                    _expected("ObsckptCommitStalled", rules, ckpt, stall_fire * 60 - start),
                ),
            ],
        },
        {
            "name": "commit stalled: a failed scrape does not reset the for timer",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_pending_steps", ckpt_labels, f"1x{stall_due - 1} stale 1x5"),
                _series(
                    "obsckpt_oldest_pending_step_start_timestamp_seconds",
                    ckpt_labels,
                    f"{start}x{stall_due - 1} stale {start}x5",
                ),
            ],
            "alert_rule_test": [
                _check(stall_due - 1, "ObsckptCommitStalled"),
                _check(
                    stall_due,
                    "ObsckptCommitStalled",
                    _expected("ObsckptCommitStalled", rules, ckpt, stall_due * 60 - start),
                ),
            ],
        },
        {
            "name": "commit stalled: a monitor gone for longer than a missed scrape resolves",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_pending_steps", ckpt_labels, f"1x{stall_due + 2} stale"),
                _series(
                    "obsckpt_oldest_pending_step_start_timestamp_seconds",
                    ckpt_labels,
                    f"{start}x{stall_due + 2} stale",
                ),
            ],
            "alert_rule_test": [
                _check(
                    stall_due + 3,
                    "ObsckptCommitStalled",
                    _expected("ObsckptCommitStalled", rules, ckpt, (stall_due + 3) * 60 - start),
                ),
                _check(stall_due + 3 + gap_window_min + 1, "ObsckptCommitStalled"),
            ],
        },
        {
            "name": "commit stalled: steps that commit, and a 0 timestamp, stay quiet",
            "interval": "1m",
            "input_series": [
                # A step pending for 4 minutes, then committed: gauges back to 0.
                _series("obsckpt_pending_steps", ckpt_labels, f"1x4 0x{stall_len}"),
                _series(
                    "obsckpt_oldest_pending_step_start_timestamp_seconds",
                    ckpt_labels,
                    f"{start}x4 0x{stall_len}",
                ),
                # Pending reported before its start time is known: no fake age.
                _series("obsckpt_pending_steps", sd_labels, f"1x{stall_len}"),
                _series(
                    "obsckpt_oldest_pending_step_start_timestamp_seconds",
                    sd_labels,
                    f"0x{stall_len}",
                ),
            ],
            "alert_rule_test": [_check(stall_fire, "ObsckptCommitStalled")],
        },
        {
            "name": "no recent commit: fires after the threshold, never for a kind not saved",
            "interval": "1m",
            "input_series": [
                _series(
                    "obsckpt_last_commit_timestamp_seconds",
                    ckpt_labels,
                    f"0x4 {commit_at}x{no_commit_fire + 5}",
                ),
                _series(
                    "obsckpt_last_commit_timestamp_seconds", sd_labels, f"0x{no_commit_fire + 5}"
                ),
            ],
            "alert_rule_test": [
                _check(quiet_min, "ObsckptNoRecentCommit"),
                _check(
                    no_commit_fire,
                    "ObsckptNoRecentCommit",
                    _expected(
                        "ObsckptNoRecentCommit", rules, ckpt, no_commit_fire * 60 - commit_at
                    ),
                ),
            ],
        },
        {
            "name": "no recent commit: a failed scrape does not reset the for timer",
            "interval": "1m",
            "input_series": [
                _series(
                    "obsckpt_last_commit_timestamp_seconds",
                    ckpt_labels,
                    f"0x4 {commit_at}x{no_commit_due - 6} stale {commit_at}x5",
                ),
            ],
            "alert_rule_test": [
                _check(
                    no_commit_due,
                    "ObsckptNoRecentCommit",
                    _expected("ObsckptNoRecentCommit", rules, ckpt, no_commit_due * 60 - commit_at),
                ),
            ],
        },
        {
            "name": "save failures: fire within the window, quiet before and after",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_step_failures_total", ckpt_labels, f"0x10 1x{window_min + 30}"),
                _series(
                    "obsckpt_saves_total",
                    f'{ckpt_labels},slot="model",result="error"',
                    f"0x10 1x{window_min + 30}",
                ),
                _series(
                    "obsckpt_saves_total",
                    f'{ckpt_labels},slot="model",result="ok"',
                    f"0+1x{window_min + 40}",
                ),
                _series("obsckpt_step_failures_total", sd_labels, f"0x{window_min + 40}"),
            ],
            "alert_rule_test": [
                _check(5, "ObsckptSaveFailures"),
                _check(12, "ObsckptSaveFailures", failing(INSTANCE)),
                _check(11 + window_min + 5, "ObsckptSaveFailures"),
            ],
        },
        {
            "name": "save failures: a slot whose first save fails fires (its series starts at 1)",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{window_min + 40}"),
                _series(
                    "obsckpt_saves_total",
                    f'{ckpt_labels},slot="model",result="error"',
                    f"_x{window_min + 10} 1x{window_min + 30}",
                ),
                _series("obsckpt_step_failures_total", ckpt_labels, f"0x{window_min + 40}"),
            ],
            "alert_rule_test": [
                _check(window_min + 5, "ObsckptSaveFailures"),
                _check(window_min + 12, "ObsckptSaveFailures", failing(INSTANCE)),
                _check(2 * window_min + 16, "ObsckptSaveFailures"),
            ],
        },
        {
            "name": "save failures: a new job whose first save failed before its first scrape "
            "fires",
            "interval": "1m",
            "input_series": [
                # Another job's monitor has been scraped all along; this one appears
                # at window + 10 with its error already counted.
                _series("up", _OTHER, f"1x{window_min + 40}"),
                _series("up", _TARGET, f"_x{window_min + 10} 1x{window_min + 30}"),
                _series(
                    "obsckpt_saves_total",
                    f'{ckpt_labels},slot="model",result="error"',
                    f"_x{window_min + 10} 1x{window_min + 30}",
                ),
            ],
            "alert_rule_test": [
                _check(window_min + 5, "ObsckptSaveFailures"),
                _check(window_min + 12, "ObsckptSaveFailures", failing(INSTANCE)),
                _check(2 * window_min + 16, "ObsckptSaveFailures"),
            ],
        },
        {
            "name": "save failures: an old failure stays quiet after failed scrapes",
            "interval": "1m",
            "input_series": [
                # One failure at minute 5; the scrape at gap_at fails (a staleness
                # marker), and Prometheus itself is down from outage_at for 2 windows.
                _series(
                    "up",
                    _TARGET,
                    f"1x{gap_at - 1} 0 1x{outage_at - gap_at - 2} _x{2 * window_min} "
                    f"1x{window_min + 10}",
                ),
                *(
                    _series(
                        name,
                        labels,
                        f"0x4 1x{gap_at - 6} stale 1x{outage_at - gap_at - 2} "
                        f"_x{2 * window_min} 1x{window_min + 10}",
                    )
                    for name, labels in (
                        ("obsckpt_step_failures_total", ckpt_labels),
                        ("obsckpt_saves_total", f'{ckpt_labels},slot="model",result="error"'),
                    )
                ),
            ],
            "alert_rule_test": [
                _check(minute, "ObsckptSaveFailures")
                for minute in (
                    gap_at + window_min - 1,
                    gap_at + window_min,
                    gap_at + window_min + 1,
                    outage_end + 1,
                    outage_end + window_min // 2,
                    outage_end + window_min,
                )
            ],
        },
        {
            "name": "save failures: two training jobs in one scrape job are told apart",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{window_min + 30}"),
                _series("up", _OTHER, f"1x{window_min + 30}"),
                _series("obsckpt_step_failures_total", ckpt_labels, f"0x{window_min + 30}"),
                _series(
                    "obsckpt_step_failures_total",
                    f'{_OTHER},kind="checkpoint"',
                    f"0x10 1x{window_min + 20}",
                ),
            ],
            "alert_rule_test": [_check(12, "ObsckptSaveFailures", failing(OTHER_INSTANCE))],
        },
        {
            "name": "monitor down: a target that stops answering fires",
            "interval": "1m",
            "input_series": [_series("up", _TARGET, f"1x5 0x{down_for_min + 10}")],
            "alert_rule_test": [
                _check(5, "ObsckptMonitorDown"),
                _check(
                    6 + down_for_min + 1,
                    "ObsckptMonitorDown",
                    _expected("ObsckptMonitorDown", rules, {"job": JOB, "instance": INSTANCE}),
                ),
            ],
        },
        {
            "name": "monitor down: a target that was never discovered fires",
            "interval": "1m",
            "input_series": [_series("up", 'job="other",instance="other:9100"', "1x20")],
            "alert_rule_test": [
                _check(
                    down_for_min + 2,
                    "ObsckptMonitorDown",
                    _expected("ObsckptMonitorDown", rules, {"job": JOB}),
                ),
            ],
        },
        {
            "name": "monitor down: quiet once the monitor shut down cleanly and withdrew its target",
            "interval": "1m",
            "input_series": [
                # The last scrape before the target went away carried the shutdown time.
                _series("up", _TARGET, "1x5 stale"),
                _series("obsckpt_monitor_shutdown_timestamp_seconds", _TARGET, "0x4 300 stale"),
            ],
            "alert_rule_test": [
                _check(6 + down_for_min + 1, "ObsckptMonitorDown"),
                _check(6 + down_for_min + 30, "ObsckptMonitorDown"),
            ],
        },
        {
            "name": "monitor down: a target gone without a clean shutdown fires",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, "1x5 stale"),
                _series("obsckpt_monitor_shutdown_timestamp_seconds", _TARGET, "0x5 stale"),
            ],
            "alert_rule_test": [
                _check(5, "ObsckptMonitorDown"),
                _check(
                    6 + down_for_min + 1,
                    "ObsckptMonitorDown",
                    _expected("ObsckptMonitorDown", rules, {"job": JOB}),
                ),
            ],
        },
        {
            "name": "monitor down: a healthy target stays quiet",
            "interval": "1m",
            "input_series": [_series("up", _TARGET, "1x30")],
            "alert_rule_test": [_check(down_for_min + 20, "ObsckptMonitorDown")],
        },
        {
            "name": "weight sync lagging: a rollout side falling behind fires",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"20x{lag_fire + 5}"),
                _series(
                    "obsckpt_model_version",
                    f'{_TARGET},role="rollout"',
                    f"19x10 {20 - behind}x{lag_fire}",
                ),
            ],
            "alert_rule_test": [
                _check(10, "ObsckptWeightSyncLagging"),
                lagging(INSTANCE),
            ],
        },
        {
            "name": "weight sync lagging: a failed scrape does not reset the for timer",
            "interval": "1m",
            "input_series": [
                _series(
                    "obsckpt_model_version",
                    f'{_TARGET},role="trainer"',
                    f"20x{lag_due - 1} stale 20x5",
                ),
                _series(
                    "obsckpt_model_version",
                    f'{_TARGET},role="rollout"',
                    f"19x10 {20 - behind}x{lag_due - 12} stale {20 - behind}x5",
                ),
            ],
            "alert_rule_test": [
                _check(
                    lag_due,
                    "ObsckptWeightSyncLagging",
                    _expected(
                        "ObsckptWeightSyncLagging",
                        rules,
                        {"job": JOB, "instance": INSTANCE},
                        behind,
                    ),
                ),
            ],
        },
        {
            "name": "weight sync lagging: two training jobs in one scrape job are told apart",
            "interval": "1m",
            "input_series": [
                # Job A is in step at a high version; job B lags at a low one.
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"100x{lag_fire}"),
                _series("obsckpt_model_version", f'{_TARGET},role="rollout"', f"100x{lag_fire}"),
                _series("obsckpt_model_version", f'{_OTHER},role="trainer"', f"20x{lag_fire}"),
                _series(
                    "obsckpt_model_version", f'{_OTHER},role="rollout"', f"{20 - behind}x{lag_fire}"
                ),
                # Job C has no rollout side: never paired with another job's.
                _series("obsckpt_model_version", f'{_THIRD},role="trainer"', f"500x{lag_fire}"),
            ],
            "alert_rule_test": [
                lagging(OTHER_INSTANCE),
            ],
        },
        {
            "name": "weight sync lagging: a job with no rollout side stays quiet",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"20x{lag_fire + 5}"),
                _series("obsckpt_model_version", f'{_TARGET},role="rollout"', f"0x{lag_fire + 5}"),
            ],
            "alert_rule_test": [_check(lag_fire, "ObsckptWeightSyncLagging")],
        },
        {
            "name": "commit phase stuck: an fsync that hangs fires while it hangs",
            "interval": "1m",
            "input_series": [
                _series(phase_gauge, phase_labels("scan"), f"0x{stuck_len}"),
                _series(phase_gauge, phase_labels("fsync_files"), f"0 {start}x{stuck_len}"),
                _series(phase_gauge, phase_labels("rename_iteration"), f"0x{stuck_len}"),
            ],
            "alert_rule_test": [_check(stuck_min, "ObsckptCommitPhaseStuck"), stuck(stuck_fire)],
        },
        {
            "name": "commit phase stuck: a failed scrape does not reset the for timer",
            "interval": "1m",
            "input_series": [
                _series(
                    phase_gauge,
                    phase_labels("fsync_files"),
                    f"{start}x{stuck_due - 1} stale {start}x5",
                ),
            ],
            "alert_rule_test": [_check(stuck_due - 1, "ObsckptCommitPhaseStuck"), stuck(stuck_due)],
        },
        {
            "name": "commit phase stuck: phases that end, and no commit running, stay quiet",
            "interval": "1m",
            "input_series": [
                # A slow fsync round of 3 minutes, then the commit's other phases.
                _series(phase_gauge, phase_labels("fsync_files"), f"0 {start}x3 0x{stuck_len}"),
                _series(phase_gauge, phase_labels("manifest"), f"0x4 240 0x{stuck_len}"),
                _series(phase_gauge, phase_labels("scan"), f"0x{stuck_len + 5}"),
            ],
            "alert_rule_test": [_check(stuck_fire, "ObsckptCommitPhaseStuck")],
        },
        {
            "name": "weight sync failures: a first failure (its series starts at 1) fires",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{sync_len}"),
                _series(
                    "obsckpt_broadcast_failures_total",
                    sync_labels,
                    f"_x{sync_min + 10} 1x{sync_len - sync_min - 10}",
                ),
            ],
            "alert_rule_test": [
                _check(sync_min + 5, "ObsckptWeightSyncFailures"),
                sync_failing(sync_min + 12),
                _check(2 * sync_min + 16, "ObsckptWeightSyncFailures"),
            ],
        },
        {
            "name": "weight sync failures: a new job whose first sync failed before its first "
            "scrape fires",
            "interval": "1m",
            "input_series": [
                _series("up", _OTHER, f"1x{sync_len}"),
                _series("up", _TARGET, f"_x{sync_min + 10} 1x30"),
                _series("obsckpt_broadcast_failures_total", sync_labels, f"_x{sync_min + 10} 1x30"),
            ],
            "alert_rule_test": [sync_failing(sync_min + 12)],
        },
        {
            "name": "weight sync failures: a later failure fires again, an old one stays quiet",
            "interval": "1m",
            "input_series": [
                _series("up", _TARGET, f"1x{sync_len + sync_min}"),
                _series(
                    "obsckpt_broadcast_failures_total",
                    sync_labels,
                    f"1x{sync_min + 19} 2x{sync_len}",
                ),
            ],
            "alert_rule_test": [
                _check(sync_min + 5, "ObsckptWeightSyncFailures"),
                sync_failing(sync_min + 21),
                _check(2 * sync_min + 25, "ObsckptWeightSyncFailures"),
            ],
        },
        {
            "name": "rollout weights stale: a rollout side held behind the trainer fires",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"5x9 6x{stale_len}"),
                _series("obsckpt_model_version", f'{_TARGET},role="rollout"', f"5x{stale_len + 9}"),
            ],
            "alert_rule_test": [
                _check(stale_due - 1, "ObsckptRolloutWeightsStale"),
                stale(stale_due + 1),
            ],
        },
        {
            "name": "rollout weights stale: a rollout side that keeps syncing stays quiet",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"1+1x{stale_len}"),
                _series(
                    "obsckpt_model_version",
                    f'{_TARGET},role="rollout"',
                    " ".join(str(1 + (i // 10) * 10) for i in range(stale_len + 1)),
                ),
            ],
            "alert_rule_test": [
                _check(minute, "ObsckptRolloutWeightsStale")
                for minute in (stale_due - 1, stale_due + 1, stale_len - 1)
            ],
        },
        {
            "name": "rollout weights stale: a first sync a moment ago is not stale",
            "interval": "1m",
            "input_series": [
                _series("obsckpt_model_version", f'{_TARGET},role="trainer"', f"6x{late_due + 5}"),
                _series(
                    "obsckpt_model_version",
                    f'{_TARGET},role="rollout"',
                    f"_x{late_start} 5x{late_due - late_start + 5}",
                ),
            ],
            "alert_rule_test": [
                _check(late_start + stale_for_min + 2, "ObsckptRolloutWeightsStale"),
                _check(late_due - 1, "ObsckptRolloutWeightsStale"),
                stale(late_due + 1),
            ],
        },
    ]
    return {"rule_files": [rules_file], "evaluation_interval": "1m", "tests": tests}
