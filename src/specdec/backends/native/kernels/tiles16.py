"""GGUF's blocks of 32 (quant_types.BLOCKS32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in tiles of 16 rows,
the layout kernels/jit/tiles16.py multiplies: the repacking, its inverse, and the PyTorch
replica of the kernel's arithmetic (bit for bit, for the tests and for BlockLinear8's torch
path). Every per-type fact comes from the type's record."""

from __future__ import annotations

import numpy as np
import torch

from specdec.backends.native.quant_types import QuantType, quant_type

TILE = 16


def fields_at(qt: QuantType) -> int:
    """Where a tile's block holds its rows' fp16 d (then m): after the vectors of qs (4 or 8
    x 64 bytes) and, with fifth bits, 64 bytes of them."""
    return 16 * qt.qs_bytes + 64 * qt.high_bits


def tile_bytes(qt: QuantType) -> int:
    """Bytes of one block of a tile: 288, 320, 352, 384 and 544 for Q4_0 .. Q8_0."""
    return fields_at(qt) + 32 * (1 + qt.with_min)


def repack(raw: np.ndarray, qtype: QuantType, n: int, k: int) -> np.ndarray:
    """The file's blocks [N, K // 32 * block bytes] -> tiles [ceil(N / 16), K // 32 *
    tile bytes] uint8 (read-only). Per block: vector v holds each row's qs[4 v .. 4 v + 3];
    for Q5 a vector of each row's fifth bits as `spread_high_bits` lays them out; then the
    rows' d, then (Q4_1, Q5_1) their m. Q8_0's eight vectors hold qs[4 v .. 4 v + 3] likewise,
    its int8 q. Rows past N are zero blocks."""
    qt = quant_type(qtype)
    blocks, tiles = k // 32, -(-n // TILE)
    rows = np.asarray(raw).reshape(n, blocks, qt.block_bytes)
    out = np.empty((tiles, blocks, tile_bytes(qt)), np.uint8)
    # REPACK_TILES at a time: a whole matrix's transients (a vocabulary's head: tens of MB)
    # would raise glibc's mmap threshold, and later arrays of that size would stay on the heap
    for first in range(0, tiles, REPACK_TILES):
        part = rows[first * TILE : (first + REPACK_TILES) * TILE]
        _repack_into(out[first : first + REPACK_TILES], part, qt)
    out = out.reshape(tiles, blocks * tile_bytes(qt))
    out.flags.writeable = False
    return out


REPACK_TILES = 64


def _repack_into(out: np.ndarray, rows: np.ndarray, qt: QuantType) -> None:
    """rows [n, blocks, block bytes] (n <= 16 * tiles) -> out [tiles, blocks, tile bytes]."""
    tiles, blocks, _ = out.shape
    width, vectors, floats = qt.block_bytes, qt.qs_bytes // 4, 1 + qt.with_min
    padded = np.zeros((tiles * TILE, blocks, width), np.uint8)
    padded[: len(rows)] = rows
    grouped = padded.reshape(tiles, TILE, blocks, width)
    # qs in groups of 4: [tiles, 16 rows, blocks, v, 4] -> [tiles, blocks, v, 16 rows, 4]
    qs = grouped[..., width - 4 * vectors :].reshape(tiles, TILE, blocks, vectors, 4).transpose(0, 2, 3, 1, 4)
    out[..., : 64 * vectors] = qs.reshape(tiles, blocks, 64 * vectors)
    if qt.high_bits:  # [tiles, 16 rows, blocks, 4] -> [tiles, blocks, 16 rows, 4]
        high = spread_high_bits(grouped[..., 2 * floats : 2 * floats + 4])
        out[..., 256:320] = high.transpose(0, 2, 1, 3).reshape(tiles, blocks, 64)
    at = fields_at(qt)
    for f in range(floats):  # d, then m: 16 rows' fp16 each
        field = grouped[..., 2 * f : 2 * f + 2].transpose(0, 2, 1, 3)
        out[..., at + 32 * f : at + 32 + 32 * f] = field.reshape(tiles, blocks, 2 * TILE)


def spread_high_bits(qh: np.ndarray) -> np.ndarray:
    """qh [..., 4] (a little-endian uint32: bit j is element j's fifth bit) -> [..., 4] bytes
    whose byte c, bit g holds element 4 g + c's: the kernel takes group g (elements 4 g ..
    4 g + 3, one per byte of a lane) with one shift and one mask."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]: bit j
    by_byte = bits.reshape(*qh.shape[:-1], 8, 4).swapaxes(-1, -2)  # [..., c, g]
    return np.packbits(by_byte, axis=-1, bitorder="little").reshape(qh.shape)


def unpack(tiles: np.ndarray, qtype: QuantType, n: int,
           k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """tiles -> (q [N, K // 32, 32] in element order: uint8 in 0..15 (Q5: 0..31), Q8_0's int8;
    d [N, K // 32] fp32; Q4_1's and Q5_1's m likewise, or None)."""
    qt = quant_type(qtype)
    blocks, vectors = k // 32, qt.qs_bytes // 4
    t = tiles.reshape(-1, blocks, tile_bytes(qt))
    rows = lambda a: a.reshape(-1, blocks, TILE, 4).transpose(0, 2, 1, 3).reshape(-1, blocks, 4)[:n]  # noqa: E731
    qs = t[..., : 64 * vectors].reshape(-1, blocks, vectors, TILE, 4).transpose(0, 3, 1, 2, 4)
    qs = qs.reshape(-1, blocks, 4 * vectors)[:n]
    # nibbles: element j < 16 is the low nibble of qs[j], j + 16 its high
    q = qs.view(np.int8) if qt.qs_bytes == 32 else np.concatenate([qs & 15, qs >> 4], axis=-1)
    if qt.high_bits:  # byte c, bit g of the spread word: element 4 g + c
        spread = np.unpackbits(rows(t[..., 256:320]), axis=-1, bitorder="little").reshape(-1, blocks, 4, 8)
        q = q | (spread.swapaxes(-1, -2).reshape(-1, blocks, 32) << 4)
    at = fields_at(qt)

    def field(f: int) -> np.ndarray:
        halves = np.ascontiguousarray(t[..., at + 32 * f : at + 32 + 32 * f]).view(np.float16)
        return halves.transpose(0, 2, 1).reshape(-1, blocks)[:n].astype(np.float32)

    return q, field(0), field(1) if qt.with_min else None


def rows16_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, q: torch.Tensor, d: torch.Tensor,
                  m: torch.Tensor | None = None, offset: int = 8) -> torch.Tensor:
    """jit/tiles16.py's arithmetic: xq [M, B, 32] integer-valued, xs and xsum [M, B]
    (int8_reference.quantize_activations), q [N, B, 32] (the file's integers), d (and m) [N, B]
    -> y [M, N]. Block after block from zeros: c = c + float(sum q xq - offset xsum) * (d *
    xs) (Q4_0, Q5_0: the record's offset), or c = c + float(sum q xq) * (d * xs) and c_m = c_m + (m * xs)
    * float(xsum) (with m), then y = c + c_m."""
    sums = torch.einsum("mbe,nbe->mnb", xq.to(torch.int64), q.to(torch.int64))
    if m is None:
        sums = sums - offset * xsum.to(torch.int64)[:, None, :]
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
