"""Delta encoding of a model's weights against the version a receiver holds.

Between two RL steps only a few percent of a published (bf16) weight's values
change: AdamW at a small learning rate moves an fp32 master weight by less
than one bf16 step most of the time. So a sync can send, per tensor, the
positions whose bits changed and their new values instead of every value.

**Encoding.** A tensor is cut into blocks of :data:`BLOCK` values, encoded
on the host's cores in parallel. A block's changed positions go as gaps of
one byte each (1 to 255 from the previous position, the first from the
block's start; a longer run of unchanged values is bridged by an entry that
changes nothing, so every gap fits), in two streams: a value whose bits
moved by at most 127 (as integers: a bf16 weight nudged by a few units in
its last place, which is nearly every change an RL step makes) goes as that
difference in one signed byte, added to the receiver's bits; any other as
its new bits, written over them. A changed bf16 value thus costs 2 bytes,
what the value itself weighs (1.5x for one sent whole), and a tensor that did
not change sends nothing. Positions compare bits, not values: ``-0.0`` after
``0.0`` is a change, a NaN that stays the same NaN is not. Adding differences
needs the receiver to hold exactly the base version's bits, which the
version vote and the digests make sure of.

**Payload and chunks.** The encoded tensors are laid back to back in one
byte buffer (each section aligned to 8 bytes), cut into chunks of at most
``chunk_bytes``, each with its CRC32. A receiver checks every chunk before it
applies anything (:func:`check_chunks`), so a corrupted payload leaves its
weights as they were.

**Digests.** After applying, a receiver compares a CRC32 of some of its
tensors with the sender's (:func:`digest`, :func:`digest_indices`): a few
tensors chosen by the version at every delta, all of them at a full sync. A
wrong apply (the chunk checks pass, the weights are wrong) is caught there.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from obsckpt.store.reader import crc32
from obsckpt.sync import delta_kernels as kernels
from obsckpt.sync.buckets import TensorMeta
from obsckpt.sync.delta_format import BLOCK, GAP_MAX

__all__ = [
    "BLOCK",
    "GAP_MAX",
    "DeltaPlan",
    "apply_delta",
    "check_chunks",
    "digest",
    "digest_indices",
    "encode_delta",
]

_ALIGN = 8
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_local = threading.local()  # each encoding thread's reusable mask
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width (a flat view, no copy).

    Raises:
        ValueError: ``t`` is not contiguous, or its dtype has no integer twin (complex128).
    """
    if not t.is_contiguous():
        raise ValueError(f"delta sync needs contiguous tensors, got strides {t.stride()}")
    kind = _BITS.get(t.element_size())
    if kind is None:
        raise ValueError(f"delta sync cannot encode {t.dtype} ({t.element_size()}-byte values)")
    return t.detach().reshape(-1).view(kind)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def section_bytes(small: int, whole: int, itemsize: int) -> int:
    """Bytes of one block's section: its differences and their gaps, then its whole values
    and their gaps, each padded to 8."""
    return 2 * _aligned(small) + _aligned(whole * itemsize) + _aligned(whole)


@dataclass(slots=True)
class DeltaPlan:
    """What a delta payload holds, sent ahead of it.

    ``blocks`` lists ``(tensor index, block index, small entries, whole entries)``
    for every block with a change, in payload order; ``chunks`` the payload's
    chunks as ``(bytes, CRC32)``.
    """

    blocks: list[tuple[int, int, int, int]]
    chunks: list[tuple[int, int]] = field(default_factory=list)
    changed: int = 0  # values that changed (entries minus bridging ones)
    changed_bytes: int = 0  # their bytes
    numel: int = 0  # values of every tensor

    @property
    def nbytes(self) -> int:
        return sum(n for n, _ in self.chunks)

    @property
    def fraction(self) -> float:
        """The fraction of values that changed."""
        return self.changed / self.numel if self.numel else 0.0

    def to_wire(self) -> dict[str, Any]:
        return {
            "blocks": self.blocks,
            "chunks": self.chunks,
            "counts": (self.changed, self.changed_bytes, self.numel),
        }

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> DeltaPlan:
        blocks = [(int(i), int(k), int(a), int(b)) for i, k, a, b in obj["blocks"]]
        chunks = [(int(n), int(c)) for n, c in obj["chunks"]]
        changed, changed_bytes, numel = (int(x) for x in obj["counts"])
        return cls(blocks, chunks, changed, changed_bytes, numel)


def _pool() -> ThreadPoolExecutor:
    """The process's encoding threads (one per core, at most 8), made on first use."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(
                max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="obsckpt-delta"
            )
        return _POOL


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


_WIDER = {1: np.int16, 2: np.int32, 4: np.int64, 8: np.int64}


def _gap_stream(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """The one-byte gaps of ascending ``positions`` (from -1), a bridging entry of
    :data:`GAP_MAX` added ahead of any longer gap; and where :func:`numpy.insert` put
    those entries (None: none were needed)."""
    gaps = np.diff(positions, prepend=-1)
    far = np.flatnonzero(gaps > GAP_MAX)  # few: the work below is on those alone
    if far.size == 0:
        return gaps.astype(np.uint8), None
    counts = (gaps[far] - 1) // GAP_MAX
    owner = np.repeat(far, counts)
    out = np.insert(gaps, owner, GAP_MAX)
    # Each far entry, now after its bridges, keeps the rest of its gap (1 to GAP_MAX).
    out[far + np.cumsum(counts)] -= GAP_MAX * counts
    return out.astype(np.uint8), owner


def _changed(new: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The positions whose bits differ (ascending), their new values and their base values.

    Compared as 8-byte words first (four bf16 values at once: a fraction of the
    elements to compare and of the mask to scan), then value by value within the
    words that changed alone.
    """
    mask = getattr(_local, "mask", None)
    if mask is None or mask.size < new.size:
        mask = _local.mask = np.empty(max(new.size, BLOCK), dtype=bool)
    per = 8 // new.itemsize
    whole = new.size - new.size % per
    if per == 1 or whole == 0:
        pos = np.flatnonzero(np.not_equal(new, base, out=mask[: new.size]))
        return pos, np.take(new, pos), np.take(base, pos)
    words_new, words_base = new[:whole].view(np.int64), base[:whole].view(np.int64)
    words = np.flatnonzero(np.not_equal(words_new, words_base, out=mask[: words_new.size]))
    got_new = np.take(words_new, words).view(new.dtype)
    got_base = np.take(words_base, words).view(new.dtype)
    k = np.flatnonzero(np.not_equal(got_new, got_base))
    shift = per.bit_length() - 1
    pos = (np.take(words, k >> shift) << shift) | (k & (per - 1))
    values, bases = np.take(got_new, k), np.take(got_base, k)
    if whole < new.size:  # the values after the last whole word
        tail = np.flatnonzero(np.not_equal(new[whole:], base[whole:])) + whole
        pos = np.concatenate([pos, tail])
        values = np.concatenate([values, np.take(new, tail)])
        bases = np.concatenate([bases, np.take(base, tail)])
    return pos, values, bases


def _encode_block(new: np.ndarray, base: np.ndarray) -> tuple[Any, ...] | None:
    """One block's ``(differences, their gaps, whole values, their gaps, changed)``; None
    when nothing changed (integer views of the same length)."""
    pos, values, bases = _changed(new, base)
    if pos.size == 0:
        return None
    # Wraps for 8-byte values, and so does the receiver's add.
    diff = np.subtract(values, bases, dtype=_WIDER[new.itemsize])
    small = (diff >= -127) & (diff <= 127)  # not abs: abs(INT64_MIN) is negative
    if small.all():
        pos_small, small_diff, pos_whole, whole = pos, diff, pos[:0], values[:0]
    else:
        pos_small, small_diff = pos[small], diff[small]
        large = ~small
        pos_whole, whole = pos[large], values[large]
    small_gaps, added = _gap_stream(pos_small)
    diffs = small_diff.astype(np.int8)
    if added is not None:  # a bridging entry adds 0
        diffs = np.insert(diffs, added, 0)
    whole_gaps, added = _gap_stream(pos_whole)
    if added is not None:  # a bridging entry writes the value already there
        whole = np.take(new, np.cumsum(whole_gaps, dtype=np.int64) - 1)
    return diffs, small_gaps, whole, whole_gaps, pos.size


_TORCH_WIDER = {1: torch.int16, 2: torch.int32, 4: torch.int64, 8: torch.int64}


def _on_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s delta is found where it lives (a GPU) rather than on the host."""
    return t.device.type != "cpu"


def _bridged_torch(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions with the bridging entries :func:`_gap_stream` adds, by torch operations
    (on the tensors' device), and where the given ones went (None: nothing added)."""
    if pos.numel() == 0:
        return pos, None
    gaps = torch.diff(pos, prepend=pos.new_full((1,), -1))
    extra = torch.div(gaps - 1, GAP_MAX, rounding_mode="floor")
    where = extra.nonzero().view(-1)
    if where.numel() == 0:
        return pos, None
    counts = extra[where]
    owner = torch.repeat_interleave(where, counts)
    starts = torch.cumsum(counts, 0) - counts
    k = torch.arange(1, owner.numel() + 1, device=pos.device)
    k = k - torch.repeat_interleave(starts, counts)
    bridges = pos[owner] - gaps[owner] + GAP_MAX * k
    merged, order = torch.sort(torch.cat([pos, bridges]))
    return merged, order


def _encode_block_torch(new: torch.Tensor, base: torch.Tensor) -> tuple[Any, ...] | None:
    """:func:`_encode_block` with torch operations where the tensors live; the (small)
    results are copied to the host."""
    pos = torch.ne(new, base).nonzero().view(-1)
    count = pos.numel()
    if count == 0:
        return None
    wide = _TORCH_WIDER[new.element_size()]
    diff = new[pos].to(wide) - base[pos].to(wide)  # wraps for 8-byte values, as the add
    small = diff.abs() <= 127
    n_small = int(small.sum())
    pos_small, order = _bridged_torch(pos[small])
    diffs = diff[small].to(torch.int8)
    if order is not None:  # a bridging entry adds 0 (it may fall on a value sent whole)
        real = order < n_small
        diffs = torch.zeros(pos_small.numel(), dtype=torch.int8, device=pos.device).masked_scatter(
            real, diffs[order[real]]
        )
    pos_whole, _ = _bridged_torch(pos[~small])
    start = pos.new_full((1,), -1)

    def gaps(p: torch.Tensor) -> np.ndarray:
        return torch.diff(p, prepend=start).to(torch.uint8).cpu().numpy()

    whole = new[pos_whole].cpu().numpy()
    return diffs.cpu().numpy(), gaps(pos_small), whole, gaps(pos_whole), count


def _host_bits(t: torch.Tensor) -> np.ndarray:
    b = bits(t)
    if b.device.type != "cpu":
        b = b.cpu()
    return b.numpy()


def encode_delta(
    tensors: Sequence[torch.Tensor],
    bases: Sequence[torch.Tensor],
    *,
    chunk_bytes: int,
) -> tuple[DeltaPlan, torch.Tensor]:
    """The delta of ``tensors`` against ``bases`` (same dtypes and shapes): its plan and payload.

    Changes nothing: the caller moves ``bases`` to the new values once the
    sync is done (:func:`apply_delta` on the sender's own copy does that cheaply).
    """
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    work = []
    results = []
    numel = 0
    for i, (new, base) in enumerate(zip(tensors, bases, strict=True)):
        numel += new.numel()
        if _on_device(new):  # compared where it lives; only the changes reach the host
            nb, bb = bits(new), bits(base.to(new.device))
            for k, o in enumerate(range(0, nb.numel(), BLOCK)):
                enc = _encode_block_torch(nb[o : o + BLOCK], bb[o : o + BLOCK])
                results.append((i, k, new.element_size(), enc))
            continue
        n, b = _host_bits(new), _host_bits(base)
        for k, o in enumerate(range(0, n.size, BLOCK)):
            work.append((i, k, n[o : o + BLOCK], b[o : o + BLOCK]))
    encode = kernels.encode_block if work and kernels.kernel_name() == "numba" else _encode_block
    results += _parallel(lambda w: (w[0], w[1], w[2].itemsize, encode(w[2], w[3])), work)
    results.sort(key=lambda r: (r[0], r[1]))
    blocks: list[tuple[int, int, int, int]] = []
    sections: list[tuple[np.ndarray, ...]] = []
    changed = changed_bytes = 0
    for i, k, itemsize, enc in results:
        if enc is None:
            continue
        diffs, small_gaps, whole, whole_gaps, count = enc
        blocks.append((i, k, int(diffs.size), int(whole.size)))
        sections.append((diffs, small_gaps, whole, whole_gaps))
        changed += count
        changed_bytes += count * itemsize
    size = sum(section_bytes(d.size, w.size, w.itemsize) for d, _, w, _ in sections)
    payload = torch.zeros(size, dtype=torch.uint8)
    out = payload.numpy()
    off = 0
    for section in sections:
        for part in section:
            raw = part.view(np.uint8)
            out[off : off + raw.size] = raw
            off += _aligned(raw.size)
    plan = DeltaPlan(blocks, changed=changed, changed_bytes=changed_bytes, numel=numel)
    plan.chunks = [(int(c.numel()), crc32(c.numpy())) for c in _chunks(payload, chunk_bytes)]
    return plan, payload


def _chunks(payload: torch.Tensor, chunk_bytes: int) -> list[torch.Tensor]:
    return [payload[o : o + chunk_bytes] for o in range(0, payload.numel(), chunk_bytes)]


def chunk_views(payload: torch.Tensor, plan: DeltaPlan) -> list[torch.Tensor]:
    """The payload cut as the plan's chunks (views)."""
    out, off = [], 0
    for n, _ in plan.chunks:
        out.append(payload[off : off + n])
        off += n
    return out


def check_chunks(payload: torch.Tensor, plan: DeltaPlan) -> list[int]:
    """Indices of the chunks whose CRC32 does not match the plan (empty: all good)."""
    host = payload if payload.device.type == "cpu" else payload.cpu()
    return [
        k
        for k, (c, (_, want)) in enumerate(zip(chunk_views(host, plan), plan.chunks, strict=True))
        if crc32(c.numpy()) != want
    ]


def check_plan(plan: DeltaPlan, meta: Sequence[TensorMeta], payload_bytes: int) -> None:
    """Refuse a plan that names a tensor or block the metadata does not have, or outgrows its payload.

    Raises:
        ValueError: naming what does not fit (nothing was applied).
    """
    need = 0
    for i, k, small, whole in plan.blocks:
        if not 0 <= i < len(meta):
            raise ValueError(f"delta names tensor #{i}, but the sync has {len(meta)}")
        m = meta[i]
        room = min(BLOCK, m.numel - k * BLOCK)
        if k < 0 or room <= 0 or small > room or whole > room:
            raise ValueError(f"delta block {k} ({small}+{whole} entries) does not fit {m.name!r}")
        need += section_bytes(small, whole, m.dtype.itemsize)
    if need != payload_bytes or need != plan.nbytes:
        raise ValueError(
            f"delta plan needs {need} bytes, its chunks hold {plan.nbytes}, {payload_bytes} came"
        )


def apply_delta(targets: Sequence[torch.Tensor], plan: DeltaPlan, payload: torch.Tensor) -> None:
    """Move ``targets`` (tensors holding exactly the base version) to the new version, in place.

    Check the payload first (:func:`check_chunks`, :func:`check_plan`).

    Raises:
        ValueError: a block's positions run past its end (a payload that passed
            its checks cannot do this).
    """
    host = payload if payload.device.type == "cpu" else payload.cpu()
    raw = host.numpy()
    work = []
    off = 0
    for i, k, small, whole in plan.blocks:
        target = targets[i]
        size = target.element_size()
        parts = []
        for n in (small, small, whole * size, whole):
            parts.append(raw[off : off + n])
            off += _aligned(n)
        work.append((target, k, *parts))
    compiled = kernels.kernel_name() == "numba"
    _parallel(lambda w: _apply_block(w, compiled), work)


def _positions(gaps: np.ndarray, room: int, k: int) -> np.ndarray:
    pos = np.cumsum(gaps, dtype=np.int64)
    pos -= 1
    if pos.size and pos[-1] >= room:
        raise ValueError(f"delta block {k} runs past its end ({int(pos[-1])})")
    return pos


def _apply_block(work: tuple[Any, ...], compiled: bool = False) -> None:
    target, k, diffs, small_gaps, whole, whole_gaps = work
    flat = bits(target)
    start = k * BLOCK
    room = min(BLOCK, flat.numel() - start)
    if compiled and flat.device.type == "cpu":
        host = flat[start : start + room].numpy()
        kernels.apply_block(host, diffs, small_gaps, whole, whole_gaps, k)
        return
    small_pos = _positions(small_gaps, room, k)
    whole_pos = _positions(whole_gaps, room, k)
    values = whole.view(_NP_BITS[flat.element_size()])
    if flat.device.type == "cpu":
        host = flat[start : start + room].numpy()
        host[small_pos] += diffs.view(np.int8)  # wraps as the sender's difference did
        host[whole_pos] = values
        return
    dev = flat[start : start + room]
    idx = torch.from_numpy(small_pos).to(dev.device)
    dev[idx] += torch.from_numpy(diffs.view(np.int8).astype(values.dtype)).to(dev.device)
    dev[torch.from_numpy(whole_pos).to(dev.device)] = torch.from_numpy(values).to(dev.device)


def digest(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (copied to the host if it is elsewhere)."""
    host = t.detach().contiguous()
    if host.device.type != "cpu":
        host = host.cpu()
    return crc32(host.reshape(-1).view(torch.uint8).numpy())


def digest_indices(meta: Sequence[TensorMeta], step: int, *, sample: int, full: bool) -> list[int]:
    """Which tensors are digested after the sync of ``step``: all of them when ``full``;
    else up to ``sample`` chosen by the step, within a sixteenth of the state's bytes
    (at least one tensor). Both sides compute the same."""
    n = len(meta)
    if full:
        return list(range(n))
    order = random.Random(step).sample(range(n), n)
    budget = sum(m.nbytes for m in meta) / 16
    picked: list[int] = []
    used = 0
    for i in order:
        if len(picked) >= sample or (picked and used + meta[i].nbytes > budget):
            continue
        picked.append(i)
        used += meta[i].nbytes
    return sorted(picked)
