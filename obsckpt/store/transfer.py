"""Parallel transfers without copies: parts as views of one buffer, run on a few threads.

A multipart upload reads each part from a view of its source (bytes, a tensor's
storage, or a file mapped into memory) through :class:`ViewReader`, a seekable
file that never copies the whole; :func:`run_parallel` runs the parts' requests
on a bounded pool of named threads and raises the first failure.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import IO, Any, TypeVar

__all__ = [
    "MAX_PARTS",
    "MAX_PART_SIZE",
    "MIN_PART_SIZE",
    "UploadSource",
    "ViewReader",
    "check_part_size",
    "run_parallel",
    "source_view",
]

_T = TypeVar("_T")

# S3's limits on multipart uploads: every part but the last at least 5 MiB, at most
# 5 GiB, at most 10,000 parts.
MIN_PART_SIZE = 5 * 1024 * 1024
MAX_PART_SIZE = 5 * 1024**3
MAX_PARTS = 10_000

UploadSource = bytes | bytearray | memoryview | str | os.PathLike[str] | IO[bytes]


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview: a part's body without copying it.

    botocore reads a body to checksum it and seeks back to send it (and again to
    retry), so a plain iterator would not do.
    """

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self._view)

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        memoryview(buffer).cast("B")[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def read(self, size: int | None = -1) -> bytes:
        stop = len(self._view) if size is None or size < 0 else self._pos + size
        chunk = bytes(self._view[self._pos : stop])
        self._pos += len(chunk)
        return chunk

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


@contextlib.contextmanager
def source_view(source: UploadSource) -> Iterator[memoryview]:
    """A flat byte view of ``source``; a path or a file is mapped, not read."""
    if isinstance(source, bytes | bytearray | memoryview):
        view = memoryview(source)
        yield view.cast("B") if view.format != "B" or view.ndim != 1 else view
        return
    with contextlib.ExitStack() as stack:
        if isinstance(source, str | os.PathLike):
            source = stack.enter_context(open(source, "rb"))
        try:
            fd = source.fileno()
        except (AttributeError, io.UnsupportedOperation):
            if isinstance(source, io.BytesIO):
                yield source.getbuffer()
                return
            raise TypeError(
                f"upload source must be bytes-like, a path or a file with a fileno(), got "
                f"{type(source).__name__}"
            ) from None
        if os.fstat(fd).st_size == 0:
            yield memoryview(b"")
            return
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        try:
            yield memoryview(mapped)
        finally:
            # A part's view still held (by a traceback, say) keeps the mapping open; it
            # is unmapped with the last view then.
            with contextlib.suppress(BufferError):
                mapped.close()


def run_parallel(calls: list[Callable[[], _T]], concurrency: int, *, name: str) -> list[_T]:
    """The results of ``calls``, run ``concurrency`` at a time; the first failure is raised.

    Calls not yet started when one fails are cancelled; the pool is joined first.
    """
    if concurrency == 1 or len(calls) == 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=name) as pool:
        futures: list[Future[_T]] = [pool.submit(call) for call in calls]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f in done and f.exception() is not None), None)
        if failed is not None:
            for future in futures:
                future.cancel()
            exc = failed.exception()
            assert exc is not None
            raise exc
        return [future.result() for future in futures]


def check_part_size(part_size: int, total: int) -> None:
    if not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
        raise ValueError(
            f"part_size must be between {MIN_PART_SIZE} (5 MiB) and {MAX_PART_SIZE} (5 GiB), "
            f"S3's limits, got {part_size}"
        )
    if -(-total // part_size) > MAX_PARTS:
        raise ValueError(
            f"{total} bytes in parts of {part_size} make more than S3's {MAX_PARTS} parts; "
            f"use parts of at least {-(-total // MAX_PARTS)} bytes"
        )
