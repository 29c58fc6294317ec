"""Snapshot a state dict into reusable staging buffers.

The training loop is blocked only for :meth:`StagingBuffers.stage`: one copy
of each tensor into a buffer kept from the previous save of the same slot.
A slot's buffers are views of one anonymous mapping (an :class:`Arena`),
registered as pinned memory with CUDA when CUDA is present so device→host
copies run at full bandwidth, without the caching host allocator's rounding
of each buffer to a power of two. :func:`obsckpt.store.torchfile.write_torch_file`
then runs in the background and writes the staged tensors to disk straight
from those views, which are page-aligned for that purpose.

With :meth:`StagingBuffers.plan` the copy can also run apart from the caller:
a copy thread queues CUDA copies on a side stream and copies CPU tensors
itself (see :class:`StagingCopy`).
"""

from __future__ import annotations

import copy
import math
import mmap
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from obsckpt.errors import TensorMutatedError, WaitTimeoutError
from obsckpt.store.torchfile import ALIGN, DIRECT_MIN
from obsckpt.tree import PLAIN_TENSORS, dtensor_type, sharded_tensor_type, tensor_leaves

# Views of at least the direct-write size start on a page (they are written to
# disk from their memory); smaller ones on torch's own 64-byte alignment, so a
# state of many small tensors does not pay a page each.
_SMALL_ALIGN = 64
_CUDA_HOST_REGISTER_PORTABLE = 1
# The longest the writer (finish) or the next use of the buffers (settle) waits
# for an overlapped copy to end: generous (a copy of a whole shard's state to
# host memory takes seconds); past it the copy is taken to hang. Tests make it small.
STAGING_TIMEOUT_S = 600.0


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


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
        self.nbytes = max(ALIGN, _round_up(nbytes, ALIGN))
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
        end = _round_up(end, ALIGN if n >= DIRECT_MIN else _SMALL_ALIGN)
        offsets.append(end)
        end += n
    return offsets, end


def _in_arena(t: torch.Tensor) -> bool:
    # A quantized tensor's scale and zero point live beside its bytes, and may
    # change from one save to the next: it is copied into a buffer of its own.
    return t.numel() > 0 and not t.is_quantized and t.layout == torch.strided


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` of its storage that ``t``'s elements lie in."""
    size = t.element_size()
    last = sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))
    start = int(t.storage_offset()) * size
    return start, start + int(last + 1) * size


class _Placement:
    """Where each tensor of a state goes in a slot's arena, storage by storage.

    Tensors that share a storage (views, tied weights) get one buffer, the
    part of their storage they cover (from a 16-byte boundary, so every
    view's offset in it is a whole number of elements), and each is staged
    as a view into it with its own size, stride and offset: the snapshot
    shares storages and keeps strides as the state did, and ``torch.save``
    writes it as it would write the state. ``meta`` tensors (``prepare``)
    have no address: their storage objects tell which share one.

    Attributes:
        groups: per buffer, ``(index of its source tensor, start, end)``: the
            bytes ``[start, end)`` of the source's storage it holds. The
            source is the group's tensor of the smallest element size, so the
            copy is one contiguous copy in its dtype.
        places: per tensor, ``(group, byte offset in the group's buffer)``;
            None where the tensor gets a buffer of its own (see _in_arena).
        signature: what must not change for the buffers to be reused.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.groups: list[tuple[int, int, int]] = []
        self.places: list[tuple[int, int] | None] = []
        by_storage: dict[tuple, int] = {}
        spans = []
        for i, t in enumerate(tensors):
            if not _in_arena(t):
                self.places.append(None)
                spans.append((0, 0))
                continue
            storage = t.untyped_storage()
            # A meta storage has no address, but views of one share its object.
            key = (storage._cdata,) if t.is_meta else (t.device, storage.data_ptr())
            g = by_storage.setdefault(key, len(self.groups))
            start, end = _span(t)
            spans.append((start, end))
            if g == len(self.groups):
                self.groups.append((i, start, end))
            else:
                source, lo, hi = self.groups[g]
                if t.element_size() < tensors[source].element_size():
                    source = i
                self.groups[g] = (source, min(lo, start), max(hi, end))
            self.places.append((g, 0))
        # Offsets only now that every group's start is known.
        self.groups = [(source, lo - lo % 16, hi) for source, lo, hi in self.groups]
        for i, place in enumerate(self.places):
            if place is not None:
                self.places[i] = (place[0], spans[i][0] - self.groups[place[0]][1])
        self.signature = [
            (tuple(t.shape), t.dtype, t.stride() if p else None, p)
            for t, p in zip(tensors, self.places, strict=True)
        ] + [hi - lo for _, lo, hi in self.groups]

    def source(self, tensors: list[torch.Tensor], group: int) -> torch.Tensor:
        """The bytes of ``group``'s storage to copy, as a view of its source tensor
        (a view: it shares the tensor's version counter, which the mutation check reads)."""
        i, lo, hi = self.groups[group]
        t = tensors[i]
        size = t.element_size()
        return t.as_strided(((hi - lo) // size,), (1,), lo // size)


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
        self._signatures: list = []
        # None where a tensor gets a buffer of its own at each save (see _in_arena).
        self._buffers: list[torch.Tensor | None] = []
        self._groups: list[torch.Tensor] = []  # each storage's buffer (see _Placement)
        self._pinned = False  # whether the current buffers are pinned
        self._stream = None  # side CUDA stream of overlapped copies
        self._copy: StagingCopy | None = None  # the last overlapped copy into the buffers
        # How the last allocation went, for the caller's telemetry.
        self.allocations = 0
        self.last_allocation_s = 0.0

    @property
    def bytes_allocated(self) -> int:
        """Host bytes this slot's staging holds (its arena)."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def pinned_bytes(self) -> int:
        """Of :attr:`bytes_allocated`, the page-locked (CUDA-registered) bytes."""
        return self._arena.nbytes if self._arena is not None and self._arena.pinned else 0

    @property
    def arena(self) -> Arena | None:
        return self._arena

    def prepare(self, obj: Any) -> bool:
        """Allocate (pin) and pre-fault buffers for ``obj``'s tensors; True if it allocated.

        Only shapes and dtypes are read: ``obj`` may hold tensors on any
        device, ``meta`` included.
        """
        found: list[tuple[str, torch.Tensor]] = []
        tensor_leaves(obj, found)
        tensors = [t for _, t in found]
        return self._ensure(tensors, _Placement(tensors), populate=True)

    def layout_of(self, obj: Any) -> tuple[list, bool]:
        """What decides whether these buffers can stage ``obj``: its tensors' shapes,
        dtypes, strides and shared storages, and whether they need pinning (see :meth:`fits`)."""
        found: list[tuple[str, torch.Tensor]] = []
        tensor_leaves(obj, found)
        tensors = [t for _, t in found]
        pin = self.pin_memory and any(t.is_cuda or t.is_meta for t in tensors)
        return _Placement(tensors).signature, pin

    def fits(self, layout: tuple[list, bool]) -> bool:
        """Whether a state of ``layout`` (:meth:`layout_of`) is staged without allocating."""
        signatures, pin = layout
        return self._arena is not None and signatures == self._signatures and self._pinned >= pin

    def _ensure(
        self, tensors: list[torch.Tensor], placement: _Placement, *, populate: bool
    ) -> bool:
        self._settle_copy()
        signatures = placement.signature
        pin = self.pin_memory and any(t.is_cuda or t.is_meta for t in tensors)
        if signatures == self._signatures and self._arena is not None and self._pinned >= pin:
            return False
        t0 = time.perf_counter()
        self.release()
        offsets, total = _layout([hi - lo for _, lo, hi in placement.groups])
        arena = Arena(total, pin=pin, populate=populate)
        groups = []
        for (source, lo, hi), offset in zip(placement.groups, offsets, strict=True):
            raw = arena.view(offset, (hi - lo,), torch.uint8)
            groups.append(raw.view(tensors[source].dtype))
        buffers: list[torch.Tensor | None] = []
        first: dict[tuple, torch.Tensor] = {}
        for t, place in zip(tensors, placement.places, strict=True):
            if place is not None:
                g, offset = place
                view = (g, offset, t.dtype, tuple(t.shape), t.stride())
                if view not in first:  # the same tensor twice (tied weights): one buffer
                    storage = groups[g].untyped_storage()
                    first[view] = torch.empty((0,), dtype=t.dtype).set_(
                        storage, offset // t.element_size(), t.shape, t.stride()
                    )
                buffers.append(first[view])
            elif t.is_quantized or t.layout != torch.strided:
                buffers.append(None)
            else:  # empty: pinned like its neighbours (a ShardedTensor checks its shards agree)
                buffers.append(
                    torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=pin)
                )
        self._arena, self._signatures, self._buffers = arena, signatures, buffers
        self._groups = groups
        self._pinned = pin
        self.allocations += 1
        self.last_allocation_s = time.perf_counter() - t0
        return True

    def release(self) -> None:
        """Drop the buffers; the arena is unregistered and unmapped once no view is held."""
        self._settle_copy()
        if self._arena is not None:
            self._arena.release()
        self._arena = None
        self._signatures, self._buffers, self._groups = [], [], []
        self._pinned = False

    def _settle_copy(self) -> None:
        """Wait for the last overlapped copy into the buffers before they are reused or freed.

        Its save may have ended without waiting for it (e.g. its admission
        failed): a copy still running would write the older state into the
        next snapshot, or into pinned memory being unregistered.
        """
        if self._copy is not None:
            self._copy.settle()
            self._copy = None

    def plan(self, obj: Any) -> tuple[Any, list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """``obj`` rebuilt around this slot's buffers, and the copies still to make.

        Returns ``(snapshot, copies)``: ``snapshot`` has ``obj``'s structure
        with its tensors replaced by staging buffers (not yet filled) and other
        leaves deep-copied; ``copies`` lists ``(key, source, buffer)``.
        """
        found: list[tuple[str, torch.Tensor]] = []
        tensor_leaves(obj, found)
        tensors = [t for _, t in found]
        placement = _Placement(tensors)
        self._ensure(tensors, placement, populate=False)
        buffers = list(self._buffers)
        # One copy per storage: tensors sharing one (tied weights, views) share its
        # buffer, so the file holds its bytes once and they load back sharing it.
        copies = [
            (found[source][0], placement.source(tensors, g), self._groups[g])
            for g, (source, _, _) in enumerate(placement.groups)
        ]
        for i, (key, src) in enumerate(found):
            if buffers[i] is None:
                own = torch.empty_like(src, device="cpu")
                buffers[i] = own
                copies.append((key, src, own))
        return self._rebuild(obj, iter(buffers)), copies

    def _rebuild(self, obj: Any, it) -> Any:
        if type(obj) in PLAIN_TENSORS:  # the common leaf, without the subclass lookups
            return next(it)
        dtensor = dtensor_type()
        if dtensor is not None and isinstance(obj, dtensor):
            local = self._rebuild(obj.to_local(), it)
            # Not from_local: it moves a local tensor to its mesh's device, which
            # would put a copy of the (not yet filled) host buffer on the GPU.
            return dtensor(local, obj._spec, requires_grad=False)
        sharded = sharded_tensor_type()
        if sharded is not None and isinstance(obj, sharded):
            return _rebuild_sharded(obj, it)
        if isinstance(obj, torch.Tensor):
            return next(it)
        if isinstance(obj, dict):
            items = [(k, self._rebuild(v, it)) for k, v in obj.items()]
            if type(obj) is dict:
                return dict(items)
            # A subclass's constructor may take other arguments (a defaultdict's
            # factory): a shallow copy keeps its type and state, its values replaced.
            out = copy.copy(obj)
            for k, v in items:
                out[k] = v
            return out
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
        devices = set()
        for _, src, buf in copies:
            if src.is_cuda:
                devices.add(src.device)
            buf.copy_(src, non_blocking=non_blocking and src.is_cuda)
        for device in devices:  # each source's device: a process may hold several GPUs
            torch.cuda.synchronize(device)
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
        staging._copy = self
        self.copies = copies
        self.versions = [src._version for _, src, _ in copies]
        self.done = threading.Event()  # set when the thread has queued or made every copy
        self.error: BaseException | None = None
        self._event = None  # recorded on the side stream after its copies
        self._lock = threading.Lock()
        self._ordered = False  # the caller's stream waits for the copies (wait() was called)
        self._started = False
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
        self._started = True

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
        """Block until every copy has ended, for a save whose result is not used.

        Returns at once for copies that were never started (nothing will run them).
        """
        if not self._started and not self.done.is_set():
            return
        self._wait_copied("the next use of its staging buffers")
        self._forget_sources()

    def _wait_copied(self, waiter: str) -> None:
        """Until the copy thread is done and the side stream's copies have run, for
        STAGING_TIMEOUT_S at most. Raises WaitTimeoutError naming ``waiter`` after that."""
        deadline = time.monotonic() + STAGING_TIMEOUT_S
        if self.done.wait(STAGING_TIMEOUT_S):
            delay = 1e-4
            while self._event is not None and not self._event.query():
                if time.monotonic() >= deadline:
                    break
                time.sleep(delay)  # no synchronize(): it could not be given up
                delay = min(2 * delay, 0.01)
            else:
                return
            stuck = "its CUDA copies on the side stream had not run"
        else:
            stuck = "the copy thread had not finished" + ("" if self._started else " (or started)")
        raise WaitTimeoutError(
            f"{waiter} waited {STAGING_TIMEOUT_S:g} s for the overlapped staging copy of "
            f"{len(self.copies)} storages, and {stuck}; the save is abandoned (a copy that "
            "hangs: check the GPU and the host's memory)"
        )

    def _forget_sources(self) -> None:
        """Let go of the sources and buffers once copied: the caller may keep this object
        (through its save's handle) long after, and the sources may be a whole state
        dict made for the save."""
        with self._lock:
            self.copies, self.versions, self._cuda, self._cpu = [], [], [], []

    def finish(self) -> None:
        """For the writer: block until every copy is in host memory; raise a mutation found.

        Raises:
            WaitTimeoutError: the copies had not ended after ``STAGING_TIMEOUT_S``.
            TensorMutatedError: a source was changed before its copy had finished.
        """
        self._wait_copied("the writer")
        if self._event is not None:
            with self._lock:
                # Changes queued without waiting may have run before the copies.
                self._cuda_sources_unchanged()
        self._forget_sources()
        if self.error is not None:
            raise self.error
