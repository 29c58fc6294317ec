"""Synchronizer: the Ray actor that hands the trainer's latest weights to the rollout side.

Two ways in, one version counter (the training step):

* memory sync: trainer rank 0 calls :meth:`Synchronizer.set_model_state_dict`
  with the full state dict, or every rank :meth:`Synchronizer.set_model_shard`
  with its shard (:mod:`obsckpt.sync.shard_publish`: merged here);
* checkpoint sync: the actor watches ``latest_state_dict_iteration.txt`` under
  ``default_local_dir`` and, when it names a newer step, loads that step's
  model (``global_step_<N>/actor/model.safetensors``, Trinity-RFT 0.6.0's, or
  the shards ``model_world_size_<W>_rank_<R>.pt``, merged into a full state
  dict) and publishes it. It reads only what the
  iteration file names, which the monitor writes after every file of the step
  is durable, so it never sees a partial step. A step that cannot be read
  (missing rank, checksum mismatch, unpicklable file) is logged, counted in
  :meth:`Synchronizer.status` and skipped; the watcher keeps going.

The rollout side calls :meth:`Synchronizer.wait_new_model_state_dict` and
:meth:`Synchronizer.get_model_state_dict`. Model versions, checkpoint-load
durations (``obsckpt_state_dict_upload_duration_seconds``) and memory-upload
durations reported by the trainer go to the job's monitor when one runs in
the namespace (one scrape target), else to a registry of this actor
(:meth:`Synchronizer.metrics_text`).

Two APIs, one class. Created with ``get_actor(namespace, default_local_dir)``
(obsckpt's, and older Trinity-RFT's ``get_actor(config)`` with a config of
only ``ray_namespace``) it holds no version until one is published (None)
and ``wait_new_model_state_dict`` waits as long as its ``timeout``. Created
from a Trinity-RFT 0.6.0 config (it has a ``synchronizer`` section) it is
that release's synchronizer: a detached actor (see :mod:`obsckpt.sync.detached`),
version 0 before anything is published, checkpoint sync of
``config.checkpoint_job_dir`` for ``sync_method: checkpoint``, waits bounded
by ``synchronizer.sync_timeout``, and the status handshakes of
:mod:`obsckpt.sync.trinity_api`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from obsckpt import validators
from obsckpt.errors import IterationFileError, StoreError
from obsckpt.options import SYNCHRONIZER_ACTOR_NAME
from obsckpt.store import layout
from obsckpt.store.uri import is_remote, root_or_url
from obsckpt.sync import detached, naming
from obsckpt.sync.delta_memory import DeltaMemorySync
from obsckpt.sync.detached import ModuleWatch
from obsckpt.sync.shard_publish import ShardMemorySync
from obsckpt.sync.shards import state_dict_meta
from obsckpt.sync.step_source import StepSource, step_source
from obsckpt.sync.telemetry import WeightSyncTelemetry
from obsckpt.sync.telemetry_route import TelemetryRoute
from obsckpt.sync.trinity_api import (
    DEFAULT_SYNC_TIMEOUT_S,
    RoleStates,
    TrinityProtocol,
    TrinitySettings,
    is_trinity_config,
)
from obsckpt.telemetry import attributes as span_attr
from obsckpt.telemetry import tracing
from obsckpt.telemetry.metrics import ROLLOUT, TRAINER, disable_created_series

logger = logging.getLogger(__name__)

ACTOR_NAME = SYNCHRONIZER_ACTOR_NAME
# Steps that could not be loaded, kept for status(); older ones are forgotten
# (load_failures counts them all). The iteration file never goes backwards, so
# a forgotten step is never named again.
_KEEP_FAILED = 64


# ----------------------------------------------------------------------
# The actor
# ----------------------------------------------------------------------


class Synchronizer(TrinityProtocol, DeltaMemorySync, ShardMemorySync):
    """Holds the latest model state dict and its version for the rollout side; one per job.

    Create it with :meth:`get_actor`; the constructor runs inside the actor.

    Args:
        default_local_dir: the checkpoint root to watch; None disables checkpoint sync.
            A Trinity-RFT config here (Trinity 0.6.0's ``Synchronizer(config,
            module_ref)``) takes the root, namespace and timeouts from it.
        module_ref: the actor that asked for this synchronizer (Trinity 0.6.0's form).
        settings: what :meth:`get_actor` read from a Trinity 0.6.0 config.
        sync_timeout_s: the longest wait in an NCCL handshake (a Trinity config's
            ``synchronizer.sync_timeout`` wins).
        poll_interval_s: how often to read the state-dict iteration file.
        namespace: the job's Ray namespace, where the monitor is looked up.
        trace_exporter: exporter name for this process's spans (default: ``OTEL_*``).
        registry: Prometheus registry for the local fallback metrics (tests).
    """

    def __init__(
        self,
        default_local_dir: Any = None,
        module_ref: Any = None,
        *,
        poll_interval_s: float = 1.0,
        namespace: str | None = None,
        trace_exporter: str | None = None,
        registry: Any = None,
        settings: TrinitySettings | None = None,
        sync_timeout_s: float = DEFAULT_SYNC_TIMEOUT_S,
    ) -> None:
        if not poll_interval_s > 0:
            raise ValueError(f"poll_interval_s must be positive seconds, got {poll_interval_s!r}")
        if not sync_timeout_s > 0:
            raise ValueError(f"sync_timeout_s must be positive seconds, got {sync_timeout_s!r}")
        if default_local_dir is not None and not isinstance(default_local_dir, (str, os.PathLike)):
            config, default_local_dir = default_local_dir, None  # Trinity: Synchronizer(config)
            if is_trinity_config(config):
                settings = TrinitySettings.from_config(config)
            namespace = namespace or naming.namespace_of(None, config)
        self._settings = settings
        # Where published versions live (get_latest_model_path), watched or not.
        self._model_root: str | None = None
        if settings is not None:
            default_local_dir = settings.watch_root
            namespace = namespace or settings.namespace
            sync_timeout_s = settings.sync_timeout_s
            self._model_root = settings.checkpoint_job_dir
        elif default_local_dir is not None:
            self._model_root = os.fspath(default_local_dir)
        # A local directory, or an s3:// root's URL; its committed steps through _steps.
        self.root: Path | str | None = None
        self._steps: StepSource | None = None
        if default_local_dir is not None:
            remote = is_remote(default_local_dir)
            self.root = os.fspath(default_local_dir) if remote else Path(default_local_dir)
            self._steps = step_source(os.fspath(self.root))
        self.poll_interval_s = float(poll_interval_s)
        self.sync_timeout_s = float(sync_timeout_s)
        self.namespace = namespace
        self._state_dict: dict[str, torch.Tensor] | str | None = None
        # Trinity 0.6.0 holds version 0 before anything is published; obsckpt's API None.
        self._version: int | None = 0 if settings is not None else None
        self._model_path: str | None = None
        self._roles = RoleStates()
        self._modules = ModuleWatch(self.shutdown)
        self._pending_modules = [module_ref] if module_ref is not None else []
        self._source: str | None = None
        self._published_at: float | None = None
        self._rollout_version: int | None = None
        self._loaded_step: int | None = None
        self._failed_steps: dict[int, str] = {}
        # Steps up to this one were committed before the trainer resumed (resume_from).
        self._stale_upto: int | None = None
        self._load_failures = 0
        self._last_error: str | None = None
        self._changed: asyncio.Condition | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._poll_lock: asyncio.Lock | None = None
        # This process is obsckpt's (an actor): its fallback /metrics text has no use for
        # the _created series (a user's process keeps them: nothing is switched at import).
        disable_created_series()
        self._telemetry_route = TelemetryRoute(namespace, registry)
        self._init_delta()
        if tracing.requested(trace_exporter):
            tracing.setup_tracing("obsckpt-synchronizer", exporter=trace_exporter)

    @classmethod
    def get_actor(
        cls,
        namespace: Any = None,
        default_local_dir: str | os.PathLike[str] | None = None,
        *,
        poll_interval_s: float = 1.0,
        trace_exporter: str | None = None,
        watch: bool = True,
        config: Any = None,
    ) -> Any:
        """The job's synchronizer actor, named ``synchronizer`` (created if absent).

        Arguments other than ``namespace`` only matter when the actor is created.
        With ``watch`` (and a ``default_local_dir``), checkpoint sync starts at once.
        Trinity's call shape works too: ``get_actor(config)`` or
        ``get_actor(config=config)`` take the namespace from
        ``config.ray_namespace`` (an explicit ``namespace=`` wins); those are
        the only arguments Trinity-RFT passes. Any other keyword is refused
        (``TypeError`` naming it), so a misspelt one never goes unnoticed.

        Returns:
            The actor's Ray handle: call its methods with ``.remote()``. Typed
            ``Any``, as Ray's own handle types do not describe this class's methods.

        A Trinity-RFT 0.6.0 config (one with a ``synchronizer`` section) makes
        that release's synchronizer: detached (``lifetime="detached"``), its
        checkpoint root ``config.checkpoint_job_dir`` when
        ``synchronizer.sync_method`` is ``checkpoint``, version 0 before
        anything is published, waits bounded by ``synchronizer.sync_timeout``.
        Called inside an actor (Trinity's trainer and explorer), that actor is
        tracked (``add_module``): the synchronizer ends once every tracked actor
        is dead. Otherwise it ends with ``shutdown()`` or
        ``python -m obsckpt.sync.lifetime --namespace <ns>``.

        Raises:
            ValueError: a synchronizer already runs in the namespace watching
                another root (or none) while ``default_local_dir`` is given.
            TypeError: ``config.ray_namespace`` is not a string, or a keyword is unknown.
        """
        import ray

        if namespace is not None and not isinstance(namespace, str):
            config, namespace = namespace, None  # Trinity: get_actor(config)
        namespace = naming.namespace_of(namespace, config)
        settings = TrinitySettings.from_config(config) if is_trinity_config(config) else None
        options: dict[str, Any] = dict(
            name=ACTOR_NAME, get_if_exists=True, max_concurrency=1000, num_cpus=0
        )
        if namespace:
            options["namespace"] = namespace
        if settings is not None:
            options["lifetime"] = "detached"  # as Trinity 0.6.0's; see obsckpt.sync.detached
        if default_local_dir is not None:
            # As the caller sees it, not against the actor's working directory.
            default_local_dir = root_or_url(default_local_dir)
        actor: Any = (
            ray.remote(cls)
            .options(**options)
            .remote(
                default_local_dir,
                poll_interval_s=poll_interval_s,
                namespace=namespace,
                trace_exporter=trace_exporter,
                settings=settings,
            )
        )
        if default_local_dir is not None:
            naming.check_root(actor, default_local_dir, namespace)
        if settings is not None:
            module = detached.current_actor()
            if module is not None:
                ray.get(actor.add_module.remote(module))
        if watch:
            ray.get(actor.start.remote())
        return actor

    # -- lifecycle -----------------------------------------------------

    async def checkpoint_root(self) -> str | None:
        """The checkpoint root this synchronizer watches (None: memory sync only)."""
        return str(self.root) if self.root is not None else None

    async def start(self) -> bool:
        """Start watching the checkpoint root (idempotent); False when there is none."""
        self._condition()
        for module in self._pending_modules:
            self._modules.add(module)
        self._pending_modules.clear()
        if self.root is None:
            return False
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name="obsckpt-synchronizer-watch"
            )
        return True

    async def stop(self) -> None:
        """Stop watching; memory sync keeps working."""
        if self._watcher is not None:
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
            self._watcher = None

    async def add_module(self, module_ref: Any) -> None:
        """Track ``module_ref`` (an actor): once every tracked actor is dead, this one ends."""
        self._modules.add(module_ref)

    async def shutdown(self) -> None:
        """End this synchronizer: stop watching, wake every waiter, and exit the actor."""
        await self.stop()
        self._modules.cancel()
        await self.set_trainer_status("stopped")
        asyncio.get_running_loop().call_later(0.2, detached.exit_this_actor)

    # -- memory sync ---------------------------------------------------

    async def set_model_state_dict(
        self,
        model_state_dict: dict[str, torch.Tensor] | str | None,
        trainer_step: int,
    ) -> bool:
        """Publish the trainer's full state dict as version ``trainer_step``.

        A string is published as it is (Trinity's Tinker backend publishes its
        remote sampler path); ``get_model_state_dict`` hands it back.

        ``None`` publishes the version without weights (the rollout side's own
        initial weights are current, as at the start of training). ``None``
        with a step older than the held version is the trainer announcing that
        it resumed from that step: versions restart there (see
        :meth:`resume_from`). A state dict older than the held version is
        ignored (returns False).
        """
        validators.validate_step(trainer_step, "trainer_step")
        if self._version is not None and trainer_step < self._version:
            if model_state_dict is None:
                await self.resume_from(trainer_step)
                return True
            logger.warning(
                "obsckpt: ignoring the state dict of step %d: the synchronizer already holds "
                "step %d and versions never go backwards",
                trainer_step,
                self._version,
            )
            return False
        return await self._publish(model_state_dict, trainer_step, "memory")

    async def resume_from(self, step: int) -> None:
        """The trainer resumed from ``step``: weight-sync versions restart there.

        The held weights belong to steps the resumed run trains again, so they are
        dropped and ``step`` is held without weights; the trainer's next uploads
        (``step + 1`` on) are published. Checkpoint sync skips the steps the
        state-dict iteration file names up to now (files of the run before the
        resume; the file never goes backwards) and loads the first step committed
        after them.
        """
        validators.validate_step(step, "step")
        stale = [v for v in (self._version, self._loaded_step) if v is not None]
        if self._steps is not None:
            try:
                on_disk = await asyncio.to_thread(self._steps.committed)
            except (IterationFileError, StoreError):
                on_disk = None
            if on_disk is not None:
                stale.append(on_disk)
        self._stale_upto = max(stale, default=None)
        # The rollout's version only rises between resumes; kept, the pre-resume one
        # would hide every version the rollout fetches until the trainer passes it
        # (and the lag, trainer - rollout, would read negative meanwhile).
        self._rollout_version = None
        logger.info(
            "obsckpt: trainer resumed from step %d; versions restart there (checkpoint sync "
            "resumes after step %s)",
            step,
            self._stale_upto,
        )
        await self._publish(None, step, "resume")

    async def get_model_state_dict(
        self,
    ) -> tuple[dict[str, torch.Tensor] | str | None, int | None]:
        """``(state_dict, version)``; the caller is taken to be the rollout side."""
        if self._version is not None:
            self._report_rollout(self._version)
        return self._state_dict, self._version

    async def wait_new_model_state_dict(
        self,
        current_version: int | None,
        timeout: float | bool | None = None,
        *,
        no_wait: bool = False,
    ) -> int | None:
        """Wait until a version newer than ``current_version`` is held; return the held version.

        Returns at once if one is already held. After ``timeout`` seconds
        (None waits forever, 0 does not wait) it returns the held version
        anyway, which is then not newer: compare it with ``current_version``.
        ``no_wait=True`` is ``timeout=0`` (Trinity's keyword); a bool in the
        second place is Trinity's positional ``no_wait``, never a timeout.

        Created from a Trinity-RFT 0.6.0 config and called as that release
        calls it (``current_version`` only), it is that release's wait: the
        caller counts as an explorer requiring a sync meanwhile
        (``explorer_requires_sync``), it returns at once when the trainer is
        stopped, when notified (a publish, ``notify_no_new_model_state_dict``,
        a stopping trainer or explorer), and raises ``asyncio.TimeoutError``
        after ``synchronizer.sync_timeout`` seconds.

        Raises:
            ValueError: (Trinity 0.6.0's form) ``current_version`` is newer than the held one.
        """
        if isinstance(timeout, bool):  # Trinity: wait_new_model_state_dict(version, no_wait)
            no_wait, timeout = no_wait or timeout, None
        if self._settings is not None and timeout is None and not no_wait:
            return await self._wait_as_trinity(current_version)
        if no_wait:
            timeout = 0
        cond = self._condition()
        floor = -1 if current_version is None else current_version

        def newer() -> bool:
            return self._version is not None and self._version > floor

        async with cond:
            if not newer() and timeout != 0:
                try:
                    await asyncio.wait_for(cond.wait_for(newer), timeout)
                except asyncio.TimeoutError:
                    pass
        return self._version

    async def get_state_dict_meta(self) -> list[tuple[str, str, tuple[int, ...]]] | None:
        """``(name, dtype, shape)`` of the held state dict, or None when there is none."""
        if not isinstance(self._state_dict, dict):
            return None
        return state_dict_meta(self._state_dict)

    async def get_version(self) -> int | None:
        return self._version

    # -- measurements ----------------------------------------------------

    async def record_upload(self, seconds: float) -> None:
        """The trainer reports how long a memory upload took (measured on its side)."""
        self._telemetry().upload(seconds)

    async def report_rollout_version(self, version: int) -> None:
        """The rollout side reports the version it now runs (e.g. after a broadcast)."""
        self._report_rollout(version)

    async def metrics_text(self) -> str:
        """This actor's local metrics (used only when no monitor runs in the namespace)."""
        from prometheus_client import generate_latest

        local = self._telemetry_route.local_metrics
        if local is None:
            return ""
        return generate_latest(local.registry).decode()

    async def status(self) -> dict[str, Any]:
        """Version held and where it came from, checkpoint-sync progress and failures."""
        return {
            "version": self._version,
            "source": self._source,
            "published_at": self._published_at,
            "rollout_version": self._rollout_version,
            "root": str(self.root) if self.root is not None else None,
            "watching": self._watcher is not None and not self._watcher.done(),
            "loaded_step": self._loaded_step,
            "load_failures": self._load_failures,
            "failed_steps": dict(self._failed_steps),
            "last_error": self._last_error,
            "telemetry": "monitor" if self._telemetry_route.monitor is not None else "local",
            "api": "trinity-0.6" if self._settings is not None else "obsckpt",
            "roles": self._roles.view(),
            "modules": len(self._modules.modules),
            "model_path": self._model_path,
        }

    async def debug_spans(self) -> list[dict[str, Any]]:
        """Spans this process recorded with the ``memory`` exporter (for tests)."""
        return tracing.finished_spans()

    async def poll_once(self) -> int | None:
        """Check the iteration file now (the watcher does this every ``poll_interval_s``)."""
        await self._poll()
        return self._version

    # -- internals -------------------------------------------------------

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    def _path_of(self, step: int) -> str | None:
        if self._model_root is None:
            return None
        if is_remote(self._model_root):
            return f"{self._model_root}/{layout.step_dir_name(step)}/{layout.MODEL_SUBDIR}"
        return os.fspath(layout.model_dir(self._model_root, step))

    async def _publish(
        self, state_dict: dict[str, torch.Tensor] | str | None, version: int, source: str
    ) -> bool:
        """Hold ``version``; False (nothing changes) when a newer one got in first.

        Checked again here, under the lock: a checkpoint load or a memory
        upload may have waited for it while another publish went through.
        Only a resume moves the version back.
        """
        cond = self._condition()
        async with cond:
            held = self._version
            if source != "resume" and held is not None:
                if version < held or (version == held and source == "checkpoint"):
                    logger.warning(
                        "obsckpt: not publishing step %d (%s sync): the synchronizer already "
                        "holds step %d and versions never go backwards",
                        version,
                        source,
                        held,
                    )
                    return False
            old, self._state_dict = self._state_dict, state_dict
            self._version = version
            self._published(old, held, source)
            self._model_path = self._path_of(version)
            self._source = source
            self._published_at = time.time()
            cond.notify_all()
        self._telemetry().model_version(TRAINER, version)
        logger.info("obsckpt: synchronizer holds step %d (%s sync)", version, source)
        return True

    def _report_rollout(self, version: int) -> None:
        if self._rollout_version is None or version >= self._rollout_version:
            self._rollout_version = version
            self._telemetry().model_version(ROLLOUT, version)

    def _telemetry(self) -> WeightSyncTelemetry:
        return self._telemetry_route.get()

    async def _watch(self) -> None:
        while True:
            try:
                await self._poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watcher must survive anything
                self._last_error = f"{type(exc).__name__}: {exc}"
                logger.exception("obsckpt: synchronizer poll failed")
            await asyncio.sleep(self.poll_interval_s)

    async def _poll(self) -> None:
        if self._steps is None:
            return
        if self._poll_lock is None:
            self._poll_lock = asyncio.Lock()
        async with self._poll_lock:
            await self._poll_locked(self._steps)

    async def _poll_locked(self, steps: StepSource) -> None:
        try:
            step = await asyncio.to_thread(steps.committed)
        except (IterationFileError, StoreError) as exc:
            self._last_error = str(exc)
            return
        if step is None or step in self._failed_steps:
            return
        if self._version is not None and step <= self._version:
            return
        if self._stale_upto is not None and step <= self._stale_upto:
            return
        await self._load_step(steps, step)

    async def _load_step(self, steps: StepSource, step: int) -> None:
        t0 = time.perf_counter()
        try:
            with tracing.span("obsckpt.upload", attributes={span_attr.STEP: step}) as sp:
                state_dict = await asyncio.to_thread(steps.load, step)
                nbytes = sum(
                    t.numel() * t.element_size()
                    for t in state_dict.values()
                    if isinstance(t, torch.Tensor)
                )
                sp.set_attribute(span_attr.BYTES, nbytes)
        except Exception as exc:  # noqa: BLE001 - a bad step is skipped, not fatal
            if await asyncio.to_thread(steps.removed_by_retention, step):
                return  # nothing is wrong: a newer step is next
            msg = f"step {step}: {exc}"
            self._failed_steps[step] = str(exc)
            if len(self._failed_steps) > _KEEP_FAILED:
                del self._failed_steps[min(self._failed_steps)]
            self._load_failures += 1
            self._last_error = msg
            logger.error(
                "obsckpt: synchronizer skips committed step %d, its model shards in %s cannot "
                "be used: %s",
                step,
                steps.where(step),
                exc,
            )
            return
        seconds = time.perf_counter() - t0
        if self._version is not None and step <= self._version:
            return  # a memory upload overtook this load
        self._telemetry().upload(seconds)
        if await self._publish(state_dict, step, "checkpoint"):
            self._loaded_step = step
