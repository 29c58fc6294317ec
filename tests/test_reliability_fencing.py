"""One committer per root, even at shutdown; commit waits bounded and visible while they hang.

Monitors run as actors on the session's Ray (the shutdown and lost-lock cases)
or in-process where a fault is injected (an fsync that hangs, Ray's node table
that cannot be read). The lock file, the iteration files and the step
directories are real files; what is asserted is what a user sees: the
iteration file's content and inode, status(), the scraped metrics, log lines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
import ray
from prometheus_client import CollectorRegistry
from reliability_helpers import scrape, wait_for

from obsckpt import CheckpointMonitor, FsyncTimeoutError, RootInUseError, RootLockLostError
from obsckpt.monitor import actor as actor_module
from obsckpt.monitor.lifecycle import DeadNodes
from obsckpt.monitor.telemetry import MonitorTelemetry
from obsckpt.store import commit, layout, reader, rootlock

ITERATION = layout.ITERATION_FILES["checkpoint"]


def make_actor(namespace: str, root) -> object:
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace, default_local_dir=str(root), metrics_host="127.0.0.1"
    )
    ray.get(monitor.status.remote())
    return monitor


def write_step(root, step: int) -> None:
    sdir = layout.step_dir(root, step)
    sdir.mkdir(parents=True)
    (sdir / "model.pt").write_bytes(b"weights of step %d" % step)


def start_save(monitor, step: int) -> int:
    """A save of ``step`` registered and admitted (not finished); returns its ticket."""
    ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=1))
    ray.get(monitor.monitor_step.remote(step))
    reply = ray.get(
        monitor.notify_started.remote(step=step, slot="model", kind="checkpoint", rank=0)
    )
    return reply["ticket"]


def finish_save(monitor, step: int, ticket: int) -> None:
    ray.get(monitor.notify_finished.remote(step, ticket=ticket, slot="model", rank=0))


def commit_step(monitor, root, step: int) -> None:
    """Save and commit ``step`` through ``monitor``; waits for its iteration file."""
    write_step(root, step)
    finish_save(monitor, step, start_save(monitor, step))
    wait_for(lambda: reader.read_iteration(root, "checkpoint") == step, 20, f"step {step}")


def inode(path) -> int:
    return os.stat(path).st_ino


def replace_lock_file(root) -> None:
    """Put a new lock file at the path at once, as a monitor that started just after a
    deletion would have (the holder's watcher cannot make one in between)."""
    path = rootlock.lock_path(root)
    spare = path.with_name("spare-lock")
    spare.write_text('{"epoch": "a-newer-monitor"}')
    os.replace(spare, path)


def failed_steps(status: dict) -> dict[int, str]:
    return {f["step"]: f["error"] for f in status["failed"] if f["kind"] == "checkpoint"}


class TestShutdownFences:
    """A monitor that has shut down commits nothing, even for a save it admitted before."""

    def test_late_commit_after_shutdown_moves_nothing(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        old = make_actor(namespace, root)
        commit_step(old, root, 1)
        ticket = start_save(old, 2)
        write_step(root, 2)
        ray.get(old.shutdown.remote())
        # The root is free: the next job's monitor takes it while the old actor lives.
        new = make_actor(namespace + "-next", root)
        before = inode(root / ITERATION)
        finish_save(old, 2, ticket)  # step 2 is whole in the old monitor now

        status = ray.get(old.status.remote())
        assert "released" in status["fenced"] and "shut down" in status["fenced"]
        error = failed_steps(status)[2]
        assert error.startswith("commit of step 2 (checkpoint) refused")
        assert f"{ITERATION} still names step 1" in error
        assert status["latest"]["checkpoint"] == 1
        assert reader.read_iteration(root, "checkpoint") == 1
        assert inode(root / ITERATION) == before  # never renamed over
        assert not (layout.step_dir(root, 2) / layout.MANIFEST_NAME).exists()
        # The monitor that owns the root commits.
        commit_step(new, root, 3)
        assert ray.get(new.status.remote())["fenced"] is None
        ray.get(new.shutdown.remote())


class TestShutdownDuringACommit:
    """shutdown() lets a running commit end within its drain wait; one still running
    after it is refused at its rename, since the root is released by then."""

    def _run(self, root, registry, release: threading.Event, release_after_s: float):
        async def scenario() -> dict:
            monitor = CheckpointMonitor(
                default_local_dir=root, metrics_port=None, registry=registry
            )
            run = asyncio.create_task(monitor.monitor_step(1))
            gauge = "obsckpt_commit_phase_started_timestamp_seconds"
            while not registry.get_sample_value(gauge, {"phase": "fsync_files"}):
                await asyncio.sleep(0.01)
            asyncio.get_running_loop().call_later(release_after_s, release.set)
            await monitor.shutdown()
            await run
            return await monitor.status()

        return asyncio.run(scenario())

    def test_a_commit_that_ends_in_time_commits(self, tmp_path, monkeypatch):
        release, hung = threading.Event(), []
        monkeypatch.setattr(commit, "fsync_file", blocking_fsync(release, hung))
        root = tmp_path / "ckpt"
        write_step(root, 1)
        status = self._run(root, CollectorRegistry(), release, 0.3)
        assert reader.read_iteration(root, "checkpoint") == 1
        assert status["latest"]["checkpoint"] == 1 and "shut down" in status["fenced"]

    def test_a_commit_past_the_drain_wait_is_refused(self, tmp_path, monkeypatch, caplog):
        release, hung = threading.Event(), []
        monkeypatch.setattr(commit, "fsync_file", blocking_fsync(release, hung))
        monkeypatch.setattr(actor_module, "_COMMIT_DRAIN_S", 0.2)
        root = tmp_path / "ckpt"
        write_step(root, 1)
        with caplog.at_level(logging.WARNING, logger="obsckpt.monitor"):
            status = self._run(root, CollectorRegistry(), release, 0.5)
        assert "releasing the root anyway" in caplog.text
        assert reader.read_iteration(root, "checkpoint") is None
        assert not (root / ITERATION).exists()
        # Nor the manifest: a monitor fenced off renames nothing into a step (a newer job
        # may have committed the same step, whose manifest a late rename would replace).
        sdir = layout.step_dir(root, 1)
        assert not (sdir / layout.MANIFEST_NAME).exists()
        assert [p.name for p in sdir.iterdir()] == ["model.pt"]  # its temp file removed
        error = failed_steps(status)[1]
        assert error.startswith("commit of step 1 (checkpoint) refused") and "released" in error


class TestLostLockFile:
    """A lock file deleted under a running monitor is found; whichever monitor locks a file
    at the path first owns the root, and the other commits nothing."""

    def test_deleted_lock_is_locked_anew_and_a_newcomer_is_refused(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        monitor = make_actor(namespace, root)
        address = ray.get(monitor.metrics_address.remote())
        commit_step(monitor, root, 1)
        epoch = rootlock.read_holder(root)["epoch"]
        rootlock.lock_path(root).unlink()

        status = ray.get(monitor.status.remote())
        assert status["fenced"] is None and status["lock_recreated"] == 1
        holder = rootlock.locked_by(root)
        assert holder is not None and holder["epoch"] == epoch
        # The root is not free: a second job's monitor is refused, naming the first.
        with pytest.raises(RootInUseError, match=namespace):
            CheckpointMonitor.get_actor(
                namespace=namespace + "-second", default_local_dir=str(root), metrics_port=None
            )
        commit_step(monitor, root, 2)
        assert scrape(address).value("obsckpt_monitor_fenced") == 0
        ray.get(monitor.shutdown.remote())

    def test_replaced_lock_fences_the_monitor(self, namespace, tmp_path):
        """Another file put at the path (another monitor's, made after a deletion): the
        monitor reports it and the next step fails, its iteration file never renamed."""
        root = tmp_path / "ckpt"
        monitor = make_actor(namespace, root)
        address = ray.get(monitor.metrics_address.remote())
        assert scrape(address).value("obsckpt_monitor_fenced") == 0
        commit_step(monitor, root, 1)
        replace_lock_file(root)

        status = ray.get(monitor.status.remote())
        assert "replaced by another file" in status["fenced"]
        assert scrape(address).value("obsckpt_monitor_fenced") == 1
        before = inode(root / ITERATION)
        write_step(root, 2)
        finish_save(monitor, 2, start_save(monitor, 2))
        wait_for(lambda: 2 in failed_steps(ray.get(monitor.status.remote())), 20, "step 2 fails")
        assert reader.read_iteration(root, "checkpoint") == 1
        assert inode(root / ITERATION) == before
        failures = scrape(address).value("obsckpt_step_failures_total", kind="checkpoint")
        assert failures == 1
        ray.get(monitor.shutdown.remote())

    def test_second_monitor_after_a_replacement_is_the_only_committer(self, namespace, tmp_path):
        root = tmp_path / "ckpt"
        first = make_actor(namespace, root)
        commit_step(first, root, 1)
        ticket = start_save(first, 2)
        replace_lock_file(root)
        # flock is on the inode: the second monitor locks the new file at the path.
        second = make_actor(namespace + "-second", root)
        write_step(root, 2)
        finish_save(first, 2, ticket)
        wait_for(lambda: 2 in failed_steps(ray.get(first.status.remote())), 20, "refusal")

        status = ray.get(first.status.remote())
        assert "replaced by another file" in status["fenced"]
        assert "refused" in failed_steps(status)[2]
        assert reader.read_iteration(root, "checkpoint") == 1
        commit_step(second, root, 3)
        assert ray.get(second.status.remote())["fenced"] is None
        # The first stays fenced: a later step of its commits nothing either.
        before = inode(root / ITERATION)
        write_step(root, 4)
        finish_save(first, 4, start_save(first, 4))
        wait_for(lambda: 4 in failed_steps(ray.get(first.status.remote())), 20, "step 4 fails")
        assert reader.read_iteration(root, "checkpoint") == 3
        assert inode(root / ITERATION) == before
        for m in (first, second):
            ray.get(m.shutdown.remote())


class TestTheFence:
    """RootLock.check proves the held file is the one at the path and names its epoch."""

    def test_each_holder_writes_a_new_epoch(self, tmp_path):
        first = rootlock.acquire(tmp_path)
        epoch = rootlock.read_holder(tmp_path)["epoch"]
        assert epoch == first.epoch
        first.check()
        first.release()
        with pytest.raises(RootLockLostError, match="released"):
            first.check()
        second = rootlock.acquire(tmp_path)
        assert second.epoch != epoch
        second.check()
        second.release()

    def test_an_epoch_rewritten_in_the_same_file_fences(self, tmp_path):
        lock = rootlock.acquire(tmp_path)
        path = rootlock.lock_path(tmp_path)
        ino = inode(path)
        with open(path, "r+") as f:  # the same inode, another holder's text
            f.write('{"epoch": "someone-else"}' + " " * 200)
        assert inode(path) == ino
        with pytest.raises(RootLockLostError, match="names epoch 'someone-else'"):
            lock.check()
        assert "someone-else" in lock.lost
        lock.release()
        assert "someone-else" in lock.lost  # the first reason stays

    def test_a_deleted_file_is_locked_anew_unless_another_holder_was_first(self, tmp_path):
        lock = rootlock.acquire(tmp_path)
        path = rootlock.lock_path(tmp_path)
        path.unlink()
        lock.check()  # made and locked anew
        assert lock.recreated == 1 and lock.lost is None
        with pytest.raises(RootInUseError):
            rootlock.acquire(tmp_path)
        path.unlink()
        newcomer = rootlock.acquire(tmp_path)  # first this time
        with pytest.raises(RootLockLostError, match="replaced by another file"):
            lock.check()
        newcomer.check()
        lock.release()
        newcomer.release()

    def test_the_watcher_finds_a_deletion_between_commits(self, tmp_path):
        lock = rootlock.acquire(tmp_path)
        lock.watch(interval_s=0.05)
        path = rootlock.lock_path(tmp_path)
        path.unlink()
        wait_for(lambda: lock.recreated == 1, 5, "the lock file made anew")
        assert rootlock.read_holder(tmp_path)["epoch"] == lock.epoch
        assert rootlock.locked_by(tmp_path) is not None
        replace_lock_file(tmp_path)
        wait_for(lambda: lock.lost, 5, "the holder fenced off")
        assert "replaced by another file" in lock.lost
        # This lock's own watcher (other monitors of the test process have theirs).
        watcher = lock._watcher
        assert watcher is not None and watcher.name == "obsckpt-root-fence"
        lock.release()
        assert not watcher.is_alive()

    def test_a_release_waits_for_a_rename_that_passed_the_fence(self, tmp_path):
        """A shutdown between a commit's check and its rename would let the rename land
        after the release: the release waits for the fenced block instead."""
        lock = rootlock.acquire(tmp_path)
        inside, leave, released = threading.Event(), threading.Event(), threading.Event()

        def commit_rename():
            with lock.fenced():
                inside.set()
                leave.wait(10)

        renamer = threading.Thread(target=commit_rename)
        renamer.start()
        assert inside.wait(5)
        releaser = threading.Thread(target=lambda: (lock.release(), released.set()))
        releaser.start()
        assert not released.wait(0.3)  # held back by the rename in progress
        leave.set()
        assert released.wait(5)
        renamer.join(5)
        releaser.join(5)
        with pytest.raises(RootLockLostError, match="released"), lock.fenced():
            pass

    def test_without_flock_a_later_monitor_fences_the_earlier(self, tmp_path, monkeypatch):
        # Some FUSE mounts and NFS mounted with nolock answer flock with ENOLCK.
        def no_locks(fd, op):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(rootlock.fcntl, "flock", no_locks)
        first = rootlock.acquire(tmp_path)
        first.check()
        second = rootlock.acquire(tmp_path)
        assert not first.held and not second.held
        second.check()
        with pytest.raises(RootLockLostError, match="another monitor wrote it"):
            first.check()
        first.release()
        second.release()


def blocking_fsync(release: threading.Event, hung: list[str]):
    """An fsync of a file that hangs until ``release`` (an NFS server that stopped answering)."""
    real = commit.fsync_file

    def fsync_file(path):
        hung.append(os.fspath(path))
        release.wait(30)
        real(path)

    return fsync_file


class TestBoundedFsync:
    """Every fsync wait of a commit has a timeout, and its error names phase, files and wait."""

    def test_a_hung_fsync_times_out_naming_what_it_waited_for(self, tmp_path, monkeypatch):
        release, hung = threading.Event(), []
        monkeypatch.setattr(commit, "fsync_file", blocking_fsync(release, hung))
        files = [tmp_path / "a.pt", tmp_path / "b.pt"]
        for f in files:
            f.write_bytes(b"x")
        start = time.monotonic()
        try:
            with pytest.raises(FsyncTimeoutError) as err:
                commit.fsync_many(
                    [(files[0], False), (files[1], False), (tmp_path, True)],
                    phase="test round",
                    timeout_s=0.3,
                )
        finally:
            release.set()
        waited = time.monotonic() - start
        assert 0.3 <= waited < 5
        msg = str(err.value)
        assert msg.startswith("test round: 2 of 3 fsyncs had not finished after 0.")
        assert "(timeout 0.3 s)" in msg and repr(str(files[0])) in msg
        assert isinstance(err.value, TimeoutError)

    def test_a_hung_commit_shows_its_phase_while_it_hangs(self, tmp_path, monkeypatch):
        """The phase gauge and status() name the hung phase; the step then fails on the
        timeout, the phase's time is observed and the gauge goes back to 0."""
        release, hung = threading.Event(), []
        monkeypatch.setattr(commit, "fsync_file", blocking_fsync(release, hung))
        monkeypatch.setattr(commit, "FSYNC_TIMEOUT_S", 1.0)
        registry = CollectorRegistry()
        root = tmp_path / "ckpt"
        write_step(root, 1)

        async def scenario() -> tuple[dict, float, dict]:
            monitor = CheckpointMonitor(
                default_local_dir=root, metrics_port=None, registry=registry
            )
            run = asyncio.create_task(monitor.monitor_step(1))
            gauge = "obsckpt_commit_phase_started_timestamp_seconds"
            deadline = time.monotonic() + 10
            while not registry.get_sample_value(gauge, {"phase": "fsync_files"}):
                assert time.monotonic() < deadline, "the commit never reached fsync_files"
                await asyncio.sleep(0.01)
            during = await monitor.status()
            started = registry.get_sample_value(gauge, {"phase": "fsync_files"})
            await run
            after = await monitor.status()
            await monitor.shutdown()
            return during, started, after

        try:
            during, started, after = asyncio.run(scenario())
        finally:
            release.set()
        assert during["committing"]["step"] == 1 and during["committing"]["phase"] == "fsync_files"
        assert abs(started - time.time()) < 30
        assert after["committing"] is None
        error = failed_steps(after)[1]
        assert "fsync_files" in error and "had not finished after 1." in error
        assert "model.pt" in error and f"{ITERATION} still names no step" in error
        assert reader.read_iteration(root, "checkpoint") is None
        count = registry.get_sample_value(
            "obsckpt_commit_phase_seconds_count", {"phase": "fsync_files"}
        )
        took = registry.get_sample_value(
            "obsckpt_commit_phase_seconds_sum", {"phase": "fsync_files"}
        )
        assert count == 1 and 1.0 <= took < 10
        for phase in commit.COMMIT_PHASES:
            value = registry.get_sample_value(
                "obsckpt_commit_phase_started_timestamp_seconds", {"phase": phase}
            )
            assert value == 0, phase
        assert registry.get_sample_value("obsckpt_step_failures_total", {"kind": "checkpoint"}) == 1

    def test_a_healthy_commit_times_every_phase(self, tmp_path):
        registry = CollectorRegistry()
        root = tmp_path / "ckpt"
        write_step(root, 1)

        async def scenario() -> None:
            monitor = CheckpointMonitor(
                default_local_dir=root, metrics_port=None, registry=registry
            )
            await monitor.monitor_step(1)
            await monitor.shutdown()

        asyncio.run(scenario())
        assert reader.read_iteration(root, "checkpoint") == 1
        for phase in commit.COMMIT_PHASES:
            count = registry.get_sample_value(
                "obsckpt_commit_phase_seconds_count", {"phase": phase}
            )
            assert count == 1, phase


class TestDeadNodes:
    """A failed ray.nodes() is logged once per run of failures, counted, and never reads
    as "no node is dead": the dead nodes known before stay dead."""

    def test_failures_keep_the_known_dead_nodes(self, caplog):
        answers: list[object] = [
            [{"NodeID": "a", "Alive": False}, {"NodeID": "b", "Alive": True}],
            RuntimeError("GCS unreachable"),
            RuntimeError("GCS unreachable"),
            [{"NodeID": "a", "Alive": False}, {"NodeID": "c", "Alive": False}],
        ]

        def nodes():
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return answer

        telemetry = MonitorTelemetry("unrestricted", CollectorRegistry(), 8)
        dead = DeadNodes(nodes, on_failure=telemetry.node_query_failed)
        with caplog.at_level(logging.INFO, logger="obsckpt.monitor"):
            assert dead() == {"a"}
            assert dead() == {"a"}
            assert dead() == {"a"}
            assert dead() == {"a", "c"}
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "GCS unreachable" in warnings[0].getMessage()
        assert "keeping the 1 dead node(s)" in warnings[0].getMessage()
        assert any("answers which nodes are dead again" in r.getMessage() for r in caplog.records)
        assert dead.failures == 2
        registry = telemetry.metrics.registry
        assert registry.get_sample_value("obsckpt_node_queries_failed_total") == 2

    def test_ray_s_own_node_table(self, ray_cluster):
        assert DeadNodes()() == set()
