"""End to end: a real Prometheus scrapes a real monitor actor and evaluates the rules.

Prometheus (Debian's ``/usr/bin/prometheus``) runs on a free loopback port with
a temporary copy of the project's scrape config: the ``obsckpt`` job finds its
target through the file_sd file the monitor writes, everything is scraped and
evaluated every second, and the alert rules are generated with thresholds of
seconds. The tests fail, not skip, when Prometheus is missing.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from dashboards import AlertThresholds, expand, panel_queries
from dashboards.build import rules_yaml
from obsckpt.sync.group import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
JOB = "obsckpt"
# Wide enough that step 1's samples stay in every rate window for the whole test,
# however slowly a loaded machine runs it (Grafana would use $__rate_interval).
RATE_INTERVAL = "5m"
# Panels that must show data once a few steps have committed: latest step,
# saves total, save duration quantiles, commit lag.
CORE_PANELS = (
    "Latest committed step",
    "Saves by result",
    "Save latency by slot and kind",
    "Commit lag",
)

pytestmark = pytest.mark.slow


def wait_for(what: str, probe: Callable[[], object], timeout: float, interval: float = 0.25):
    """Poll ``probe`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            result = probe()
        except OSError as exc:  # Prometheus not listening yet: an error, not an answer
            last = exc
        else:
            if result:
                return result
            last = result
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last probe: {last!r}")


class PrometheusServer:
    """A Prometheus process and a small client for its HTTP API."""

    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log

    def get(self, path: str, **params: str) -> dict:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            body = json.load(resp)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def alerts(self, name: str) -> list[dict]:
        return [a for a in self.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def start_prometheus(config_file: Path, workdir: Path) -> PrometheusServer:
    """The real prometheus binary on ``config_file``, once it answers ready."""
    binary = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(binary).exists():
        pytest.fail("prometheus not found: install Debian's `prometheus` package")
    port = free_port()
    log = workdir / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", process, log)

    def ready() -> bool:
        if process.poll() is not None:
            pytest.fail(f"prometheus exited with {process.returncode}:\n{server.log_tail()}")
        with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
            return resp.status == 200

    try:
        wait_for("prometheus to be ready", ready, timeout=20)
    except BaseException:
        server.stop()
        raise
    return server


def prometheus_config(sd_file: Path, rules_file: Path) -> dict:
    """The project's config, rewritten for the test: 1 s intervals, the test's files."""
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(rules_file)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == JOB]
    job["file_sd_configs"] = [{"files": [str(sd_file)], "refresh_interval": "1s"}]
    config["scrape_configs"] = [job]
    # The stack's Alertmanager (alertmanager:9093) does not exist here; the test
    # reads the alerts from Prometheus' own API.
    assert config.pop("alerting")["alertmanagers"]
    return config


@pytest.fixture
def ckpt_dir(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    path.mkdir()
    return path


@pytest.fixture
def monitor(ray_cluster, namespace, ckpt_dir, tmp_path):
    from obsckpt import CheckpointMonitor, SaveStrategy

    actor = CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=SaveStrategy.UNRESTRICTED,
        default_local_dir=str(ckpt_dir),
        metrics_port=0,
        metrics_host="127.0.0.1",
        file_sd_path=str(tmp_path / "sd.json"),
    )
    try:
        yield actor
    finally:
        try:
            ray_cluster.get(actor.shutdown.remote(), timeout=10)
        finally:
            ray_cluster.kill(actor)


def prometheus_for(monitor, ray_cluster, tmp_path: Path) -> PrometheusServer:
    """The real Prometheus scraping ``monitor`` through its file_sd file, with the rules."""
    address = ray_cluster.get(monitor.metrics_address.remote(), timeout=30)
    assert address and address.startswith("127.0.0.1:"), address
    sd_file = tmp_path / "sd.json"
    assert json.loads(sd_file.read_text())[0]["targets"] == [address]

    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(
        rules_yaml(AlertThresholds(commit_stall_seconds=2, commit_stall_for="1s", monitor_job=JOB))
    )
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(prometheus_config(sd_file, rules_file)))
    return start_prometheus(config_file, tmp_path)


def scraped_monitor(ray_cluster, namespace: str, tmp_path: Path, root: str, **options):
    """A monitor actor on ``root`` (``options``: more of get_actor's), a coordinator for it,
    and the real Prometheus scraping it."""
    from obsckpt import CheckpointCoordinator, CheckpointMonitor

    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        default_local_dir=root,
        metrics_port=0,
        metrics_host="127.0.0.1",
        file_sd_path=str(tmp_path / "sd.json"),
        **options,
    )
    coord = CheckpointCoordinator(monitor, rpc_timeout=30, save_timeout=60)
    return monitor, coord, prometheus_for(monitor, ray_cluster, tmp_path)


def save_two_steps(ray_cluster, monitor, coord, root: str) -> None:
    """Steps 1 and 2 of a 4 MiB state saved under ``root`` and submitted."""
    import torch

    for step in (1, 2):
        ray_cluster.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=1))
        state = {"w": torch.full((1 << 20,), float(step))}
        coord.save_state_dict_async("actor", state, f"{root}/global_step_{step}/m.pt", step)
        coord.wait_all(60)
        ray_cluster.get(monitor.monitor_step.remote(step))


@pytest.fixture
def prometheus(tmp_path, monitor, ray_cluster) -> Iterator[PrometheusServer]:
    server = prometheus_for(monitor, ray_cluster, tmp_path)
    try:
        yield server
    finally:
        server.stop()


def checkpoint(coord, step: int, save_fn: Callable[[], object]) -> None:
    """One step the way a trainer does it: start the save, then register and submit."""
    coord.save_async("model", save_fn, step, is_state_dict=False)
    asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=1))


def writer(ckpt_dir: Path, step: int) -> Callable[[], None]:
    def save() -> None:
        step_dir = ckpt_dir / f"global_step_{step}" / "actor"
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / "model_world_size_1_rank_0.pt").write_bytes(b"\0" * 4096)
        time.sleep(0.05)

    return save


def clock_offset() -> float:
    """Wall clock minus monotonic clock: changes when the wall clock is stepped."""
    return time.time() - time.monotonic()


def has_finite_value(result: list[dict]) -> bool:
    return any(math.isfinite(float(sample["value"][1])) for sample in result)


@pytest.mark.needs_promtool
def test_dashboards_and_commit_stall_alert_against_real_prometheus(
    prometheus, monitor, ckpt_dir, ray_cluster
):
    from obsckpt import CheckpointCoordinator

    # 1. The monitor's own file_sd entry makes it a healthy target of job "obsckpt".
    def target_up():
        targets = prometheus.get("/api/v1/targets", state="active")["activeTargets"]
        return [t for t in targets if t["labels"]["job"] == JOB and t["health"] == "up"]

    wait_for("the obsckpt target to be up", target_up, timeout=20)

    clock_at_start = clock_offset()

    # 2. Saves. Slot series appear with their first save, and rate() needs two
    # samples of a series, so later steps are saved once Prometheus has seen the first.
    coord = CheckpointCoordinator(monitor, rank=0)
    checkpoint(coord, 1, writer(ckpt_dir, 1))
    coord.wait_all(timeout=30)
    # Every series a core panel rates must have been scraped once before the next
    # saves: a scrape can land between the save counter's and the histograms' updates,
    # and a series first seen after its last increase has a rate of zero.
    for series in (
        f'obsckpt_saves_total{{job="{JOB}",slot="model"}}',
        f'obsckpt_save_duration_seconds_count{{job="{JOB}",slot="model"}} > 0',
        f'obsckpt_commit_lag_seconds_count{{job="{JOB}",kind="checkpoint"}} > 0',
    ):
        wait_for(f"Prometheus to scrape {series}", lambda s=series: prometheus.query(s), timeout=15)
    for step in (2, 3):
        checkpoint(coord, step, writer(ckpt_dir, step))
        coord.wait_all(timeout=30)
    ray_cluster.get(
        [
            monitor.record_broadcast.remote("gloo", 0.2, 1 << 20),
            monitor.record_upload.remote(0.1),
            monitor.record_model_version.remote("trainer", 3),
            monitor.record_model_version.remote("rollout", 2),
            monitor.record_weight_sync.remote(
                {
                    "method": "broadcast",
                    "step": 3,
                    "encoding": "delta",
                    "phases": {"encode": 0.05, "wire": 0.02, "apply": 0.01, "verify": 0.004},
                    "sent_bytes": 1 << 16,
                    "state_bytes": 1 << 20,
                    "changed_fraction": 0.02,
                    "pause_s": 0.3,
                    "rollout_version": 2,
                    "corrupt": "digest",
                }
            ),
        ],
        timeout=30,
    )
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"

    # 3. Every dashboard query evaluates; the core ones show data.
    queries = [(q, expand(q.expr, job=JOB, rate_interval=RATE_INTERVAL)) for q in panel_queries()]
    core = [(q, expr) for q, expr in queries if q.panel in CORE_PANELS]
    assert {q.panel for q, _ in core} == set(CORE_PANELS)

    def core_panels_without_data():
        return [
            f"{q.panel} ({q.ref_id}): {expr}"
            for q, expr in core
            if not has_finite_value(prometheus.query(expr))
        ]

    def scraped(step: int) -> None:
        wait_for(
            f"Prometheus to scrape the saves up to step {step}",
            lambda: prometheus.query(
                f'obsckpt_save_duration_seconds_count{{job="{JOB}",slot="model"}} >= {step}'
            ),
            timeout=15,
        )

    # The rates need an increase between two samples inside their window. Samples
    # are stamped with the wall clock, which a freshly booted VM may step forward
    # by minutes (its clock being set) and leave every earlier sample out of the
    # window; so while a core panel shows nothing, save one more step and look again.
    scraped(3)
    step = 3
    deadline = time.monotonic() + 60
    while (missing := core_panels_without_data()) and time.monotonic() < deadline:
        time.sleep(2)
        if core_panels_without_data():
            step += 1
            checkpoint(coord, step, writer(ckpt_dir, step))
            coord.wait_all(timeout=30)
            scraped(step)
    if missing:
        # What Prometheus holds, so a failure here can be told apart from a slow scrape.
        for probe in (
            f'count_over_time(obsckpt_save_duration_seconds_count{{job="{JOB}"}}[{RATE_INTERVAL}])',
            f'min_over_time(obsckpt_save_duration_seconds_count{{job="{JOB}"}}[{RATE_INTERVAL}])',
            f'obsckpt_save_duration_seconds_count{{job="{JOB}"}}',
            f'rate(obsckpt_save_duration_seconds_count{{job="{JOB}"}}[{RATE_INTERVAL}])',
            f'count_over_time(up{{job="{JOB}"}}[{RATE_INTERVAL}])',
            f'min_over_time(up{{job="{JOB}"}}[{RATE_INTERVAL}])',
            f'max_over_time(scrape_duration_seconds{{job="{JOB}"}}[{RATE_INTERVAL}])',
        ):
            missing.append(f"  {probe} = {prometheus.query(probe)}")
        missing.append(
            f"  wall clock moved {clock_offset() - clock_at_start:+.1f} s against monotonic"
        )
    assert not missing, f"core panels without data after step {step}:\n" + "\n".join(missing)
    for _, expr in queries:
        prometheus.query(expr)  # fails the test on a PromQL error
    assert prometheus.query(f'obsckpt_latest_step{{job="{JOB}",kind="checkpoint"}} == {step}')

    # Every latency panel shows its last value (a gauge kept until the next observation,
    # so it needs no window), and the bandwidth panel the last sync's bytes over its
    # duration; the weight sync's and the upload's are those recorded above.
    last_values = {q.panel: expr for q, expr in queries if q.legend.startswith("last")}
    # The upload panel of the s3:// row has data only on an s3:// root (its series are
    # scraped in tests/test_store_commit.py); this job's root is local.
    del last_values["Uploads per slot"]
    del last_values["Mirror copies"]  # with a mirror only: test_mirror_panels_... below
    assert {
        "Commit lag",
        "Broadcast duration",
        "Broadcast bandwidth",
        "State dict upload duration",
    } <= set(last_values)

    def last_value(panel: str) -> dict[str, float]:
        return {
            ",".join(sample["metric"].values()): float(sample["value"][1])
            for sample in prometheus.query(last_values[panel])
        }

    wait_for(
        "every latency panel's last value",
        lambda: all(
            values and all(math.isfinite(v) for v in values.values())
            for values in map(last_value, last_values)
        ),
        timeout=15,
    )
    assert last_value("Broadcast duration") == {"gloo": 0.2}
    assert last_value("Broadcast bandwidth") == {"gloo,broadcast": pytest.approx((1 << 20) / 0.2)}
    assert last_value("State dict upload duration") == {"": 0.1}
    assert last_value("Rollout pause") == {"broadcast": 0.3}

    # The delta sync's panels show the sync recorded above without a window.
    def panel_values(panel: str) -> list[dict[str, float]]:
        return [
            {
                ",".join(v for k, v in sorted(s["metric"].items()) if k != "instance"): float(
                    s["value"][1]
                )
                for s in prometheus.query(expr)
            }
            for q, expr in queries
            if q.panel == panel
        ]

    assert last_value("Sync phases") == {
        "apply": 0.01,
        "encode": 0.05,
        "verify": 0.004,
        "wire": 0.02,
    }
    assert panel_values("Bytes sent vs full state")[:2] == [{"delta": 1 / 16}, {"": 0.02}]
    assert panel_values("Integrity failures") == [{"checksum": 0.0, "digest": 1.0}]
    assert panel_values("Rollout version lag") == [{"": 1.0}]
    # The last commit moved both iteration files: one lag for each kind.
    lags = last_value("Commit lag")
    assert set(lags) == {"checkpoint", "state_dict"} and all(0 < v < 60 for v in lags.values())

    # 4. A save that never finishes stalls the next step; the alert goes pending, then firing.
    step += 1
    release = threading.Event()
    checkpoint(coord, step, lambda: release.wait(60))
    try:
        firing = wait_for(
            "ObsckptCommitStalled to fire",
            lambda: [
                a for a in prometheus.alerts("ObsckptCommitStalled") if a["state"] == "firing"
            ],
            timeout=25,
        )
        assert firing[0]["labels"]["kind"] == "checkpoint"
        assert firing[0]["labels"]["job"] == JOB
        assert firing[0]["annotations"]["runbook_url"].endswith("#obsckptcommitstalled")
        status = ray_cluster.get(monitor.status.remote(), timeout=10)
        assert [p["step"] for p in status["pending"]] == [step]
    finally:
        release.set()
    coord.wait_all(timeout=30)

    # 5. The step commits and the alert resolves.
    assert (ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == str(step)
    wait_for(
        "ObsckptCommitStalled to resolve",
        lambda: not prometheus.alerts("ObsckptCommitStalled"),
        timeout=15,
    )
    assert not [a for a in prometheus.alerts("ObsckptMonitorDown") if a["state"] == "firing"]
    assert prometheus.process.poll() is None, prometheus.log_tail()


def test_store_row_against_real_prometheus(ray_cluster, namespace, tmp_path, seaweed_server):
    """The dashboard's s3:// row, its commit phases and ObsckptStoreErrors, against the real
    Prometheus scraping a monitor whose root is on the S3 server."""
    import uuid

    from seaweed import BUCKET

    root = f"s3://{BUCKET}/runs/{uuid.uuid4().hex[:12]}"
    monitor, coord, server = scraped_monitor(ray_cluster, namespace, tmp_path, root)
    try:
        save_two_steps(ray_cluster, monitor, coord, root)
        queries = {
            (q.panel, q.legend): expand(q.expr, job=JOB)
            for q in panel_queries()
            if q.panel
            in (
                "Uploads per slot",
                "Upload throughput per slot",
                "Store errors, conflicts and fenced commits",
                "Commit phase time",
            )
        }

        def values(key: tuple[str, str]) -> dict[str, float]:
            return {
                ",".join(sample["metric"].values()): float(sample["value"][1])
                for sample in server.query(queries[key])
            }

        wait_for(
            "the s3:// row's upload panels",
            lambda: (
                values(("Uploads per slot", "last {{slot}}"))
                and values(("Upload throughput per slot", "{{slot}}"))
                and values(("Commit phase time", "last {{phase}}"))
            ),
            timeout=20,
        )
        assert set(values(("Uploads per slot", "last {{slot}}"))) == {"actor"}
        assert all(v > 0 for v in values(("Uploads per slot", "last {{slot}}")).values())
        phases = values(("Commit phase time", "last {{phase}}"))
        assert {"head_check", "manifest_put", "pointer_cas"} <= set(phases), phases
        # No error, conflict or fenced commit: the counters' panels read 0, or nothing for
        # the error counter, whose series appear with a first error.
        store_panel = "Store errors, conflicts and fenced commits"
        for (panel, legend), _expr in queries.items():
            if panel == store_panel:
                assert all(v == 0 for v in values((panel, legend)).values()), legend
        assert values((store_panel, "fenced commits {{instance}}"))
        assert server.alerts("ObsckptStoreErrors") == []
        for key in queries:  # every query of the row is one Prometheus takes
            values(key)
    finally:
        server.stop()
        coord.close()
        ray_cluster.get(monitor.shutdown.remote(final_scrape_wait_s=0), timeout=30)
        ray_cluster.kill(monitor)


def test_mirror_panels_against_real_prometheus(ray_cluster, namespace, tmp_path, seaweed_server):
    """The dashboard's mirror panels, against the real Prometheus scraping a monitor whose
    local root is mirrored to the S3 server."""
    import uuid

    from seaweed import BUCKET

    root = str(tmp_path / "root")
    mirror = f"s3://{BUCKET}/mirrors/{uuid.uuid4().hex[:12]}"
    monitor, coord, server = scraped_monitor(ray_cluster, namespace, tmp_path, root, mirror=mirror)
    try:
        save_two_steps(ray_cluster, monitor, coord, root)
        wait_for(
            "the mirror's copy of step 2",
            lambda: (
                ray_cluster.get(monitor.status.remote())["mirror"]["committed"]["checkpoint"] == 2
            ),
            timeout=30,
        )
        rows = ("Mirror: steps committed locally and on S3", "Mirror copies")
        rows += ("Mirror throughput and failures",)
        queries = {
            (q.panel, q.legend): expand(q.expr, job=JOB) for q in panel_queries() if q.panel in rows
        }

        def values(key: tuple[str, str]) -> dict[str, float]:
            return {
                ",".join(sample["metric"].values()): float(sample["value"][1])
                for sample in server.query(queries[key])
            }

        steps = ("Mirror: steps committed locally and on S3", "mirror {{kind}} {{instance}}")
        wait_for(
            "the mirror panels",
            lambda: (
                2 in values(steps).values()
                and values(("Mirror copies", "last copy"))
                and values(("Mirror throughput and failures", "bytes/s {{instance}}"))
            ),
            timeout=20,
        )
        local = values(("Mirror: steps committed locally and on S3", "local {{kind}} {{instance}}"))
        assert sorted(local.values()) == [2.0, 2.0], local  # checkpoint and state dict
        assert all(v > 0 for v in values(("Mirror copies", "last copy")).values())
        failed = values(("Mirror throughput and failures", "failed copies {{instance}}"))
        assert failed and all(v == 0 for v in failed.values()), failed
        for key in queries:  # every query of the row is one Prometheus takes
            values(key)
    finally:
        server.stop()
        coord.close()
        ray_cluster.get(monitor.shutdown.remote(final_scrape_wait_s=0), timeout=90)
        ray_cluster.kill(monitor)
