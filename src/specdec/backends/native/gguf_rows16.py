"""Q4_0 and Q4_1 matrices in tiles of 16 rows (gguf_jit_rows16.py's layout and arithmetic):
the repacking, and the PyTorch replica of the kernel's arithmetic (bit for bit, for the tests
and for BlockLinear8's torch path)."""

from __future__ import annotations

import numpy as np
import torch

ROWS16_KIND = 5  # Q4_0's code in a layer's groups (gguf_jit_layer), past gguf_jit_small's KIND_CODES; Q4_1 6
ROWS16_TYPES = ("Q4_0", "Q4_1")
TILE = 16
FILE_BYTES = {"Q4_0": 18, "Q4_1": 20}  # a file block: fp16 d (Q4_1: and m), 16 bytes of nibbles
TILE_BYTES = {"Q4_0": 288, "Q4_1": 320}  # a tile's block: 4 x 64 bytes of nibbles, 16 fp16 d (and 16 m)


def repack(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    """The file's blocks [N, K // 32 * 18 or 20] -> tiles [ceil(N / 16), K // 32 * 288 or 320]
    uint8 (read-only): per block, vector v holds each row's qs[4 v .. 4 v + 3], then the rows'
    d, then (Q4_1) their m; rows past N are zero blocks."""
    blocks, tiles, width = k // 32, -(-n // TILE), FILE_BYTES[qtype]
    fields = width - 16  # d (m) before the nibbles
    padded = np.zeros((tiles * TILE, blocks, width), np.uint8)
    padded[:n] = np.asarray(raw).reshape(n, blocks, width)
    grouped = padded.reshape(tiles, TILE, blocks, width)
    out = np.empty((tiles, blocks, TILE_BYTES[qtype]), np.uint8)
    # qs as 4 groups of 4: [tiles, 16 rows, blocks, 4 v, 4] -> [tiles, blocks, 4 v, 16 rows, 4]
    nibbles = grouped[..., fields:].reshape(tiles, TILE, blocks, 4, 4).transpose(0, 2, 3, 1, 4)
    out[..., :256] = nibbles.reshape(tiles, blocks, 256)
    for f in range(fields // 2):  # d, then m: 16 rows' fp16 each
        field = grouped[..., 2 * f : 2 * f + 2].transpose(0, 2, 1, 3)
        out[..., 256 + 32 * f : 288 + 32 * f] = field.reshape(tiles, blocks, 2 * TILE)
    out = out.reshape(tiles, blocks * TILE_BYTES[qtype])
    out.flags.writeable = False
    return out


def unpack(tiles: np.ndarray, qtype: str, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """tiles -> (q [N, K // 32, 32] uint8 in 0..15, element order; d [N, K // 32] fp32; Q4_1's
    m likewise, or None)."""
    blocks = k // 32
    t = tiles.reshape(-1, blocks, TILE_BYTES[qtype])
    qs = t[..., :256].reshape(-1, blocks, 4, TILE, 4).transpose(0, 3, 1, 2, 4).reshape(-1, blocks, 16)[:n]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)  # element j < 16: low nibble of qs[j]; j + 16: its high

    def field(f: int) -> np.ndarray:
        halves = np.ascontiguousarray(t[..., 256 + 32 * f : 288 + 32 * f]).view(np.float16)
        return halves.transpose(0, 2, 1).reshape(-1, blocks)[:n].astype(np.float32)

    return q, field(0), field(1) if qtype == "Q4_1" else None


def rows16_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                  m: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """gguf_jit_rows16's arithmetic: xq [M, B, 32] integer-valued, xs and xsum [M, B]
    (gguf_kernels_8bit.quantize_activations), q [N, B, 32] in 0..15, d (and Q4_1's m) [N, B]
    -> y [M, N]. Block after block from zeros: c = c + float(sum q xq - 8 xsum) * (d * xs)
    (Q4_0), or c = c + float(sum q xq) * (d * xs) and c_m = c_m + (m * xs) * float(xsum)
    (Q4_1), then y = c + c_m."""
    sums = torch.einsum("mbe,nbe->mnb", xq.to(torch.int64), q.to(torch.int64))
    if m is None:
        sums = sums - 8 * xsum.to(torch.int64)[:, None, :]
    products = sums.to(torch.float32) * (d[None, :, :] * xs[:, None, :])  # [M, N, B]
    total = torch.zeros(products.shape[:2])
    for b in range(products.shape[2]):  # in block order, as the kernel adds them
        total = total + products[..., b]
    if m is None:
        return total
    mins = (m[None, :, :] * xs[:, None, :]) * xsum.to(torch.float32)[:, None, :]
    min_total = torch.zeros(products.shape[:2])
    for b in range(mins.shape[2]):
        min_total = min_total + mins[..., b]
    return total + min_total
