"""Compiled delta kernels: one pass over a block's tiles encodes it, one walk applies it.

:mod:`obsckpt.sync.delta` encodes a block with numpy, one whole-array operation
after another (compare, scan the mask, gather, subtract, classify, make the gap
streams): each reads and writes the block's changed values again, and the
compare's mask is written and scanned as well. Where numba is installed (the
``fast`` extra; vLLM, the usual rollout engine, depends on it anyway) these
kernels (:mod:`obsckpt.sync.delta_jit`) do the same work tile by tile, in the
core's cache: compare eight bytes at a time and keep the changed words without
a branch, split their lanes into changed positions and differences, write both
streams; the apply walks each stream once.
Their output is byte for byte the numpy path's (the tests compare them), so a
sender with numba and a receiver without it (or the other way round) agree.

``OBSCKPT_DELTA_KERNEL=numpy`` turns them off. Compiled on first use and cached
beside delta_jit (numba's ``cache=True``; a user-wide cache where that folder is
read-only), so a process pays for the compile once per machine, not per sync.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from typing import Any

import numpy as np

from obsckpt.sync.delta_format import GAP_MAX

__all__ = [
    "KERNEL_ENV",
    "apply_block",
    "encode_block",
    "kernel_name",
    "numba_installed",
]

KERNEL_ENV = "OBSCKPT_DELTA_KERNEL"
_local = threading.local()  # each encoding thread's work arrays

_compiled: Any = None  # obsckpt.sync.delta_jit, once imported (its kernels compiled on first use)
_compile_lock = threading.Lock()


@functools.cache
def numba_installed() -> bool:
    """Whether numba can be imported (found, not imported: that costs 0.6 s of CPU, which
    only a process that encodes or applies on the host pays)."""
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # pragma: no cover
        return False


def _kernels() -> Any:
    """The module of numba's encode and apply (:mod:`obsckpt.sync.delta_jit`), imported on
    first use; its kernels compile on their first call (or load from numba's cache)."""
    global _compiled
    with _compile_lock:
        if _compiled is None:
            from obsckpt.sync import delta_jit

            _compiled = delta_jit
        return _compiled


def kernel_name() -> str:
    """Which encoder and apply run on the host: ``"numba"`` or ``"numpy"``.

    Raises:
        ValueError: ``OBSCKPT_DELTA_KERNEL`` names neither.
    """
    asked = os.environ.get(KERNEL_ENV, "").strip().lower()
    if asked not in ("", "numba", "numpy"):
        raise ValueError(
            f"{KERNEL_ENV}={os.environ[KERNEL_ENV]!r} is not a delta kernel; "
            "set it to 'numba' or 'numpy', or unset it (numba where installed)"
        )
    if asked == "numba" and not numba_installed():
        raise ValueError(
            f"{KERNEL_ENV}=numba, but numba is not installed: "
            "pip install 'obsckpt[fast]', or unset it"
        )
    if asked == "numpy" or not numba_installed():
        return "numpy"
    return "numba"


def _buffers(n: int, dtype: np.dtype, tile: int) -> tuple[tuple[np.ndarray, ...], ...]:
    """This thread's work arrays for a block of ``n`` values, kept between blocks: a
    tile's (``tile`` words, see :mod:`obsckpt.sync.delta_jit`), and the streams (only
    the pages a block's streams reach are ever backed)."""
    room = n + n // GAP_MAX + 1  # every value changed, and the bridges of the longest gaps
    held = getattr(_local, "buffers", None)
    if held is None or held[2][0].size < room:  # sized for the largest block seen
        lane_room = tile * 8 + 8  # a tile's lanes, and the values after the last word
        held = _local.buffers = (
            (np.empty(tile, np.int32), np.empty(tile, np.int64), np.empty(tile, np.int64)),
            (np.empty(lane_room, np.int32), np.empty(lane_room, np.int64)),
            (
                np.empty(room, dtype=np.int8),
                np.empty(room, dtype=np.uint8),
                np.empty(room * 8, dtype=np.uint8),
                np.empty(room, dtype=np.uint8),
            ),
        )
    words, values, (diffs, small_gaps, whole, whole_gaps) = held
    return (
        words,
        values,
        (diffs, small_gaps, whole[: room * dtype.itemsize].view(dtype), whole_gaps),
    )


def encode_block(new: np.ndarray, base: np.ndarray) -> tuple[Any, ...] | None:
    """delta._encode_block by the compiled kernel: ``(differences, their gaps, whole
    values, their gaps, changed)``; None when nothing changed."""
    per = 8 // new.itemsize
    words = new.size - new.size % per
    jit = _kernels()
    work_words, work_values, streams = _buffers(new.size, new.dtype, jit.TILE)
    ns, nw, count = jit.encode(
        new, base, new[:words].view(np.int64), base[:words].view(np.int64),
        work_words, work_values, streams,
    )  # fmt: skip
    diffs, small_gaps, whole, whole_gaps = streams
    if count == 0:
        return None
    return (
        diffs[:ns].copy(),
        small_gaps[:ns].copy(),
        whole[:nw].copy(),
        whole_gaps[:nw].copy(),
        count,
    )


def apply_block(
    target: np.ndarray, diffs: np.ndarray, small_gaps: np.ndarray, whole: np.ndarray,
    whole_gaps: np.ndarray, k: int,
) -> None:  # fmt: skip
    """delta._apply_block's host apply by the compiled kernel (``target``: the block's bits).

    Raises:
        ValueError: a stream runs past the block's end (nothing is written then).
    """
    past = _kernels().apply(
        target, diffs.view(np.int8), small_gaps, whole.view(target.dtype), whole_gaps
    )
    if past >= 0:
        raise ValueError(f"delta block {k} runs past its end ({int(past)})")
