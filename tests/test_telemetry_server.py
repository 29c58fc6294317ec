"""The /metrics endpoint and the file_sd target file: what a scraper is told and finds."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest
from prometheus_client import CollectorRegistry, Counter

from obsckpt.telemetry.server import (
    _is_local,
    publish_file_sd,
    read_file_sd_targets,
    serve_metrics,
    withdraw_file_sd,
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

    @staticmethod
    def closed_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

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
        dead = f"127.0.0.1:{self.closed_port()}"  # the host answers, nothing listens
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
