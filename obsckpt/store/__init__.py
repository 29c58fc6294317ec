"""The storage layer: where checkpoints live, on a filesystem or an object store.

The on-disk contract (:mod:`~obsckpt.store.layout`), a root's committed steps
behind one interface (:mod:`~obsckpt.store.roots`: ``PosixRoot``, ``S3Root``),
the POSIX backend (``commit``, ``rootlock``, ``torchfile``, ``file_records``,
``repair``), the read path that verifies before it deserialises (``reader``,
``checked_read``, ``loading``), and the S3 backend:

- :mod:`~obsckpt.store.uri`: what a root names (``parse_root``: a local path or
  ``s3://bucket/prefix``; other schemes refused).
- :mod:`~obsckpt.store.s3`: :class:`S3Client`, conditional writes and parallel
  transfers on boto3 (the ``s3`` extra: ``pip install 'obsckpt[s3]'``); loaded on
  first use, so importing this package does not need boto3.
- :mod:`~obsckpt.store.probe`: whether an endpoint enforces conditional writes.
- :mod:`~obsckpt.store.pointer`: the commit protocol (a create-only manifest and a
  pointer moved by compare-and-swap, fenced by an owner epoch).
- :mod:`~obsckpt.store.errors`: their exceptions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from obsckpt.store.client import Blob, ListedObject, MultipartUpload, ObjectClient, ObjectInfo
from obsckpt.store.errors import (
    ConditionalConflict,
    ConditionalWritesUnsupportedError,
    FencedError,
    ManifestConflictError,
    ObjectNotFoundError,
    PointerFormatError,
    PreconditionFailed,
    StoreError,
    StoreUnavailableError,
    UnsupportedStoreError,
)
from obsckpt.store.pointer import Lease, Pointer, RootPointer, read_pointer
from obsckpt.store.probe import probe_conditional_writes
from obsckpt.store.uri import Root, is_remote, parse_root, refuse_unsupported

if TYPE_CHECKING:
    from obsckpt.store.s3 import S3Client, S3Options

__all__ = [
    "Blob",
    "ConditionalConflict",
    "ConditionalWritesUnsupportedError",
    "FencedError",
    "Lease",
    "ListedObject",
    "ManifestConflictError",
    "MultipartUpload",
    "ObjectClient",
    "ObjectInfo",
    "ObjectNotFoundError",
    "Pointer",
    "PointerFormatError",
    "PreconditionFailed",
    "Root",
    "RootPointer",
    "S3Client",
    "S3Options",
    "StoreError",
    "StoreUnavailableError",
    "UnsupportedStoreError",
    "is_remote",
    "parse_root",
    "probe_conditional_writes",
    "read_pointer",
    "refuse_unsupported",
]


def __getattr__(name: str) -> Any:
    # boto3 is the s3 extra's: imported when the client is first asked for.
    if name in ("S3Client", "S3Options"):
        try:
            from obsckpt.store import s3
        except ModuleNotFoundError as err:
            if err.name not in ("boto3", "botocore"):
                raise
            raise ModuleNotFoundError(
                f"obsckpt.store.{name} needs boto3, which is not installed: "
                "pip install 'obsckpt[s3]'",
                name=err.name,
            ) from err
        return getattr(s3, name)
    raise AttributeError(f"module 'obsckpt.store' has no attribute {name!r}")
