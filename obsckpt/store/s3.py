"""An S3 object client on boto3, with conditional writes and parallel transfers.

Where and as whom it connects comes from the standard AWS settings only, read by
boto3: ``AWS_ENDPOINT_URL`` (or ``AWS_ENDPOINT_URL_S3``), ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``,
``AWS_PROFILE`` and the AWS config and credentials files. What obsckpt decides
is in :class:`S3Options`: timeouts, how many times a request is tried, the
connection pool.

Retries. Ordinary requests (GET, HEAD, LIST, unconditional PUT, multipart parts)
are retried by botocore's ``standard`` mode, bounded by
``S3Options.max_attempts``; retrying them cannot change their outcome. A
conditional PUT (If-None-Match, If-Match) is different: if its answer is lost
after the server applied it, a blind retry is refused with 412 (the object now
exists, or its ETag moved: by this very write), which would report a write
that succeeded as lost to another writer. So conditional PUTs go through a
client that botocore never retries, and are tried again here only when the
connection could not be made at all (the request never left). Any other failure
(a read timeout, a reset connection, a 409 ConditionalRequestConflict, a 5xx)
surfaces as it is: :class:`StoreUnavailableError` with ``maybe_applied=True`` or
:class:`ConditionalConflict`, and the caller settles the outcome by reading the
object back (:mod:`obsckpt.store.pointer` does).
"""

from __future__ import annotations

import builtins
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import boto3  # type: ignore[import-untyped]
import botocore  # type: ignore[import-untyped]
from botocore import exceptions as boto_errors  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]

from obsckpt.store.client import Blob, ListedObject, MultipartUpload, ObjectInfo
from obsckpt.store.errors import (
    ConditionalConflict,
    ObjectNotFoundError,
    PreconditionFailed,
    StoreError,
    StoreUnavailableError,
)
from obsckpt.store.transfer import (
    MIN_PART_SIZE,
    UploadSource,
    ViewReader,
    check_part_size,
    run_parallel,
    source_view,
)

__all__ = ["MIN_PART_SIZE", "S3Client", "S3Options", "UploadSource"]

# A range is read into its buffer this many bytes at a time: urllib3 reads each
# readinto() into a temporary bytes object first, so one call for a whole part
# would hold a second copy of it.
_READ_CHUNK = 1024 * 1024
# DeleteObjects takes at most this many keys per request.
_DELETE_BATCH = 1000
# The wait before trying a connection again: doubles from this, up to _MAX_BACKOFF_S.
_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 2.0
# Failures where the connection was never made: the request did not reach the server.
_NOT_SENT = (
    boto_errors.EndpointConnectionError,
    boto_errors.ConnectTimeoutError,
    boto_errors.ProxyConnectionError,
)
# Failures after the request may have reached the server: no (whole) answer came.
_NO_ANSWER = (
    boto_errors.ConnectionError,
    boto_errors.HTTPClientError,
    boto_errors.IncompleteReadError,
)


@dataclass(kw_only=True, slots=True)
class S3Options:
    """How the client talks to the endpoint (where and as whom come from the AWS settings).

    Attributes:
        connect_timeout_s: the longest wait for a connection.
        read_timeout_s: the longest wait for the next bytes of an answer.
        max_attempts: tries of one request, the first included (botocore's
            ``standard`` retry mode; conditional writes: see the module's docstring).
        max_pool_connections: connections kept per client; at least the concurrency
            of parallel transfers, or their parts wait for a connection.
    """

    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    max_attempts: int = 5
    max_pool_connections: int = 32

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"S3Options.{name} must be a positive number, got {value!r}")
        for name in ("max_attempts", "max_pool_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"S3Options.{name} must be a positive integer, got {value!r}")


class S3Client:
    """One bucket's objects, through boto3.

    Args:
        bucket: the bucket every key is in.
        options: timeouts, attempts and pool size (defaults: :class:`S3Options`).
        session: the boto3 session to make clients from (default: a new one, which
            reads the standard AWS settings); hooks registered on its ``events``
            apply to this client's requests.

    Every method raises :class:`~obsckpt.store.errors.StoreError` (or a subclass:
    :class:`PreconditionFailed` for 412, :class:`ConditionalConflict` for 409
    ConditionalRequestConflict, :class:`ObjectNotFoundError` for 404,
    :class:`StoreUnavailableError` when no answer came), never a botocore error.
    """

    def __init__(
        self,
        bucket: str,
        *,
        options: S3Options | None = None,
        session: boto3.session.Session | None = None,
    ) -> None:
        self._bucket = bucket
        self._options = options if options is not None else S3Options()
        # Told of every failed request but the answers that are part of the protocol
        # (404 for an absent object, 412 for a condition that did not hold): a metric.
        self.on_error: Callable[[StoreError], None] | None = None
        session = session if session is not None else boto3.session.Session()
        self._client = session.client("s3", config=self._config(self._options.max_attempts))
        # Conditional writes: never retried by botocore (see the module's docstring).
        self._once = session.client("s3", config=self._config(1))
        put = self._once.meta.service_model.operation_model("PutObject").input_shape.members
        if "IfMatch" not in put or "IfNoneMatch" not in put:
            raise ImportError(
                f"botocore {botocore.__version__} has no conditional PutObject (If-Match); "
                "obsckpt needs boto3 1.36 or newer: pip install -U 'obsckpt[s3]'"
            )

    def _config(self, attempts: int) -> Config:
        return Config(
            connect_timeout=self._options.connect_timeout_s,
            read_timeout=self._options.read_timeout_s,
            retries={"mode": "standard", "total_max_attempts": attempts},
            max_pool_connections=self._options.max_pool_connections,
        )

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def endpoint(self) -> str:
        """The endpoint URL requests go to (from AWS_ENDPOINT_URL, a profile, or AWS's own)."""
        return str(self._client.meta.endpoint_url)

    # --- single objects --------------------------------------------------------

    def put_create_only(self, key: str, data: bytes) -> str:
        """Write ``key`` only if no object is there (If-None-Match: *); its new ETag.

        Raises:
            PreconditionFailed: an object is already there.
            ConditionalConflict, StoreUnavailableError: the outcome is unknown (read
                ``key`` to settle it; ``maybe_applied`` is False when nothing was sent).
        """
        return self._conditional_put("put_create_only", key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str:
        """Replace ``key`` only if its ETag is still ``etag`` (If-Match); its new ETag.

        Raises:
            PreconditionFailed: the ETag moved (some servers, SeaweedFS among them, also
                answer 412 where there is no object).
            ObjectNotFoundError: there is no object (AWS S3 answers 404).
            ConditionalConflict, StoreUnavailableError: as for :meth:`put_create_only`.
        """
        return self._conditional_put("put_if_match", key, data, IfMatch=etag)

    def put(self, key: str, data: bytes) -> str:
        """Write ``key`` whatever is there; its new ETag."""
        with self._translated("put", key):
            return str(self._client.put_object(Bucket=self._bucket, Key=key, Body=data)["ETag"])

    def head(self, key: str) -> ObjectInfo | None:
        """``key``'s size, ETag and version; None when there is no such object."""
        try:
            with self._translated("head", key):
                answer = self._client.head_object(Bucket=self._bucket, Key=key)
        except ObjectNotFoundError:
            return None
        return _info(answer)

    def read(self, key: str) -> Blob | None:
        """``key``'s whole content and the ETag of that content; None when there is none."""
        try:
            with self._translated("get", key):
                answer = self._client.get_object(Bucket=self._bucket, Key=key)
                data = answer["Body"].read()
        except ObjectNotFoundError:
            return None
        return Blob(data=data, info=_info(answer))

    def get(self, key: str, range: tuple[int, int] | None = None) -> bytes:
        """``key``'s content, or bytes ``[start, stop)`` of it with ``range=(start, stop)``.

        Raises:
            ObjectNotFoundError: there is no such object.
            ValueError: ``range`` is not ``0 <= start <= stop``.
        """
        args: dict[str, Any] = {"Bucket": self._bucket, "Key": key}
        if range is not None:
            start, stop = _check_range(range)
            if start == stop:
                return b""
            args["Range"] = f"bytes={start}-{stop - 1}"
        with self._translated("get", key):
            return bytes(self._client.get_object(**args)["Body"].read())

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (in requests of up to 1,000); a key already gone is no error."""
        keys = builtins.list(keys)
        for first in range(0, len(keys), _DELETE_BATCH):
            batch = keys[first : first + _DELETE_BATCH]
            with self._translated("delete", batch[0]):
                answer = self._client.delete_objects(
                    Bucket=self._bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            errors = answer.get("Errors") or []
            if errors:
                bad = errors[0]
                raise StoreError(
                    f"S3 delete of {len(errors)} of {len(batch)} objects at {self.endpoint} "
                    f"failed, the first s3://{self._bucket}/{bad.get('Key', '')}: "
                    f"{bad.get('Code', '?')} {_one_line(bad.get('Message', ''))}",
                    operation="delete",
                    key=str(bad.get("Key", "")),
                    status=str(bad.get("Code", "error")),
                )

    def list(self, prefix: str, *, max_keys: int | None = None) -> builtins.list[ListedObject]:
        """The objects whose key starts with ``prefix``, in key order (the first ``max_keys``)."""
        found: builtins.list[ListedObject] = []
        with self._translated("list", prefix):
            pages = self._client.get_paginator("list_objects_v2")
            limit = {} if max_keys is None else {"PaginationConfig": {"MaxItems": max_keys}}
            for page in pages.paginate(Bucket=self._bucket, Prefix=prefix, **limit):
                for item in page.get("Contents") or []:
                    modified = item.get("LastModified")
                    found.append(
                        ListedObject(
                            key=item["Key"],
                            size=int(item["Size"]),
                            etag=item["ETag"],
                            modified=None if modified is None else modified.timestamp(),
                        )
                    )
        return found[:max_keys] if max_keys is not None else found

    def list_prefixes(self, prefix: str) -> builtins.list[str]:
        """The "directories" right under ``prefix`` (keys up to the next ``/``), in order."""
        found: builtins.list[str] = []
        with self._translated("list", prefix):
            pages = self._client.get_paginator("list_objects_v2")
            for page in pages.paginate(Bucket=self._bucket, Prefix=prefix, Delimiter="/"):
                found += [item["Prefix"] for item in page.get("CommonPrefixes") or []]
        return found

    # --- multipart uploads and parallel reads ----------------------------------

    def upload_file_multipart(
        self, key: str, source: UploadSource, part_size: int, concurrency: int
    ) -> str:
        """Upload ``source`` to ``key`` as a multipart upload, ``concurrency`` parts at a time.

        ``source`` is bytes-like (bytes, bytearray, a memoryview of a tensor's
        storage), a path, or a binary file with a ``fileno()``: a file is mapped
        into memory, and each part is read from a view of the source, so no second
        copy of the whole is made. A failed upload is aborted before the error is
        raised. Returns the object's ETag.

        Raises:
            ValueError: ``part_size`` outside S3's limits (5 MiB to 5 GiB, at most
                10,000 parts) or ``concurrency`` below 1.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        with source_view(source) as view:
            check_part_size(part_size, len(view))
            bounds = [
                (start, min(start + part_size, len(view)))
                for start in range(0, max(len(view), 1), part_size)
            ]
            upload_id = self.begin_multipart(key)
            try:
                etags = run_parallel(
                    [
                        partial(self.upload_part, key, upload_id, n, view[lo:hi])
                        for n, (lo, hi) in enumerate(bounds, start=1)
                    ],
                    concurrency,
                    name="obsckpt-s3-upload",
                )
                return self.complete_multipart(key, upload_id, etags)
            except BaseException as err:
                self.abort_quietly(key, upload_id, err)
                raise

    def begin_multipart(self, key: str) -> str:
        """Start a multipart upload to ``key``; its upload id."""
        with self._translated("create_multipart", key):
            answer = self._client.create_multipart_upload(Bucket=self._bucket, Key=key)
        return str(answer["UploadId"])

    def upload_part(self, key: str, upload_id: str, number: int, part: memoryview) -> str:
        """Upload part ``number`` (from 1) of an upload from a view, without copying it; its ETag."""
        with self._translated(f"upload_part {number}", key):
            answer = self._client.upload_part(
                Bucket=self._bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                Body=ViewReader(part),
            )
        return str(answer["ETag"])

    def complete_multipart(self, key: str, upload_id: str, etags: builtins.list[str]) -> str:
        """Complete an upload from its parts' ETags, in part order; the object's ETag."""
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, start=1)]
        with self._translated("complete_multipart", key):
            done = self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )
        return str(done["ETag"])

    def abort_quietly(self, key: str, upload_id: str, cause: BaseException) -> None:
        """Abort an upload that failed with ``cause``; an abort failing too is noted on it."""
        try:
            self.abort_multipart(key, upload_id)
        except StoreError as abort_err:
            cause.add_note(f"aborting upload {upload_id} of {key} failed too: {abort_err}")

    def get_ranged_parallel(
        self,
        key: str,
        size: int,
        part_size: int,
        concurrency: int,
        *,
        etag: str | None = None,
    ) -> bytearray:
        """``key``'s first ``size`` bytes, read in ranges of ``part_size``, ``concurrency`` at a time.

        Each range is read straight into one preallocated buffer. With ``etag``
        every range asks If-Match, so an object replaced during the read fails
        with :class:`PreconditionFailed` instead of mixing two versions.

        Raises:
            StoreError: a range could not be read (after ``max_attempts`` tries), or
                the object is shorter than ``size``.
        """
        if part_size < 1 or concurrency < 1 or size < 0:
            raise ValueError(
                f"size must be >= 0 and part_size, concurrency >= 1; got size={size}, "
                f"part_size={part_size}, concurrency={concurrency}"
            )
        out = bytearray(size)
        view = memoryview(out)
        run_parallel(
            [
                partial(self.read_range_into, key, view[lo : min(lo + part_size, size)], lo, etag)
                for lo in range(0, size, part_size)
            ],
            concurrency,
            name="obsckpt-s3-get",
        )
        return out

    def read_range_into(self, key: str, into: memoryview, start: int, etag: str | None) -> None:
        """Fill ``into`` with ``key``'s bytes from ``start`` on (If-Match ``etag`` when given);
        a body cut off mid-stream is asked for again. StoreError: short, or failed."""
        args: dict[str, Any] = {
            "Bucket": self._bucket,
            "Key": key,
            "Range": f"bytes={start}-{start + len(into) - 1}",
        }
        if etag is not None:
            args["IfMatch"] = etag
        operation = f"get bytes {start}-{start + len(into) - 1}"
        for attempt in range(self._options.max_attempts):
            try:
                with self._translated(operation, key):
                    body = self._client.get_object(**args)["Body"]
                    filled = 0
                    while filled < len(into):
                        n = body.readinto(into[filled : filled + _READ_CHUNK])
                        if n == 0:
                            break
                        filled += n
                if filled != len(into):
                    raise StoreError(
                        f"S3 {operation} of s3://{self._bucket}/{key} at {self.endpoint}: "
                        f"only {filled} of {len(into)} bytes came; is the object shorter?",
                        operation="get",
                        key=key,
                        status="short",
                    )
                return
            except StoreUnavailableError:
                # A body cut off mid-stream: botocore retried the request, not the read.
                if attempt + 1 == self._options.max_attempts:
                    raise
                time.sleep(_backoff(attempt))

    def list_multipart_uploads(self, prefix: str) -> builtins.list[MultipartUpload]:
        """The multipart uploads under ``prefix`` that were neither completed nor aborted."""
        found: builtins.list[MultipartUpload] = []
        with self._translated("list_multipart", prefix):
            pages = self._client.get_paginator("list_multipart_uploads")
            for page in pages.paginate(Bucket=self._bucket, Prefix=prefix):
                for item in page.get("Uploads") or []:
                    found.append(MultipartUpload(key=item["Key"], upload_id=item["UploadId"]))
        return found

    def abort_multipart(self, key: str, upload_id: str) -> None:
        """Abort a multipart upload; its parts are deleted. One already gone is no error."""
        try:
            with self._translated("abort_multipart", key):
                self._client.abort_multipart_upload(
                    Bucket=self._bucket, Key=key, UploadId=upload_id
                )
        except ObjectNotFoundError:
            pass

    # --- errors -----------------------------------------------------------------

    def _conditional_put(self, operation: str, key: str, data: bytes, **condition: str) -> str:
        for attempt in range(self._options.max_attempts):
            try:
                with self._translated(operation, key):
                    answer = self._once.put_object(
                        Bucket=self._bucket, Key=key, Body=data, **condition
                    )
                return str(answer["ETag"])
            except StoreUnavailableError as err:
                # Only a request that never left may be sent again (module docstring).
                if err.maybe_applied or attempt + 1 == self._options.max_attempts:
                    raise
                time.sleep(_backoff(attempt))
        raise AssertionError("unreachable")  # the loop returns or raises

    @contextlib.contextmanager
    def _translated(self, operation: str, key: str) -> Iterator[None]:
        """Raise botocore's errors inside as the :class:`StoreError` they mean."""
        try:
            yield
        except boto_errors.ClientError as err:
            raise self._seen(self._client_error(err, operation, key)) from err
        except _NOT_SENT + _NO_ANSWER as err:
            raise self._seen(self._unavailable(err, operation, key)) from err
        except boto_errors.NoCredentialsError as err:
            raise self._seen(
                StoreError(
                    f"S3 {operation} of {self._where(key)} at {self.endpoint}: no AWS credentials "
                    "found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
                    operation=operation,
                    key=key,
                    status="credentials",
                )
            ) from err
        except boto_errors.BotoCoreError as err:
            raise self._seen(
                StoreError(
                    f"S3 {operation} of {self._where(key)} at {self.endpoint} failed: "
                    f"{type(err).__name__}: {_one_line(str(err))}",
                    operation=operation,
                    key=key,
                    status="client",
                )
            ) from err

    def _seen(self, err: StoreError) -> StoreError:
        if self.on_error is not None and not isinstance(
            err, ObjectNotFoundError | PreconditionFailed
        ):
            try:
                self.on_error(err)
            except Exception:  # noqa: BLE001 - a metric must not change the request's error
                pass
        return err

    def _where(self, key: str) -> str:
        return f"s3://{self._bucket}/{key}"

    def _client_error(self, err: boto_errors.ClientError, operation: str, key: str) -> StoreError:
        error = err.response.get("Error") or {}
        code = str(error.get("Code") or "")
        status = int((err.response.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
        said = _one_line(str(error.get("Message") or ""))
        head = f"S3 {operation} of {self._where(key)} at {self.endpoint}"
        if status == 412:
            return PreconditionFailed(
                f"{head}: a precondition did not hold (412 {code or 'PreconditionFailed'})",
                operation=operation,
                key=key,
                status=status,
            )
        if status == 409 and code == "ConditionalRequestConflict":
            return ConditionalConflict(
                f"{head}: a concurrent write conflicted (409 {code}); whether this one took "
                "effect is known only by reading the object",
                operation=operation,
                key=key,
                status=status,
            )
        if code == "NoSuchBucket":
            return ObjectNotFoundError(
                f"{head}: bucket {self._bucket!r} does not exist at this endpoint (404 {code})",
                operation=operation,
                key=key,
                status=status,
            )
        if status == 404 or code in ("NoSuchKey", "NotFound", "NoSuchUpload"):
            return ObjectNotFoundError(
                f"{head}: no such object (404 {code})", operation=operation, key=key, status=status
            )
        hint = ""
        if status == 403:
            hint = "; check the credentials (AWS_ACCESS_KEY_ID, AWS_PROFILE) and the bucket policy"
        return StoreError(
            f"{head} failed: {status} {code} {said}".rstrip() + hint,
            operation=operation,
            key=key,
            status=status,
        )

    def _unavailable(self, err: Exception, operation: str, key: str) -> StoreUnavailableError:
        timed_out = isinstance(err, boto_errors.ConnectTimeoutError | boto_errors.ReadTimeoutError)
        if isinstance(err, boto_errors.ConnectTimeoutError):
            reason = f"no connection within {self._options.connect_timeout_s:g} s"
        elif isinstance(err, boto_errors.ReadTimeoutError):
            reason = f"no answer within {self._options.read_timeout_s:g} s"
        elif isinstance(err, _NOT_SENT):
            reason = "connection refused or unreachable"
        else:
            reason = f"the connection broke before the answer ({type(err).__name__})"
        return StoreUnavailableError(
            f"S3 endpoint {self.endpoint} did not answer {operation} of {self._where(key)}: "
            f"{reason}; check that it is up and that AWS_ENDPOINT_URL names it",
            operation=operation,
            key=key,
            status="timeout" if timed_out else "connection",
            maybe_applied=not isinstance(err, _NOT_SENT),
        )


def _info(answer: dict[str, Any]) -> ObjectInfo:
    return ObjectInfo(
        size=int(answer.get("ContentLength") or 0),
        etag=str(answer.get("ETag") or ""),
        version=answer.get("VersionId"),
    )


def _check_range(value: tuple[int, int]) -> tuple[int, int]:
    start, stop = value
    if not 0 <= start <= stop:
        raise ValueError(f"range must be (start, stop) with 0 <= start <= stop, got {value!r}")
    return start, stop


def _backoff(attempt: int) -> float:
    return float(min(_BACKOFF_S * 2**attempt, _MAX_BACKOFF_S))


def _one_line(text: str) -> str:
    return " ".join(text.split())
