"""The compiled delta kernels give the numpy path's bytes, and apply them the same way.

A sender and a receiver may differ in whether numba is installed, so the
kernels' output is checked byte for byte against the numpy encoder's, for
every integer width the encoder sees, lengths that are no multiple of a word,
views that start off a word boundary, and changes from none to all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from obsckpt.sync import delta
from obsckpt.sync import delta_kernels as kernels

WIDTHS = [np.int8, np.int16, np.int32, np.int64]


def pair(n: int, dtype, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A base and a new block: ``fraction`` of the values changed, most by a small step
    (sent as a difference), some to anything (sent whole), across the type's range."""
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    base = rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    new = base.copy()
    where = rng.choice(n, int(n * fraction), replace=False) if n else np.empty(0, np.int64)
    small = rng.random(where.size) < 0.85
    steps = rng.integers(-127, 128, where.size)
    with np.errstate(over="ignore"):
        new[where[small]] = (base[where[small]].astype(np.int64) + steps[small]).astype(dtype)
    new[where[~small]] = rng.integers(info.min, info.max, (~small).sum(), dtype=dtype)
    return new, base


def encodes_and_applies_alike(new: np.ndarray, base: np.ndarray) -> None:
    """The kernel's streams are the numpy encoder's, byte for byte, and its apply
    takes ``base`` to ``new``."""
    want, got = delta._encode_block(new, base), kernels.encode_block(new, base)
    assert (want is None) == (got is None)
    if want is None:
        return
    for w, g in zip(want[:4], got[:4], strict=True):
        assert w.dtype == g.dtype and np.array_equal(w, g)
    assert want[4] == got[4]
    target = base.copy()
    kernels.apply_block(target, *got[:4], k=0)
    assert np.array_equal(target, new)


def test_this_environment_has_the_compiled_kernels():
    """`make test` installs the `fast` extra: the kernels must run here, not be skipped."""
    assert kernels.numba_installed(), "numba is missing: pip install 'obsckpt[fast]'"
    assert kernels.kernel_name() == "numba"


def test_importing_the_sync_modules_leaves_numba_unimported():
    """numba costs 0.6 s of CPU to import: only a process that encodes on the host pays."""
    import subprocess
    import sys

    code = (
        "import sys, obsckpt.sync.delta, obsckpt.sync.synchronizer; print('numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("dtype", WIDTHS)
@pytest.mark.parametrize("n", [0, 1, 7, 13, 1000, 4097, 70_000])
@pytest.mark.parametrize("fraction", [0.0, 0.002, 0.03, 0.5, 1.0])
def test_encode_gives_the_numpy_bytes(dtype, n, fraction):
    new, base = pair(n, dtype, fraction, seed=n)
    for off in (0, 1, 3):  # views starting off a word's boundary
        encodes_and_applies_alike(new[off:], base[off:])


@pytest.mark.parametrize("dtype", WIDTHS)
def test_long_runs_and_every_gap_length_bridge_alike(dtype):
    """Gaps of exactly 255, 256 and 510 (one and two bridges), in both streams."""
    n = 3000
    base = np.zeros(n, dtype=dtype)
    new = base.copy()
    info = np.iinfo(dtype)
    for i, p in enumerate([254, 509, 510, 1020, 1530, 2999]):
        new[p] = 3 if i % 2 else info.max  # small and whole, alternating
    want, got = delta._encode_block(new, base), kernels.encode_block(new, base)
    for w, g in zip(want[:4], got[:4], strict=True):
        assert np.array_equal(w, g)


@pytest.mark.parametrize("dtype", WIDTHS)
def test_gaps_and_streams_carry_across_tiles(dtype):
    """The kernel works a tile of words at a time: a gap that spans a tile's end (bridged
    or not), a change in a tile's first and last value, a block of several tiles."""
    from obsckpt.sync.delta_jit import TILE

    per = 8 // np.dtype(dtype).itemsize
    edge = TILE * per  # the first value of the second tile
    n = 3 * edge + 5
    new, base = pair(n, dtype, 0.001, seed=per)
    info = np.iinfo(dtype)
    for p, v in [(edge - 1, 5), (edge, info.max), (edge + 300, 9), (2 * edge - 1, info.min)]:
        new[p] = base[p] + 1 if v == 5 or v == 9 else v
    new[2 * edge : 2 * edge + 600] = base[2 * edge : 2 * edge + 600]  # a long quiet gap
    new[n - 1] = base[n - 1] ^ 1
    encodes_and_applies_alike(new, base)


@pytest.mark.parametrize("kernel", ["numba", "numpy"])
def test_a_sign_flip_of_zero_in_float64_is_sent(monkeypatch, kernel):
    """-0.0 to 0.0 in float64 is a difference of 2**63 in its bits, which wraps to
    INT64_MIN, whose absolute value is negative: it must go whole, not as a small 0."""
    monkeypatch.setenv(kernels.KERNEL_ENV, kernel)
    base = torch.tensor([-0.0, 1.0, -0.0], dtype=torch.float64)
    new = torch.tensor([0.0, 1.0, -0.0], dtype=torch.float64)
    plan, payload = delta.encode_delta([new], [base], chunk_bytes=64)
    assert plan.blocks == [(0, 0, 0, 1)]
    target = base.clone()
    delta.apply_delta([target], plan, payload)
    assert torch.equal(delta.bits(target), delta.bits(new))


@pytest.mark.parametrize("stream", ["differences", "whole values"])
def test_a_stream_past_the_block_writes_nothing(stream):
    base = np.arange(100, dtype=np.int16)
    diffs, small_gaps = np.array([1, 1], np.int8), np.array([50, 49], np.uint8)
    whole, whole_gaps = np.array([7], np.int16), np.array([3], np.uint8)
    if stream == "differences":
        small_gaps = np.array([50, 51], np.uint8)  # reaches position 100 of 0..99
    else:
        whole_gaps = np.array([101], np.uint8)
    target = base.copy()
    with pytest.raises(ValueError, match="delta block 4 runs past its end"):
        kernels.apply_block(target, diffs, small_gaps, whole, whole_gaps, k=4)
    assert np.array_equal(target, base)


@pytest.mark.parametrize("value", ["fortran", "NUMBA "])
def test_the_kernel_setting_is_checked(monkeypatch, value):
    monkeypatch.setenv(kernels.KERNEL_ENV, value)
    if value.strip().lower() == "numba":
        assert kernels.kernel_name() == "numba"  # case and spaces do not matter
        return
    with pytest.raises(ValueError, match="OBSCKPT_DELTA_KERNEL='fortran'.*'numba' or 'numpy'"):
        kernels.kernel_name()
    with pytest.raises(ValueError, match="OBSCKPT_DELTA_KERNEL"):
        delta.encode_delta([torch.ones(4)], [torch.zeros(4)], chunk_bytes=64)
