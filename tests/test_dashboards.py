"""The dashboard code: generated files up to date, queries on the contract's metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import obsckpt
from dashboards import ALERT_NAMES, AlertThresholds, build_dashboard, expand, panel_queries
from dashboards.build import DASHBOARD, ROOT, RULES, generated_files, main, stale_files
from dashboards.dashboard import JOB
from obsckpt import assets, cli
from obsckpt.telemetry.metrics import METRICS

METRIC_NAMES = {spec.name for spec in METRICS}
HISTOGRAMS = {spec.name for spec in METRICS if spec.type == "histogram"}
# Histogram -> the gauge holding its last observation.
LAST_VALUE_GAUGES = {
    next(h.name for h in METRICS if h.attr == spec.last_of): spec.name
    for spec in METRICS
    if spec.last_of and spec.last_of in {h.attr for h in METRICS if h.type == "histogram"}
}
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
        with pytest.raises(ValueError, match=r"\$cluster"):
            expand('up{cluster="$cluster"}')

    def test_no_latency_reads_a_rate_interval(self):
        """A histogram read over $__rate_interval is empty between saves minutes apart."""
        for expr in _exprs():
            if "_bucket" in expr or "_seconds_sum" in expr:
                assert "$__rate_interval" not in expr and "[$window]" in expr, expr


class TestVariables:
    """Monitors of several jobs, in one scrape job or one Ray namespace, are told apart."""

    def test_instance_and_namespace_variables(self):
        variables = {v["name"]: v for v in build_dashboard()["templating"]["list"]}
        assert {"datasource", "job", "namespace", "instance", "window"} <= set(variables)
        for name in ("namespace", "instance"):
            # "All" must match a target without the label too (a static scrape config).
            assert variables[name]["includeAll"] and variables[name]["allValue"] == ".*"
            assert variables[name]["multi"]
        assert "obsckpt_namespace" in variables["namespace"]["query"]
        assert variables["window"]["current"]["value"] == "2h"

    def test_every_query_uses_them(self):
        for expr in _exprs():
            for name, matchers in SELECTOR.findall(expr):
                assert 'instance=~"$instance"' in matchers, f"{name} in {expr!r}"
                assert 'obsckpt_namespace=~"$namespace"' in matchers, f"{name} in {expr!r}"


def _panels(viz: str) -> list[dict]:
    return [p for p in build_dashboard()["panels"] if p["type"] == viz]


def _steps(panel: dict) -> list[tuple[float | None, str]]:
    thresholds = panel["fieldConfig"]["defaults"]["thresholds"]
    assert thresholds["mode"] == "absolute"
    return [(step["value"], step["color"]) for step in thresholds["steps"]]


class TestThresholds:
    """Colours mean something: failures above 0, ages past their alert; none on counters."""

    def test_every_stat_panel_sets_its_own_thresholds(self):
        for panel in _panels("stat"):
            steps = _steps(panel)
            assert all(value != 80 for value, _ in steps), f"{panel['title']}: Grafana's default"
            coloured = panel["options"]["colorMode"] != "none"
            assert coloured == (len(steps) > 1), panel["title"]

    def test_colours_by_meaning(self):
        alerts = AlertThresholds()
        stats = {p["title"]: p for p in _panels("stat")}
        assert _steps(stats["Failed steps"]) == [(None, "green"), (1, "red")]
        assert _steps(stats["Oldest pending step age"]) == [
            (None, "green"),
            (alerts.commit_stall_seconds, "red"),
        ]
        assert _steps(stats["Time since last commit"])[1] == (alerts.no_commit_seconds, "orange")
        for title in ("Latest committed step", "Clean monitor shutdowns", "Pending steps"):
            assert stats[title]["options"]["colorMode"] == "none", title

    def test_alert_thresholds_drawn_on_time_series(self):
        alerts = AlertThresholds()
        series = {p["title"]: p for p in _panels("timeseries")}
        for title, value in (
            ("Oldest pending step age", alerts.commit_stall_seconds),
            ("Time since last commit", alerts.no_commit_seconds),
            ("Commit phase in progress", alerts.commit_phase_stuck_seconds),
        ):
            panel = series[title]
            assert panel["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] in (
                "line",
                "dashed",
            ), title
            assert value in [v for v, _ in _steps(panel)], title

    def test_alert_list_panel(self):
        [panel] = _panels("alertlist")
        assert panel["options"]["alertName"] == "Obsckpt"
        assert panel["options"]["stateFilter"]["firing"]


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


# The panels that read a latency histogram, and the labels each aggregates by.
LATENCY_PANELS: dict[str, tuple[str, ...]] = {
    "Save latency by slot and kind": ("kind", "slot"),
    "Thread-join waits": ("slot",),
    "Admission waits": ("strategy",),
    "Commit lag": ("kind",),
    "Commit phase time": ("phase",),
    "Broadcast duration": ("backend",),
    "State dict upload duration": (),
    "Uploads per slot": ("slot",),
    "Mirror copies": (),
    "Rollout pause": ("method",),
    "Sync phases": ("sync_phase",),
}
# Their last-value targets aggregate by the same labels, except the save latency's,
# read from the per-rank gauge (which has no kind).
LAST_BY = {**LATENCY_PANELS, "Save latency by slot and kind": ("slot",)}
# Every observation lands in the (1, 2] bucket and is 1.5 s: the mean is 1.5 and
# Prometheus interpolates p50/p95/p99 linearly inside the bucket.
EXPECTED = {"mean": 1.5, "p50": 1.5, "p95": 1.95, "p99": 1.99, "last": 1.5}
HIST_LABELS = (
    'job="obsckpt",instance="a:9400",slot="actor",kind="checkpoint",strategy="all",'
    'phase="scan",backend="nccl",method="broadcast",sync_phase="wire"'
)
LABEL_VALUES = {"slot": "actor", "kind": "checkpoint", "strategy": "all", "phase": "scan"}
LABEL_VALUES["backend"] = "nccl"
LABEL_VALUES |= {"method": "broadcast", "sync_phase": "wire"}


def _events(every_s: int, scrape_s: int, length_s: int) -> list[int]:
    """Events (saves, syncs) counted at each scrape, one every ``every_s``: 0 at the
    first scrape, the first event lands at the next one."""
    return [0] + [
        1 + (i * scrape_s - scrape_s) // every_s for i in range(1, length_s // scrape_s + 1)
    ]


def _seconds(duration: str) -> int:
    """A promtool duration of one unit ("5s", "1m") in seconds."""
    return int(duration[:-1]) * (60 if duration.endswith("m") else 1)


def _sparse_series(save_every_s: int, scrape_s: int, length_s: int) -> dict[str, str]:
    """Every latency histogram of the dashboard, one save every ``save_every_s``, and the
    gauges holding their last observation (absent until the first save, then kept).

    The counters are 0 at the first scrape; the first save lands at the next one.
    """
    saves = _events(save_every_s, scrape_s, length_s)
    text = lambda scale: " ".join(f"{n * scale:g}" for n in saves)  # noqa: E731
    series: dict[str, str] = {}
    for metric in {
        "obsckpt_save_duration_seconds",
        "obsckpt_thread_join_wait_seconds",
        "obsckpt_save_admission_wait_seconds",
        "obsckpt_commit_lag_seconds",
        "obsckpt_commit_phase_seconds",
        "obsckpt_broadcast_duration_seconds",
        "obsckpt_state_dict_upload_duration_seconds",
        "obsckpt_store_upload_seconds",
        "obsckpt_mirror_copy_seconds",
        "obsckpt_rollout_pause_seconds",
        "obsckpt_weight_sync_phase_seconds",
    }:
        series[f'{metric}_bucket{{{HIST_LABELS},le="1"}}'] = text(0)
        series[f'{metric}_bucket{{{HIST_LABELS},le="2"}}'] = text(1)
        series[f'{metric}_bucket{{{HIST_LABELS},le="+Inf"}}'] = text(1)
        series[f"{metric}_sum{{{HIST_LABELS}}}"] = text(1.5)
        series[f"{metric}_count{{{HIST_LABELS}}}"] = text(1)
    last = " ".join("_" if n == 0 else "1.5" for n in saves)
    for metric in LAST_VALUE_GAUGES.values():
        series[f"{metric}{{{HIST_LABELS}}}"] = last
    series[
        'obsckpt_rank_last_save_duration_seconds{job="obsckpt",instance="a:9400",slot="actor",rank="0"}'
    ] = last
    return series


def _latency_cases(eval_times: list[str], window: str, only: str | None = None) -> list[dict]:
    """promtool cases of every latency panel's targets (``only``: those of one legend
    kind, e.g. ``"last"``), each expecting its value at each of ``eval_times``."""
    board = build_dashboard()
    cases = []
    for panel in board["panels"]:
        if panel["title"] not in LATENCY_PANELS or panel["type"] != "timeseries":
            continue
        for target in panel["targets"]:
            kind = target["legendFormat"].split(" ", 1)[0]
            if only is not None and kind != only:
                continue
            by = (LAST_BY if kind == "last" else LATENCY_PANELS)[panel["title"]]
            labels = ",".join(f'{k}="{LABEL_VALUES[k]}"' for k in sorted(by))
            for at in eval_times:
                cases.append(
                    {
                        # Rounded: extrapolated increases are off in the 10th digit.
                        "expr": f"round({expand(target['expr'], job='obsckpt', window=window)}, 0.001)",
                        "eval_time": at,
                        "exp_samples": [{"labels": f"{{{labels}}}", "value": EXPECTED[kind]}],
                    }
                )
    return cases


def _evaluate_at(
    promtool: str, tmp_path: Path, interval: str, series: dict[str, str], cases: list[dict]
) -> str:
    tests = {
        "rule_files": [],
        "evaluation_interval": interval,
        "tests": [
            {
                "interval": interval,
                "input_series": [{"series": k, "values": v} for k, v in series.items()],
                "promql_expr_test": cases,
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, width=10_000))
    result = subprocess.run(
        [promtool, "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return result.stdout + result.stderr if result.returncode else ""


@pytest.mark.needs_promtool
class TestLatencyAtSparseSaves:
    """Latency panels show the last value, mean and percentiles however rarely a job saves.

    Synthetic histograms with one save every 5 s, 10 min or 1 h, scraped by the
    real Prometheus engine (promtool); each panel query is evaluated between saves.
    """

    def test_every_latency_panel_is_covered(self):
        titles = {p["title"] for p in build_dashboard()["panels"]}
        assert set(LATENCY_PANELS) <= titles
        quantile_panels = {
            q.panel for q in panel_queries() if q.expr.startswith("histogram_quantile(")
        }
        assert quantile_panels == set(LATENCY_PANELS)

    def test_every_latency_panel_shows_the_last_value(self):
        """One target per panel reads a gauge of the last observation, over no range."""
        for title in LATENCY_PANELS:
            lasts = [q for q in panel_queries() if q.panel == title and q.legend.startswith("last")]
            assert len(lasts) == 1, f"{title}: {lasts}"
            [(name, _)] = SELECTOR.findall(lasts[0].expr)
            assert name in LAST_VALUE_GAUGES.values() or (
                name == "obsckpt_rank_last_save_duration_seconds"
                and title == "Save latency by slot and kind"
            ), f"{title} reads {name} as its last value"
            assert "[" not in lasts[0].expr, lasts[0].expr
        panel_histograms = {
            _base(name)
            for q in panel_queries()
            if q.panel in LATENCY_PANELS
            for name, _ in SELECTOR.findall(q.expr)
        }
        # Each histogram but the save duration's (read from the per-rank gauge) has its own.
        assert set(LAST_VALUE_GAUGES) == (panel_histograms & HISTOGRAMS) - {
            "obsckpt_save_duration_seconds"
        }

    @pytest.mark.parametrize(
        ("save_every_s", "scrape", "length_s", "eval_times"),
        [
            (5, "5s", 3600, ["5m", "32m", "1h"]),
            (600, "1m", 4 * 3600, ["5m", "19m", "2h", "3h55m"]),
            (3600, "1m", 5 * 3600, ["5m", "55m", "65m", "3h30m", "4h59m"]),
        ],
        ids=["every-5s", "every-10min", "every-1h"],
    )
    def test_panels_have_data_between_saves(
        self, promtool, tmp_path, save_every_s, scrape, length_s, eval_times
    ):
        scrape_s = _seconds(scrape)
        series = _sparse_series(save_every_s, scrape_s, length_s)
        cases = _latency_cases(eval_times, window="2h")
        assert _evaluate_at(promtool, tmp_path, scrape, series, cases) == ""

    def test_a_rate_interval_window_would_be_empty(self, promtool, tmp_path):
        """The same cases over a one-minute window fail: the test sees an empty panel."""
        series = _sparse_series(600, 60, 3600)
        cases = _latency_cases(["5m"], window="1m")
        out = _evaluate_at(promtool, tmp_path, "1m", series, cases)
        assert "histogram_quantile" in out and "FAILED" in out

    @pytest.mark.parametrize(
        ("save_every_s", "scrape", "length_s", "eval_times"),
        [
            (5, "5s", 600, ["1m", "4m33s", "10m"]),
            (600, "1m", 3600, ["5m", "19m", "59m"]),
            (3600, "1m", 5 * 3600, ["5m", "59m", "65m", "3h30m", "4h59m"]),
        ],
        ids=["every-5s", "every-10min", "every-1h"],
    )
    def test_last_values_need_no_window(
        self, promtool, tmp_path, save_every_s, scrape, length_s, eval_times
    ):
        """The last values show between saves even over a window shorter than the interval."""
        scrape_s = _seconds(scrape)
        series = _sparse_series(save_every_s, scrape_s, length_s)
        cases = _latency_cases(eval_times, window="1m", only="last")
        assert len(cases) == len(LATENCY_PANELS) * len(eval_times)
        assert _evaluate_at(promtool, tmp_path, scrape, series, cases) == ""

    def test_a_missing_last_value_fails(self, promtool, tmp_path):
        """Without the gauges the same last-value cases fail: the test sees an empty panel."""
        series = _sparse_series(3600, 60, 2 * 3600)
        for name in [k for k in series if k.startswith("obsckpt_last_")]:
            del series[name]
        out = _evaluate_at(promtool, tmp_path, "1m", series, _latency_cases(["65m"], "2h", "last"))
        for gauge in LAST_VALUE_GAUGES.values():
            assert gauge in out, f"no failed case for {gauge}:\n{out}"
        assert "obsckpt_rank_last_save_duration_seconds" not in out


BANDWIDTH = "Broadcast bandwidth"
SYNC_LABELS = 'job="obsckpt",instance="a:9400",backend="nccl",method="broadcast"'
# Each sync sends 3 GiB in 1.5 s: 2 GiB/s.
SYNC_BYTES, SYNC_SECONDS = 3 << 30, 1.5
LAST_BANDWIDTH = {"labels": '{backend="nccl",method="broadcast"}', "value": 2 << 30}


def _sync_series(sync_every_s: int, scrape_s: int, length_s: int) -> dict[str, str]:
    """The weight syncs' bytes counter and duration histogram, one sync every
    ``sync_every_s``, and the gauges of the last sync's bytes and duration (absent until
    the first sync, then kept)."""
    syncs = _events(sync_every_s, scrape_s, length_s)
    text = lambda scale: " ".join(str(n * scale) for n in syncs)  # noqa: E731
    last = lambda value: " ".join("_" if n == 0 else str(value) for n in syncs)  # noqa: E731
    return {
        f"obsckpt_broadcast_bytes_total{{{SYNC_LABELS}}}": text(SYNC_BYTES),
        f"obsckpt_broadcast_duration_seconds_sum{{{SYNC_LABELS}}}": text(SYNC_SECONDS),
        f"obsckpt_broadcast_duration_seconds_count{{{SYNC_LABELS}}}": text(1),
        f"obsckpt_last_broadcast_bytes{{{SYNC_LABELS}}}": last(SYNC_BYTES),
        f"obsckpt_last_broadcast_duration_seconds{{{SYNC_LABELS}}}": last(SYNC_SECONDS),
    }


def _bandwidth_cases(eval_times: list[str], window: str, only_last: bool = False) -> list[dict]:
    """promtool cases of the bandwidth panel's targets: the last sync's at 2 GiB/s; with
    ``only_last`` False, the window targets too, each expected to show no bandwidth
    (``> 0`` keeps neither a rate of 0 nor the NaN of 0 bytes over 0 s)."""
    [panel] = [p for p in build_dashboard()["panels"] if p["title"] == BANDWIDTH]
    cases = []
    for target in panel["targets"]:
        expr = expand(target["expr"], job="obsckpt", window=window)
        if target["legendFormat"].startswith("last"):
            cases += [
                {"expr": expr, "eval_time": at, "exp_samples": [LAST_BANDWIDTH]}
                for at in eval_times
            ]
        elif not only_last:
            cases += [
                {"expr": f"({expr}) > 0", "eval_time": at, "exp_samples": []} for at in eval_times
            ]
    return cases


@pytest.mark.needs_promtool
class TestBandwidthAtSparseSyncs:
    """The bandwidth panel shows the last sync's bandwidth however rarely weights sync.

    A sync every 5 s, 30 minutes or 1 h (an RL job may sync weights once an hour),
    scraped by the real Prometheus engine (promtool), evaluated between syncs.
    """

    def test_one_target_divides_the_last_bytes_by_the_last_duration(self):
        lasts = [q for q in panel_queries() if q.panel == BANDWIDTH and q.legend.startswith("last")]
        assert len(lasts) == 1, lasts
        names = [name for name, _ in SELECTOR.findall(lasts[0].expr)]
        assert names == ["obsckpt_last_broadcast_bytes", "obsckpt_last_broadcast_duration_seconds"]
        assert "[" not in lasts[0].expr, lasts[0].expr
        assert lasts[0].expr.startswith("max by (backend, method) (")

    @pytest.mark.parametrize(
        ("sync_every_s", "scrape", "length_s", "eval_times"),
        [
            (5, "5s", 600, ["1m", "4m33s", "10m"]),
            (1800, "1m", 3 * 3600, ["5m", "29m", "31m", "2h15m", "3h"]),
            (3600, "1m", 5 * 3600, ["5m", "59m", "65m", "3h30m", "4h59m"]),
        ],
        ids=["every-5s", "every-30min", "every-1h"],
    )
    def test_the_last_sync_needs_no_window(
        self, promtool, tmp_path, sync_every_s, scrape, length_s, eval_times
    ):
        scrape_s = _seconds(scrape)
        series = _sync_series(sync_every_s, scrape_s, length_s)
        cases = _bandwidth_cases(eval_times, window="1m", only_last=True)
        assert len(cases) == len(eval_times)
        assert _evaluate_at(promtool, tmp_path, scrape, series, cases) == ""

    def test_the_window_targets_show_nothing_between_rare_syncs(self, promtool, tmp_path):
        """Over a $window shorter than the interval (15m, syncs an hour apart) the rate
        targets show no bandwidth between syncs; the last sync's target does."""
        series = _sync_series(3600, 60, 4 * 3600)
        cases = _bandwidth_cases(["30m", "1h50m", "3h40m"], window="15m")
        assert len(cases) == 3 * 3
        assert _evaluate_at(promtool, tmp_path, "1m", series, cases) == ""

    def test_a_missing_last_value_fails(self, promtool, tmp_path):
        """Without the last bytes gauge the last sync's cases fail: an empty panel."""
        series = _sync_series(3600, 60, 2 * 3600)
        del series[f"obsckpt_last_broadcast_bytes{{{SYNC_LABELS}}}"]
        out = _evaluate_at(
            promtool, tmp_path, "1m", series, _bandwidth_cases(["65m"], "2h", only_last=True)
        )
        assert "FAILED" in out and "obsckpt_last_broadcast_bytes" in out, out


class TestShippedAssets:
    """The wheel's copies (obsckpt/_assets) are what dashboards/ builds, and export writes them."""

    def test_package_data_matches_the_build(self):
        files = generated_files()
        assert assets.read(assets.DASHBOARD) == files[DASHBOARD]
        assert assets.read(assets.RULES) == files[RULES]
        assert json.loads(assets.read(assets.DASHBOARD)) == build_dashboard()

    def test_scrape_snippet_is_the_stacks_job(self):
        snippet = yaml.safe_load(assets.read(assets.SCRAPE))
        stack = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        [job] = snippet["scrape_configs"]
        [stack_job] = [j for j in stack["scrape_configs"] if j["job_name"] == "obsckpt"]
        assert job["file_sd_configs"] == stack_job["file_sd_configs"]
        assert job["scrape_interval"] == stack["global"]["scrape_interval"]
        assert snippet["rule_files"] == [assets.RULES]
        assert f"obsckpt {obsckpt.__version__}" in assets.read(assets.SCRAPE)

    def test_cli_export_writes_files_prometheus_loads(self, promtool, tmp_path, capsys):
        out = tmp_path / "out"
        assert cli.main(["dashboards", "export", str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == sorted(assets.NAMES)
        assert capsys.readouterr().out.split() == [str(out / n) for n in assets.NAMES]
        for name in assets.NAMES:
            assert (out / name).read_text() == assets.read(name)
        # The snippet and the rules beside it are a config Prometheus accepts.
        result = subprocess.run(
            [promtool, "check", "config", assets.SCRAPE],
            cwd=out,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"SUCCESS: {len(ALERT_NAMES)} rules found" in result.stdout

    def test_export_points_runbook_links_at_the_given_url(self, tmp_path, monkeypatch):
        monkeypatch.setenv(assets.RUNBOOK_URL_ENV, "https://env.example/runbook.md")
        assets.export(tmp_path / "a", runbook_link="https://wiki.example/obsckpt/runbook")
        assets.export(tmp_path / "b")
        for sub, base in (
            ("a", "https://wiki.example/obsckpt/runbook"),
            ("b", "https://env.example/runbook.md"),
        ):
            rules = yaml.safe_load((tmp_path / sub / assets.RULES).read_text())
            urls = [r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]]
            assert urls == [f"{base}#{name.lower()}" for name in ALERT_NAMES]

    def test_export_refuses_a_relative_runbook_url_and_a_file(self, tmp_path, capsys):
        assert cli.main(["dashboards", "export", str(tmp_path), "--runbook-url", "docs/r.md"]) == 2
        err = capsys.readouterr().err
        assert "usage: obsckpt dashboards export" in err
        assert "--runbook-url: must be a URL (http:// or https://), got 'docs/r.md'" in err
        (tmp_path / "f").write_text("")
        assert cli.main(["dashboards", "export", str(tmp_path / "f")]) == 2
        assert "is a file" in capsys.readouterr().err
