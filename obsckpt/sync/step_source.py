"""Where checkpoint sync finds committed steps: a local root, or an ``s3://`` one.

:func:`step_source` gives the :class:`~obsckpt.sync.synchronizer.Synchronizer` one
object for either: the state-dict step the root has committed, the full model of a
step (verified against its manifest, weights only), and whether a step that failed
to load was removed by retention meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from obsckpt.errors import AdapterOnlyError, StateDictLoadError, UnverifiedCheckpointError
from obsckpt.store import layout, reader
from obsckpt.store.uri import is_remote
from obsckpt.sync import step_model
from obsckpt.sync.shards import is_adapter_only, merge_shards, quiet_mesh_unpickling

logger = logging.getLogger(__name__)


class StepSource(Protocol):
    def committed(self) -> int | None:
        """The state-dict step the root has committed (None: none yet)."""
        ...

    def load(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s full model, verified; StateDictLoadError when it cannot be used."""
        ...

    def removed_by_retention(self, step: int) -> bool: ...

    def where(self, step: int) -> str: ...


class LocalSteps:
    """A root on a filesystem: the iteration file, the step directory's model shards."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def committed(self) -> int | None:
        return reader.read_iteration(self.root, "state_dict")

    def load(self, step: int) -> dict[str, torch.Tensor]:
        return step_model.load_step_model(self._model_dir(step))

    def removed_by_retention(self, step: int) -> bool:
        return step_model.removed_by_retention(self.root, step)

    def where(self, step: int) -> str:
        return str(self._model_dir(step))

    def _model_dir(self, step: int) -> Path:
        return layout.step_dir(self.root, step) / layout.MODEL_SUBDIR


class S3Steps:
    """An ``s3://`` root: the pointer, the committed manifest's model shards under ``actor/``."""

    def __init__(self, url: str) -> None:
        from obsckpt.store.s3root import shared_s3_root

        self.url = url
        self.store = shared_s3_root(url)

    def committed(self) -> int | None:
        return self.store.committed("state_dict")

    def load(self, step: int) -> dict[str, torch.Tensor]:
        from obsckpt.store.loading import CommittedObjects

        try:  # the pointer and the manifest are read once, for every shard
            objects = CommittedObjects(self.store, step, self.store.committed_records(step))
        except ValueError as exc:
            raise UnverifiedCheckpointError(str(exc)) from None
        under = [r.path.rpartition("/") for r in objects.records]
        found = {
            world: {rank: f"{layout.MODEL_SUBDIR}/{name}" for rank, name in ranks.items()}
            for world, ranks in layout.model_shard_sets(
                name for head, _, name in under if head == layout.MODEL_SUBDIR
            ).items()
        }
        if len(found) != 1:
            raise StateDictLoadError(
                f"{self.where(step)}: {'no' if not found else 'more than one world size of'} "
                "model shards (model_world_size_<W>_rank_<R>.pt) in the step's manifest"
            )
        [(world, paths)] = found.items()
        missing = sorted(set(range(world)) - set(paths))
        if missing:
            raise StateDictLoadError(
                f"{self.where(step)}: rank(s) {missing} of world size {world} are not in the "
                "step's manifest"
            )
        shards: dict[int, Mapping[str, Any]] = {}
        for rank in range(world):
            url = f"{objects.url}/{paths[rank]}"
            with quiet_mesh_unpickling():
                obj = objects.torch_load(url, map_location="cpu")
            if not isinstance(obj, Mapping):
                raise StateDictLoadError(f"{url} holds a {type(obj).__name__}, not a state dict")
            if rank == 0 and is_adapter_only(obj):
                raise AdapterOnlyError(
                    f"{url} holds only LoRA adapter weights: not a whole model, so it is "
                    "not published"
                )
            shards[rank] = obj
        return merge_shards(shards)

    def removed_by_retention(self, step: int) -> bool:
        newer = self.committed()
        if newer is None or newer <= step or self.store.has_objects(step):
            return False
        logger.info(
            "obsckpt: synchronizer skips step %d: superseded by step %d and removed while it "
            "loaded; step %d is next",
            step,
            newer,
            newer,
        )
        return True

    def where(self, step: int) -> str:
        return f"{self.url}/{layout.step_dir_name(step)}/{layout.MODEL_SUBDIR}"


def step_source(root: str) -> StepSource:
    """The source of committed steps of ``root`` (an absolute path or an ``s3://`` URL)."""
    return S3Steps(root) if is_remote(root) else LocalSteps(Path(root))
