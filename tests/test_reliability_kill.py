"""Trainer ranks killed with SIGKILL at random moments while they save.

Each trial is one job: a monitor and ``WORLD`` rank actors on the local Ray
save steps with ``CheckpointCoordinator.save_state_dict_async``; a few steps
commit, then during a later step's saves one rank is killed at a random
moment. The job is then "restarted" (a fresh monitor on the same root, fresh
ranks) and resumes from the newest committed step.

``OBSCKPT_RELIABILITY_TRIALS`` sets the number of trials (default 3).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid

import pytest

from obsckpt import CheckpointCoordinator, CheckpointMonitor
from obsckpt import commit as disk
from reliability_helpers import (
    assert_root_consistent,
    rank_path,
    rank_worker_class,
    report,
    scrape,
    trials,
    wait_for,
)

WORLD = 2
NUMEL = 2 << 20  # 8 MiB per rank file: long enough to be killed mid-write


def _submit(monitor, step: int) -> None:
    trainer = CheckpointCoordinator(monitor)
    asyncio.run(trainer.register_and_monitor(step, checkpoint_thread_count=WORLD))


def _latest(ray, monitor) -> int | None:
    return ray.get(monitor.status.remote())["latest"]["checkpoint"]


def _start_job(ray, root: str):
    namespace = f"kill-{uuid.uuid4().hex[:8]}"
    monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root)
    worker_cls = rank_worker_class()
    workers = [worker_cls.remote(monitor, root, r, WORLD, NUMEL) for r in range(WORLD)]
    pids = ray.get([w.pid.remote() for w in workers])
    return monitor, workers, pids


def _stop_job(ray, monitor, workers) -> None:
    for actor in (*workers, monitor):
        ray.kill(actor, no_restart=True)


def _commit_step(ray, monitor, workers, step: int, timeout: float = 60.0) -> float:
    """Save and commit one step normally; returns seconds from save call to commit."""
    _submit(monitor, step)
    t0 = time.monotonic()
    ray.get([w.save.remote(step) for w in workers])
    errors = ray.get([w.wait.remote() for w in workers])
    assert errors == [None] * WORLD, errors
    wait_for(lambda: _latest(ray, monitor) == step, timeout, f"step {step} to commit")
    return time.monotonic() - t0


def run_trial(ray, root: str, rng: random.Random) -> dict:
    monitor, workers, pids = _start_job(ray, root)
    address = ray.get(monitor.metrics_address.remote())
    committed_before = rng.randint(1, 3)
    durations = [_commit_step(ray, monitor, workers, s) for s in range(1, committed_before + 1)]
    save_time = max(durations)

    # The step that will lose a rank: register and submit it, start its saves, kill.
    step = committed_before + 1
    victim = rng.randrange(WORLD)
    delay = rng.uniform(0.0, 1.5 * save_time)
    _submit(monitor, step)
    t_step = time.time()
    calls = [w.save.remote(step) for w in workers]
    time.sleep(delay)
    os.kill(pids[victim], signal.SIGKILL)
    survivors = [w for i, w in enumerate(workers) if i != victim]
    assert ray.get([w.wait.remote() for w in survivors]) == [None] * (WORLD - 1)
    try:
        ray.get(calls[victim], timeout=10)
    except Exception:  # noqa: BLE001 - the victim may die before its call returns
        pass

    # Whether the victim's save was reported decides whether the step may commit.
    def reported_saves() -> float:
        return scrape(address).total("obsckpt_saves_total", slot="model", result="ok")

    time.sleep(0.5)  # let a notification sent just before the kill land
    ok_saves = reported_saves()
    finished_in_step = int(ok_saves) - WORLD * committed_before
    status = ray.get(monitor.status.remote())
    latest = status["latest"]["checkpoint"]
    on_disk = assert_root_consistent(root)
    assert on_disk["checkpoint"] == latest
    if finished_in_step == WORLD:
        outcome = "committed (killed after its save was reported)"
        wait_for(lambda: _latest(ray, monitor) == step, 30, f"step {step} to commit")
    else:
        # The killed rank never reported: the step must not commit, and it shows as a stall.
        outcome = "stalled (killed before its save was reported)"
        assert latest == committed_before, status
        pending = [p for p in status["pending"] if p["kind"] == "checkpoint"]
        assert [p["step"] for p in pending] == [step], status["pending"]
        assert pending[0]["finished"] == finished_in_step
        s = scrape(address)
        assert s.value("obsckpt_pending_steps", kind="checkpoint") == 1
        oldest = s.value("obsckpt_oldest_pending_step_start_timestamp_seconds", kind="checkpoint")
        assert t_step - 5 <= oldest <= time.time(), (oldest, t_step)
        assert s.value("obsckpt_latest_step", kind="checkpoint") == committed_before
        # Nothing moves while the rank is gone.
        time.sleep(0.3)
        assert _latest(ray, monitor) == committed_before
        assert disk.read_iteration(root, "checkpoint") == committed_before

    victim_file = rank_path(root, step, victim, WORLD)
    phase = "file renamed into place" if victim_file.exists() else "file not yet in place"
    _stop_job(ray, monitor, workers)

    # The resumed job: a fresh monitor reads the root, fresh ranks load the newest committed step.
    resumed_from = disk.read_iteration(root, "checkpoint")
    monitor, workers, _ = _start_job(ray, root)
    status = ray.get(monitor.status.remote())
    assert status["latest"]["checkpoint"] == resumed_from
    if resumed_from < step and disk.step_dir(root, step).exists():
        assert step in [a["step"] for a in status["abandoned"]], status["abandoned"]
    assert ray.get([w.resume.remote() for w in workers]) == [resumed_from] * WORLD
    _commit_step(ray, monitor, workers, resumed_from + 1)
    assert assert_root_consistent(root)["checkpoint"] == resumed_from + 1
    assert ray.get([w.resume.remote() for w in workers]) == [resumed_from + 1] * WORLD
    _stop_job(ray, monitor, workers)
    return {
        "outcome": outcome,
        "finished_in_killed_step": finished_in_step,
        "victim_phase": phase,
        "delay_s": round(delay, 3),
        "save_time_s": round(save_time, 3),
        "resumed_from": resumed_from,
    }


class TestKilledRank:
    """A rank killed mid-save never leaves an iteration file naming a partial step;
    the stall is visible in metrics, and a restarted job resumes from the newest commit."""

    def test_sigkill_at_random_moments(self, ray_cluster, tmp_path):
        seed = int(os.environ.get("OBSCKPT_RELIABILITY_SEED", "0")) or random.randrange(1 << 30)
        rng = random.Random(seed)
        outcomes = []
        for i in range(trials(3)):
            root = str(tmp_path / f"trial{i}")
            try:
                result = run_trial(ray_cluster, root, rng)
            except AssertionError as exc:
                raise AssertionError(f"trial {i} (seed {seed}): {exc}") from exc
            report("kill", trial=i, seed=seed, **result)
            outcomes.append(result["outcome"])
        assert outcomes


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
