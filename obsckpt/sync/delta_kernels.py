"""Compiled delta kernels: two passes over a block encode it, one walk applies it.

:mod:`obsckpt.sync.delta` encodes a block with numpy, one whole-array operation
after another (compare, scan the mask, gather, subtract, classify, make the gap
streams): each reads and writes the block's changed values again, and the
compare's mask is written and scanned as well. Where numba is installed (the
``fast`` extra; vLLM, the usual rollout engine, depends on it anyway) these
kernels do the same work in two passes over a block: the first compares eight
bytes at a time and collects the changed positions, the second writes both
streams from them; the apply walks each stream once.
Their output is byte for byte the numpy path's (the tests compare them), so a
sender with numba and a receiver without it (or the other way round) agree.

``OBSCKPT_DELTA_KERNEL=numpy`` turns them off. Compiled on first use and cached
beside this file (numba's ``cache=True``; a user-wide cache where that folder is
read-only), so a process pays for the compile once per machine, not per sync.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from typing import Any

import numpy as np

__all__ = ["GAP_MAX", "KERNEL_ENV", "apply_block", "encode_block", "kernel_name", "numba_installed"]

KERNEL_ENV = "OBSCKPT_DELTA_KERNEL"
# The longest gap one byte holds (a longer one is bridged): part of the encoding, which
# delta.py's numpy path shares from here (a global the compiled kernel reads).
GAP_MAX = 255
_local = threading.local()  # each encoding thread's work arrays

_compiled: tuple[Any, Any] | None = None  # the encode and apply kernels, once compiled
_compile_lock = threading.Lock()


@functools.cache
def numba_installed() -> bool:
    """Whether numba can be imported (found, not imported: that costs 0.6 s of CPU, which
    only a process that encodes or applies on the host pays)."""
    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # pragma: no cover
        return False


def _kernels() -> tuple[Any, Any]:
    """numba's encode and apply, compiled on first use (or loaded from its cache)."""
    global _compiled
    with _compile_lock:
        if _compiled is None:
            import numba

            jit = numba.njit(nogil=True, cache=True)
            _compiled = (jit(_encode_impl), jit(_apply_impl))
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


def _encode_impl(new, base, new_words, base_words, per, idx, diffs, small_gaps, whole, whole_gaps):
    """Both streams of one block, as delta._encode_block makes them; returns their
    lengths and the count of changed values."""
    # The changed positions: eight bytes compared at once (most words are unchanged),
    # then the values of a changed word, written without a branch; then the values
    # after the last whole word.
    k = 0
    for w in range(new_words.size):
        if new_words[w] != base_words[w]:
            o = w * per
            for j in range(per):
                idx[k] = o + j
                k += new[o + j] != base[o + j]
    for i in range(new_words.size * per, new.size):
        idx[k] = i
        k += new[i] != base[i]
    ns = 0
    nw = 0
    last_small = -1
    last_whole = -1
    for t in range(k):
        i = idx[t]
        a = new[i]
        d = np.int64(a) - np.int64(base[i])  # wraps for 8-byte values, as the receiver's add
        if d >= -127 and d <= 127:
            gap = i - last_small
            while gap > GAP_MAX:  # a bridging entry adds 0
                small_gaps[ns] = GAP_MAX
                diffs[ns] = 0
                ns += 1
                gap -= GAP_MAX
            small_gaps[ns] = gap
            diffs[ns] = d
            ns += 1
            last_small = i
        else:
            gap = i - last_whole
            while gap > GAP_MAX:  # a bridging entry writes the value already there
                last_whole += GAP_MAX
                whole_gaps[nw] = GAP_MAX
                whole[nw] = new[last_whole]
                nw += 1
                gap -= GAP_MAX
            whole_gaps[nw] = gap
            whole[nw] = a
            nw += 1
            last_whole = i
    return ns, nw, k


def _apply_impl(target, diffs, small_gaps, whole, whole_gaps) -> int:
    """Add the differences and write the whole values into ``target`` (one block's
    bits). Returns -1, or, where a stream runs past the block (checked before
    anything is written), the position it reaches."""
    room = target.size
    for gaps in (small_gaps, whole_gaps):
        pos = -1
        for j in range(gaps.size):
            pos += gaps[j]
        if pos >= room:
            return pos
    pos = -1
    for j in range(small_gaps.size):
        pos += small_gaps[j]
        target[pos] += diffs[j]  # wraps in the target's width, as the sender's difference
    pos = -1
    for j in range(whole_gaps.size):
        pos += whole_gaps[j]
        target[pos] = whole[j]
    return -1


def _buffers(n: int, dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """This thread's work arrays for a block of ``n`` values, kept between blocks (only
    the pages a block touches are ever backed)."""
    room = n + n // GAP_MAX + 1  # every value changed, and the bridges of the longest gaps
    held = getattr(_local, "buffers", None)
    if held is None or held[0].size < n:  # sized for the largest block seen
        held = _local.buffers = (
            np.empty(n, dtype=np.int32),
            np.empty(room, dtype=np.int8),
            np.empty(room, dtype=np.uint8),
            np.empty(room * 8, dtype=np.uint8),
            np.empty(room, dtype=np.uint8),
        )
    idx, diffs, small_gaps, whole, whole_gaps = held
    return idx, diffs, small_gaps, whole[: room * dtype.itemsize].view(dtype), whole_gaps


def encode_block(new: np.ndarray, base: np.ndarray) -> tuple[Any, ...] | None:
    """delta._encode_block by the compiled kernel: ``(differences, their gaps, whole
    values, their gaps, changed)``; None when nothing changed."""
    per = 8 // new.itemsize
    words = new.size - new.size % per
    idx, diffs, small_gaps, whole, whole_gaps = _buffers(new.size, new.dtype)
    encode, _ = _kernels()
    ns, nw, count = encode(
        new, base, new[:words].view(np.int64), base[:words].view(np.int64), per,
        idx, diffs, small_gaps, whole, whole_gaps,
    )  # fmt: skip
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
    _, apply = _kernels()
    past = apply(target, diffs.view(np.int8), small_gaps, whole.view(target.dtype), whole_gaps)
    if past >= 0:
        raise ValueError(f"delta block {k} runs past its end ({int(past)})")
