"""CheckpointMonitor and CheckpointCoordinator on a real local Ray, real files, real scrapes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import pytest
import ray
import torch
from metrics_helpers import scrape, value
from workers import SaveWorker

from obsckpt import (
    CheckpointCoordinator,
    CheckpointDirError,
    CheckpointMonitor,
    SaveError,
    SaveStrategy,
    SaveTimeoutError,
)
from obsckpt.monitor.telemetry import file_sd_root_label
from obsckpt.store import layout, reader
from obsckpt.telemetry.metrics import METRICS


def make_monitor(namespace, root, strategy=SaveStrategy.UNRESTRICTED, **kw):
    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=strategy,
        default_local_dir=str(root),
        metrics_port=kw.pop("metrics_port", 0),
        metrics_host="127.0.0.1",
        **kw,
    )
    ray.get(monitor.status.remote())  # created and answering
    return monitor


def submit(monitor, step, *, is_state_dict=False, sd=0, ck=0):
    asyncio.run(
        CheckpointCoordinator(monitor).register_and_monitor(
            step,
            is_state_dict=is_state_dict,
            state_dict_thread_count=sd,
            checkpoint_thread_count=ck,
        )
    )


def wait_for(predicate, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := predicate():
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def root(tmp_path):
    return tmp_path / "ckpt"


class TestCommitGating:
    """The iteration file names a step only once every registered save of it finished."""

    def test_full_checkpoint_with_two_ranks_and_two_slots(self, namespace, root):
        monitor = make_monitor(namespace, root)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]
        ray.get([w.save.remote(str(root), 1, ["model", "optim"], gated=True) for w in workers])
        submit(monitor, 1, ck=4)
        gates = [(w, slot) for w in workers for slot in ("model", "optim")]
        for w, slot in gates[:-1]:
            ray.get(w.release.remote(slot, 1))
        wait_for(
            lambda: ray.get(monitor.status.remote())["pending"][0]["finished"] == 3,
            what="three finishes",
        )
        assert reader.read_iteration(root, "checkpoint") is None
        w, slot = gates[-1]
        ray.get(w.release.remote(slot, 1))
        assert ray.get([w.wait.remote() for w in workers]) == [None, None]
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, what="commit of step 1")
        assert reader.read_iteration(root, "state_dict") == 1
        manifest = reader.read_manifest(layout.step_dir(root, 1))
        assert sorted(r.path for r in manifest) == sorted(
            f"actor/{slot}_rank_{rank}.pt" for slot in ("model", "optim") for rank in range(2)
        )
        assert reader.verify_step(layout.step_dir(root, 1)) == []
        # The pointer is swapped before the monitor closes the step's record.
        status = wait_for(
            lambda: (s := ray.get(monitor.status.remote()))["pending"] == [] and s,
            what="step 1's record closed",
        )
        assert status["in_flight"] == []

    def test_state_dict_only_step_leaves_checkpoint_file_alone(self, namespace, root):
        monitor = make_monitor(namespace, root)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]
        ray.get([w.save.remote(str(root), 3, ["model"], is_state_dict=True) for w in workers])
        submit(monitor, 3, is_state_dict=True, sd=2)
        assert ray.get([w.wait.remote() for w in workers]) == [None, None]
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 3, what="state dict commit")
        assert reader.read_iteration(root, "checkpoint") is None
        assert not (root / "latest_checkpointed_iteration.txt").exists()

    def test_snapshot_save_through_ray_is_loadable_and_unaffected_by_mutation(
        self, namespace, root
    ):
        monitor = make_monitor(namespace, root)
        worker = SaveWorker.remote(namespace, 0)
        path = root / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt"
        ray.get(worker.save_state_dict.remote(str(path), 2, 7.0))
        submit(monitor, 2, is_state_dict=True, sd=1)
        assert ray.get(worker.wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 2, what="commit")
        loaded = torch.load(path)
        assert torch.equal(loaded["w"], torch.full((256, 256), 7.0)) and loaded["step"] == 2
        assert reader.verify_step(layout.step_dir(root, 2)) == []


class TestParts:
    """Every rank's save is one part of a single save: each is reported, the step waits for all."""

    def test_a_rank_that_comes_after_the_commit_writes_nothing(self, namespace, root):
        """Ranks that check "already committed?" apart can disagree; admission decides for all.

        Rank 1 saves its part of step 4's state dict after the step was committed
        (its check ran before the commit): with unless_committed the monitor
        refuses to admit it, so the committed shard is not rewritten, and the
        same rank's part of the next, open step is written and counted.
        """
        monitor = make_monitor(namespace, root)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]

        def shard(step, rank):
            return str(root / f"global_step_{step}" / "actor" / f"model_rank_{rank}.pt")

        for rank, w in enumerate(workers):
            ray.get(w.save_state_dict.remote(shard(4, rank), 4, 1.0, part=rank, parts=2))
        submit(monitor, 4, is_state_dict=True, sd=1)
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 4, what="commit of step 4")
        wait_for(lambda: ray.get(monitor.status.remote())["pending"] == [], what="step 4 closed")
        committed = open(shard(4, 1), "rb").read()
        resaves = ray.get(monitor.status.remote())["resaves"]

        late = workers[1].save_state_dict.remote(
            shard(4, 1), 4, 2.0, part=1, parts=2, unless_committed=True, overlap=True
        )
        assert ray.get(late) is True  # its overlapped copy still ended: the slot is free
        assert ray.get(workers[1].wait.remote()) is None  # skipped is not a failure
        assert open(shard(4, 1), "rb").read() == committed
        assert reader.verify_step(layout.step_dir(root, 4)) == []
        status = ray.get(monitor.status.remote())
        assert status["resaves"] == resaves + 1
        assert status["pending"] == [] and status["failed"] == [] and status["in_flight"] == []

        for rank, w in enumerate(workers):
            ray.get(
                w.save_state_dict.remote(
                    shard(5, rank), 5, 3.0, part=rank, parts=2, unless_committed=True
                )
            )
        submit(monitor, 5, is_state_dict=True, sd=1)
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 5, what="commit of step 5")
        assert torch.equal(torch.load(shard(5, 1))["w"], torch.full((256, 256), 3.0))

    def test_each_part_reported_and_leased_the_save_counted_once(self, namespace, root):
        monitor = make_monitor(namespace, root)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]
        for w in workers:
            ray.get(w.save.remote(str(root), 1, ["model"], is_state_dict=True, gated=True, parts=2))
        submit(monitor, 1, is_state_dict=True, sd=1)  # one save per step, as Trinity registers
        wait_for(lambda: len(ray.get(monitor.status.remote())["in_flight"]) == 2, what="admission")
        s = scrape(monitor)
        assert value(s, "obsckpt_saves_in_flight", kind="state_dict") == 2  # one per part
        in_flight = ray.get(monitor.status.remote())["in_flight"]
        assert sorted((t["rank"], t["part"], t["parts"]) for t in in_flight) == [
            (0, 0, 2),
            (1, 1, 2),
        ]
        ray.get(workers[0].release.remote("model", 1))
        assert ray.get(workers[0].wait.remote()) is None

        def open_parts():
            [pending] = ray.get(monitor.status.remote())["pending"]
            return pending["open_parts"]

        wait_for(lambda: open_parts()["model"]["finished"] == [0], what="part 0 finished")
        assert reader.read_iteration(root, "state_dict") is None  # part 1 still runs
        ray.get(workers[1].release.remote("model", 1))
        assert ray.get(workers[1].wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "state_dict") == 1, what="commit of step 1")
        manifest = reader.read_manifest(layout.step_dir(root, 1))
        assert sorted(r.path for r in manifest) == [
            "actor/model_rank_0.pt",
            "actor/model_rank_1.pt",
        ]
        assert reader.verify_step(layout.step_dir(root, 1)) == []
        s = scrape(monitor)
        assert value(s, "obsckpt_saves_total", slot="model", kind="state_dict", result="ok") == 2
        assert value(s, "obsckpt_saves_in_flight", kind="state_dict") == 0

    def test_a_killed_rank_fails_the_step_through_its_part_lease(self, namespace, root):
        monitor = make_monitor(namespace, root, lease_timeout_s=2.0)
        alive, doomed = SaveWorker.remote(namespace, 0), SaveWorker.remote(namespace, 1)
        ray.get(
            doomed.save.remote(str(root), 1, ["model"], is_state_dict=True, gated=True, parts=2)
        )
        ray.get(alive.save.remote(str(root), 1, ["model"], is_state_dict=True, parts=2))
        submit(monitor, 1, is_state_dict=True, sd=1)
        assert ray.get(alive.wait.remote()) is None
        wait_for(lambda: len(ray.get(monitor.status.remote())["in_flight"]) == 1, what="part 0")
        ray.kill(doomed)  # no finish, no failure report, no more heartbeats
        wait_for(lambda: ray.get(monitor.status.remote())["failed"] != [], what="lease expiry")
        [failed] = ray.get(monitor.status.remote())["failed"]
        assert failed["step"] == 1 and "sent no heartbeat" in failed["error"]
        assert reader.read_iteration(root, "state_dict") is None

    def test_conflicting_part_counts_fail_the_step_with_a_clear_error(self, namespace, root):
        monitor = make_monitor(namespace, root)
        first, second = SaveWorker.remote(namespace, 0), SaveWorker.remote(namespace, 1)
        ray.get(first.save.remote(str(root), 1, ["model"], is_state_dict=True, parts=2))
        assert ray.get(first.wait.remote()) is None
        ray.get(second.save.remote(str(root), 1, ["model"], is_state_dict=True, parts=3))
        error = ray.get(second.wait.remote())
        assert "SaveError" in error and "part 1 says the save has 3 parts" in error
        submit(monitor, 1, is_state_dict=True, sd=1)
        status = ray.get(monitor.status.remote())
        [failed] = status["failed"]
        assert "earlier part said 2" in failed["error"]
        assert status["in_flight"] == [] and status["pending"] == []
        assert value(scrape(monitor), "obsckpt_step_failures_total", kind="state_dict") == 1
        assert reader.read_iteration(root, "state_dict") is None

    def test_bad_parts_fail_in_the_caller(self, namespace, root):
        coord = CheckpointCoordinator(make_monitor(namespace, root), rank=0)
        with pytest.raises(ValueError, match=r"part must be an integer in \[0, parts=2\).* got 2"):
            coord.save_async("model", lambda: None, 1, part=2, parts=2)
        with pytest.raises(ValueError, match="parts must be a positive integer.* got None"):
            coord.save_sync(lambda: None, 1, part=0)
        assert ray.get(coord.monitor.status.remote())["in_flight"] == []


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in a mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


class TestSavedPaths:
    """``paths=`` files and directories are made durable and checksummed by the saving process."""

    def test_a_directory_stands_for_every_file_under_it(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        hf = layout.step_dir(root, 5) / "actor" / "huggingface"
        payload = {"model.safetensors": os.urandom(70_000), "sub/tokenizer.json": b"{}"}

        def save() -> None:
            for rel, data in payload.items():
                (hf / rel).parent.mkdir(parents=True, exist_ok=True)
                (hf / rel).write_bytes(data)
            (hf / "model.safetensors.tmp.123.0123abcd").write_bytes(b"unfinished")

        coord.save_async("hf_model", save, 5, paths=[hf])
        coord.wait_all(timeout=60)
        submit(monitor, 5, ck=1)
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 5, what="step 5 committed")
        records = {r.path: r for r in reader.read_manifest(layout.step_dir(root, 5))}
        for rel, data in payload.items():
            rec = records[f"actor/huggingface/{rel}"]
            assert (rec.size, rec.crc32) == (len(data), reader.crc32(data))
        # Reported by the save (the temp file is not part of it), not found by the monitor.
        reported = sum(len(d) for d in payload.values())
        saved = value(
            scrape(monitor), "obsckpt_save_bytes_total", slot="hf_model", kind="checkpoint"
        )
        assert saved == reported

    def test_a_named_path_the_save_did_not_write_fails_the_save(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        missing = layout.step_dir(root, 6) / "never.pt"
        with pytest.raises(FileNotFoundError, match=r"never.pt is named in paths= but the save"):
            coord.save_sync(lambda: None, 6, paths=[missing])
        coord.wait_all(timeout=10)  # raised once, by save_sync
        submit(monitor, 6, ck=1)
        wait_for(lambda: ray.get(monitor.status.remote())["failed"], what="step 6 failed")
        assert reader.read_iteration(root, "checkpoint") is None

    def test_a_single_path_instead_of_a_list_is_refused_before_anything_runs(self, namespace, root):
        coord = CheckpointCoordinator(make_monitor(namespace, root), rank=0)
        ran = []
        with pytest.raises(ValueError, match=r"single path 'x.pt'; pass \[path\]"):
            coord.save_async("model", lambda: ran.append(1), 1, paths="x.pt")
        assert ran == [] and ray.get(coord.monitor.status.remote())["in_flight"] == []

    def test_one_file_written_by_two_saves_of_a_step_commits_as_it_is_on_disk(
        self, namespace, root
    ):
        """A state-dict save and a full checkpoint of one step write the same model file:
        both succeed, and the manifest holds the write that is on disk, whichever it is."""
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        for trial, value_ in enumerate((1.0, 2.0, 3.0)):
            step = 8 + trial
            path = layout.step_dir(root, step) / "actor" / "model_world_size_1_rank_0.pt"
            coord.save_state_dict_async("model", {"w": torch.full((1 << 20,), value_)}, path, step)
            coord.save_state_dict_async(
                "model_state_dict", {"w": torch.full((1 << 20,), -value_)}, path, step, True
            )
            coord.wait_all(timeout=60)
            submit(monitor, step, sd=1, ck=1)
            wait_for(
                lambda step=step: reader.read_iteration(root, "checkpoint") == step,
                what=f"step {step} committed",
            )
            assert reader.verify_step(layout.step_dir(root, step)) == []


class TestSaveOutcomes:
    """The trainer hears of every save that did not end well, when it asks, and at once."""

    def test_wait_all_raises_a_timed_out_save_without_waiting_for_it(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0, save_timeout=0.5)
        release = threading.Event()
        try:
            coord.save_async("model", lambda: release.wait(60), 1)
            t0 = time.monotonic()
            with pytest.raises(SaveTimeoutError, match=r"save_timeout=0.5"):
                coord.wait_all()  # no timeout: the save's own timeout ends the wait
            assert time.monotonic() - t0 < 15
        finally:
            release.set()
        # The stuck save returns later: reported once (as failed), raised once.
        coord.close(timeout=10)
        coord.wait_all(timeout=10)
        status = ray.get(monitor.status.remote())
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(1, "checkpoint")]

    def test_save_sync_raises_when_it_ran_past_save_timeout(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0, save_timeout=0.3)
        with pytest.raises(SaveTimeoutError, match=r"save_timeout=0.3"):
            coord.save_sync(lambda: time.sleep(1.0), 2)
        coord.wait_all(timeout=10)  # raised once, by save_sync

    def test_save_sync_raises_what_the_save_raised(self, namespace, root):
        """As a direct call of save_fn would (Trinity's save_sync): callers catch its type."""

        class DiskQuotaExceeded(OSError):
            pass

        def save() -> None:
            raise DiskQuotaExceeded("quota of /ckpt exceeded")

        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        with pytest.raises(DiskQuotaExceeded, match="quota of /ckpt exceeded") as raised:
            coord.save_sync(save, 7, name="megatron")
        [note] = raised.value.__notes__
        assert "'megatron' of step 7 (checkpoint) failed" in note and "the step fails" in note
        coord.wait_all(timeout=10)  # raised once, by save_sync
        submit(monitor, 7, ck=1)
        wait_for(lambda: ray.get(monitor.status.remote())["failed"], what="step 7 failed")

    def test_a_save_whose_report_is_lost_is_raised(self, namespace, root):
        """The save wrote its files but the monitor died before hearing of it: the step
        may never commit, so wait_all raises instead of returning as if all went well."""
        monitor = make_monitor(namespace, root, max_restarts=0)
        coord = CheckpointCoordinator(monitor, rank=0, rpc_timeout=10)
        release = threading.Event()
        coord.save_async("model", lambda: release.wait(60), 3)
        wait_for(lambda: ray.get(monitor.status.remote())["in_flight"], what="the save admitted")
        ray.kill(monitor, no_restart=True)

        def dead() -> bool:
            # ray.kill returns before the actor is gone: a report sent until then lands.
            try:
                ray.get(monitor.status.remote(), timeout=10)
            except ray.exceptions.RayActorError:
                return True
            return False

        wait_for(dead, what="the monitor gone")
        release.set()
        with pytest.raises(SaveError, match=r"finished, but reporting it to the monitor failed"):
            coord.wait_all(timeout=30)

    def test_close_frees_the_staging_of_saves_that_ended(self, namespace, root):
        """No idle save thread keeps the last snapshot (views of the arena) alive."""
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor, rank=0)
        state = {"w": torch.ones(8 << 20 >> 2)}
        path = layout.step_dir(root, 1) / "model.pt"
        coord.save_state_dict_async("model", state, path, 1)
        coord.wait_all(timeout=60)
        address = coord._staging["model"].arena.address
        assert _mapped(address)
        coord.close(timeout=30)
        assert not _mapped(address), "the slot's arena is still mapped after close()"


@pytest.mark.parametrize("strategy", list(SaveStrategy))
class TestStrategies:
    """Every strategy admits with Trinity's meaning, and a failed save never deadlocks it."""

    def test_admission_and_failure_recovery(self, namespace, root, strategy):
        monitor = make_monitor(namespace, root, strategy)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]
        # Step 1: one save of rank 0 fails; every other save still runs.
        ray.get(
            [
                w.save.remote(str(root), 1, ["model", "optim"], sleep=0.15, fail_slots=fails)
                for w, fails in zip(workers, [("optim",), ()], strict=True)
            ]
        )
        submit(monitor, 1, ck=4)
        errors = ray.get([w.wait.remote() for w in workers])
        assert errors[1] is None
        assert "SaveError" in errors[0] and "'optim' of step 1" in errors[0]
        assert "No space left on device" in errors[0]
        # Step 2 commits normally after the failure.
        ray.get([w.save.remote(str(root), 2, ["model", "optim"], sleep=0.15) for w in workers])
        submit(monitor, 2, ck=4)
        assert ray.get([w.wait.remote() for w in workers]) == [None, None]
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 2, what="commit of step 2")
        status = ray.get(monitor.status.remote())
        assert [(f["step"], f["kind"]) for f in status["failed"]] == [(1, "checkpoint")]
        assert status["in_flight"] == [] and status["admission_waiting"] == 0
        # What overlapped tells which strategy ran.
        intervals = []
        for rank, w in enumerate(workers):
            intervals += [(rank, *iv) for iv in ray.get(w.get_intervals.remote())]
        # monotonic clocks of two processes on one machine are comparable
        overlaps = {
            (a[0] == b[0])
            for i, a in enumerate(intervals)
            for b in intervals[i + 1 :]
            if a[3] < b[4] and b[3] < a[4]
        }
        if strategy is SaveStrategy.SINGLE_THREAD:
            assert overlaps == set()
        elif strategy is SaveStrategy.SINGLE_PROCESS:
            assert False not in overlaps  # never two processes at once
        else:  # one node: SINGLE_NODE admits both ranks together, like UNRESTRICTED
            assert False in overlaps
        samples = scrape(monitor)
        wait_hist = value(
            samples, "obsckpt_save_admission_wait_seconds_count", strategy=strategy.value
        )
        assert wait_hist == 8


class TestLeases:
    """A rank that dies mid-save stops its heartbeats: its save fails and admission frees up."""

    def test_killed_rank_does_not_block_single_thread_admission(self, namespace, root):
        monitor = make_monitor(namespace, root, SaveStrategy.SINGLE_THREAD, lease_timeout_s=2.0)
        doomed, survivor = SaveWorker.remote(namespace, 0), SaveWorker.remote(namespace, 1)
        ray.get(doomed.save.remote(str(root), 1, ["model"], gated=True))
        wait_for(
            lambda: ray.get(monitor.status.remote())["in_flight"] != [], what="admission of step 1"
        )
        ray.kill(doomed)  # SIGKILL: no finish, no failure report, no more heartbeats
        ray.get(survivor.save.remote(str(root), 2, ["model"]))
        submit(monitor, 2, ck=1)
        assert ray.get(survivor.wait.remote(timeout=60)) is None
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 2, what="commit of step 2")
        status = wait_for(
            lambda: (s := ray.get(monitor.status.remote()))["pending"] == [] and s,
            what="step 2's record closed",
        )
        [failed] = status["failed"]
        assert failed["step"] == 1 and "sent no heartbeat" in failed["error"]
        assert status["in_flight"] == []
        s = scrape(monitor)
        assert value(s, "obsckpt_saves_total", slot="model", kind="checkpoint", result="error") == 1
        assert value(s, "obsckpt_step_failures_total", kind="checkpoint") == 1

    def test_slow_save_with_heartbeats_is_not_expired(self, namespace, root):
        monitor = make_monitor(namespace, root, lease_timeout_s=1.0)
        worker = SaveWorker.remote(namespace, 0)
        ray.get(worker.save.remote(str(root), 1, ["model"], sleep=3.0))
        submit(monitor, 1, ck=1)
        assert ray.get(worker.wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, what="commit of step 1")
        assert ray.get(monitor.status.remote())["failed"] == []

    def test_a_paused_monitor_does_not_blame_the_ranks(self, namespace, root):
        """While the monitor's own process is stopped (a debugger, SIGSTOP, a long GC
        pause) the heartbeats it misses wait in its queue: a lease is judged on the
        time the monitor was running, so a healthy save is not failed when it resumes."""
        monitor = make_monitor(namespace, root, lease_timeout_s=1.0)
        pid = ray.get(monitor.__ray_call__.remote(lambda self: os.getpid()))
        worker = SaveWorker.remote(namespace, 0)
        ray.get(worker.save.remote(str(root), 1, ["model"], sleep=4.0))
        submit(monitor, 1, ck=1)
        wait_for(
            lambda: ray.get(monitor.status.remote())["in_flight"] != [], what="admission of step 1"
        )
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2.5)  # over two leases without the monitor running
        finally:
            os.kill(pid, signal.SIGCONT)
        assert ray.get(worker.wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, what="commit of step 1")
        assert ray.get(monitor.status.remote())["failed"] == []

    def test_bad_lease_timeout(self, namespace, root):
        with pytest.raises(
            ValueError, match="lease_timeout_s must be positive seconds or None, got 0"
        ):
            CheckpointMonitor(default_local_dir=str(root), metrics_port=None, lease_timeout_s=0)


class TestRestart:
    """A fresh monitor on an existing directory picks up the committed steps."""

    def test_fresh_monitor_recovers_and_refuses_older_steps(self, ray_cluster, root):
        ns1, ns2 = f"a-{os.getpid()}-{time.time_ns()}", f"b-{os.getpid()}-{time.time_ns()}"
        monitor = make_monitor(ns1, root)
        worker = SaveWorker.remote(ns1, 0)
        ray.get(worker.save.remote(str(root), 5, ["model"]))
        submit(monitor, 5, ck=1)
        assert ray.get(worker.wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 5, what="commit")
        # A save of step 6 that never finishes leaves an uncommitted step dir.
        ray.get(worker.save.remote(str(root), 6, ["model"], gated=True))
        ray.kill(monitor, no_restart=True)
        (root / "global_step_6" / "actor").mkdir(parents=True, exist_ok=True)

        fresh = make_monitor(ns2, root)
        status = ray.get(fresh.status.remote())
        assert status["latest"] == {"checkpoint": 5, "state_dict": 5}
        assert [a["step"] for a in status["abandoned"]] == [6]
        assert value(scrape(fresh), "obsckpt_latest_step", kind="checkpoint") == 5
        ray.get(fresh.monitor_step.remote(4, False))  # an older step: ignored, logged
        assert reader.read_iteration(root, "checkpoint") == 5
        worker2 = SaveWorker.remote(ns2, 0)
        ray.get(worker2.save.remote(str(root), 7, ["model"]))
        submit(fresh, 7, ck=1)
        assert ray.get(worker2.wait.remote()) is None
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 7, what="commit of step 7")
        ray.kill(worker)


class TestMetrics:
    """Measurements reach /metrics; every metric exists from the first scrape."""

    @pytest.mark.needs_promtool
    def test_all_metrics_exported_from_start_and_promtool_is_happy(self, namespace, root):
        monitor = make_monitor(namespace, root)
        address = ray.get(monitor.metrics_address.remote())
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for spec in METRICS:
            assert f"# TYPE {spec.name} {spec.type}" in text, spec.name
        samples = scrape(monitor)
        for kind in ("checkpoint", "state_dict"):
            assert value(samples, "obsckpt_pending_steps", kind=kind) == 0
            assert value(samples, "obsckpt_saves_in_flight", kind=kind) == 0
            assert value(samples, "obsckpt_step_failures_total", kind=kind) == 0
        promtool = shutil.which("promtool")
        assert promtool, "promtool is required (Debian package prometheus)"
        result = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert result.returncode == 0 and result.stdout.strip() == "", result.stdout + result.stderr

    def test_worker_measurements_are_scraped(self, namespace, root):
        monitor = make_monitor(namespace, root)
        workers = [SaveWorker.remote(namespace, rank) for rank in range(2)]
        ray.get([w.save.remote(str(root), 1, ["model"], fail_slots=()) for w in workers])
        submit(monitor, 1, ck=2)
        ray.get([w.wait.remote() for w in workers])
        # A second save of the same slot joins the first: a join wait is recorded.
        ray.get(workers[0].save.remote(str(root), 2, ["model"], sleep=0.2))
        ray.get(workers[0].save.remote(str(root), 3, ["model"], fail_slots=("model",)))
        ray.get(workers[0].wait.remote())
        wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, what="commit")
        s = scrape(monitor)
        assert value(s, "obsckpt_saves_total", slot="model", kind="checkpoint", result="ok") == 3
        assert value(s, "obsckpt_saves_total", slot="model", kind="checkpoint", result="error") == 1
        assert value(s, "obsckpt_save_bytes_total", slot="model", kind="checkpoint") > 0
        assert value(s, "obsckpt_save_duration_seconds_count", slot="model", kind="checkpoint") == 4
        assert value(s, "obsckpt_thread_join_wait_seconds_count", slot="model") == 4
        assert value(s, "obsckpt_thread_join_wait_seconds_sum", slot="model") >= 0.1
        assert value(s, "obsckpt_rank_last_save_duration_seconds", rank="1", slot="model") > 0
        assert value(s, "obsckpt_commit_lag_seconds_count", kind="checkpoint") == 1
        assert value(s, "obsckpt_latest_step", kind="checkpoint") == 1
        assert value(s, "obsckpt_last_commit_timestamp_seconds", kind="checkpoint") > 1e9
        assert value(s, "obsckpt_saves_in_flight", kind="checkpoint") == 0
        # Steps 2 and 3 were started but never submitted: pending, with a start time.
        assert value(s, "obsckpt_pending_steps", kind="checkpoint") == 1  # step 2 (3 failed)
        assert (
            value(s, "obsckpt_oldest_pending_step_start_timestamp_seconds", kind="checkpoint") > 1e9
        )
        assert value(s, "obsckpt_step_failures_total", kind="checkpoint") == 1

    def test_file_sd_names_the_endpoint(self, namespace, root, tmp_path):
        # The root as a user may write it (a trailing slash); its entry names the root as
        # file_sd_root_label predicts, which a starter knows before the monitor answers.
        sd_path = tmp_path / "sd" / "obsckpt.json"
        monitor = make_monitor(namespace, f"{root}/", file_sd_path=str(sd_path))
        address = ray.get(monitor.metrics_address.remote())
        targets = json.loads(sd_path.read_text())
        labels = {"obsckpt_namespace": namespace, "__meta_obsckpt_root": str(root)}
        assert targets == [{"targets": [address], "labels": labels}]
        assert file_sd_root_label(f"{root}/") == str(root)
        assert file_sd_root_label("s3://bucket//run/") == "s3://bucket/run"

    def test_two_jobs_sharing_a_file_sd_file_are_both_targets(self, namespace, root, tmp_path):
        # OBSCKPT_FILE_SD_PATH set for a whole cluster: each job's monitor keeps its entry.
        sd_path = tmp_path / "sd" / "obsckpt.json"
        first = make_monitor(namespace, root, file_sd_path=str(sd_path))
        second = make_monitor(f"{namespace}-b", tmp_path / "b", file_sd_path=str(sd_path))
        addresses = [ray.get(m.metrics_address.remote()) for m in (first, second)]
        groups = json.loads(sd_path.read_text())
        assert [g["targets"] for g in groups] == [[a] for a in addresses]
        assert groups[1]["labels"]["obsckpt_namespace"] == f"{namespace}-b"
        ray.get(first.shutdown.remote())
        assert [g["targets"] for g in json.loads(sd_path.read_text())] == [addresses[1:]]
        ray.kill(second)

    def test_shutdown_withdraws_its_file_sd_target(self, namespace, root, tmp_path):
        # A closed endpoint left in file_sd stays a target, and another process may
        # later get the port and be scraped under this job's label.
        sd_path = tmp_path / "sd" / "obsckpt.json"
        monitor = make_monitor(namespace, root, file_sd_path=str(sd_path))
        ray.get(monitor.shutdown.remote())
        assert json.loads(sd_path.read_text()) == []
        assert ray.get(monitor.metrics_address.remote()) is None

    def test_shutdown_keeps_a_newer_monitor_s_file_sd_target(self, namespace, root, tmp_path):
        sd_path = tmp_path / "obsckpt.json"
        monitor = make_monitor(namespace, root, file_sd_path=str(sd_path))
        newer = [{"targets": ["10.0.0.9:9400"], "labels": {"obsckpt_namespace": "next"}}]
        sd_path.write_text(json.dumps(newer))
        ray.get(monitor.shutdown.remote())
        assert json.loads(sd_path.read_text()) == newer

    def test_port_in_use_keeps_the_job_running(self, namespace, root):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = busy.getsockname()[1]
            monitor = make_monitor(namespace, root, metrics_port=port)
            assert ray.get(monitor.metrics_address.remote()) is None
            status = ray.get(monitor.status.remote())
            assert f"metrics port {port}" in status["metrics"]["error"]
            assert "already in use" in status["metrics"]["error"]
            worker = SaveWorker.remote(namespace, 0)
            ray.get(worker.save.remote(str(root), 1, ["model"]))
            submit(monitor, 1, ck=1)
            assert ray.get(worker.wait.remote()) is None
            wait_for(lambda: reader.read_iteration(root, "checkpoint") == 1, what="commit")


class TestBadInput:
    """Bad arguments get a clear error naming the value; nothing is committed."""

    def test_a_running_monitor_of_another_root_is_refused(self, namespace, tmp_path):
        first = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=tmp_path / "a")
        again = CheckpointMonitor.get_actor(
            namespace=namespace, default_local_dir=str(tmp_path / "x" / ".." / "a")
        )
        assert ray.get(again.status.remote())["root"] == str(tmp_path / "a")
        with pytest.raises(ValueError) as err:
            CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=tmp_path / "b")
        msg = str(err.value)
        assert str(tmp_path / "a") in msg and str(tmp_path / "b") in msg
        assert "namespace" in msg
        ray.kill(first)

    def test_a_relative_root_is_the_callers(self, namespace, tmp_path, monkeypatch):
        monkeypatch.chdir(tmp_path)
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir="ckpt")
        assert ray.get(monitor.checkpoint_root.remote()) == str(tmp_path / "ckpt")
        ray.kill(monitor)

    def test_unwritable_directory_is_refused_at_creation(self, namespace):
        with pytest.raises(CheckpointDirError, match="/proc/obsckpt"):
            CheckpointMonitor.get_actor(namespace=namespace, default_local_dir="/proc/obsckpt")

    @pytest.mark.parametrize("port", [-1, 70000, "9400", True])
    def test_bad_metrics_port(self, namespace, root, port):
        with pytest.raises(ValueError, match="metrics_port"):
            CheckpointMonitor.get_actor(
                namespace=namespace, default_local_dir=str(root), metrics_port=port
            )

    def test_bad_strategy(self, namespace, root):
        with pytest.raises(ValueError, match="save_strategy must be one of .* got 'fast'"):
            CheckpointMonitor.get_actor(
                namespace=namespace, default_local_dir=str(root), save_strategy="fast"
            )

    def test_bad_slot_and_step_fail_in_the_caller(self, namespace, root):
        monitor = make_monitor(namespace, root)
        coord = CheckpointCoordinator(monitor)
        with pytest.raises(ValueError, match=r"slot name '\.\./x'"):
            coord.save_async("../x", lambda: None, 1)
        with pytest.raises(ValueError, match="got -3"):
            coord.save_async("model", lambda: None, -3)
        with pytest.raises(ValueError, match=r"got 2\.5"):
            asyncio.run(coord.register_and_monitor(2.5))
        assert reader.read_iteration(root, "checkpoint") is None
