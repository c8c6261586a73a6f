"""GGUF's K-quants (quant_types.SUPERBLOCKS: Q6_K, Q5_K, Q4_K) in tiles of 16 rows, the layout
kernels/jit/supertiles.py multiplies: the repacking, its inverse, and the PyTorch replica of
the kernel's arithmetic (bit for bit, for the tests and for BlockLinear8's torch path).

A tile's super-block holds, for rows 16 t .. 16 t + 15 (the last tile padded with zero rows),
vectors of 64 bytes whose lane r (4 bytes) belongs to row r:
- Q4_K, Q5_K: 32 vectors, v = 8 c + g giving each row's qs[32 c + 4 g .. + 3], whose low
  nibbles are elements 64 c + 4 g .. + 3 (sub-block 2 c) and high nibbles elements 64 c + 32 +
  4 g .. + 3 (sub-block 2 c + 1); Q5_K then 8 vectors, g giving each row's qh[4 g .. 4 g + 3]
  (bit j of qh[l] is the fifth bit of element 32 j + l);
- Q6_K: 64 vectors of whole bytes, v giving each row's q of elements 4 v .. 4 v + 3 (0..63,
  the file's six bits joined): a vector is a load away from the dot, where splitting the
  nibble and two-bit planes each time cost more than the memory it saved (a one-row pass
  was bound by those instructions, not by its bytes);
then the sub-block scales (and Q4_K's and Q5_K's mins), 16 bytes each (byte r: row r's), and
the 16 rows' fp16 d (and dmin). The file's bits in another order, the six-bit fields of Q4_K
and Q5_K unpacked to bytes: per 16 x 256 weights 2,368 bytes for Q4_K (the file's 2,304),
2,880 for Q5_K (2,816) and 4,384 for Q6_K (3,360).
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.backends.native.kernels.int8_reference import SUPERBLOCK_VALUES, _fp16_at
from specdec.backends.native.quant_types import Q, QuantType, quant_type

TILE = 16
QS_BYTES = 32 * 64  # 32 vectors of 64 bytes of nibbles


def whole_bytes(qt: QuantType) -> bool:
    """Whether the tiles hold each weight as a byte (Q6_K) rather than nibbles and high bits."""
    return qt.ggml is Q.Q6_K


def high_bytes(qt: QuantType) -> int:
    """Bytes of the vectors of high bits that follow the nibbles: 16 rows x 256 weights' bits
    above the fourth (Q5_K 512, Q4_K none); for Q6_K's whole bytes, the 2,048 past the first."""
    return QS_BYTES if whole_bytes(qt) else (qt.q_bits - 4) * 256 // 8 * TILE


def scales(qt: QuantType) -> int:
    """Sub-block scales per super-block: 16 for Q6_K, 8 for Q4_K and Q5_K."""
    return 256 // qt.sub_block


def scales_at(qt: QuantType) -> int:
    """Where a tile's super-block holds its sub-block scales (then the mins, d and dmin)."""
    return QS_BYTES + high_bytes(qt)


def tile_bytes(qt: QuantType) -> int:
    fields = 1 + qt.with_min  # sc (and m) per sub-block, d (and dmin) per row
    return scales_at(qt) + fields * (scales(qt) * TILE + 2 * TILE)


def d_at(qt: QuantType) -> int:
    """Where the 16 rows' fp16 d sit (then dmin): after the scales and mins."""
    return scales_at(qt) + (1 + qt.with_min) * scales(qt) * TILE


def repack(raw: np.ndarray, qtype: QuantType, n: int, k: int) -> np.ndarray:
    """The file's super-blocks [N, K // 256 * block bytes] -> tiles [ceil(N / 16), K // 256 *
    tile bytes] uint8 (read-only), 64 tiles at a time (a whole matrix's transients would raise
    glibc's mmap threshold, as kernels/tiles16.py notes)."""
    qt = quant_type(qtype)
    units, tiles = k // 256, -(-n // TILE)
    rows = np.asarray(raw).reshape(n, units, qt.block_bytes)
    out = np.empty((tiles, units, tile_bytes(qt)), np.uint8)
    for first in range(0, tiles, 64):
        _repack_into(out[first : first + 64], rows[first * TILE : (first + 64) * TILE], qt)
    out = out.reshape(tiles, units * tile_bytes(qt))
    out.flags.writeable = False
    return out


def _repack_into(out: np.ndarray, rows: np.ndarray, qt: QuantType) -> None:
    tiles, units, _ = out.shape
    padded = np.zeros((tiles * TILE, units, qt.block_bytes), np.uint8)
    padded[: len(rows)] = rows
    blocks = padded.reshape(tiles, TILE, units, qt.block_bytes)

    def lanes(first: int, count: int) -> np.ndarray:  # bytes first .. + count of each row, 4 a lane
        part = blocks[..., first : first + count].reshape(tiles, TILE, units, count // 4, 4)
        return part.transpose(0, 2, 3, 1, 4).reshape(tiles, units, count * TILE)

    q, sc, mn = SUPERBLOCK_VALUES[qt.ggml](padded)  # [tiles * 16, units, 256 or scales] fp32 of integers
    if whole_bytes(qt):  # q + 32 (0..63) as bytes, 4 a lane: [tiles, units, 64 vectors, 16 rows, 4]
        whole = (q + 32).astype(np.uint8).reshape(tiles, TILE, units, 64, 4).transpose(0, 2, 3, 1, 4)
        out[..., : scales_at(qt)] = whole.reshape(tiles, units, 256 * TILE)
    else:
        out[..., :QS_BYTES] = lanes(qt.block_bytes - 128, 128)
        if high_bytes(qt):
            out[..., QS_BYTES : scales_at(qt)] = lanes(16, high_bytes(qt) // TILE)
    at, count = scales_at(qt), scales(qt)
    for field, values in enumerate((sc, mn)[: 1 + qt.with_min]):  # Q6_K's int8, the others' six bits
        grouped = values.astype(np.int8).reshape(tiles, TILE, units, count).transpose(0, 2, 3, 1)
        out[..., at + count * TILE * field : at + count * TILE * (field + 1)] = grouped.reshape(
            tiles, units, count * TILE).view(np.uint8)
    for field, offset in enumerate(qt.scales_at):  # d (and dmin): the file's fp16 bits
        halves = blocks[..., offset : offset + 2].transpose(0, 2, 1, 3)  # [tiles, units, 16, 2]
        out[..., d_at(qt) + 32 * field : d_at(qt) + 32 * (field + 1)] = halves.reshape(tiles, units, 32)


def unpack(tiles: np.ndarray, qtype: QuantType, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Tiles -> (q [n, S, 256] the file's integers (Q6_K's q - 32), the sub-block scales [n,
    S, 8 or 16], the mins [n, S, 8] or None, d [n, S], dmin [n, S] or None) as fp32: the
    inverse of `repack`; the weights are d sc q (- dmin m)."""
    qt = quant_type(qtype)
    units, count = k // 256, tiles.shape[0]
    t = np.asarray(tiles).reshape(count, units, tile_bytes(qt))

    def rows_bytes(first: int, size: int) -> np.ndarray:  # -> each row's bytes [rows, S, size // 16]
        part = t[..., first : first + size].reshape(count, units, size // 64, TILE, 4)
        return part.transpose(0, 3, 1, 2, 4).reshape(count * TILE, units, size // TILE)

    if whole_bytes(qt):
        q = rows_bytes(0, scales_at(qt)).astype(np.float32) - 32
    else:
        raw = np.zeros((count * TILE, units, qt.block_bytes), np.uint8)
        raw[..., qt.block_bytes - 128 : qt.block_bytes] = rows_bytes(0, QS_BYTES)  # the nibbles
        if high_bytes(qt):
            raw[..., 16 : 16 + high_bytes(qt) // TILE] = rows_bytes(QS_BYTES, high_bytes(qt))
        q = SUPERBLOCK_VALUES[qt.ggml](raw)[0]  # the integers alone: scales and mins come next
    at, per = scales_at(qt), scales(qt)
    fields = [t[..., at + per * TILE * f : at + per * TILE * (f + 1)].view(np.int8)
              .reshape(count, units, per, TILE).transpose(0, 3, 1, 2).reshape(count * TILE, units, per)
              .astype(np.float32) for f in range(1 + qt.with_min)]
    floats = [_fp16_at(t[..., d_at(qt) + 32 * f : d_at(qt) + 32 * (f + 1)].reshape(count, units, TILE, 2), 0)
              .transpose(0, 2, 1).reshape(count * TILE, units) for f in range(1 + qt.with_min)]
    sc, mn = fields[0], fields[1] if qt.with_min else None
    d, dmin = floats[0], floats[1] if qt.with_min else None
    return tuple(None if a is None else a[:n] for a in (q, sc, mn, d, dmin))


def supertile_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, q: torch.Tensor,
                     sc: torch.Tensor, mn: torch.Tensor | None, d: torch.Tensor,
                     dmin: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in PyTorch ops: xq [M, S, 256] (integer-valued fp32), xs [M, S],
    xsum [M, S * 8] -> y [M, n] fp32. Per super-block u the exact integers isum = sum over
    sub-blocks j of sc[j] * (sum of q xq over j) and, with mins, mi = sum over the sub-blocks
    of 32 of m[j] * xsum[j] (below 2^31: exact in float64, then rounded once to fp32 as the
    kernel's int32 -> fp32); then c = c + isum * (d * xs[u]) and cm = cm + mi * (dmin * xs[u])
    in super-block order; y = c - cm, or c."""
    m, units, per = xq.shape[0], xq.shape[1], sc.shape[-1]
    dots = torch.einsum("msje,nsje->mnsj", xq.double().reshape(m, units, per, -1),
                        q.double().reshape(q.shape[0], units, per, -1))
    isum = (dots * sc.double()[None]).sum(-1).float()  # [M, n, S]
    scale = d[None] * xs[:, None]  # [M, n, S]
    c = torch.zeros(isum.shape[:2])
    for u in range(units):
        c = c + isum[..., u] * scale[..., u]
    if mn is None:
        return c
    mi = torch.einsum("msj,nsj->mns", xsum.reshape(m, units, 8).double(), mn.double()).float()
    low, cm = dmin[None] * xs[:, None], torch.zeros(isum.shape[:2])
    for u in range(units):
        cm = cm + mi[..., u] * low[..., u]
    return c - cm
