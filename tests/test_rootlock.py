"""One committer per checkpoint root: a second job's monitor is refused, naming the first.

Real processes hold the lock (a monitor in a subprocess, a monitor actor on the
session's Ray); the lock is the kernel's flock, so a killed holder frees it.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import ray
from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor, IterationFileError, RootInUseError
from obsckpt.cli import main as cli_main
from obsckpt.store import commit, layout, reader, rootlock

# A monitor in a process of its own: prints "ready" once it holds the root, then
# sits until killed or until stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    from prometheus_client import CollectorRegistry
    from obsckpt import CheckpointMonitor
    m = CheckpointMonitor(default_local_dir=sys.argv[1], metrics_port=None,
                          namespace="first-job", registry=CollectorRegistry())
    print("ready", flush=True)
    sys.stdin.read()
    """
)


def start_holder(root) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"holder did not start (exit {proc.poll()})"
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def monitor(root, **kw):
    return CheckpointMonitor(
        default_local_dir=root, metrics_port=None, registry=CollectorRegistry(), **kw
    )


@pytest.fixture
def quick(monkeypatch):
    """New monitors give up on a held root at once (5 s by default)."""
    monkeypatch.setattr(rootlock, "START_WAIT_S", 0.0)


@pytest.fixture
def committed_root(tmp_path):
    """A root with step 3 committed by the first job."""
    root = tmp_path / "ckpt"
    sdir = layout.step_dir(root, 3)
    sdir.mkdir(parents=True)
    (sdir / "model.pt").write_bytes(b"weights")
    commit.finalize_step(sdir, iterations={"checkpoint": 3})
    return root


class TestOneMonitorPerRoot:
    """While a monitor's process lives, no other monitor commits into its root."""

    def test_a_second_monitor_is_refused_naming_the_first(self, committed_root, quick):
        holder = start_holder(committed_root)
        try:
            before = sorted(os.listdir(committed_root))
            with pytest.raises(RootInUseError) as err:
                monitor(committed_root)
            msg = str(err.value)
            assert str(committed_root) in msg
            assert f"pid {holder.pid}" in msg and socket.gethostname() in msg
            assert "'first-job'" in msg and "default_local_dir" in msg
            assert err.value.holder["pid"] == holder.pid
            assert isinstance(err.value, OSError)
            # Nothing of the first job's was touched.
            assert sorted(os.listdir(committed_root)) == before
            assert reader.read_iteration(committed_root, "checkpoint") == 3
        finally:
            stop(holder)

    def test_a_killed_holder_frees_the_root_at_once(self, committed_root, quick):
        holder = start_holder(committed_root)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=10)
        m = monitor(committed_root)
        assert m.tracker.latest["checkpoint"] == 3
        assert rootlock.locked_by(committed_root)["pid"] == os.getpid()
        asyncio.run(m.shutdown())

    def test_shutdown_frees_the_root(self, tmp_path, quick):
        first = monitor(tmp_path)
        with pytest.raises(RootInUseError, match=f"pid {os.getpid()}"):
            monitor(tmp_path)  # a second monitor in the same process too
        asyncio.run(first.shutdown())
        assert rootlock.locked_by(tmp_path) is None
        asyncio.run(monitor(tmp_path).shutdown())

    def test_a_new_monitor_waits_for_a_holder_that_is_ending(self, tmp_path, monkeypatch):
        monkeypatch.setattr(rootlock, "START_WAIT_S", 10.0)
        holder = start_holder(tmp_path)
        # Killed while the new monitor waits, as a monitor is after ray.kill.
        killer = subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -9 {holder.pid}"])
        start = time.monotonic()
        m = monitor(tmp_path)
        assert 0.4 < time.monotonic() - start < 5
        killer.wait(timeout=10)
        holder.wait(timeout=10)
        asyncio.run(m.shutdown())

    def test_a_monitor_that_fails_to_start_does_not_keep_the_root(self, tmp_path, quick):
        (tmp_path / layout.ITERATION_FILES["checkpoint"]).write_text("seven\n")
        with pytest.raises(IterationFileError):
            monitor(tmp_path)  # fails after taking the lock
        assert rootlock.locked_by(tmp_path) is None
        (tmp_path / layout.ITERATION_FILES["checkpoint"]).unlink()
        asyncio.run(monitor(tmp_path).shutdown())

    def test_a_filesystem_without_locks_runs_unlocked_with_a_warning(
        self, tmp_path, monkeypatch, caplog
    ):
        # Some FUSE mounts and NFS mounted with nolock answer flock with ENOLCK.
        def no_locks(fd, op):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(rootlock.fcntl, "flock", no_locks)
        m = monitor(tmp_path)
        assert not m._root_lock.held
        assert "does not support flock" in caplog.text and str(tmp_path) in caplog.text
        assert rootlock.locked_by(tmp_path) is None
        asyncio.run(m.shutdown())

    def test_details_that_cannot_be_read_still_refuse(self, tmp_path, quick):
        holder = start_holder(tmp_path)
        try:
            # Another writer's garbage in the file: the lock, not its text, decides.
            with open(rootlock.lock_path(tmp_path), "r+b") as f:
                f.write(b"\xff" * 64)
            with pytest.raises(RootInUseError, match="a holder that left no details"):
                monitor(tmp_path)
        finally:
            stop(holder)


class TestRayJobs:
    """Two jobs (namespaces) with one root: the second one's get_actor fails in the caller."""

    def test_a_second_jobs_monitor_is_refused(self, ray_cluster, tmp_path):
        root = tmp_path / "ckpt"
        first = CheckpointMonitor.get_actor(
            namespace="rootlock-first", default_local_dir=root, metrics_port=None
        )
        try:
            start = time.monotonic()
            with pytest.raises(RootInUseError) as err:
                CheckpointMonitor.get_actor(
                    namespace="rootlock-second", default_local_dir=root, metrics_port=None
                )
            assert time.monotonic() - start < rootlock.START_WAIT_S + 3
            assert "'rootlock-first'" in str(err.value)
            # No actor of the second job was left behind.
            with pytest.raises(ValueError):
                ray.get_actor("checkpoint_monitor", namespace="rootlock-second")
        finally:
            ray.kill(first)
        # Once the first job's monitor is gone the root is the second job's.
        second = CheckpointMonitor.get_actor(
            namespace="rootlock-second", default_local_dir=root, metrics_port=None
        )
        assert ray.get(second.checkpoint_root.remote()) == str(root)
        ray.kill(second)


class TestTools:
    """The CLI shows who commits into a root; the demo never clears a root in use."""

    def test_status_names_the_running_monitor(self, committed_root, capsys):
        holder = start_holder(committed_root)
        try:
            assert cli_main(["status", str(committed_root), "--json"]) == 0
            st = json.loads(capsys.readouterr().out)
            assert st["monitor"]["pid"] == holder.pid
            assert cli_main(["status", str(committed_root)]) == 0
            assert f"monitor: running (host {socket.gethostname()}, pid {holder.pid}" in (
                capsys.readouterr().out
            )
        finally:
            stop(holder)
        assert cli_main(["status", str(committed_root)]) == 0
        assert "monitor: none holds this root" in capsys.readouterr().out

    def test_demo_refuses_a_root_in_use_and_removes_nothing(self, tmp_path, quick):
        from obsckpt.demo.config import DemoConfig
        from obsckpt.demo.root import MARKER, prepare_root
        from obsckpt.errors import DemoError

        root = tmp_path / "demo"
        root.mkdir()
        (root / MARKER).write_text("{}\n")
        sdir = layout.step_dir(root, 2)
        sdir.mkdir()
        (sdir / "model.pt").write_bytes(b"w")
        holder = start_holder(root)
        try:
            for dry_run in (True, False):
                with pytest.raises(DemoError, match=f"in use .*pid {holder.pid}.*--ckpt-dir"):
                    prepare_root(DemoConfig(ckpt_dir=str(root)), print, dry_run=dry_run)
            assert (sdir / "model.pt").read_bytes() == b"w"
        finally:
            stop(holder)
        # Its lock file left behind does not make the root foreign.
        assert os.path.exists(rootlock.lock_path(root))
        prepare_root(DemoConfig(ckpt_dir=str(root)), lambda *_: None)
        assert not sdir.exists()
