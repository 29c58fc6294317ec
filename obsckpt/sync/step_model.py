"""A committed step's model for checkpoint sync: ``model.safetensors`` or verl's shards.

Trinity-RFT 0.6.0's ``save_state_dict`` writes one ``actor/model.safetensors``
(rank 0 streams the full tensors); verl's managers and obsckpt's helpers write
``actor/model_world_size_<W>_rank_<R>.pt`` per rank. Either is read only
through :class:`~obsckpt.store.loading.CommittedStep`: the step must be committed and
the file must match its manifest. Where both are present the safetensors file
is used, as Trinity's own loader does.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from obsckpt.errors import (
    AdapterOnlyError,
    IterationFileError,
    MegatronLayoutError,
    StateDictLoadError,
)
from obsckpt.store import layout, reader
from obsckpt.store.loading import CommittedStep
from obsckpt.sync.shards import is_adapter_only, load_sharded_state_dict, shard_files

logger = logging.getLogger(__name__)

# Trinity-RFT 0.6.0's checkpoint-sync file, inside a step's role directory.
SAFETENSORS_MODEL = "model.safetensors"


def safetensors_path(model_dir: str | os.PathLike) -> Path:
    return Path(model_dir) / SAFETENSORS_MODEL


def load_step_model(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full state dict a committed step's ``model_dir`` holds, verified against its manifest.

    Raises:
        StateDictLoadError: nothing readable, not committed, not matching the manifest,
            adapter weights only, or a layout checkpoint sync cannot read.
    """
    path = safetensors_path(model_dir)
    if not os.path.lexists(path):
        return load_sharded_state_dict(model_dir)
    data = CommittedStep.of(path).read_bytes(path)
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        state_dict = load(data)
    except SafetensorError as exc:
        raise StateDictLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
    if is_adapter_only(state_dict):
        raise AdapterOnlyError(
            f"{path} holds only LoRA adapter weights ({len(state_dict)} tensors): not a whole "
            "model, so it is not published. Sync a LoRA run's weights from memory or by broadcast"
        )
    return state_dict


def step_model_present(model_dir: str | os.PathLike) -> bool:
    """Whether ``model_dir`` still holds a whole model to load (used after a failed load).

    Raises:
        MegatronLayoutError: it holds Megatron's layout, which is whole but never readable here.
    """
    if os.path.lexists(safetensors_path(model_dir)):
        return True
    try:
        shard_files(model_dir)
    except StateDictLoadError as exc:
        if type(exc) is not StateDictLoadError:
            raise
        return False
    return True


def removed_by_retention(root: Path, step: int) -> bool:
    """Whether ``step``'s files are gone or going because a newer step committed (logged).

    Retention deletes a whole step directory once a newer step is committed; a
    Synchronizer that read the iteration file before that commit may be loading
    the step it deletes. False when the iteration file still names ``step`` (or
    cannot be read), or when the step is still whole on disk (a load error then
    is the step's own).
    """
    try:
        newer = reader.read_iteration(root, "state_dict")
    except IterationFileError:
        return False
    if newer is None or newer <= step:
        return False
    try:
        present = step_model_present(layout.step_dir(root, step) / layout.MODEL_SUBDIR)
    except MegatronLayoutError:
        return False  # whole, and never readable here: its own error says what to do
    if not present:  # the directory, or some of its shards, already deleted
        logger.info(
            "obsckpt: synchronizer skips step %d: it was superseded by step %d and "
            "removed while it loaded; step %d is next",
            step,
            newer,
            newer,
        )
        return True
    return False
