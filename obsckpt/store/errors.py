"""The exceptions of checkpoint roots on object stores.

Each is under :class:`obsckpt.errors.ObsckptError` and subclasses the builtin it
refines. A :class:`StoreError` carries the ``operation`` (``put``, ``get``, ...)
and the ``status`` (an HTTP status, or ``"timeout"`` / ``"connection"`` when no
answer came), the two labels of a per-request error counter. Classes with
keyword-only state define ``__reduce__``, so they survive pickling (an actor's
error reaching ``ray.get``).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from obsckpt.errors import ObsckptError, RootLockLostError

__all__ = [
    "ConditionalConflict",
    "ConditionalWritesUnsupportedError",
    "FencedError",
    "ManifestConflictError",
    "ObjectNotFoundError",
    "PointerFormatError",
    "PreconditionFailed",
    "StoreError",
    "StoreUnavailableError",
    "UnsupportedStoreError",
]


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
