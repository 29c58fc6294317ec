"""Steps of the wall clock: NTP corrections, a VM resumed, chrony's makestep at boot.

Durations, leases, deadlines and ages are measured on the monotonic clock;
only what is shown as a Unix timestamp reads the wall clock. This container
cannot step the system clock, so each test moves the one reading of it that
the code under test makes: the monitor's clock seam (``clock=``, in-process, or
in the monitor actor's own process through :class:`SteppedClockMonitor`), and the
``time`` module the IPC receiver sees. The monotonic clock runs on untouched,
as it does across a real step.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointCoordinator, CheckpointMonitor, SaveStrategy
from obsckpt.monitor import SystemClock
from obsckpt.store import commit, layout, reader

HOUR = 3600.0


class WallClock(SystemClock):
    """The in-process monitor's clocks: its wall clock stepped by the test."""

    def __init__(self) -> None:
        self.offset = 0.0

    def time(self) -> float:
        return time.time() + self.offset

    def now(self) -> float:
        return self.time()

    def step(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock() -> WallClock:
    return WallClock()


def in_process_monitor(root: Path, **kwargs) -> CheckpointMonitor:
    return CheckpointMonitor(
        default_local_dir=root, metrics_port=None, registry=CollectorRegistry(), **kwargs
    )


def write(root: Path, step: int, name: str) -> None:
    path = layout.step_dir(root, step) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * 64)


def sample(m: CheckpointMonitor, name: str, **labels: str) -> float | None:
    return m.metrics.registry.get_sample_value(name, labels)


class TestLeases:
    """A step of the wall clock neither expires a save that renews its lease, nor keeps
    alive one that stopped renewing it."""

    def test_forward_and_back_by_an_hour(self, tmp_path, clock):
        root = tmp_path / "root"
        m = in_process_monitor(root, clock=clock, lease_timeout_s=1.0)  # checked every 0.25 s

        async def run() -> dict:
            await m.register_thread_count(1, checkpoint_thread_count=1)
            await m.register_thread_count(2, checkpoint_thread_count=1)
            kw = dict(kind="checkpoint", lease=True)
            alive = (await m.notify_started("n", "j", step=1, slot="alive", **kw))["ticket"]
            await m.heartbeat([alive])
            clock.step(+HOUR)
            await asyncio.sleep(0.5)  # half the lease without a heartbeat: still healthy
            assert [t["step"] for t in (await m.status())["in_flight"]] == [1]
            await m.heartbeat([alive])
            await m.notify_started("n", "j", step=2, slot="dead", **kw)  # never renewed
            clock.step(-HOUR)
            deadline = time.monotonic() + 3.0  # the lease and a check, with room to spare
            while not (await m.status())["failed"] and time.monotonic() < deadline:
                await m.heartbeat([alive])
                await asyncio.sleep(0.1)
            status = await m.status()
            write(root, 1, "alive.pt")
            await m.notify_finished(1, ticket=alive, slot="alive")
            await m.monitor_step(1)
            return status

        status = asyncio.run(run())
        [failed] = status["failed"]
        assert failed["step"] == 2, status
        # The lease and at most one check interval, in whole seconds.
        assert re.search(r"sent no heartbeat for [12] s \(lease_timeout_s=1.0\)", failed["error"])
        assert [t["step"] for t in status["in_flight"]] == [1]
        assert reader.read_iteration(root, "checkpoint") == 1
        assert sample(m, "obsckpt_saves_total", slot="dead", kind="checkpoint", result="error")
        assert not sample(m, "obsckpt_saves_total", slot="alive", kind="checkpoint", result="error")


class TestDurations:
    """Durations, waits and lags span wall-clock steps at their true length, and the
    times in status() and the *_timestamp_seconds gauges read in the wall clock of now."""

    def test_steps_during_a_wait_a_save_and_a_commit(self, tmp_path, clock, monkeypatch):
        root = tmp_path / "root"
        m = in_process_monitor(root, clock=clock, save_strategy=SaveStrategy.SINGLE_THREAD)
        real_finalize = commit.finalize_step

        def finalize_across_a_step(*args, **kwargs):
            clock.step(+HOUR)  # while the commit's files are fsynced
            return real_finalize(*args, **kwargs)

        monkeypatch.setattr(commit, "finalize_step", finalize_across_a_step)

        async def run() -> tuple[float, dict]:
            t0 = time.monotonic()
            await m.register_thread_count(1, checkpoint_thread_count=2)
            first = (await m.notify_started("n", "j", step=1, slot="a"))["ticket"]
            queued = asyncio.ensure_future(m.notify_started("n", "j", step=1, slot="b"))
            await asyncio.sleep(0.05)
            clock.step(-HOUR)
            pending = (await m.status())["pending"][0]
            assert 0 <= clock.now() - pending["started"] < 5, pending
            gauge = sample(
                m, "obsckpt_oldest_pending_step_start_timestamp_seconds", kind="checkpoint"
            )
            assert 0 <= clock.now() - gauge < 5, (gauge, clock.now())
            await asyncio.sleep(0.2)
            write(root, 1, "a.pt")
            write(root, 1, "b.pt")
            await m.notify_finished(1, ticket=first, slot="a")  # measured by the monitor
            second = (await queued)["ticket"]
            await m.notify_finished(1, ticket=second, slot="b", duration_s=0.01)
            await m.monitor_step(1)
            return time.monotonic() - t0, await m.status()

        elapsed, status = asyncio.run(run())
        assert reader.read_iteration(root, "checkpoint") == 1
        labels = {"slot": "a", "kind": "checkpoint"}
        save_s = sample(m, "obsckpt_save_duration_seconds_sum", **labels)
        wait_s = sample(m, "obsckpt_save_admission_wait_seconds_sum", strategy="single_thread")
        lag_s = sample(m, "obsckpt_commit_lag_seconds_sum", kind="checkpoint")
        assert 0.2 <= save_s <= elapsed, save_s
        assert 0.2 <= wait_s <= elapsed, wait_s
        assert 0.2 <= lag_s <= elapsed, lag_s
        last = status["last_commit"]["checkpoint"]
        assert 0 <= last["commit_io_s"] < 5, last
        assert last["whole_at"] <= last["committed_at"] <= clock.now()
        assert 0 <= clock.now() - status["last_commit_time"]["checkpoint"] < 5, status
        gauge = sample(m, "obsckpt_last_commit_timestamp_seconds", kind="checkpoint")
        assert 0 <= clock.now() - gauge < 5, (gauge, clock.now())
        assert (
            sample(m, "obsckpt_oldest_pending_step_start_timestamp_seconds", kind="checkpoint") == 0
        )


class SteppedClockMonitor(CheckpointMonitor):
    """The monitor actor, with an RPC that steps its wall clock (in its own process only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, clock=WallClock(), **kwargs)

    async def step_wall_clock(self, seconds: float) -> None:
        self.clock.step(seconds)


class TestRunningJob:
    """A job on Ray: saves through a coordinator, a rank killed, /metrics scraped, while
    the monitor's wall clock steps an hour forward and back."""

    def test_leases_commits_gauges_and_status(self, namespace, tmp_path):
        import ray
        from metrics_helpers import scrape, value
        from reliability_helpers import wait_for
        from workers import SaveWorker

        root = tmp_path / "root"
        monitor = SteppedClockMonitor.get_actor(
            namespace=namespace,
            default_local_dir=root,
            metrics_host="127.0.0.1",
            lease_timeout_s=2.0,  # heartbeats and checks every 0.5 s
        )
        doomed = SaveWorker.remote(namespace, 1)
        coord = CheckpointCoordinator(monitor, rank=0)
        gate = threading.Event()
        path = layout.step_dir(root, 1) / "model.pt"

        def save() -> None:
            gate.wait(30)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * 64)

        def status() -> dict:
            return ray.get(monitor.status.remote())

        def age(name: str, offset: float) -> float:
            return time.time() + offset - value(scrape(monitor), name, kind="checkpoint")

        coord.save_async("model", save, 1, paths=[str(path)])
        asyncio.run(coord.register_and_monitor(1, checkpoint_thread_count=1))
        wait_for(lambda: status()["in_flight"], 20, "the admission of step 1")

        ray.get(monitor.step_wall_clock.remote(+HOUR))
        assert 0 <= age("obsckpt_oldest_pending_step_start_timestamp_seconds", HOUR) < 20
        [pending] = status()["pending"]
        assert 0 <= time.time() + HOUR - pending["started"] < 20, pending
        time.sleep(1.0)  # two lease checks after the step
        assert status()["failed"] == []

        ray.get(doomed.save.remote(str(root), 2, ["model"], gated=True))
        asyncio.run(coord.register_and_monitor(2, checkpoint_thread_count=1))
        wait_for(lambda: len(status()["in_flight"]) == 2, 20, "the admission of step 2")
        ray.get(monitor.step_wall_clock.remote(-HOUR))
        ray.kill(doomed)  # SIGKILL: its heartbeats stop
        gate.set()
        coord.wait_all(timeout=20)
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, 20, "the commit of step 1")
        [failed] = wait_for(lambda: status()["failed"], 6, "the killed rank's lease to run out")
        assert failed["step"] == 2, failed
        assert re.search(r"sent no heartbeat for [23] s", failed["error"]), failed
        assert 0 <= time.time() - failed["at"] < 20, failed

        ray.get(monitor.step_wall_clock.remote(+HOUR))  # a commit is as recent as it was
        assert 0 <= age("obsckpt_last_commit_timestamp_seconds", HOUR) < 20
        s = scrape(monitor)
        lag = value(s, "obsckpt_commit_lag_seconds_sum", kind="checkpoint")
        assert 1.0 <= lag < 20, lag
        assert value(s, "obsckpt_saves_in_flight", kind="checkpoint") == 0
        coord.close()
        ray.kill(monitor)


class SteppedTime:
    """The ``time`` module as a module sees it once the wall clock stepped by ``offset``."""

    def __init__(self, offset: float) -> None:
        self.offset = offset

    def time(self) -> float:
        return time.time() + self.offset

    def __getattr__(self, name: str):
        return getattr(time, name)


class TestIpcDeadline:
    """The sender's deadline is a CLOCK_MONOTONIC reading, which both processes of one
    host share: a wall-clock step between send and receive neither refuses a sync in
    time nor lets a late one through."""

    def test_a_step_forward_does_not_refuse_a_sync_in_time(self, tmp_path, monkeypatch):
        import torch

        from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender
        from obsckpt.sync.ipc import receiver as receiver_module

        sender = IpcWeightSender(device="cpu", timeout_s=30, shm_dir=str(tmp_path))
        receiver = IpcWeightReceiver()
        monkeypatch.setattr(receiver_module, "time", SteppedTime(+HOUR))
        weights = {"w": torch.arange(64, dtype=torch.float32)}
        received = []

        def deliver(payload):
            ack, out = receiver.recv(payload, clone=True)
            received.append(out)
            return ack

        sender.send(weights, deliver, step=1)
        assert receiver.last_step == 1 and torch.equal(received[0]["w"], weights["w"])
        sender.close()
        receiver.close()

    def test_a_step_back_does_not_let_a_late_sync_through(self, tmp_path, monkeypatch):
        import torch

        from obsckpt.errors import BroadcastError, BroadcastTimeoutError
        from obsckpt.sync.ipc import IpcWeightReceiver, IpcWeightSender
        from obsckpt.sync.ipc import receiver as receiver_module

        sender = IpcWeightSender(device="cpu", timeout_s=0.05, shm_dir=str(tmp_path))
        payloads = []
        with pytest.raises(BroadcastError):  # the sender gives up on a wrong answer
            sender.send(
                {"w": torch.zeros(64)}, lambda p: payloads.append(p) or {"step": -1}, step=1
            )
        time.sleep(0.1)  # past the sender's deadline
        monkeypatch.setattr(receiver_module, "time", SteppedTime(-HOUR))
        receiver = IpcWeightReceiver()
        with pytest.raises(BroadcastTimeoutError, match=r"s after the sender's deadline"):
            receiver.recv(payloads[0])
        assert receiver.last_step is None
        sender.close()
        receiver.close()
