"""The demo's endpoints, checked before anything starts: /metrics and the file_sd file.

A port in use or a path that cannot be written is found here, with one line
naming the flag, rather than in the monitor actor after the cluster started.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shlex
import socket
from pathlib import Path

from obsckpt.demo.config import DemoConfig
from obsckpt.errors import DemoError


def check_endpoints(cfg: DemoConfig) -> DemoConfig:
    """Check --metrics-host/--metrics-port and --file-sd before anything starts.

    The file_sd path is made absolute here: the monitor actor writes it, and its
    working directory is not the caller's on a joined cluster.
    """
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
