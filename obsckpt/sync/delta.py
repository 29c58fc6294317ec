"""Delta encoding of a model's weights against the version a receiver holds.

Between two RL steps only a few percent of a published (bf16) weight's values
change: AdamW at a small learning rate moves an fp32 master weight by less
than one bf16 step most of the time. So a sync can send, per tensor, the
positions whose bits changed and their new values instead of every value.

**Encoding.** A tensor is cut into blocks of :data:`BLOCK` values, encoded
on the host's cores in parallel. A block's changed positions go as gaps of
one byte each (1 to 255 from the previous position, the first from the
block's start; a longer run of unchanged values is bridged by an entry that
rewrites the value already there, so every gap fits), and the values as
their raw bits. An entry of a bf16 tensor is 3 bytes against 2
for the changed value itself (1.5x; 1.25x for fp32), and a tensor that did
not change sends nothing. Positions compare bits, not values: ``-0.0`` after
``0.0`` is a change, a NaN that stays the same NaN is not.

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

from obsckpt.reader import crc32
from obsckpt.sync.buckets import TensorMeta

__all__ = [
    "GAP_MAX",
    "DeltaPlan",
    "apply_delta",
    "check_chunks",
    "digest",
    "digest_indices",
    "encode_delta",
]

GAP_MAX = 255
BLOCK = 1 << 22  # values per block: encoded and applied as one unit, in parallel
_ALIGN = 8
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_local = threading.local()


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


def section_bytes(count: int, itemsize: int) -> int:
    """Bytes of one block's section: its values, then its gaps, each padded to 8."""
    return _aligned(count * itemsize) + _aligned(count)


@dataclass(slots=True)
class DeltaPlan:
    """What a delta payload holds, sent ahead of it.

    ``blocks`` lists ``(tensor index, block index, entries)`` for every block
    with a change, in payload order; ``chunks`` the payload's chunks as
    ``(bytes, CRC32)``.
    """

    blocks: list[tuple[int, int, int]]
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
        blocks = [(int(i), int(k), int(n)) for i, k, n in obj["blocks"]]
        chunks = [(int(n), int(c)) for n, c in obj["chunks"]]
        changed, changed_bytes, numel = (int(x) for x in obj["counts"])
        return cls(blocks, chunks, changed, changed_bytes, numel)


def _pool() -> ThreadPoolExecutor:
    pool = getattr(_local, "pool", None)
    if pool is None:
        pool = _local.pool = ThreadPoolExecutor(
            max(1, min(8, os.cpu_count() or 1)), thread_name_prefix="obsckpt-delta"
        )
    return pool


def _parallel(fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


def bridged(positions: np.ndarray) -> np.ndarray:
    """Ascending ``positions`` (from -1) with bridging entries added: no gap exceeds :data:`GAP_MAX`."""
    if positions.size == 0:
        return positions
    prev = np.empty_like(positions)
    prev[0] = -1
    prev[1:] = positions[:-1]
    extra = (positions - prev - 1) // GAP_MAX  # bridging entries before each position
    if not extra.any():
        return positions
    counts = extra + 1
    owner = np.repeat(np.arange(positions.size), counts)
    starts = np.cumsum(counts) - counts
    k = np.arange(owner.size) - starts[owner]  # 0.. within each group
    return np.minimum(prev[owner] + GAP_MAX * (k + 1), positions[owner])


def _encode_block(new: np.ndarray, base: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """``(values, gaps, changed)`` of one block (integer views of the same length)."""
    mask = getattr(_local, "mask", None)
    if mask is None or mask.size < new.size:
        mask = _local.mask = np.empty(max(new.size, BLOCK), dtype=bool)
    m = mask[: new.size]
    np.not_equal(new, base, out=m)
    pos = np.flatnonzero(m)
    changed = int(pos.size)
    if changed == 0:
        return pos, pos, 0
    pos = bridged(pos)
    gaps = np.diff(pos, prepend=-1).astype(np.uint8)
    return new[pos], gaps, changed


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
    numel = 0
    for i, (new, base) in enumerate(zip(tensors, bases, strict=True)):
        n, b = _host_bits(new), _host_bits(base)
        numel += n.size
        for k, o in enumerate(range(0, n.size, BLOCK)):
            work.append((i, k, n[o : o + BLOCK], b[o : o + BLOCK]))
    results = _parallel(lambda w: (w[0], w[1], *_encode_block(w[2], w[3])), work)
    blocks: list[tuple[int, int, int]] = []
    sections: list[tuple[np.ndarray, np.ndarray]] = []
    changed = changed_bytes = 0
    for i, k, values, gaps, count in results:
        if count == 0:
            continue
        blocks.append((i, k, int(gaps.size)))
        sections.append((values, gaps))
        changed += count
        changed_bytes += count * values.itemsize
    size = sum(section_bytes(g.size, v.itemsize) for v, g in sections)
    payload = torch.zeros(size, dtype=torch.uint8)
    out = payload.numpy()
    off = 0
    for values, gaps in sections:
        vb = values.size * values.itemsize
        out[off : off + vb] = values.view(np.uint8)
        off += _aligned(vb)
        out[off : off + gaps.size] = gaps
        off += _aligned(gaps.size)
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
    for i, k, count in plan.blocks:
        if not 0 <= i < len(meta):
            raise ValueError(f"delta names tensor #{i}, but the sync has {len(meta)}")
        m = meta[i]
        if not 0 <= k * BLOCK < max(m.numel, 1) or count > min(BLOCK, m.numel - k * BLOCK):
            raise ValueError(f"delta block {k} ({count} entries) does not fit {m.name!r}")
        need += section_bytes(count, m.dtype.itemsize)
    if need != payload_bytes or need != plan.nbytes:
        raise ValueError(
            f"delta plan needs {need} bytes, its chunks hold {plan.nbytes}, {payload_bytes} came"
        )


def apply_delta(targets: Sequence[torch.Tensor], plan: DeltaPlan, payload: torch.Tensor) -> None:
    """Write the payload's values into ``targets`` (tensors of the base version), in place.

    Check the payload first (:func:`check_chunks`, :func:`check_plan`).

    Raises:
        ValueError: a block's positions run past its end (a payload that passed
            its checks cannot do this).
    """
    host = payload if payload.device.type == "cpu" else payload.cpu()
    work = []
    off = 0
    for i, k, count in plan.blocks:
        target = targets[i]
        size = target.element_size()
        work.append(
            (
                target,
                k,
                host[off : off + count * size],
                host[off + _aligned(count * size) :][:count],
            )
        )
        off += section_bytes(count, size)
    _parallel(_apply_block, work)


def _apply_block(work: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]) -> None:
    target, k, values, gaps = work
    flat = bits(target)
    start = k * BLOCK
    pos = np.cumsum(gaps.numpy(), dtype=np.int64)
    pos -= 1
    if pos.size and pos[-1] >= min(BLOCK, flat.numel() - start):
        raise ValueError(f"delta block {k} runs past its end ({int(pos[-1])})")
    vals = values.view(flat.dtype)
    if flat.device.type == "cpu":
        block = flat[start : start + BLOCK].numpy()
        block[pos] = vals.numpy()
    else:
        idx = torch.from_numpy(pos).to(flat.device, non_blocking=True)
        flat[start : start + BLOCK][idx] = vals.to(flat.device, non_blocking=True)


def digest(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (copied to the host if it is elsewhere)."""
    host = t.detach().contiguous()
    if host.device.type != "cpu":
        host = host.cpu()
    return crc32(host.reshape(-1).view(torch.uint8).numpy())


def digest_indices(meta: Sequence[TensorMeta], step: int, *, sample: int, full: bool) -> list[int]:
    """Which tensors are digested after the sync of ``step``: all of them when ``full``,
    else ``sample`` chosen by the step (both sides compute the same)."""
    n = len(meta)
    if full or sample >= n:
        return list(range(n))
    return sorted(random.Random(step).sample(range(n), max(0, sample)))
