"""The compose stack's job, run without a Docker engine.

The job image is the Dockerfile's: its COPY lines and its ``uv pip install``
extras are read from the Dockerfile, installed the same way into a fresh
virtual environment (no editable install, no dev tools), and the compose
service's own command is run from it, with the container paths and the port
mapped to temporary ones and the OTLP collector left unreachable, as it is
when the collector has not started. What a Docker engine would add (the base
image, the CPU torch index, users and volumes) is not checked here; see
docs/observability.md.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from obsckpt.store import reader
from obsckpt.sync.group import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "docker-compose.yml"
SERVICE = "obsckpt"


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(instruction, arguments) of each Dockerfile line, continuations joined."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def copied_paths() -> list[str]:
    """What the Dockerfile copies from the build context (not from other images)."""
    paths = []
    for word, rest in dockerfile_instructions():
        if word == "COPY" and "--from=" not in rest:
            paths += shlex.split(rest)[:-1]
    return paths


def installed_extras() -> list[str]:
    """The extras of the project's own ``uv pip install`` line (``".[a,b]"``)."""
    found = []
    for word, rest in dockerfile_instructions():
        if word == "RUN" and "pip install" in rest:
            for arg in shlex.split(rest):
                m = re.fullmatch(r"\.\[([\w,\-]+)\]", arg)
                if m:
                    found.append(m.group(1).split(","))
    assert len(found) == 1, f"expected one install of the project ('.[extras]'), got {found}"
    return found[0]


def image_env() -> dict[str, str]:
    """The Dockerfile's ``ENV`` settings."""
    env = {}
    for word, rest in dockerfile_instructions():
        if word == "ENV":
            for arg in shlex.split(rest):
                key, sep, value = arg.partition("=")
                if sep:
                    env[key] = value
    return env


def job_service() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"][SERVICE]


def clean_env() -> dict[str, str]:
    """This machine's environment without what ties a process to this checkout or cluster."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS") and not k.startswith("PYTEST")
    }
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def find_links() -> list[str]:
    """Local wheel folders, as the Makefile passes them to uv (the CPU torch wheel)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "").split() or [
        d for d in ("/opt/wheels",) if os.path.isdir(d)
    ]
    return [arg for d in dirs for arg in ("--find-links", d)]


def build_job_env(tmp: Path) -> Path:
    """A virtual environment made as the Dockerfile makes the image; returns its bin folder."""
    # uv from PATH, else the one the Makefile installs into .uv-tools where PATH has none.
    local_uv = ROOT / ".uv-tools" / "bin" / "uv"
    uv = shutil.which("uv") or (str(local_uv) if local_uv.exists() else None)
    if uv is None:
        pytest.fail(
            "uv is not installed: neither on PATH nor in .uv-tools/ (`make test` installs it "
            "there; or `python3 -m pip install uv`)"
        )
    context = tmp / "context"
    context.mkdir()
    for rel in copied_paths():
        src = ROOT / rel
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, context / rel)
    venv = tmp / "venv"
    python = venv / "bin" / "python"
    env = clean_env()
    # Bytecode compiled at install as in the image (its cache settings are the image
    # build's own: here uv's cache serves the packages).
    compile_bytecode = image_env().get("UV_COMPILE_BYTECODE")
    if compile_bytecode is not None:
        env["UV_COMPILE_BYTECODE"] = compile_bytecode
    subprocess.run(
        [uv, "venv", "--quiet", "--python", sys.executable, str(venv)], env=env, check=True
    )
    # torch first, pinned, as the Dockerfile does; local wheels stand in for its CPU index.
    constraints = ["-c", str(context / "constraints.txt")]
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(python), *find_links(), *constraints]
        + ["torch"],
        env=env,
        check=True,
        timeout=600,
    )
    extras = ",".join(installed_extras())
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(python), *find_links(), *constraints]
        + [f".[{extras}]"],
        cwd=context,
        env=env,
        check=True,
        timeout=600,
    )
    return venv / "bin"


def service_command(service: dict, ckpt: Path, sd: Path, port: int) -> list[str]:
    """The compose command with container paths and the published port mapped here."""
    mounts = {"/data/ckpt": str(ckpt), "/data/sd": str(sd)}
    command = [str(c) for c in service["command"]]
    i = command.index("--metrics-port")
    command[i + 1] = str(port)
    mapped = []
    for arg in command:
        for target, here in mounts.items():
            if arg == target or arg.startswith(target + "/"):
                arg = here + arg[len(target) :]
        mapped.append(arg)
    assert mapped != command or not mounts, "the compose command names none of the volumes"
    return mapped


def scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as resp:
            return resp.read().decode()
    except OSError:
        return None


@pytest.fixture(scope="module")
def job_bin(tmp_path_factory) -> Path:
    return build_job_env(tmp_path_factory.mktemp("job-image"))


class TestDockerfileParsing:
    """The Dockerfile is read, not restated: its extras and copies are what the test installs."""

    def test_reads_the_install_line(self):
        assert set(installed_extras()) >= {"demo", "otlp"}
        assert {"pyproject.toml", "constraints.txt", "obsckpt"} <= set(copied_paths())
        assert image_env()["RAY_USAGE_STATS_ENABLED"] == "0"


def run_until_committed(
    command: list[str], env: dict, work: Path, ckpt: Path, port: int, log: Path, above: int
) -> tuple[int, int]:
    """Run the service command until it commits a step above ``above`` and /metrics shows
    it, then stop it as Docker does (SIGTERM); returns (committed step, exit code)."""
    with open(log, "wb") as out:
        # An empty working directory, so nothing from the checkout can be imported.
        proc = subprocess.Popen(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 420
        committed, metrics = None, None
        while time.monotonic() < deadline and proc.poll() is None:
            committed = reader.read_iteration(ckpt, "checkpoint")
            metrics = scrape(port)
            if (
                committed is not None
                and committed > above
                and metrics
                and 'kind="checkpoint"' in metrics
            ):
                break
            time.sleep(1.0)
        assert proc.poll() is None, f"the job exited early:\n{log.read_text()[-4000:]}"
        assert committed is not None and committed > above, (
            f"no checkpoint above step {above} committed:\n{log.read_text()[-4000:]}"
        )
        assert metrics and re.search(
            r'^obsckpt_latest_step\{kind="checkpoint"\} [1-9]', metrics, re.M
        ), "/metrics does not show the committed step"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    return committed, code


@pytest.mark.slow
@pytest.mark.needs_index
class TestComposeJobRuns:
    """The compose service's command, in the image's environment, commits a checkpoint and
    serves /metrics; run again, as restart: unless-stopped does, it continues from there."""

    def test_service_command_commits_serves_metrics_and_resumes(self, job_bin, tmp_path):
        service = job_service()
        assert service["command"][:2] == ["obsckpt", "demo"]
        ckpt, sd, work = tmp_path / "ckpt", tmp_path / "sd", tmp_path / "work"
        for d in (ckpt, sd, work):
            d.mkdir()
        port = free_port()
        command = service_command(service, ckpt, sd, port)
        assert "--otlp-endpoint" in command, "the job should send traces to the collector"
        env = clean_env()
        env.update({k: v for k, v in image_env().items() if not k.startswith("UV_")})
        env.update({k: str(v) for k, v in (service.get("environment") or {}).items()})
        env["PATH"] = f"{job_bin}{os.pathsep}{env.get('PATH', '')}"
        first_log, second_log = tmp_path / "job.log", tmp_path / "job-restarted.log"
        # The first run finds an empty volume (--resume starts at step 1 there).
        first, code = run_until_committed(command, env, work, ckpt, port, first_log, above=0)
        text = first_log.read_text()
        assert code == 128 + signal.SIGTERM, f"the job exited {code} after SIGTERM:\n{text[-4000:]}"
        assert "Traceback" not in text, text[-4000:]
        assert "demo terminated" in text
        assert (sd / "obsckpt.json").is_file(), "the file_sd target was not written"
        # The restart continues past the first run's step and keeps its checkpoints
        # (without --resume the demo starts over and deletes them).
        first = reader.read_iteration(ckpt, "checkpoint")
        second, code = run_until_committed(command, env, work, ckpt, port, second_log, first)
        text = second_log.read_text()
        assert code == 128 + signal.SIGTERM, f"the restart exited {code}:\n{text[-4000:]}"
        assert "starting over" not in text, text[-4000:]
        assert "Traceback" not in text, text[-4000:]
        assert second > first
        # The committed step is whole, checked by the image's own CLI.
        verify = subprocess.run(
            [str(job_bin / "obsckpt"), "verify", str(ckpt)],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
