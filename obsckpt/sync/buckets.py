"""How a model's tensors travel: their metadata, and the plan that packs them into buckets.

Every side of a weight sync computes the same plan from the same metadata, so
only the names, dtypes and shapes travel: :func:`plan_buckets` groups tensors
of one dtype back to back into buckets of at most ``bucket_bytes`` (a larger
tensor goes alone), in the order the sender issues them. The broadcast sends
one collective per bucket; the ipc sync packs its buckets the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

DEFAULT_BUCKET_BYTES = 256 << 20


class TensorMeta(NamedTuple):
    """What a receiver needs to rebuild one tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_wire(self) -> tuple[str, str, tuple[int, ...]]:
        return (self.name, str(self.dtype).removeprefix("torch."), self.shape)

    @classmethod
    def from_wire(cls, obj: tuple[str, str, tuple[int, ...]]) -> TensorMeta:
        name, dtype, shape = obj
        return cls(name, getattr(torch, dtype), tuple(int(d) for d in shape))


def tensor_meta(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorMeta]:
    """Names, dtypes and shapes of ``(name, tensor)`` pairs, in order."""
    return [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named_tensors]


def as_tensor_meta(
    entries: Iterable[TensorMeta | tuple[str, str | torch.dtype, Sequence[int]]],
) -> list[TensorMeta]:
    """:class:`TensorMeta` of each ``(name, dtype, shape)`` entry, in order.

    A dtype may be a ``torch.dtype`` or its name (``"float32"``, ``"torch.float32"``),
    as :meth:`~obsckpt.sync.Synchronizer.get_state_dict_meta` gives it.

    Raises:
        ValueError: an entry is not ``(name, dtype, shape)`` or names no torch dtype.
    """
    out: list[TensorMeta] = []
    for entry in entries:
        if isinstance(entry, TensorMeta):
            out.append(entry)
            continue
        try:
            name, dtype, shape = entry
        except (TypeError, ValueError):
            raise ValueError(
                f"tensor metadata must be (name, dtype, shape) entries, got {entry!r}"
            ) from None
        if isinstance(dtype, str):
            found = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(found, torch.dtype):
                raise ValueError(f"{name!r}: {dtype!r} names no torch dtype")
            dtype = found
        out.append(TensorMeta(name, dtype, tuple(int(d) for d in shape)))
    return out


def validate_unique_names(meta: list[TensorMeta]) -> None:
    """Refuse a name given twice: names key the receiver's dict, so one would vanish silently.

    Raises:
        ValueError: some name appears more than once (nothing was sent).
    """
    dups = sorted(name for name, n in Counter(m.name for m in meta).items() if n > 1)
    if not dups:
        return
    raise ValueError(
        f"tensor names must be unique, but {dups[:3]} appear more than once; the receiver "
        "would keep only one of each. Nothing was sent: give each tensor its own name"
    )


@dataclass(frozen=True, slots=True)
class Bucket:
    """One collective: tensors of one dtype packed back to back, or one large tensor alone."""

    dtype: torch.dtype
    indices: tuple[int, ...]  # positions in the metadata list
    offsets: tuple[int, ...]  # element offsets inside the bucket
    numel: int
    solo: bool

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def plan_buckets(meta: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """Buckets in the order the sender issues them, computed identically on every side.

    Tensors are taken in order; each dtype fills its own open bucket until the
    next tensor of that dtype does not fit. A tensor of at least
    ``bucket_bytes`` goes alone. A bucket is issued as soon as its last tensor
    arrives, so buckets are ordered by their last tensor.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    issued: list[Bucket] = []
    open_: dict[torch.dtype, tuple[list[int], list[int], int]] = {}

    def close(dtype: torch.dtype) -> None:
        idx, offs, numel = open_.pop(dtype)
        issued.append(Bucket(dtype, tuple(idx), tuple(offs), numel, solo=False))

    for i, m in enumerate(meta):
        if m.nbytes >= bucket_bytes:
            issued.append(Bucket(m.dtype, (i,), (0,), m.numel, solo=True))
            continue
        cur = open_.get(m.dtype)
        if cur is not None and (cur[2] + m.numel) * m.dtype.itemsize > bucket_bytes:
            close(m.dtype)
            cur = None
        if cur is None:
            cur = open_[m.dtype] = ([], [], 0)
        idx, offs, numel = cur
        idx.append(i)
        offs.append(numel)
        open_[m.dtype] = (idx, offs, numel + m.numel)
    for dtype in list(open_):
        close(dtype)
    # The sender issues a bucket as soon as its last tensor is packed.
    issued.sort(key=lambda b: b.indices[-1])
    return issued
