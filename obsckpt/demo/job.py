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

SIGINT, SIGTERM and SIGHUP stop the run (see :class:`_Stop`): during the
start-up at once; during training after the current step, the saves in flight
then finish and commit (or, if they fail or take too long, are left
uncommitted: an iteration file never names a partial step). A second SIGINT
stops at once.
"""

from __future__ import annotations

import asyncio
import math
import os
import shlex
import signal
import socket
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from obsckpt.demo.model import ModelSpec
from obsckpt.demo.progress import Progress
from obsckpt.demo.root import prepare_root, rotate_state_dicts
from obsckpt.demo.summary import Scrape, format_table, summarize
from obsckpt.errors import DemoError, WeightMismatchError

SYNC_METHODS = ("broadcast", "checkpoint", "ipc", "memory")
DEVICES = ("auto", "cpu", "cuda")
DEFAULT_CKPT_DIR = os.path.join("obsckpt-demo", "ckpt")
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# The signals that stop a run; it then exits 128 + the signal's number, as a shell
# reports a process a signal ended (130 SIGINT, 143 SIGTERM, 129 SIGHUP).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# After SIGTERM or SIGHUP, how long saves in flight may take to finish and commit.
# Whoever sends them (a job runner, a closing terminal) does not wait long.
STOP_GRACE_S = 10.0
# Seeds of the synthetic batches are combined with the step into a 64-bit torch seed.
MAX_SEED = 2**32 - 1


@dataclass(kw_only=True, slots=True)
class DemoConfig:
    """Settings of one demo run (the ``obsckpt demo`` flags)."""

    steps: int = 40
    save_every: int = 10
    world_size: int | None = None  # None: 2 on CPU, 1 on one GPU, a GPU per rank + rollout
    sync_method: str | None = None  # None: broadcast, or ipc on a single GPU
    ckpt_dir: str = DEFAULT_CKPT_DIR
    resume: bool = False
    duration: float | None = None
    metrics_port: int | None = 0
    metrics_host: str = "0.0.0.0"
    file_sd: str | None = None
    otlp_endpoint: str | None = None
    address: str | None = None
    namespace: str | None = None
    save_strategy: str = "unrestricted"
    keep: int = 3
    device: str = "auto"
    seed: int = 0
    lr: float = 1e-2
    progress: bool = True
    verbose: bool = False
    commit_timeout: float = 300.0

    def __post_init__(self) -> None:
        for name in ("steps", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("save_every", "world_size"):
            value = getattr(self, name)
            if name == "world_size" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.sync_method is not None and self.sync_method not in SYNC_METHODS:
            raise ValueError(f"sync_method must be one of {SYNC_METHODS}, got {self.sync_method!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(
                f"duration must be positive, finite seconds or None, got {self.duration!r}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be from 0 to {MAX_SEED}, got {self.seed}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be 0-65535 or None, got {self.metrics_port!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if not self.commit_timeout > 0:
            raise ValueError(
                f"commit_timeout must be positive seconds, got {self.commit_timeout!r}"
            )


@dataclass(slots=True)
class DemoResult:
    """What a run did, as the tests and the CLI read it."""

    exit_code: int = EXIT_OK
    stop_reason: str = "completed"
    first_step: int = 1
    last_step: int = 0
    resumed_from: int | None = None
    checkpoint_steps: list[int] = field(default_factory=list)
    committed: dict[str, int | None] = field(default_factory=dict)
    rollout_versions: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    device: str | None = None
    sync_method: str | None = None
    metrics_address: str | None = None
    summary: dict[str, Any] | None = None
    save_errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    root: str = ""


def stop_reason(signum: int) -> str:
    """How the last line names a run a signal stopped: ``interrupted`` (Ctrl-C), else by name."""
    if signum == signal.SIGINT:
        return "interrupted"
    return f"terminated by {signal.Signals(signum).name}"


class StartupStopped(KeyboardInterrupt):
    """A stop signal came before the first step: the start-up is abandoned.

    A KeyboardInterrupt, as Ray cuts short a ``ray.get`` for that one alone (and
    raises a plain KeyboardInterrupt in its place: _Stop records the signal).
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.signum,), dict(vars(self)))


class _Stop:
    """What SIGINT, SIGTERM and SIGHUP do to the run, by phase.

    * ``start-up``: nothing is in flight yet, so the start-up is abandoned at once
      (:class:`StartupStopped`), except inside :meth:`held`, which finishes first
      (removing an earlier run's steps is not cut short);
    * ``training``: the loop stops after its current step, and the saves in flight
      finish and commit;
    * ``finishing`` (draining, the summary, shutting down): the run ends as it was
      going to, with the signal's exit status.

    A second SIGINT raises KeyboardInterrupt in any phase (stop at once); a second
    SIGTERM or SIGHUP changes nothing.
    """

    def __init__(self, notify) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.at: float | None = None  # monotonic time of the first signal
        self.phase = "start-up"
        self._notify = notify
        self._previous: dict[int, Any] = {}
        self._held = False

    def install(self) -> None:
        """Take the stop signals (in the main thread only: Python runs handlers there)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def reinstall(self) -> None:
        """Take the signals back if they were taken (ray.init puts in a SIGTERM handler)."""
        if self._previous:
            self.install()

    def record(self, signum: int) -> bool:
        """Note the first stop signal; False when one came before."""
        if self.signum is not None:
            return False
        self.signum = signum
        self.at = time.monotonic()
        self.event.set()
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def exit_code(self) -> int:
        assert self.signum is not None
        return 128 + self.signum

    def check(self) -> None:
        """Raise StartupStopped if a signal came during the start-up."""
        if self.signum is not None and self.phase == "start-up":
            raise StartupStopped(self.signum)

    @contextmanager
    def held(self):
        """A start-up section a signal does not interrupt; it takes effect after it."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        self.check()

    def grace_deadline(self, deadline: float) -> float:
        """``deadline``, or sooner once SIGTERM or SIGHUP asked the run to end."""
        if self.signum in (signal.SIGTERM, signal.SIGHUP):
            return min(deadline, self.at + STOP_GRACE_S)
        return deadline

    def _handle(self, signum, _frame) -> None:
        if not self.record(signum):
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        if self.phase == "start-up":
            if not self._held:
                raise StartupStopped(signum)
        elif self.phase == "training":
            name = signal.Signals(signum).name
            if signum == signal.SIGINT:
                self._notify(
                    f"received {name}: stopping after this step; saves in flight will finish "
                    "and commit (Ctrl-C again to stop at once, leaving them uncommitted)"
                )
            else:
                self._notify(
                    f"received {name}: stopping after this step; saves in flight get "
                    f"{STOP_GRACE_S:.0f} s to finish and commit"
                )


# ----------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------


def _otel_env(cfg: DemoConfig) -> dict[str, str]:
    if cfg.otlp_endpoint:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = cfg.otlp_endpoint
        os.environ.setdefault("OTEL_TRACES_EXPORTER", "otlp")
    return {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}


def _start_ray(cfg: DemoConfig, namespace: str, env: dict[str, str]) -> None:
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
        kwargs["num_cpus"] = max(os.cpu_count() or 1, cfg.world_size + 1)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # A terminal's Ctrl-C reaches the whole foreground process group, which
    # includes the GCS and raylet this call starts; they inherit an ignored
    # SIGINT, so the cluster outlives the first Ctrl-C while saves drain. A
    # driver in a session of its own (as `obsckpt demo` runs it) needs no shield,
    # and keeps a Ctrl-C passed on to it while Ray starts.
    shield = threading.current_thread() is threading.main_thread() and not _own_session()
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


def _own_session() -> bool:
    """Whether this process leads a session without a terminal.

    No terminal's signals reach such a session, so none reach the Ray processes
    it starts either: only a signal sent to the process itself.
    """
    if not hasattr(os, "getsid"):
        return False
    try:
        if os.getsid(0) != os.getpid():
            return False
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return True
    os.close(fd)
    return False


def resolve_plan(cfg: DemoConfig, gpus: int | None = None) -> DemoConfig:
    """Fill in the device, world size and sync method from the GPUs this machine has.

    No GPU (or ``device="cpu"``): the CPU, gloo, 2 ranks, broadcast. One GPU:
    one rank on it and the rollout beside it, weights handed over by CUDA IPC
    (``ipc``). Two or more: a GPU per rank and one for the rollout, NCCL
    broadcast. Explicit settings are kept, and checked against the GPUs.
    """
    import dataclasses

    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if cfg.device != "cpu" and torch.cuda.is_available() else 0
    if cfg.device == "cuda" and gpus == 0:
        raise DemoError("--device cuda, but no CUDA device is visible; use --device cpu")
    if cfg.device == "cpu" or gpus == 0:
        return dataclasses.replace(
            cfg,
            device="cpu",
            world_size=cfg.world_size or 2,
            sync_method=cfg.sync_method or "broadcast",
        )
    sync = cfg.sync_method or ("ipc" if gpus == 1 else "broadcast")
    if sync == "ipc":
        world = cfg.world_size or 1
        if world != 1:
            raise DemoError(
                f"--sync-method ipc on GPUs runs one trainer rank sharing its GPU with the "
                f"rollout; got --world-size {world} (use 1, or --sync-method broadcast)"
            )
    elif sync == "broadcast":
        world = cfg.world_size or max(1, min(2, gpus - 1))
        if world + 1 > gpus:
            raise DemoError(
                f"--sync-method broadcast over NCCL needs a GPU per trainer rank and one for "
                f"the rollout ({world + 1}); this machine has {gpus}. Use --sync-method ipc "
                "(one rank), fewer ranks, or --device cpu"
            )
    else:
        world = cfg.world_size or min(2, gpus)
        if world > gpus:
            raise DemoError(
                f"{world} trainer ranks need {world} GPUs (NCCL needs one per rank); this "
                f"machine has {gpus}"
            )
    return dataclasses.replace(cfg, device="cuda", world_size=world, sync_method=sync)


# ----------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------


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
    stop = _Stop(progress.note)
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
            root = Path(result.root or cfg.ckpt_dir).expanduser()
            result.committed = committed_on_disk(root)
        result.elapsed_s = time.monotonic() - t_start


def _run(cfg: DemoConfig, out: TextIO, progress: Progress, stop: _Stop, result) -> DemoResult:
    cfg = resolve_plan(cfg)
    cfg = _check_endpoints(cfg)
    # Every check, before Ray starts and before anything in the root is removed: a
    # run that cannot start (a bad --address, say) must not have wiped the last one.
    result.root = str(prepare_root(cfg, progress.note, dry_run=True)[0])
    env = _otel_env(cfg)

    import ray

    from obsckpt import CheckpointCoordinator, CheckpointMonitor
    from obsckpt.telemetry import tracing

    namespace = cfg.namespace or f"obsckpt-demo-{uuid.uuid4().hex[:8]}"
    owns_ray = not ray.is_initialized()
    actors: list[Any] = []
    monitor = None
    loop = asyncio.new_event_loop()
    try:
        if owns_ray:
            try:
                _start_ray(cfg, namespace, env)
            except StartupStopped as exc:
                stop.record(exc.signum)
                raise
            stop.reinstall()
        stop.check()
        traced = tracing.requested()  # _otel_env put --otlp-endpoint into os.environ
        if traced:
            tracing.setup_tracing("obsckpt-demo")
        with stop.held():  # starting over removes the earlier run's steps
            root, resumed, state_dict_step = prepare_root(cfg, progress.note)
        result.root = str(root)
        result.resumed_from = resumed or None
        # Step numbers go on from the resumed step: the bar spans this run's steps.
        progress.set_range(resumed, resumed + cfg.steps if cfg.steps else None)
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
        if traced:
            where = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_TRACES_EXPORTER")
            progress.note(f"traces: {where}")

        device = cfg.device
        trainers, rollout, synchronizer, info = _start_actors(
            cfg, namespace, device, env, root, actors
        )
        result.device = info["device"]
        result.sync_method = cfg.sync_method
        progress.note(plan_line(cfg, info))
        where = shlex.quote(str(root))
        progress.note(f"checkpoints: {root}  (inspect with `obsckpt status {where}`)")
        if resumed:
            ray.get([t.load_checkpoint.remote(str(root), resumed) for t in trainers])
            progress.note(f"resumed from committed step {resumed}")
        if synchronizer is not None:
            if cfg.resume:
                # Weight-sync versions restart at the resumed step; checkpoint sync
                # skips the state dicts committed before it (Synchronizer.resume_from).
                ray.get(synchronizer.resume_from.remote(resumed))
            if cfg.sync_method == "checkpoint":
                ray.get([t.start_state_dict_sync.remote(resumed) for t in trainers])
                ray.get(synchronizer.start.remote())
        retrained = resumed
        if (
            cfg.sync_method == "checkpoint"
            and state_dict_step is not None
            and state_dict_step > resumed
        ):
            # Stopped between full checkpoints: the state dicts of the steps trained
            # again are committed already, and the iteration file never goes back.
            retrained = state_dict_step
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
        job = _Job(
            trainers=trainers,
            rollout=rollout,
            synchronizer=synchronizer,
            monitor=monitor,
            coord=CheckpointCoordinator(monitor),
            loop=loop,
            progress=progress,
            stop=stop,
            result=result,
        )
        stop.phase = "training"
        _train(cfg, root, resumed, job, retrained=retrained)
        stop.phase = "finishing"
        progress.close()
        _drain(cfg, trainers, monitor, progress, result, stop)
    except KeyboardInterrupt:
        if stop.phase == "start-up" and stop.signum is not None:
            raise StartupStopped(stop.signum) from None
        progress.close()
        progress.note("stopped at once: saves still in flight are left uncommitted")
        result.stop_reason = "aborted"
        result.exit_code = EXIT_INTERRUPTED
    finally:
        stop.phase = "finishing"
        loop.close()
        started = result.last_step >= result.first_step
        if monitor is not None and result.stop_reason != "aborted":
            if started:
                _report(monitor, result, out, progress)
            elif stop.signum is None:
                progress.note("no summary: no training step ran")
        _shutdown(actors, monitor, owns_ray, patient=stop.signum is None)
        if stop.signum is not None and result.stop_reason != "aborted":
            result.stop_reason = stop_reason(stop.signum)
            result.exit_code = 128 + stop.signum
    return result


def committed_on_disk(root: Path) -> dict[str, int | None]:
    """The steps the iteration files name (None: no file, or one that cannot be read)."""
    from obsckpt import layout, reader
    from obsckpt.errors import IterationFileError

    latest: dict[str, int | None] = {}
    for kind in layout.KINDS:
        try:
            latest[kind] = reader.read_iteration(root, kind)
        except IterationFileError:
            latest[kind] = None
    return latest


def _check_endpoints(cfg: DemoConfig) -> DemoConfig:
    """Check --metrics-host/--metrics-port and --file-sd before anything starts.

    The file_sd path is made absolute here: the monitor actor writes it, and its
    working directory is not the caller's on a joined cluster.
    """
    import dataclasses

    if cfg.metrics_port is not None and not cfg.address:
        check_metrics_endpoint(cfg.metrics_host, cfg.metrics_port)
    if cfg.file_sd:
        cfg = dataclasses.replace(cfg, file_sd=check_file_sd(cfg.file_sd))
    return cfg


def check_metrics_endpoint(host: str, port: int) -> None:
    """Raise DemoError when the monitor could not serve /metrics on ``host:port`` here."""
    import errno

    shown = f"{host or '0.0.0.0'}:{port}"
    # "[::1]", as URLs write an IPv6 literal, is what the metrics server binds as "::1".
    bind_host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        infos = socket.getaddrinfo(
            bind_host or "0.0.0.0", port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise DemoError(
            f"--metrics-host {host!r} is not an address of this machine ({exc.strerror}); "
            "pass an interface address such as 0.0.0.0 or 127.0.0.1"
        ) from None
    family, kind, proto, _name, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        # As the metrics server binds (it reuses addresses), so a port in TIME_WAIT passes.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DemoError(
                    f"--metrics-port {port}: {shown} is already in use; pass another "
                    "--metrics-port (0 picks a free one), or --no-metrics"
                ) from None
            raise DemoError(
                f"/metrics cannot be served on {shown} ({exc.strerror or exc}); pass another "
                "--metrics-host or --metrics-port, or --no-metrics"
            ) from None


def check_file_sd(path: str) -> str:
    """The absolute --file-sd path; DemoError when no file can be written there."""
    target = Path(path).expanduser().resolve()
    if target.is_dir():
        raise DemoError(
            f"--file-sd {target} is a directory; pass the path of a file in it, "
            f"e.g. --file-sd {shlex.quote(str(target / 'obsckpt-demo.json'))}"
        )
    # Missing directories are created by the monitor; the nearest existing one must take them.
    parent = target.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DemoError(
            f"--file-sd {target}: {parent} is a file, not a directory; pass a path whose "
            "directories exist or can be created"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DemoError(
            f"--file-sd {target}: {parent} is not writable by this user; pass a path in a "
            "directory you can write"
        )
    return str(target)


def _steps(first: int, last: int) -> str:
    return f"step {first} is" if first == last else f"steps {first}-{last} are"


def plan_line(cfg: DemoConfig, info: dict) -> str:
    """The first line about the job: ranks, device, model size, sync, save interval."""
    ranks = "1 FSDP2 rank" if cfg.world_size == 1 else f"{cfg.world_size} FSDP2 ranks"
    return (
        f"obsckpt demo: {ranks} ({info['backend']}, {info['device']}), "
        f"Qwen2 with {info['parameters'] / 1e6:.2f} M parameters, weight sync "
        f"{_sync_name(cfg, info)}, full checkpoint every "
        f"{'step' if cfg.save_every == 1 else f'{cfg.save_every} steps'}"
    )


def _sync_name(cfg: DemoConfig, info: dict) -> str:
    if cfg.sync_method == "broadcast":
        return f"broadcast over {info['backend']}"
    if cfg.sync_method == "ipc":
        return "ipc (CUDA IPC, colocated)" if cfg.device == "cuda" else "ipc (shared memory)"
    return cfg.sync_method


def _start_actors(
    cfg: DemoConfig, namespace: str, device: str, env: dict[str, str], root: Path, actors: list
):
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


@dataclass
class _Job:
    """The running demo's actors and helpers, as the training loop uses them."""

    trainers: list[Any]
    rollout: Any
    synchronizer: Any
    monitor: Any
    coord: Any
    loop: asyncio.AbstractEventLoop
    progress: Any
    stop: Any
    result: Any


def _train(cfg, root, resumed: int, job: _Job, *, retrained: int) -> None:
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
        losses = ray.get([t.train_step.remote(step) for t in trainers])
        result.losses.append(losses[0])
        result.last_step = step
        monitor.record_model_version.remote("trainer", step)
        timed_out = cfg.duration is not None and time.monotonic() - t_train >= cfg.duration
        is_last = (last is not None and step == last) or timed_out
        full = step % cfg.save_every == 0 or is_last
        if full:
            with tracing.checkpoint_span(step) as carrier:
                # Each rank's manager registers its own saves before starting them.
                ray.get(
                    [
                        t.save_checkpoint.remote(str(root), step, carrier or None, cfg.keep)
                        for t in trainers
                    ]
                )
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
            version = _sync(cfg, step, trainers, rollout, synchronizer)
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
        if timed_out:
            result.stop_reason = "duration"
            break


def _sync(cfg, step, trainers, rollout, synchronizer) -> int:
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


def _drain(cfg, trainers, monitor, progress, result, stop: _Stop) -> None:
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


def _report(monitor, result: DemoResult, out: TextIO, progress: Progress) -> None:
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


def _shutdown(actors: list[Any], monitor, owns_ray: bool, *, patient: bool = True) -> None:
    """Close the actors, then stop the cluster this run started.

    Not ``patient`` (a signal stopped the run): a few seconds for the actors to
    close, so that the whole stop stays within what a job runner waits.
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
                ray.get(monitor.shutdown.remote(), timeout=wait_s)
            ray.kill(a)
        except Exception:  # noqa: BLE001 - already gone
            pass
    if owns_ray:
        import inspect

        if "wait_for_processes" in inspect.signature(ray.shutdown).parameters:
            # Returns once the cluster's processes are gone: none outlives the run.
            ray.shutdown(wait_for_processes=True)
        else:
            ray.shutdown()
