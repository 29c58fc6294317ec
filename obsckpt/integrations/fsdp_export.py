"""The FSDP checkpoint manager's HF export (``hf_model`` in ``checkpoint.save_contents``).

Written as verl's own manager writes it, in the background through the manager's
coordinator: into the step directory through a scratch directory (each file
renamed into place, a file the step's manifest lists kept as committed), or, on
an ``s3://`` root, at the URL's scratch path and uploaded. Imports verl lazily.
"""

from __future__ import annotations

import shutil
from typing import Any

import torch

from obsckpt.integrations import object_steps
from obsckpt.integrations.fsdp_files import committed_files, hf_model_class
from obsckpt.integrations.verl_fsdp import (
    find_processing_class,
    move_durably,
    pretrained_generation_config,
    unwrap,
)
from obsckpt.store import commit, layout
from obsckpt.store.scratch import scratch_path


def save_hf_model(manager: Any, local_path: str, global_step: int, *, write: bool) -> None:
    """Gather the full state dict (a collective) and write an HF model on rank 0 in the
    background, as one more save of the step (``write``: this rank writes it).

    The model class is chosen as verl's own manager chooses it (critic:
    token classification, actor: causal LM, vision: verl's vision2seq class).
    """
    from verl.utils.fsdp_utils import get_fsdp_full_state_dict

    state_dict = get_fsdp_full_state_dict(manager.model, offload_to_cpu=True, rank0_only=True)
    if not write:
        return
    model = unwrap(manager.model)
    config = model.config
    model_cls = hf_model_class(config, model)  # fails here, not in the background
    remote = object_steps.is_url(local_path)
    hf_dir = object_steps.join(local_path, layout.HF_SUBDIR)
    processing_class = manager.processing_class or find_processing_class(manager)
    trust_remote_code = getattr(manager, "trust_remote_code", False)
    generation_config = pretrained_generation_config(model)

    def save() -> None:
        from accelerate import init_empty_weights

        with init_empty_weights():
            empty = model_cls.from_config(
                config, torch_dtype=torch.bfloat16, trust_remote_code=trust_remote_code
            )
        empty.to_empty(device="cpu")
        # save_pretrained writes the model's generation config: the pretrained one, as
        # save_hf_metadata wrote it, not one derived from the model config.
        if generation_config is not None and empty.can_generate():
            empty.generation_config = generation_config
        try:  # verl >= 0.9: tied weights' duplicate keys are dropped before saving
            from verl.utils.transformers_compat import drop_tied_target_keys
        except ImportError:
            pass
        else:
            drop_tied_target_keys(state_dict, empty, config)
        if remote:  # written at the URL's scratch path, then uploaded (see save_async)
            empty.save_pretrained(scratch_path(hf_dir, manager.rank), state_dict=state_dict)
            if processing_class is not None:
                processing_class.save_pretrained(scratch_path(hf_dir, manager.rank))
            return
        # Written aside, then each file renamed into place: a crash never leaves a torn
        # file in huggingface/, and a file the step's manifest lists (committed with
        # the step's state dict by an earlier run) is kept as committed.
        # Named as a temp file: a commit meanwhile does not list what is in it.
        scratch = commit.scratch_dir(hf_dir)
        try:
            empty.save_pretrained(scratch, state_dict=state_dict)
            if processing_class is not None:
                processing_class.save_pretrained(scratch)
            move_durably(scratch, hf_dir, keep=committed_files(hf_dir))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    # Fsynced and checksummed by this process (the monitor may run on another node).
    manager.coordinator.save_async(
        "hf_model", save, global_step, paths=[hf_dir], unless_committed=True
    )
