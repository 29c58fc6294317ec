"""The exceptions of checkpoint roots on object stores.

Defined in :mod:`obsckpt.errors` with every other exception obsckpt raises (each
under :class:`~obsckpt.errors.ObsckptError`, importable from ``obsckpt``), and
named here for the store's modules. A :class:`StoreError` carries the
``operation`` (``put``, ``get``, ...) and the ``status`` (an HTTP status, or
``"timeout"`` / ``"connection"`` when no answer came), the two labels of a
per-request error counter.
"""

from __future__ import annotations

from obsckpt.errors import (
    ConditionalConflict,
    ConditionalWritesUnsupportedError,
    FencedError,
    ManifestConflictError,
    ObjectNotFoundError,
    PointerFormatError,
    PreconditionFailed,
    StoreCheckError,
    StoreError,
    StoreUnavailableError,
    UnsupportedStoreError,
)

__all__ = [
    "ConditionalConflict",
    "ConditionalWritesUnsupportedError",
    "FencedError",
    "ManifestConflictError",
    "ObjectNotFoundError",
    "PointerFormatError",
    "PreconditionFailed",
    "StoreCheckError",
    "StoreError",
    "StoreUnavailableError",
    "UnsupportedStoreError",
]
