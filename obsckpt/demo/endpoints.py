"""The demo's endpoints, checked before anything starts: /metrics, the file_sd file,
the OTLP endpoint and the Ray cluster to join.

A port in use, a path that cannot be written or a URL that is none is found here,
with one line naming the flag (or variable), rather than in the monitor actor after
the cluster started or in OpenTelemetry's exporter once the first spans are sent.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shlex
import socket
from collections.abc import Mapping
from pathlib import Path

from opentelemetry.sdk.environment_variables import (
    OTEL_EXPORTER_OTLP_ENDPOINT,
    OTEL_EXPORTER_OTLP_PROTOCOL,
    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
)

from obsckpt import validators
from obsckpt.demo.config import DemoConfig
from obsckpt.errors import DemoError

# The variables naming where spans go, as the tracing setup reads them.
OTLP_ENDPOINT_VARIABLES = (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_ENDPOINT)


def check_endpoints(cfg: DemoConfig) -> DemoConfig:
    """Check --metrics-host/--metrics-port, --file-sd, --otlp-endpoint (and the
    ``OTEL_*`` endpoints) and --address before anything starts.

    The file_sd path is made absolute here: the monitor actor writes it, and its
    working directory is not the caller's on a joined cluster.
    """
    try:
        if cfg.otlp_endpoint is not None:
            otlp_endpoint(cfg.otlp_endpoint, "--otlp-endpoint")
        check_otel_environment(cfg.otlp_endpoint)
        if cfg.address is not None:
            ray_address(cfg.address, "--address")
    except ValueError as exc:
        raise DemoError(str(exc)) from None
    if cfg.metrics_port is not None and not cfg.address:
        check_metrics_endpoint(cfg.metrics_host, cfg.metrics_port)
    if cfg.file_sd:
        cfg = dataclasses.replace(cfg, file_sd=check_file_sd(cfg.file_sd))
    return cfg


def check_metrics_endpoint(host: str, port: int) -> None:
    """Raise DemoError when the monitor could not serve /metrics on ``host:port`` here."""
    shown = f"{host or '0.0.0.0'}:{port}"
    # "[::1]", as URLs write an IPv6 literal, is what the metrics server binds as "::1".
    bind_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(
            bind_host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise DemoError(
            f"--metrics-host {host!r} is not an address of this machine ({exc.strerror}); "
            "pass an interface address such as 0.0.0.0 or 127.0.0.1"
        ) from None
    family, kind, proto, _name, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the metrics server binds (it reuses addresses), so a port in TIME_WAIT passes.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DemoError(
                    f"--metrics-port {port}: {shown} is already in use; pass another "
                    "--metrics-port (0 picks a free one), or --no-metrics"
                ) from None
            raise DemoError(
                f"/metrics cannot be served on {shown} ({exc.strerror or exc}); pass another "
                "--metrics-host or --metrics-port, or --no-metrics"
            ) from None


def check_file_sd(path: str) -> str:
    """The absolute --file-sd path; DemoError when no file can be written there."""
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise DemoError(
            f"--file-sd {target} is a directory; pass the path of a file in it, "
            f"e.g. --file-sd {shlex.quote(str(target / 'obsckpt-demo.json'))}"
        )
    # Missing directories are created by the monitor; the nearest existing one must take them.
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DemoError(
            f"--file-sd {target}: {parent} is a file, not a directory; pass a path whose "
            "directories exist or can be created"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DemoError(
            f"--file-sd {target}: {parent} is not writable by this user; pass a path in a "
            "directory you can write"
        )
    return str(target)


def otlp_endpoint(value: str, what: str = "", environ: Mapping[str, str] | None = None) -> str:
    """``value`` if OpenTelemetry's OTLP exporter can send spans to it; else a ValueError
    naming ``what``, the value and a good one.

    OTLP/HTTP takes an http:// or https:// URL; OTLP/gRPC (the ``OTEL_*_PROTOCOL``
    variables say ``grpc``) a scheme-less ``HOST:PORT`` too.
    """
    env = os.environ if environ is None else environ
    protocol = env.get(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) or env.get(OTEL_EXPORTER_OTLP_PROTOCOL)
    grpc = protocol == "grpc"
    example = f"http://localhost:{4317 if grpc else 4318}"
    return validators.validate_url(value, what, bare=grpc, example=example)


def check_otel_environment(
    flag: str | None = None, environ: Mapping[str, str] | None = None
) -> None:
    """Raise a ValueError naming the first ``OTEL_*`` endpoint variable set to no URL.

    ``flag``, the --otlp-endpoint given, replaces OTEL_EXPORTER_OTLP_ENDPOINT, as the
    demo sets it (:func:`obsckpt.demo.cluster.otel_env`).
    """
    env = dict(os.environ if environ is None else environ)
    if flag is not None:
        env[OTEL_EXPORTER_OTLP_ENDPOINT] = flag
    for name in OTLP_ENDPOINT_VARIABLES:
        if env.get(name):
            otlp_endpoint(env[name], name, env)


def ray_address(value: str, what: str = "") -> str:
    """``value`` if ``ray.init`` can join a cluster by it: ``auto``, the ``HOST:PORT`` of
    its head (GCS) or a Ray Client ``ray://HOST[:PORT]``; else a ValueError naming ``what``."""
    if value == "auto":
        return value
    return validators.validate_url(
        value, what, schemes=("ray",), bare=True, example="127.0.0.1:6379"
    )
