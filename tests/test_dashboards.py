"""The dashboard code: generated files up to date, queries on the contract's metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dashboards import build_dashboard, expand, panel_queries
from dashboards.build import DASHBOARD, ROOT, generated_files, main, stale_files
from dashboards.dashboard import JOB
from obsckpt.telemetry.metrics import METRICS

METRIC_NAMES = {spec.name for spec in METRICS}
HISTOGRAMS = {spec.name for spec in METRICS if spec.type == "histogram"}
SELECTOR = re.compile(r"\b(obsckpt_[a-z_]+)(\{[^}]*\})?")


def _base(name: str) -> str:
    for suffix in ("_bucket", "_sum", "_count"):
        stem = name.removesuffix(suffix)
        if stem != name and stem in HISTOGRAMS:
            return stem
    return name


def _exprs() -> list[str]:
    return [q.expr for q in panel_queries()]


class TestGeneratedFilesAreCommitted:
    """The committed dashboard and rule files are exactly what the code generates."""

    def test_no_generated_file_is_stale(self):
        stale = stale_files()
        assert not stale, f"out of date: {[str(p) for p in stale]}; run `make dashboards`"

    def test_check_mode_agrees(self, capsys):
        assert main(["--check"]) == 0, capsys.readouterr().err

    def test_generation_is_deterministic(self):
        assert generated_files() == generated_files()

    def test_committed_dashboard_parses_to_the_built_one(self):
        committed = json.loads((ROOT / DASHBOARD).read_text())
        assert committed == build_dashboard()


class TestQueries:
    """Every query reads the contract's metrics of the selected job."""

    def test_every_metric_selector_filters_on_job(self):
        for expr in _exprs():
            selectors = SELECTOR.findall(expr)
            assert selectors, f"query reads no obsckpt metric: {expr}"
            for name, matchers in selectors:
                assert JOB in matchers, f"{name} in {expr!r} does not filter on {JOB}"

    def test_queries_only_name_metrics_of_the_contract(self):
        for expr in _exprs():
            for name, _ in SELECTOR.findall(expr):
                assert _base(name) in METRIC_NAMES, f"{name} is not defined in metrics.py"

    def test_every_metric_of_the_contract_has_a_panel(self):
        used = {_base(name) for expr in _exprs() for name, _ in SELECTOR.findall(expr)}
        assert METRIC_NAMES - used == set()

    def test_save_latency_quantiles_by_slot_and_kind(self):
        exprs = _exprs()
        for q in ("0.5", "0.95", "0.99"):
            assert any(
                e.startswith(f"histogram_quantile({q}, sum by (le, slot, kind)")
                and "obsckpt_save_duration_seconds_bucket" in e
                for e in exprs
            ), f"no p{q} save latency by slot and kind"

    def test_timestamp_panels_are_guarded_against_zero(self):
        for expr in _exprs():
            for gauge in (
                "obsckpt_last_commit_timestamp_seconds",
                "obsckpt_oldest_pending_step_start_timestamp_seconds",
            ):
                if gauge in expr:
                    assert "> 0" in expr, f"{expr!r}: a 0 timestamp would read as 55 years"

    def test_slowest_ranks_use_topk(self):
        assert any(
            e.startswith("topk(") and "obsckpt_rank_last_save_duration_seconds" in e
            for e in _exprs()
        )

    def test_failures_and_versions_are_shown(self):
        joined = "\n".join(_exprs())
        assert 'result="error"' in joined
        assert "obsckpt_step_failures_total" in joined
        assert 'role="trainer"' in joined and 'role="rollout"' in joined

    def test_expand_replaces_every_variable(self):
        for expr in _exprs():
            out = expand(expr, job="obsckpt", rate_interval="30s")
            assert "$" not in out
            assert 'job=~"obsckpt"' in out

    def test_expand_rejects_unknown_variables(self):
        with pytest.raises(ValueError, match=r"\$instance"):
            expand('up{instance="$instance"}')


def _panel_exprs(title: str, viz: str) -> list[str]:
    """The queries of the panel called ``title`` drawn as ``viz``, ready for Prometheus."""
    [panel] = [p for p in build_dashboard()["panels"] if p["title"] == title and p["type"] == viz]
    return [expand(t["expr"], job="obsckpt", rate_interval="5m") for t in panel["targets"]]


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).exists():
        pytest.fail("promtool not found: install Debian's `prometheus` package")
    return path


def _evaluate(promtool: str, tmp_path: Path, series: dict[str, str], cases: list[dict]) -> str:
    """Run ``promql_expr_test`` cases on ``series`` (1 min apart) with Prometheus' engine."""
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "promql_expr_test": cases,
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests))
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.stdout + result.stderr if result.returncode else ""


@pytest.mark.needs_promtool
class TestSeveralMonitors:
    """With several training jobs' monitors in one scrape job, a stalled one is not hidden."""

    # Monitor a committed once at minute 1; monitor b commits every minute.
    SERIES = {
        'obsckpt_last_commit_timestamp_seconds{job="obsckpt",instance="a:9400",kind="checkpoint"}': "60x40",
        'obsckpt_last_commit_timestamp_seconds{job="obsckpt",instance="b:9400",kind="checkpoint"}': "0+60x40",
        # A third monitor that has not committed yet (timestamp 0).
        'obsckpt_last_commit_timestamp_seconds{job="obsckpt",instance="c:9400",kind="checkpoint"}': "0x40",
        'obsckpt_latest_step{job="obsckpt",instance="a:9400",kind="checkpoint"}': "5x40",
        'obsckpt_latest_step{job="obsckpt",instance="b:9400",kind="checkpoint"}': "0+10x40",
    }

    def test_overview_shows_the_least_recent_commit(self, promtool, tmp_path):
        [expr] = _panel_exprs("Time since last commit", "stat")
        case = {
            "expr": expr,
            "eval_time": "30m",
            "exp_samples": [{"labels": '{kind="checkpoint"}', "value": 30 * 60 - 60}],
        }
        assert _evaluate(promtool, tmp_path, self.SERIES, [case]) == ""

    def test_commit_panels_show_each_monitor(self, promtool, tmp_path):
        [age] = _panel_exprs("Time since last commit", "timeseries")
        [step] = _panel_exprs("Latest committed step", "timeseries")
        a, b = '{instance="a:9400",kind="checkpoint"}', '{instance="b:9400",kind="checkpoint"}'
        cases = [
            {
                "expr": age,
                "eval_time": "30m",
                "exp_samples": [{"labels": a, "value": 1740}, {"labels": b, "value": 0}],
            },
            {
                "expr": step,
                "eval_time": "30m",
                "exp_samples": [{"labels": a, "value": 5}, {"labels": b, "value": 300}],
            },
        ]
        assert _evaluate(promtool, tmp_path, self.SERIES, cases) == ""
