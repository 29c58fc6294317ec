"""One object written as a stream: parts filled in turn, uploaded in parallel, checksummed.

:class:`ObjectWriter` is the file-like object a serialiser (``torch.save``)
writes into when a save's destination is an object. Bytes are copied once, into
one of a few part buffers; a full part is handed to an upload thread (its CRC32
computed there, in parallel with the next part filling) and the writer moves
on to a free buffer. So a rank's file goes straight to the store: no copy of it
on local disk, and no more memory than ``concurrency + 1`` parts. An object
smaller than one part is sent in one PUT. A part the endpoint does not answer
(a restart) is sent again for up to :data:`UNAVAILABLE_RETRY_S`. :meth:`ObjectWriter.finish` returns
the object's size, CRC32 and ETag, which the rank's report carries to the
monitor; a failure (or :meth:`ObjectWriter.abort`) aborts the multipart upload,
so no part outlives it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from zlib_ng.zlib_ng import crc32_combine  # a dependency: zlib-ng's C version

from obsckpt.store.errors import StoreError, StoreUnavailableError
from obsckpt.store.reader import crc32

__all__ = ["DEFAULT_CONCURRENCY", "DEFAULT_PART_SIZE", "ObjectWriter", "Uploaded"]

# Parts of 16 MiB, 8 in flight: enough to fill a 10 Gb/s link from one rank, and
# 144 MiB of buffers at most per file being written.
DEFAULT_PART_SIZE = 16 * 1024 * 1024
DEFAULT_CONCURRENCY = 8
# How long a part keeps being sent again while the endpoint does not answer (a
# restart, a failover): a part is idempotent, its number replaced by the next try.
# Past it the save fails, naming the endpoint.
UNAVAILABLE_RETRY_S = 60.0
_RETRY_PAUSE_S = (0.5, 5.0)  # the first pause, and the longest


class _BufferPool:
    """Part buffers kept between objects: a save writes the same sizes every step, and a
    fresh 16 MiB buffer costs its page faults again. Holds at most ``keep`` per size."""

    def __init__(self, keep: int = 2 * (DEFAULT_CONCURRENCY + 1)) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}

    def take(self, size: int) -> bytearray:
        with self._lock:
            found = self._free.get(size)
            if found:
                return found.pop()
        return bytearray(size)

    def give(self, buffers: list[bytearray]) -> None:
        with self._lock:
            for buffer in buffers:
                kept = self._free.setdefault(len(buffer), [])
                if len(kept) < self._keep:
                    kept.append(buffer)


_POOL = _BufferPool()


class PartClient(Protocol):
    """What :class:`ObjectWriter` needs of a client (:class:`~obsckpt.store.s3.S3Client`)."""

    def put(self, key: str, data: bytes) -> str: ...

    def begin_multipart(self, key: str) -> str: ...

    def upload_part(self, key: str, upload_id: str, number: int, part: memoryview) -> str: ...

    def complete_multipart(self, key: str, upload_id: str, etags: list[str]) -> str: ...

    def abort_quietly(self, key: str, upload_id: str, cause: BaseException) -> None: ...


@dataclass(frozen=True, slots=True)
class Uploaded:
    """An object written: what the rank reports and the commit checks."""

    key: str
    size: int
    crc32: int
    etag: str
    seconds: float
    parts: int


class ObjectWriter:
    """A write-only file whose bytes become object ``key``.

    Args:
        client: the bucket's client.
        key: the object's key.
        part_size: bytes per part (every part but the last); at least 5 MiB for S3.
        concurrency: parts uploaded at once.
    """

    def __init__(
        self,
        client: PartClient,
        key: str,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.key = key
        self.size = 0
        self._client = client
        self._part_size = part_size
        self._concurrency = concurrency
        self._t0 = time.perf_counter()
        self._buffers: list[bytearray] = []
        self._free: list[bytearray] = []
        self._freed = threading.Condition()
        self._buffer: bytearray | None = None
        self._fill = 0
        self._upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._parts: list[Future[tuple[str, int, int]]] = []
        self._done = False

    # --- the file protocol torch's writer uses ---------------------------------

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def write(self, data: Any) -> int:
        """Copy ``data`` into the part buffers; a full part is sent at once."""
        if self._done:
            raise ValueError(f"write to {self.key} after it was finished or aborted")
        view = memoryview(data).cast("B")
        taken = 0
        while taken < len(view):
            if self._buffer is None:
                self._buffer = self._take_buffer()
                self._fill = 0
            n = min(len(view) - taken, self._part_size - self._fill)
            self._buffer[self._fill : self._fill + n] = view[taken : taken + n]
            self._fill += n
            taken += n
            if self._fill == self._part_size:
                self._send_part()
        self.size += len(view)
        return len(view)

    # --- ending -------------------------------------------------------------------

    def finish(self) -> Uploaded:
        """Send what is left and complete the object; its size, CRC32 and ETag.

        Raises:
            StoreError: a part or the completion failed (the upload is aborted).
        """
        if self._done:
            raise ValueError(f"{self.key} was finished or aborted already")
        try:
            if self._upload_id is None:
                # Smaller than a part: one PUT.
                data = bytes(self._buffer[: self._fill]) if self._buffer is not None else b""
                etag = self._client.put(self.key, data)
                crc, parts = crc32(data), 1
            else:
                if self._fill:
                    self._send_part()
                etags, crc = [], 0
                for future in self._parts:
                    etag_of_part, part_crc, part_len = future.result()
                    etags.append(etag_of_part)
                    crc = crc32_combine(crc, part_crc, part_len)
                etag = self._client.complete_multipart(self.key, self._upload_id, etags)
                parts = len(etags)
        except BaseException as exc:
            self._fail(exc)
            raise
        self._close()
        return Uploaded(
            key=self.key,
            size=self.size,
            crc32=crc,
            etag=etag,
            seconds=time.perf_counter() - self._t0,
            parts=parts,
        )

    def abort(self, cause: BaseException | None = None) -> None:
        """Give the object up: its multipart upload (if any) is aborted. Idempotent."""
        if self._done:
            return
        if cause is None:
            cause = StoreError(
                f"write of {self.key} abandoned", operation="upload", key=self.key, status="aborted"
            )
        self._fail(cause)

    # --- internals --------------------------------------------------------------

    def _take_buffer(self) -> bytearray:
        with self._freed:
            if not self._free and len(self._buffers) < self._concurrency + 1:
                buffer = _POOL.take(self._part_size)
                self._buffers.append(buffer)
                return buffer
            while not self._free:
                self._raise_failed_part()
                self._freed.wait(0.5)
            return self._free.pop()

    def _raise_failed_part(self) -> None:
        for future in self._parts:
            if future.done() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]

    def _send_part(self) -> None:
        assert self._buffer is not None
        if self._upload_id is None:
            self._upload_id = self._client.begin_multipart(self.key)
            self._pool = ThreadPoolExecutor(
                max_workers=self._concurrency, thread_name_prefix="obsckpt-s3-part"
            )
        assert self._pool is not None
        buffer, length = self._buffer, self._fill
        number = len(self._parts) + 1
        self._parts.append(self._pool.submit(self._upload, number, buffer, length))
        self._buffer, self._fill = None, 0

    def _upload(self, number: int, buffer: bytearray, length: int) -> tuple[str, int, int]:
        try:
            view = memoryview(buffer)[:length]
            part_crc = crc32(view)
            assert self._upload_id is not None
            deadline = time.monotonic() + UNAVAILABLE_RETRY_S
            pause = _RETRY_PAUSE_S[0]
            while True:
                try:
                    etag = self._client.upload_part(self.key, self._upload_id, number, view)
                    return etag, part_crc, length
                except StoreUnavailableError:
                    if time.monotonic() + pause > deadline or self._done:
                        raise
                time.sleep(pause)
                pause = min(2 * pause, _RETRY_PAUSE_S[1])
        finally:
            with self._freed:
                self._free.append(buffer)
                self._freed.notify()

    def _fail(self, cause: BaseException) -> None:
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._upload_id is not None:
            self._client.abort_quietly(self.key, self._upload_id, cause)
        self._buffers.clear()
        self._free.clear()
        self._buffer = None

    def _close(self) -> None:
        self._done = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        _POOL.give(self._buffers)
        self._buffers.clear()
        self._free.clear()
        self._buffer = None
