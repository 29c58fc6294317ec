"""The /metrics HTTP endpoint and the Prometheus file_sd target file."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from obsckpt.commit import atomic_write

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def validate_port(port: object, what: str = "metrics_port") -> int | None:
    if port is None:
        return None
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(
            f"{what} must be an int from 0 to 65535 (0 picks a free port) or None for no "
            f"endpoint; got {port!r}"
        )
    return port


# After the last scrape's samples are generated: time for the response to reach Prometheus
# before the socket closes under it.
_FINAL_SCRAPE_GRACE_S = 0.5
# Scrape times kept to tell a polling scraper (and its interval) from one-off reads.
_POLL_SAMPLES = 4


class _ScrapeCounter:
    """The registry as the HTTP server sees it: counts the scrapes that completed.

    A clean shutdown waits for one more scrape, so Prometheus stores the last
    values (the shutdown timestamp among them) before the target goes away;
    only while a scraper polls the endpoint (a one-off read, such as the
    demo's summary, makes no wait).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._cond = threading.Condition()
        self._started = 0
        self._completed = 0  # the highest scrape number that finished generating
        self._finished_at: list[float] = []  # monotonic times of the last few scrapes

    def collect(self) -> Iterator:
        with self._cond:
            self._started += 1
            number = self._started
        yield from self._registry.collect()
        with self._cond:
            self._completed = max(self._completed, number)
            self._finished_at = [*self._finished_at[-(_POLL_SAMPLES - 1) :], time.monotonic()]
            self._cond.notify_all()

    def restricted_registry(self, names):  # a scrape with ?name[]=... filters
        return self._registry.restricted_registry(names)

    def next_due(self, limit: float) -> float | None:
        """How long to wait for the next scrape of a scraper polling the endpoint.

        None when nothing polls it: fewer than two scrapes, or none within twice
        the longest interval between the last few (plus a second). At most ``limit``.
        """
        with self._cond:
            times = list(self._finished_at)
        if len(times) < 2:
            return None
        interval = max(b - a for a, b in zip(times[:-1], times[1:], strict=True))
        due = 2 * interval + 1.0 - (time.monotonic() - times[-1])
        return min(limit, due) if due > 0 else None

    def wait_for_next(self, timeout: float) -> bool:
        """Wait for a scrape that starts from now on to finish; False after ``timeout``."""
        with self._cond:
            after = self._started
            return self._cond.wait_for(lambda: self._completed > after, timeout)


@dataclass(slots=True)
class MetricsServer:
    """A running (or failed) /metrics endpoint. ``address`` is None when not serving."""

    address: str | None = None
    error: str | None = None
    _server: object = field(default=None, repr=False)
    _scrapes: _ScrapeCounter | None = field(default=None, repr=False)

    def close(self, *, final_scrape_timeout_s: float = 0.0) -> None:
        """Stop serving; ``address`` is None from then on.

        Args:
            final_scrape_timeout_s: while a scraper polls the endpoint, first
                wait for its next scrape (up to twice its interval plus a second,
                and at most this long), so that Prometheus stores the values set
                just before (a clean shutdown's timestamp). An endpoint that no
                scraper polls (never read, or read once) closes at once.
        """
        scrapes = self._scrapes
        if self._server is not None and final_scrape_timeout_s > 0 and scrapes is not None:
            due = scrapes.next_due(final_scrape_timeout_s)
            if due is not None:
                if scrapes.wait_for_next(due):
                    time.sleep(_FINAL_SCRAPE_GRACE_S)
                else:
                    logger.warning(
                        "obsckpt: no scrape of %s within %.1f s before shutdown; Prometheus may "
                        "not see that the monitor shut down cleanly",
                        self.address,
                        due,
                    )
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.address = None


def advertised_host(host: str) -> str:
    """The host other machines reach a server bound to ``host`` by."""
    if host not in _WILDCARD_HOSTS:
        return host
    try:
        import ray.util

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray, loopback is the honest answer
        return "127.0.0.1"


def _bare_host(host: str) -> str:
    """``host`` without the brackets URLs and Prometheus targets put around an IPv6 literal
    ("[::1]"); sockets take it bare ("::1")."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets as URLs and Prometheus targets need."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def serve_metrics(registry: CollectorRegistry, host: str, port: int | None) -> MetricsServer:
    """Serve ``registry`` at http://host:port/metrics; never raises for a busy port.

    A port already in use is logged and reported in ``MetricsServer.error``:
    the job keeps running without an endpoint.
    """
    if port is None:
        return MetricsServer()
    host = _bare_host(host)
    scrapes = _ScrapeCounter(registry)
    try:
        # "" means every interface to socket.bind, but not to getaddrinfo, which
        # prometheus_client asks first.
        server, _thread = start_http_server(port, addr=host or "0.0.0.0", registry=scrapes)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            msg = (
                f"metrics port {port} on {host or '0.0.0.0'} is already in use; metrics are not "
                "served. Pass another metrics_port, or 0 to pick a free one"
            )
        else:
            where = host_port(host or "0.0.0.0", port)
            msg = f"cannot serve metrics on {where}: {exc.strerror or exc}"
        logger.error("obsckpt: %s", msg)
        return MetricsServer(error=msg)
    actual_port = server.server_address[1]
    return MetricsServer(
        address=host_port(advertised_host(host), actual_port), _server=server, _scrapes=scrapes
    )


# The target label that says which checkpoint root an entry's monitor commits into:
# a __meta_ label, so Prometheus can relabel on it but drops it from the series.
ROOT_LABEL = "__meta_obsckpt_root"
_PROBE_TIMEOUT_S = 0.5


def _read_groups(path: Path) -> list[dict]:
    try:
        groups = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{path} is not a file_sd target list (a JSON list of objects)")
    return groups


def read_file_sd_targets(path: str | os.PathLike) -> list[str]:
    """The targets a file_sd file names (empty for a missing file).

    Raises:
        ValueError: the file is not a file_sd target list.
    """
    return [t for g in _read_groups(Path(path)) for t in g.get("targets", [])]


def _is_local(host: str) -> bool:
    """True when ``host`` is an address of this machine (a socket can bind to it)."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind(sockaddr)
    except (OSError, IndexError):
        return False
    return True


def _refused(address: object) -> bool:
    """True when ``address`` is on this machine and nothing listens on its port.

    That monitor's process has ended (its port is closed). Other machines'
    addresses are never taken for gone: a firewall that rejects connections
    looks the same from here as a closed port.
    """
    if not isinstance(address, str) or ":" not in address:
        return False
    host, _, port = address.rpartition(":")
    host = _bare_host(host)
    if not _is_local(host):
        return False
    try:
        with socket.create_connection((host, int(port)), timeout=_PROBE_TIMEOUT_S):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds ``<path>.lock``: jobs sharing one file_sd file update it one at a time."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _write_groups(path: Path, groups: list[dict]) -> None:
    atomic_write(path, (json.dumps(groups, indent=2) + "\n").encode())


def publish_file_sd(
    path: str | os.PathLike, address: str | None, labels: dict[str, str], *, root: str
) -> list[str]:
    """Name ``address`` in the file_sd file ``path``, beside other jobs' monitors.

    Several jobs may share one file (``OBSCKPT_FILE_SD_PATH`` set for a whole
    cluster): each monitor's entry is its own group, tagged with its checkpoint
    root. This replaces the entry of an earlier monitor of ``root`` (one that Ray
    restarted, or the last job on that root) and entries at an address of this
    machine where nothing listens (a monitor whose process has ended), and keeps
    every other. A file that is not a target list is replaced, with an error
    logged. ``address`` None only removes ``root``'s entry.

    Returns:
        The addresses removed as gone (not those of ``root``'s earlier monitor).
    """
    path = Path(path)
    with _locked(path):
        try:
            groups = _read_groups(path)
        except ValueError as exc:  # not JSON (or not UTF-8), or not a list of groups
            logger.error("obsckpt: replacing %s, which is not a file_sd target list: %s", path, exc)
            groups = []
        kept, gone = [], []
        for group in groups:
            targets = group.get("targets")
            tags = group.get("labels")
            if isinstance(tags, dict) and tags.get(ROOT_LABEL) == root:
                continue
            if isinstance(targets, list) and address in targets:
                continue  # the port was another monitor's, which has ended
            if isinstance(targets, list) and targets and all(_refused(t) for t in targets):
                gone.extend(targets)
                continue
            kept.append(group)
        if address:
            kept.append({"targets": [address], "labels": {**labels, ROOT_LABEL: root}})
        _write_groups(path, kept)
    return gone


def withdraw_file_sd(path: str | os.PathLike, address: str) -> bool:
    """Remove ``address``'s entry from the file_sd file; False if it names it no more."""
    path = Path(path)
    with _locked(path):
        groups = _read_groups(path)
        kept = [g for g in groups if address not in (g.get("targets") or [])]
        if len(kept) == len(groups):
            return False
        _write_groups(path, kept)
    return True
