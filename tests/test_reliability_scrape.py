"""Scraping never affects commits: a thousand idle connections held open against a real
monitor actor's /metrics leave its threads and descriptors bounded, a step still commits,
a scrape still answers, and the refusals are counted."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import socket
import threading
import time
from pathlib import Path

import pytest
import ray
from reliability_helpers import report, scrape, wait_for
from workers import SaveWorker

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.store import reader
from obsckpt.telemetry.server import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS

N_CONNECTIONS = 1000
# Threads and descriptors the monitor may add besides one per served connection: the
# save worker's Ray connection, a commit's files, a scrape.
SLACK = 32


def proc_threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def proc_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def room_for_clients():
    """This process can hold N_CONNECTIONS client sockets besides what it has open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = N_CONNECTIONS + len(os.listdir("/proc/self/fd")) + 256
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.fail(
                f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors this test "
                "holds; raise it (ulimit -Hn) to run it"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class Peaks:
    """The highest thread and descriptor counts of a process, sampled in the background."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.threads = proc_threads(pid)
        self.fds = proc_fds(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peaks", daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError):  # a descriptor closed while listed
                self.threads = max(self.threads, proc_threads(self.pid))
                self.fds = max(self.fds, proc_fds(self.pid))

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def try_scrape(address: str):
    try:
        return scrape(address, timeout=5)
    except OSError:  # refused while the held connections fill the bound
        return None


class TestIdleConnectionFlood:
    """With 1,000 idle connections held open against the monitor's /metrics, a step saves
    and commits, the monitor's threads and descriptors stay within the endpoint's bound,
    a real scrape answers once the held ones time out, and the refusals are counted."""

    def test_commits_and_scrapes_go_on(self, namespace, tmp_path, room_for_clients):
        root = tmp_path / "ckpt"
        monitor = CheckpointMonitor.get_actor(
            namespace=namespace,
            default_local_dir=str(root),
            metrics_port=0,
            metrics_host="127.0.0.1",
        )
        address = ray.get(monitor.metrics_address.remote())
        pid = ray.get(monitor.__ray_call__.remote(lambda self: os.getpid()))
        worker = SaveWorker.remote(namespace, 0)
        ray.get(worker.pid.remote())  # started, and connected to the monitor
        scrape(address)
        threads_before, fds_before = proc_threads(pid), proc_fds(pid)
        host, port = address.rsplit(":", 1)
        with contextlib.ExitStack() as held, Peaks(pid) as peaks:
            t0 = time.monotonic()
            for _ in range(N_CONNECTIONS):
                held.enter_context(socket.create_connection((host, int(port)), timeout=10))
            connect_s = time.monotonic() - t0
            # A step saved and committed while every connection is still held by its client.
            ray.get(worker.save.remote(str(root), 1, ["model"]))
            asyncio.run(
                CheckpointCoordinator(monitor).register_and_monitor(1, checkpoint_thread_count=1)
            )
            assert ray.get(worker.wait.remote()) is None
            wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, 30, "step 1 commit")
            commit_s = time.monotonic() - t0
            found = wait_for(
                lambda: try_scrape(address), CONNECTION_TIMEOUT_S + 15, "a scrape to answer"
            )
            scrape_s = time.monotonic() - t0
        rejected = found.value("obsckpt_metrics_connections_rejected_total")
        fields = dict(
            connections=N_CONNECTIONS,
            connect_s=round(connect_s, 2),
            commit_s=round(commit_s, 2),
            scrape_s=round(scrape_s, 2),
            threads_before=threads_before,
            threads_peak=peaks.threads,
            fds_before=fds_before,
            fds_peak=peaks.fds,
            rejected=rejected,
        )
        report("scrape_flood", **fields)
        print(fields)
        assert peaks.threads <= threads_before + MAX_CONNECTIONS + SLACK, fields
        assert peaks.fds <= fds_before + MAX_CONNECTIONS + SLACK, fields
        # Those not served were refused; at most the bound's worth per timeout were served.
        assert rejected >= N_CONNECTIONS - MAX_CONNECTIONS * 4, fields
        assert found.value("obsckpt_latest_step", kind="checkpoint") == 1
        # Once the flood is gone, nothing is left open and the endpoint answers at once.
        wait_for(
            lambda: proc_fds(pid) <= fds_before + 4,
            CONNECTION_TIMEOUT_S + 10,
            "the monitor's descriptors to return to their count before the flood",
        )
        assert scrape(address).value("obsckpt_latest_step", kind="checkpoint") == 1
