"""Alert rules: promtool checks them and their unit tests; runbook links resolve.

promtool comes from Debian's ``prometheus`` package; these tests fail, not
skip, when it is missing, since the rules are untested without it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import ALERT_NAMES, AlertThresholds, alert_rules
from dashboards.alert_tests import alert_unit_tests
from dashboards.alerts import DEFAULT_RUNBOOK_URL, RUNBOOK_URL_ENV, runbook_url_from_env
from dashboards.build import RULE_TESTS, RULES, rules_yaml, to_yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
CONTRACT_ALERTS = (
    "ObsckptStoreErrors",
    "ObsckptMirrorBehind",
    "ObsckptCommitStalled",
    "ObsckptNoRecentCommit",
    "ObsckptSaveFailures",
    "ObsckptMonitorDown",
    "ObsckptWeightSyncLagging",
    "ObsckptCommitPhaseStuck",
    "ObsckptWeightSyncFailures",
    "ObsckptRolloutWeightsStale",
    "ObsckptWeightSyncCorrupt",
    "ObsckptRolloutVersionLag",
)


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or (
        "/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None
    )
    if path is None:
        pytest.fail(
            "promtool not found: install Debian's `prometheus` package (apt-get install prometheus)"
        )
    return path


def run_promtool(promtool: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


@pytest.mark.needs_promtool
class TestPromtool:
    """The committed rules and config pass promtool, and the rule unit tests pass."""

    def test_check_rules(self, promtool):
        result = run_promtool(promtool, "check", "rules", str(RULES))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(CONTRACT_ALERTS)} rules found" in result.stdout

    def test_check_config(self, promtool):
        result = run_promtool(promtool, "check", "config", str(PROMETHEUS_CONFIG))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS: 1 rule files found" in result.stdout

    def test_rule_unit_tests_pass(self, promtool):
        result = run_promtool(
            promtool, "test", "rules", RULE_TESTS.name, cwd=ROOT / RULE_TESTS.parent
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout


@pytest.mark.needs_promtool
class TestUnitTestsDiscriminate:
    """The promtool cases fail against rules that never fire or always fire."""

    def _run_against(self, promtool, tmp_path: Path, thresholds: AlertThresholds):
        (tmp_path / "rules.yml").write_text(rules_yaml(thresholds))
        (tmp_path / "tests.yml").write_text(to_yaml(alert_unit_tests(rules_file="rules.yml")))
        return run_promtool(promtool, "test", "rules", "tests.yml", cwd=tmp_path)

    def test_rules_that_never_fire_fail_the_tests(self, promtool, tmp_path):
        result = self._run_against(
            promtool,
            tmp_path,
            AlertThresholds(
                commit_stall_seconds=1e9,
                no_commit_seconds=1e9,
                monitor_down_for="1h",
                weight_sync_max_lag=1e9,
                rollout_stale_window="1y",
            ),
        )
        assert result.returncode != 0
        out = result.stdout + result.stderr
        for alert in (
            "ObsckptCommitStalled",
            "ObsckptNoRecentCommit",
            "ObsckptMonitorDown",
            "ObsckptRolloutWeightsStale",
        ):
            assert alert in out

    def test_other_thresholds_pass_their_own_tests(self, promtool, tmp_path):
        # Durations of several units and thresholds of more than six digits, as
        # Prometheus reads them: the generated cases still fire on the edges.
        thresholds = AlertThresholds(
            commit_stall_seconds=1234.567,
            commit_stall_for="1m30s",
            no_commit_seconds=7200.25,
            failure_window="1h30m",
            weight_sync_for="1h",
        )
        (tmp_path / "rules.yml").write_text(rules_yaml(thresholds))
        assert run_promtool(promtool, "check", "rules", "rules.yml", cwd=tmp_path).returncode == 0
        tests = alert_unit_tests(thresholds, rules_file="rules.yml")
        (tmp_path / "tests.yml").write_text(to_yaml(tests))
        result = run_promtool(promtool, "test", "rules", "tests.yml", cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr

    def test_rules_that_fire_early_fail_the_tests(self, promtool, tmp_path):
        result = self._run_against(
            promtool,
            tmp_path,
            AlertThresholds(commit_stall_seconds=60, no_commit_seconds=60, weight_sync_max_lag=0),
        )
        assert result.returncode != 0
        out = result.stdout + result.stderr
        for alert in ("ObsckptCommitStalled", "ObsckptNoRecentCommit", "ObsckptWeightSyncLagging"):
            assert alert in out

    def test_failures_rule_that_trusts_a_missed_scrape_fails_the_tests(self, promtool, tmp_path):
        # Without the scrape guard, an error counter that was already counting reads
        # as new a window after one failed scrape, and the alert fires on an old failure.
        guard = (
            "\n  and on (job, instance) (\n    up offset 15m == 1\n"
            "    or ((up unless on (job, instance) up offset 15m)\n"
            "      and on () (count(up offset 15m) > 0)))"
        )
        out = _promtool_without(promtool, tmp_path, guard)
        assert "an old failure stays quiet after failed scrapes" in out

    def test_failures_rule_without_new_targets_fails_the_tests(self, promtool, tmp_path):
        # Only targets scraped a window ago: a job whose first save failed before its
        # first scrape (its error series starts at 1) would never fire.
        branch = (
            "\n    or ((up unless on (job, instance) up offset 15m)\n"
            "      and on () (count(up offset 15m) > 0))"
        )
        out = _promtool_without(promtool, tmp_path, branch)
        assert "a new job whose first save failed" in out


def _promtool_without(promtool, tmp_path: Path, fragment: str) -> str:
    """promtool's output for the shipped rules less ``fragment`` of an expression (it must fail)."""
    indented = fragment.replace("\n", "\n      ")  # as the rules file indents the expression
    rules = rules_yaml(AlertThresholds())
    assert indented in rules
    (tmp_path / "rules.yml").write_text(rules.replace(indented, ""))
    (tmp_path / "tests.yml").write_text(to_yaml(alert_unit_tests(rules_file="rules.yml")))
    result = run_promtool(promtool, "test", "rules", "tests.yml", cwd=tmp_path)
    assert result.returncode != 0
    return result.stdout + result.stderr


@pytest.mark.needs_promtool
class TestMissedScrapesAndCleanShutdowns:
    """A failed scrape does not reset an alert's ``for`` timer, and a finished job is
    not a lost monitor: rules without either guard fail the promtool cases."""

    def _failures(self, promtool, tmp_path: Path, rules: str) -> str:
        (tmp_path / "rules.yml").write_text(rules)
        (tmp_path / "tests.yml").write_text(to_yaml(alert_unit_tests(rules_file="rules.yml")))
        result = run_promtool(promtool, "test", "rules", "tests.yml", cwd=tmp_path)
        assert result.returncode != 0
        return result.stdout + result.stderr

    def test_gauges_read_without_the_window_fail_the_gap_cases(self, promtool, tmp_path):
        rules = re.sub(r"last_over_time\((\w+(?:\{[^}]*\})?)\[2m\]\)", r"\1", rules_yaml())
        assert "last_over_time" not in rules.replace("last_over_time(obsckpt_monitor_", "")
        out = self._failures(promtool, tmp_path, rules)
        for case in (
            "commit stalled: a failed scrape does not reset the for timer",
            "no recent commit: a failed scrape does not reset the for timer",
            "weight sync lagging: a failed scrape does not reset the for timer",
        ):
            assert case in out

    def test_absent_target_without_the_shutdown_guard_fails(self, promtool, tmp_path):
        rules = rules_yaml()
        start = rules.index("or (absent(")
        end = rules.index("[7d])) > 0)", start) + len("[7d])) > 0)")
        guarded = rules[start:end]
        rules = rules.replace(guarded, 'or absent(up{job="obsckpt"})')
        out = self._failures(promtool, tmp_path, rules)
        assert "quiet once the monitor shut down cleanly" in out


class TestRules:
    """Every alert of the contract exists, is annotated and links to its runbook section."""

    def test_alerts_are_the_contracts(self):
        assert sorted(ALERT_NAMES) == sorted(CONTRACT_ALERTS)

    def test_committed_file_holds_the_default_rules(self):
        groups = yaml.safe_load((ROOT / RULES).read_text())["groups"]
        assert [r["alert"] for g in groups for r in g["rules"]] == list(ALERT_NAMES)

    def test_annotations(self):
        for rule in alert_rules():
            annotations = rule["annotations"]
            for key in ("summary", "description", "runbook_url"):
                assert annotations.get(key), f"{rule['alert']} has no {key}"
            assert rule["labels"]["severity"] in ("warning", "critical")

    def test_runbook_anchors_exist(self):
        headings = re.findall(r"^#{1,6} (.+)$", RUNBOOK.read_text(), flags=re.MULTILINE)
        anchors = {github_slug(h) for h in headings}
        for rule in alert_rules():
            path, _, anchor = rule["annotations"]["runbook_url"].partition("#")
            # Alertmanager and Grafana show it as a link: a relative path is dead there.
            assert path.startswith("https://") and path.endswith("docs/runbook.md"), path
            assert anchor in anchors, f"{rule['alert']}: no heading for #{anchor} in {RUNBOOK}"

    def test_runbook_mentions_the_tools(self):
        text = RUNBOOK.read_text()
        for needle in (
            "obsckpt status DIR",
            "obsckpt verify DIR",
            "status.remote()",
            "Ray dashboard",
        ):
            assert needle in text

    def test_thresholds_are_parameters(self):
        rules = {
            r["alert"]: r
            for r in alert_rules(
                AlertThresholds(commit_stall_seconds=2, commit_stall_for="1s", monitor_job="test")
            )
        }
        assert "> 2\n" in rules["ObsckptCommitStalled"]["expr"]
        assert rules["ObsckptCommitStalled"]["for"] == "1s"
        assert 'up{job="test"}' in rules["ObsckptMonitorDown"]["expr"]

    def test_commit_stalled_is_guarded_against_the_zero_timestamp(self):
        expr = next(r["expr"] for r in alert_rules() if r["alert"] == "ObsckptCommitStalled")
        assert "obsckpt_oldest_pending_step_start_timestamp_seconds[2m]) > 0" in expr
        assert "obsckpt_pending_steps[2m]) > 0" in expr

    def test_monitor_down_covers_an_absent_target(self):
        expr = next(r["expr"] for r in alert_rules() if r["alert"] == "ObsckptMonitorDown")
        assert 'up{job="obsckpt"} == 0' in expr and 'absent(up{job="obsckpt"})' in expr

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"commit_stall_seconds": 0},
            {"no_commit_seconds": -1},
            {"weight_sync_max_lag": -1},
            {"commit_stall_seconds": "900"},
            {"no_commit_seconds": float("nan")},
            {"weight_sync_max_lag": True},
            {"failure_window": "0m"},
            {"missed_scrape_window": "0s"},
            {"finished_quiet_for": "0m"},
            {"monitor_job": None},
            {"rollout_stale_window": "0m"},
            {"weight_sync_failure_window": "0s"},
            {"runbook_base": "docs/runbook.md"},
        ],
    )
    def test_invalid_thresholds_name_the_field(self, kwargs):
        ((field, value),) = kwargs.items()
        with pytest.raises(ValueError, match=f"{field} must .*got {re.escape(repr(value))}"):
            AlertThresholds(**kwargs)

    @pytest.mark.parametrize(
        "field",
        [
            "commit_stall_for",
            "no_commit_for",
            "failure_window",
            "monitor_down_for",
            "missed_scrape_window",
            "finished_quiet_for",
            "rollout_stale_window",
            "rollout_stale_for",
            "weight_sync_failure_window",
        ],
    )
    @pytest.mark.parametrize("value", ["90", "15 minutes", "1m30", "", 60])
    def test_durations_prometheus_would_refuse_name_the_field(self, field, value):
        # Prometheus refuses a rule file with such a duration as a whole: no alert at all.
        with pytest.raises(
            ValueError,
            match=rf"{field}: {re.escape(repr(value))} is not a Prometheus duration.*\"15m\"",
        ):
            AlertThresholds(**{field: value})

    def test_runbook_url_from_argument_environment_or_default(self, monkeypatch):
        monkeypatch.delenv(RUNBOOK_URL_ENV, raising=False)
        assert runbook_url_from_env() == DEFAULT_RUNBOOK_URL
        assert DEFAULT_RUNBOOK_URL.startswith("https://")
        monkeypatch.setenv(RUNBOOK_URL_ENV, "https://wiki.example/obsckpt/runbook.md")
        assert runbook_url_from_env() == "https://wiki.example/obsckpt/runbook.md"
        assert runbook_url_from_env("http://docs.local/r.md") == "http://docs.local/r.md"
        monkeypatch.setenv(RUNBOOK_URL_ENV, "docs/runbook.md")
        with pytest.raises(ValueError, match="must be absolute.*OBSCKPT_RUNBOOK_URL"):
            runbook_url_from_env()
        monkeypatch.setenv(RUNBOOK_URL_ENV, "http://docs.local:99999/r.md")  # no such port
        with pytest.raises(ValueError, match="99999.*must be absolute"):
            runbook_url_from_env()
        rule = alert_rules(AlertThresholds(runbook_base="https://wiki.example/r"))[0]
        assert rule["annotations"]["runbook_url"] == "https://wiki.example/r#obsckptcommitstalled"

    def test_weight_sync_alerts_read_the_sync_metrics(self):
        rules = {r["alert"]: r["expr"] for r in alert_rules()}
        assert "obsckpt_broadcast_failures_total" in rules["ObsckptWeightSyncFailures"]
        stale = rules["ObsckptRolloutWeightsStale"]
        assert (
            'role="trainer"' in stale and 'changes(obsckpt_model_version{role="rollout"}' in stale
        )

    def test_thresholds_are_written_exactly(self):
        expr = next(
            r["expr"]
            for r in alert_rules(AlertThresholds(no_commit_seconds=1234567))
            if r["alert"] == "ObsckptNoRecentCommit"
        )
        assert "> 1234567\n" in expr, expr
        stalled = alert_rules(AlertThresholds(commit_stall_seconds=1234.567))[0]
        assert "> 1234.567\n" in stalled["expr"], stalled["expr"]

    def test_every_alert_has_a_firing_and_a_quiet_case(self):
        fired, quiet = set(), set()
        for case in alert_unit_tests()["tests"]:
            for check in case["alert_rule_test"]:
                (fired if check["exp_alerts"] else quiet).add(check["alertname"])
        assert fired == set(ALERT_NAMES)
        assert quiet == set(ALERT_NAMES)
