"""FSDP (FSDP1 and FSDP2) checkpoint and weight-sync helpers for verl engines.

Drop-in for Trinity-RFT's ``trinity.trainer.verl.fsdp_engine`` helpers. Each
takes the engine object (verl's ``FSDPEngine``, ``engine.actor.engine``):
``engine.module`` is the FSDP-wrapped model and ``engine.get_per_tensor_param()``
yields ``(name, full_tensor)`` pairs (verl 0.9 returns them with the LoRA
config as a pair; both shapes are accepted).

* :func:`fsdp_save_state_dict` -- checkpoint sync: every rank's shard is
  snapshotted on the calling thread and written in the background through
  the :class:`~obsckpt.CheckpointCoordinator`, as one part of a save made of
  one part per rank (the monitor commits the step once every rank's file is
  durable; the Synchronizer then merges them).
* :func:`fsdp_upload_state_dict` -- memory sync: the full state dict is
  gathered (a collective: every rank calls it) and rank 0 hands it to the
  Synchronizer.
* :func:`fsdp_sync_weight_nccl` -- broadcast: full parameters from trainer
  rank 0 to the rollout side, bucketed over a :class:`WeightSyncGroup`, or
  one collective per tensor over a plain ``torch.distributed`` group.

What the Megatron helpers do the same way (ranks, the upload, the broadcast)
is in :mod:`obsckpt.integrations._common`. Nothing here imports verl.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from obsckpt.integrations._common import (
    already_committed,
    broadcast_named_tensors,
    dist_rank,
    dist_world_size,
    upload_engine_state_dict,
)

# Not used here; defined in _common (shared with verl_megatron), importable from here.
from obsckpt.integrations._common import broadcaster_for as broadcaster_for
from obsckpt.integrations._common import gather_full_state_dict as gather_full_state_dict
from obsckpt.integrations._common import per_tensor_params as per_tensor_params
from obsckpt.integrations._common import upload_state_dict as upload_state_dict
from obsckpt.store import commit, layout
from obsckpt.sync.buckets import TensorMeta
from obsckpt.sync.wire import BroadcastResult

_log = logging.getLogger(__name__)

MODEL_SLOT = "model_state_dict"
FSDP_CONFIG_FILE = "fsdp_config.json"
LORA_META_FILE = "lora_train_meta.json"
_FSDP_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


# ----------------------------------------------------------------------
# Small helpers shared with the checkpoint manager
# ----------------------------------------------------------------------


def fsdp_version(module: torch.nn.Module) -> int:
    """1 for ``FullyShardedDataParallel``, 2 for ``fully_shard`` modules, 0 otherwise."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        return 1
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        from torch.distributed._composable.fsdp import FSDPModule
    return 2 if isinstance(module, FSDPModule) else 0


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The model inside an FSDP1 wrapper (FSDP2 modules are the model itself)."""
    return getattr(module, "_fsdp_wrapped_module", module)


def clean_name(name: str) -> str:
    """A parameter name without FSDP1, activation-checkpointing or compile wrapper segments."""
    for prefix in _FSDP_WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def sharded_model_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """This rank's shard of the model state dict, as DTensors for FSDP1 and FSDP2 alike.

    FSDP1's default sharded state dict holds ``ShardedTensor``s, which cannot be
    unpickled without a process group; asking for DTensors makes every rank's
    file mergeable offline (by the Synchronizer or verl's model merger).
    """
    if fsdp_version(module) == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

        cfg = ShardedStateDictConfig(offload_to_cpu=torch.cuda.is_available(), _use_dtensor=True)
        with FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT, cfg):
            return module.state_dict()
    return module.state_dict()


def find_processing_class(engine: Any) -> Any:
    """The tokenizer or processor an engine carries, if any."""
    manager = getattr(engine, "checkpoint_manager", None)
    candidates = [
        getattr(manager, "processing_class", None),
        getattr(engine, "processing_class", None),
        getattr(getattr(engine, "model_config", None), "processor", None),
        getattr(getattr(engine, "model_config", None), "tokenizer", None),
        getattr(engine, "tokenizer", None),
    ]
    return next((c for c in candidates if c is not None), None)


def save_hf_metadata(
    module: torch.nn.Module, local_path: str, processing_class: Any = None
) -> str | None:
    """Write on rank 0 what verl's own manager writes next to the model shards.

    verl's model merger rebuilds the HF model from it: ``huggingface/`` holds
    the HF config, the generation config of a pretrained model, the tokenizer
    or processor and a custom model's code (``auto_map``);
    ``fsdp_config.json`` the FSDP version and world size; and
    ``lora_train_meta.json`` a LoRA model's rank and alpha. Each file is
    written in a scratch directory, fsynced and renamed into place: a crash
    never leaves a torn file, and the files are durable before this rank's
    shard is handed to the coordinator (so before the step can commit).

    Returns the ``huggingface`` directory, or None when the model has no HF config.
    """
    model = unwrap(module)
    config = getattr(model, "config", None)
    has_config = config is not None and hasattr(config, "save_pretrained")
    # Named as a temp file: a commit of the step meanwhile does not list what is in it.
    scratch = commit.scratch_dir(os.path.join(local_path, "metadata"))
    try:
        if has_config:
            _write_hf_dir(model, config, os.path.join(scratch, layout.HF_SUBDIR), processing_class)
        with open(os.path.join(scratch, FSDP_CONFIG_FILE), "w", encoding="utf-8") as f:
            json.dump({"FSDP_version": fsdp_version(module), "world_size": dist_world_size()}, f)
        lora = lora_train_meta(model)
        if lora is not None:
            with open(os.path.join(scratch, LORA_META_FILE), "w", encoding="utf-8") as f:
                json.dump(lora, f, indent=4)
        move_durably(scratch, local_path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return os.path.join(local_path, layout.HF_SUBDIR) if has_config else None


def _write_hf_dir(model: Any, config: Any, hf_dir: str, processing_class: Any) -> None:
    os.makedirs(hf_dir)
    generation_config = pretrained_generation_config(model)
    if generation_config is not None:
        generation_config.save_pretrained(hf_dir)
    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict) and None in auto_map:
        config.auto_map = {k: v for k, v in auto_map.items() if k is not None}
    config.save_pretrained(hf_dir)
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(hf_dir)
    if hasattr(config, "auto_map"):
        from transformers.dynamic_module_utils import custom_object_save

        # The file that defines the model's class; a PEFT wrapper's would be peft's own.
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        custom_object_save(base, hf_dir, config=config)


def move_durably(scratch: str, dest: str, *, keep: Collection[str] = ()) -> None:
    """Fsync every file under ``scratch``, rename it to the same place under ``dest``.

    A file whose path relative to ``dest`` is in ``keep`` is left as it is in
    ``dest`` (a committed file) and not moved.
    """
    touched = set()
    for dirpath, _dirnames, filenames in os.walk(scratch):
        rel_dir = os.path.relpath(dirpath, scratch)
        target_dir = os.path.join(dest, rel_dir)
        os.makedirs(target_dir, exist_ok=True)
        for name in filenames:
            if os.path.normpath(os.path.join(rel_dir, name)) in keep:
                continue
            commit.fsync_file(os.path.join(dirpath, name))
            os.replace(os.path.join(dirpath, name), os.path.join(target_dir, name))
            touched.add(target_dir)
    for directory in touched | {dest}:
        commit.fsync_dir(directory)


# name_or_path -> its generation config (or None): read once, not on every step's save.
_generation_configs: dict[str, Any] = {}


def pretrained_generation_config(model: Any) -> Any:
    """The generation config stored with the pretrained model, as verl's manager reads it.

    None for a model that cannot generate or was not loaded from a pretrained
    model (verl's merger then derives one from the model config).
    """
    can_generate = getattr(model, "can_generate", None)
    name = getattr(getattr(model, "config", None), "name_or_path", None)
    if not (callable(can_generate) and can_generate() and name):
        return None
    if name not in _generation_configs:
        from transformers import GenerationConfig

        try:
            _generation_configs[name] = GenerationConfig.from_pretrained(name)
        except Exception:  # noqa: BLE001 - none stored: verl saves none either
            _generation_configs[name] = None
    return _generation_configs[name]


def lora_train_meta(model: Any) -> dict[str, Any] | None:
    """A LoRA model's rank, alpha and task type, as verl records them, else None."""
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return None
    if isinstance(peft_config, dict):
        peft_config = peft_config.get("default") or next(iter(peft_config.values()), None)
    rank = int(getattr(peft_config, "r", 0) or 0)
    if rank <= 0:
        return None
    task_type = getattr(peft_config, "task_type", None) or "CAUSAL_LM"
    return {
        "r": rank,
        "lora_alpha": int(getattr(peft_config, "lora_alpha", rank) or 0),
        "task_type": str(getattr(task_type, "value", task_type)),
    }


# ----------------------------------------------------------------------
# Checkpoint sync
# ----------------------------------------------------------------------


def fsdp_save_state_dict(
    engine: Any,
    local_path: str,
    global_step: int,
    coordinator: Any,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict[str, str] | None = None,
) -> int:
    """Save every rank's model shard for checkpoint-based weight sync; call on every rank.

    Every rank snapshots its shard into the coordinator's staging buffers on
    the calling thread (training may change the weights as soon as this
    returns) and writes it in the background in the ``model_state_dict`` slot
    (temp file, fsync, rename). Each rank's write is reported to the monitor
    as one part of a single save made of ``world_size`` parts, with its file
    and checksum, so every shard is in the step's manifest; the monitor counts
    the save once every part is durable, and a failed part fails the step. The
    number of parts is known from the first part that reports, so a rank that
    starts late holds the commit back instead of leaving the step partial.
    The helper adds no collective and no synchronous write of its own.
    Rank 0 also writes the HF config and tokenizer to ``{local_path}/huggingface/``.

    A step whose state dict is already committed is not written again (a
    re-save would change files the iteration file vouches for); it is logged
    and 0 is returned on every rank. Each rank asks before it snapshots, and
    the monitor decides again when it admits the rank's part, so a step that
    commits while the ranks save is skipped by every rank that comes late,
    never written by one of them into the committed step.

    Args:
        engine: the FSDP engine (``engine.module`` is the FSDP-wrapped model).
        local_path: the step's model directory, ``<root>/global_step_<N>/actor``.
        global_step: the training step (the version the rollout side will see).
        coordinator: this rank's :class:`~obsckpt.CheckpointCoordinator`.
        logger: the calling worker's logger.
        trace_context: W3C carrier of the step's trace.

    Returns:
        1 on rank 0 and 0 elsewhere: summed over ranks, the one save per step
        that ``register_and_monitor(..., state_dict_thread_count=1)`` registers,
        as Trinity-RFT's trainer does.
    """
    log = logger or _log
    rank, world = dist_rank(engine), dist_world_size(engine)
    if already_committed(coordinator, global_step, log):
        return 0
    path = os.path.join(local_path, layout.shard_name("model", world, rank))
    # Before the metadata below is written beside the shard: a path into another step's
    # directory is refused while that step's files are still untouched.
    coordinator.check_targets(
        [local_path], global_step, True, name=MODEL_SLOT, part=rank, parts=world
    )
    os.makedirs(local_path, exist_ok=True)
    state_dict = sharded_model_state_dict(engine.module)
    if rank == 0:
        save_hf_metadata(engine.module, local_path, find_processing_class(engine))
    coordinator.save_state_dict_async(
        MODEL_SLOT,
        state_dict,
        path,
        global_step,
        is_state_dict=True,
        trace_context=trace_context,
        part=rank,
        parts=world,
        unless_committed=True,
    )
    log.info("obsckpt: rank %d saving its model shard of step %d to %s", rank, global_step, path)
    return 1 if rank == 0 else 0


# ----------------------------------------------------------------------
# Memory sync
# ----------------------------------------------------------------------


def fsdp_upload_state_dict(
    engine: Any,
    synchronizer: Any,
    global_step: int,
    logger: logging.Logger | None = None,
    *,
    trace_context: dict[str, str] | None = None,
) -> float | None:
    """Upload the full FSDP state dict to the Synchronizer (memory sync); call on every rank."""
    return upload_engine_state_dict(
        engine, synchronizer, global_step, logger, trace_context=trace_context
    )


# ----------------------------------------------------------------------
# Broadcast
# ----------------------------------------------------------------------


@contextmanager
def full_params(
    module: torch.nn.Module,
) -> Iterator[tuple[list[TensorMeta], Iterator[tuple[str, torch.Tensor]]]]:
    """Metadata and a lazy iterator of ``(name, full tensor)`` for FSDP1, FSDP2 or a plain module.

    Shapes come from the DTensors (no communication); each tensor is gathered
    with ``full_tensor()`` when the iterator reaches it, so only one full
    tensor at a time is alive on any rank. FSDP1 is asked for its sharded
    state dict as DTensors (each FSDP unit is unsharded only while its own
    shards are taken), not for ``summon_full_params`` over the whole model,
    which would hold every full parameter on every rank at once.
    """
    from torch.distributed.tensor import DTensor

    if fsdp_version(module) == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardedStateDictConfig, StateDictType

        # Kept on the device: full_tensor() gathers over the mesh's backend (NCCL).
        cfg = ShardedStateDictConfig(offload_to_cpu=False, _use_dtensor=True)
        with FSDP.state_dict_type(module, StateDictType.SHARDED_STATE_DICT, cfg):
            state = module.state_dict()
    else:
        state = module.state_dict()
    meta = [TensorMeta(clean_name(n), t.dtype, tuple(t.shape)) for n, t in state.items()]

    def gen() -> Iterator[tuple[str, torch.Tensor]]:
        for t, m in zip(state.values(), meta, strict=True):
            yield m.name, (t.full_tensor() if isinstance(t, DTensor) else t.detach())

    yield meta, gen()


def fsdp_sync_weight_nccl(
    engine: Any,
    model_update_group: Any,
    *,
    step: int | None = None,
    trace_context: dict[str, str] | None = None,
    metrics: Any = None,
    monitor: Any = None,
) -> BroadcastResult | None:
    """Broadcast the full FSDP1/FSDP2 parameters from trainer rank 0; call on every trainer rank.

    Each tensor is gathered with ``full_tensor()`` as the sender reaches it
    (FSDP1 through its DTensor sharded state dict), so no rank holds the
    whole model. Despite the name (kept for
    compatibility) the backend is the group's: NCCL on GPUs, gloo on CPUs.
    Returns rank 0's :class:`BroadcastResult`; None on other ranks.
    """
    rank = dist_rank(engine)
    with full_params(engine.module) as (meta, named):
        return broadcast_named_tensors(
            meta,
            named,
            model_update_group,
            rank=rank,
            step=step,
            trace_context=trace_context,
            metrics=metrics,
            monitor=monitor,
        )
