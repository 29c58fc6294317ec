"""Trainer ranks killed with SIGKILL at random moments while they save.

Each trial is one job: a monitor and ``WORLD`` rank actors on the local Ray
save steps with ``CheckpointCoordinator.save_state_dict_async``; a few steps
commit, then during a later step's saves one rank is killed at a random
moment. The job is then "restarted" (a fresh monitor on the same root, fresh
ranks) and resumes from the newest committed step.

``OBSCKPT_RELIABILITY_TRIALS`` sets the number of trials (default 2).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
import uuid

from reliability_helpers import (
    assert_root_consistent,
    rank_path,
    rank_worker_class,
    report,
    scrape,
    trials,
    wait_for,
)

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt.store import layout, reader

WORLD = 2
NUMEL = 8 << 20  # 32 MiB per rank file: long enough to be killed mid-write


def _submit(monitor, step: int) -> None:
    trainer = CheckpointCoordinator(monitor)
    asyncio.run(trainer.register_and_monitor(step, checkpoint_thread_count=WORLD))


def _latest(ray, monitor) -> int | None:
    return ray.get(monitor.status.remote())["latest"]["checkpoint"]


class Job:
    """A monitor and WORLD ranks on one root; ranks that survive a restart are reused."""

    def __init__(self, ray, root: str) -> None:
        self.ray, self.root = ray, root
        self.worker_cls = rank_worker_class()
        self.monitor = None
        self.workers: list = [None] * WORLD
        self.pids: list[int | None] = [None] * WORLD

    def start(self) -> None:
        """(Re)start the job: a fresh monitor, fresh processes for ranks that died."""
        ns = f"kill-{uuid.uuid4().hex[:8]}"
        self.monitor = CheckpointMonitor.get_actor(namespace=ns, default_local_dir=self.root)
        for r, w in enumerate(self.workers):
            if w is None:
                self.workers[r] = self.worker_cls.remote(self.monitor, self.root, r, WORLD, NUMEL)
            else:
                self.ray.get(w.attach.remote(self.monitor))
        self.pids = self.ray.get([w.pid.remote() for w in self.workers])
        self.address = self.ray.get(self.monitor.metrics_address.remote())

    def stop_monitor(self) -> None:
        self.ray.kill(self.monitor, no_restart=True)

    def stop(self) -> None:
        for actor in (*self.workers, self.monitor):
            if actor is not None:
                self.ray.kill(actor, no_restart=True)

    def commit_step(self, step: int, timeout: float = 60.0) -> float:
        """Save and commit one step normally; returns seconds from save call to commit."""
        _submit(self.monitor, step)
        t0 = time.monotonic()
        self.ray.get([w.save.remote(step) for w in self.workers])
        errors = self.ray.get([w.wait.remote() for w in self.workers])
        assert errors == [None] * WORLD, errors
        wait_for(lambda: _latest(self.ray, self.monitor) == step, timeout, f"step {step} to commit")
        return time.monotonic() - t0

    def ok_saves(self) -> int:
        return int(scrape(self.address).total("obsckpt_saves_total", slot="model", result="ok"))


def run_trial(ray, job: Job, rng: random.Random) -> dict:
    """One trial on a started job: commit steps, kill a rank mid-step, check, restart, resume."""
    ray = job.ray
    root = job.root
    base = reader.read_iteration(root, "checkpoint") or 0
    ok_before = job.ok_saves()
    n_ok = rng.randint(1, 2)
    durations = [job.commit_step(s) for s in range(base + 1, base + n_ok + 1)]
    save_time = durations[-1]
    committed_before = base + n_ok

    # The step that loses a rank: register and submit it, start its saves, kill one rank.
    step = committed_before + 1
    victim = rng.randrange(WORLD)
    delay = rng.uniform(0.0, 1.2 * save_time)
    _submit(job.monitor, step)
    t_step = time.time()
    calls = [w.save.remote(step) for w in job.workers]
    time.sleep(delay)
    os.kill(job.pids[victim], signal.SIGKILL)
    survivors = [w for i, w in enumerate(job.workers) if i != victim]
    assert ray.get([w.wait.remote() for w in survivors]) == [None] * (WORLD - 1)
    try:
        ray.get(calls[victim], timeout=10)
    except Exception:  # noqa: BLE001 - the victim may die before its call returns
        pass
    job.workers[victim] = None

    time.sleep(0.5)  # let a notification sent just before the kill land
    # Whether the victim's save was reported decides whether the step may commit.
    finished_in_step = job.ok_saves() - ok_before - WORLD * n_ok
    # Read while no commit runs: a commit swaps the pointer before status() shows it.
    status = wait_for(
        lambda: (s := ray.get(job.monitor.status.remote()))["committing"] is None and s,
        30,
        "no commit running",
    )
    latest = status["latest"]["checkpoint"]
    on_disk = assert_root_consistent(root)
    assert on_disk["checkpoint"] == latest
    if finished_in_step == WORLD:
        outcome = "committed"  # killed after its save was reported
        wait_for(lambda: _latest(ray, job.monitor) == step, 30, f"step {step} to commit")
    else:
        # The killed rank never reported: the step must not commit, and it shows as a stall.
        outcome = "stalled"
        assert latest == committed_before, status
        pending = [p for p in status["pending"] if p["kind"] == "checkpoint"]
        assert [p["step"] for p in pending] == [step], status["pending"]
        assert pending[0]["finished"] == finished_in_step
        s = scrape(job.address)
        assert s.value("obsckpt_pending_steps", kind="checkpoint") == 1
        oldest = s.value("obsckpt_oldest_pending_step_start_timestamp_seconds", kind="checkpoint")
        assert t_step - 5 <= oldest <= time.time(), (oldest, t_step)
        assert s.value("obsckpt_latest_step", kind="checkpoint") == committed_before
        time.sleep(0.3)  # nothing moves while the rank is gone
        assert _latest(ray, job.monitor) == committed_before
        assert reader.read_iteration(root, "checkpoint") == committed_before

    victim_file = rank_path(root, step, victim, WORLD)
    in_place = victim_file.exists()
    tmp_left = (
        any(".tmp" in p.name for p in victim_file.parent.glob("*"))
        if victim_file.parent.exists()
        else False
    )
    job.stop_monitor()

    # The resumed job: a fresh monitor reads the root, ranks load the newest committed step.
    resumed_from = reader.read_iteration(root, "checkpoint")
    job.start()
    status = ray.get(job.monitor.status.remote())
    assert status["latest"]["checkpoint"] == resumed_from
    if resumed_from < step and layout.step_dir(root, step).exists():
        assert step in [a["step"] for a in status["abandoned"]], status["abandoned"]
    assert ray.get([w.resume.remote() for w in job.workers]) == [resumed_from] * WORLD
    job.commit_step(resumed_from + 1)
    assert assert_root_consistent(root)["checkpoint"] == resumed_from + 1
    assert ray.get([w.resume.remote() for w in job.workers]) == [resumed_from + 1] * WORLD
    return {
        "outcome": outcome,
        "finished_in_killed_step": finished_in_step,
        "victim_file_in_place": in_place,
        "victim_tmp_left": tmp_left,
        "delay_s": round(delay, 3),
        "save_time_s": round(save_time, 3),
        "killed_step": step,
        "resumed_from": resumed_from,
    }


class TestKilledRank:
    """A rank killed mid-save never leaves an iteration file naming a partial step;
    the stall is visible in metrics, and a restarted job resumes from the newest commit."""

    def test_sigkill_at_random_moments(self, ray_cluster, tmp_path):
        seed = int(os.environ.get("OBSCKPT_RELIABILITY_SEED", "0")) or random.randrange(1 << 30)
        rng = random.Random(seed)
        job = Job(ray_cluster, str(tmp_path / "root"))
        job.start()
        outcomes = []
        try:
            for i in range(trials(2)):
                try:
                    result = run_trial(ray_cluster, job, rng)
                except AssertionError as exc:
                    raise AssertionError(f"trial {i} (seed {seed}): {exc}") from exc
                report("kill", trial=i, seed=seed, **result)
                outcomes.append(result["outcome"])
        finally:
            job.stop()
        assert len(outcomes) == trials(2)


class TestLeftoversOfWritesCutShort:
    """A job's start removes obsckpt's own temp files and scratch directories that a
    killed writer left (older than the last commit), and touches nothing else."""

    def test_swept_at_start(self, tmp_path, caplog):
        from prometheus_client import CollectorRegistry

        root = tmp_path / "root"
        step = layout.step_dir(root, 1)
        (step / "actor").mkdir(parents=True)
        (step / "actor" / "model.pt").write_bytes(b"committed")
        old = time.time() - 3600
        leftovers = [
            root / "latest_checkpointed_iteration.txt.tmp.4242.0badf00d",  # a commit killed
            step / "manifest.json.tmp.4242.deadbeef",  # ... inside its manifest write
            step / "actor" / "optim.pt.tmp.77.12345678",  # a rank killed mid-write
        ]
        scratch = step / "actor" / "huggingface.tmp.77.abcdef01"  # an HF export cut short
        (scratch / "sub").mkdir(parents=True)
        (scratch / "sub" / "config.json").write_text("{}")
        kept = [
            step / "actor" / "optimizer.tmp",  # not a name obsckpt makes
            step / "actor" / "data.tmp.77",
            step / "actor" / "notes.tmp.77.NOTHEX00",
            root / "elsewhere" / "x.pt.tmp.77.12345678",  # not in a step directory
        ]
        for path in leftovers + kept:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"partial")
        for path in [*leftovers, scratch, *kept]:
            os.utime(path, (old, old))
        (root / "latest_checkpointed_iteration.txt").write_text("1\n")  # the last commit
        # A temp file newer than the last commit may belong to a save still running.
        recent = step / "actor" / "model.pt.tmp.99.87654321"
        recent.write_bytes(b"being written")

        registry = CollectorRegistry()
        with caplog.at_level(logging.INFO, logger="obsckpt.monitor"):
            m = CheckpointMonitor(default_local_dir=root, metrics_port=None, registry=registry)
        try:
            status = asyncio.run(m.status())
        finally:
            asyncio.run(m.shutdown())
        assert not any(p.exists() for p in [*leftovers, scratch])
        assert all(p.exists() for p in [*kept, recent, step / "actor" / "model.pt"])
        assert status["leftovers_removed"] == len(leftovers) + 1
        assert registry.get_sample_value("obsckpt_leftovers_removed_total") == len(leftovers) + 1
        (logged,) = [r.getMessage() for r in caplog.records if "leftover temp files" in r.message]
        assert f"removed {len(leftovers) + 1} leftover" in logged
        assert all(str(p) in logged for p in [*leftovers, scratch])
        assert reader.read_iteration(root, "checkpoint") == 1

    def test_nothing_is_swept_before_a_first_commit(self, tmp_path):
        from prometheus_client import CollectorRegistry

        root = tmp_path / "root"
        temp = layout.step_dir(root, 1) / "model.pt.tmp.4242.0badf00d"
        temp.parent.mkdir(parents=True)
        temp.write_bytes(b"partial")
        registry = CollectorRegistry()
        m = CheckpointMonitor(default_local_dir=root, metrics_port=None, registry=registry)
        try:
            assert asyncio.run(m.status())["leftovers_removed"] == 0
            # Served at 0 from the first scrape, so a later sweep is an increase.
            assert registry.get_sample_value("obsckpt_leftovers_removed_total") == 0
        finally:
            asyncio.run(m.shutdown())
        assert temp.exists()
