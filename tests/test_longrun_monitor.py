"""A monitor that runs for days: what it keeps stays the size of the last steps.

The monitor is used in-process (its RPCs are async methods) with a fresh
registry, driven through many steps as a long job would drive it; files are
real and really fsynced.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from obsckpt import CheckpointMonitor

SLOTS = ("model", "optim")
KEEP = 64  # resolved steps the monitor keeps for status()


def _monitor(root: Path) -> CheckpointMonitor:
    return CheckpointMonitor(
        "unrestricted", default_local_dir=root, metrics_port=None, registry=CollectorRegistry()
    )


async def _step(mon: CheckpointMonitor, step: int, *, ok: bool) -> None:
    """One step as the trainer and its ranks report it: register, two saves, submit."""
    await mon.register_thread_count(step, checkpoint_thread_count=len(SLOTS))
    for slot in SLOTS:
        admitted = await mon.notify_started(
            "node", "job", step=step, slot=slot, kind="checkpoint", rank=0, pid=1, lease=True
        )
        if ok:
            os.makedirs(os.path.join(mon.root, f"global_step_{step}", slot), exist_ok=True)
        await mon.notify_finished(
            step,
            False,
            ticket=admitted["ticket"],
            slot=slot,
            rank=0,
            ok=ok,
            error=None if ok else "OSError: [Errno 28] No space left on device",
            duration_s=0.01,
        )
    await mon.monitor_step(step, False)


async def _run(mon: CheckpointMonitor, steps: range, *, ok) -> list[float]:
    """Seconds each step's notifications took."""
    took = []
    for step in steps:
        t0 = time.perf_counter()
        await _step(mon, step, ok=ok(step))
        took.append(time.perf_counter() - t0)
    return took


class TestAFailingJobForgetsOldFailures:
    """A job whose saves fail for hours commits nothing, yet the monitor keeps only the
    newest resolved steps: status() and the work of each notification stay the size
    they had after the first failures."""

    def test_status_keeps_the_newest_failed_steps(self, tmp_path):
        mon = _monitor(tmp_path / "ckpt")
        n = 400

        async def main():
            await _run(mon, range(1, n + 1), ok=lambda _s: False)
            return await mon.status()

        status = asyncio.run(main())
        failed = sorted(f["step"] for f in status["failed"])
        assert failed == list(range(n - KEEP + 1, n + 1))
        assert status["pending"] == [] and status["in_flight"] == []
        assert status["latest"] == {"checkpoint": None, "state_dict": None}
        # Every failure was still counted.
        assert mon.metrics.registry.get_sample_value(
            "obsckpt_step_failures_total", {"kind": "checkpoint"}
        ) == float(n)

    def test_notifications_cost_the_same_after_many_failures(self, tmp_path):
        mon = _monitor(tmp_path / "ckpt")

        async def main():
            await _run(mon, range(1, KEEP + 1), ok=lambda _s: False)  # the kept window is full
            first = await _run(mon, range(KEEP + 1, KEEP + 101), ok=lambda _s: False)
            await _run(mon, range(KEEP + 101, 1001), ok=lambda _s: False)
            last = await _run(mon, range(1001, 1101), ok=lambda _s: False)
            return first, last

        first, last = asyncio.run(main())
        first_s, last_s = sorted(first)[50], sorted(last)[50]  # medians
        # Kept, 1,000 failed steps made each notification walk all of them (~10x slower).
        assert last_s < 3 * first_s + 0.002, (first_s, last_s)

    def test_a_step_after_the_failures_commits(self, tmp_path):
        root = tmp_path / "ckpt"
        mon = _monitor(root)

        async def main():
            await _run(mon, range(1, 301), ok=lambda s: s == 300)
            return await mon.status()

        status = asyncio.run(main())
        assert status["latest"]["checkpoint"] == 300
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "300"
        assert len(status["failed"]) <= KEEP
