"""Encoding floats into GGUF block formats, for synthetic model files (tests, scripts).

The gguf package quantizes F32/F16/BF16/Q8_0/Q4_0/Q4_1 itself; the K-quants (Q4_K, Q5_K,
Q6_K) are encoded here, vectorized over all blocks at once. An encoder need not be optimal,
only valid: the gguf package's `dequantize` of its bytes is the model's weights.

The K-quants cut each row into super-blocks of 256 (llama.cpp's block_q4_K, block_q5_K,
block_q6_K):
- Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks
  of 32, then 128 bytes of nibbles; w = d * sc * q - dmin * m, q in 0..15;
- Q5_K (176 bytes): as Q4_K with 32 bytes of fifth bits (bit i of byte l: element l of
  sub-block i) before the nibbles; q in 0..31;
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales
  (one per sub-block of 16), fp16 d; w = d * sc * (q - 32), q in 0..63.
Scales come from each sub-block's range (min/max), not a least-squares fit.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

QK_K = 256  # elements per K-quant super-block


def quantize_blocks(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """x [N, K] fp32 -> the file's bytes for `qtype`: [N, bytes per row] uint8 for block
    types, [N, K] of the float type otherwise."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    encoder = {"Q4_K": _encode_q4_k, "Q5_K": _encode_q5_k, "Q6_K": _encode_q6_k}.get(qtype.name)
    if encoder is None:
        return gguf_quants.quantize(x, qtype)
    if x.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K} elements, got {x.shape[-1]}")
    blocks = encoder(x.reshape(-1, QK_K))  # [B, bytes per block]
    return blocks.reshape(*x.shape[:-1], -1)


def _fp16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [..., 2] uint8, the same value as fp32)."""
    half = v.astype(np.float16)
    return half[..., None].view(np.uint8), half.astype(np.float32)


def _range_quantize(blocks: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K's asymmetric sub-blocks: blocks [B, 256] -> (d, dmin fp16 bytes [B, 2] each,
    sc, m [B, 8] in 0..63, q [B, 8, 32] in 0..levels)."""
    sub = blocks.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [B, 8]; the format's minimum is never positive
    scale, mins = (sub.max(-1) - lo) / levels, -lo
    d_bytes, d = _fp16(scale.max(-1) / 63)  # [B]
    dmin_bytes, dmin = _fp16(mins.max(-1) / 63)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.clip(np.rint(scale / d[:, None]), 0, 63), 0).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.clip(np.rint(mins / dmin[:, None]), 0, 63), 0).astype(np.uint8)
        step = (d[:, None] * sc)[..., None]  # [B, 8, 1], the reference decoder's fp32 products
        offset = (dmin[:, None] * m)[..., None]
        q = np.where(step > 0, np.clip(np.rint((sub + offset) / step), 0, levels), 0).astype(np.uint8)
    return d_bytes, dmin_bytes, sc, m, q


def pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and 8 six-bit mins [B, 8] -> llama.cpp's 12 bytes [B, 12]
    (get_scale_min_k4): bytes 0-3 hold sc 0-3 and the top bits of sc 4-7, bytes 4-7 the same
    for the mins, bytes 8-11 the low nibbles of sc 4-7 (low) and m 4-7 (high)."""
    first = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    second = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    third = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    return np.concatenate([first, second, third], axis=1).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [B, 8, 32] -> [B, 128]: byte 32 j + l holds sub-block 2j (low nibble) and 2j+1 (high)."""
    pairs = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _range_quantize(blocks, 15)
    return np.concatenate([d, dmin, pack_scale_min(sc, m), _nibbles(q)], axis=1)


def _encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _range_quantize(blocks, 31)
    fifth = (q >> 4).astype(np.uint8)  # [B, 8, 32]
    qh = np.bitwise_or.reduce(fifth << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)  # [B, 32]
    return np.concatenate([d, dmin, pack_scale_min(sc, m), qh, _nibbles(q)], axis=1)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    sub = blocks.reshape(-1, 16, 16)
    # each sub-block's scale maps its largest magnitude to -32 (the wider side of -32..31)
    peak = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]  # [B, 16], signed
    scale = peak / -32
    widest = np.take_along_axis(scale, np.abs(scale).argmax(-1)[:, None], -1)[:, 0]  # [B]
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(widest != 0, -128 / widest, 0)
        sc = np.clip(np.rint(inverse[:, None] * scale), -128, 127).astype(np.int8)  # [B, 16]
        d_bytes, d = _fp16(np.where(inverse != 0, 1 / inverse, 0))
        step = (d[:, None] * sc)[..., None]  # [B, 16, 1]
        q = np.where(step != 0, np.clip(np.rint(sub / step), -32, 31), 0)
    q = (q + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [B, half, quarter, l]
    ql = (q[:, :, 0:2] & 0x0F) | ((q[:, :, 2:4] & 0x0F) << 4)  # [B, 2, 2, 32]: quarters 0|2, 1|3
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)  # [B, 2, 32]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)
