"""The demo job's driver: train, save in the background, sync weights, report.

:func:`run_demo` starts (or joins) a Ray cluster, starts the job's
:class:`~obsckpt.CheckpointMonitor` (which serves /metrics), ``world_size``
FSDP2 trainer ranks and a rollout actor, and runs the training loop:

* every step: one optimizer step on every rank, then the weights go to the
  rollout (``broadcast``: a gloo/NCCL group of trainer rank 0 and the
  rollout; ``memory``: through the Synchronizer actor; ``checkpoint``: a
  state-dict save per step that the Synchronizer loads once committed). The
  rollout checks that the version it got is the trainer's step and that the
  weights are bit-identical to the trainer's;
* every ``save_every`` steps (and at the last step): a full checkpoint
  (model, optimizer, extra state) written in the background by every rank
  through the coordinator, registered and submitted inside
  ``tracing.checkpoint_span`` so each step is one trace.

SIGINT, SIGTERM and SIGHUP stop the run
(see :class:`~obsckpt.demo.signals.StopSignals`): during the
start-up at once; during training after the current step, the saves in flight
then finish and commit (or, if they fail or take too long, are left
uncommitted: an iteration file never names a partial step). A second SIGINT
stops at once.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from obsckpt.demo.cluster import otel_env, ray_start_lines, shutdown, start_actors, start_ray
from obsckpt.demo.config import EXIT_FAILED, EXIT_INTERRUPTED, DemoConfig, DemoResult
from obsckpt.demo.endpoints import check_endpoints
from obsckpt.demo.loop import Job, drain, report, sync, train
from obsckpt.demo.plan import plan_line, resolve_plan
from obsckpt.demo.progress import Progress
from obsckpt.demo.resume_check import check_resume, final_digest, kill_targets, load_reference
from obsckpt.demo.root import committed_on_disk, demo_root, prepare_root
from obsckpt.demo.signals import StartupStopped, StopSignals, stop_reason
from obsckpt.errors import DemoError, StateDictLoadError
from obsckpt.monitor.telemetry import file_sd_root_label
from obsckpt.monitor_link import one_line
from obsckpt.telemetry.server import file_sd_root

__all__ = ["DemoConfig", "DemoResult", "StartupStopped", "run_demo"]


def run_demo(
    cfg: DemoConfig,
    *,
    out: TextIO | None = None,
    err: TextIO | None = None,
    handle_signals: bool = True,
) -> DemoResult:
    """Run the demo job; returns what it did. The summary table goes to ``out``.

    Works with a Ray that is already initialised (the caller's cluster and
    namespace are used; nothing is shut down at the end). With
    ``handle_signals``, SIGINT, SIGTERM and SIGHUP stop the run (module docstring)
    and set its exit code to 128 + the signal's number.

    Raises:
        DemoError: the checkpoint root or the cluster cannot be used.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    t_start = time.monotonic()
    progress = Progress(cfg.steps or None, stream=err, enabled=cfg.progress)
    stop = StopSignals(progress.note)
    if handle_signals:
        stop.install()
    result = DemoResult()
    try:
        return _run(cfg, out, progress, stop, result)
    except StartupStopped as exc:
        result.stop_reason = stop_reason(exc.signum)
        result.exit_code = 128 + exc.signum
        return result
    finally:
        stop.restore()
        if stop.signum is not None:
            # Not the monitor's word: what the iteration files name once it is gone (a
            # commit it had under way when the run stopped may have landed since).
            result.committed = committed_on_disk(demo_root(result.root or cfg.ckpt_dir))
        result.elapsed_s = time.monotonic() - t_start


def _run(
    cfg: DemoConfig, out: TextIO, progress: Progress, stop: StopSignals, result: DemoResult
) -> DemoResult:
    cfg = resolve_plan(cfg)
    cfg = check_endpoints(cfg)
    reference = load_reference(cfg.check_resume) if cfg.check_resume else None
    # Every check, before Ray starts and before anything in the root is removed: a
    # run that cannot start (a bad --address, say) must not have wiped the last one.
    result.root = str(prepare_root(cfg, progress.note, dry_run=True)[0])
    env, traces_to = otel_env(cfg)

    import ray

    from obsckpt import CheckpointCoordinator
    from obsckpt.telemetry import tracing

    namespace = cfg.namespace or f"obsckpt-demo-{uuid.uuid4().hex[:8]}"
    owns_ray = not ray.is_initialized()
    # The workers of a local cluster started here inherit this environment (the raylet
    # starts with it); a runtime_env, which starts each of them through Ray's setup
    # step, only for a cluster that is already running.
    worker_env = {} if owns_ray and not cfg.address else env
    actors: list[Any] = []
    monitor = None
    sd_root = None
    failed = False  # the run raised: its ranks may be stuck in a collective, so no patience
    loop = asyncio.new_event_loop()
    try:
        if owns_ray:
            try:
                with timed(progress.note, *ray_start_lines(cfg)):
                    start_ray(cfg, namespace, worker_env)
            except StartupStopped as exc:
                stop.record(exc.signum)
                raise
            stop.reinstall()
        stop.check()
        traced = tracing.requested()  # otel_env put --otlp-endpoint into os.environ
        if traced:
            tracing.setup_tracing("obsckpt-demo")
        with stop.held():  # starting over removes the earlier run's steps
            root, resumed, state_dict_step = prepare_root(cfg, progress.note)
        result.root = str(root)
        result.resumed_from = resumed or None
        # Step numbers go on from the resumed step: the bar spans this run's steps.
        progress.set_range(resumed, resumed + cfg.steps if cfg.steps else None)
        if cfg.file_sd:
            # The root the monitor's entry names (a monitor Ray restarts publishes under
            # it too), known before the monitor answers: it publishes first, and a stop
            # signal can cut the start-up short in between.
            sd_root = file_sd_root_label(root)
        monitor = _start_monitor(cfg, namespace, root, progress, result)
        if cfg.file_sd and result.metrics_address:
            sd_root = file_sd_root(cfg.file_sd, result.metrics_address) or sd_root
        if traced:
            progress.note(f"traces: {traces_to}")

        ranks = "1 rank" if cfg.world_size == 1 else f"{cfg.world_size} ranks"
        with timed(progress.note, f"building the model on {ranks}", "ranks ready"):
            trainers, rollout, synchronizer, info = start_actors(
                cfg, namespace, cfg.device, worker_env, root, actors
            )
        result.device = info["device"]
        result.sync_method = cfg.sync_method
        progress.note(plan_line(cfg, info))
        where = shlex.quote(str(root))
        progress.note(f"checkpoints: {root}  (inspect with `obsckpt status {where}`)")
        retrained = _resume(
            cfg, root, resumed, state_dict_step, (trainers, rollout, synchronizer), progress, result
        )
        job = Job(
            trainers=trainers,
            rollout=rollout,
            synchronizer=synchronizer,
            monitor=monitor,
            coord=CheckpointCoordinator(monitor),
            loop=loop,
            progress=progress,
            stop=stop,
            result=result,
            kill_targets=kill_targets(trainers, rollout) if cfg.kill_at else [],
        )
        stop.phase = "training"
        train(cfg, root, resumed, job, retrained=retrained)
        stop.phase = "finishing"
        progress.close()
        if result.last_step >= result.first_step:
            result.final_digest = final_digest(trainers)
        drain(cfg, trainers, monitor, progress, result, stop)
        if reference is not None:
            matched, line = check_resume(reference, result)
            result.resume_check = line
            progress.note(line)
            if not matched:
                result.exit_code = EXIT_FAILED
                result.stop_reason = "resume mismatch"
    except KeyboardInterrupt:
        if stop.phase == "start-up" and stop.signum is not None:
            raise StartupStopped(stop.signum) from None
        progress.close()
        progress.note("stopped at once: saves still in flight are left uncommitted")
        result.stop_reason = "aborted"
        result.exit_code = EXIT_INTERRUPTED
    except BaseException:
        failed = True
        raise
    finally:
        stop.phase = "finishing"
        loop.close()
        started = result.last_step >= result.first_step
        if monitor is not None and result.stop_reason != "aborted":
            if started:
                report(monitor, result, out, progress)
                progress.note(DASHBOARD_HINT)
            elif stop.signum is None:
                progress.note("no summary: no training step ran")
        shutdown(
            actors,
            monitor,
            owns_ray,
            patient=stop.signum is None and not failed,
            file_sd=cfg.file_sd,
            address=result.metrics_address,
            sd_root=sd_root,
        )
        if stop.signum is not None and result.stop_reason != "aborted":
            result.stop_reason = stop_reason(stop.signum)
            result.exit_code = 128 + stop.signum
    return result


@contextmanager
def timed(note: Callable[[str], None], doing: str, done: str) -> Iterator[None]:
    """Say what starts (``doing...``), and once it has, how long it took (``done in 4.1 s``)."""
    note(f"{doing}...")
    started = time.monotonic()
    yield
    note(f"{done} in {time.monotonic() - started:.1f} s")


# Where to see the job's metrics once it has run: the stack, or the user's own Grafana.
DASHBOARD_HINT = (
    "dashboard: `docker compose up -d` in the source tree runs the job with Prometheus, "
    "Alertmanager and Grafana (http://localhost:3000, dashboard 'obsckpt: checkpointing'); "
    "for your own Grafana and Prometheus, `obsckpt dashboards export DIR` writes the "
    "dashboard, the alert rules and a scrape snippet"
)


def _start_monitor(
    cfg: DemoConfig, namespace: str, root: Path | str, progress: Progress, result: DemoResult
) -> Any:
    """The job's CheckpointMonitor actor, serving /metrics (and file_sd) as asked.

    Raises:
        DemoError: /metrics was asked for and the monitor cannot serve it.
    """
    import ray

    from obsckpt import CheckpointMonitor

    monitor = CheckpointMonitor.get_actor(
        namespace=namespace,
        save_strategy=cfg.save_strategy,
        default_local_dir=str(root),
        metrics_port=cfg.metrics_port,
        metrics_host=cfg.metrics_host,
        file_sd_path=cfg.file_sd,
    )
    status = ray.get(monitor.status.remote())
    address = ray.get(monitor.metrics_address.remote())
    result.metrics_address = address
    if address:
        progress.note(f"metrics: http://{address}/metrics")
    elif cfg.metrics_port is not None:
        # Checked before Ray started on a local cluster; on a joined one the monitor
        # may run elsewhere. A demo without /metrics has no summary: refuse to run.
        raise DemoError(
            f"the monitor cannot serve /metrics ({status['metrics']['error']}); pass "
            "another --metrics-port (0 picks a free one), or --no-metrics"
        )
    if cfg.file_sd:
        progress.note(f"file_sd: {cfg.file_sd}")
    return monitor


def _resume(
    cfg: DemoConfig,
    root: Path | str,
    resumed: int,
    state_dict_step: int | None,
    actors: tuple[list[Any], Any, Any],
    progress: Progress,
    result: DemoResult,
) -> int:
    """Load the resumed step and its resume record into the ranks, start the synchronizer
    from the record's weight version and publish the resumed weights under it.

    Returns the last step trained again without a state-dict save (``resumed``
    unless checkpoint sync committed state dicts past the newest full checkpoint).
    """
    import ray

    trainers, rollout, synchronizer = actors
    version = resumed
    if resumed:
        try:
            versions = ray.get([t.load_checkpoint.remote(str(root), resumed) for t in trainers])
        except StateDictLoadError as exc:  # refused by obsckpt.loading, on a rank
            raise DemoError(
                f"--resume: committed step {resumed} cannot be loaded: {one_line(exc)}"
            ) from exc
        if len(set(versions)) != 1 or versions[0] is None:
            raise DemoError(
                f"--resume: the resume records of step {resumed} name weight versions "
                f"{versions} (one per rank); they must agree. Resume from another step"
            )
        version = versions[0]
        progress.note(
            f"resumed from committed step {resumed} (data position, RNGs and weight version "
            f"{version} from its resume record)"
        )
    if synchronizer is not None:
        if cfg.resume:
            # Weight-sync versions restart at the record's version; checkpoint sync
            # skips the state dicts committed before it (Synchronizer.resume_from).
            ray.get(synchronizer.resume_from.remote(version))
        if cfg.sync_method == "checkpoint":
            ray.get([t.start_state_dict_sync.remote(resumed) for t in trainers])
            ray.get(synchronizer.start.remote())
    if resumed and cfg.sync_method != "checkpoint":
        # Before the rollout waits on the next step's weights: it holds none after a
        # restart, and versions go on from here. (Checkpoint sync publishes through the
        # next committed state dict.)
        result.republished_version = sync(cfg, version, trainers, rollout, synchronizer)
        progress.note(f"published the resumed weights to the rollout as version {version}")
    if cfg.sync_method != "checkpoint" or state_dict_step is None or state_dict_step <= resumed:
        return resumed
    # Stopped between full checkpoints: the state dicts of the steps trained
    # again are committed already, and the iteration file never goes back.
    full = (
        f"the newest full checkpoint is step {resumed}"
        if resumed
        else "there is no full checkpoint"
    )
    progress.note(
        f"--resume: the state dict of step {state_dict_step} is committed, but {full}; "
        f"{_steps(resumed + 1, state_dict_step)} trained again without state-dict saves "
        f"(step {state_dict_step}'s stays), and the rollout gets new weights from step "
        f"{state_dict_step + 1} on"
    )
    return state_dict_step


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"
