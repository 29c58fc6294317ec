"""The durable ``torch.save``: a file written and checksummed by helper threads, fsynced, renamed.

:func:`write_torch_file` runs in the background of a save. Large tensors
whose memory is page-aligned (staging buffers are, see
:mod:`obsckpt.staging`) are written to disk from that memory with
``O_DIRECT``, without a copy; everything else goes through a few aligned
chunks. The file's CRC32 is computed on the way and goes into the manifest.

Records start on a 4 KiB boundary (so aligned tensors can be written
directly), which would cost up to a page for each small tensor. Storages
smaller than ``PACK_MAX`` (64 KiB) are therefore packed (see
:class:`obsckpt.tree.StoragePacker`): copied, one after
the other, into one storage per dtype, written as one record. A small tensor
loaded back (plain ``torch.load``, ``weights_only=True`` included) is a view
into that packed storage, with its own size, stride and dtype; its
``storage_offset()`` counts from the start of the pack, and tensors that
shared a storage when saved share it again. Storages of ``PACK_MAX``
bytes or more keep a record of their own, as ``torch.save``
writes them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import inspect
import logging
import math
import mmap
import os
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

from obsckpt.env import OBSCKPT_DIRECT_IO, from_env_if_absent
from obsckpt.errors import WaitTimeoutError
from obsckpt.store.commit import fsync_many, raise_named
from obsckpt.store.layout import FileRecord, temp_name
from obsckpt.store.reader import crc32
from obsckpt.tree import StoragePacker, cpu_storages

# The writer's chunks, for the bytes that cannot be written from where they lie
# (headers, pickles, small or unaligned tensors): big enough for full-speed
# direct I/O, few enough to stay a small fraction of the state in resident memory.
_IO_CHUNK = 16 << 20
_IO_CHUNKS = 4
# Tensors of at least this size whose memory is aligned (staging buffers are)
# are written to disk from that memory, in pieces, without a copy.
DIRECT_MIN = 1 << 20
_DIRECT_PIECE = 16 << 20
# Writes in flight at once (into blocks reserved ahead, see reserve): enough to
# keep the device queue full between pieces.
_WRITERS = 4
# zlib's CRC32 is slower than a fast disk; chunks are checksummed in parallel.
_CRC_THREADS = 2
_CRC32_POLY = 0xEDB88320
ALIGN = 4096
# The longest the writer waits on its helper threads without any of them
# finishing a piece (16 MiB at most): past it a write to the filesystem is taken
# to hang and the save fails. Generous, for a stalled network filesystem that
# recovers; a large file on a slow disk makes progress all along. Tests make it small.
WAIT_TIMEOUT_S = 600.0

logger = logging.getLogger(__name__)


def _direct_io() -> bool:
    """Whether to write with O_DIRECT: ``OBSCKPT_DIRECT_IO=0`` writes through the page cache.

    Read at each file, not at import, so a job that sets it after importing obsckpt
    (or a test) is heard.
    """
    return from_env_if_absent(None, OBSCKPT_DIRECT_IO, "1") != "0"


_save: Any
try:  # torch's writer without its per-record CRC32 (see _torch_save)
    from torch.serialization import _get_storage_alignment, _save

    if list(inspect.signature(_save).parameters)[:5] != [
        "obj",
        "zip_file",
        "pickle_module",
        "pickle_protocol",
        "_disable_byteorder_record",
    ] or not hasattr(torch._C, "PyTorchFileWriter"):
        _save = None
except ImportError:  # pragma: no cover - other torch versions
    _save = None


def _gf2_times(mat: tuple[int, ...] | list[int], vec: int) -> int:
    out = 0
    i = 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


@functools.lru_cache(maxsize=16)
def _crc32_shift(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that moves a CRC-32 past ``nbytes`` bytes (zlib's crc32_combine)."""
    odd = [_CRC32_POLY] + [1 << n for n in range(31)]  # one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    ops = []
    n = nbytes
    while n:
        even = _gf2_square(odd)
        if n & 1:
            ops.append(even)
        n >>= 1
        if not n:
            break
        odd = _gf2_square(even)
        if n & 1:
            ops.append(odd)
        n >>= 1
    cols = []
    for i in range(32):
        v = 1 << i
        for op in ops:
            v = _gf2_times(op, v)
        cols.append(v)
    return tuple(cols)


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_crc32_shift(len2), crc1) ^ crc2


try:  # zlib-ng's C version; the pure-Python one costs ~2 ms per distinct length
    from zlib_ng.zlib_ng import crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    crc32_combine = _crc32_combine


def _libc_fallocate() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


# fallocate(2) itself: posix_fallocate falls back to writing every block where
# the filesystem lacks it, which would cost more than it saves.
_fallocate = _libc_fallocate()
# Reservations grow by at least this much once the expected size is passed.
_RESERVE_STEP = 256 << 20


def _address(view: memoryview) -> int:
    """Address of the first byte of ``view`` (read-only views included)."""
    return np.frombuffer(view, np.uint8).ctypes.data


class _PipelinedSink:
    """The file-like object ``torch.save`` writes into: checksummed and written by helper threads.

    ``torch.save`` through a buffered file costs a copy into the page cache
    and a writeback that only starts at ``fsync``; on fast storage that is
    several times slower than the disk. Here the file is opened with
    ``O_DIRECT`` and written with ``pwrite`` by helper threads, several writes in
    flight, while other helpers checksum each piece (combined in order at the
    end). A large tensor whose memory and file offset are aligned (staging
    buffers are page-aligned, and records start on a page boundary) is written
    from its own memory, with no copy: ``write`` hands its pieces to the
    helpers and returns at once when the memory belongs to a tensor of the
    object being saved (alive until :meth:`finish`), or waits for them when it
    does not (a temporary copy torch made). Everything else is copied into one
    of a few page-aligned chunks, written while the next one fills. Where the
    filesystem refuses ``O_DIRECT`` the same pipeline writes through the page
    cache. The last chunk is padded to the alignment and the file truncated.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.crc = 0
        self.size = 0
        self.direct_bytes = 0  # written from the caller's memory, without a copy
        # Addresses of the storages of the object being saved: alive until finish().
        self.owned: set[int] = set()
        self._reserved: float = 0  # bytes allocated ahead of the writes (see reserve)
        self.direct = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if _direct_io() and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        # (sequence number, buffer, bytes, token) to checksum
        self._to_crc: queue.SimpleQueue[tuple[int, Any, int, Any] | None] = queue.SimpleQueue()
        self._crcs: dict[int, tuple[int, int]] = {}  # sequence number -> (crc32, bytes)
        self._seq = 0
        # (buffer, bytes with padding, file offset, token) to write
        self._to_disk: queue.SimpleQueue[tuple[Any, int, int, Any] | None] = queue.SimpleQueue()
        # token (a chunk, or the Event of one direct write) -> uses left by the helpers
        self._users: dict[int, int] = {}
        self._lock = threading.Lock()
        self._chunks: list[mmap.mmap] = []
        self._chunk: mmap.mmap | None = None
        self._fill = 0
        self._error: BaseException | None = None
        self._stopped = False  # the helpers were told to stop
        # When a piece was last handed to the helpers or finished by them: a wait
        # fails once WAIT_TIMEOUT_S pass after it.
        self._progress = time.monotonic()
        self._closed = False
        name = os.path.basename(path)
        workers = [(self._checksum, "crc")] * _CRC_THREADS + [(self._write, "writer")] * _WRITERS
        self._threads = [
            threading.Thread(target=fn, name=f"obsckpt-{what}-{name}", daemon=True)
            for fn, what in workers
        ]
        for t in self._threads:
            t.start()

    def _take_chunk(self) -> mmap.mmap:
        if len(self._chunks) < _IO_CHUNKS:
            chunk = mmap.mmap(-1, _IO_CHUNK)  # page-aligned, as O_DIRECT requires
            self._chunks.append(chunk)
            return chunk
        while True:
            try:
                chunk = self._free.get(timeout=max(self._patience(), 1e-3))
                break
            except queue.Empty:
                if self._patience() <= 0:
                    raise self._timeout("a chunk to be written and freed") from None
        self._raise_if_failed()
        return chunk

    def _patience(self) -> float:
        """Seconds a wait on the helpers may still last: until WAIT_TIMEOUT_S pass with
        no piece handed to them or finished by them."""
        return self._progress + WAIT_TIMEOUT_S - time.monotonic()

    def _timeout(self, what: str) -> WaitTimeoutError:
        """The error of a wait for the helpers during which none finished a piece for
        WAIT_TIMEOUT_S; the helpers skip what is left (the save is abandoned)."""
        with self._lock:
            pending = len(self._users)
        error = WaitTimeoutError(
            f"writing {self.path}: waited for {what}, and no write finished in "
            f"{WAIT_TIMEOUT_S:g} s ({pending} pieces still to write or checksum, of the "
            f"{self.size} bytes handed to the writer threads): a write to the filesystem "
            "hangs. The save is abandoned; check the storage's health"
        )
        self._error = self._error or error
        return error

    def reserve(self, nbytes: int) -> None:
        """Allocate the file's blocks up to ``nbytes`` before writing them.

        A direct write past the end of the file or into unallocated blocks
        takes the inode lock exclusively for its whole duration (ext4, XFS),
        so the writers' writes would run one at a time. Into allocated blocks
        they run side by side. The file is truncated to its real size at the end.
        """
        if not self.direct or _fallocate is None or nbytes <= self._reserved:
            return
        nbytes = -(-nbytes // ALIGN) * ALIGN
        if _fallocate(self.fd, 0, self._reserved, nbytes - self._reserved) == 0:
            self._reserved = nbytes
        else:  # the filesystem cannot: write without reserving
            self._reserved = math.inf

    def _enqueue(self, buf: Any, nbytes: int, padded: int, offset: int, token: Any) -> None:
        if offset + padded > self._reserved:
            # _reserved is finite here: nothing exceeds math.inf.
            self.reserve(max(offset + padded, int(self._reserved) + _RESERVE_STEP))
        self._progress = time.monotonic()
        self._to_crc.put((self._seq, buf, nbytes, token))
        self._seq += 1
        self._to_disk.put((buf, padded, offset, token))

    def _submit_chunk(self, padded: int) -> None:
        chunk, n = self._chunk, self._fill
        with self._lock:
            self._users[id(chunk)] = 2
        self._enqueue(chunk, n, padded, self.size - n, chunk)
        self._chunk, self._fill = None, 0

    def _release(self, token: Any) -> None:
        self._progress = time.monotonic()
        with self._lock:
            self._users[id(token)] -= 1
            done = self._users[id(token)] == 0
            if done:
                del self._users[id(token)]
        if not done:
            return
        if isinstance(token, threading.Event):
            token.set()
        else:
            self._free.put(token)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            error = OSError(
                f"writing {self.path} failed: {self._error}; the save is abandoned (check the "
                "filesystem's free space and health)"
            )
            # Callers tell a full disk from other faults by errno, as for any OSError.
            error.errno = getattr(self._error, "errno", None)
            raise error from self._error

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if (
            self.direct
            and n >= DIRECT_MIN
            and self.size % ALIGN == 0
            and _address(view) % ALIGN == 0
        ):
            body = n - n % ALIGN
            self._write_direct(view[:body], wait=_address(view) not in self.owned)
            view = view[body:]
        self._copy(view)
        return n

    def _write_direct(self, view: memoryview, wait: bool) -> None:
        """Write ``view`` at the current (aligned) offset from its own memory."""
        if self._fill:  # the chunk so far ends at this aligned offset: write it as it is
            self._submit_chunk(self._fill)
        step = _DIRECT_PIECE
        pieces = [(view[i : i + step], self.size + i) for i in range(0, len(view), step)]
        done = threading.Event()
        with self._lock:
            self._users[id(done)] = 2 * len(pieces)
        for piece, offset in pieces:
            self._enqueue(piece, len(piece), len(piece), offset, done)
        self.size += len(view)
        self.direct_bytes += len(view)
        if wait:
            while not done.wait(max(self._patience(), 1e-3)):
                if self._patience() <= 0:
                    raise self._timeout(f"a direct write of {len(view)} bytes")
            self._raise_if_failed()

    def _copy(self, view: memoryview) -> None:
        n = view.nbytes
        done = 0
        while done < n:
            if self._chunk is None:
                self._chunk, self._fill = self._take_chunk(), 0
            step = min(n - done, _IO_CHUNK - self._fill)
            self._chunk[self._fill : self._fill + step] = view[done : done + step]
            self._fill += step
            self.size += step
            done += step
            if self._fill == _IO_CHUNK:
                self._submit_chunk(_IO_CHUNK)

    def flush(self) -> None:
        self._raise_if_failed()

    def _checksum(self) -> None:
        while (item := self._to_crc.get()) is not None:
            seq, buf, n, token = item
            try:
                with memoryview(buf) as view:
                    self._crcs[seq] = (crc32(view[:n]), n)
            except BaseException as exc:  # noqa: BLE001 - raised by the saving thread
                self._error = self._error or exc
            self._release(token)

    def _write(self) -> None:
        while (item := self._to_disk.get()) is not None:
            buf, n, offset, token = item
            if self._error is None:
                try:
                    self._pwrite(buf, n, offset)
                except BaseException as exc:  # noqa: BLE001 - raised by the saving thread
                    self._error = self._error or exc
            self._release(token)

    def _pwrite(self, buf: Any, n: int, offset: int) -> None:
        whole = memoryview(buf)
        view = whole[:n]
        try:
            while view:
                written = os.pwrite(self.fd, view, offset)
                offset += written
                view = view[written:]
        finally:
            # The stored error's traceback keeps this frame: a view left in it would
            # keep the chunk's mapping exported, and the chunk could not be closed.
            view.release()
            whole.release()

    def finish(self) -> None:
        """Write the last chunk, truncate to the real size, fsync, close."""
        try:
            if self._chunk is not None and self._fill:
                padded = self._fill
                if self.direct:
                    padded = -(-self._fill // ALIGN) * ALIGN
                    self._chunk[self._fill : padded] = bytes(padded - self._fill)
                self._submit_chunk(padded)
            if not self._stop():
                raise self._timeout("its helper threads to finish")
            self._raise_if_failed()
            for seq in range(self._seq):
                crc, n = self._crcs[seq]
                self.crc = crc32_combine(self.crc, crc, n)
            if self.direct:
                try:
                    os.ftruncate(self.fd, self.size)
                except OSError as exc:  # on a descriptor: the error names no file
                    raise_named(exc, self.path)
            # Bounded (FSYNC_TIMEOUT_S): a hung fsync of network storage fails the save.
            fsync_many([(self.path, False)], phase=f"writing {self.path}")
        except BaseException:
            self.close(quiet=True)  # an error closing must not hide the one that ended the write
            raise
        self.close()

    def _stop(self) -> bool:
        """Tell the helpers to stop and join them; False if one is still busy once
        WAIT_TIMEOUT_S passed with no piece finished (a write that hangs). A second
        call does not wait again."""
        if not self._stopped:
            self._stopped = True
            self._progress = time.monotonic()
            for _ in range(_CRC_THREADS):
                self._to_crc.put(None)
            for _ in range(_WRITERS):
                self._to_disk.put(None)
            while alive := [t for t in self._threads if t.is_alive()]:
                if self._patience() <= 0:
                    return False
                alive[0].join(self._patience())
        return not any(t.is_alive() for t in self._threads)

    def close(self, *, quiet: bool = False) -> None:
        """Stop the helpers, close the file and free the chunks; ``quiet``: log a failure
        to close instead of raising it (an error is already on its way)."""
        if self._closed:
            return
        self._closed = True
        if not self._stop():
            # A helper is still in a write: closing the descriptor now could hand its
            # number to another file before that write returns. The last one out closes.
            self._error = self._error or WaitTimeoutError(f"writing {self.path} was abandoned")
            name = f"obsckpt-close-{os.path.basename(self.path)}"
            threading.Thread(target=self._close_after_helpers, name=name, daemon=True).start()
            return
        try:
            self._close_now()
        except OSError as exc:
            if not quiet:
                raise_named(exc, self.path)
            logger.warning(
                "obsckpt: closing %s after a failed write failed too: %s", self.path, exc
            )

    def _close_after_helpers(self) -> None:
        # Without a bound: this thread blocks nothing, and the descriptor may only be
        # closed once the kernel has returned the hung write.
        for t in self._threads:
            t.join()
        with contextlib.suppress(OSError):
            self._close_now()

    def _close_now(self) -> None:
        for chunk in self._chunks:
            # A chunk still exported (by a view torch holds) is unmapped by the collector
            # instead; failing here would hide the error that ended the write.
            with contextlib.suppress(BufferError):
                chunk.close()
        self._chunks.clear()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _torch_save(obj: Any, sink: _PipelinedSink) -> None:
    """``torch.save(obj, sink)`` with small storages packed, without torch's per-record CRC32.

    The whole file's CRC32 is computed here (it goes into the manifest), so
    torch computing another one per record would only halve the write speed.
    Falls back to plain ``torch.save`` (still packing) where torch's writer
    has another shape.
    """
    storages = cpu_storages(obj)
    sink.owned = set(storages)
    # The tensors' bytes, each record's header and alignment, and the pickle.
    sink.reserve(sum(storages.values()) + len(storages) * 2 * ALIGN + (1 << 20))
    packer = StoragePacker(obj)
    try:
        _save_packed(obj, sink, packer.pickle_module())
    finally:
        packer.close()


def _save_packed(obj: Any, sink: _PipelinedSink, pickle_module: Any) -> None:
    """Write ``obj`` into ``sink`` with torch's writer, pickled with ``pickle_module``."""
    if _save is None:
        torch.save(obj, sink, pickle_module=pickle_module)  # type: ignore[arg-type]
        return
    try:
        # Records start on a page boundary, so aligned tensors are written from their memory.
        alignment = max(ALIGN, _get_storage_alignment())
        writer = torch._C.PyTorchFileWriter(sink, False, alignment)  # type: ignore[call-overload]
    except TypeError:  # pragma: no cover - a torch whose writer takes other arguments
        torch.save(obj, sink, pickle_module=pickle_module)  # type: ignore[arg-type]
        return
    try:
        _save(obj, writer, pickle_module, torch.serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # An unfinished writer finishes the file in its destructor, whenever the
        # collector frees it, and an error there (the sink refusing writes) aborts
        # the process: finish it now, where its error can be dropped for the first one.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


def _remove_temp(tmp: str) -> None:
    """Remove a failed write's temp file; a failure to is logged, never raised over the
    error that failed the write."""
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning(
            "obsckpt: could not remove the temp file %s of a failed write (%s); it is left "
            "behind (the monitor removes obsckpt's leftovers at its next start)",
            tmp,
            exc,
        )


def upload_torch_file(obj: Any, writer: Any, path: str) -> FileRecord:
    """``torch.save`` of ``obj`` straight into an object (``writer``, an
    :class:`obsckpt.store.stream.ObjectWriter`); the record of ``path`` (its path in
    the step) with the object's size, CRC32 and ETag.

    Small storages are packed as in :func:`write_torch_file`; nothing is written to
    local disk. A failure aborts the object's upload.
    """
    packer = StoragePacker(obj)
    try:
        try:
            _save_packed(obj, writer, packer.pickle_module())
        finally:
            packer.close()
        done = writer.finish()
    except BaseException as exc:
        writer.abort(exc)
        raise
    return FileRecord(path=path, size=done.size, crc32=done.crc32, etag=done.etag)


def write_torch_file(obj: Any, path: str | os.PathLike[str]) -> FileRecord:
    """``torch.save`` to a temp file, fsync, rename into place, fsync the directory.

    Small storages are packed (see the module's docstring); the file loads
    with plain ``torch.load``.

    Raises:
        WaitTimeoutError: no write to the filesystem finished for ``WAIT_TIMEOUT_S``.
        OSError: the write failed (its errno kept); the temp file is removed.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = temp_name(path)
    try:
        sink = _PipelinedSink(tmp)
        try:
            _torch_save(obj, sink)
            sink.finish()
        except BaseException:
            sink.close(quiet=True)
            raise
        os.replace(tmp, path)
    except BaseException:
        _remove_temp(tmp)
        raise
    fsync_many([(directory, True)], phase=f"writing {path}: its directory")
    return FileRecord(path=os.path.abspath(path), size=sink.size, crc32=sink.crc)
