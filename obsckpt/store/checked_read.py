"""A file read once into private memory, its CRC32 checked on the way, then deserialised there.

:func:`read_checked` reads an open file into one buffer of its own, chunk by
chunk; a second thread computes the CRC32 of each chunk right behind the
reads, so the check costs little more than the read itself. Nothing is
deserialised until the whole file's CRC32 is known.

:func:`torch_load_buffer` then deserialises a ``torch.save`` zip from that
buffer without copying it again: each tensor's storage is a view of its record
in the buffer, the same way ``torch.load(mmap=True)`` hands out views of a
mapped file, except that the memory is the process's own (anonymous, not a
mapping of the file): nothing written to the file afterwards reaches the
tensors. All tensors of one file share that buffer, which is freed when the
last of them is.
"""

from __future__ import annotations

import ctypes
import io
import os
import threading
from typing import IO, Any, cast

import torch

from obsckpt.store import reader

# Chunk of the read: large enough that a syscall and a CRC32 call per chunk cost
# nothing, small enough that the CRC32 of the last chunk (the part not overlapped
# with a read) is short.
CHUNK = 4 << 20


def read_checked(fd: int, size: int) -> tuple[torch.UntypedStorage, int]:
    """``size`` bytes of ``fd`` in a new CPU storage, with their CRC32.

    Raises:
        OSError: the read failed.
        EOFError: the file ended before ``size`` bytes (it shrank while it was read).
    """
    storage = torch.empty(size, dtype=torch.uint8).untyped_storage()
    if size == 0:
        return storage, 0
    view = memory_of(storage)
    if size <= CHUNK:
        _read_into(fd, view, 0, size)
        return storage, reader.crc32(view)
    return storage, _read_and_crc_in_step(fd, view, size)


def memory_of(storage: torch.UntypedStorage) -> memoryview:
    """A writable byte view of a CPU storage's memory (valid while the storage lives)."""
    array = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return memoryview(array).cast("B")


def _read_into(fd: int, view: memoryview, start: int, end: int) -> None:
    while start < end:
        got = os.preadv(fd, [view[start:end]], start)
        if got == 0:
            raise EOFError(f"the file ended at byte {start} of {len(view)}")
        start += got


def _read_and_crc_in_step(fd: int, view: memoryview, size: int) -> int:
    """Read in this thread; CRC32 each chunk in a helper thread as soon as it is read."""
    read_up_to = 0  # bytes [0, read_up_to) are in the buffer
    failed = False
    cond = threading.Condition()
    crc = 0

    def checksum() -> None:
        nonlocal crc
        done = 0
        while done < size:
            with cond:
                while read_up_to == done and not failed:
                    cond.wait()
                if failed:
                    return
                upto = read_up_to
            while done < upto:  # zlib-ng releases the GIL over each chunk
                stop = min(done + CHUNK, upto)
                crc = reader.crc32(view[done:stop], crc)
                done = stop

    helper = threading.Thread(target=checksum, name="obsckpt-load-crc32", daemon=True)
    helper.start()
    try:
        for start in range(0, size, CHUNK):
            end = min(start + CHUNK, size)
            _read_into(fd, view, start, end)
            with cond:
                read_up_to = end
                cond.notify()
    except BaseException:
        with cond:
            failed = True
            cond.notify()
        raise
    finally:
        helper.join()
    return crc


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a buffer, for torch's zip reader (no copy)."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(buffer)]
        n = len(chunk)
        memoryview(buffer).cast("B")[:n] = chunk
        self._pos += n
        return n


ZIP_MAGIC = b"PK\x03\x04"


def is_torch_zip(storage: torch.UntypedStorage) -> bool:
    """Whether the buffer holds a zip file (what ``torch.save`` has written since torch 1.6)."""
    return storage.nbytes() >= 4 and bytes(memory_of(storage)[:4]) == ZIP_MAGIC


def torch_load_buffer(storage: torch.UntypedStorage, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` of the ``torch.save`` zip in ``storage``, no copy.

    The caller sets the allowed globals (``torch.serialization.safe_globals``).
    Tensors on the CPU are views into ``storage``; with another ``map_location``
    they are copied there, as ``torch.load`` does.

    Raises:
        pickle.UnpicklingError: the pickle names a global that is not allowed.
        RuntimeError, ValueError: not a zip ``torch.save`` wrote (a TorchScript
            archive among them), or a damaged one.
    """
    from torch import _weights_only_unpickler
    from torch.serialization import _load

    zipped = torch._C.PyTorchFileReader(cast(IO[bytes], _MemoryFile(memory_of(storage))))
    if zipped.has_record("constants.pkl"):  # type: ignore[attr-defined]
        raise RuntimeError("a TorchScript archive, not a file torch.save wrote")
    return _load(
        zipped,
        map_location,
        _weights_only_unpickler,
        overall_storage=storage,
        encoding="utf-8",
    )
