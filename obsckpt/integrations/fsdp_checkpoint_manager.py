"""An FSDP checkpoint manager whose saves run in the background, committed by the monitor.

Subclasses verl 0.9's ``FSDPCheckpointManager`` (same files, so verl's own
``load_checkpoint`` and model merger read them) and keeps Trinity-RFT's
additions: ``save_state_dict`` / ``upload_state_dict`` for weight sync and
``wait_on_save_thread``. Differences from both:

* model, optimizer and extra-state saves go through a
  :class:`~obsckpt.CheckpointCoordinator`: each is snapshotted into staging
  buffers on the calling thread (training may change the weights and
  optimizer state at once), then written with temp file, fsync and rename in
  the coordinator's slot thread, reported to the monitor even when it fails;
* this rank's save counts are registered with the monitor *before* the saves
  start, so a fast save can never finish ahead of its registration;
* retention (``max_ckpt_to_keep``) never deletes the latest committed step
  (of either kind, since the Synchronizer may be reading it) nor a step that
  is newer than it (still being saved, or failed but not yet superseded);
* the model files of a step whose state dict the monitor has committed are
  never written again (a restarted job retrains steps behind
  ``latest_state_dict_iteration.txt``): ``save_state_dict`` skips such a
  step and ``save_checkpoint`` saves only its optimizer and extra state;
* a step whose checkpoint the monitor has committed is not saved again (a
  job resumed from an older step retrains it), and an HF export never
  replaces a file of ``huggingface/`` that the step's manifest lists;
* verl 0.9's ``checkpoint.save_lora_only`` applies to checkpoints, not to
  ``save_state_dict`` (whose files the Synchronizer serves as the model);
* a checkpoint saved by another number of ranks is refused by name on load.

Importing this module imports verl (seconds): import it lazily.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed

from obsckpt.coordinator import CheckpointCoordinator, StagedSave
from obsckpt.env import OBSCKPT_SYNC_SAVE, from_env_if_absent
from obsckpt.errors import UnverifiedCheckpointError
from obsckpt.integrations import alone, object_steps, verl_install
from obsckpt.integrations._common import hand_to_synchronizer, upload_staged_shards
from obsckpt.integrations.fsdp_files import check_world_size
from obsckpt.integrations.retention import prune
from obsckpt.integrations.slot_prepare import prepare_slots
from obsckpt.integrations.verl_fsdp import (
    MODEL_SLOT,
    already_committed,
    save_hf_metadata,
    unwrap,
    upload_state_dict,
)
from obsckpt.options import MONITOR_ACTOR_NAME, SYNCHRONIZER_ACTOR_NAME, lookup_actor
from obsckpt.resume import ResumeRecord, restore_resume_record, save_resume_record
from obsckpt.store import layout, loading
from obsckpt.sync.shards import is_adapter_key

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{OBSCKPT_SYNC_SAVE}={text!r}: set it to 1 (synchronous saves) or 0")
    return text == "1"


# verl's class, even where verl_install has bound obsckpt's to verl's name.
VerlFSDPCheckpointManager = verl_install.original(
    "verl.utils.checkpoint.fsdp_checkpoint_manager", "FSDPCheckpointManager"
)


class FSDPCheckpointManager(VerlFSDPCheckpointManager):
    """verl's FSDP checkpoint manager with background, monitor-committed saves.

    Args:
        *args, **kwargs: as verl's ``FSDPCheckpointManager`` (model, optimizer,
            lr_scheduler, processing_class, checkpoint_config, trust_remote_code).
        ray_namespace: the job's namespace, where the ``checkpoint_monitor`` and
            ``synchronizer`` actors are looked up.
        monitor: the monitor actor handle (default: looked up by name).
        coordinator: a coordinator to use (default: one for this rank).
        synchronizer: the Synchronizer handle (default: looked up on first upload).
        save_timeout: passed to the default coordinator.
        sync_save: ``save_checkpoint`` returns only once this rank's files are durable
            (written, fsynced, renamed into place and reported to the monitor), as
            verl's own synchronous save does, for code that reads the files right
            after it returns (verl's own tests do). Default: the ``OBSCKPT_SYNC_SAVE``
            variable (``1``), else off: saves run in the background and training
            stalls only for the snapshot. The step still commits when the trainer
            submits it (verl_install's trainer does, and waits for the commit).
        commit_steps: this manager submits each step it saves, once every rank has
            registered its saves, and a load of a step this process saved waits for
            its commit (:mod:`obsckpt.integrations.alone`): for a manager used
            without a trainer that submits (verl's own tests, a user's loop).
            False: the trainer submits (``register_and_monitor``), as verl's and
            Trinity's switched trainers do. Default: the ``OBSCKPT_MANAGER_COMMITS``
            variable, else True unless the monitor says a trainer submits the steps
            (``trainer_submits``: the switches' trainers create it so).
    """

    def __init__(
        self,
        *args: Any,
        ray_namespace: str = "",
        monitor: Any = None,
        coordinator: CheckpointCoordinator | None = None,
        synchronizer: Any = None,
        save_timeout: float | None = None,
        sync_save: bool | None = None,
        commit_steps: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.sync_save = from_env_if_absent(sync_save, OBSCKPT_SYNC_SAVE, False, _flag)
        self.ray_namespace = ray_namespace or None
        if monitor is None and coordinator is None:
            monitor = self._lookup(MONITOR_ACTOR_NAME)
        self.checkpoint_monitor = monitor
        self.coordinator = coordinator or CheckpointCoordinator(
            monitor, rank=self.rank, save_timeout=save_timeout
        )
        if self.checkpoint_monitor is None:
            self.checkpoint_monitor = self.coordinator.monitor
        self._commit_steps = commit_steps
        self._synchronizer = synchronizer
        prepare_slots(self, MODEL_SLOT)
        self.previous_state_dict_step: int | None = None
        # The model's snapshot upload_state_dict published: the step's model save writes it.
        self._staged_model: StagedSave | None = None

    @property
    def commit_steps(self) -> bool:
        """Whether this manager submits the steps it saves (asked once, at the first save)."""
        if self._commit_steps is None:
            self._commit_steps = alone.commits_steps(None, self.coordinator)
        return self._commit_steps

    def _lookup(self, name: str) -> Any:
        maker = "CheckpointMonitor" if name == MONITOR_ACTOR_NAME else "Synchronizer"
        return lookup_actor(
            name,
            self.ray_namespace,
            hint=f"create it first (e.g. {maker}.get_actor(namespace=..., "
            "default_local_dir=...)) or pass it in",
            error=RuntimeError,
        )

    @property
    def synchronizer(self) -> Any:
        if self._synchronizer is None:
            self._synchronizer = self._lookup(SYNCHRONIZER_ACTOR_NAME)
        return self._synchronizer

    # -- weight sync (Trinity's API) -----------------------------------

    def upload_state_dict(self, global_step: int) -> float | None:
        """Publish the model on the Synchronizer as version ``global_step`` (every rank calls).

        FSDP2: each rank publishes its own shard from a host snapshot taken in
        the model's save slot, and this step's model save (``save_checkpoint``
        or ``save_state_dict`` right after, as Trinity's trainer does) writes
        that snapshot as it is: the weights leave the devices once for both,
        and nothing is gathered (the Synchronizer merges the shards). FSDP1, a
        model without DTensors, or a Synchronizer that takes whole state dicts
        only (no ``set_model_shard``): the full state dict is gathered to rank 0
        and published from there.
        """
        from torch.distributed.tensor import DTensor

        from obsckpt.integrations.verl_fsdp import fsdp_version

        if fsdp_version(self.model) == 1:
            from torch.distributed.fsdp import FullStateDictConfig, StateDictType
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
            with FSDP.state_dict_type(self.model, StateDictType.FULL_STATE_DICT, cfg):
                named = iter(self.model.state_dict().items())
            return upload_state_dict(named, self.synchronizer, global_step, rank=self.rank)
        state = self._model_state_dict(lora_only=False)
        # A Synchronizer without set_model_shard (another project's) takes whole state
        # dicts only; every rank sees the same handle, so all gather together.
        shards = hasattr(self.synchronizer, "set_model_shard")
        if shards and any(isinstance(t, DTensor) for t in state.values()):
            self._staged_model = self.coordinator.stage(MODEL_SLOT, state, global_step)
            return upload_staged_shards(
                self._staged_model,
                self.synchronizer,
                global_step,
                rank=self.rank,
                world_size=self.world_size,
                logger=logger,
            )
        named = ((n, t.full_tensor() if isinstance(t, DTensor) else t) for n, t in state.items())
        return upload_state_dict(named, self.synchronizer, global_step, rank=self.rank)

    def save_state_dict(self, local_path: str | None, global_step: int = 0) -> int:
        """Save this rank's model shard for checkpoint sync, in the background.

        As Trinity's, the first call of a manager (the trainer's first sync, in
        ``prepare``) saves nothing: the rollout's weights are the trainer's
        (both loaded the same model or checkpoint), so rank 0 only tells the
        Synchronizer, if one runs, that ``global_step`` is current
        (``set_model_state_dict(None, global_step)``; after a resume this
        restarts its versions at the resumed step).

        Returns the number of state-dict saves started (registered with the
        monitor here): 0 on the first call, when this manager already saved the
        step's model, or when the monitor has committed the step's state dict
        (or a later one).
        """
        if self.previous_state_dict_step is None:
            self.previous_state_dict_step = global_step
            self._announce(global_step)
            return 0
        if local_path is None or self.previous_state_dict_step == global_step:
            return 0
        if not object_steps.is_url(local_path):
            os.makedirs(local_path, exist_ok=True)
        torch.distributed.barrier()
        if already_committed(self.coordinator, global_step, logger):
            return 0
        # The whole model, also with checkpoint.save_lora_only: these files are what the
        # Synchronizer hands the rollout side.
        state_dict = self._model_state_dict(lora_only=False)
        self._register(global_step, state_dict=1, checkpoint=0)
        self._save_model(local_path, global_step, state_dict)
        self._submit(global_step, "state_dict")
        return 1

    def _announce(self, global_step: int) -> None:
        """Rank 0: tell the Synchronizer (if one runs) that ``global_step`` is current."""
        if self.rank != 0:
            return
        try:
            synchronizer = self.synchronizer
        except RuntimeError:
            logger.info(
                "obsckpt: no synchronizer in namespace %r: step %d is not announced",
                self.ray_namespace,
                global_step,
            )
            return
        hand_to_synchronizer(
            synchronizer.set_model_state_dict.remote(None, global_step),
            f"take the announcement of step {global_step}",
            logger,
        )

    # -- full checkpoints ----------------------------------------------

    def save_checkpoint(
        self,
        local_path: str | None,
        hdfs_path: str | int | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        *,
        save_as_hf: bool = False,
    ) -> dict[str, int]:
        """Snapshot model, optimizer and extra state and save them in the background.

        Returns once every snapshot is taken; the monitor commits the step
        when every rank's files are durable and the trainer has submitted it
        (``register_and_monitor(step)``). Returns this rank's save counts.

        Trinity-RFT's positional order, ``(local_path, global_step,
        max_ckpt_to_keep, save_as_hf)``, is accepted too: an int where verl
        passes ``hdfs_path`` is the step. ``local_path=None`` saves nothing.
        """
        if isinstance(hdfs_path, int) and not isinstance(hdfs_path, bool):
            # Trinity's positional order: (local_path, global_step, max_ckpt_to_keep,
            # save_as_hf), so its save_as_hf arrives where verl's max_ckpt_to_keep goes.
            if isinstance(max_ckpt_to_keep, bool):
                save_as_hf = save_as_hf or max_ckpt_to_keep
            global_step, max_ckpt_to_keep, hdfs_path = hdfs_path, global_step or None, None
        if isinstance(hdfs_path, str) and object_steps.is_url(hdfs_path):
            local_path = hdfs_path  # verl's default_hdfs_dir on S3: the files go there
        if local_path is None:
            return {"state_dict": 0, "checkpoint": 0}
        self.previous_global_step = global_step
        if self.rank == 0:
            self.enforce_retention(max_ckpt_to_keep)
        remote = object_steps.is_url(local_path)
        if not remote:
            os.makedirs(local_path, exist_ok=True)
        torch.distributed.barrier()
        if self.should_save_model and self.model is None:
            raise ValueError("checkpoint save contents include 'model' but no model was given")
        if self.should_save_optimizer and self.optimizer is None:
            raise ValueError(
                "checkpoint save contents include 'optimizer' but no optimizer was given"
            )

        # Asked after the barrier, so no rank is still saving the step when another asks.
        # A committed checkpoint (a job resumed from an older step retrains it) keeps the
        # files it was committed with: one run's model with another run's optimizer would
        # resume as neither run.
        committed = already_committed(self.coordinator, global_step, logger, is_state_dict=False)
        save_model = (
            self.should_save_model
            and self.previous_state_dict_step != global_step
            and not committed
            and not already_committed(self.coordinator, global_step, logger)
        )
        save_optimizer = self.should_save_optimizer and not committed
        save_extra = self.should_save_extra and not committed
        save_hf = (self.should_save_hf_model or save_as_hf) and self.rank == 0 and not committed
        counts = {
            "state_dict": int(save_model),
            "checkpoint": int(save_optimizer) + int(save_extra) + int(save_hf),
        }
        # Taken before the registration: a save_lora_only model without adapter weights
        # raises here, leaving no registered save that would never finish.
        model_state = self._model_state_dict(lora_only=self.saves_lora_only) if save_model else {}
        self._register(
            global_step, state_dict=counts["state_dict"], checkpoint=counts["checkpoint"]
        )

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if save_model:
                self._save_model(
                    local_path, global_step, model_state, whole=not self.saves_lora_only
                )
            if save_optimizer:
                self._save_optimizer(local_path, global_step)
            if save_extra:
                self._save_extra_state(local_path, global_step)
        if self.rank == 0 and save_model:
            # With the model: a committed step keeps the metadata it was committed with.
            if remote:
                object_steps.save_metadata(
                    self.coordinator,
                    local_path,
                    global_step,
                    lambda d: save_hf_metadata(self.model, d, self.processing_class),
                )
            else:
                save_hf_metadata(self.model, local_path, self.processing_class)
        if self.should_save_hf_model or save_as_hf:
            self._save_hf_model(local_path, global_step, write=save_hf)
        if self.rank == 0:
            self.previous_saved_paths.append(local_path)
            self.enforce_retention(max_ckpt_to_keep)
        if counts["state_dict"] or counts["checkpoint"]:
            self._submit(global_step, "checkpoint" if counts["checkpoint"] else "state_dict")
        if self.sync_save:
            self.coordinator.wait_all()
        return counts

    def load_checkpoint(
        self,
        local_path: str | None,
        hdfs_path: str | None = None,
        del_local_after_load: bool = False,
    ) -> None:
        """Wait for this rank's saves in flight, then load as verl does, verified.

        ``local_path=None`` loads nothing and returns at once, as verl's does. A
        step this process saved and submitted (``commit_steps``) is loaded once it
        is committed: the load waits for its commit (``OBSCKPT_VERL_COMMIT_TIMEOUT_S``,
        default 1800 s).

        Each file verl's loader reads goes through :mod:`obsckpt.loading`: it
        must belong to a committed step, be listed in its manifest and match its
        size and CRC32, and is loaded with ``weights_only=True`` (verl asks for
        ``weights_only=False``, which would run code from the file).

        Raises:
            FileNotFoundError: ``local_path`` was saved by a different number of
                ranks (the message names both and what to do), or lacks a file.
            UnverifiedCheckpointError: the step is not committed (one saved here: not
                within the wait, or it failed), or a file is not listed in its manifest
                or does not match it.
            UnsafeCheckpointError: a file names a global loading could run code from.
        """
        if local_path is None:  # verl loads nothing then (a failed save raises at the next)
            return
        self.coordinator.wait_all()
        kinds = [
            prefix
            for prefix, wanted in (
                ("model", self.should_load_model),
                ("optim", self.should_load_optimizer),
                ("extra_state", self.should_load_extra),
            )
            if wanted
        ]
        # A step this process saved: its commit may still be on its way.
        alone.wait_for_saved_step(self.coordinator, local_path)
        # Only names are read (of a step of objects: its manifest's); the load verifies.
        listed = None
        if object_steps.is_url(local_path):
            paths = loading.CommittedObjects.of(local_path).paths()
            listed = object_steps.names_under(local_path, paths)
        check_world_size(local_path, self.world_size, self.rank, kinds, listed)
        with loading.verified_torch_load(local_path):
            super().load_checkpoint(local_path, hdfs_path, del_local_after_load)

    def save_resume_record(self, record: ResumeRecord) -> StagedSave:
        """Save this rank's resume record with its step: data position, RNGs, weight version.

        One more save of ``record.step`` (registered here), so the step commits
        only once the record is durable beside the shards; see
        :func:`obsckpt.resume.save_resume_record`.
        """
        return save_resume_record(self.coordinator, record)

    def restore_resume_record(
        self, local_path: str, *, data_loader: Any = None, rng: bool = True
    ) -> ResumeRecord:
        """This rank's record of the committed step holding ``local_path`` (the path given
        to :meth:`load_checkpoint`), verified and restored: RNGs and ``data_loader``.

        Raises:
            UnverifiedCheckpointError: ``local_path`` lies in no ``global_step_<N>``
                directory, the step is not committed, or the record does not match.
            ResumeRecordError: the step holds no record for this rank.
        """
        located = (
            object_steps.step_of(local_path)
            if object_steps.is_url(local_path)
            else layout.step_of_path(os.path.abspath(local_path))
        )
        if located is None:
            raise UnverifiedCheckpointError(
                f"{local_path} lies in no {layout.STEP_DIR_PREFIX}<N> directory: a resume "
                "record belongs to a committed step"
            )
        root, step = located
        return restore_resume_record(root, step, self.rank, data_loader=data_loader, rng=rng)

    def wait_on_save_thread(self, timeout: float | None = None) -> None:
        """Wait for every background save of this rank; raises the first failure."""
        self.coordinator.wait_all(timeout)

    # -- retention -------------------------------------------------------

    def enforce_retention(self, max_ckpt_to_keep: int | None) -> list[str]:
        """Delete old checkpoints beyond ``max_ckpt_to_keep`` that are safe to delete (rank 0)."""
        doomed = prune(list(self.previous_saved_paths), max_ckpt_to_keep)
        if doomed:
            self.previous_saved_paths = [p for p in self.previous_saved_paths if p not in doomed]
        return doomed

    # verl's own rotation deletes before the new save commits; ours replaces it.
    def ensure_checkpoint_capacity(self, max_ckpt_to_keep: int) -> None:
        self.enforce_retention(max_ckpt_to_keep)

    def register_checkpoint(self, new_path: str, max_ckpt_to_keep: int | None = None) -> None:
        self.previous_saved_paths.append(new_path)
        self.enforce_retention(max_ckpt_to_keep)

    # -- internals -------------------------------------------------------

    def _submit(self, step: int, kind: str) -> None:
        """Submit the step where no trainer will (``commit_steps``), and remember it: a
        load of it here waits for its commit."""
        if self.commit_steps:
            alone.submit(
                self.coordinator, step, kind, rank=self.rank, barrier=torch.distributed.barrier
            )

    def _register(self, step: int, *, state_dict: int, checkpoint: int) -> None:
        if not (state_dict or checkpoint):
            return
        self.coordinator.link.register_thread_count(
            step, state_dict_thread_count=state_dict, checkpoint_thread_count=checkpoint
        )

    def _path(self, local_path: str, prefix: str) -> str:
        return object_steps.join(local_path, layout.shard_name(prefix, self.world_size, self.rank))

    def _sharded(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` under verl's sharded state-dict context (FSDP1; a no-op for FSDP2)."""
        from torch.distributed.fsdp import (
            ShardedOptimStateDictConfig,
            ShardedStateDictConfig,
            StateDictType,
        )
        from verl.utils.fsdp_utils import get_fsdp_state_ctx

        offload = torch.cuda.is_available()
        with get_fsdp_state_ctx(
            self.model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=offload),
            ShardedOptimStateDictConfig(offload_to_cpu=offload),
        ):
            return fn()

    @property
    def saves_lora_only(self) -> bool:
        """Whether checkpoints hold only the LoRA adapter weights of the model.

        verl 0.9's ``checkpoint.save_lora_only`` on a model with a ``peft_config``;
        verl 0.7 has no such setting and always saves the whole model.
        """
        asked = getattr(self, "should_save_lora_only", False)
        return bool(asked) and hasattr(unwrap(self.model), "peft_config")

    def _model_state_dict(self, *, lora_only: bool) -> dict[str, Any]:
        """This rank's model shard in verl's format; only its adapter weights with ``lora_only``.

        Raises:
            ValueError: ``lora_only`` and no entry is a LoRA/adapter weight (as verl raises).
        """
        # verl's format (FSDP1: ShardedTensor, FSDP2: DTensor), so verl's loader reads it.
        state_dict = self._sharded(self.model.state_dict)
        if not lora_only:
            return state_dict
        adapters = {name: value for name, value in state_dict.items() if is_adapter_key(name)}
        if not adapters:
            raise ValueError(
                "checkpoint.save_lora_only=True and the model has a peft_config, but none of "
                f"its {len(state_dict)} state-dict entries is a LoRA/adapter weight (a name "
                "holding 'lora_' or '.adapter_'), so there is nothing to save. Set "
                "checkpoint.save_lora_only=false to save the whole model, or check that the "
                "LoRA target modules match the model's layers"
            )
        logger.info(
            "obsckpt: LoRA-only save: %d of %d model entries", len(adapters), len(state_dict)
        )
        return adapters

    def _save_model(
        self, local_path: str, global_step: int, state_dict: dict[str, Any], *, whole: bool = True
    ) -> None:
        # unless_committed: the monitor decides again when it admits the write, so a
        # commit that lands after the check above still leaves the committed files alone.
        # The step's published snapshot (upload_state_dict) is written as it is: the
        # coordinator checks that nothing staged over it since.
        staged, self._staged_model = self._staged_model, None
        self.coordinator.save_state_dict_async(
            MODEL_SLOT,
            state_dict,
            self._path(local_path, "model"),
            global_step,
            is_state_dict=True,
            unless_committed=True,
            staged=staged if whole else None,
        )
        self.previous_state_dict_step = global_step

    def _save_optimizer(self, local_path: str, global_step: int) -> None:
        state = self._sharded(self.optimizer.state_dict)
        self.coordinator.save_state_dict_async(
            "optim", state, self._path(local_path, "optim"), global_step, unless_committed=True
        )

    def _extra_state(self) -> dict[str, Any]:
        return {
            "lr_scheduler": self.lr_scheduler.state_dict()
            if self.lr_scheduler is not None
            else None,
            "rng": self.get_rng_state(),
        }

    def _save_extra_state(self, local_path: str, global_step: int) -> None:
        extra = self._extra_state()
        self.coordinator.save_state_dict_async(
            "extra_state",
            extra,
            self._path(local_path, "extra_state"),
            global_step,
            unless_committed=True,
        )

    def _save_hf_model(self, local_path: str, global_step: int, *, write: bool) -> None:
        """Gather the full state dict (a collective) and write an HF model on rank 0 in the
        background (:func:`obsckpt.integrations.fsdp_export.save_hf_model`)."""
        from obsckpt.integrations.fsdp_export import save_hf_model

        save_hf_model(self, local_path, global_step, write=write)


# Where verl's module was patched while this one was being imported, bind it now.
verl_install.bind_pending()
