"""The demo's Ray side: the cluster, the job's actors, and shutting both down.

Also the one place the demo reads the ``OTEL_*`` variables (:func:`otel_env`):
the workers get the driver's, so their spans join the driver's traces.
"""

from __future__ import annotations

import inspect
import os
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from opentelemetry.environment_variables import OTEL_TRACES_EXPORTER
from opentelemetry.sdk.environment_variables import OTEL_EXPORTER_OTLP_ENDPOINT

from obsckpt.demo.config import DemoConfig, ModelSpec
from obsckpt.demo.signals import StartupStopped, own_session
from obsckpt.store.uri import is_remote

# Every variable of the OpenTelemetry SDK starts so; the workers get them all.
OTEL_PREFIX = "OTEL_"


def otel_env(cfg: DemoConfig) -> tuple[dict[str, str], str | None]:
    """The ``OTEL_*`` variables the job's processes get (and ``AWS_*`` ones for an ``s3://``
    root), and where traces go.

    ``--otlp-endpoint`` is put into this process's environment as the SDK's
    variables (so ``tracing.requested()`` here sees it); every ``OTEL_*`` variable
    is then passed on to the workers. The second value names where traces go, for
    the line that says so (None: neither an endpoint nor an exporter is set).
    """
    if cfg.otlp_endpoint:
        os.environ[OTEL_EXPORTER_OTLP_ENDPOINT] = cfg.otlp_endpoint
        os.environ.setdefault(OTEL_TRACES_EXPORTER, "otlp")
    # With an s3:// --ckpt-dir the standard AWS settings reach the workers too: every
    # rank writes to the store.
    prefixes = (OTEL_PREFIX, "AWS_") if is_remote(cfg.ckpt_dir) else (OTEL_PREFIX,)
    env = {k: v for k, v in os.environ.items() if k.startswith(prefixes)}
    return env, env.get(OTEL_EXPORTER_OTLP_ENDPOINT) or env.get(OTEL_TRACES_EXPORTER)


def local_cpus(cfg: DemoConfig) -> int:
    """The CPUs of the local cluster: this machine's, and one per rank and the rollout at least."""
    return max(os.cpu_count() or 1, cfg.world_size + 1)


def ray_start_lines(cfg: DemoConfig) -> tuple[str, str]:
    """What the demo says while Ray starts, and once it has (before its time)."""
    if cfg.address:
        return f"joining the Ray cluster at {cfg.address}", "joined"
    return f"starting a local Ray cluster ({local_cpus(cfg)} CPUs)", "Ray up"


def start_ray(cfg: DemoConfig, namespace: str, env: dict[str, str]) -> None:
    """Start a local Ray cluster (or join ``cfg.address``).

    Raises:
        StartupStopped: SIGTERM came while Ray started (ray.init takes it then).
    """
    import ray

    kwargs: dict[str, Any] = dict(
        namespace=namespace,
        log_to_driver=cfg.verbose,
        logging_level="INFO" if cfg.verbose else "WARNING",
        include_dashboard=False,
    )
    if env:
        kwargs["runtime_env"] = {"env_vars": env}
    if cfg.address:
        kwargs["address"] = cfg.address
    else:
        # "local": a cluster of its own, never one that `ray start` (or RAY_ADDRESS)
        # left on this machine, which num_cpus cannot be given to anyway.
        kwargs["address"] = "local"
        kwargs["num_cpus"] = local_cpus(cfg)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # A terminal's Ctrl-C reaches the whole foreground process group, which
    # includes the GCS and raylet this call starts; they inherit an ignored
    # SIGINT, so the cluster outlives the first Ctrl-C while saves drain. A
    # driver in a session of its own (as `obsckpt demo` runs it) needs no shield,
    # and keeps a Ctrl-C passed on to it while Ray starts.
    shield = threading.current_thread() is threading.main_thread() and not own_session()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if shield else None
    try:
        ray.init(**kwargs)
    except BaseException as exc:
        # ray.init's own SIGTERM handler exits the interpreter (sys.exit(15)); raised
        # within a call into Ray's C++ core it comes as the context of another error.
        if any(
            isinstance(e, SystemExit) and e.code == signal.SIGTERM for e in (exc, exc.__context__)
        ):
            raise StartupStopped(signal.SIGTERM) from None
        raise
    finally:
        if shield:
            signal.signal(signal.SIGINT, previous)


def start_actors(
    cfg: DemoConfig,
    namespace: str,
    device: str,
    env: dict[str, str],
    root: Path | str,
    actors: list,
) -> tuple[list[Any], Any, Any, dict[str, Any]]:
    """Start the job's actors, each added to ``actors`` as it is created (so a start-up
    cut short shuts down the ones it has)."""
    import ray

    from obsckpt.demo.workers import Rollout, TrainerRank

    colocated = device == "cuda" and cfg.sync_method == "ipc"
    # Colocated: the rank and the rollout share one GPU (half each, so Ray packs them).
    gpu = (0.5 if colocated else 1) if device == "cuda" else 0
    rollout_gpu = gpu if cfg.sync_method in ("broadcast", "ipc") else 0
    options: dict[str, Any] = dict(num_cpus=1, num_gpus=gpu, namespace=namespace)
    if env:
        options["runtime_env"] = {"env_vars": env}
    threads = max(1, (os.cpu_count() or 1) // cfg.world_size)
    cls = ray.remote(TrainerRank).options(**options)
    trainers = [
        cls.remote(
            rank=r,
            world_size=cfg.world_size,
            namespace=namespace,
            spec=asdict(ModelSpec()),
            lr=cfg.lr,
            seed=cfg.seed,
            device=device,
            threads=threads,
        )
        for r in range(cfg.world_size)
    ]
    actors += trainers
    master = ray.get(trainers[0].node_address.remote())
    port = ray.get(trainers[0].free_port.remote())
    infos = ray.get([t.setup.remote(master, port) for t in trainers])
    rollout_opts = dict(options, num_cpus=0, num_gpus=rollout_gpu)
    rollout = (
        ray.remote(Rollout)
        .options(**rollout_opts)
        .remote(namespace=namespace, device=device if rollout_gpu else "cpu")
    )
    actors.append(rollout)
    synchronizer = None
    backend = infos[0]["backend"]
    if cfg.sync_method == "broadcast":
        sync_port = ray.get(trainers[0].free_port.remote())
        ray.get(
            [
                trainers[0].join_weight_sync.remote(master, sync_port, backend),
                rollout.join_weight_sync.remote(master, sync_port, backend),
            ]
        )
    elif cfg.sync_method == "ipc":
        ray.get(trainers[0].make_ipc_sender.remote())
    else:
        from obsckpt.sync.synchronizer import Synchronizer

        synchronizer = Synchronizer.get_actor(
            namespace=namespace,
            default_local_dir=str(root) if cfg.sync_method == "checkpoint" else None,
            poll_interval_s=0.1,
            watch=False,  # run_demo starts it, after resume_from when resuming
        )
        actors.append(synchronizer)
    return trainers, rollout, synchronizer, infos[0]


def shutdown(
    actors: list[Any],
    monitor: Any,
    owns_ray: bool,
    *,
    patient: bool = True,
    file_sd: str | None = None,
    address: str | None = None,
    sd_root: str | None = None,
) -> None:
    """Close the actors, then stop the cluster this run started.

    Not ``patient`` (a signal stopped the run, or it failed: a rank may then be
    stuck in a collective its peer left, and its close would never run): a few
    seconds for the actors to close, so that the whole stop stays within what a
    job runner waits. The
    monitor withdraws its ``file_sd`` target (at ``address``) as it shuts down;
    where it could not (a signal to the process group ended its process first,
    and the monitor Ray restarted published a new address but was not ready to
    shut down in time), the driver withdraws the targets of ``sd_root`` (the
    root the monitor's entry named when it started) once the monitor is gone, so
    Prometheus does not go on scraping a dead address.
    """
    import ray

    wait_s = 15.0 if patient else 3.0
    closes = []
    for a in actors:
        if a is not None and hasattr(a, "close"):
            try:
                closes.append(a.close.remote())
            except Exception:  # noqa: BLE001
                pass
    if closes:
        try:
            ray.wait(closes, num_returns=len(closes), timeout=wait_s)
        except Exception:  # noqa: BLE001
            pass
    for a in [*actors, monitor]:
        if a is None:
            continue
        try:
            if a is monitor:
                # Its last scrape is waited for within the stop's own bound.
                last_scrape_s = None if patient else wait_s / 3
                ray.get(monitor.shutdown.remote(last_scrape_s), timeout=wait_s)
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if file_sd and address:
        from obsckpt.telemetry.server import withdraw_file_sd

        try:
            withdraw_file_sd(file_sd, address)  # False when the monitor did already
        except OSError:
            pass
    if owns_ray:
        if "wait_for_processes" in inspect.signature(ray.shutdown).parameters:
            # Returns once the cluster's processes are gone: none outlives the run.
            ray.shutdown(wait_for_processes=True)
        else:
            ray.shutdown()
    if file_sd and sd_root is not None:
        withdraw_root_targets(file_sd, sd_root, wait_s)


def withdraw_root_targets(file_sd: str, root: str, wait_s: float) -> None:
    """Withdraw ``root``'s file_sd targets where nothing listens any more, waiting up to
    ``wait_s`` for a killed monitor's port to close (ray.kill returns before its process
    ends); a target still served after that is another monitor's and stays."""
    from obsckpt.telemetry.server import withdraw_gone_file_sd

    deadline = time.monotonic() + wait_s
    while True:
        try:
            _, left = withdraw_gone_file_sd(file_sd, root)
        except (OSError, ValueError):
            return
        if not left or time.monotonic() >= deadline:
            return
        time.sleep(0.1)
