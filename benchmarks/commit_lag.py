"""Commit lag: the last save of a step finished → its iteration file committed.

A few Ray actors each play many ranks through the monitor's own RPCs, as
the coordinator makes them: ``notify_started(..., step=, slot=, kind=, rank=)``,
a small file written per save, then ``notify_finished(step, ..., ticket=,
slot=, rank=, ok=True, files=[...])``. The trainer side registers the step's
saves and submits it first (``register_thread_count`` + ``monitor_step``), so
the step commits inside the ``notify_finished`` RPC that makes it whole.

The saves of a step finish spread over a window (shards of one step end close
together, not at one instant); each actor notes the wall-clock time just before
it sends each ``notify_finished``. The lag of a step is the monitor's commit
timestamp (taken once the iteration file has been replaced and its directory
fsynced) minus the latest of those times. A burst variant, where every save of
a step finishes at the same instant, is reported alongside: it measures how
fast the monitor drains notifications rather than how fast it commits.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import time
from typing import Any

from benchmarks.common import Result, Sizes, median, p99

_FILE_BYTES = 4096


class RankSim:
    """Plays ``ranks`` × ``slots`` saves per step against the monitor."""

    def __init__(self, monitor: Any, ranks: list[int], slots: list[str], root: str, world: int):
        self.monitor = monitor
        self.pairs = [(r, s) for r in ranks for s in slots]
        self.root = root
        self.world = world
        self.tickets: dict[tuple[int, str], int] = {}
        self.payload = os.urandom(_FILE_BYTES)

    async def start(self, step: int) -> None:
        refs = [
            self.monitor.notify_started.remote(
                "bench-node",
                "bench-job",
                step=step,
                slot=slot,
                kind="checkpoint",
                rank=rank,
                pid=os.getpid(),
            )
            for rank, slot in self.pairs
        ]
        admitted = await asyncio.gather(*refs)
        self.tickets = {pair: a["ticket"] for pair, a in zip(self.pairs, admitted, strict=True)}
        # The "save": one small file per rank and slot, in the step directory.
        sdir = os.path.join(self.root, f"global_step_{step}", "actor")
        os.makedirs(sdir, exist_ok=True)
        for rank, slot in self.pairs:
            with open(os.path.join(sdir, self._name(rank, slot)), "wb") as f:
                f.write(self.payload)

    def _name(self, rank: int, slot: str) -> str:
        return f"{slot}_world_size_{self.world}_rank_{rank}.pt"

    async def finish(self, step: int, t_base: float, spread_s: float, seed: int) -> float:
        """Send every finish at its time; returns the wall-clock time the last one was sent."""
        rng = random.Random(seed)
        plan = sorted((rng.uniform(0, spread_s), pair) for pair in self.pairs)
        refs = []
        last_sent = 0.0
        for offset, (rank, slot) in plan:
            delay = t_base + offset - time.time()
            if delay > 0.0005:
                await asyncio.sleep(delay)
            record = {
                "path": f"actor/{self._name(rank, slot)}",
                "size": _FILE_BYTES,
                "crc32": "00000000",
            }
            last_sent = time.time()
            refs.append(
                self.monitor.notify_finished.remote(
                    step,
                    False,
                    ticket=self.tickets[(rank, slot)],
                    slot=slot,
                    rank=rank,
                    ok=True,
                    duration_s=1.0,
                    nbytes=_FILE_BYTES,
                    join_wait_s=0.0,
                    files=[record],
                )
            )
        await asyncio.gather(*refs)
        return last_sent


def _run_steps(
    monitor,
    sims,
    first_step: int,
    steps: int,
    spread_s: float,
    root: str,
    expected: int,
    log,
    label,
):
    import ray

    from obsckpt import commit as disk

    lags = []
    for i in range(steps):
        step = first_step + i
        ray.get(monitor.register_thread_count.remote(step, checkpoint_thread_count=expected))
        ray.get(monitor.monitor_step.remote(step, False))
        ray.get([s.start.remote(step) for s in sims])
        t_base = time.time() + 0.02
        last_sent = max(
            ray.get(
                [
                    s.finish.remote(step, t_base, spread_s, step * 131 + k)
                    for k, s in enumerate(sims)
                ]
            )
        )
        status = ray.get(monitor.status.remote())
        committed_at = status["last_commit_time"]["checkpoint"]
        named = disk.read_iteration(root, "checkpoint")
        if named != step or committed_at is None:
            raise RuntimeError(
                f"step {step} was not committed after all {expected} saves finished "
                f"(iteration file names {named}; pending {status['pending'][:2]})"
            )
        lags.append(committed_at - last_sent)
        if step - 2 >= first_step:
            shutil.rmtree(os.path.join(root, f"global_step_{step - 2}"), ignore_errors=True)
        if (i + 1) % max(1, steps // 4) == 0:
            log(
                f"  commit lag ({label}) {i + 1}/{steps} steps: p50 {median(lags) * 1e3:.1f} ms, max {max(lags) * 1e3:.1f} ms"
            )
    return lags


def run_commit_lag(sizes: Sizes, bench_dir: str, namespace: str, log) -> Result:
    import ray

    from obsckpt import CheckpointMonitor

    root = os.path.join(bench_dir, "commit-lag")
    os.makedirs(root, exist_ok=True)
    monitor = CheckpointMonitor.get_actor(namespace=namespace, default_local_dir=root)
    slots = ["model", "optimizer", "extra_state", "hf"][: sizes.commit_slots]
    slots += [f"slot{i}" for i in range(len(slots), sizes.commit_slots)]
    per_actor = -(-sizes.commit_ranks // sizes.commit_actors)
    sim_cls = ray.remote(num_cpus=0, max_concurrency=1)(RankSim)
    sims = [
        sim_cls.remote(
            monitor,
            list(range(a * per_actor, min(sizes.commit_ranks, (a + 1) * per_actor))),
            slots,
            root,
            sizes.commit_ranks,
        )
        for a in range(sizes.commit_actors)
    ]
    expected = sizes.commit_ranks * len(slots)
    # One warm-up step: actor start-up and first-call costs are not commit lag.
    _run_steps(
        monitor, sims, 1, 1, sizes.commit_spread_s, root, expected, lambda _m: None, "warm-up"
    )
    lags = _run_steps(
        monitor, sims, 2, sizes.commit_steps, sizes.commit_spread_s, root, expected, log, "spread"
    )
    burst_steps = max(1, sizes.commit_steps // 5)
    burst = _run_steps(
        monitor, sims, 2 + sizes.commit_steps, burst_steps, 0.0, root, expected, log, "burst"
    )
    for handle in [*sims, monitor]:
        ray.kill(handle)
    shutil.rmtree(root, ignore_errors=True)
    ms = [x * 1e3 for x in lags]
    burst_ms = [x * 1e3 for x in burst]
    return Result(
        "commit_lag_p99_ms",
        p99(ms),
        "<=",
        50,
        unit="ms",
        limit="monitor event loop (one Python process handles every notification) and the commit's fsyncs",
        details={
            "ranks": sizes.commit_ranks,
            "slots": len(slots),
            "saves_per_step": expected,
            "steps": len(ms),
            "finish_spread_s": sizes.commit_spread_s,
            "p50_ms": round(median(ms), 2),
            "max_ms": round(max(ms), 2),
            "burst_steps": len(burst_ms),
            "burst_p50_ms": round(median(burst_ms), 2),
            "burst_p99_ms": round(p99(burst_ms), 2),
            "burst_note": "every save of the step finishes at once: the lag is the time the "
            "monitor needs to drain saves_per_step notifications",
            "simulated_by": f"{sizes.commit_actors} actors each driving "
            f"{per_actor} ranks x {len(slots)} slots",
        },
    )
