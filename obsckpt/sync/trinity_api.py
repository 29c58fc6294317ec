"""Trinity-RFT 0.6.0's synchronizer protocol, on obsckpt's :class:`~obsckpt.sync.Synchronizer`.

Trinity 0.6.0's trainer, explorer and rollout models drive the synchronizer
with status handshakes (``set_trainer_status``, ``set_explorer_status``), sync
decisions (``explorer_requires_sync``, ``trainer_requires_weight_sync``,
``ready_to_nccl_sync``), the NCCL group's setup and teardown, and lookups
(``get_latest_model_version``, ``get_latest_model_path``,
``get_model_state_dict_iterator``). :class:`TrinityProtocol` holds those
methods; the Synchronizer inherits them, so they are actor methods.

A synchronizer created from a Trinity config (``get_actor(config)`` with a
config that has a ``synchronizer`` section, or ``Synchronizer(config,
module_ref)``) follows Trinity 0.6.0 wherever the two APIs disagree: version 0
before anything is published, and ``wait_new_model_state_dict(version)``
waiting at most ``synchronizer.sync_timeout`` (then ``asyncio.TimeoutError``).
:class:`TrinitySettings` is what it takes from the config.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from obsckpt import validators
from obsckpt.store import layout
from obsckpt.telemetry.metrics import TRAINER

if TYPE_CHECKING:
    from obsckpt.sync.telemetry import WeightSyncTelemetry

logger = logging.getLogger(__name__)

RUNNING, REQUIRE_SYNC, STOPPED = "running", "require_sync", "stopped"
_STATUSES = (RUNNING, REQUIRE_SYNC, STOPPED)
# Trinity's defaults (trinity.common.config.SynchronizerConfig, constants).
DEFAULT_SYNC_TIMEOUT_S = 3600.0
DEFAULT_GROUP_NAME = "rollout_weight_sync"


async def settle_checkpoints(namespace: str | None) -> None:
    """Wait for the monitor of ``namespace`` (if one runs) to commit what was saved and
    copy it to its mirror (:meth:`~obsckpt.monitor.CheckpointMonitor.settle`); logged."""
    import ray

    from obsckpt.monitor.mirror import SETTLE_WAIT_S
    from obsckpt.options import MONITOR_ACTOR_NAME

    try:
        monitor = ray.get_actor(MONITOR_ACTOR_NAME, namespace=namespace or None)
    except ValueError:
        return  # no monitor: nothing of the job's checkpoints to wait for
    try:
        out = await monitor.settle.remote(SETTLE_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - a monitor without settle, or gone: go on
        logger.warning("obsckpt: the trainer stopped; its monitor could not be waited for: %s", exc)
        return
    if not (out["committed"] and out["mirrored"]):
        logger.warning(
            "obsckpt: the trainer stopped before its last steps were committed and mirrored "
            "(committed: %s, mirrored: %s; mirror: %s)",
            out["committed"],
            out["mirrored"],
            out["mirror"],
        )


def is_trinity_config(config: Any) -> bool:
    """Whether ``config`` is a Trinity-RFT 0.6.0 config (it has a ``synchronizer`` section)."""
    return config is not None and getattr(config, "synchronizer", None) is not None


def _value(enum_or_str: Any) -> str | None:
    """A Trinity enum's value (``SyncMethod.CHECKPOINT`` -> ``"checkpoint"``), lower case."""
    if enum_or_str is None:
        return None
    return str(getattr(enum_or_str, "value", enum_or_str)).lower()


@dataclass(kw_only=True, slots=True, frozen=True)
class TrinitySettings:
    """What a Synchronizer takes from a Trinity 0.6.0 config (plain values: no trinity import)."""

    namespace: str | None = None
    checkpoint_job_dir: str | None = None
    sync_method: str | None = None
    sync_timeout_s: float = DEFAULT_SYNC_TIMEOUT_S
    mode: str | None = None
    trainer_type: str | None = "verl"
    trainer_name: str = "trainer"
    explorer_name: str = "explorer"
    group_name: str = DEFAULT_GROUP_NAME
    explorer_world_size: int | None = None

    def __post_init__(self) -> None:
        if not self.sync_timeout_s > 0:
            raise ValueError(
                f"synchronizer.sync_timeout must be positive seconds, got {self.sync_timeout_s!r}"
            )

    @classmethod
    def from_config(cls, config: Any) -> TrinitySettings:
        """Read a Trinity config (``config.synchronizer``, ``.trainer``, ``.explorer``, ...)."""
        sync = config.synchronizer
        trainer = getattr(config, "trainer", None)
        explorer = getattr(config, "explorer", None)
        job_dir = getattr(config, "checkpoint_job_dir", None)
        return cls(
            namespace=getattr(config, "ray_namespace", None),
            checkpoint_job_dir=os.path.abspath(job_dir) if job_dir else None,
            sync_method=_value(getattr(sync, "sync_method", None)),
            sync_timeout_s=float(getattr(sync, "sync_timeout", DEFAULT_SYNC_TIMEOUT_S)),
            mode=_value(getattr(config, "mode", None)),
            trainer_type=_value(getattr(trainer, "trainer_type", "verl")),
            trainer_name=getattr(trainer, "name", None) or "trainer",
            explorer_name=getattr(explorer, "name", None) or "explorer",
            group_name=getattr(sync, "group_name", None) or DEFAULT_GROUP_NAME,
            explorer_world_size=getattr(sync, "explorer_world_size", None),
        )

    @property
    def watch_root(self) -> str | None:
        """The root checkpoint sync watches: Trinity's, for ``sync_method: checkpoint`` only."""
        if self.sync_method != "checkpoint" or self.mode == "bench":
            return None
        if self.trainer_type != "verl":
            # Trinity's Tinker backend publishes remote sampler paths, not files in the root.
            return None
        return self.checkpoint_job_dir


def status_value(status: Any) -> str:
    """Trinity's ``RunningStatus`` member (or its value) as its value; refused by name otherwise."""
    value = _value(status)
    if value not in _STATUSES:
        raise ValueError(
            f"status must be one of {_STATUSES} (Trinity's RunningStatus), got {status!r}"
        )
    return value


class RoleStates:
    """The trainer's status and how many explorers are in each status (plain Python).

    Trinity 0.6.0 keeps the same: the trainer starts ``stopped`` until it calls
    ``set_trainer_status(RUNNING)``; explorers are counted, not named.
    """

    def __init__(self) -> None:
        self.trainer = STOPPED
        self.explorers = dict.fromkeys(_STATUSES, 0)

    def set_trainer(self, status: Any) -> str:
        self.trainer = status_value(status)
        return self.trainer

    def move_explorer(self, status: Any, old_status: Any = None) -> None:
        """One explorer enters ``status`` (leaving ``old_status``, when given).

        Raises:
            ValueError: ``old_status`` equals ``status`` or no explorer is in it.
        """
        new = status_value(status)
        if old_status is not None:
            old = status_value(old_status)
            if old == new:
                raise ValueError(f"an explorer status change from {old!r} to itself is not one")
            if self.explorers[old] <= 0:
                raise ValueError(
                    f"no explorer is {old!r} (counts {self.explorers}); call "
                    f"set_explorer_status({old!r}) first"
                )
            self.explorers[old] -= 1
        self.explorers[new] += 1

    def enter_wait(self) -> bool:
        """An explorer starts waiting for weights; whether it left ``running`` for it."""
        moved = self.explorers[RUNNING] > 0
        if moved:
            self.explorers[RUNNING] -= 1
        self.explorers[REQUIRE_SYNC] += 1
        return moved

    def leave_wait(self, moved: bool) -> None:
        if self.explorers[REQUIRE_SYNC] > 0:
            self.explorers[REQUIRE_SYNC] -= 1
        if moved:
            self.explorers[RUNNING] += 1

    def view(self) -> dict[str, Any]:
        return {"trainer": self.trainer, "explorers": dict(self.explorers)}


class TrinityProtocol:
    """Trinity 0.6.0's synchronizer methods; mixed into the Synchronizer actor.

    Uses the Synchronizer's condition (``_condition()``), held version and
    weights, :class:`RoleStates` (``_roles``) and settings (``_settings``).
    """

    _roles: RoleStates
    _settings: TrinitySettings | None
    _version: int | None
    _state_dict: Any
    _model_path: str | None
    _source: str | None
    _published_at: float | None
    sync_timeout_s: float

    def _condition(self) -> asyncio.Condition:  # pragma: no cover - the Synchronizer's
        raise NotImplementedError

    def _telemetry(self) -> WeightSyncTelemetry:  # pragma: no cover - the Synchronizer's
        raise NotImplementedError

    def _path_of(self, step: int) -> str | None:  # pragma: no cover - the Synchronizer's
        raise NotImplementedError

    # -- status handshakes -------------------------------------------------

    async def set_trainer_status(self, status: Any) -> None:
        """The trainer's status (Trinity's ``RunningStatus``); ``STOPPED`` wakes every waiter.

        Trinity's trainer sets ``STOPPED`` after its final save, and its job may end right
        after: so, waiters woken, this returns only once the job's monitor has committed
        what was saved and its mirror holds it (or ``SETTLE_WAIT_S`` passed; logged).
        """
        cond = self._condition()
        async with cond:
            stopped = self._roles.set_trainer(status) == STOPPED
            if stopped:
                cond.notify_all()
        if stopped:
            await settle_checkpoints(getattr(self, "namespace", None))

    def trainer_requires_weight_sync(self) -> bool | None:
        """True: the trainer waits to sync; False: it runs; None: it stopped (end the watch)."""
        if self._roles.trainer == STOPPED:
            return None
        return self._roles.trainer == REQUIRE_SYNC

    async def set_explorer_status(self, status: Any, old_status: Any = None) -> None:
        """Count one explorer in ``status`` (out of ``old_status``); ``STOPPED`` wakes waiters."""
        self._roles.move_explorer(status, old_status)
        if status_value(status) == STOPPED:
            cond = self._condition()
            async with cond:
                cond.notify_all()

    def explorer_requires_sync(self) -> bool:
        """Whether any explorer waits for new weights."""
        return self._roles.explorers[REQUIRE_SYNC] > 0

    async def notify_no_new_model_state_dict(self) -> None:
        """The trainer has nothing newer: wake ``wait_new_model_state_dict`` callers now."""
        cond = self._condition()
        async with cond:
            cond.notify_all()

    # -- lookups -------------------------------------------------------------

    async def get_latest_model_version(self) -> int | None:
        """The held version (0 before anything is published, in Trinity 0.6.0's form)."""
        return self._version

    async def get_latest_model_path(self, use_huggingface: bool = False) -> str | None:
        """``<root>/global_step_<N>/actor`` of the published version (``/huggingface`` inside).

        None until a version is published, or when the synchronizer knows no root.
        """
        if self._model_path and use_huggingface:
            return os.path.join(self._model_path, layout.HF_SUBDIR)
        return self._model_path

    def get_model_state_dict_iterator(self) -> Iterator[tuple[str, Any]]:
        """Yield the held weights as ``(name, tensor)``, one Ray object each (streaming).

        Raises:
            ValueError: what is held is not a state dict (e.g. a Tinker sampler path).
        """
        held = self._state_dict  # one snapshot: a publish meanwhile does not mix versions
        if held is None:
            return
        if not isinstance(held, dict):
            raise ValueError(
                f"the synchronizer holds a {type(held).__name__}, not a state dict, for "
                f"version {self._version}; there are no tensors to stream"
            )
        # A plain loop: Ray drives a generator method with send(), which a dict
        # iterator behind ``yield from`` lacks.
        for item in held.items():  # noqa: UP028
            yield item

    async def _wait_as_trinity(self, current_version: int | None) -> int | None:
        current = -1 if current_version is None else current_version
        cond = self._condition()
        async with cond:
            held = -1 if self._version is None else self._version
            if current > held:
                raise ValueError(
                    f"the rollout side runs version {current}, newer than the synchronizer's "
                    f"{held}: it was restarted or resumed behind the explorer"
                )
            moved = self._roles.enter_wait()
            try:
                if held == current and self._roles.trainer != STOPPED:
                    await asyncio.wait_for(cond.wait(), self.sync_timeout_s)
            finally:
                self._roles.leave_wait(moved)
            return self._version

    # -- NCCL sync -------------------------------------------------------------

    async def ready_to_nccl_sync(self, module: str, trainer_step: int) -> int | None:
        """Meet the other side for an NCCL sync; the version to sync, or None when it cannot.

        ``module`` is ``"trainer"`` (it sets the version to ``trainer_step``) or
        ``"explorer"``. Each side waits up to ``sync_timeout`` for the other;
        None when the other side stopped, timed out, or no explorer runs.

        Raises:
            ValueError: ``module`` is neither, or not exactly one explorer is counted.
        """
        if module not in ("trainer", "explorer"):
            raise ValueError(f"module must be 'trainer' or 'explorer', got {module!r}")
        roles = self._roles
        if sum(roles.explorers.values()) != 1:
            raise ValueError(f"NCCL sync supports exactly one explorer; counted {roles.explorers}")
        if roles.explorers[STOPPED] == 1:
            self._nccl_failed(module)
            return None
        cond = self._condition()
        timeout = self.sync_timeout_s
        async with cond:
            try:
                if module == "trainer":
                    self._hold_nccl_version(trainer_step)
                    roles.set_trainer(REQUIRE_SYNC)
                    cond.notify_all()
                    if roles.explorers[REQUIRE_SYNC] != 1:
                        await asyncio.wait_for(
                            cond.wait_for(
                                lambda: (
                                    roles.explorers[REQUIRE_SYNC] + roles.explorers[STOPPED] == 1
                                )
                            ),
                            timeout,
                        )
                        if roles.explorers[STOPPED] == 1:
                            self._nccl_failed(module)
                            return None
                    roles.move_explorer(RUNNING, REQUIRE_SYNC)
                else:
                    roles.move_explorer(REQUIRE_SYNC, RUNNING)
                    cond.notify_all()
                    if roles.trainer != REQUIRE_SYNC:
                        await asyncio.wait_for(
                            cond.wait_for(lambda: roles.trainer in (REQUIRE_SYNC, STOPPED)),
                            timeout,
                        )
                        if roles.trainer == STOPPED:
                            self._nccl_failed(module)
                            return None
                    roles.set_trainer(RUNNING)
                return self._version
            except asyncio.TimeoutError:
                self._nccl_failed(module)
                return None

    def _nccl_failed(self, module: str) -> None:
        roles = self._roles
        if module == "explorer":
            if roles.explorers[REQUIRE_SYNC] > 0:
                roles.move_explorer(RUNNING, REQUIRE_SYNC)
            other = "trainer"
        else:
            roles.set_trainer(RUNNING)
            other = "explorer"
        logger.error("obsckpt: the %s is not ready for an NCCL weight sync; skipped", other)
        return None

    def _hold_nccl_version(self, step: int) -> None:
        """The trainer's NCCL sync of ``step``: that version is held; its weights go by NCCL."""
        validators.validate_step(step, "trainer_step")
        if self._version != step:
            self._state_dict = None  # what is held belongs to another version
        self._version, self._source, self._published_at = step, "nccl", time.time()
        self._model_path = self._path_of(step)
        self._telemetry().model_version(TRAINER, step)

    def _trinity(self, what: str) -> TrinitySettings:
        if self._settings is None:
            raise ValueError(
                f"{what} needs the Trinity config's trainer and explorer names: create the "
                "synchronizer with Synchronizer.get_actor(config), Trinity 0.6.0's form"
            )
        return self._settings

    async def setup_weight_sync_group(
        self, master_address: str, master_port: int, state_dict_meta: list | None = None
    ) -> None:
        """Ask the explorer actor to join the weight-sync group (and give it the meta)."""
        import ray

        settings = self._trinity("setup_weight_sync_group")
        explorer = ray.get_actor(settings.explorer_name, namespace=settings.namespace)
        await explorer.setup_weight_sync_group.remote(master_address, master_port)
        if state_dict_meta is not None:
            await explorer.set_state_dict_meta.remote(state_dict_meta)

    async def coordinate_weight_sync_setup(self, timeout: float | None = None) -> None:
        """Form the NCCL group: the trainer's address, port and meta; both sides join at once."""
        import ray

        settings = self._trinity("coordinate_weight_sync_setup")
        if settings.explorer_world_size is None:
            raise ValueError(
                "coordinate_weight_sync_setup needs synchronizer.explorer_world_size in the "
                "Trinity config (Trinity's config validation sets it)"
            )
        trainer = ray.get_actor(settings.trainer_name, namespace=settings.namespace)
        explorer = ray.get_actor(settings.explorer_name, namespace=settings.namespace)
        addr, port, meta = await trainer.get_weight_sync_info.remote()
        world_size = settings.explorer_world_size + 1
        timeout = timeout or settings.sync_timeout_s
        logger.info("obsckpt: weight-sync group at %s:%s, world size %d", addr, port, world_size)
        await asyncio.gather(
            trainer.setup_weight_sync_group.remote(
                addr, port, world_size, settings.group_name, timeout
            ),
            explorer.setup_weight_sync_group.remote(
                addr, port, world_size, settings.group_name, timeout
            ),
        )
        await explorer.set_state_dict_meta.remote(meta)

    async def coordinate_weight_sync_teardown(self) -> None:
        """Tear the group down, explorer first; a side already gone is logged and skipped."""
        import ray

        settings = self._trinity("coordinate_weight_sync_teardown")
        for role, name in (
            ("explorer", settings.explorer_name),
            ("trainer", settings.trainer_name),
        ):
            try:
                actor = ray.get_actor(name, namespace=settings.namespace)
                await actor.teardown_weight_sync_group.remote()
            except (ray.exceptions.RayActorError, ValueError) as exc:
                logger.warning("obsckpt: the %s is gone; its teardown is skipped: %s", role, exc)
