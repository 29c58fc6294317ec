"""What the FSDP checkpoint manager reads off a step directory, and the HF class it exports with.

Plain functions of paths and configs (no verl import at module level), kept
apart from :mod:`obsckpt.integrations.fsdp_checkpoint_manager` so they can be
used and tested without building a manager.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from obsckpt.store import layout, reader


def check_world_size(
    local_path: str,
    world_size: int,
    rank: int,
    kinds: list[str],
    listed: set[str] | None = None,
) -> None:
    """Refuse, by name, a checkpoint written by another number of ranks.

    verl reads ``<kind>_world_size_<W>_rank_<R>.pt`` for this job's W and R
    only; without this check a resume on another number of GPUs fails with a
    bare missing-file error on some ranks. ``listed``: the names under
    ``local_path`` that its step's manifest lists (a step of objects), instead
    of the directory's files.

    Raises:
        FileNotFoundError: a file of ``kinds`` for this rank is missing (the message
            names the world size that saved the step, if another, and what to do).
    """
    for kind in kinds:
        name = layout.shard_name(kind, world_size, rank)
        path = f"{local_path}/{name}" if listed is not None else os.path.join(local_path, name)
        present = name in listed if listed is not None else os.path.exists(path)
        if present:
            continue
        if listed is not None:
            names: Iterable[str] = listed
        else:
            try:
                names = os.listdir(local_path)
            except OSError:
                names = []
        sizes = sorted(
            {
                int(m.group(2))
                for n in names
                if (m := layout.SHARD_RE.match(n)) is not None and m.group(1) == kind
            }
        )
        if sizes and world_size not in sizes:
            saved = sizes[0] if len(sizes) == 1 else sizes
            merge = (  # verl's model merger reads a local directory
                ", or merge the step into an HF model (python -m verl.model_merger merge "
                f"--backend fsdp --local_dir {local_path} --target_dir <dir>) and start a "
                "new run from it"
                if listed is None
                else ""
            )
            raise FileNotFoundError(
                f"{local_path} holds a checkpoint saved by {saved} ranks "
                f"({kind}_world_size_{sizes[0]}_rank_*.pt), but this job runs "
                f"{world_size} ranks; verl loads FSDP shards only at the world size "
                "that saved them. Resume with the same number of GPUs (trainer.nnodes x "
                f"trainer.n_gpus_per_node){merge}"
            )
        raise FileNotFoundError(
            f"{path} does not exist: {local_path} is not a whole checkpoint of {world_size} "
            f"ranks (checkpoint.load_contents asks for {kinds}). Resume from a committed "
            "step (the one latest_checkpointed_iteration.txt names) or drop what it lacks "
            "from checkpoint.load_contents"
        )


def committed_files(directory: str) -> set[str]:
    """Paths, relative to ``directory``, of the files under it that its step's manifest lists.

    ``directory`` lies inside a ``global_step_<N>`` directory; empty when it
    does not, or the step has no manifest (nothing of it is committed).
    """
    directory = os.path.abspath(directory)
    located = layout.step_of_path(os.path.dirname(directory))
    if located is None:
        return set()
    sdir = layout.step_dir(*located)
    try:
        records = reader.read_manifest(sdir)
    except FileNotFoundError:
        return set()
    prefix = os.path.relpath(directory, sdir) + os.sep
    return {r.path[len(prefix) :] for r in records if r.path.startswith(prefix)}


def hf_model_class(config: Any, model: Any = None) -> Any:
    """The ``transformers`` auto class verl's manager writes ``config``'s model with.

    verl reads ``config.architectures[0]``; a config built in memory has none
    until it is saved, so the model's class name stands in for it then.

    Raises:
        NotImplementedError: an architecture verl does not export either.
    """
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    if "ForTokenClassification" in arch:
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification
    if "ForCausalLM" in arch:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    if "ForConditionalGeneration" in arch:
        from verl.utils.transformers_compat import get_auto_model_for_vision2seq

        return get_auto_model_for_vision2seq()
    raise NotImplementedError(
        f"cannot export architectures={getattr(config, 'architectures', None)!r} as an HF model: "
        "verl exports *ForTokenClassification, *ForCausalLM and *ForConditionalGeneration; "
        "drop 'hf_model' from checkpoint.save_contents"
    )
