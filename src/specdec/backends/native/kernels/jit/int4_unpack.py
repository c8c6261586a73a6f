"""numba kernels that decode a tile of a quantized matrix for the prompt GEMM
(kernels/int4_blocks.Int4BlockLinear.tile_forward): elementwise, no reduction, so any split over threads
gives the same bits. Imported on first use; compiled once, cached on disk.

Each weight is computed as PyTorch's `unpack_tile` computes it, operation for operation:
(q - 8) * scale, then + zero, each rounded to fp32 (numba compiles without fastmath, so
LLVM does not fuse them), then rounded to bf16, to nearest with ties to even. The tests
check the two bit for bit. A tile comes out transposed, [K, rows], the GEMM's own layout
for its second operand, so that every loop reads and writes memory in order.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

_SIGNATURE = "void(uint8[:, :, ::1], float32[:, ::1], float32[:, ::1], {}[:, ::1])"


@njit(cache=True, nogil=True, inline="always")
def _column(packed, s, z, values):  # pragma: no cover - compiled
    """One column of 64 rows: packed [32] bytes (row j low nibble, row j + 32 high), s and z
    [64] -> values [64] fp32."""
    for j in range(32):
        low = np.float32(packed[j] & 15) - np.float32(8)
        high = np.float32(packed[j] >> 4) - np.float32(8)
        product_low, product_high = low * s[j], high * s[j + 32]
        values[j] = product_low + z[j]
        values[j + 32] = product_high + z[j + 32]


@njit(_SIGNATURE.format("uint16"), cache=True, nogil=True, parallel=True)
def int4_tile_bf16_t(blocks, scale, zero, out):  # pragma: no cover - compiled
    """blocks [R / 64, K, 32]: PyTorch's int4 packing (byte j of column c holds row j in its low
    nibble and row j + 32 in its high one), scale and zero [K // 32, R] fp32 -> out [K, R]
    bf16 bits (uint16): the tile's weights, transposed."""
    for g in prange(blocks.shape[0]):
        values = np.empty(64, np.float32)
        bits = values.view(np.uint32)
        for c in range(blocks.shape[1]):
            _column(blocks[g, c], scale[c // 32, g * 64 : g * 64 + 64], zero[c // 32, g * 64 : g * 64 + 64],
                    values)
            row = out[c, g * 64 : g * 64 + 64]
            for j in range(64):
                b = bits[j]
                row[j] = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                                   >> np.uint32(16))
