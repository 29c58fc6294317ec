"""Runbook drills: each alert's incident made to happen in a real job, as on-call meets it.

A local Ray cluster runs a real monitor (and, for weight sync, a real
Synchronizer); a real Prometheus (Debian's ``/usr/bin/prometheus``) discovers it
through the file_sd file the monitor writes, scrapes it every second and
evaluates the project's rules, generated with thresholds of seconds. Each drill
checks what docs/runbook.md promises: the alert fires with the labels and
annotations it describes, the diagnosis steps show what it says they show, the
remedy clears the alert, and a healthy job (its start, a monitor restart, a
clean finish) raises nothing. The tests fail, not skip, when Prometheus is missing.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from test_prometheus_e2e import PrometheusServer, prometheus_config, start_prometheus, wait_for

from dashboards import AlertThresholds, build_dashboard
from dashboards.alerts import duration_seconds
from dashboards.build import rules_yaml
from obsckpt.cli import main as obsckpt_cli

pytestmark = [pytest.mark.slow, pytest.mark.needs_promtool]

ROOT = Path(__file__).resolve().parents[1]
RUNBOOK = ROOT / "docs" / "runbook.md"
JOB = "obsckpt"
# The production rules scaled to a 1 s scrape. Monitor down: Prometheus applies
# file_sd changes at most every 5 s, so a restarted monitor's old target is down
# for several seconds; the shipped 2 minutes leave the same margin at 10 s scrapes.
THRESHOLDS = AlertThresholds(
    commit_stall_seconds=3,
    commit_stall_for="2s",
    no_commit_seconds=4,
    no_commit_for="1s",
    failure_window="2m",
    monitor_down_for="10s",
    weight_sync_for="2s",
    missed_scrape_window="5s",
)
UNRENDERED = re.compile(r"\{\{|\(\s*,|,\s*\)|job \)|monitor \)|  ")


class Drill:
    """One training job's monitor, scraped by its own Prometheus."""

    def __init__(self, ray, monitor, ckpt_dir: Path, sd_file: Path, prom: PrometheusServer):
        self.ray = ray
        self.monitor = monitor
        self.ckpt_dir = ckpt_dir
        self.sd_file = sd_file
        self.prom = prom
        self.address = ray.get(monitor.metrics_address.remote(), timeout=30)

    def monitor_pid(self) -> int:
        return self.ray.get(self.monitor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)

    def firing(self, name: str) -> list[dict]:
        return [a for a in self.prom.alerts(name) if a["state"] == "firing"]

    def wait_firing(self, name: str, timeout: float = 30) -> dict:
        (alert,) = wait_for(f"{name} to fire", lambda: self.firing(name), timeout=timeout)
        return alert

    def wait_resolved(self, name: str, timeout: float = 30) -> None:
        wait_for(f"{name} to resolve", lambda: not self.prom.alerts(name), timeout=timeout)

    def ever_fired(self, seconds: int) -> list[dict]:
        """Alerts that were firing at any evaluation in the last ``seconds``."""
        return self.prom.query(f'max_over_time(ALERTS{{alertstate="firing"}}[{seconds}s])')

    def cli(self, *argv: str) -> tuple[int, str]:
        out, err = io.StringIO(), io.StringIO()
        code = obsckpt_cli(list(argv), out=out, err=err)
        return code, out.getvalue() + err.getvalue()


def writer(ckpt_dir: Path, step: int) -> Callable[[], None]:
    def save() -> None:
        step_dir = ckpt_dir / f"global_step_{step}" / "actor"
        step_dir.mkdir(parents=True, exist_ok=True)
        (step_dir / "model_world_size_1_rank_0.pt").write_bytes(b"\0" * 4096)

    return save


def checkpoint(coord, step: int, save_fn: Callable[[], object]) -> None:
    """One step the way a trainer does it: start the save, then register and submit."""
    coord.save_async("model", save_fn, step, is_state_dict=False)
    asyncio.run(coord.register_and_monitor(step, checkpoint_thread_count=1))


def assert_rendered(alert: dict) -> None:
    for key in ("summary", "description"):
        text = alert["annotations"][key]
        assert not UNRENDERED.search(text), f"{key} not rendered: {text!r}"


@pytest.fixture
def start_drill(ray_cluster, namespace) -> Iterator[Callable[..., Drill]]:
    """Start a monitor (``get_actor`` keywords) and a Prometheus scraping it."""
    started: list[Drill] = []
    # Not pytest's tmp_path: other pytest sessions on the machine prune old base
    # directories, and Prometheus loses its TSDB and file_sd file with it.
    scratch = tempfile.TemporaryDirectory(prefix="obsckpt-drill-")
    tmp_path = Path(scratch.name)

    def start(**monitor_kwargs) -> Drill:
        from obsckpt import CheckpointMonitor

        ckpt_dir = tmp_path / "ckpt"
        ckpt_dir.mkdir()
        sd_file = tmp_path / "sd.json"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            default_local_dir=str(ckpt_dir),
            metrics_port=0,
            metrics_host="127.0.0.1",
            file_sd_path=str(sd_file),
            **monitor_kwargs,
        )
        rules = tmp_path / "rules.yml"
        rules.write_text(rules_yaml(THRESHOLDS))
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(prometheus_config(sd_file, rules)))
        prom = start_prometheus(config, tmp_path)
        drill = Drill(ray_cluster, monitor, ckpt_dir, sd_file, prom)
        started.append(drill)
        wait_for(
            "the monitor to be scraped",
            lambda: prom.query(f'up{{job="{JOB}",instance="{drill.address}"}} == 1'),
            timeout=20,
        )
        return drill

    yield start
    for drill in started:
        drill.prom.stop()
        try:
            pid = drill.monitor_pid()
            ray_cluster.kill(drill.monitor)
        except Exception:  # noqa: BLE001 - already gone in the monitor drills
            continue
        # ray.kill returns before the process is gone: a monitor still finishing a commit
        # would write into the directory being removed.
        wait_for("the monitor's process to exit", lambda p=pid: not process_alive(p), timeout=30)
    scratch.cleanup()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class TestCommitStalled:
    """A hung save fires ObsckptCommitStalled with its age in seconds; the runbook's
    checks name the step and the hung save; a missed scrape does not restart the
    ``for`` timer; the save finishing commits the step and resolves the alert."""

    def test_drill(self, start_drill, namespace):
        from obsckpt import CheckpointCoordinator

        drill = start_drill()
        coord = CheckpointCoordinator(drill.monitor, rank=0)
        checkpoint(coord, 1, writer(drill.ckpt_dir, 1))
        coord.wait_all(timeout=30)

        release = threading.Event()
        checkpoint(coord, 2, lambda: release.wait(120))
        try:
            pending = wait_for(
                "ObsckptCommitStalled to go pending",
                lambda: drill.prom.alerts("ObsckptCommitStalled"),
                timeout=20,
            )
            # The monitor stops answering for two scrapes (a long GC pause, an
            # overloaded node): the pending alert keeps its start.
            pid = drill.monitor_pid()
            os.kill(pid, signal.SIGSTOP)
            try:
                time.sleep(2.5)
            finally:
                os.kill(pid, signal.SIGCONT)
            wait_for(
                "a failed scrape while the monitor was stopped",
                lambda: drill.prom.query(f'min_over_time(up{{job="{JOB}"}}[15s]) == 0'),
                timeout=5,
            )
            alert = drill.wait_firing("ObsckptCommitStalled")
            assert alert["activeAt"] == pending[0]["activeAt"]

            assert alert["labels"]["kind"] == "checkpoint"
            assert alert["labels"]["instance"] == drill.address
            assert alert["labels"]["obsckpt_namespace"] == namespace
            assert alert["labels"]["severity"] == "critical"
            assert_rendered(alert)
            age = float(re.search(r"started (\d+) s ago", alert["annotations"]["description"])[1])
            assert 3 < age < 60
            assert alert["annotations"]["runbook_url"].endswith("#obsckptcommitstalled")

            # Check 2: status() names the pending step and its hung save.
            status = drill.ray.get(drill.monitor.status.remote(), timeout=10)
            (step,) = status["pending"]
            assert (step["step"], step["registered"], step["finished"]) == (2, 1, 0)
            (save,) = status["in_flight"]
            assert (save["step"], save["slot"], save["rank"]) == (2, "model", 0)
            # Check 3: the iteration files still name step 1.
            code, out = drill.cli("status", str(drill.ckpt_dir))
            assert code == 0, out
            assert "latest checkpoint: 1" in out
            # Check 4: the hung save's thread, by the name the runbook gives.
            assert "obsckpt-save-model-step2" in [t.name for t in threading.enumerate()]
        finally:
            release.set()
        coord.wait_all(timeout=30)
        drill.wait_resolved("ObsckptCommitStalled")
        assert (drill.ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


class TestNoRecentCommit:
    """A job that stops committing fires ObsckptNoRecentCommit for each kind it has
    committed, with the time since; the next commit resolves it."""

    def test_drill(self, start_drill):
        from obsckpt import CheckpointCoordinator

        drill = start_drill()
        time.sleep(5)  # the threshold and its for: nothing fires before a first commit
        assert not drill.prom.alerts("ObsckptNoRecentCommit")

        coord = CheckpointCoordinator(drill.monitor, rank=0)
        checkpoint(coord, 1, writer(drill.ckpt_dir, 1))
        coord.wait_all(timeout=30)
        alerts = wait_for(
            "ObsckptNoRecentCommit to fire for both kinds (a full checkpoint commits both)",
            lambda: (
                len(drill.firing("ObsckptNoRecentCommit")) == 2
                and drill.firing("ObsckptNoRecentCommit")
            ),
            timeout=30,
        )
        assert {a["labels"]["kind"] for a in alerts} == {"checkpoint", "state_dict"}
        for alert in alerts:
            assert_rendered(alert)
            ago = float(re.search(r"step (\d+) s ago", alert["annotations"]["description"])[1])
            assert 4 < ago < 60
        code, out = drill.cli("status", str(drill.ckpt_dir))
        assert code == 0 and "latest checkpoint: 1" in out, out

        checkpoint(coord, 2, writer(drill.ckpt_dir, 2))
        coord.wait_all(timeout=30)
        drill.wait_resolved("ObsckptNoRecentCommit", timeout=15)


class TestSaveFailures:
    """A save that raises (ENOSPC) fires ObsckptSaveFailures for its monitor and kind;
    wait_all() names the slot and step, status() the failed step, and the last
    committed step still verifies; the next step commits normally."""

    def test_drill(self, start_drill, namespace):
        from obsckpt import CheckpointCoordinator

        drill = start_drill()
        coord = CheckpointCoordinator(drill.monitor, rank=0)
        checkpoint(coord, 1, writer(drill.ckpt_dir, 1))
        coord.wait_all(timeout=30)

        def no_space() -> None:
            raise OSError(28, "No space left on device")

        checkpoint(coord, 2, no_space)
        with pytest.raises(Exception, match=r"'model' of step 2.*No space left"):
            coord.wait_all(timeout=30)
        alert = drill.wait_firing("ObsckptSaveFailures")
        assert alert["labels"]["kind"] == "checkpoint"
        assert alert["labels"]["instance"] == drill.address
        assert alert["labels"]["obsckpt_namespace"] == namespace
        assert_rendered(alert)
        assert drill.address in alert["annotations"]["description"]

        status = drill.ray.get(drill.monitor.status.remote(), timeout=10)
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(2, "checkpoint")]
        assert "No space left" in status["failed"][0]["error"]
        code, out = drill.cli("verify", str(drill.ckpt_dir))
        assert code == 0, out

        checkpoint(coord, 3, writer(drill.ckpt_dir, 3))
        coord.wait_all(timeout=30)
        assert (drill.ckpt_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


class TestMonitorDown:
    """A monitor that Ray restarts is scraped again at its new address without
    ObsckptMonitorDown firing; one that dies for good fires it while its file_sd
    entry still names the dead address; a clean finish fires nothing."""

    def test_restart_is_quiet_and_a_dead_monitor_fires(self, start_drill):
        drill = start_drill(max_restarts=1)
        first = drill.address
        os.kill(drill.monitor_pid(), signal.SIGKILL)
        killed = time.monotonic()
        # Restarted: it writes its new address to the file_sd file and is scraped there.
        wait_for(
            "the restarted monitor's new address in the file_sd file",
            lambda: first not in drill.sd_file.read_text(),
            timeout=30,
        )
        second = drill.ray.get(drill.monitor.metrics_address.remote(), timeout=30)
        assert json.loads(drill.sd_file.read_text())[0]["targets"] == [second]
        wait_for(
            "the restarted monitor to be scraped",
            lambda: drill.prom.query(f'up{{job="{JOB}",instance="{second}"}} == 1'),
            timeout=20,
        )
        assert drill.ray.get(drill.monitor.status.remote(), timeout=10)["restarted"]
        down_for = duration_seconds(THRESHOLDS.monitor_down_for)
        time.sleep(max(0.0, killed + down_for + 2 - time.monotonic()))
        assert not drill.firing("ObsckptMonitorDown")

        # No restarts left: the actor stays dead and its entry names a dead address.
        os.kill(drill.monitor_pid(), signal.SIGKILL)
        alert = drill.wait_firing("ObsckptMonitorDown", timeout=40)
        assert alert["labels"]["instance"] == second
        assert alert["labels"]["severity"] == "critical"
        assert_rendered(alert)
        # Check 2: the file_sd file still names the dead monitor's address.
        assert json.loads(drill.sd_file.read_text())[0]["targets"] == [second]
        # Check 4: the monitor does not answer.
        with pytest.raises(Exception, match="(?i)actor"):
            drill.ray.get(drill.monitor.status.remote(), timeout=10)

    def test_a_healthy_job_and_its_clean_finish_fire_nothing(self, start_drill):
        from obsckpt import CheckpointCoordinator

        drill = start_drill()
        coord = CheckpointCoordinator(drill.monitor, rank=0)
        started = time.monotonic()
        step = 0
        while time.monotonic() - started < 3:
            step += 1
            checkpoint(coord, step, writer(drill.ckpt_dir, step))
            coord.wait_all(timeout=30)
            time.sleep(0.5)
        fired = drill.ever_fired(int(time.monotonic() - started) + 5)
        assert not fired, [a["metric"] for a in fired]
        # The job ends as `obsckpt demo` ends it: shutdown() withdraws the target.
        drill.ray.get(drill.monitor.shutdown.remote(), timeout=60)
        assert json.loads(drill.sd_file.read_text()) == []
        finished = time.monotonic()
        wait_for(
            "Prometheus to drop the withdrawn target",
            lambda: not drill.prom.query(f'up{{job="{JOB}"}}'),
            timeout=20,
        )
        time.sleep(
            max(
                0.0, finished + duration_seconds(THRESHOLDS.monitor_down_for) + 4 - time.monotonic()
            )
        )
        assert not drill.prom.alerts("ObsckptMonitorDown")
        seconds = int(time.monotonic() - finished) + 2
        assert not drill.prom.query(
            f'max_over_time(ALERTS{{alertname="ObsckptMonitorDown",alertstate="firing"}}[{seconds}s])'
        )


class TestWeightSyncLagging:
    """A rollout side that stops taking new weights from the Synchronizer fires
    ObsckptWeightSyncLagging with the lag in versions; the rollout catching up
    resolves it."""

    def test_drill(self, start_drill, namespace):
        import torch

        from obsckpt import Synchronizer

        drill = start_drill()
        sync = Synchronizer.get_actor(namespace=namespace, watch=False)
        try:
            drill.ray.get(sync.set_model_state_dict.remote({"w": torch.zeros(2)}, 1), timeout=30)
            drill.ray.get(sync.report_rollout_version.remote(1), timeout=30)
            for version in range(2, 12):
                drill.ray.get(
                    sync.set_model_state_dict.remote({"w": torch.zeros(2)}, version), timeout=30
                )
            alert = drill.wait_firing("ObsckptWeightSyncLagging")
            assert alert["labels"]["instance"] == drill.address
            assert alert["labels"]["obsckpt_namespace"] == namespace
            assert_rendered(alert)
            assert " 10 model versions behind" in alert["annotations"]["description"]

            drill.ray.get(sync.report_rollout_version.remote(11), timeout=30)
            drill.wait_resolved("ObsckptWeightSyncLagging")
        finally:
            drill.ray.kill(sync)


class TestRunbookReferences:
    """Every dashboard panel and row the runbook points to exists by that title, and
    every obsckpt command it gives parses with those arguments."""

    def _dashboard_titles(self) -> tuple[set[str], set[str]]:
        panels = build_dashboard()["panels"]
        rows = {p["title"] for p in panels if p["type"] == "row"}
        return rows, {p["title"] for p in panels if p["type"] != "row"}

    def test_panels_named_in_bold_exist(self):
        rows, panels = self._dashboard_titles()
        text = RUNBOOK.read_text()
        named = {" ".join(n.split()) for n in re.findall(r"\*\*([^*]+)\*\*", text)}
        prose = {"Fires when", "What it means.", "Check.", "Act.", "obsckpt: checkpointing"}
        assert named - prose - panels == set()
        assert "obsckpt: checkpointing" == build_dashboard()["title"]

    def test_rows_named_in_italics_exist(self):
        rows, _ = self._dashboard_titles()
        found = re.findall(r"(?<![*\w])\*([A-Z][^*]+)\*(?!\*)", RUNBOOK.read_text())
        named = {" ".join(n.split()) for n in found}
        ui_paths = {n for n in named if "→" in n}
        assert named - ui_paths - rows == set()

    def test_commands_parse(self, tmp_path):
        from obsckpt.cli import build_parser

        text = RUNBOOK.read_text()
        commands = set(re.findall(r"`obsckpt (\w+ [^`]*)`", text))
        assert commands, "the runbook names no obsckpt command"
        parser = build_parser()
        for command in commands:
            parser.parse_args(command.replace("DIR", str(tmp_path)).split())
