"""numba's delta kernels (imported by :mod:`obsckpt.sync.delta_kernels` on first use only:
importing numba costs 0.6 s of CPU, which a process that never encodes should not pay).

The encode works through a block one tile of :data:`TILE` eight-byte words at a
time, so the tile's work arrays stay in the core's cache:

1. every word of the tile is compared with the base's, and the changed ones are
   collected (their index and both values) without a branch: the next slot is
   written for every word and kept only when the word differs (a branch here
   would be mispredicted for about one word in ten, at random);
2. the lanes of each changed word (``8 // itemsize`` values, a constant of the
   compiled kernel) are split out of the two kept words, again without a
   branch: the position and the difference of each lane that differs;
3. each changed value goes to one of the two streams: a difference that fits
   one byte, or the whole new value, each with its one-byte gap.

The apply walks each stream once, after checking that neither runs past the block.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from obsckpt.sync.delta_format import GAP_MAX

# Eight-byte words per tile: 128 KiB of each side and of the tile's work arrays. Like
# GAP_MAX, a constant of the compiled code (as arguments they cost it about 15%).
TILE = 16384


def lanes(values: np.ndarray) -> int:
    """Values of ``values``' dtype in one eight-byte word."""
    return 8 // values.itemsize


@overload(lanes)
def _lanes_compiled(values):  # type: ignore[no-untyped-def]
    per = 64 // values.dtype.bitwidth  # known when the kernel is compiled: its loops unroll
    return lambda values: per


@numba.njit(nogil=True, cache=True)
def encode(new, base, new_words, base_words, work_words, work_values, streams):  # type: ignore[no-untyped-def]
    """Both streams of one block, as delta._encode_block makes them, written into
    ``streams`` (differences, their gaps, whole values, their gaps); returns the
    streams' lengths and the count of changed values. ``work_words`` hold a tile's
    words, ``work_values`` its lanes."""
    widx, wnew, wbase = work_words
    idx, dv = work_values
    diffs, small_gaps, whole, whole_gaps = streams
    per = lanes(new)
    bits = 64 // per
    mask = ~np.uint64(0) if per == 1 else (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    sign = np.uint64(1) << np.uint64(bits - 1)
    nwords = new_words.size
    ns = nw = count = 0
    last_small = last_whole = -1
    for t0 in range(0, max(nwords, 1), TILE):
        t1 = min(t0 + TILE, nwords)
        m = 0
        for w in range(t0, t1):
            a = new_words[w]
            b = base_words[w]
            widx[m] = w
            wnew[m] = a
            wbase[m] = b
            m += a != b
        k = 0
        for t in range(m):
            x = np.uint64(wnew[t])
            y = np.uint64(wbase[t])
            o = widx[t] * per
            for j in range(per):
                s = np.uint64(j * bits)
                u = (x >> s) & mask
                v = (y >> s) & mask
                idx[k] = o + j
                # Sign-extended lanes; for 8-byte values the difference wraps, as the
                # receiver's add does.
                dv[k] = np.int64((u ^ sign) - sign) - np.int64((v ^ sign) - sign)
                k += u != v
        if t1 == nwords:  # the values after the last whole word
            for i in range(nwords * per, new.size):
                idx[k] = i
                dv[k] = np.int64(new[i]) - np.int64(base[i])
                k += new[i] != base[i]
        count += k
        for t in range(k):
            i = idx[t]
            d = dv[t]
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
                whole[nw] = new[i]
                nw += 1
                last_whole = i
    return ns, nw, count


@numba.njit(nogil=True, cache=True)
def apply(target, diffs, small_gaps, whole, whole_gaps):  # type: ignore[no-untyped-def]
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
