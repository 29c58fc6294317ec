"""Load: 256 simulated ranks x 4 slots x N steps against one monitor on the local Ray.

``OBSCKPT_LOAD_STEPS`` sets N (default 12; docs/reliability.md reports N = 50).

Ranks are simulated cheaply: a few driver actors send each rank's
``notify_started`` / ``notify_finished`` RPCs, as CheckpointCoordinator
would, concurrently. Every step must commit, every notification must be
counted, and every commit's lag recorded.
"""

from __future__ import annotations

import asyncio
import os
import time

import ray
from reliability_helpers import by_value, report, scrape, wait_for

from obsckpt import CheckpointMonitor
from obsckpt.store import reader

RANKS = int(os.environ.get("OBSCKPT_LOAD_RANKS", "256"))
SLOTS = ("model", "optim", "extra", "hf")
# The suite runs 12 steps (about 25k RPCs); docs/reliability.md reports runs of 50.
STEPS = int(os.environ.get("OBSCKPT_LOAD_STEPS", "12"))
DRIVERS = 4


class RankDriver:
    """Plays a block of ranks: for each rank and slot, admission then finish, all at once."""

    def __init__(self, monitor, ranks: list[int]) -> None:
        self.monitor = monitor
        self.ranks = ranks

    async def save_step(self, step: int) -> int:
        async def one(rank: int, slot: str) -> None:
            admitted = await self.monitor.notify_started.remote(
                node_id=f"node-{rank // 8}",
                job_id="load",
                step=step,
                slot=slot,
                kind="checkpoint",
                rank=rank,
                pid=10_000 + rank,
            )
            await self.monitor.notify_finished.remote(
                step,
                False,
                ticket=admitted["ticket"],
                slot=slot,
                rank=rank,
                ok=True,
                duration_s=0.01,
                nbytes=1 << 20,
            )

        await asyncio.gather(*(one(r, s) for r in self.ranks for s in SLOTS))
        return len(self.ranks) * len(SLOTS)


class TestLoad:
    """Every step commits and no notification is lost under 256 ranks x 4 slots."""

    def test_many_ranks(self, ray_cluster, namespace, tmp_path):
        root = str(tmp_path / "root")
        monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root)
        by_value()
        driver_cls = ray.remote(num_cpus=0)(RankDriver)
        blocks = [list(range(RANKS))[i::DRIVERS] for i in range(DRIVERS)]
        drivers = [driver_cls.remote(monitor, b) for b in blocks]
        address = ray.get(monitor.metrics_address.remote())
        per_step = RANKS * len(SLOTS)
        t0 = time.monotonic()
        for step in range(1, STEPS + 1):
            ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=per_step))
            # The trainer submits while the ranks save, as it does in a real job.
            saves = [d.save_step.remote(step) for d in drivers]
            ray.get(monitor.monitor_step.remote(step, False))
            assert sum(ray.get(saves)) == per_step
        wait_for(
            lambda: ray.get(monitor.status.remote())["latest"]["checkpoint"] == STEPS,
            60,
            "the last step to commit",
        )
        elapsed = time.monotonic() - t0
        status = ray.get(monitor.status.remote())
        assert status["pending"] == [] and status["failed"] == [] and status["in_flight"] == []
        assert reader.read_iteration(root, "checkpoint") == STEPS
        s = scrape(address)
        total = RANKS * len(SLOTS) * STEPS
        assert s.total("obsckpt_saves_total", result="ok") == total
        assert s.total("obsckpt_saves_total", result="error") == 0
        for slot in SLOTS:
            assert (
                s.value("obsckpt_saves_total", slot=slot, kind="checkpoint", result="ok")
                == RANKS * STEPS
            )
        assert s.total("obsckpt_save_bytes_total") == total * (1 << 20)
        assert s.value("obsckpt_commit_lag_seconds_count", kind="checkpoint") == STEPS
        assert (
            s.value("obsckpt_save_admission_wait_seconds_count", strategy="unrestricted") == total
        )
        assert s.value("obsckpt_saves_in_flight", kind="checkpoint") == 0
        assert s.value("obsckpt_pending_steps", kind="checkpoint") == 0
        rank_series = [
            n for n, lab, _ in s.samples if n == "obsckpt_rank_last_save_duration_seconds"
        ]
        assert len(rank_series) == RANKS * len(SLOTS)
        lag_sum = s.value("obsckpt_commit_lag_seconds_sum", kind="checkpoint")
        report(
            "load",
            ranks=RANKS,
            slots=len(SLOTS),
            steps=STEPS,
            notifications=2 * total,
            elapsed_s=round(elapsed, 1),
            notifications_per_s=round(2 * total / elapsed),
            mean_commit_lag_s=round(lag_sum / STEPS, 3),
            scrape_bytes=len(s.text),
        )
        for d in drivers:
            ray.kill(d, no_restart=True)
        ray.kill(monitor, no_restart=True)
