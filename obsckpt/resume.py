"""The resume record: a trainer's RL state beside its weights, committed with them.

A checkpoint of model and optimizer is not enough to resume an RL job where it
stopped: the data loader's position, the random number generators and the
weight version the rollout side holds must come back too, or the resumed run
trains on other data, draws other samples, or waits for weights no one sends.
A :class:`ResumeRecord` holds them, per rank (each rank's RNG differs):

* ``data``: the data loader's position (a torchdata ``StatefulDataLoader``'s
  ``state_dict()``, or any plain dict);
* ``rng``: torch's CPU generator, CUDA's (when this process uses CUDA), NumPy's
  global generator and Python's ``random`` (:func:`capture_rng`);
* ``weight_version``: the version under which the trainer publishes this
  step's weights to the rollout side, so a resumed trainer publishes them
  again under it (and a Synchronizer restarts its versions there);
* ``user``: any other state, a dict of tensors and plain values.

:func:`save_resume_record` saves it through a :class:`CheckpointCoordinator`
as one more save of the step, registered before it starts: the step does not
commit without it, and its file (``global_step_<N>/resume/rank_<R>.pt``) is
listed in the step's manifest with its CRC32. :func:`load_resume_record` reads
it back through :mod:`obsckpt.loading` (committed step, manifest checked,
``weights_only=True``); :func:`restore_resume_record` also restores the RNGs and
the data loader.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from obsckpt import validators
from obsckpt.coordinator import CheckpointCoordinator, StagedSave
from obsckpt.errors import ResumeRecordError
from obsckpt.store import layout, loading

__all__ = [
    "RECORD_FORMAT",
    "RESUME_SLOT",
    "ResumeRecord",
    "capture_rng",
    "load_resume_record",
    "record_path",
    "restore_resume_record",
    "restore_rng",
    "save_resume_record",
]

# The coordinator slot the record is saved in, and its directory inside a step. verl
# writes actor/, critic/, data.pt and huggingface/ there, never resume/.
RESUME_SLOT = "resume"
RESUME_SUBDIR = "resume"
# The record's own format; a reader refuses any other by name.
RECORD_FORMAT = 1

_PLAIN = (bool, int, float, str, bytes, type(None))


def record_path(root: str | os.PathLike, step: int, rank: int) -> Path:
    """``<root>/global_step_<step>/resume/rank_<rank>.pt``."""
    validators.validate_step(step)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be a non-negative integer, got {rank!r}")
    return layout.step_dir(root, step) / RESUME_SUBDIR / f"rank_{rank}.pt"


def record_location(root: str | os.PathLike, step: int, rank: int) -> str:
    """:func:`record_path` as a string; an object URL for an ``s3://`` root."""
    if "://" not in os.fspath(root):
        return os.fspath(record_path(root, step, rank))
    record_path("/", step, rank)  # the same checks of step and rank
    return layout.step_location(root, step, RESUME_SUBDIR, f"rank_{rank}.pt")


# -- random number generators -------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """This process's RNG states, as tensors and plain values (they load with weights_only).

    CUDA's are included when this process has initialised CUDA (capturing them
    otherwise would create a CUDA context in a CPU-only process).
    """
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return {
        "torch": torch.get_rng_state().clone(),
        "cuda": cuda,
        "numpy": {
            "bit_generator": str(np_name),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "python": {
            "version": int(py_version),
            "internal": torch.tensor(py_internal, dtype=torch.int64),
            "gauss_next": py_gauss,
        },
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNGs to ``state`` (from :func:`capture_rng`).

    Raises:
        ResumeRecordError: ``state`` lacks a generator, or holds CUDA states for
            more devices than this process sees.
    """
    try:
        torch_state, cuda, np_state, py_state = (
            state["torch"],
            state["cuda"],
            state["numpy"],
            state["python"],
        )
        np_tuple = (
            np_state["bit_generator"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
        py_tuple = (
            py_state["version"],
            tuple(int(v) for v in py_state["internal"].tolist()),
            py_state["gauss_next"],
        )
    except (KeyError, TypeError, AttributeError) as exc:
        raise ResumeRecordError(
            f"the RNG state lacks {exc} or holds the wrong type; it must come from "
            "obsckpt.resume.capture_rng()"
        ) from exc
    if cuda is not None:
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if len(cuda) > visible:
            raise ResumeRecordError(
                f"the RNG state holds {len(cuda)} CUDA generators, this process sees {visible} "
                "CUDA devices; resume with the same devices per rank, or restore with rng=False"
            )
        for index, cuda_state in enumerate(cuda):
            torch.cuda.set_rng_state(_own_storage(cuda_state), index)
    torch.set_rng_state(_own_storage(torch_state))
    np.random.set_state(np_tuple)
    random.setstate(py_tuple)


def _own_storage(state: torch.Tensor) -> torch.Tensor:
    """``state`` in a storage of its own, as the generators' setters need.

    A file obsckpt wrote packs small tensors into one storage per dtype; loaded
    back, each is a view at an offset into it, which ``torch.set_rng_state``
    reads from the storage's start (or crashes on).
    """
    return state.detach().to("cpu", copy=True).contiguous()


# -- the record -----------------------------------------------------------------


@dataclass(kw_only=True, slots=True)
class ResumeRecord:
    """A rank's RL state at a step, beside the step's weights (module docstring).

    ``data`` and ``user`` hold tensors and plain values only (dicts, lists,
    tuples, ``bool``/``int``/``float``/``str``/``bytes``/``None``), so the file
    loads with ``weights_only=True``; anything else is refused here, when the
    record is made, not at the resume.
    """

    step: int
    data: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None
    weight_version: int | None = None
    user: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validators.validate_step(self.step)
        if self.weight_version is not None:
            validators.validate_step(self.weight_version, "weight_version")
        for name in ("data", "user"):
            value = getattr(self, name)
            if not isinstance(value, dict):
                raise ValueError(
                    f"{name} must be a dict (e.g. a data loader's state_dict()), got "
                    f"{type(value).__name__}"
                )
            _check_plain(value, name)

    @classmethod
    def capture(
        cls,
        step: int,
        *,
        data: Any = None,
        weight_version: int | None = None,
        user: dict[str, Any] | None = None,
        rng: bool = True,
    ) -> ResumeRecord:
        """This process's record at ``step``: ``data`` is a dict or has ``state_dict()``."""
        if data is not None and not isinstance(data, dict) and hasattr(data, "state_dict"):
            data = data.state_dict()
        return cls(
            step=step,
            data={} if data is None else data,
            rng=capture_rng() if rng else None,
            weight_version=weight_version,
            user={} if user is None else user,
        )

    def to_state(self, rank: int) -> dict[str, Any]:
        """What the record's file holds for ``rank``."""
        return {
            "format": RECORD_FORMAT,
            "step": self.step,
            "rank": rank,
            "data": self.data,
            "rng": self.rng,
            "weight_version": self.weight_version,
            "user": self.user,
        }

    @classmethod
    def from_state(cls, state: Any, path: Any, *, step: int, rank: int) -> ResumeRecord:
        """The record in ``state`` (read from ``path``), checked to be ``rank``'s at ``step``.

        Raises:
            ResumeRecordError: another format, another step or rank, or not a record.
        """
        if not isinstance(state, dict) or "format" not in state:
            raise ResumeRecordError(
                f"{path} is not a resume record (it holds {type(state).__name__}); "
                "save it with obsckpt.resume.save_resume_record"
            )
        if state["format"] != RECORD_FORMAT:
            raise ResumeRecordError(
                f"{path} is a resume record of format {state['format']!r}, this obsckpt reads "
                f"format {RECORD_FORMAT}; upgrade obsckpt to resume from it"
            )
        if state.get("step") != step or state.get("rank") != rank:
            raise ResumeRecordError(
                f"{path} holds the record of step {state.get('step')!r}, rank "
                f"{state.get('rank')!r}, not of step {step}, rank {rank}: the file was copied "
                "or renamed; resume from a step whose records are its own"
            )
        try:
            return cls(
                step=state["step"],
                data=state["data"],
                rng=state["rng"],
                weight_version=state["weight_version"],
                user=state["user"],
            )
        except (KeyError, ValueError) as exc:
            raise ResumeRecordError(f"{path} is a damaged resume record: {exc}") from exc


def _check_plain(value: Any, where: str) -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not load back, naming where it is."""
    if isinstance(value, torch.Tensor) or isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise ValueError(f"{where} has the key {key!r}; use str or int keys")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        for index, item in enumerate(value):
            _check_plain(item, f"{where}[{index}]")
        return
    hint = "torch.from_numpy(x)" if isinstance(value, (np.ndarray, np.generic)) else "its state"
    raise ValueError(
        f"{where} is a {type(value).__name__}: a resume record holds tensors and plain values "
        "(dict, list, tuple, bool, int, float, str, bytes, None) so that it loads with "
        f"weights_only=True; store {hint} instead"
    )


# -- saving and loading ---------------------------------------------------------


def save_resume_record(
    coordinator: CheckpointCoordinator,
    record: ResumeRecord,
    *,
    register: bool = True,
) -> StagedSave:
    """Save ``record`` as one more save of its step, for the coordinator's rank.

    With ``register`` (the default) the save is registered with the monitor
    first (one checkpoint save of this rank), so the step commits only once the
    record is durable, listed in its manifest. Pass ``register=False`` when the
    trainer registers the step's save counts itself. The record is copied before
    this returns (the caller may go on changing its state); the file is written
    in the background, and a step already committed is not written again.

    Raises:
        ValueError: the coordinator has no rank.
        SavePathError: see :meth:`CheckpointCoordinator.save_state_dict_async`.
    """
    rank = coordinator.rank
    if rank is None:
        raise ValueError(
            "the coordinator has no rank, and each rank saves its own resume record; create "
            "it with CheckpointCoordinator(monitor, rank=<this rank>) or set RANK"
        )
    root = coordinator.link.checkpoint_root()
    path = record_location(root, record.step, rank)
    if "://" not in path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    if register:
        coordinator.link.register_thread_count(record.step, checkpoint_thread_count=1)
    return coordinator.save_state_dict_async(
        RESUME_SLOT, record.to_state(rank), path, record.step, unless_committed=True
    )


def load_resume_record(root: str | os.PathLike, step: int, rank: int) -> ResumeRecord:
    """``rank``'s record of committed step ``step``, verified against the step's manifest.

    Raises:
        ResumeRecordError: the step has no record for ``rank``, or it is not a
            record of this step and rank.
        UnverifiedCheckpointError: the step is not committed, or the file does
            not match its manifest.
        UnsafeCheckpointError: the file names a global loading could run code from.
    """
    path = record_location(root, step, rank)
    committed: loading.CommittedStep | loading.CommittedObjects
    if "://" in path:
        committed = loading.CommittedObjects.of(path)
        listed = committed.path_of(path) in committed.paths()
    else:
        committed = loading.CommittedStep.of(path)
        listed = os.path.relpath(path, committed.dir) in committed.records
    if not listed:
        raise ResumeRecordError(
            f"committed step {step} in {root} has no resume record for rank {rank} ({path} "
            "is not in its manifest): it was saved without save_resume_record, or by fewer "
            "ranks; resume from a step saved with one"
        )
    state = _own_storages(committed.torch_load(path, map_location="cpu"))
    return ResumeRecord.from_state(state, path, step=step, rank=rank)


def _own_storages(obj: Any) -> Any:
    """``obj`` with each tensor in a storage of its own (see :func:`_own_storage`): a data
    loader's ``load_state_dict`` hands its generator state to ``Generator.set_state``."""
    if isinstance(obj, torch.Tensor):
        return _own_storage(obj)
    if isinstance(obj, dict):
        return {key: _own_storages(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_own_storages(value) for value in obj)
    return obj


def restore_resume_record(
    root: str | os.PathLike,
    step: int,
    rank: int,
    *,
    data_loader: Any = None,
    rng: bool = True,
) -> ResumeRecord:
    """Load ``rank``'s record of ``step`` and restore it: RNGs and, if given, the data loader.

    ``data_loader.load_state_dict(record.data)`` is called when ``data_loader``
    is given; the weight version and the user state are the caller's to apply
    (e.g. ``Synchronizer.resume_from(record.weight_version)``).

    Raises:
        See :func:`load_resume_record` and :func:`restore_rng`.
    """
    record = load_resume_record(root, step, rank)
    if rng and record.rng is not None:
        restore_rng(record.rng)
    if data_loader is not None:
        data_loader.load_state_dict(record.data)
    return record
