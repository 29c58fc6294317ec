"""The delta encoding's two numbers, which a sender and its receivers (and every
encoder and apply: numpy, torch, the compiled kernels) must agree on.

See :mod:`obsckpt.sync.delta` for the encoding itself.
"""

from __future__ import annotations

__all__ = ["BLOCK", "GAP_MAX"]

BLOCK = 1 << 22  # values per block: encoded and applied as one unit, in parallel
# The longest gap one byte holds; a longer one is bridged. The compiled kernels read
# it when they compile; numba's cache keys on delta_jit.py alone, so a change here
# is seen there once that file changes too (test_delta_kernels would show the mismatch).
GAP_MAX = 255
