"""The /metrics endpoint and the file_sd target file: what a scraper is told and finds."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from metrics_helpers import closed_port
from prometheus_client import CollectorRegistry, Counter

import obsckpt.telemetry.server as telemetry_server
from obsckpt.telemetry.server import (
    MetricsServer,
    _is_local,
    file_sd_root,
    publish_file_sd,
    read_file_sd_targets,
    serve_metrics,
    withdraw_file_sd,
    withdraw_gone_file_sd,
)


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("obsckpt_test_total", "A sample to scrape.", registry=registry).inc()
    return registry


def fetch(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


class TestAdvertisedAddress:
    """The address a server advertises is a valid host:port that reaches it."""

    @pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
    def test_ipv6_literal_is_bracketed(self, registry, tmp_path):
        server = serve_metrics(registry, "::1", 0)
        try:
            # Prometheus refuses "::1:<port>" ("too many colons in address"), and so
            # does a URL parser: a target needs the brackets.
            url = urlsplit(f"http://{server.address}/metrics")
            assert (url.hostname, url.port) == ("::1", int(server.address.rsplit(":", 1)[1]))
            assert "obsckpt_test_total 1.0" in fetch(server.address)
            publish_file_sd(tmp_path / "sd.json", server.address, {}, root="/ckpt")
            [group] = json.loads((tmp_path / "sd.json").read_text())
            assert group["targets"] == [f"[::1]:{url.port}"]
        finally:
            server.close()

    @pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
    @pytest.mark.parametrize(("host", "reached_at"), [("[::1]", "[::1]"), ("[::]", "127.0.0.1")])
    def test_bracketed_ipv6_host_binds(self, registry, host, reached_at):
        # The form URLs and Prometheus targets use; a bind needs the bare literal.
        server = serve_metrics(registry, host, 0)
        try:
            assert server.error is None and server.address is not None, server.error
            port = server.address.rsplit(":", 1)[1]
            assert "obsckpt_test_total 1.0" in fetch(f"{reached_at}:{port}")
            if host == "[::1]":
                assert server.address == f"[::1]:{port}"
        finally:
            server.close()

    def test_empty_host_binds_every_interface(self, registry):
        server = serve_metrics(registry, "", 0)
        try:
            assert server.error is None and server.address is not None
            port = server.address.rsplit(":", 1)[1]
            assert "obsckpt_test_total 1.0" in fetch(f"127.0.0.1:{port}")
        finally:
            server.close()


class TestClose:
    """A closed server stops answering and no longer claims an address."""

    def test_close_forgets_the_address(self, registry):
        server = serve_metrics(registry, "127.0.0.1", 0)
        address = server.address
        assert "obsckpt_test_total" in fetch(address)
        server.close()
        assert server.address is None
        with pytest.raises(urllib.error.URLError):
            fetch(address)
        server.close()  # a second close is harmless


class TestFinalScrape:
    """A closing endpoint that a scraper polls waits for its next scrape, so the values set
    just before (a clean shutdown's timestamp) are stored; one read once closes at once."""

    def test_a_polled_endpoint_serves_one_more_scrape(self, registry):
        import threading
        import time

        from prometheus_client import Gauge

        gauge = Gauge("obsckpt_test_final", "Set just before closing.", registry=registry)
        server = serve_metrics(registry, "127.0.0.1", 0)
        address = server.address
        seen: list[str] = []
        stop = threading.Event()

        def poll() -> None:  # a scraper with a 0.3 s interval
            while not stop.is_set():
                try:
                    seen.append(fetch(address))
                except OSError:
                    return
                time.sleep(0.3)

        scraper = threading.Thread(target=poll, daemon=True)
        scraper.start()
        try:
            while len(seen) < 3:
                time.sleep(0.05)
            gauge.set(42)
            t0 = time.monotonic()
            server.close(final_scrape_timeout_s=15.0)
            waited = time.monotonic() - t0
        finally:
            stop.set()
            scraper.join(10)
        assert "obsckpt_test_final 42.0" in seen[-1]
        assert waited < 3.0  # the next scrape, not the whole timeout

    def test_an_endpoint_read_once_closes_at_once(self, registry):
        import time

        server = serve_metrics(registry, "127.0.0.1", 0)
        fetch(server.address)  # a one-off read, as the demo's summary makes
        t0 = time.monotonic()
        server.close(final_scrape_timeout_s=15.0)
        assert time.monotonic() - t0 < 1.0
        assert server.address is None


class TestSharedFileSd:
    """Jobs sharing one file_sd file (OBSCKPT_FILE_SD_PATH set cluster-wide) each stay a target."""

    def test_each_root_keeps_its_own_entry(self, tmp_path):
        sd = tmp_path / "sd" / "obsckpt.json"
        with socket.socket() as a, socket.socket() as b:
            for s in (a, b):
                s.bind(("127.0.0.1", 0))
                s.listen()
            addr_a = f"127.0.0.1:{a.getsockname()[1]}"
            addr_b = f"127.0.0.1:{b.getsockname()[1]}"
            assert publish_file_sd(sd, addr_a, {"obsckpt_namespace": "a"}, root="/ckpt/a") == []
            assert publish_file_sd(sd, addr_b, {"obsckpt_namespace": "b"}, root="/ckpt/b") == []
            groups = json.loads(sd.read_text())
            assert [g["targets"] for g in groups] == [[addr_a], [addr_b]]
            assert groups[0]["labels"] == {
                "obsckpt_namespace": "a",
                "__meta_obsckpt_root": "/ckpt/a",
            }
            assert read_file_sd_targets(sd) == [addr_a, addr_b]
            # Job a's monitor restarted elsewhere: its entry moves, b's stays.
            publish_file_sd(sd, addr_a.replace("127.0.0.1", "localhost"), {}, root="/ckpt/a")
            assert read_file_sd_targets(sd) == [addr_b, addr_a.replace("127.0.0.1", "localhost")]
            # Withdrawn by address: only that entry goes.
            assert withdraw_file_sd(sd, addr_b) is True
            assert withdraw_file_sd(sd, addr_b) is False
            assert read_file_sd_targets(sd) == [addr_a.replace("127.0.0.1", "localhost")]

    def test_entries_of_monitors_that_are_gone_are_dropped(self, tmp_path, caplog):
        sd = tmp_path / "obsckpt.json"
        dead = f"127.0.0.1:{closed_port()}"  # the host answers, nothing listens
        # Another machine's address: never taken for gone (a firewall may refuse it).
        unreachable = next(
            f"{ip}:9400" for ip in ("192.0.2.1", "198.51.100.1", "203.0.113.1") if not _is_local(ip)
        )
        sd.write_text(
            json.dumps(
                [
                    {"targets": [dead], "labels": {"__meta_obsckpt_root": "/old"}},
                    {"targets": [unreachable], "labels": {"__meta_obsckpt_root": "/far"}},
                ]
            )
        )
        with socket.socket() as live:
            live.bind(("127.0.0.1", 0))
            live.listen()
            mine = f"127.0.0.1:{live.getsockname()[1]}"
            assert publish_file_sd(sd, mine, {}, root="/new") == [dead]
        assert read_file_sd_targets(sd) == [unreachable, mine]

    def test_no_address_removes_only_the_roots_entry(self, tmp_path):
        sd = tmp_path / "obsckpt.json"
        other = [{"targets": ["192.0.2.1:9400"], "labels": {"__meta_obsckpt_root": "/b"}}]
        sd.write_text(
            json.dumps(
                other + [{"targets": ["192.0.2.2:1"], "labels": {"__meta_obsckpt_root": "/a"}}]
            )
        )
        publish_file_sd(sd, None, {}, root="/a")
        assert json.loads(sd.read_text()) == other

    def test_a_roots_ended_monitors_are_withdrawn_and_its_live_one_stays(self, tmp_path):
        """A job's stop withdraws what its monitors left (the one Ray restarted at a new
        address included) by root; a monitor still serving there and other roots stay."""
        sd = tmp_path / "obsckpt.json"
        first, restarted = (f"127.0.0.1:{closed_port()}" for _ in range(2))
        with socket.socket() as live:
            live.bind(("127.0.0.1", 0))
            live.listen()
            serving = f"127.0.0.1:{live.getsockname()[1]}"
            publish_file_sd(sd, first, {}, root="/ckpt/a")
            assert file_sd_root(sd, first) == "/ckpt/a"
            publish_file_sd(sd, restarted, {}, root="/ckpt/a")  # replaces first's entry
            assert file_sd_root(sd, first) is None
            sd.write_text(
                json.dumps(
                    json.loads(sd.read_text())
                    + [
                        {"targets": [f"127.0.0.1:{closed_port()}"], "labels": {}},
                        {"targets": [serving], "labels": {"__meta_obsckpt_root": "/ckpt/b"}},
                    ]
                )
            )
            before = read_file_sd_targets(sd)
            assert withdraw_gone_file_sd(sd, "/ckpt/a") == ([restarted], 0)
            assert read_file_sd_targets(sd) == [t for t in before if t != restarted]
            assert withdraw_gone_file_sd(sd, "/ckpt/b") == ([], 1)
            assert serving in read_file_sd_targets(sd)
        assert file_sd_root(tmp_path / "none.json", serving) is None

    def test_concurrent_publishers_all_land(self, tmp_path):
        sd = tmp_path / "obsckpt.json"
        with contextlib.ExitStack() as stack:
            socks = [stack.enter_context(socket.socket()) for _ in range(12)]
            for s in socks:
                s.bind(("127.0.0.1", 0))
                s.listen()
            addrs = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
            barrier = threading.Barrier(len(addrs))

            def publish(i):
                barrier.wait()
                publish_file_sd(sd, addrs[i], {}, root=f"/ckpt/{i}")

            threads = [threading.Thread(target=publish, args=(i,)) for i in range(len(addrs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(read_file_sd_targets(sd)) == sorted(addrs)

    def test_a_damaged_file_is_replaced(self, tmp_path, caplog):
        sd = tmp_path / "obsckpt.json"
        sd.write_text('{"targets": ')
        publish_file_sd(sd, "192.0.2.1:9400", {}, root="/a")
        assert read_file_sd_targets(sd) == ["192.0.2.1:9400"]
        assert "not a file_sd target list" in caplog.text


# -- what a scraper can and cannot do to the endpoint ---------------------------------


def request(address: str, path: str, headers: dict[str, str] | None = None):
    """One GET of ``path``: (status, headers, body)."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket, timeout: float) -> bytes | None:
    """What the server sent before closing ``sock`` (b"" for nothing); None if still open."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def endpoint_threads(besides: set[threading.Thread] = frozenset()) -> set[threading.Thread]:
    """The live threads endpoints started (accept loops and connections), but ``besides``."""
    return {
        t for t in threading.enumerate() if t.name.startswith("obsckpt-metrics") and t.is_alive()
    } - set(besides)


def wait_until(predicate, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def served(registry):
    """Starts servers of ``registry`` that count their refusals in it; closes them after."""
    rejected = Counter("obsckpt_test_rejected", "Refused connections.", registry=registry)
    servers = []

    def start(**kw) -> tuple[MetricsServer, Counter]:
        server = serve_metrics(registry, "127.0.0.1", 0, rejected=rejected, **kw)
        servers.append(server)
        assert server.error is None, server.error
        return server

    yield start
    for server in servers:
        server.close()


class TestPaths:
    """Only /metrics (and /healthz) answer; any other path is a 404. /metrics keeps
    prometheus_client's content negotiation, gzip and ?name[]= filtering."""

    @pytest.mark.parametrize("path", ["/", "/metric", "/metrics/x", "/favicon.ico", "/..%2f"])
    def test_other_paths_are_not_found(self, served, path):
        server = served()
        status, _, body = request(server.address, path)
        assert status == 404
        assert b"obsckpt_test_total" not in body and b"/metrics" in body

    def test_healthz_answers(self, served):
        assert request(served().address, "/healthz")[0] == 200

    def test_metrics_negotiates_like_prometheus_client(self, served, registry):
        Counter("obsckpt_test_other", "Another sample.", registry=registry).inc(3)
        address = served().address
        status, headers, body = request(address, "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
        assert b"obsckpt_test_total 1.0" in body and b"obsckpt_test_other_total 3.0" in body

        _, headers, body = request(address, "/metrics", {"Accept-Encoding": "gzip"})
        assert headers["Content-Encoding"] == "gzip"
        assert b"obsckpt_test_total 1.0" in gzip.decompress(body)

        _, headers, body = request(
            address, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert headers["Content-Type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")

        _, _, body = request(address, "/metrics?name[]=obsckpt_test_other_total")
        assert b"obsckpt_test_other_total 3.0" in body and b"obsckpt_test_total" not in body


class TestConnectionTimeout:
    """A connection not answered within timeout_s of its accept is closed: idle, or sending
    its request a byte at a time. The endpoint then serves others."""

    def test_idle_connection_is_dropped(self, served):
        server = served(timeout_s=0.5)
        with connect(server.address) as idle:
            t0 = time.monotonic()
            assert closed_by_server(idle, timeout=5.0) == b""
            assert 0.4 < time.monotonic() - t0 < 2.0
        assert b"obsckpt_test_total 1.0" in request(server.address, "/metrics")[2]

    def test_trickled_request_is_dropped_at_the_deadline(self, served):
        server = served(timeout_s=1.0)
        # Each byte comes well within the per-read timeout; only the deadline stops it.
        trickle = b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 200
        with connect(server.address) as slow:
            t0 = time.monotonic()
            sent = 0
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                while sent < len(trickle) and time.monotonic() - t0 < 10:
                    slow.send(trickle[sent : sent + 1])
                    sent += 1
                    if select.select([slow], [], [], 0.1)[0]:
                        break  # closed by the server
            assert closed_by_server(slow, timeout=5.0) is not None
        assert sent < len(trickle), "the server waited for the whole trickled request"
        assert time.monotonic() - t0 < 3.0


class TestConnectionBound:
    """At most max_connections are served at once; more are answered 503 and closed at
    once, and counted. The endpoint's threads stay bounded however many connect."""

    def test_excess_connections_are_refused_and_counted(self, served, registry):
        before = endpoint_threads()
        server = served(max_connections=2, timeout_s=30.0)
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(connect(server.address)) for _ in range(2)]
            # The accept loop and one thread per held connection.
            wait_until(lambda: len(endpoint_threads(before)) == 3, "the held connections' threads")
            extra = [stack.enter_context(connect(server.address)) for _ in range(50)]
            for sock in extra:
                reply = closed_by_server(sock, timeout=5.0)
                assert reply is not None, "an excess connection was left open"
                assert reply == b"" or reply.startswith(b"HTTP/1.0 503"), reply
            assert registry.get_sample_value("obsckpt_test_rejected_total") == 50
            assert len(endpoint_threads(before)) == 3
            # The bound holds: with both held, even a scrape is refused.
            with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
                fetch(server.address)
            for sock in held:
                sock.close()
            # Closed by their clients, the slots free up.
            # Until their threads end, a scrape may still be refused (and counted).
            deadline = time.monotonic() + 5
            refused_again = 0
            while True:
                try:
                    text = fetch(server.address)
                    break
                except (urllib.error.URLError, ConnectionError, http.client.HTTPException):
                    assert time.monotonic() < deadline, "the endpoint never served again"
                    refused_again += 1
                    time.sleep(0.05)
        assert f"obsckpt_test_rejected_total {51 + refused_again}.0" in text

    def test_listening_socket_is_given_listen_backlog(self, served, monkeypatch):
        """listen() is given LISTEN_BACKLOG (at least 128), not socketserver's default of 5,
        so a burst of scrapers waits in the kernel's queue instead of being dropped."""
        backlogs: list[int] = []
        listen = socket.socket.listen

        def recording(sock, *args):
            backlogs.extend(args)
            return listen(sock, *args)

        monkeypatch.setattr(socket.socket, "listen", recording)
        server = served()
        monkeypatch.undo()
        server.close()
        assert backlogs == [telemetry_server.LISTEN_BACKLOG]
        assert telemetry_server.LISTEN_BACKLOG >= 128

    def test_close_ends_open_connections_and_their_threads(self, served):
        before = endpoint_threads()
        server = served(max_connections=4, timeout_s=60.0)
        with contextlib.ExitStack() as stack:
            held = [stack.enter_context(connect(server.address)) for _ in range(4)]
            wait_until(lambda: len(endpoint_threads(before)) == 5, "the held connections' threads")
            t0 = time.monotonic()
            server.close()
            assert time.monotonic() - t0 < 2.0
            assert endpoint_threads(before) == set(), "close() left threads running"
            assert all(closed_by_server(s, timeout=5.0) is not None for s in held)


# The endpoint in a process whose descriptors are all taken: accept() fails with EMFILE
# while the connection waits in the backlog.
_EMFILE_CHILD = """
import json, os, resource, sys, time
from prometheus_client import CollectorRegistry, Counter
from obsckpt.telemetry.server import serve_metrics

registry = CollectorRegistry()
rejected = Counter("obsckpt_test_rejected", "Refused.", registry=registry)
server = serve_metrics(registry, "127.0.0.1", 0, rejected=rejected)
print(server.address, flush=True)
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
sys.stdin.readline()  # the parent connected
cpu0, t0 = time.process_time(), time.monotonic()
time.sleep(2.0)
cpu = time.process_time() - cpu0
wall = time.monotonic() - t0
count = registry.get_sample_value("obsckpt_test_rejected_total")
for fd in held:
    os.close(fd)
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "rejected": count}), flush=True)
sys.stdin.readline()  # the parent read its answer
server.close()
"""


class TestAcceptFailure:
    """With the process out of descriptors, the endpoint does not spin on the pending
    connection: it pauses between tries, counts them, and serves it once descriptors free."""

    def test_no_spin_on_emfile_and_recovery(self):
        child = subprocess.Popen(
            [sys.executable, "-c", _EMFILE_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            address = child.stdout.readline().strip()
            assert child.stdout.readline().strip() == "full"
            with connect(address) as sock:
                sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                child.stdin.write("connected\n")
                child.stdin.flush()
                measured = json.loads(child.stdout.readline())
                reply = closed_by_server(sock, timeout=10.0)
            child.stdin.write("done\n")
            child.stdin.flush()
            assert child.wait(30) == 0
        finally:
            child.kill()
            child.wait()
        # A spinning accept loop burns a core and counts thousands of tries.
        assert measured["cpu_s"] < 0.1 * measured["wall_s"], measured
        assert 1 <= measured["rejected"] <= 20, measured
        assert reply is not None and reply.startswith(b"HTTP/1.0 200"), reply
        assert b"obsckpt_test_rejected_total" in reply
