"""Snapshot a state dict into reusable staging buffers; write it durably.

The training loop is blocked only for :meth:`StagingBuffers.stage`: one copy
of each tensor into a buffer kept from the previous save of the same slot.
A slot's buffers are views of one anonymous mapping (an :class:`Arena`),
registered as pinned memory with CUDA when CUDA is present so device→host
copies run at full bandwidth, without the caching host allocator's rounding
of each buffer to a power of two. :func:`write_torch_file` then runs in the
background and writes the staged tensors to disk straight from those views,
which are page-aligned for that purpose.

With :meth:`StagingBuffers.plan` the copy can also run apart from the caller:
a copy thread queues CUDA copies on a side stream and copies CPU tensors
itself (see :class:`StagingCopy`).
"""

from __future__ import annotations

import copy
import ctypes
import errno
import functools
import inspect
import math
import mmap
import os
import pickle
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from obsckpt.commit import FileRecord, crc32, fsync_dir
from obsckpt.errors import TensorMutatedError


def _dtensor_type() -> type | None:
    """DTensor, if its module is loaded; a state dict with DTensors has loaded it.

    Importing ``torch.distributed.tensor`` here would pull in sympy, seconds
    of the first save's stall for a state dict that has no DTensor at all.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


# Leaves that are plain tensors (not DTensor, ShardedTensor or another subclass).
_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))


def _sharded_tensor_type() -> type | None:
    """FSDP1's ShardedTensor, if its module is loaded (a state dict holding one has loaded it)."""
    module = sys.modules.get("torch.distributed._shard.sharded_tensor")
    return getattr(module, "ShardedTensor", None)


# The writer's chunks, for the bytes that cannot be written from where they lie
# (headers, pickles, small or unaligned tensors): big enough for full-speed
# direct I/O, few enough to stay a small fraction of the state in resident memory.
_IO_CHUNK = 16 << 20
_IO_CHUNKS = 4
# Tensors of at least this size whose memory is aligned (staging buffers are)
# are written to disk from that memory, in pieces, without a copy.
_DIRECT_MIN = 1 << 20
_DIRECT_PIECE = 16 << 20
# Writes in flight at once (into blocks reserved ahead, see reserve): enough to
# keep the device queue full between pieces.
_WRITERS = 4
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


def _crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    return _gf2_times(_crc32_shift(len2), crc1) ^ crc2


try:  # zlib-ng's C version; the pure-Python one costs ~2 ms per distinct length
    from zlib_ng.zlib_ng import crc32_combine
except ImportError:  # pragma: no cover - zlib-ng is a dependency
    crc32_combine = _crc32_combine


def _libc_fallocate():
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


# Views of at least the direct-write size start on a page (they are written to
# disk from their memory); smaller ones on torch's own 64-byte alignment, so a
# state of many small tensors does not pay a page each.
_SMALL_ALIGN = 64
_CUDA_HOST_REGISTER_PORTABLE = 1


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _cuda_host_register(address: int, nbytes: int) -> bool:
    """Page-lock ``nbytes`` at ``address`` for CUDA (``cudaHostRegister``); False if refused."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    except Exception:  # noqa: BLE001 - staging still works unpinned, only slower
        return False
    return int(getattr(err, "value", err)) == 0


def _cuda_host_unregister(address: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001 - nothing more can be done at release
        pass


class Arena:
    """One page-aligned anonymous mapping, carved into tensor views.

    Each view is a tensor with a storage of its own (``torch.save`` writes
    it as its own record) whose memory lies inside the mapping. With
    ``pin=True`` the whole mapping is registered with CUDA
    (``cudaHostRegister``): one page-locked region for the slot, exactly its
    size. :meth:`release` unregisters it and drops the arena's reference; the
    mapping is unmapped when the last view is gone (views keep it alive,
    never the other way round).

    Args:
        nbytes: size of the mapping (rounded up to a page).
        pin: register the mapping with CUDA.
        populate: fault every page in now (``MAP_POPULATE``), so the first
            copy into the views does not pay the page faults.
    """

    def __init__(self, nbytes: int, *, pin: bool = False, populate: bool = False) -> None:
        if nbytes < 0:
            raise ValueError(f"an arena's size must be >= 0 bytes, got {nbytes!r}")
        self.nbytes = max(_ALIGN, _round_up(nbytes, _ALIGN))
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if populate and not pin:  # registering faults the pages in anyway
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        self._mm: mmap.mmap | None = mmap.mmap(-1, self.nbytes, flags=flags)
        probe = np.frombuffer(self._mm, np.uint8, count=1)
        self.address: int = probe.ctypes.data
        del probe
        self.pinned = pin and _cuda_host_register(self.address, self.nbytes)
        # Unregistered however the arena goes, before the mapping can be unmapped.
        self._finalizer = (
            weakref.finalize(self, _cuda_host_unregister, self.address) if self.pinned else None
        )

    @property
    def released(self) -> bool:
        return self._mm is None

    def mapping(self) -> mmap.mmap | None:
        """The mapping itself while the arena holds it (None once released)."""
        return self._mm

    def view(self, offset: int, shape: torch.Size | tuple[int, ...], dtype: torch.dtype):
        """A tensor of ``shape`` and ``dtype`` whose memory starts ``offset`` bytes into the mapping."""
        if self._mm is None:
            raise RuntimeError("this staging arena was released; allocate a new one")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"a view of {nbytes} bytes at offset {offset} does not fit an arena of "
                f"{self.nbytes} bytes"
            )
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(dtype).view(shape)

    def release(self) -> None:
        """Unregister (CUDA) and let go of the mapping; views still held keep their memory."""
        if self._finalizer is not None:
            self._finalizer()
        self.pinned = False
        self._mm = None


def _layout(sizes: list[int]) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes in one arena, and the arena's size."""
    offsets = []
    end = 0
    for n in sizes:
        end = _round_up(end, _ALIGN if n >= _DIRECT_MIN else _SMALL_ALIGN)
        offsets.append(end)
        end += n
    return offsets, end


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


@functools.cache
def _can_view(dtype: torch.dtype) -> bool:
    try:
        torch.empty(dtype.itemsize, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError, ValueError):  # a dtype that cannot view bytes
        return False
    return True


def _rebuild_sharded(obj: Any, it) -> Any:
    """A ShardedTensor over this rank's staged local shards (``it``), with no communication.

    It keeps ``obj``'s global metadata, with every placement moved to the CPU
    where the staging buffers live, so the file loads as verl's own
    CPU-offloaded sharded state dict does.
    """
    from torch.distributed import _remote_device
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

    def on_cpu(shard_md: Any) -> Any:
        shard_md = copy.deepcopy(shard_md)
        shard_md.placement = _remote_device(f"rank:{shard_md.placement.rank()}/cpu")
        return shard_md

    metadata = copy.deepcopy(obj.metadata())
    metadata.shards_metadata = [on_cpu(md) for md in metadata.shards_metadata]
    shards = [Shard(next(it), on_cpu(shard.metadata)) for shard in obj.local_shards()]
    metadata.tensor_properties.pin_memory = bool(shards) and shards[0].tensor.is_pinned()
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, metadata, process_group=obj._process_group
    )


def _local(obj: Any) -> Any:
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(obj, dtensor):
        return obj.to_local()
    return obj


def _tensors(obj: Any, out: list[tuple[str, torch.Tensor]], key: str = "") -> None:
    """The tensors :meth:`StagingBuffers.plan` stages, in its order, with their keys."""
    if type(obj) in _PLAIN_TENSORS:  # the common leaf, without the subclass lookups
        out.append((key, obj.detach()))
        return
    obj = _local(obj)
    sharded = _sharded_tensor_type()
    if sharded is not None and isinstance(obj, sharded):
        # A tensor subclass whose ops run shard by shard: staged through its
        # local shards, never as one global-shaped tensor.
        for i, shard in enumerate(obj.local_shards()):
            out.append((f"{key}.shard{i}", shard.tensor.detach()))
    elif isinstance(obj, torch.Tensor):
        out.append((key, obj.detach()))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, out, f"{key}.{k}" if key else str(k))
    elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        for i, v in enumerate(obj):
            _tensors(v, out, f"{key}.{i}" if key else str(i))


class StagingBuffers:
    """Host buffers for one slot, reused while the state dict keeps its shapes.

    The buffers are views of one :class:`Arena`, pinned when ``pin_memory``
    (default: CUDA is available) and the state has CUDA tensors (or ``meta``
    ones, from :meth:`prepare`): a state held on the CPU gains nothing from
    locked pages. A state dict of other shapes or dtypes, or one that now
    needs pinning, gets a new arena, and the old one is released.
    """

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._arena: Arena | None = None
        self._signatures: list[tuple] = []
        self._buffers: list[torch.Tensor] = []
        self._loose_bytes = 0  # buffers outside the arena (dtypes that cannot view bytes)
        self._pinned = False  # whether the current buffers are pinned
        self._stream = None  # side CUDA stream of overlapped copies
        # How the last allocation went, for the caller's telemetry.
        self.allocations = 0
        self.last_allocation_s = 0.0

    @property
    def bytes_allocated(self) -> int:
        """Host bytes this slot's staging holds (the arena plus any loose buffers)."""
        arena = self._arena.nbytes if self._arena is not None else 0
        return arena + self._loose_bytes

    @property
    def pinned_bytes(self) -> int:
        """Of :attr:`bytes_allocated`, the page-locked (CUDA-registered) bytes."""
        arena = self._arena.nbytes if self._arena is not None and self._arena.pinned else 0
        return arena + (self._loose_bytes if self._pinned else 0)

    @property
    def arena(self) -> Arena | None:
        return self._arena

    def prepare(self, obj: Any) -> bool:
        """Allocate (pin) and pre-fault buffers for ``obj``'s tensors; True if it allocated.

        Only shapes and dtypes are read: ``obj`` may hold tensors on any
        device, ``meta`` included.
        """
        found: list[tuple[str, torch.Tensor]] = []
        _tensors(obj, found)
        return self._ensure([t for _, t in found], populate=True)

    def _ensure(self, tensors: list[torch.Tensor], *, populate: bool) -> bool:
        signatures = [_signature(t) for t in tensors]
        pin = self.pin_memory and any(t.is_cuda or t.is_meta for t in tensors)
        if signatures == self._signatures and self._arena is not None and self._pinned >= pin:
            return False
        t0 = time.perf_counter()
        self.release()
        viewable = [_can_view(t.dtype) for t in tensors]
        sizes = [_nbytes(t) if ok else 0 for t, ok in zip(tensors, viewable, strict=True)]
        offsets, total = _layout(sizes)
        arena = Arena(total, pin=pin, populate=populate)
        buffers = []
        for t, ok, offset in zip(tensors, viewable, offsets, strict=True):
            if ok and t.numel():
                buffers.append(arena.view(offset, t.shape, t.dtype))
            else:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin and ok)
                self._loose_bytes += _nbytes(buf)
                buffers.append(buf)
        self._arena, self._signatures, self._buffers = arena, signatures, buffers
        self._pinned = pin
        self.allocations += 1
        self.last_allocation_s = time.perf_counter() - t0
        return True

    def release(self) -> None:
        """Drop the buffers; the arena is unregistered and unmapped once no view is held."""
        if self._arena is not None:
            self._arena.release()
        self._arena = None
        self._signatures, self._buffers = [], []
        self._loose_bytes = 0
        self._pinned = False

    def plan(self, obj: Any) -> tuple[Any, list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """``obj`` rebuilt around this slot's buffers, and the copies still to make.

        Returns ``(snapshot, copies)``: ``snapshot`` has ``obj``'s structure
        with its tensors replaced by staging buffers (not yet filled) and other
        leaves deep-copied; ``copies`` lists ``(key, source, buffer)``.
        """
        found: list[tuple[str, torch.Tensor]] = []
        _tensors(obj, found)
        self._ensure([t for _, t in found], populate=False)
        copies = [(key, src, buf) for (key, src), buf in zip(found, self._buffers, strict=True)]
        it = iter(self._buffers)
        return self._rebuild(obj, it), copies

    def _rebuild(self, obj: Any, it) -> Any:
        if type(obj) in _PLAIN_TENSORS:  # the common leaf, without the subclass lookups
            return next(it)
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            local = self._rebuild(obj.to_local(), it)
            return dtensor.from_local(
                local,
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        sharded = _sharded_tensor_type()
        if sharded is not None and isinstance(obj, sharded):
            return _rebuild_sharded(obj, it)
        if isinstance(obj, torch.Tensor):
            return next(it)
        if isinstance(obj, dict):
            return type(obj)((k, self._rebuild(v, it)) for k, v in obj.items())
        if isinstance(obj, list):
            return [self._rebuild(v, it) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._rebuild(v, it) for v in obj)
        return copy.deepcopy(obj)

    def stage(self, obj: Any) -> Any:
        """A copy of ``obj`` whose tensors live in this slot's staging buffers.

        Returns once every copy has completed, so the caller may mutate its
        tensors immediately. Containers are rebuilt; other leaves are deep-copied.
        """
        out, copies = self.plan(obj)
        non_blocking = self._pinned
        cuda = False
        for _, src, buf in copies:
            cuda = cuda or src.is_cuda
            buf.copy_(src, non_blocking=non_blocking and src.is_cuda)
        if cuda:
            torch.cuda.synchronize()
        return out

    def side_stream(self):
        """This slot's CUDA stream for overlapped copies (created on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


class StagingCopy:
    """An overlapped copy of planned staging copies, with a check for early mutation.

    Built on the caller's thread, it only reads each source's version counter
    and, for CUDA sources, records an event on the caller's current stream;
    :meth:`run`, on a copy thread, does the rest, so the caller's thread and
    stream go on at once. CUDA sources are copied on the slot's side stream,
    after that event (the work the caller had queued when it saved); CPU
    sources are copied by the thread itself. :meth:`wait` makes the caller's
    current stream wait for the copies (an event, no host block beyond the
    copy thread's queueing of them), so the optimizer step queued after it
    runs after them. Every source's version counter (``tensor._version``,
    bumped by each in-place operation) is compared when its copy has finished:
    a change means the caller modified the tensor before staging finished, and
    the save fails with :class:`TensorMutatedError` instead of writing a mix
    of two steps.
    """

    def __init__(self, staging: StagingBuffers, copies: list) -> None:
        self.copies = copies
        self.versions = [src._version for _, src, _ in copies]
        self.done = threading.Event()  # set when the thread has queued or made every copy
        self.error: BaseException | None = None
        self._event = None  # recorded on the side stream after its copies
        self._lock = threading.Lock()
        self._ordered = False  # the caller's stream waits for the copies (wait() was called)
        self._cuda = [(k, s, b) for k, s, b in copies if s.is_cuda]
        self._cpu = [(i, c) for i, c in enumerate(copies) if not c[1].is_cuda]
        self._side = self._ready = None
        if self._cuda:
            self._side = staging.side_stream()
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream())
        if not copies:
            self.done.set()

    def start(self, submit: Callable[[Callable[[], None]], Any] | None = None) -> None:
        """Run :meth:`run` through ``submit`` (e.g. a thread pool's), else on a new thread."""
        if self.done.is_set():
            return
        if submit is not None:
            submit(self.run)
        else:
            threading.Thread(target=self.run, name="obsckpt-stage", daemon=True).start()

    def finished(self) -> bool:
        """Whether every copy has completed (CUDA ones included), without blocking."""
        return self.done.is_set() and (self._event is None or self._event.query())

    def _check(self, indices) -> None:
        for i in indices:
            key, src, _ = self.copies[i]
            if src._version != self.versions[i]:
                raise TensorMutatedError(
                    f"tensor {key!r} was modified in place before its staging copy had "
                    f"finished (version {self.versions[i]} -> {src._version}); the save is "
                    "abandoned. Call wait_staged() on the save's handle before the "
                    "optimizer step (or any in-place change of the saved tensors)"
                )

    def run(self) -> None:
        """The copy thread's work: queue the CUDA copies, copy the CPU sources (each checked)."""
        try:
            if self._cuda:
                side = self._side
                with torch.cuda.stream(side):
                    side.wait_event(self._ready)
                    for _, src, buf in self._cuda:
                        buf.copy_(src, non_blocking=True)
                        src.record_stream(side)
                    event = torch.cuda.Event()
                    event.record(side)
                self._event = event
            for i, (_, src, buf) in self._cpu:
                buf.copy_(src)
                self._check((i,))
        except BaseException as exc:  # noqa: BLE001 - raised by wait() and by the write
            self.error = exc
        finally:
            self.done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Order the caller's work after the copies; False on timeout. Raises a mutation found."""
        if not self.done.wait(timeout):
            return False
        if self._event is not None:
            with self._lock:
                if self._cuda_sources_unchanged():
                    torch.cuda.current_stream().wait_event(self._event)
                    self._ordered = True
        if self.error is not None:
            raise self.error
        return True

    def _cuda_sources_unchanged(self) -> bool:
        """With the lock held: check the CUDA sources' versions, unless ordered or failed already.

        True when checked and unchanged; a change is stored as the error.
        """
        if self._ordered or self.error is not None:
            return False
        cuda = [i for i, (_, src, _) in enumerate(self.copies) if src.is_cuda]
        try:
            self._check(cuda)
        except TensorMutatedError as exc:
            self.error = exc
            return False
        return True

    def settle(self) -> None:
        """Block until every copy has ended, for a save whose result is not used."""
        self.done.wait()
        if self._event is not None:
            self._event.synchronize()

    def finish(self) -> None:
        """For the writer: block until every copy is in host memory; raise a mutation found."""
        self.done.wait()
        if self._event is not None:
            self._event.synchronize()
            with self._lock:
                # Changes queued without waiting may have run before the copies.
                self._cuda_sources_unchanged()
        if self.error is not None:
            raise self.error


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
        self.crc = 0
        self.size = 0
        self.direct_bytes = 0  # written from the caller's memory, without a copy
        # Addresses of the storages of the object being saved: alive until finish().
        self.owned: set[int] = set()
        self._reserved: float = 0  # bytes allocated ahead of the writes (see reserve)
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
        chunk = self._free.get()
        self._raise_if_failed()
        return chunk

    def reserve(self, nbytes: int) -> None:
        """Allocate the file's blocks up to ``nbytes`` before writing them.

        A direct write past the end of the file or into unallocated blocks
        takes the inode lock exclusively for its whole duration (ext4, XFS),
        so the writers' writes would run one at a time. Into allocated blocks
        they run side by side. The file is truncated to its real size at the end.
        """
        if not self.direct or _fallocate is None or nbytes <= self._reserved:
            return
        nbytes = -(-nbytes // _ALIGN) * _ALIGN
        if _fallocate(self.fd, 0, self._reserved, nbytes - self._reserved) == 0:
            self._reserved = nbytes
        else:  # the filesystem cannot: write without reserving
            self._reserved = math.inf

    def _enqueue(self, buf: Any, nbytes: int, padded: int, offset: int, token: Any) -> None:
        if offset + padded > self._reserved:
            self.reserve(max(offset + padded, self._reserved + _RESERVE_STEP))
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
            raise OSError(f"writing the checkpoint file failed: {self._error}") from self._error

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = view.nbytes
        if (
            self.direct
            and n >= _DIRECT_MIN
            and self.size % _ALIGN == 0
            and _address(view) % _ALIGN == 0
        ):
            body = n - n % _ALIGN
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
            done.wait()
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
                    with memoryview(buf) as whole:
                        view = whole[:n]
                        while view:
                            written = os.pwrite(self.fd, view, offset)
                            offset += written
                            view = view[written:]
                        view.release()
                except BaseException as exc:  # noqa: BLE001 - raised by the saving thread
                    self._error = self._error or exc
            self._release(token)

    def finish(self) -> None:
        """Write the last chunk, truncate to the real size, fsync, close."""
        try:
            if self._chunk is not None and self._fill:
                padded = self._fill
                if self.direct:
                    padded = -(-self._fill // _ALIGN) * _ALIGN
                    self._chunk[self._fill : padded] = bytes(padded - self._fill)
                self._submit_chunk(padded)
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
            for _ in range(_WRITERS):
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


def _storages(obj: Any) -> dict[int, int]:
    """Data address -> bytes of the CPU tensors' storages in a (nested) state dict."""
    found: dict[int, int] = {}
    stack = [obj]
    while stack:
        item = stack.pop()
        item = _local(item)
        sharded = _sharded_tensor_type()
        if sharded is not None and isinstance(item, sharded):
            stack.extend(shard.tensor for shard in item.local_shards())
        elif isinstance(item, torch.Tensor):
            if item.device.type == "cpu":
                storage = item.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _torch_save(obj: Any, sink: _PipelinedSink) -> None:
    """``torch.save(obj, sink)`` without torch's own per-record CRC32.

    The whole file's CRC32 is computed here (it goes into the manifest), so
    torch computing another one per record would only halve the write speed.
    Falls back to plain ``torch.save`` where torch's writer has another shape.
    """
    storages = _storages(obj)
    sink.owned = set(storages)
    # The tensors' bytes, each record's header and alignment, and the pickle.
    sink.reserve(sum(storages.values()) + len(storages) * 2 * _ALIGN + (1 << 20))
    if _save is None:
        torch.save(obj, sink)
        return
    try:
        # Records start on a page boundary, so aligned tensors are written from their memory.
        alignment = max(_ALIGN, _get_storage_alignment())
        writer = torch._C.PyTorchFileWriter(sink, False, alignment)
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
