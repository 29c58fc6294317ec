"""The /metrics HTTP endpoint and the Prometheus file_sd target file.

The endpoint is prometheus_client's request handler (text or OpenMetrics,
gzip, ``?name[]=``) behind a server of obsckpt's own: a scraper, however slow
or numerous, holds a bounded number of the monitor's threads and descriptors
for a bounded time, so scraping never stands in the way of a commit.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import MetricsHandler

from obsckpt.store.commit import atomic_write

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


# A scrape is a request line, a few headers and a few KB back: a connection not done
# this long after it was accepted is idle or stalled, and is closed.
CONNECTION_TIMEOUT_S = 5.0
# Connections served at once, one thread each; more are answered 503 and closed.
# Prometheus (or an HA pair of them) and a person with curl need a few.
MAX_CONNECTIONS = 16
# Connections the kernel queues before the endpoint accepts them.
LISTEN_BACKLOG = 128
# How often the serving thread closes connections past their deadline.
_POLL_INTERVAL_S = 0.5
# accept() failing for want of a file descriptor: the first pause, and the longest.
_ACCEPT_PAUSE_S = (0.05, 1.0)
_FD_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_REJECT_LOG_EVERY_S = 60.0
_BUSY_REPLY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\n\r\ntoo many connections to this /metrics endpoint\n"
)


class _Handler(MetricsHandler):
    """prometheus_client's handler (content negotiation, gzip, ?name[]=) at /metrics only.

    ``_Handler.factory(registry)`` makes the class that serves ``registry``.
    """

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            super().do_GET()
        elif path == "/healthz":
            self._reply(200, b"ok\n")
        else:
            self._reply(404, b"not found: this endpoint serves /metrics (and /healthz)\n")

    def _reply(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _MetricsHTTPServer(socketserver.TCPServer):
    """The endpoint's HTTP server: bounded threads, bounded time per connection.

    Each connection is served on its own thread, at most ``max_connections`` at
    once; one more is answered 503 and closed at once. A connection has
    ``timeout_s`` from its accept to be answered: the serving thread shuts down
    those past it, so an idle client, or one that trickles its request a byte at
    a time, holds its thread no longer. An accept() that fails for want of a file
    descriptor leaves the connection queued and the listening socket readable;
    the loop pauses (doubling, up to a second) instead of retrying at once.
    Refusals and such failures are counted in ``rejected``.
    """

    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        family: socket.AddressFamily,
        address: tuple,
        scrapes: _ScrapeCounter,
        *,
        rejected: Counter | None,
        max_connections: int,
        timeout_s: float,
    ) -> None:
        self.address_family = family
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self._rejected = rejected
        self._lock = threading.Lock()
        # Open connections -> when each must be done (monotonic); the threads serving them.
        self._deadlines: dict[socket.socket, float] = {}
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        self._pause_s = 0.0
        self._warned_at: float | None = None
        self._thread: threading.Thread | None = None
        super().__init__(address, _Handler.factory(scrapes))
        self.where = host_port(*self.socket.getsockname()[:2])

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self.serve_forever,
            kwargs={"poll_interval": _POLL_INTERVAL_S},
            name="obsckpt-metrics",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, end the open connections, join every thread; close the socket."""
        self._closing.set()
        self.shutdown()  # returns once serve_forever has
        with self._lock:
            for conn in self._deadlines:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = [*self._threads, self._thread]
        for thread in threads:
            if thread is not None:
                thread.join(self.timeout_s)
        self.server_close()

    def get_request(self) -> tuple[socket.socket, object]:
        try:
            conn = self.socket.accept()
        except OSError as exc:
            if exc.errno in _FD_ERRNOS:
                self._pause_s = min(max(2 * self._pause_s, _ACCEPT_PAUSE_S[0]), _ACCEPT_PAUSE_S[1])
                self._count_rejected(
                    f"accept() failed ({exc.strerror}): this process has no file descriptor "
                    f"left; retrying in {self._pause_s:.2f} s"
                )
                self._closing.wait(self._pause_s)
            raise  # socketserver drops the failed accept and polls again
        self._pause_s = 0.0
        return conn

    def process_request(  # type: ignore[override]  # a TCP server's requests are sockets
        self, request: socket.socket, client_address: object
    ) -> None:
        with self._lock:
            admitted = len(self._deadlines) < self.max_connections
            if admitted:
                self._deadlines[request] = time.monotonic() + self.timeout_s
        if not admitted:
            self._refuse(request, f"{self.max_connections} connections are open already")
            return
        thread = threading.Thread(
            target=self._serve,
            args=(request, client_address),
            name="obsckpt-metrics-connection",
            daemon=True,
        )
        with self._lock:
            # Kept until they have ended (close() joins them), dropped at the next accept.
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # the process is out of threads
            with self._lock:
                self._threads.discard(thread)
                del self._deadlines[request]
            self._refuse(request, f"cannot start a thread for it: {exc}")

    def _serve(self, request: socket.socket, client_address: object) -> None:
        try:
            request.settimeout(self.timeout_s)
            self.finish_request(request, client_address)
        except OSError as exc:  # a reset, a timeout, or shut down at its deadline
            logger.debug("obsckpt: /metrics connection from %s ended: %s", client_address, exc)
        except Exception:  # noqa: BLE001 - one failed request must not end the endpoint
            logger.exception("obsckpt: /metrics request from %s failed", client_address)
        finally:
            # Forgotten before it is closed, so service_actions never shuts down a
            # descriptor number the process has since reused.
            with self._lock:
                del self._deadlines[request]
            self.shutdown_request(request)

    def service_actions(self) -> None:
        """Shut down connections past their deadline; their threads then return."""
        now = time.monotonic()
        with self._lock:
            for conn, deadline in self._deadlines.items():
                if now >= deadline:
                    with contextlib.suppress(OSError):
                        conn.shutdown(socket.SHUT_RDWR)

    def _refuse(self, request: socket.socket, why: str) -> None:
        # Counted first: a client that sees its refusal finds it in the counter.
        self._count_rejected(why)
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY_REPLY)
        self.close_request(request)

    def _count_rejected(self, why: str) -> None:
        if self._rejected is not None:
            self._rejected.inc()
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _REJECT_LOG_EVERY_S:
            self._warned_at = now
            logger.warning(
                "obsckpt: /metrics at %s refused a connection: %s. Counted in "
                "obsckpt_metrics_connections_rejected_total; logged at most once a minute",
                self.where,
                why,
            )


@dataclass(slots=True)
class MetricsServer:
    """A running (or failed) /metrics endpoint. ``address`` is None when not serving."""

    address: str | None = None
    error: str | None = None
    _server: _MetricsHTTPServer | None = field(default=None, repr=False)
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
        self.await_final_scrape(final_scrape_timeout_s)
        if self._server is not None:
            self._server.close()
            self._server = None

    def await_final_scrape(self, final_scrape_timeout_s: float) -> None:
        """While a scraper polls the endpoint, wait for its next scrape (see :meth:`close`)."""
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


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int | None,
    *,
    rejected: Counter | None = None,
    max_connections: int = MAX_CONNECTIONS,
    timeout_s: float = CONNECTION_TIMEOUT_S,
) -> MetricsServer:
    """Serve ``registry`` at http://host:port/metrics; never raises for a busy port.

    A port already in use is logged and reported in ``MetricsServer.error``:
    the job keeps running without an endpoint. Scrapers cannot hold the
    process's threads or descriptors: see ``_MetricsHTTPServer``.

    Args:
        rejected: counts connections refused (``max_connections`` open already)
            and accepts that failed for want of a file descriptor.
        max_connections: connections served at once.
        timeout_s: time a connection has, from its accept, to be answered.
    """
    if port is None:
        return MetricsServer()
    if isinstance(max_connections, bool) or not isinstance(max_connections, int):
        raise ValueError(f"max_connections must be a positive int, got {max_connections!r}")
    if max_connections < 1 or not timeout_s > 0:
        raise ValueError(
            f"max_connections must be >= 1 and timeout_s > 0 seconds, got {max_connections!r} "
            f"and {timeout_s!r}"
        )
    host = _bare_host(host)
    # "" means every interface to socket.bind, but not to getaddrinfo.
    bind_host = host or "0.0.0.0"
    scrapes = _ScrapeCounter(registry)
    try:
        [(family, _, _, _, sockaddr), *_] = socket.getaddrinfo(
            bind_host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        server = _MetricsHTTPServer(
            family,
            sockaddr,
            scrapes,
            rejected=rejected,
            max_connections=max_connections,
            timeout_s=timeout_s,
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            msg = (
                f"metrics port {port} on {bind_host} is already in use; metrics are not "
                "served. Pass another metrics_port, or 0 to pick a free one"
            )
        else:
            msg = f"cannot serve metrics on {host_port(bind_host, port)}: {exc.strerror or exc}"
        logger.error("obsckpt: %s", msg)
        return MetricsServer(error=msg)
    server.start()
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


def _ended(targets: object) -> bool:
    """True when ``targets`` (a file_sd group's) are all on this machine and nothing
    listens at any of them: the monitor that served them has ended."""
    return isinstance(targets, list) and bool(targets) and all(_refused(t) for t in targets)


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
            if _ended(targets):
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


def file_sd_root(path: str | os.PathLike, address: str) -> str | None:
    """The checkpoint root of ``address``'s entry in the file_sd file (None: no such entry,
    or no readable file)."""
    try:
        groups = _read_groups(Path(path))
    except (OSError, ValueError):
        return None
    for group in groups:
        tags = group.get("labels")
        if address in (group.get("targets") or []) and isinstance(tags, dict):
            root = tags.get(ROOT_LABEL)
            return root if isinstance(root, str) else None
    return None


def withdraw_gone_file_sd(path: str | os.PathLike, root: str) -> tuple[list[str], int]:
    """Remove ``root``'s entries at addresses of this machine where nothing listens (its
    monitors that have ended: one that Ray restarted at a new address included).

    Returns:
        The addresses removed, and how many of ``root``'s entries are left (a monitor
        still serving there).
    """
    path = Path(path)
    with _locked(path):
        groups = _read_groups(path)
        kept, gone, left = [], [], 0
        for group in groups:
            tags = group.get("labels")
            targets = group.get("targets")
            if isinstance(tags, dict) and tags.get(ROOT_LABEL) == root:
                if _ended(targets):
                    gone.extend(targets)
                    continue
                left += 1
            kept.append(group)
        if gone:
            _write_groups(path, kept)
    return gone, left
