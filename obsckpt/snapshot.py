"""Snapshot a state dict into reusable staging buffers; write it durably.

The training loop is blocked only for :meth:`StagingBuffers.stage`: one copy
of each tensor into a buffer kept from the previous save of the same slot
(pinned host memory when CUDA is present, so device→host copies run at
full bandwidth). :func:`write_torch_file` then runs in the background.
"""

from __future__ import annotations

import copy
import errno
import functools
import inspect
import mmap
import os
import pickle
import queue
import threading
from typing import Any

import torch

from obsckpt.commit import FileRecord, crc32, fsync_dir

try:  # DTensor shards (FSDP2) are staged as their local tensor plus placement.
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None  # type: ignore[assignment,misc]


# The writer's chunks: big enough for full-speed direct I/O, few enough to stay
# a small fraction of the state's size in resident memory.
_IO_CHUNK = 16 << 20
_IO_CHUNKS = 4
# zlib's CRC32 is slower than a fast disk; chunks are checksummed in parallel.
_CRC_THREADS = 2
_CRC32_POLY = 0xEDB88320
_ALIGN = 4096
# OBSCKPT_DIRECT_IO=0 writes through the page cache instead.
_DIRECT_IO = os.environ.get("OBSCKPT_DIRECT_IO", "1") != "0"

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


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_crc32_shift(len2), crc1) ^ crc2


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


class StagingBuffers:
    """Host buffers for one slot, reused while the state dict keeps its shapes."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffers: list[torch.Tensor] = []
        self._cursor = 0

    @property
    def bytes_allocated(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def _buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        i = self._cursor
        self._cursor += 1
        if i < len(self._buffers) and _signature(self._buffers[i]) == _signature(t):
            return self._buffers[i]
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin_memory)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in this slot's staging buffers.

        Returns once every copy has completed, so the caller may mutate its
        tensors immediately. Containers are rebuilt; other leaves are deep-copied.
        """
        self._cursor = 0
        out = self._stage(obj)
        del self._buffers[self._cursor :]
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    def _stage(self, obj: Any) -> Any:
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._stage(obj.to_local())
            return DTensor.from_local(
                local,
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffer_for(src)
            buf.copy_(src, non_blocking=self.pin_memory and src.is_cuda)
            return buf
        if isinstance(obj, dict):
            return type(obj)((k, self._stage(v)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._stage(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._stage(v) for v in obj)
        return copy.deepcopy(obj)


class _PipelinedSink:
    """The file-like object ``torch.save`` writes into: checksummed and written by helper threads.

    ``torch.save`` through a buffered file costs a copy into the page cache
    and a writeback that only starts at ``fsync``; on fast storage that is
    several times slower than the disk. Here the saving thread only copies
    each piece into one of a few page-aligned chunks; helper threads checksum
    full chunks (in parallel, combined in order at the end) while another writes them with ``O_DIRECT`` (no
    page-cache copy, and the disk works while the next chunk fills). Where the
    filesystem refuses ``O_DIRECT`` the same pipeline writes through the page
    cache. The last chunk is padded to the alignment and the file truncated.
    """

    def __init__(self, path: str) -> None:
        self.crc = 0
        self.size = 0
        self.direct = False
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        if _DIRECT_IO and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self._free: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._to_crc: queue.SimpleQueue[tuple[int, mmap.mmap, int] | None] = queue.SimpleQueue()
        self._crcs: dict[int, tuple[int, int]] = {}  # chunk sequence number -> (crc32, bytes)
        self._seq = 0
        self._to_disk: queue.SimpleQueue[tuple[mmap.mmap, int] | None] = queue.SimpleQueue()
        self._users: dict[int, int] = {}  # chunk id -> helper threads still using it
        self._lock = threading.Lock()
        self._chunks: list[mmap.mmap] = []
        self._chunk: mmap.mmap | None = None
        self._fill = 0
        self._error: BaseException | None = None
        name = os.path.basename(path)
        workers = [(self._checksum_chunks, "crc")] * _CRC_THREADS + [(self._write_chunks, "writer")]
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
        chunk = self._free.get()
        self._raise_if_failed()
        return chunk

    def _submit(self, chunk: mmap.mmap, nbytes: int, padded: int) -> None:
        with self._lock:
            self._users[id(chunk)] = 2
        self._to_crc.put((self._seq, chunk, nbytes))
        self._seq += 1
        self._to_disk.put((chunk, padded))

    def _release(self, chunk: mmap.mmap) -> None:
        with self._lock:
            self._users[id(chunk)] -= 1
            done = self._users[id(chunk)] == 0
        if done:
            self._free.put(chunk)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OSError(f"writing the checkpoint file failed: {self._error}") from self._error

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        self.size += n
        done = 0
        while done < n:
            if self._chunk is None:
                self._chunk, self._fill = self._take_chunk(), 0
            step = min(n - done, _IO_CHUNK - self._fill)
            self._chunk[self._fill : self._fill + step] = view[done : done + step]
            self._fill += step
            done += step
            if self._fill == _IO_CHUNK:
                self._submit(self._chunk, _IO_CHUNK, _IO_CHUNK)
                self._chunk = None
        return n

    def flush(self) -> None:
        self._raise_if_failed()

    def _checksum_chunks(self) -> None:
        while (item := self._to_crc.get()) is not None:
            seq, chunk, n = item
            try:
                with memoryview(chunk) as view:
                    self._crcs[seq] = (crc32(view[:n]), n)
            except BaseException as exc:  # noqa: BLE001 - raised by the saving thread
                self._error = self._error or exc
            self._release(chunk)

    def _write_chunks(self) -> None:
        while (item := self._to_disk.get()) is not None:
            chunk, n = item
            if self._error is None:
                try:
                    with memoryview(chunk) as whole:
                        view = whole[:n]
                        while view:
                            view = view[os.write(self.fd, view) :]
                        view.release()
                except BaseException as exc:  # noqa: BLE001 - raised by the saving thread
                    self._error = self._error or exc
            self._release(chunk)

    def finish(self) -> None:
        """Write the last chunk, truncate to the real size, fsync, close."""
        try:
            if self._chunk is not None and self._fill:
                n = padded = self._fill
                if self.direct:
                    padded = -(-n // _ALIGN) * _ALIGN
                    self._chunk[n:padded] = bytes(padded - n)
                self._submit(self._chunk, n, padded)
                self._chunk = None
            self._stop()
            self._raise_if_failed()
            for seq in range(self._seq):
                crc, n = self._crcs[seq]
                self.crc = crc32_combine(self.crc, crc, n)
            if self.direct:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
        finally:
            self.close()

    def _stop(self) -> None:
        if any(t.is_alive() for t in self._threads):
            for _ in range(_CRC_THREADS):
                self._to_crc.put(None)
            self._to_disk.put(None)
            for t in self._threads:
                t.join()

    def close(self) -> None:
        self._stop()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for chunk in self._chunks:
            chunk.close()
        self._chunks.clear()


def _torch_save(obj: Any, sink: _PipelinedSink) -> None:
    """``torch.save(obj, sink)`` without torch's own per-record CRC32.

    The whole file's CRC32 is computed here (it goes into the manifest), so
    torch computing another one per record would only halve the write speed.
    Falls back to plain ``torch.save`` where torch's writer has another shape.
    """
    if _save is None:
        torch.save(obj, sink)
        return
    try:
        writer = torch._C.PyTorchFileWriter(sink, False, _get_storage_alignment())
    except TypeError:  # pragma: no cover - a torch whose writer takes other arguments
        torch.save(obj, sink)
        return
    _save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def write_torch_file(obj: Any, path: str | os.PathLike) -> FileRecord:
    """``torch.save`` to a temp file, fsync, rename into place, fsync the directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        sink = _PipelinedSink(tmp)
        try:
            _torch_save(obj, sink)
            sink.finish()
        finally:
            sink.close()
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)
    return FileRecord(path=os.path.abspath(path), size=sink.size, crc32=sink.crc)
