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

UID = "obsckpt"
TITLE = "obsckpt: checkpointing"
DATASOURCE = dash_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
TEMPO_UID = "tempo"

# Every query carries this matcher; a test checks it.
JOB = 'job=~"$job"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)


def m(metric: str, *matchers: str) -> str:
    """A selector of ``metric`` in the selected job, with extra label matchers."""
    return f"{metric}{{{', '.join((JOB, *matchers))}}}"


def quantiles(metric: str, by: tuple[str, ...], legend: str) -> list[tuple[str, str]]:
    """p50/p95/p99 targets of a histogram, aggregated over everything but ``by``."""
    keys = ", ".join(("le", *by))
    return [
        (
            f"histogram_quantile({q:g}, sum by ({keys}) (rate({m(metric + '_bucket')}[{RATE}])))",
            f"p{round(q * 100)} {legend}".rstrip(),
        )
        for q in QUANTILES
    ]


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
    extra: dict = field(default_factory=dict)


ROWS: list[tuple[str, list[PanelSpec]]] = [
    (
        "Overview",
        [
            PanelSpec(
                "Latest committed step",
                "Step named by latest_*_iteration.txt.",
                "none",
                [(f"max by (kind) ({m('obsckpt_latest_step')})", "{{kind}}")],
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
                width=4,
                height=5,
            ),
            PanelSpec(
                "Pending steps",
                "Steps with saves started or registered that are not committed, failed or superseded.",
                "none",
                [(f"sum by (kind) ({m('obsckpt_pending_steps')})", "{{kind}}")],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Oldest pending step age",
                "Empty when nothing is pending (the start timestamp is 0).",
                "s",
                [
                    (
                        "time() - (min by (kind) "
                        f"({m('obsckpt_oldest_pending_step_start_timestamp_seconds')} > 0))",
                        "{{kind}}",
                    )
                ],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Saves in flight",
                "Saves admitted by the monitor and not yet finished.",
                "none",
                [(f"sum by (kind) ({m('obsckpt_saves_in_flight')})", "{{kind}}")],
                viz="stat",
                width=4,
                height=5,
            ),
            PanelSpec(
                "Failed steps",
                "Steps that will never commit because a save failed, since the monitor started.",
                "none",
                [(f"sum by (kind) ({m('obsckpt_step_failures_total')})", "{{kind}}")],
                viz="stat",
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
                "Admission to fsync of one background save.",
                "s",
                quantiles("obsckpt_save_duration_seconds", ("slot", "kind"), "{{slot}} {{kind}}"),
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
                "A new save waiting for the previous save of the same slot: saves outpace the disk.",
                "s",
                quantiles("obsckpt_thread_join_wait_seconds", ("slot",), "{{slot}}"),
                width=6,
            ),
            PanelSpec(
                "Admission waits",
                "A save waiting for admission under the save strategy.",
                "s",
                quantiles("obsckpt_save_admission_wait_seconds", ("strategy",), "{{strategy}}"),
                width=6,
            ),
        ],
    ),
    (
        "Commits",
        [
            PanelSpec(
                "Commit lag",
                "From a step's first save start to its iteration file commit.",
                "s",
                quantiles("obsckpt_commit_lag_seconds", ("kind",), "{{kind}}"),
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
                "Per monitor (one per training job); empty until its first commit of a kind.",
                "s",
                [
                    (
                        "time() - max by (instance, kind) "
                        f"({m('obsckpt_last_commit_timestamp_seconds')} > 0)",
                        "{{instance}} {{kind}}",
                    )
                ],
                width=8,
            ),
            PanelSpec(
                "Pending and abandoned steps",
                "Steps waiting for their saves to finish, and steps that will never commit "
                "(found uncommitted at monitor start, lost by a monitor restart, or overtaken "
                "by a later commit).",
                "none",
                [
                    (f"sum by (kind) ({m('obsckpt_pending_steps')})", "pending {{kind}}"),
                    (f"sum({m('obsckpt_abandoned_steps')})", "abandoned"),
                ],
                width=8,
            ),
            PanelSpec(
                "Oldest pending step age",
                "Grows until the step commits; ObsckptCommitStalled fires past its threshold.",
                "s",
                [
                    (
                        "time() - (min by (kind) "
                        f"({m('obsckpt_oldest_pending_step_start_timestamp_seconds')} > 0))",
                        "{{kind}}",
                    )
                ],
                width=8,
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
                "Where a commit's time goes: scan, fsync_files, manifest, rename_iteration "
                "(failed and timed-out phases included).",
                "s",
                quantiles("obsckpt_commit_phase_seconds", ("phase",), "{{phase}}"),
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
        ],
    ),
    (
        "Weight sync",
        [
            PanelSpec(
                "Broadcast duration",
                "One weight broadcast from trainer rank 0 to the rollout side.",
                "s",
                quantiles("obsckpt_broadcast_duration_seconds", ("backend",), "{{backend}}"),
                width=8,
            ),
            PanelSpec(
                "Broadcast bandwidth",
                "Bytes per second averaged over time, and while a broadcast runs.",
                "Bps",
                [
                    (
                        f"sum by (backend) (rate({m('obsckpt_broadcast_bytes_total')}[{RATE}]))",
                        "{{backend}} average",
                    ),
                    (
                        f"sum by (backend) (rate({m('obsckpt_broadcast_bytes_total')}[{RATE}]))"
                        " / sum by (backend) "
                        f"(rate({m('obsckpt_broadcast_duration_seconds_sum')}[{RATE}]))",
                        "{{backend}} while broadcasting",
                    ),
                ],
                width=8,
            ),
            PanelSpec(
                "State dict upload duration",
                "One state dict upload to the Synchronizer.",
                "s",
                quantiles("obsckpt_state_dict_upload_duration_seconds", (), ""),
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
                "Weight syncs that raised (peer died or stalled past the timeout); "
                "each breaks its group, which is formed again for the next sync.",
                "none",
                [
                    (
                        "sum by (backend, method, reason) "
                        f"(increase({m('obsckpt_broadcast_failures_total')}[{RATE}]))",
                        "{{method}} {{backend}} {{reason}}",
                    ),
                ],
                width=8,
            ),
        ],
    ),
]


def _target(ref: str, expr: str, legend: str, instant: bool) -> prom_b.Dataquery:
    query = prom_b.Dataquery().ref_id(ref).expr(expr).legend_format(legend).datasource(DATASOURCE)
    return query.instant() if instant else query.range()


def _panel(spec: PanelSpec, panel_id: int):
    if spec.viz == "stat":
        panel = (
            stat.Panel()
            .graph_mode(common_m.BigValueGraphMode.AREA)
            .color_mode(common_m.BigValueColorMode.VALUE)
            .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
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
    )
    panel_id = 1
    for title, specs in ROWS:
        builder = builder.with_row(dash_b.Row(title).id(panel_id))
        panel_id += 1
        for spec in specs:
            builder = builder.with_panel(_panel(spec, panel_id))
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


def expand(expr: str, *, job: str = ".+", rate_interval: str = "1m") -> str:
    """``expr`` with the dashboard variables replaced, ready for Prometheus' HTTP API."""
    out = expr.replace("$__rate_interval", rate_interval).replace("$job", job)
    leftover = re.findall(r"\$\w+", out)
    if leftover:
        raise ValueError(f"query still has variables {leftover} after expansion: {out}")
    return out
