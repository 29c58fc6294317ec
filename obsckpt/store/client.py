"""What the commit protocol needs of an object store, and the values it returns.

:class:`ObjectClient` is the interface the pointer and the probe call; the S3
implementation is :class:`obsckpt.store.s3.S3Client`. Keeping the protocol apart
from boto3 lets the commit protocol be imported (and tested with wrappers that
misbehave on purpose) without the ``s3`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Blob", "ListedObject", "MultipartUpload", "ObjectClient", "ObjectInfo"]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a HEAD (or a GET) says of an object.

    ``etag`` is as the server sent it, quotes included, so it can be handed back
    in If-Match unchanged; ``version`` is the version id on a versioned bucket.
    """

    size: int
    etag: str
    version: str | None = None


@dataclass(frozen=True, slots=True)
class Blob:
    """An object's whole content with the ETag of that content (read in one GET)."""

    data: bytes
    info: ObjectInfo


@dataclass(frozen=True, slots=True)
class ListedObject:
    """One entry of a listing."""

    key: str
    size: int
    etag: str
    modified: float | None = None  # last modified, seconds since the epoch


@dataclass(frozen=True, slots=True)
class MultipartUpload:
    """A multipart upload begun and neither completed nor aborted."""

    key: str
    upload_id: str


class ObjectClient(Protocol):
    """The conditional-write object API the commit protocol is written against.

    Every method raises a :class:`~obsckpt.store.errors.StoreError`:
    :class:`~obsckpt.store.errors.PreconditionFailed` when a condition did not
    hold, :class:`~obsckpt.store.errors.ConditionalConflict` when a concurrent
    write raced a conditional one, :class:`~obsckpt.store.errors.StoreUnavailableError`
    when no answer came.
    """

    @property
    def bucket(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    def put_create_only(self, key: str, data: bytes) -> str:
        """Write ``key`` only if no object is there (If-None-Match: *); its new ETag."""
        ...

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Replace ``key`` only if its ETag is still ``etag`` (If-Match); its new ETag."""
        ...

    def put(self, key: str, data: bytes) -> str:
        """Write ``key`` unconditionally; its new ETag."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """``key``'s size and ETag, None when there is no such object."""
        ...

    def read(self, key: str) -> Blob | None:
        """``key``'s content with its ETag, None when there is no such object."""
        ...

    def delete(self, keys: list[str]) -> None:
        """Delete ``keys``; a key already gone is no error."""
        ...
