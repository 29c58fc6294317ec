"""Domain exceptions; each refines the builtin a caller would already catch."""

from __future__ import annotations

from functools import partial
from typing import Any


class CheckpointDirError(OSError):
    """The checkpoint root is missing, not a directory, or not writable."""


class RootInUseError(CheckpointDirError):
    """Another job's monitor holds the checkpoint root; ``holder`` says who ({} if unknown)."""

    def __init__(self, message: str, *, holder: dict[str, Any]) -> None:
        super().__init__(message)
        self.holder = holder

    def __reduce__(self) -> tuple[Any, ...]:
        return (partial(type(self), holder=self.holder), self.args, dict(vars(self)))


class IterationFileError(ValueError):
    """An iteration file exists but does not hold a step number."""


class NotificationError(ValueError):
    """A notification does not match what the monitor knows (e.g. more finishes than registrations)."""


class TensorMutatedError(RuntimeError):
    """A tensor being staged was changed in place before its copy had finished."""


class PartsMismatchError(NotificationError):
    """Parts of one save disagree on how many parts it has; their step fails.

    ``failed`` holds the (step, kind) pairs that failed as a result.
    """

    def __init__(self, message: str, *, failed: list[tuple[int, str]] | None = None) -> None:
        super().__init__(message)
        self.failed = list(failed or ())


class SaveError(RuntimeError):
    """A background save failed; carries its slot and step."""

    def __init__(self, message: str, *, slot: str, step: int) -> None:
        super().__init__(message)
        self.slot = slot
        self.step = step

    # Ray (an actor's error reaching ray.get) and multiprocessing pickle exceptions;
    # the default rebuilds one by calling its class with ``args`` alone, which
    # fails for keyword-only state and leaves the caller an unpickling error.
    def __reduce__(self) -> tuple[Any, ...]:
        return (partial(type(self), slot=self.slot, step=self.step), self.args, dict(vars(self)))


class SaveTimeoutError(SaveError, TimeoutError):
    """A save, a join or a wait did not finish within its timeout."""
