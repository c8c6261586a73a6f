"""The int8 activations of the GGUF 8-bit kernels (jit/tiles16.py and jit/supertiles.py state the
arithmetic; kernels/int8_reference.py holds the PyTorch replica). numba, compiled once and cached on disk;
imported on first use. Each activation row is quantized on its own, so a row's integers and
scales do not depend on the others in the batch."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True, inline="always")
def _abs_max(x, m, start, count):  # pragma: no cover - compiled
    amax = np.float32(0)
    for i in range(start, start + count):
        amax = max(amax, abs(x[m, i]))
    return amax


@njit(cache=True, nogil=True, inline="always")
def _quantize_block8(x, xq, xsum4, m, start, inv):  # pragma: no cover - compiled
    """xq[m, start : start + 32] = rint(x * inv) as int8, xsum4 the sums of each 4; returns
    the block's sum."""
    total = 0
    for g in range(start // 4, start // 4 + 8):
        part = 0
        for i in range(4 * g, 4 * g + 4):
            q = np.int8(np.rint(x[m, i] * inv))
            xq[m, i] = q
            part += q
        xsum4[m, g] = part
        total += part
    return total


@njit("void(float32[:, ::1], int8[:, ::1], float32[:, ::1], int32[:, ::1], int32[:, ::1])",
      cache=True, nogil=True)
def quantize_rows(x, xq, xs, xsum, xsum4):  # pragma: no cover - compiled
    """For the blocks of 32 (llama.cpp's Q8_0 activations): x [M, K] -> xq [M, K] int8,
    xs [M, K // 32], xsum [M, K // 32] (each block's sum of xq), xsum4 [M, K // 4] (each 4's)."""
    rows, blocks = xs.shape
    for m in range(rows):
        for b in range(blocks):
            d = _abs_max(x, m, b * 32, 32) / np.float32(127)
            xs[m, b] = d
            xsum[m, b] = _quantize_block8(x, xq, xsum4, m, b * 32,
                                          np.float32(1) / d if d > 0 else np.float32(0))


@njit("void(float32[:, ::1], int8[:, ::1], float32[:, ::1], int32[:, ::1], int32[:, ::1])",
      cache=True, nogil=True)
def quantize_rows_k(x, xq, xs, xsum, xsum4):  # pragma: no cover - compiled
    """For the K-quants (llama.cpp's Q8_K): x [M, K] -> xq [M, K] int8, xs [M, K // 256],
    xsum [M, K // 32] and xsum4 [M, K // 4]; per super-block inv = 127 / max|x|, xq = rint(x
    * inv), xs = 1 / inv."""
    rows, units = xs.shape
    for m in range(rows):
        for u in range(units):
            amax = _abs_max(x, m, u * 256, 256)
            inv = np.float32(127) / amax if amax > 0 else np.float32(0)
            xs[m, u] = np.float32(1) / inv if amax > 0 else np.float32(0)
            for b in range(8):
                xsum[m, u * 8 + b] = _quantize_block8(x, xq, xsum4, m, u * 256 + b * 32, inv)
