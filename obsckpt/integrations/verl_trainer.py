"""What a patched verl trainer does around its own save (see :mod:`verl_install`).

``_save_checkpoint`` runs verl's code with its write of the iteration file
diverted (the monitor writes it at commit) and its ``torch.save`` of
``data.pt`` written atomically, never into a committed step; the step is then
submitted, and ``fit`` waits for the last submitted step's commit before it
returns. The driver reaches the job's monitor through one :class:`MonitorLink`
per trainer.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import functools
import inspect
import io
import logging
import os
import threading
import time
from typing import Any

from obsckpt.env import OBSCKPT_VERL_COMMIT_TIMEOUT_S, from_env_if_absent
from obsckpt.integrations import verl_store
from obsckpt.monitor_link import DEFAULT_RPC_TIMEOUT_S, MonitorLink
from obsckpt.options import MonitorOptions
from obsckpt.store import commit, layout, reader
from obsckpt.store.uri import local_root

logger = logging.getLogger("obsckpt.integrations.verl_install")

COMMIT_TIMEOUT_ENV = OBSCKPT_VERL_COMMIT_TIMEOUT_S
DEFAULT_COMMIT_TIMEOUT_S = 1800.0

# Set while verl's _save_checkpoint runs: its writes of the iteration file are diverted
# into this list (their text names the step it saved), not written.
_diverted: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "obsckpt_verl_diverted", default=None
)
# The trainer whose _save_checkpoint runs: its torch.save of data.pt goes through
# _save_data_file.
_saving: contextvars.ContextVar[Any] = contextvars.ContextVar("obsckpt_verl_saving", default=None)


def diverting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
    """``open`` for verl's trainer modules: a write of the iteration file goes nowhere."""
    writes = _diverted.get()
    if (
        writes is not None
        and "w" in mode
        and isinstance(file, str | os.PathLike)
        and os.path.basename(os.fspath(file)) == layout.ITERATION_FILES["checkpoint"]
    ):
        return _DivertedWrite(writes)  # the monitor writes it when the step commits
    return builtins.open(file, mode, *args, **kwargs)


class _DivertedWrite(io.StringIO):
    """What the trainer writes into the iteration file, kept to learn the step it saved."""

    def __init__(self, writes: list[str]) -> None:
        super().__init__()
        self._writes = writes

    def close(self) -> None:
        if not self.closed:
            self._writes.append(self.getvalue())
        super().close()


def wrap_torch_save() -> None:
    """Route the trainer's ``torch.save`` of ``data.pt`` through :func:`_save_data_file`.

    verl's trainers write ``data.pt`` with ``torch.save(state, path)``, which
    writes in place: a job resumed from an older step would rewrite a committed
    step's file (it would no longer match the step's manifest), and a crash
    would leave it torn. Every other call, and every call outside a trainer's
    ``_save_checkpoint``, is ``torch.save`` itself.
    """
    import torch

    original = torch.save
    if getattr(original, "obsckpt", False):
        return

    @functools.wraps(original)
    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = _saving.get()
        root = None if trainer is None else verl_store.store_root(trainer.config.trainer)
        if root is not None and isinstance(f, str | os.PathLike):
            step = verl_store.data_file_step(trainer, root, os.fspath(f))
            if step is not None:
                return verl_store.upload_data_file(
                    trainer,
                    link_for(trainer),
                    root,
                    step,
                    obj,
                    lambda o, b: original(o, b, *args, **kwargs),
                )
        if trainer is not None and _is_data_file(trainer, f):
            return _save_data_file(trainer, obj, os.fspath(f), original, *args, **kwargs)
        return original(obj, f, *args, **kwargs)

    save.obsckpt = True  # type: ignore[attr-defined]
    torch.save = save


def _is_data_file(trainer: Any, f: Any) -> bool:
    """Whether ``f`` is ``<trainer.default_local_dir>/global_step_<N>/data.pt``."""
    if not isinstance(f, str | os.PathLike):
        return False
    path = os.path.abspath(os.fspath(f))
    step_dir = os.path.dirname(path)
    return (
        os.path.basename(path) == layout.DATA_FILE
        and layout.step_of_dir_name(os.path.basename(step_dir)) is not None
        and os.path.dirname(step_dir) == checkpoint_root(trainer)
    )


def _save_data_file(
    trainer: Any, obj: Any, path: str, save: Any, *args: Any, **kwargs: Any
) -> None:
    """Write the trainer's ``data.pt`` atomically, unless its step already holds a committed one.

    A step whose checkpoint the monitor has committed (or a later one) keeps
    its files, as the workers' managers keep theirs: a job resumed from an
    older step retrains it. So does a step whose manifest lists ``data.pt``
    (committed with the step's state dict).
    """
    step_dir = os.path.dirname(path)
    step = layout.step_of_dir_name(os.path.basename(step_dir))
    latest = link_for(trainer).latest_steps().get("checkpoint")
    if (latest is not None and step is not None and step <= latest) or _listed(step_dir):
        logger.info(
            "obsckpt: %s not written again: step %s is committed (latest committed "
            "checkpoint: %s) and a rewrite would change a file its manifest vouches for",
            path,
            step,
            latest,
        )
        return
    buffer = io.BytesIO()
    save(obj, buffer, *args, **kwargs)
    commit.atomic_write(path, buffer.getvalue())


def _listed(step_dir: str) -> bool:
    """Whether the step's manifest lists ``data.pt``."""
    try:
        return any(r.path == layout.DATA_FILE for r in reader.read_manifest(step_dir))
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise RuntimeError(
            f"{os.path.join(step_dir, layout.MANIFEST_NAME)} cannot be read ({exc}), so whether "
            f"the step's {layout.DATA_FILE} is committed is unknown; check the step with "
            "`obsckpt verify`, and move the step directory aside if it is damaged"
        ) from exc


def setup_wrapper(orig: Any) -> Any:
    if inspect.iscoroutinefunction(orig):

        @functools.wraps(orig)
        async def setup_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            monitor_for(self)  # before any worker builds its manager (which looks it up)
            return await orig(self, *args, **kwargs)

        return setup_async

    @functools.wraps(orig)
    def setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        monitor_for(self)
        return orig(self, *args, **kwargs)

    return setup


def save_wrapper(orig: Any) -> Any:
    @functools.wraps(orig)
    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _diverted.get() is not None:  # an override calling verl's: the outer call submits
            return orig(self, *args, **kwargs)
        return save_and_submit(self, lambda: orig(self, *args, **kwargs))

    return _save_checkpoint


def fit_wrapper(orig: Any) -> Any:
    if inspect.iscoroutinefunction(orig):

        @functools.wraps(orig)
        async def fit_async(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = await orig(self, *args, **kwargs)
            await asyncio.to_thread(wait_for_commit, self)
            return result

        return fit_async

    @functools.wraps(orig)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = orig(self, *args, **kwargs)
        wait_for_commit(self)
        return result

    return fit


def checkpoint_root(trainer: Any) -> str:
    """The trainer's checkpoint root: its ``s3://`` one (see :mod:`verl_store`), else
    ``trainer.default_local_dir`` as an absolute path (verl resolves it against the cwd)."""
    remote = verl_store.store_root(trainer.config.trainer)
    if remote is not None:
        return remote
    return local_root(trainer.config.trainer.default_local_dir, "trainer.default_local_dir")


def monitor_for(trainer: Any) -> Any:
    """The job's monitor actor for this trainer's checkpoint root (created if absent)."""
    monitor = getattr(trainer, "_obsckpt_monitor", None)
    if monitor is None:
        from obsckpt.monitor import CheckpointMonitor
        from obsckpt.monitor.lifecycle import start_actor

        hdfs = trainer.config.trainer.get("default_hdfs_dir", None)
        if hdfs and verl_store.store_root(trainer.config.trainer) != str(hdfs).rstrip("/"):
            raise ValueError(
                f"trainer.default_hdfs_dir={hdfs!r}: obsckpt's verl integration writes "
                "checkpoints to a local directory or to s3://bucket/prefix, not HDFS (verl 0.9 "
                "cannot resume from there either); set it to null or to an s3:// URL"
            )
        # The options from the job's own config (`+obsckpt.metrics_port=9400` on verl's
        # command line), each overridden by its OBSCKPT_* variable; all of them reach the
        # monitor. Created in init_workers, before fit's _load_checkpoint: a mirror
        # restores into an empty root first, and verl's own resume then finds its step.
        options = MonitorOptions.from_settings(
            checkpoint_root(trainer),
            trainer.config.get("obsckpt", None),
            trainer_submits=True,  # this trainer submits each step (save_and_submit)
        )
        monitor = start_actor(CheckpointMonitor, options)
        trainer._obsckpt_monitor = monitor
    return monitor


def link_for(trainer: Any) -> MonitorLink:
    """The driver's calls to the job's monitor (:func:`monitor_for`), made once per trainer."""
    link = getattr(trainer, "_obsckpt_link", None)
    if link is None:
        link = MonitorLink(monitor_for(trainer), rank=None, rpc_timeout=DEFAULT_RPC_TIMEOUT_S)
        trainer._obsckpt_link = link
    return link


class LoggerMetrics:
    """What obsckpt adds to the metrics verl's ``trainer.logger`` logs at each step.

    Beside verl's own ``timing_s/save_checkpoint`` (which, with obsckpt, is the
    snapshot's stall and the submission): ``obsckpt/save_stall_s`` of the save
    since the last log, and, once the monitor has committed a step not yet
    reported, ``obsckpt/committed_step`` and ``obsckpt/commit_lag_s`` (from the
    step's last file being durable to its commit: the commit's fsyncs and renames).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stall_s: float | None = None
        self._link: MonitorLink | None = None
        self._awaiting: int | None = None  # the step submitted and not yet seen committed
        self._reported: int | None = None
        self._warned = False

    def saved(self, link: MonitorLink, seconds: float, step: int) -> None:
        with self._lock:
            self._link = link
            self._stall_s = seconds
            self._awaiting = step

    def drain(self) -> dict[str, float]:
        """The metrics not logged yet; the monitor is asked only while a submitted step
        has not been seen committed."""
        with self._lock:
            out: dict[str, float] = {}
            if self._stall_s is not None:
                out["obsckpt/save_stall_s"] = self._stall_s
                self._stall_s = None
            if self._link is None or self._awaiting is None:
                return out
            try:
                last = self._link.status()["last_commit"].get("checkpoint")
            except Exception as exc:  # noqa: BLE001 - a log line must not fail the step
                if not self._warned:
                    logger.warning("obsckpt: cannot read the last commit for the logger: %s", exc)
                    self._warned = True
                return out
            if last and last["step"] != self._reported:
                self._reported = last["step"]
                out["obsckpt/committed_step"] = float(last["step"])
                out["obsckpt/commit_lag_s"] = last["committed_at"] - last["whole_at"]
            if last and last["step"] >= self._awaiting:
                self._awaiting = None
            return out


LOGGER_METRICS = LoggerMetrics()


def tracking_log_wrapper(orig: Any) -> Any:
    """verl's ``Tracking.log`` with :data:`LOGGER_METRICS` merged into each step's data."""

    @functools.wraps(orig)
    def log(self: Any, data: dict[str, Any], step: int, *args: Any, **kwargs: Any) -> Any:
        extra = LOGGER_METRICS.drain()
        return orig(self, {**data, **extra} if extra else data, step, *args, **kwargs)

    log.__obsckpt_wrapped__ = True  # type: ignore[attr-defined]
    return log


def load_wrapper(orig: Any) -> Any:
    """verl's trainer ``_load_checkpoint``, its own ``torch.load`` calls verified.

    verl's driver reads the resumed step's ``data.pt`` (the dataloader's state)
    with ``weights_only=False``; inside, every load goes through
    :mod:`obsckpt.loading`: the file's step must be committed, the file listed in
    its manifest and matching it, and it is loaded with ``weights_only=True``.
    """
    from obsckpt.store import loading

    @functools.wraps(orig)
    def _load_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        root = verl_store.store_root(self.config.trainer)
        if root is not None:  # verl's own joins the URL to the working directory
            return verl_store.load_checkpoint(self, root)
        with loading.verified_torch_load():
            return orig(self, *args, **kwargs)

    return _load_checkpoint


def save_and_submit(trainer: Any, save: Any) -> Any:
    """Run verl's ``_save_checkpoint`` (``save``) with the iteration file diverted, then submit.

    A V1 trainer's ``checkpoint_callback`` is called after the step is
    committed: verl calls it once the iteration file names the step
    (``async_save=False``: the checkpoint is durable), and a callback that
    uploads or registers the step must not see files still being written.
    verl's default callback does nothing, so it does not make the save wait.
    """
    link = link_for(trainer)
    remote = verl_store.store_root(trainer.config.trainer) is not None
    if remote:
        verl_store.refuse_async_modes(trainer, checkpoint_root(trainer))
    writes: list[str] = []
    callback = getattr(trainer, "checkpoint_callback", None)
    deferred: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    if callback is not None:
        trainer.checkpoint_callback = _DeferredCallback(deferred)
    token = _diverted.set(writes)
    saving = _saving.set(trainer)
    started = time.perf_counter()
    try:
        with verl_store.no_local_mkdir() if remote else contextlib.nullcontext():
            result = save()
        stall_s = time.perf_counter() - started
    finally:
        _saving.reset(saving)
        _diverted.reset(token)
        if callback is not None:
            trainer.checkpoint_callback = callback
    # The step the trainer named in the iteration file is the one it saved (verl's
    # fully asynchronous trainer saves at its parameter version, not global_steps).
    step = _written_step(writes)
    if step is None:  # nothing written (Megatron's async_save path): verl's own counter
        step = int(trainer.global_steps)
    if not remote:
        step_dir = layout.step_dir(checkpoint_root(trainer), step)
        data = step_dir / layout.DATA_FILE  # verl's dataloader state, written with torch.save
        if data.exists():
            commit.fsync_file(data)
        # The V1 trainer's asynchronous modes save the prompts in flight here.
        _fsync_tree(step_dir / "transfer_queue")
        if step_dir.is_dir():
            commit.fsync_dir(step_dir)
    link.monitor_step(step, False)
    trainer._obsckpt_last_submitted = step
    LOGGER_METRICS.saved(link, stall_s, step)
    if deferred and not _is_noop_callback(callback):
        wait_for_commit(trainer)
    if callback is not None:  # only then were calls deferred
        for args, kwargs in deferred:
            callback.on_save(*args, **kwargs)
    return result


def _written_step(writes: list[str]) -> int | None:
    text = writes[-1].strip() if writes else ""
    return int(text) if text.isdigit() and text.isascii() else None


class _DeferredCallback:
    """Stands in for a V1 trainer's ``checkpoint_callback`` while verl's save runs."""

    def __init__(self, calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self._calls = calls

    def on_save(self, *args: Any, **kwargs: Any) -> None:
        self._calls.append((args, kwargs))


def _is_noop_callback(callback: Any) -> bool:
    try:
        from verl.trainer.ppo.checkpoint_callback import CheckpointCallback
    except ImportError:
        return False
    return type(callback).on_save is CheckpointCallback.on_save


def _fsync_tree(root: Any) -> None:
    if not root.is_dir():
        return
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            commit.fsync_file(os.path.join(dirpath, name))
        commit.fsync_dir(dirpath)


def wait_for_commit(trainer: Any, timeout: float | None = None, poll_s: float = 0.2) -> int | None:
    """Wait until the last step this trainer submitted is committed; returns it.

    Raises:
        RuntimeError: the step failed or was abandoned (the error names why).
        TimeoutError: not committed within ``timeout`` seconds (default
            ``OBSCKPT_VERL_COMMIT_TIMEOUT_S`` or 1800).
    """
    step = getattr(trainer, "_obsckpt_last_submitted", None)
    if step is None:
        return None
    timeout = from_env_if_absent(timeout, COMMIT_TIMEOUT_ENV, DEFAULT_COMMIT_TIMEOUT_S, float)
    outcome = link_for(trainer).wait_committed(step, "checkpoint", timeout, poll_s)
    if outcome is None:
        return step
    what, detail = outcome
    if what != "timeout":
        raise RuntimeError(f"checkpoint of step {step} {what}: {detail}")
    raise TimeoutError(
        f"checkpoint of step {step} not committed after {timeout:.0f} s ({detail}); raise "
        f"{COMMIT_TIMEOUT_ENV} or check the workers' logs"
    )
