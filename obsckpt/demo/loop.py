"""The demo's training loop: a step on every rank, its saves, the weight sync, the drain.

Each step trains on every rank; every ``save_every`` steps (and at the last)
the ranks write a full checkpoint in the background through the coordinator,
registered and submitted inside ``tracing.checkpoint_span`` so that each step
is one trace; then the weights go to the rollout, which checks that they are
the trainer's, bit for bit.
"""

from __future__ import annotations

import asyncio
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from obsckpt.demo.config import EXIT_FAILED, DemoConfig, DemoResult
from obsckpt.demo.progress import Progress
from obsckpt.demo.resume_check import kill_job
from obsckpt.demo.root import rotate_state_dicts
from obsckpt.demo.signals import STOP_GRACE_S, StopSignals
from obsckpt.demo.summary import Scrape, format_table, summarize
from obsckpt.errors import WeightMismatchError


@dataclass
class Job:
    """The running demo's actors and helpers, as the training loop uses them."""

    trainers: list[Any]
    rollout: Any
    synchronizer: Any
    monitor: Any
    coord: Any
    loop: asyncio.AbstractEventLoop
    progress: Progress
    stop: StopSignals
    result: DemoResult
    # (node, pid) of the ranks and the rollout, for --kill-at.
    kill_targets: list[tuple[str, int]] = field(default_factory=list)


def train(cfg: DemoConfig, root: Path | str, resumed: int, job: Job, *, retrained: int) -> None:
    """Train steps ``resumed + 1`` on; with checkpoint sync, steps up to ``retrained``
    have a committed state dict already: they save none and sync nothing.

    ``--duration`` counts from here, not from the start-up (Ray and the workers can
    take longer than a short duration); the step that ends it is the last one, and is
    saved as such."""
    import ray

    from obsckpt.telemetry import tracing

    trainers, rollout, synchronizer = job.trainers, job.rollout, job.synchronizer
    monitor, coord, loop = job.monitor, job.coord, job.loop
    progress, stop, result = job.progress, job.stop, job.result

    last = resumed + cfg.steps if cfg.steps else None
    step = resumed
    result.first_step = resumed + 1
    committed_seen: int | None = None
    t_train = time.monotonic()
    if cfg.duration is not None:
        progress.set_duration(cfg.duration, t_train)
    while not stop.event.is_set():
        if last is not None and step >= last:
            break
        step += 1
        outs = ray.get([t.train_step.remote(step) for t in trainers])
        losses = [loss for loss, _ in outs]
        result.losses.append(losses[0])
        result.data_digests.append(",".join(crc for _, crc in outs))
        result.last_step = step
        monitor.record_model_version.remote("trainer", step)
        timed_out = cfg.duration is not None and time.monotonic() - t_train >= cfg.duration
        is_last = (last is not None and step == last) or timed_out
        full = step % cfg.save_every == 0 or is_last
        if full:
            with tracing.checkpoint_span(step) as carrier:
                # Each rank's manager registers its own saves before starting them.
                # The weight version of this step's weights is the step: the record says so.
                ray.get(
                    [
                        t.save_checkpoint.remote(str(root), step, carrier or None, cfg.keep, step)
                        for t in trainers
                    ]
                )
                if cfg.kill_in_save and cfg.kill_at == step:
                    kill_job(job.kill_targets, progress.note)  # its writes in flight
                loop.run_until_complete(coord.register_and_monitor(step))
            result.checkpoint_steps.append(step)
        elif cfg.sync_method == "checkpoint" and step > retrained:
            with tracing.checkpoint_span(step, is_state_dict=True) as carrier:
                ray.get(
                    [
                        t.save_model_state_dict.remote(str(root), step, carrier or None)
                        for t in trainers
                    ]
                )
                loop.run_until_complete(coord.register_and_monitor(step, is_state_dict=True))
        version = None
        if cfg.sync_method != "checkpoint" or step > retrained:
            version = sync(cfg, step, trainers, rollout, synchronizer)
            result.rollout_versions.append(version)
        status = ray.get(monitor.status.remote())
        committed = status["latest"]["checkpoint"]
        if committed != committed_seen:
            committed_seen = committed
            if cfg.sync_method == "checkpoint" and cfg.keep:
                rotate_state_dicts(root, result.checkpoint_steps, status["latest"])
        progress.update(
            step,
            loss=losses[0],
            committed=committed,
            in_flight=len(status["in_flight"]),
            pending=len(status["pending"]),
            rollout_version=version,
        )
        if cfg.kill_at == step and not cfg.kill_in_save:
            kill_job(job.kill_targets, progress.note)
        if timed_out:
            result.stop_reason = "duration"
            break


def sync(cfg: DemoConfig, step: int, trainers: list[Any], rollout: Any, synchronizer: Any) -> int:
    """Hand step ``step``'s weights to the rollout; the version it then holds."""
    import ray

    if cfg.sync_method == "broadcast":
        sent = [t.broadcast_weights.remote(step, None) for t in trainers]
        got = rollout.receive_broadcast.remote(step)
        ray.get(sent)
        version, fp = ray.get(got)
    elif cfg.sync_method == "ipc":
        ray.get([t.ipc_weights.remote(step, rollout, None) for t in trainers])
        version, fp = ray.get(rollout.accepted.remote())
    elif cfg.sync_method == "memory":
        ray.get([t.upload_weights.remote(step) for t in trainers])
        version, fp = ray.get(rollout.pull.remote(synchronizer, step, 60.0))
    else:
        # Waited for here, not only in the rollout's pull: that waits for a version
        # newer than the one it holds, and after --resume it holds none while the
        # synchronizer holds the resumed step, so the pull would poll without waiting.
        held = ray.get(synchronizer.wait_new_model_state_dict.remote(step - 1, cfg.commit_timeout))
        if held is None or held < step:
            raise RuntimeError(
                f"the synchronizer holds version {held} after {cfg.commit_timeout:.0f} s; the "
                f"trainer is at step {step} (is the step's commit stuck? see `obsckpt status`)"
            )
        version, fp = ray.get(rollout.pull.remote(synchronizer, step, cfg.commit_timeout))
    fingerprints = ray.get([t.fingerprint.remote() for t in trainers])
    check_rollout_weights(version, step, fp, fingerprints[0])
    return version


def check_rollout_weights(version: int, step: int, got: str | None, want: str | None) -> None:
    """Raise WeightMismatchError when the rollout's CRC32 is not the trainer's."""
    if got != want:
        raise WeightMismatchError(
            f"the rollout's weights of version {version} differ from the trainer's step {step} "
            f"(crc32 {got} vs {want})"
        )


def drain(
    cfg: DemoConfig,
    trainers: list[Any],
    monitor: Any,
    progress: Progress,
    result: DemoResult,
    stop: StopSignals,
) -> None:
    """Let saves in flight finish and their steps commit.

    Bounded by ``commit_timeout``, and by STOP_GRACE_S from a SIGTERM or SIGHUP
    (one that comes while it waits too): what is not committed by then is left
    uncommitted.
    """
    import ray

    status = ray.get(monitor.status.remote())
    if status["in_flight"] or status["pending"]:
        progress.note(
            f"waiting for {len(status['in_flight'])} saves in flight and "
            f"{len(status['pending'])} pending steps to commit"
        )
    deadline = time.monotonic() + cfg.commit_timeout
    waits = [t.wait_saves.remote(cfg.commit_timeout) for t in trainers]
    # Polled rather than waited on at once, so that a signal shortens the wait.
    abandoned = False
    while True:
        done, _ = ray.wait(waits, num_returns=len(waits), timeout=0.1)
        if len(done) == len(waits):
            result.save_errors = [e for e in ray.get(waits) if e]
            break
        if time.monotonic() > stop.grace_deadline(math.inf):
            progress.note(
                f"saves still running {STOP_GRACE_S:.0f} s after "
                f"{signal.Signals(stop.signum).name}: left uncommitted"
            )
            abandoned = True
            break
    while not abandoned:
        status = ray.get(monitor.status.remote())
        open_steps = [p for p in status["pending"] if p["submitted"]]
        if not open_steps and not status["in_flight"]:
            break
        if time.monotonic() > stop.grace_deadline(deadline):
            waited = (
                f"{STOP_GRACE_S:.0f} s after {signal.Signals(stop.signum).name}"
                if time.monotonic() < deadline
                else f"{cfg.commit_timeout:.0f} s"
            )
            progress.note(
                f"gave up waiting for commits after {waited}: "
                f"{[p['step'] for p in open_steps]} still pending (left uncommitted)"
            )
            break
        time.sleep(0.05)
    status = ray.get(monitor.status.remote())
    result.committed = dict(status["latest"])
    for e in result.save_errors:
        progress.note(f"save failed: {e}")
    if result.save_errors or status["failed"]:
        result.exit_code = EXIT_FAILED
        result.stop_reason = "save failed"


def report(monitor: Any, result: DemoResult, out: TextIO, progress: Progress) -> None:
    """Print the summary table scraped from /metrics (best effort) and note what is committed."""
    import ray

    try:
        status = ray.get(monitor.status.remote(), timeout=30)
        result.committed = dict(status["latest"])
        if result.metrics_address:
            summary = summarize(Scrape.fetch(result.metrics_address), status["latest"])
            result.summary = summary
            out.write("\n" + format_table(summary) + "\n")
            out.flush()
    except Exception as exc:  # noqa: BLE001 - the summary is best effort at shutdown
        progress.note(f"no summary: {type(exc).__name__}: {exc}")
