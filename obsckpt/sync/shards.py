"""Reading a committed step's model shards into one state dict (plain functions, no Ray).

A state-dict save writes one file per rank,
``global_step_<N>/actor/model_world_size_<W>_rank_<R>.pt``; the step's
manifest holds each file's size and CRC32, checked as it is read. Two kinds
of step are refused by name rather than published as a model: one whose
files hold only LoRA adapter weights (verl's ``checkpoint.save_lora_only``),
and one written by Megatron, whose distributed-checkpoint layout this reader
does not read.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from obsckpt.errors import AdapterOnlyError, MegatronLayoutError, StateDictLoadError
from obsckpt.store import layout, reader
from obsckpt.store.loading import CommittedStep
from obsckpt.sync.publish import ZeroCopyTensor

# Ranks named in an error about missing ones: an absurd world size must not make it huge.
_NAMED_RANKS = 8
# What verl's Megatron checkpoint manager writes in a role's directory: its
# distributed checkpoint (``dist_ckpt/`` in verl 0.7, ``model/dist_ckpt/`` in
# verl 0.9) and, on rank 0, the model's transformer config and (verl 0.9) a
# list of the contents saved.
_MEGATRON_MARKERS = (
    "dist_ckpt",
    os.path.join("model", "dist_ckpt"),
    "transformer_config.json",
    "ckpt_contents.json",
)
_MEGATRON_FILE_SUFFIX = ".distcp"  # a torch_dist shard of Megatron's distributed checkpoint


def is_adapter_key(name: object) -> bool:
    """Whether ``name`` is a LoRA/adapter weight, by verl's test (``is_lora_only_state_dict``)."""
    return isinstance(name, str) and ("lora_" in name or ".adapter_" in name)


def is_adapter_only(names: Iterable[object]) -> bool:
    """Whether ``names`` (a state dict's keys) are all LoRA/adapter weights; False when empty."""
    seen = False
    for name in names:
        if not is_adapter_key(name):
            return False
        seen = True
    return seen


def _megatron_marker(model_dir: Path, names: list[str]) -> str | None:
    """What in ``model_dir`` shows that Megatron wrote it, else None."""
    for marker in _MEGATRON_MARKERS:
        if reader.exists(model_dir / marker):
            return marker
    return next((n for n in sorted(names) if n.endswith(_MEGATRON_FILE_SUFFIX)), None)


class _MeshUnpicklingNote(logging.Filter):
    """Drops torch's note that a DTensor's mesh was unpickled before its process groups
    exist: a Synchronizer has none, and uses the shards' local tensors alone."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "unpickling of the DeviceMesh" not in record.getMessage()


_MESH_NOTE = _MeshUnpicklingNote()
_mesh_quiet_lock = threading.Lock()
_mesh_quiet_users = 0  # loads running under the filter (in several threads at once)


@contextmanager
def quiet_mesh_unpickling() -> Iterator[None]:
    """Load DTensor shards without torch logging, per file, that process-group lookups
    will fail (they are never made here); its other records pass. The filter stays
    while any load in the process runs, and only then."""
    global _mesh_quiet_users
    mesh_logger = logging.getLogger("torch.distributed.device_mesh")
    with _mesh_quiet_lock:
        _mesh_quiet_users += 1
        mesh_logger.addFilter(_MESH_NOTE)
    try:
        yield
    finally:
        with _mesh_quiet_lock:
            _mesh_quiet_users -= 1
            if not _mesh_quiet_users:
                mesh_logger.removeFilter(_MESH_NOTE)


def shard_files(model_dir: str | os.PathLike) -> tuple[int, dict[int, Path]]:
    """The world size and ``{rank: path}`` of the model shards in ``model_dir``.

    Raises:
        StateDictLoadError: no shards, several world sizes, or a missing rank.
    """
    model_dir = Path(model_dir)
    try:
        names = reader.names_in(model_dir)
    except FileNotFoundError:
        raise StateDictLoadError(f"{model_dir} does not exist") from None
    except NotADirectoryError:
        raise StateDictLoadError(
            f"{model_dir} is not a directory; a step's model shards are files in it"
        ) from None
    except OSError as exc:
        raise StateDictLoadError(f"cannot list {model_dir}: {exc.strerror or exc}") from exc
    found = {
        world: {rank: model_dir / name for rank, name in ranks.items()}
        for world, ranks in layout.model_shard_sets(names).items()
    }
    if not found:
        marker = _megatron_marker(model_dir, names)
        if marker is not None:
            raise MegatronLayoutError(
                f"{model_dir} holds a Megatron checkpoint ({marker}), not FSDP model shards "
                "(model_world_size_<W>_rank_<R>.pt): checkpoint sync cannot read Megatron's "
                "distributed-checkpoint layout. Sync a Megatron trainer's weights from memory "
                "(megatron_upload_state_dict, or upload_state_dict, which call "
                "Synchronizer.set_model_state_dict) or by broadcast (megatron_sync_weight_nccl), "
                "and create the Synchronizer without default_local_dir so that it does not "
                "watch the checkpoints"
            )
        raise StateDictLoadError(f"{model_dir} holds no model_world_size_<W>_rank_<R>.pt files")
    if len(found) > 1:
        raise StateDictLoadError(
            f"{model_dir} mixes shards of world sizes {sorted(found)}; remove the stale ones"
        )
    ((world, ranks),) = found.items()
    if world == 0:
        raise StateDictLoadError(
            f"{model_dir} holds shards of world size 0 ({sorted(ranks.values())[0].name}), "
            "which no save writes; remove them"
        )
    present = sum(1 for r in ranks if r < world)
    if present < world:
        # Counted, not listed: the world size is read from a file name, and may be absurd.
        missing = [r for r in range(min(world, present + _NAMED_RANKS + 1)) if r not in ranks]
        shown = ", ".join(map(str, missing[:_NAMED_RANKS]))
        more = ", ..." if world - present > _NAMED_RANKS else ""
        raise StateDictLoadError(
            f"{model_dir} lacks the shards of ranks [{shown}{more}] (world size {world}, "
            f"{world - present} missing)"
        )
    return world, ranks


def load_sharded_state_dict(
    model_dir: str | os.PathLike, *, manifest_dir: str | os.PathLike | None = None
) -> dict[str, torch.Tensor]:
    """Load every rank's shard file in ``model_dir`` and merge them into a full state dict.

    Read through :mod:`obsckpt.loading`: ``model_dir`` must lie in a committed
    step, every shard must be listed in its manifest and match its size and
    CRC32, and files are loaded with ``weights_only=True`` only. ``manifest_dir``
    (the ``global_step_<N>`` directory) is accepted for callers that pass it; it
    must be the step directory holding ``model_dir``.

    Raises:
        StateDictLoadError: a shard is missing, not in the manifest, corrupt, holds
            objects ``weights_only`` refuses, or cannot be merged; or the step is
            not committed (:class:`~obsckpt.errors.UnverifiedCheckpointError`).
    """
    model_dir = Path(model_dir)
    world, paths = shard_files(model_dir)
    step = CommittedStep.of(model_dir)
    if manifest_dir is not None and os.path.abspath(manifest_dir) != os.fspath(step.dir):
        raise StateDictLoadError(
            f"manifest_dir {manifest_dir} is not the step directory {step.dir} that holds "
            f"{model_dir}; pass that one (or none)"
        )
    shards: dict[int, Mapping[str, Any]] = {}
    for rank in range(world):
        path = paths[rank]
        with quiet_mesh_unpickling():
            obj = step.torch_load(path, map_location="cpu")
        if not isinstance(obj, Mapping):
            raise StateDictLoadError(f"{path} holds a {type(obj).__name__}, not a state dict")
        if rank == 0 and is_adapter_only(obj):
            # verl's checkpoint.save_lora_only: the base weights are not in the step, so
            # publishing these would hand the rollout side a model without them.
            raise AdapterOnlyError(
                f"{path} holds only LoRA adapter weights ({len(obj)} tensors, e.g. "
                f"{next(iter(obj))!r}): the step was saved with checkpoint.save_lora_only="
                "True and is not a whole model, so it is not published. For checkpoint sync "
                "keep whole-model files (save_state_dict / fsdp_save_state_dict always write "
                "them; or set checkpoint.save_lora_only=false), or sync a LoRA run's weights "
                "from memory (upload_state_dict) or by broadcast"
            )
        shards[rank] = obj
    return merge_shards(shards)


def merge_shards(shards: Mapping[int, Mapping[str, Any]]) -> dict[str, torch.Tensor]:
    """Merge per-rank state dicts (DTensor shards, their :class:`ShardPiece`, or plain
    tensors) into full tensors.

    A sharded tensor's pieces are placed by their rank's coordinate in the saved
    device mesh: ``Shard(d)`` pieces are concatenated along ``d`` (innermost
    mesh dimension first), ``Replicate`` ones are taken once. A plain tensor
    is the same on every rank; rank 0's (the lowest rank's) is used, and the
    other ranks may send None for it.
    """
    from torch.distributed.tensor import DTensor

    ranks = sorted(shards)
    if not ranks:
        return {}
    names = list(shards[ranks[0]])
    for r in ranks[1:]:
        if set(shards[r]) != set(names):
            diff = sorted(set(names) ^ set(shards[r]))[:3]
            raise StateDictLoadError(
                f"rank {r}'s shard holds different names than rank {ranks[0]}'s (e.g. {diff})"
            )
    out: dict[str, torch.Tensor] = {}
    for name in names:
        first = shards[ranks[0]][name]
        if isinstance(first, DTensor | ShardPiece):
            pieces = [(r, ShardPiece.of(shards[r][name])) for r in ranks]
            out[name] = _merge_pieces(name, pieces)
        elif isinstance(first, torch.Tensor):
            out[name] = first
        elif type(first).__name__ == "ShardedTensor":
            raise StateDictLoadError(
                f"{name!r} is a ShardedTensor (FSDP1's default sharded state dict), which "
                "cannot be merged without a process group; save with "
                "ShardedStateDictConfig(_use_dtensor=True) as fsdp_save_state_dict does"
            )
        else:
            out[name] = first  # non-tensor extras (e.g. _extra_state) pass through
    return out


@dataclass(frozen=True, slots=True)
class ShardPiece:
    """One rank's piece of a sharded tensor, as :func:`merge_shards` places it: the local
    tensor, the placements, the device mesh's ranks and the global shape.

    It pickles without a copy of the local tensor's bytes (out of band under
    pickle protocol 5: Ray writes them into its object store once), and is
    rebuilt without a process group or a device mesh.
    """

    local: torch.Tensor
    placements: tuple[Any, ...]
    mesh: torch.Tensor
    shape: tuple[int, ...]

    @classmethod
    def of(cls, value: Any) -> ShardPiece:
        """``value`` (a DTensor, or a piece already) as a piece; a DTensor's local tensor is not copied.

        Raises:
            StateDictLoadError: ``value`` is neither (another rank's entry of the name is).
        """
        if isinstance(value, ShardPiece):
            return value
        if not hasattr(value, "device_mesh"):
            raise StateDictLoadError(
                f"a {type(value).__name__} where another rank holds a sharded tensor"
            )
        return cls(
            value.to_local(), tuple(value.placements), value.device_mesh.mesh, tuple(value.shape)
        )

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ShardPiece, (ZeroCopyTensor(self.local), self.placements, self.mesh, self.shape)


def _merge_pieces(name: str, pieces: list[tuple[int, ShardPiece]]) -> torch.Tensor:
    first = pieces[0][1]
    placements = first.placements
    mesh = first.mesh
    for p in placements:
        if type(p).__name__ == "_StridedShard" or not (p.is_shard() or p.is_replicate()):
            raise StateDictLoadError(
                f"{name!r} has placement {p}, which obsckpt cannot merge; only Shard and "
                "Replicate placements (FSDP2, HSDP) are supported"
            )
    sharded = [(d, p.dim) for d, p in enumerate(placements) if p.is_shard()]
    chunks: dict[tuple[int, ...], torch.Tensor] = {}
    for rank, piece in pieces:
        where = (mesh == rank).nonzero()
        if where.numel() == 0:
            raise StateDictLoadError(
                f"{name!r}: rank {rank} is not in the saved device mesh {mesh.tolist()}"
            )
        coord = tuple(int(c) for c in where[0])
        if any(coord[d] != 0 for d, p in enumerate(placements) if p.is_replicate()):
            continue  # a replica of a piece another rank already holds
        chunks[tuple(coord[d] for d, _ in sharded)] = piece.local

    def assemble(prefix: tuple[int, ...], level: int) -> torch.Tensor:
        if level == len(sharded):
            try:
                return chunks[prefix]
            except KeyError:
                raise StateDictLoadError(
                    f"{name!r}: no rank holds the piece at mesh coordinate {prefix}"
                ) from None
        mesh_dim, tensor_dim = sharded[level]
        parts = [assemble(prefix + (c,), level + 1) for c in range(mesh.shape[mesh_dim])]
        return torch.cat(parts, dim=tensor_dim)

    full = assemble((), 0)
    if tuple(full.shape) != tuple(first.shape):
        raise StateDictLoadError(
            f"{name!r}: merged shape {tuple(full.shape)} differs from the saved global shape "
            f"{tuple(first.shape)}"
        )
    return full


def state_dict_meta(state_dict: Mapping[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of every tensor, in order (dtype without ``torch.``)."""
    return [
        (name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in state_dict.items()
        if isinstance(t, torch.Tensor)
    ]
