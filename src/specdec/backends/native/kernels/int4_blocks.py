"""Linear layers over a GGUF's 4-bit family (Q4_0, Q4_1, Q4_K), built from the file's blocks.

Every one of these formats is, per group of 32 weights along K, w = (q - offset) * a + b with
q in 0..15 and fp32 a, b decoded from the block's fp16 fields (`decode_rows`):
- Q4_0: w = (q - 8) * d;
- Q4_1: w = q * d + m;
- Q4_K: each super-block of 256 holds 8 sub-blocks of 32, w = q * (d * sc) - dmin * m, with
  6-bit sc and m (the gguf package's own `get_scale_min` unpacks them).

Layers (the dispatch is gguf/layers.build_linear's; where numba runs, all three types take
kernels/int8_blocks.py's kernels instead, int8 activations times the file's blocks, and these
layers serve the fallback and SPECDEC_CPU_KERNELS=fallback):
- `Int4BlockLinear` (default where PyTorch's CPU int4 kernel runs): the blocks repacked, tile
  by tile, into `_weight_int4pack_mm_for_cpu`'s format, w = (q - 8) * scale + zero with bf16
  scale and zero. That kernel stores bf16, so the weights are the file's up to the bf16
  rounding of scale (a) and zero (b + 8 a): a relative 2^-9 of each. tests/test_gguf_kernels.py
  bounds the effect on outputs (top-1 and KL against the exact dequantization).
- `ExactQ4Linear` (the fallback, and SPECDEC_CPU_KERNELS=fallback): the nibbles in the file's
  Q4_0 byte order plus fp32 a and b, dequantized a tile of rows at a time in exactly the gguf
  reference's arithmetic, then one fp32 matrix-vector product per activation row. Pure PyTorch.

Reduction order (what makes a row's bits independent of the batch and of the thread count):
- int4 kernel: each output (m, n) is one dot product over K in K order, per group of 32 in
  fp32; the kernel splits work over N (and M), never over K. The tests check both properties.
- `tile_forward` of `Int4BlockLinear` (the prompt kernel where `prompt_tiles`): a tile of
  512 output rows at a time is decoded from the packed weights to bf16 (the int4 kernel's own
  scale and zero, one more rounding to bf16; numba's jit/int4_unpack.py, or its
  PyTorch replica) and multiplied by oneDNN's bf16 GEMM on one thread (cpu.one_thread_mm: on
  an AMX Xeon a GEMM's order over K changed with the thread count), which computes each
  output over K in one order for any M on the CPUs tested (checked at start-up and by the
  tests, not assumed).
- `ExactQ4Linear`: a matrix-vector product per activation row (one row never shares a call).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from gguf.quants import Q4_K

from specdec.backends.native.kernels.cpu import (
    cpu_features,
    forced_fallback,
    gemm_rows_independent,
    one_thread_mm,
)
from specdec.backends.native.kernels.numba_ops import importable as numba_importable
from specdec.backends.native.kernels.numba_ops import numba_threads
from specdec.backends.native.kernels.precisions import INT4_GROUP, Int4Linear
from specdec.backends.native.quant_types import Family, QuantType, quant_type

PACK_ROWS = 1024  # rows repacked at a time (a multiple of the kernel's 64-row blocks)
PROMPT_TILE = 512  # output rows decoded to bf16 at a time by prompt_forward
GEMV_TILE = 256  # rows dequantized to fp32 at a time by ExactQ4Linear


def decode_rows(qtype: QuantType, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Rows of the file's blocks [n, bytes per row] of a 4-bit type -> (q [n, K] uint8 in 0..15,
    a [n, K // 32] fp32, b [n, K // 32] fp32, offset) with w = (q - offset) * a + b per group
    of 32."""
    qt, n = quant_type(qtype), data.shape[0]
    raw = np.ascontiguousarray(data)
    if not qt.four_bit:
        raise ValueError(f"not a 4-bit type: {qt.name}")
    if qt.family is Family.BLOCKS32:
        blocks = raw.reshape(n, -1, qt.block_bytes)  # [n, G, width]
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, G]
        qs = blocks[..., qt.block_bytes - 16 :]  # byte j: element j (low nibble), j + 16 (high)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
        if not qt.with_min:  # Q4_0
            return q, d, np.zeros_like(d), qt.offset
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        return q, d, m, 0
    # Q4_K [n * S, 144]: d, dmin (fp16), 12 bytes of scales, 128 of nibbles
    blocks = raw.reshape(-1, qt.block_bytes)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n * S, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [n * S, 8] each, 6-bit
    a = (d * sc.astype(np.float32)).reshape(n, -1)  # [n, G]: the reference's d * sc
    b = -(dmin * mn.astype(np.float32)).reshape(n, -1)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 64 elements per 32 bytes: low nibbles first
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(n, -1)
    return q, a, b, 0


class Int4BlockLinear(Int4Linear):
    """A 4-bit GGUF matrix on PyTorch's int4 kernel (bf16 scales; see the module docstring)."""

    @classmethod
    def from_blocks(cls, qtype: QuantType, data: np.ndarray, k: int,
                    bias: torch.Tensor | None = None) -> Int4BlockLinear:
        """data: the file's rows [N, bytes per row] of `qtype`; k: the row length in weights."""
        n = data.shape[0]
        padded = n + (-n % 64)  # whole 64-row blocks, so that tiles' packs concatenate
        packs, scales, zeros = [], [], []
        for start in range(0, padded, PACK_ROWS):
            stop = min(start + PACK_ROWS, padded)
            q, a, b, offset = decode_rows(qtype, data[start : min(stop, n)])
            scale, zero = a, b + (8 - offset) * a  # (q - 8) * scale + zero; rounded to bf16 below
            if stop > n:  # padding rows: weight 0
                pad = stop - min(stop, n)
                q = np.concatenate([q, np.full((pad, k), 8, np.uint8)])
                scale, zero = np.pad(scale, ((0, pad), (0, 0))), np.pad(zero, ((0, pad), (0, 0)))
            q32 = torch.from_numpy(q.astype(np.int32))  # [rows, K], transient
            packs.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q32, 1))
            scales.append(torch.from_numpy(scale))
            zeros.append(torch.from_numpy(zero))
        scales_and_zeros = torch.stack([torch.cat(scales).T, torch.cat(zeros).T], dim=-1)  # [G, N padded, 2]
        return cls.from_packed(torch.cat(packs), scales_and_zeros.to(torch.bfloat16).contiguous(), n, bias)

    def prompt_forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        """Prompt rows (up to a whole prompt's chunks at once, see CachePool.forward_prompt):
        bf16 tiles and a GEMM, which keep many rows far cheaper than the int4 kernel does,
        where `prompt_tiles`; else the int4 kernel itself."""
        return self.tile_forward(x) if prompt_tiles() else self.forward(x)

    def tile_forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        """bf16 tiles decoded from the packed weights, each multiplied by a bf16 GEMM."""
        if not packed_layout_known():
            return self.forward(x)
        xb = x.to(torch.bfloat16)
        packed, scales_and_zeros = self.packed, self.scales_and_zeros
        out = torch.empty(x.shape[0], packed.shape[0], dtype=torch.bfloat16)  # [M, N padded]
        unpack = _unpack_kernel()
        for start in range(0, packed.shape[0], PROMPT_TILE):
            stop = min(start + PROMPT_TILE, packed.shape[0])
            w_t = unpack(packed[start:stop], scales_and_zeros[:, start:stop])  # [K, rows] bf16
            one_thread_mm(xb, w_t, out[:, start:stop])  # the same bits at any thread count
        y = out[:, : self.out_features].to(x.dtype)
        return y if self.bias is None else y + self.bias


def unpack_tile(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The kernel's packed rows [rows, K / 2] (whole 64-row blocks: [block, K, 32] bytes, byte j
    holding row j low and row j + 32 high) and their [G, rows, 2] -> weights [rows, K] bf16."""
    rows, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(rows // 64, k, 32)
    q = (torch.cat([blocks & 0x0F, blocks >> 4], dim=2).transpose(1, 2)
         .reshape(rows, k // INT4_GROUP, INT4_GROUP))
    scale = scales_and_zeros[..., 0].T.float()[..., None]  # [rows, G, 1]: broadcast, not repeated
    zero = scales_and_zeros[..., 1].T.float()[..., None]
    w = q.float().sub_(8).mul_(scale).add_(zero)  # [rows, G, 32] fp32
    return w.to(torch.bfloat16).reshape(rows, k)


def unpack_tile_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """`unpack_tile`, transposed: [K, rows] bf16, the GEMM's layout for its second operand."""
    return unpack_tile(packed, scales_and_zeros).T.contiguous()


def unpack_tile_t_jit(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """`unpack_tile_t` on numba's threads (jit/int4_unpack.py), bit for bit the same."""
    from specdec.backends.native.kernels.jit.int4_unpack import int4_tile_bf16_t

    rows, k = packed.shape[0], packed.shape[1] * 2
    scale = scales_and_zeros[..., 0].float().contiguous()  # [G, rows]
    zero = scales_and_zeros[..., 1].float().contiguous()
    out = torch.empty(k, rows, dtype=torch.bfloat16)
    int4_tile_bf16_t(packed.view(rows // 64, k, 32).numpy(), scale.numpy(), zero.numpy(),
                     out.view(torch.uint16).numpy())
    return out


@functools.cache
def prompt_tiles() -> bool:
    """Whether prompts multiply bf16 tiles: where the CPU multiplies bf16 natively (AVX2
    emulates it, slower than the int4 kernel) and its bf16 GEMM computes a row the same in any
    row count, so that a row's bits do not depend on its prompt's other rows."""
    native = {"amx_bf16", "avx512_bf16"} & cpu_features()
    return bool(native) and not forced_fallback() and gemm_rows_independent(torch.bfloat16)


def _unpack_kernel():
    """numba's unpacking where it runs (the same bits), PyTorch's otherwise."""
    if forced_fallback() or not numba_importable():
        return unpack_tile_t
    numba_threads()  # the threading layer and count, before the first parallel launch
    return unpack_tile_t_jit


@functools.cache
def packed_layout_known() -> bool:
    """Whether this PyTorch build packs int4 weights the way unpack_tile reads them (checked
    once on random values; where not, prompts run on the int4 kernel itself)."""
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    if packed.dtype != torch.uint8 or tuple(packed.shape) != (128, 32):
        return False
    ones = torch.zeros(2, 128, 2, dtype=torch.bfloat16)
    ones[..., 0] = 1.0
    ones[..., 1] = 8.0  # w = q exactly
    return torch.equal(unpack_tile(packed, ones).float(), q.float())


class ExactQ4Linear(torch.nn.Module):
    """A 4-bit GGUF matrix in pure PyTorch with the file's exact fp32 scales (see the module
    docstring): nibbles [N, K / 2] uint8 (byte 16 g + j: element 32 g + j low, 32 g + 16 + j
    high), a and b [N, K // 32] fp32."""

    def __init__(self, qtype: QuantType, data: np.ndarray, k: int, bias: torch.Tensor | None = None):
        super().__init__()
        n = data.shape[0]
        nibbles, a_parts, b_parts = [], [], []
        for start in range(0, n, PACK_ROWS):
            q, a, b, self.offset = decode_rows(qtype, data[start : start + PACK_ROWS])
            grouped = q.reshape(q.shape[0], -1, 2, 16)  # [rows, G, halves, 16]
            nibbles.append(torch.from_numpy(
                (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(q.shape[0], -1)))
            a_parts.append(torch.from_numpy(a))
            b_parts.append(torch.from_numpy(b))
        self.register_buffer("nibbles", torch.cat(nibbles), persistent=False)  # [N, K / 2]
        self.register_buffer("a", torch.cat(a_parts), persistent=False)  # [N, G]
        self.register_buffer("b", torch.cat(b_parts), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = n, torch.float32

    def tile(self, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop dequantized as the gguf reference does, bit for bit: [rows, K] fp32."""
        nib = self.nibbles[start:stop].view(stop - start, -1, 16)  # [rows, G, 16]
        q = torch.cat([nib & 0x0F, nib >> 4], dim=2).float()  # [rows, G, 32]
        if self.offset:
            q = q - self.offset
        w = torch.mul(q, self.a[start:stop, :, None])  # separate multiply and add, as numpy does
        return torch.add(w, self.b[start:stop, :, None]).reshape(stop - start, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        xf = x.float()
        out = torch.empty(x.shape[0], self.out_features)
        for start in range(0, self.out_features, GEMV_TILE):
            stop = min(start + GEMV_TILE, self.out_features)
            w = self.tile(start, stop)
            for m in range(x.shape[0]):  # one row per product: no row shares a reduction
                torch.mv(w, xf[m], out=out[m, start:stop])
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype)

    def prompt_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)
