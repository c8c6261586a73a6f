"""Q4_0 matrices in tiles of 16 rows (gguf_jit_rows16.py's layout and arithmetic): the
repacking, and the PyTorch replica of the kernel's arithmetic (bit for bit, for the tests and
for BlockLinear8's torch path)."""

from __future__ import annotations

import numpy as np
import torch

ROWS16_KIND = 5  # a group part's kind code in gguf_jit_layer, past gguf_jit_small's KIND_CODES
TILE = 16
BLOCK_BYTES = 288  # a tile's block: 4 x 64 bytes of nibbles, then 16 fp16 d
Q4_0_BYTES = 18  # a file block: fp16 d, 16 bytes of nibbles


def repack(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The file's Q4_0 blocks [N, K // 32 * 18] -> tiles [ceil(N / 16), K // 32 * 288] uint8
    (read-only): per block, vector v holds each row's qs[4 v .. 4 v + 3], then the rows' d;
    rows past N are zero blocks."""
    blocks, tiles = k // 32, -(-n // TILE)
    padded = np.zeros((tiles * TILE, blocks, Q4_0_BYTES), np.uint8)
    padded[:n] = np.asarray(raw).reshape(n, blocks, Q4_0_BYTES)
    grouped = padded.reshape(tiles, TILE, blocks, Q4_0_BYTES)
    out = np.empty((tiles, blocks, BLOCK_BYTES), np.uint8)
    # qs bytes 2..17 as 4 groups of 4: [tiles, 16 rows, blocks, 4 v, 4] -> [tiles, blocks, 4 v, 16 rows, 4]
    out[..., :256] = grouped[..., 2:].reshape(tiles, TILE, blocks, 4, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, blocks, 256)
    out[..., 256:] = grouped[..., :2].transpose(0, 2, 1, 3).reshape(tiles, blocks, 2 * TILE)
    out = out.reshape(tiles, blocks * BLOCK_BYTES)
    out.flags.writeable = False
    return out


def unpack(tiles: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """tiles -> (q [N, K // 32, 32] in 0..15, element order; d [N, K // 32] fp32)."""
    blocks = k // 32
    t = tiles.reshape(-1, blocks, BLOCK_BYTES)
    qs = t[..., :256].reshape(-1, blocks, 4, TILE, 4).transpose(0, 3, 1, 2, 4).reshape(-1, blocks, 16)[:n]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # element j < 16: low nibble of qs[j]; j + 16: its high
    d = np.ascontiguousarray(t[..., 256:]).view(np.float16).transpose(0, 2, 1).reshape(-1, blocks)[:n]
    return q, d.astype(np.float32)


def rows16_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """gguf_jit_rows16's arithmetic: xq [M, B, 32] integer-valued, xs and xsum [M, B]
    (gguf_kernels_8bit.quantize_activations), q [N, B, 32] in 0..15, d [N, B] -> y [M, N]:
    c = c + float(sum q xq - 8 xsum) * (d * xs), block after block from c = 0."""
    sums = torch.einsum("mbe,nbe->mnb", xq.to(torch.int64), q.to(torch.int64)) - 8 * xsum.to(torch.int64)[:, None, :]
    products = sums.to(torch.float32) * (d[None, :, :] * xs[:, None, :])  # [M, N, B]
    total = torch.zeros(products.shape[:2])
    for b in range(products.shape[2]):  # in block order, as the kernel adds them
        total = total + products[..., b]
    return total
