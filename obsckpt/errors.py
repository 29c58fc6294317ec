"""Every exception obsckpt raises, under one root a user can catch.

Each class also subclasses the builtin it refines, so code that already catches
``OSError``, ``ValueError``, ``RuntimeError`` or ``TimeoutError`` keeps working.
Classes with keyword-only state define ``__reduce__``: Ray (an actor's error
reaching ``ray.get``) and multiprocessing pickle exceptions, and the default
rebuilds one from ``args`` alone, which fails for keyword-only state.
"""

from __future__ import annotations

from functools import partial
from typing import Any

__all__ = [
    "AdapterOnlyError",
    "BroadcastError",
    "BroadcastTimeoutError",
    "CheckpointDirError",
    "CliError",
    "ConditionalConflict",
    "ConditionalWritesUnsupportedError",
    "DemoError",
    "DeviceSelectionError",
    "FencedError",
    "FsyncTimeoutError",
    "IpcLayoutUnknownError",
    "WeightSyncCorruptError",
    "IterationContentError",
    "IterationFileError",
    "ManifestConflictError",
    "MegatronLayoutError",
    "MirrorError",
    "MonitorCallError",
    "MonitorTimeoutError",
    "MonitorUnavailableError",
    "NotificationError",
    "ObjectNotFoundError",
    "ObsckptError",
    "PartsMismatchError",
    "PointerFormatError",
    "PreconditionFailed",
    "RayShutDownError",
    "ResumeRecordError",
    "RootInUseError",
    "RootLockLostError",
    "SaveError",
    "SavePathError",
    "SaveTimeoutError",
    "StateDictLoadError",
    "StoreCheckError",
    "StoreError",
    "StoreUnavailableError",
    "TensorMutatedError",
    "UnsafeCheckpointError",
    "UnsupportedStoreError",
    "UnverifiedCheckpointError",
    "WaitTimeoutError",
    "WeightMismatchError",
]


class ObsckptError(Exception):
    """The root of every exception obsckpt defines."""


# --- the checkpoint root and what is on disk -------------------------------


class CheckpointDirError(ObsckptError, OSError):
    """The checkpoint root is missing, not a directory, or not writable."""


class RootInUseError(CheckpointDirError):
    """Another job's monitor holds the checkpoint root; ``holder`` says who ({} if unknown)."""

    def __init__(self, message: str, *, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder

    def __reduce__(self) -> tuple[Any, ...]:
        return (partial(type(self), holder=self.holder), self.args, dict(vars(self)))


class IterationFileError(ObsckptError, ValueError):
    """An iteration file exists but does not hold a step number."""


class IterationContentError(IterationFileError):
    """An iteration file was read, and what it holds is not a step number (empty,
    text, too long): ``obsckpt repair`` points it at the latest whole step. A file
    that could not be read raises :class:`IterationFileError` itself (leave it)."""


class RootLockLostError(ObsckptError, RuntimeError):
    """This monitor no longer owns its checkpoint root, so it commits nothing more.

    It was shut down (its lock released), or its lock file was deleted or
    replaced while it ran (another monitor may own the root now).
    """


class FsyncTimeoutError(ObsckptError, TimeoutError):
    """fsyncs did not finish within their timeout (a hung storage server); names the files."""


# --- saves and the monitor ---------------------------------------------------


class NotificationError(ObsckptError, ValueError):
    """A notification does not match what the monitor knows (e.g. more finishes than registrations)."""


class PartsMismatchError(NotificationError):
    """Parts of one save disagree on how many parts it has; their step fails.

    ``failed`` holds the (step, kind) pairs that failed as a result.
    """

    def __init__(self, message: str, *, failed: list[tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.failed = list(failed or ())


class TensorMutatedError(ObsckptError, RuntimeError):
    """A tensor being staged was changed in place before its copy had finished."""


class SaveError(ObsckptError, RuntimeError):
    """A background save failed; carries its slot and step."""

    def __init__(self, message: str, *, slot: str, step: int) -> None:
        super().__init__(message)
        self.slot = slot
        self.step = step

    def __reduce__(self) -> tuple[Any, ...]:
        return (partial(type(self), slot=self.slot, step=self.step), self.args, dict(vars(self)))


class SaveTimeoutError(SaveError, TimeoutError):
    """A save, a join or a wait did not finish within its timeout."""


class WaitTimeoutError(ObsckptError, TimeoutError):
    """A wait inside a save (the writer's helper threads, a staging copy) outlived its bound.

    The message names what was waited for and for how long; the save that
    waited fails with it (a background save reports it as its error).
    """


class RayShutDownError(ObsckptError, RuntimeError):
    """Ray is not initialized in this process, so the monitor cannot be reached."""


class SavePathError(ObsckptError, ValueError):
    """A save names a path outside its own step directory; refused before anything is written."""


class MonitorCallError(ObsckptError, RuntimeError):
    """A call to the checkpoint monitor raised inside the monitor (the Ray error is its cause)."""


class MonitorUnavailableError(ObsckptError, ConnectionError):
    """The checkpoint monitor cannot be reached now (restarting, or its node is gone); retryable."""


class MonitorTimeoutError(MonitorUnavailableError, TimeoutError):
    """The checkpoint monitor did not answer within ``rpc_timeout``; retryable."""


# --- weight sync -------------------------------------------------------------


class BroadcastError(ObsckptError, RuntimeError):
    """A weight broadcast failed, or its group can no longer be used."""


class BroadcastTimeoutError(BroadcastError, TimeoutError):
    """A weight broadcast (or the group's rendezvous) did not finish within its timeout."""


class WeightSyncCorruptError(BroadcastError):
    """A weight sync failed its integrity check on a receiver (a chunk's CRC32, or a digest
    after the apply); that receiver keeps its version, the group stays usable."""


class IpcLayoutUnknownError(BroadcastError):
    """A payload names a layout its receiver does not hold (a restarted rollout, say).

    The sender then describes the layout again, within the same sync.
    """


class DeviceSelectionError(ObsckptError, RuntimeError):
    """The GPU a rank was given cannot be used by this process."""


class StateDictLoadError(ObsckptError, ValueError):
    """A committed step's model shards cannot be read or merged."""


class MegatronLayoutError(StateDictLoadError):
    """A step's model directory holds Megatron's distributed checkpoint, not FSDP shards."""


class AdapterOnlyError(StateDictLoadError):
    """A step's model shards hold only LoRA adapter weights, not a whole model."""


class UnverifiedCheckpointError(StateDictLoadError):
    """A file to be loaded is not part of a whole committed step, or does not match its manifest."""


class UnsafeCheckpointError(StateDictLoadError):
    """A file to be loaded refers to a Python global that loading could run code from."""


class ResumeRecordError(StateDictLoadError):
    """A step's resume record is missing for a rank, of another format, or not its own."""


# --- the command line and the demo --------------------------------------------


class CliError(ObsckptError):
    """A problem the ``obsckpt`` command reports as one line on stderr with exit code 2."""


class DemoError(ObsckptError, RuntimeError):
    """The demo cannot start or continue; the message says why and what to do."""


class WeightMismatchError(ObsckptError, RuntimeError):
    """The rollout's weights are not the trainer's: the run failed (exit 1, not a usage error)."""


# -- checkpoint roots on object stores (obsckpt.store) --------------------------


class UnsupportedStoreError(ObsckptError, ValueError):
    """A checkpoint root names a storage scheme obsckpt does not write to (gs://, hdfs://, ...)."""


class StoreError(ObsckptError, OSError):
    """A request to an object store failed.

    Attributes:
        operation: what was asked (``put``, ``put_if_match``, ``get``, ``list``, ...).
        key: the object key, or the prefix for a listing ("" when neither).
        status: the HTTP status of the answer, or ``"timeout"`` / ``"connection"``
            when none came; ``code`` is it as a metric label.
    """

    def __init__(self, message: str, *, operation: str, key: str, status: int | str) -> None:
        super().__init__(message)
        self.operation = operation
        self.key = key
        self.status = status

    @property
    def code(self) -> str:
        """``status`` as a label value: ``"412"``, ``"timeout"``."""
        return str(self.status)

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = partial(type(self), operation=self.operation, key=self.key, status=self.status)
        return (rebuild, self.args, dict(vars(self)))


class MirrorError(ObsckptError, RuntimeError):
    """A step could not be copied to the monitor's mirror, or restored from it (named)."""


class StoreCheckError(StoreError):
    """Objects a rank reported are missing or differ at commit time; the step is not committed."""


class PreconditionFailed(StoreError):
    """412: a conditional write's condition did not hold (the object exists, or its ETag moved)."""


class ConditionalConflict(StoreError):
    """409 ConditionalRequestConflict: a concurrent write raced this conditional write.

    Whether this write took effect is not known from the answer alone; read the
    object to settle it.
    """


class ObjectNotFoundError(StoreError, FileNotFoundError):
    """404: the object (or its bucket) does not exist."""


class StoreUnavailableError(StoreError, ConnectionError):
    """No answer from the endpoint: connection refused, reset, or timed out.

    ``maybe_applied`` is False when the request never left (the connection could
    not be made), True when it may have reached the server before the answer was
    lost: a write's outcome is then unknown until the object is read back.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        key: str,
        status: int | str,
        maybe_applied: bool = True,
    ) -> None:
        super().__init__(message, operation=operation, key=key, status=status)
        self.maybe_applied = maybe_applied

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = partial(
            type(self),
            operation=self.operation,
            key=self.key,
            status=self.status,
            maybe_applied=self.maybe_applied,
        )
        return (rebuild, self.args, dict(vars(self)))


class ConditionalWritesUnsupportedError(ObsckptError, RuntimeError):
    """The endpoint ignores or rejects If-None-Match / If-Match, so commits there are unsafe.

    ``endpoint`` is the endpoint probed, ``check`` the check that failed.
    """

    def __init__(self, message: str, *, endpoint: str, check: str) -> None:
        super().__init__(message)
        self.endpoint = endpoint
        self.check = check

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = partial(type(self), endpoint=self.endpoint, check=self.check)
        return (rebuild, self.args, dict(vars(self)))


class FencedError(RootLockLostError):
    """Another owner took the root over (a higher epoch is in its pointer); commit nothing more.

    ``root`` is the root, ``epoch`` this owner's epoch, ``new_epoch`` the one that
    fenced it.
    """

    def __init__(self, message: str, *, root: str, epoch: int, new_epoch: int) -> None:
        super().__init__(message)
        self.root = root
        self.epoch = epoch
        self.new_epoch = new_epoch

    def __reduce__(self) -> tuple[Any, ...]:
        rebuild = partial(type(self), root=self.root, epoch=self.epoch, new_epoch=self.new_epoch)
        return (rebuild, self.args, dict(vars(self)))


class ManifestConflictError(ObsckptError, FileExistsError):
    """A step's manifest already exists with other content; the step is not committed again."""


class PointerFormatError(ObsckptError, ValueError):
    """The root's pointer object holds something other than the pointer obsckpt writes."""
