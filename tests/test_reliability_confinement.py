"""A save writes only inside its own step, never changes a committed step, and an error
crossing Ray reaches the caller as obsckpt's own, on one line, its cause kept.

On a real local Ray with a real monitor and real files: what is checked is what a
user sees (the files, the manifest, ``obsckpt verify``'s check, the monitor's
status, the exception raised and its text).
"""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys
import threading
import types

import pytest
import ray
import torch

from obsckpt import (
    CheckpointCoordinator,
    CheckpointMonitor,
    MonitorCallError,
    MonitorTimeoutError,
    MonitorUnavailableError,
    NotificationError,
    ObsckptError,
    SaveError,
    SavePathError,
    SaveStrategy,
    SaveTimeoutError,
    WaitTimeoutError,
)
from obsckpt.monitor_link import monitor_error, ray_identity
from obsckpt.save_threads import wait_watched
from obsckpt.store import layout, reader


def make_monitor(namespace, root, strategy=SaveStrategy.SINGLE_THREAD, **kw):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=strategy,
        default_local_dir=str(root),
        metrics_port=None,
        **kw,
    )
    ray.get(monitor.status.remote())  # created and answering
    return monitor


def submit(coord, step, *, is_state_dict=False, sd=0, ck=0):
    asyncio.run(
        coord.register_and_monitor(
            step,
            is_state_dict=is_state_dict,
            state_dict_thread_count=sd,
            checkpoint_thread_count=ck,
        )
    )


def wait_for(predicate, timeout=30.0, what="condition"):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def shard(root, step):
    return layout.step_dir(root, step) / "actor" / "model_world_size_1_rank_0.pt"


def commit_step(coord, root, step, value=1.0):
    """Save and commit ``step`` (a full checkpoint of one model shard); its bytes on disk."""
    coord.save_state_dict_async("model", {"w": torch.full((64,), value)}, shard(root, step), step)
    coord.wait_all(timeout=60)
    submit(coord, step, ck=1)
    wait_for(lambda: reader.read_iteration(root, "checkpoint") == step, what=f"step {step}")
    # The pointer is swapped before the monitor closes the step's record.
    wait_for(lambda: coord.link.status()["pending"] == [], what=f"step {step}'s record closed")
    return step_bytes(root, step)


def step_bytes(root, step) -> dict[str, bytes]:
    sdir = layout.step_dir(root, step)
    return {
        str(p.relative_to(sdir)): p.read_bytes() for p in sorted(sdir.rglob("*")) if p.is_file()
    }


def assert_one_line(exc: BaseException) -> None:
    text = str(exc)
    assert "\n" not in text and "\x1b" not in text, text


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


class TestTargetsOutsideTheStep:
    """A target outside the save's own step directory is refused in the caller, before a
    byte is written, in one line naming the path, its step directory and the save's step;
    the step it was to save fails (never pending with a save counted as running), and
    the next step commits normally."""

    def test_a_path_into_a_committed_step_is_refused_and_that_step_is_untouched(
        self, namespace, root
    ):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        committed = commit_step(coord, root, 4)
        coord.link.register_thread_count(5, checkpoint_thread_count=1)
        target = shard(root, 4)

        with pytest.raises(SavePathError) as info:
            coord.save_state_dict_async("model", {"w": torch.full((64,), 9.0)}, target, 5)

        message = str(info.value)
        assert_one_line(info.value)
        assert str(target) in message and "step 5" in message
        assert f"step directory {layout.step_dir(root, 4)} (step 4)" in message
        assert step_bytes(root, 4) == committed
        assert reader.verify_step(layout.step_dir(root, 4)) == []
        status = ray.get(monitor.status.remote())
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(5, "checkpoint")]
        assert status["pending"] == [] and status["in_flight"] == []
        coord.wait_all(timeout=10)  # raised in the caller already, not stored again

        # Admission is free (single_thread would hold the next save otherwise).
        commit_step(coord, root, 6, value=6.0)
        assert reader.verify_step(layout.step_dir(root, 6)) == []

    def test_paths_naming_a_shared_file_is_refused_before_the_save_runs(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        commit_step(coord, root, 1)
        shared = root / layout.ITERATION_FILES["checkpoint"]
        before = shared.read_bytes()
        ran = []

        with pytest.raises(SavePathError, match=r"no global_step_<N> directory") as info:
            coord.save_async("meta", lambda: ran.append(1), 2, paths=[str(shared)])
        assert_one_line(info.value)
        assert str(shared) in str(info.value) and "step 2" in str(info.value)
        with pytest.raises(SavePathError, match=r"\(step 1\)"):
            coord.save_sync(lambda: ran.append(1), 2, paths=[layout.step_dir(root, 1)])

        assert ran == [] and shared.read_bytes() == before
        status = ray.get(monitor.status.remote())
        assert status["in_flight"] == [] and status["pending"] == []
        commit_step(coord, root, 3)

    def test_a_path_outside_any_step_is_refused_and_not_written(self, namespace, root, tmp_path):
        """verl's LoRA tests save to a plain directory: through obsckpt that is refused."""
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        plain = tmp_path / "lora_ckpt" / "adapter.pt"
        other_root = tmp_path / "other" / "global_step_1" / "m.pt"

        with pytest.raises(SavePathError, match=r"lies in no global_step_<N> directory") as info:
            coord.save_state_dict_async("model", {"w": torch.ones(4)}, plain, 1)
        assert_one_line(info.value)
        assert str(plain) in str(info.value) and str(layout.step_dir(root, 1)) in str(info.value)
        with pytest.raises(SavePathError, match=r"of another root"):
            coord.save_state_dict_async("model", {"w": torch.ones(4)}, other_root, 1)

        assert not plain.exists() and not other_root.exists()
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [1]  # the step it was to save
        assert status["in_flight"] == [] and status["pending"] == []
        commit_step(coord, root, 2)

    def test_a_symbolic_link_out_of_the_step_is_refused(self, namespace, root):
        """global_step_6/actor pointing at committed step 4's directory: the path is spelled
        inside step 6, but it resolves into step 4, whose shard would be overwritten."""
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        committed = commit_step(coord, root, 4)
        layout.step_dir(root, 6).mkdir()
        (layout.step_dir(root, 6) / "actor").symlink_to(layout.step_dir(root, 4) / "actor")
        coord.link.register_thread_count(6, checkpoint_thread_count=1)

        with pytest.raises(SavePathError, match="resolves through a symbolic link") as info:
            coord.save_state_dict_async("model", {"w": torch.full((64,), 9.0)}, shard(root, 6), 6)
        assert_one_line(info.value)
        assert f"which lies in step directory {layout.step_dir(root, 4)} (step 4)" in str(
            info.value
        )
        assert step_bytes(root, 4) == committed
        assert reader.verify_step(layout.step_dir(root, 4)) == []
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [6]
        assert status["pending"] == [] and status["in_flight"] == []

    def test_an_over_long_file_name_is_refused_naming_the_name_and_the_limit(self, namespace, root):
        """A name that fits the filesystem but not with the temp suffix beside it: refused
        in the caller (not as errno 36 on a temp path in the save thread)."""
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        coord.link.register_thread_count(5, checkpoint_thread_count=1)
        target = layout.step_dir(root, 5) / ("m" * 240 + ".pt")

        with pytest.raises(SavePathError, match=r"is 243 bytes") as info:
            coord.save_state_dict_async("model", {"w": torch.ones(4)}, target, 5)
        message = str(info.value)
        assert_one_line(info.value)
        assert "at most 231 bytes" in message and "limit is 255" in message
        assert "mmmm" in message and ".tmp." not in message
        assert not layout.step_dir(root, 5).exists()  # refused before anything was made
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [5]
        assert status["pending"] == [] and status["in_flight"] == []
        commit_step(coord, root, 6)

    def test_verls_checkpoint_sync_into_a_committed_step_writes_nothing(self, namespace, root):
        """fsdp_save_state_dict writes HF metadata beside the shard before it hands the shard
        over: a local_path in committed step 4 for step 5 is refused before either."""
        from obsckpt.integrations import fsdp_save_state_dict

        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        committed = commit_step(coord, root, 4)
        (layout.step_dir(root, 4) / "actor" / "fsdp_config.json").write_text("{}")
        committed["actor/fsdp_config.json"] = b"{}"
        engine = types.SimpleNamespace(module=torch.nn.Linear(2, 2))

        with pytest.raises(SavePathError, match=r"\(step 4\)"):
            fsdp_save_state_dict(engine, str(layout.step_dir(root, 4) / "actor"), 5, coord)
        assert step_bytes(root, 4) == committed
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [5]
        assert status["pending"] == [] and status["in_flight"] == []


class TestResaveOfACommittedStep:
    """A background re-save of a committed step (Trinity's end-of-training save repeats the
    last step) writes nothing: its files and manifest stay as committed, verify passes."""

    def test_the_committed_files_and_manifest_do_not_change(self, namespace, root, caplog):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        committed = commit_step(coord, root, 4, value=1.0)
        manifest = (layout.step_dir(root, 4) / layout.MANIFEST_NAME).read_bytes()
        resaves = ray.get(monitor.status.remote())["resaves"]
        ran = []

        with caplog.at_level(logging.INFO, logger="obsckpt"):
            staged = coord.save_state_dict_async(
                "model", {"w": torch.full((64,), 2.0)}, shard(root, 4), 4
            )
            coord.save_async("extra", lambda: ran.append(1), 4)
            coord.wait_all(timeout=60)  # a skip is not a failure
            submit(coord, 4, ck=2)
        assert staged.staged and ran == []
        assert "not written: the monitor has committed step 4" in caplog.text

        assert step_bytes(root, 4) == committed
        assert (layout.step_dir(root, 4) / layout.MANIFEST_NAME).read_bytes() == manifest
        assert reader.verify_step(layout.step_dir(root, 4)) == []
        assert torch.equal(torch.load(shard(root, 4))["w"], torch.full((64,), 1.0))
        status = ray.get(monitor.status.remote())
        assert status["resaves"] > resaves
        assert status["failed"] == [] and status["pending"] == [] and status["in_flight"] == []
        assert status["latest"]["checkpoint"] == 4

    def test_a_state_dict_resave_of_a_committed_state_dict_writes_nothing(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        path = shard(root, 2)
        coord.save_state_dict_async("model", {"w": torch.full((64,), 1.0)}, path, 2, True)
        coord.wait_all(timeout=60)
        submit(coord, 2, is_state_dict=True, sd=1)
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 2, what="state dict 2")
        committed = step_bytes(root, 2)

        coord.save_state_dict_async("model", {"w": torch.full((64,), 5.0)}, path, 2, True)
        coord.wait_all(timeout=60)

        assert step_bytes(root, 2) == committed
        assert reader.verify_step(layout.step_dir(root, 2)) == []


class TestErrorsCrossingRay:
    """What the monitor raises reaches the caller as obsckpt's exception, on one line,
    without colour codes, Ray's error kept as ``__cause__``; the save it was about is
    failed and released, so the next step commits."""

    def _admitted(self, coord, step):
        reply = coord.link.admit("model", step, "checkpoint", carrier=None)
        return reply["ticket"]

    def test_a_refused_report_is_one_line_and_leaves_nothing_running(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        coord.link.register_thread_count(5, checkpoint_thread_count=1)
        ticket = self._admitted(coord, 5)
        outside = {"path": str(shard(root, 4)), "size": 1, "crc32": "00000000"}

        with pytest.raises(NotificationError) as info:
            coord.link.finished("model", 5, "checkpoint", ticket, ok=True, files=[outside])

        assert_one_line(info.value)
        assert "save 'model' of step 5 reported a file" in str(info.value)
        assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)
        coord.link.drop_lease(ticket)
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [5]
        assert status["in_flight"] == [] and status["pending"] == []
        commit_step(coord, root, 6)

    def test_a_builtin_error_in_the_monitor_becomes_a_monitor_call_error(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        ticket = self._admitted(coord, 1)

        with pytest.raises(MonitorCallError) as info:
            coord.link.finished("model", 1, "checkpoint", ticket, ok=True, duration_s=-1.0)

        assert_one_line(info.value)
        assert "notify_finished (slot 'model', step 1)" in str(info.value)
        assert "duration_s" in str(info.value)
        assert isinstance(info.value.__cause__, ray.exceptions.RayTaskError)
        assert "\n" in str(info.value.__cause__)  # what the caller was spared

    def test_an_unreachable_monitor_is_a_retryable_error_naming_it(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        ray.kill(monitor, no_restart=True)

        with pytest.raises(MonitorUnavailableError) as info:
            coord.link.status()

        assert isinstance(info.value, ConnectionError) and isinstance(info.value, ObsckptError)
        assert_one_line(info.value)
        assert "'checkpoint_monitor'" in str(info.value) and "retryable" in str(info.value)
        assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)
        # The trainer's awaited calls and a background save say the same.
        with pytest.raises(MonitorUnavailableError, match=r"during register_thread_count"):
            submit(coord, 1, ck=1)
        coord.save_async("model", lambda: None, 1)
        with pytest.raises(SaveError) as saved:
            coord.wait_all(timeout=60)
        assert_one_line(saved.value)
        assert "failed: MonitorUnavailableError: the checkpoint monitor" in str(saved.value)
        assert isinstance(saved.value.__cause__, MonitorUnavailableError)

    def test_ray_unavailable_and_timeout_errors_map_to_retryable_ones(self, ray_cluster):
        unavailable = ray.exceptions.ActorUnavailableError("restarting\n\x1b[31mdetail", None)
        error = monitor_error(unavailable, "status", "the checkpoint monitor (actor 'm')")
        assert type(error) is MonitorUnavailableError
        assert "is restarting or unreachable" in str(error) and "retryable" in str(error)
        assert_one_line(error)
        timeout = monitor_error(ray.exceptions.GetTimeoutError("late"), "status", "m", 3.0)
        assert isinstance(timeout, MonitorTimeoutError) and isinstance(timeout, TimeoutError)
        assert "rpc_timeout=3.0 s" in str(timeout)
        plain = OSError("not from Ray")
        assert monitor_error(plain, "status", "m") is plain


class _FailsToStart(CheckpointMonitor):
    """A monitor whose constructor fails (its port taken, say) after the caller's checks."""

    def __init__(self, *args, **kwargs):
        raise OSError(98, "Address already in use")


class TestMonitorStart:
    def test_a_monitor_that_fails_to_start_is_one_line_naming_its_error(self, namespace, root):
        from obsckpt.monitor.lifecycle import start_actor
        from obsckpt.options import MonitorOptions

        options = MonitorOptions(namespace=namespace, default_local_dir=str(root))
        with pytest.raises(MonitorCallError) as info:
            start_actor(_FailsToStart, options, max_restarts=0)
        assert_one_line(info.value)
        assert str(info.value).endswith(
            f"for checkpoint root {str(root)!r} failed to start: "
            "OSError: [Errno 98] Address already in use"
        ), info.value
        assert isinstance(info.value.__cause__, ray.exceptions.RayActorError)


class TestIdentity:
    """A save's identity is real: Ray's node and job ids, else this host and pid (logged once)."""

    def test_inside_ray_the_node_and_job_ids(self, ray_cluster):
        ctx = ray.get_runtime_context()
        assert ray_identity() == (ctx.get_node_id(), ctx.get_job_id())

    def test_outside_ray_host_and_pid_with_one_warning(self):
        code = (
            "import os, socket; from obsckpt.monitor_link import ray_identity; "
            "a = ray_identity(); b = ray_identity(); "
            "assert a == b == (f'host:{socket.gethostname()}', f'pid:{os.getpid()}'), a"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        assert out.stderr.count("Ray is not initialized in this process") == 1, out.stderr


class TestWatchedWaits:
    """A wait with no bound logs, at intervals, what it waits for and for how long."""

    def test_wait_watched_warns_each_interval_and_honours_its_timeout(self, caplog):
        calls = []

        def wait(seconds):
            calls.append(seconds)
            return len(calls) == 3

        with caplog.at_level(logging.WARNING, logger="obsckpt"):
            assert wait_watched(wait, None, lambda: "slot 'x' (step 1)", warn_every=0.01)
        assert calls == [0.01] * 3
        assert caplog.text.count("still waiting for slot 'x' (step 1) after") == 2
        assert not wait_watched(lambda s: False, 0.05, lambda: "y", warn_every=0.02)

    def test_a_join_and_wait_all_without_bound_name_the_slot_and_step(
        self, namespace, root, caplog
    ):
        monitor = make_monitor(namespace, root, strategy=SaveStrategy.UNRESTRICTED)
        coord = CheckpointCoordinator(monitor, rank=0, stall_warning_s=0.2)
        release = threading.Event()
        coord.save_async("model", lambda: release.wait(60), 1)
        with caplog.at_level(logging.WARNING, logger="obsckpt"):
            second = threading.Thread(target=coord.save_async, args=("model", lambda: None, 2))
            second.start()
            wait_for(lambda: "its save of step 2 waits" in caplog.text, what="a join warning")
            assert "still waiting for slot 'model' to finish its save of step 1" in caplog.text
            threading.Timer(0.6, release.set).start()
            coord.wait_all()  # no timeout: watched while step 1's save is stuck
            assert "1 of 1 saves in wait_all: 'model' (step 1)" in caplog.text
            second.join(30)
            coord.wait_all(timeout=30)
        assert coord.pending_errors() == []

    def test_stall_warning_must_be_positive(self, namespace, root):
        with pytest.raises(ValueError, match=r"stall_warning_s must be positive seconds, got 0"):
            CheckpointCoordinator(make_monitor(namespace, root), stall_warning_s=0)
        with pytest.raises(ValueError, match=r"stall_timeout_s must be positive seconds or None"):
            CheckpointCoordinator(make_monitor(namespace, root), stall_timeout_s=-1)

    def test_a_stuck_save_bounds_the_join_and_wait_all_by_stall_timeout(
        self, namespace, root, caplog
    ):
        """Under save_timeout=None a save runs as long as it takes, but the waits on it
        end after stall_timeout_s, naming the slot, the step and the time waited; the
        save that could not start fails its own step instead of waiting for good."""
        monitor = make_monitor(namespace, root, strategy=SaveStrategy.UNRESTRICTED)
        coord = CheckpointCoordinator(monitor, rank=0, stall_warning_s=0.1, stall_timeout_s=0.5)
        release = threading.Event()
        coord.save_async("model", lambda: release.wait(60), 1)
        coord.link.register_thread_count(2, checkpoint_thread_count=1)

        with caplog.at_level(logging.WARNING, logger="obsckpt"):
            with pytest.raises(SaveTimeoutError) as joined:
                coord.save_async("model", lambda: None, 2)
        assert_one_line(joined.value)
        assert re.search(
            r"slot 'model' is still busy with step 1 after 0\.\d s \(stall_timeout_s\)",
            str(joined.value),
        ), joined.value
        assert "(gives up after 0 s)" in caplog.text or "(gives up after 1 s)" in caplog.text
        status = ray.get(monitor.status.remote())
        assert [f["step"] for f in status["failed"]] == [2]
        assert 2 not in [p["step"] for p in status["pending"]]

        with pytest.raises(SaveTimeoutError) as waited:
            coord.wait_all()
        assert (
            "0 of 1 saves finished after 0.5 s (stall_timeout_s); still running: 'model' (step 1)"
            in str(waited.value)
        )
        release.set()
        coord.wait_all(timeout=30)  # step 1's save ended: nothing is left to raise

    def test_a_wait_for_a_stuck_prepare_is_bounded(self, namespace, root, monkeypatch):
        from obsckpt.staging import StagingBuffers

        gate = threading.Event()
        real = StagingBuffers.prepare

        def held(self, state_dict):
            gate.wait(30)
            return real(self, state_dict)

        monkeypatch.setattr(StagingBuffers, "prepare", held)
        coord = CheckpointCoordinator(
            make_monitor(namespace, root), rank=0, stall_warning_s=0.1, stall_timeout_s=0.3
        )
        state = {"w": torch.ones(8)}
        first = coord.prepare("model", state, background=True)
        with pytest.raises(
            WaitTimeoutError,
            match=r"the prepare\(\) of slot 'model' was still running after 0\.3 s",
        ):
            coord.prepare("model", state)
        gate.set()
        first.result(30)
        coord.prepare("model", state)  # the slot's prepare ended: no wait now
        coord.close()


def test_errors_are_exported():
    import obsckpt

    for name in ("SavePathError", "MonitorUnavailableError", "MonitorCallError"):
        assert issubclass(getattr(obsckpt, name), ObsckptError)
    assert issubclass(SavePathError, ValueError)
