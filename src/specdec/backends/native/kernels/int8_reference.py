"""The int8 activations of the numba kernels in PyTorch, operation for operation (jit/activations.py
states them; the tests hold the two to the same bits), and the decoders of the file's blocks into
their integers and scales. BlockLinear8's "torch" kernel quantizes with these where numba does not
run (the tiles' replicas are in tiles16.py and supertiles.py); kernels/int8_ort.py, supertiles.py
and the tests read the decoders."""

from __future__ import annotations

import numpy as np
import torch

from specdec.backends.native.quant_types import Family, Q, QuantType, quant_type

BLOCK = 32  # the blocks of 32's activation block (and the lanes' span)
SUPER = 256  # the K-quants' super-block: their activation block


def _fp16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """blocks [..., width] uint8 -> the fp16 at byte `offset` of each block, as fp32 [...]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 32, 32] integer-valued fp32, xs [M, K // 32], xsum [M, K // 32]),
    the operations of jit/activations.quantize_rows."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    xq = torch.round(blocks * inv[..., None])  # half to even, as np.rint
    return xq, d, xq.sum(-1)


def quantize_activations_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 256, 256] integer-valued fp32, xs [M, K // 256], xsum
    [M, K // 32]), the operations of jit/activations.quantize_rows_k (llama.cpp's Q8_K)."""
    blocks = x.reshape(x.shape[0], -1, SUPER)
    amax = blocks.abs().amax(-1)
    # tensor / tensor: a scalar's `127 / t` is 127 * (1 / t), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / torch.where(amax > 0, amax, 1), 0)
    xq = torch.round(blocks * inv[..., None])  # half to even, as np.rint
    xs = torch.where(amax > 0, torch.ones_like(inv) / torch.where(amax > 0, inv, 1), 0)
    return xq, xs, xq.reshape(x.shape[0], -1, BLOCK).sum(-1)


def scale_table(qtype: QuantType, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The fp32 values of the fp16 scales of a matrix's blocks raw [N, bytes per row]: [N,
    blocks, fields], the fields at the record's `scales_at` (d, then m or dmin)."""
    qt = quant_type(qtype)
    blocks = raw.reshape(n, k // qt.block, qt.block_bytes)
    return np.ascontiguousarray(np.stack([_fp16_at(blocks, at) for at in qt.scales_at], axis=-1))


def decode_integers(qtype: QuantType, raw: np.ndarray, scales: np.ndarray) -> tuple:
    """Rows of raw Q8_0, Q5_0 or super-blocks, with their `scale_table` -> (w [n, K // 32, 32]
    the file's integers as fp32, scale_lo and scale_hi [n, K // 32] the scales of each 32's
    first and last 16 elements, offset [n, K // 32] or None): w * scale - offset are the
    file's weights (kernels/int8_ort.py and the tests read them so)."""
    qt, n = quant_type(qtype), raw.shape[0]
    blocks = raw.reshape(n, -1, qt.block_bytes)
    if qt.ggml is Q.Q8_0:
        return blocks[..., 2:].view(np.int8).astype(np.float32), scales[..., 0], scales[..., 0], None
    if qt.ggml is Q.Q5_0:
        return _q5_values(blocks) - 16, scales[..., 0].copy(), scales[..., 0].copy(), None
    if qt.family is not Family.SUPERBLOCKS:
        raise ValueError(f"decode_integers reads Q8_0, Q5_0 and super-blocks, not {qt.name}")
    q, sc, mn = SUPERBLOCK_VALUES[qt.ggml](blocks)
    scale = scales[..., 0:1] * sc  # [n, S, sub-blocks]
    if sc.shape[-1] == 16:  # Q6_K: a scale per 16, two per 32
        scale = scale.reshape(n, -1, 2)
        lo, hi = scale[..., 0].copy(), scale[..., 1].copy()
    else:
        lo = hi = scale.reshape(n, -1)
    offset = None if mn is None else (scales[..., 1:2] * mn).reshape(n, -1)
    return q.reshape(n, -1, 32), lo, hi, offset


def _q6_k_values(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q6_K blocks [n, S, 210] -> (q - 32 [n, S, 256] fp32 (element h*128 + t*32 + l: nibble
    t // 2 of ql[h*64 + (t % 2)*32 + l], bit pair t of qh[h*32 + l]), the int8 scales of its
    sub-blocks of 16 [n, S, 16] as fp32, no mins)."""
    ql = b[..., :128].reshape(*b.shape[:2], 2, 2, 32)  # [n, S, half, t % 2, l]
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)  # [n, S, half, 1, l]
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [n, S, half, t, l], t = 0..3
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    q = ((low | (high << 4)).astype(np.float32) - 32).reshape(*b.shape[:2], 256)
    return q, b[..., 192:208].view(np.int8).astype(np.float32), None


def _q5_values(b: np.ndarray) -> np.ndarray:
    """Q5_0 blocks [n, B, 22] -> q [n, B, 32] fp32 (0..31): element j < 16 is the
    low nibble of qs[j], element j + 16 its high nibble; its fifth bit is bit j of the
    little-endian uint32 qh (the 4 bytes before the 16 of qs, which end the block)."""
    qs = b[..., -16:]
    qh = b[..., -20:-16]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [n, B, 32]
    high = (qh[..., np.arange(32) // 8] >> (np.arange(32) % 8).astype(np.uint8)) & 1
    return (low | (high << 4)).astype(np.float32)


def _k_scales_mins(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q5_K / Q4_K blocks [n, S, width] -> their six-bit sc and m [n, S, 8] as fp32."""
    s = b[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes of a K-quant's nibbles [n, S, 128] -> [n, S, 8, 32]: sub-block 2j the low
    nibbles of bytes 32j .. 32j + 31, 2j + 1 their high nibbles."""
    qs = qs.reshape(*qs.shape[:2], 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*qs.shape[:2], 8, 32)


def _q5_k_values(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K blocks [n, S, 176] -> (q [n, S, 256], sc and m [n, S, 8]) as fp32."""
    low = _k_nibbles(b[..., 48:176])
    high = (b[..., 16:48][..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [n, S, 8, 32]
    q = (low | (high << 4)).astype(np.float32).reshape(*b.shape[:2], 256)
    return (q, *_k_scales_mins(b))


def _q4_k_values(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K blocks [n, S, 144] -> (q [n, S, 256], sc and m [n, S, 8]) as fp32."""
    return (_k_nibbles(b[..., 16:144]).astype(np.float32).reshape(*b.shape[:2], 256), *_k_scales_mins(b))


# each super-block type's decoder: blocks [n, S, bytes] -> (q [n, S, 256], sub-block scales, mins or None)
SUPERBLOCK_VALUES = {Q.Q6_K: _q6_k_values, Q.Q5_K: _q5_k_values, Q.Q4_K: _q4_k_values}
