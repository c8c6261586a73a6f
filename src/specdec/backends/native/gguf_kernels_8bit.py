"""Linear layers over GGUF Q8_0, Q6_K, Q5_K, Q5_0 and Q5_1 matrices (and Q4_0, Q4_1 and Q4_K
where numba runs: gguf_kernels.int8_activation_types), read from the file's own blocks.

`linear_for(tensor, bias)` is the entry point (gguf_kernels.linear_from_quant dispatches these
types to it). No dense float copy of a matrix is made:
- the blocks of 32 (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1) are repacked in tiles of 16 rows
  (gguf_rows16.py: the same bits in another order, scales inside), and the loader drops the
  file's pages of them;
- the K-quants' super-blocks stay the file's bytes (memory-mapped, not copied), plus small
  fp32 tables of their fp16 scales.

Arithmetic (gguf_jit_rows16.py and gguf_jit_8bit.py state it exactly): int8 activations
times the file's integers, as llama.cpp does. The blocks of 32 quantize each row per block of
32 (scale max|x| / 127, llama.cpp's Q8_0 activations); the K-quants per super-block of 256
(scale 1 / (127 / max|x|), llama.cpp's Q8_K). The weights' scales are the file's, exact in
fp32 (d, dmin, m; the K-quants' sub-block scales stay integers), so the weights used equal
the gguf package's reference dequantization as real numbers. The only roundings are the
activations' quantization and the fp32 accumulation. Reduction order, for each output:
- blocks of 32: per block the exact integer sum times (d * xs), added block after block;
  the min term of Q4_1 and Q5_1, (m * xs) * xsum, summed apart and added last (a vector's
  lanes are a tile's 16 rows);
- Q6_K, Q5_K, Q4_K: per super-block 16 exact integer lanes of sc * (sums of four products w xq),
  then one fp32 term (d * xs) * lanes added in super-block order; Q5_K's min term likewise,
  subtracted last. A super-block's unpacked integers are shared by the rows of a pass.
Nothing depends on M or on the thread count: rows share no arithmetic, threads split the
output rows, never a reduction (no split-K). Prompts (any M) run the same kernel, so a row's
bits do not depend on the path.

Kernels, chosen per process (`kernel_name`):
- "numba": gguf_jit_rows16.py and gguf_jit_8bit.py (vpdpbusd with AVX-512 VNNI, pmaddubsw
  on AVX2, plain IR elsewhere: the same integers), compiled by LLVM for this CPU, output
  rows on numba's threads (as many as torch's);
- `OrtBlockLinear8` (gguf_kernels_ort8.py): Q8_0, Q6_K and Q5_0 on ONNX Runtime's 8-bit
  MatMulNBits, exact weights, for the LM head on request (`lm_head=ort8`, gguf_kernels.head_from_quant): flat in rows,
  but it holds about twice the matrix's bytes;
- "torch": the same operations in the same order on PyTorch tensors, tile by tile of output
  rows (transient memory only); bit-identical to "numba", and much slower. Runs where numba
  is not installed or `SPECDEC_CPU_KERNELS=fallback`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.backends.native.cpu import forced_fallback
from specdec.backends.native.gguf_rows16 import OFFSET, ROWS16_TYPES, repack, rows16_matmul, unpack
from specdec.backends.native.gguf_rows16 import TILE as TILE_ROWS
from specdec.backends.native.gguf_tensors import QuantTensor
from specdec.backends.native.jit_ops import importable as numba_importable
from specdec.backends.native.jit_ops import numba_threads

QTYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q4_K")
SMALL_BLOCK_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")  # blocks of 32; the K-quants' are of 256
BLOCK = 32  # activation block of the small-block types (and the lanes' span)
SUPER = 256  # the K-quants' super-block: their activation block
LANES = 16
BLOCK_BYTES = {"Q8_0": 34, "Q6_K": 210, "Q5_K": 176, "Q5_0": 22, "Q5_1": 24, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144}  # per block (of 32 or 256)
TORCH_TILE = 256  # output rows the torch kernel decodes at a time (whole tiles of 16)


def kernel_name() -> str:
    """"numba" where numba imports and the fallback is not forced, else "torch"."""
    return "torch" if forced_fallback() or not numba_importable() else "numba"


def _fp16_at(blocks: np.ndarray, offset: int) -> np.ndarray:
    """blocks [..., width] uint8 -> the fp16 at byte `offset` of each block, as fp32 [...]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


class BlockLinear8(torch.nn.Module):
    """x [M, K] -> y [M, N] = x @ W.T (+ bias) for a matrix W [N, K] of one of QTYPES;
    fp32 activations in, x's dtype out."""

    def __init__(self, tensor: QuantTensor, bias: torch.Tensor | None = None, kernel: str | None = None):
        super().__init__()
        qtype = tensor.qtype.name
        if qtype not in QTYPES:
            raise ValueError(f"BlockLinear8 reads {', '.join(QTYPES)}, not {qtype} (tensor {tensor.name!r})")
        n, k = tensor.shape
        span = BLOCK if qtype in SMALL_BLOCK_TYPES else 256
        if k % span:
            raise ValueError(f"tensor {tensor.name!r}: {qtype} rows of {k} are not whole blocks of {span}")
        self.qtype, self.in_features, self.out_features = qtype, k, n
        self.act_dtype = torch.float32
        self.raw = np.ascontiguousarray(tensor.data).reshape(n, -1)  # [N, bytes per row]: the file's own
        self.bias = None if bias is None else bias.detach().float().cpu()  # [N]
        self.kernel = kernel or kernel_name()
        # what the numba kernel takes, formed once: a call's fixed costs weigh at decode widths
        self.kind, self.small_blocks, self.units = qtype.lower(), span == BLOCK, k // span
        self.tiles = None
        if qtype in ROWS16_TYPES:  # in tiles of 16 rows (gguf_rows16.py), d (m) inside: a copy of the blocks
            self.tiles, self.kind = repack(self.raw, qtype, n, k), qtype.lower() + "x16"
            self.scales = self.table = np.empty((n, 0), np.float32)
            self.raw = None  # the tiles hold the blocks (a joined q/k/v copy is not kept)
            return
        self.scales = scale_table(qtype, self.raw, n, k)
        self.table = self.scales.reshape(n, -1)  # [N, T]: a view

    def nbytes(self) -> int:
        """Bytes this layer holds besides the file's mapping (the scale tables, Q4_0's and Q4_1's tiles, the bias)."""
        held = self.scales.nbytes + (0 if self.tiles is None else self.tiles.nbytes)
        return held + (0 if self.bias is None else self.bias.nbytes)

    @torch.compiler.disable  # numba and numpy: compiled graphs call it eagerly
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.kernel == "numba":
            rows = float_rows(x)
            y = np.empty((rows.shape[0], self.out_features), np.float32)
            self.matmul_into(quantized(rows, self.small_blocks), y, 0)
            y = torch.from_numpy(y)
        else:
            y = self._torch(x.detach().to("cpu", torch.float32).contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def matmul_into(self, activations: tuple, y: np.ndarray, column: int) -> None:
        """The numba kernel on `quantized` activations of this layer's kind, into y[:, column :
        column + N]."""
        if self.tiles is not None:
            xq, xs, xsum, _ = activations
            kind = ROWS16_TYPES.index(self.qtype)
            _rows16_jit().matmul(kind, self.tiles, self.out_features, self.units, xq, xs, xsum, y, column)
            return
        jit = _superblock_jit()
        jit.matmul(jit.KIND_CODES[self.kind], self.raw, self.table, self.units, *activations, y, column)

    def numba_part(self) -> tuple:
        """(kind, raw, table, units): this matrix as the numba matmuls take it (gguf_jit_layer)."""
        if self.tiles is not None:  # the tiles' own code (gguf_jit_layer.linear)
            return ROWS16_TYPES.index(self.qtype), self.tiles, self.table, self.units
        raw = self.raw.view()
        raw.flags.writeable = False  # one type for every part: the file's mapping is read-only
        return _superblock_jit().KIND_CODES[self.kind], raw, self.table, self.units

    def numba_group(self) -> tuple | None:
        """This layer as gguf_jit_layer's linear group (small, parts, bias, width), or None where
        it does not run the numba kernel."""
        if self.kernel != "numba":
            return None
        return self.small_blocks, (self.numba_part(),), _bias_array(self.bias), self.out_features

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiles is not None:
            return self._torch_tiles(x)
        xq, xs, xsum = quantize_activations_k(x)
        tiles = []
        for start in range(0, self.out_features, TORCH_TILE):
            raw, scales = self.raw[start : start + TORCH_TILE], self.scales[start : start + TORCH_TILE]
            tiles.append(superblock_matmul(xq, xs, xsum, *decode_superblocks(self.qtype, raw, scales)))
        return torch.cat(tiles, dim=1)

    def _torch_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """rows16_matmul over the tiles, TORCH_TILE output rows (whole tiles) unpacked at a time."""
        acts, outputs = quantize_activations(x), []
        for start in range(0, self.out_features, TORCH_TILE):
            rows = min(TORCH_TILE, self.out_features - start)
            tiles = self.tiles[start // TILE_ROWS : (start + TORCH_TILE) // TILE_ROWS]
            q, d, m = (None if a is None else torch.from_numpy(a)
                       for a in unpack(tiles, self.qtype, rows, self.in_features))  # fmt: skip
            outputs.append(rows16_matmul(*acts, q, d, m, OFFSET[self.qtype]))
        return torch.cat(outputs, dim=1)


class MixedBlockLinear8(torch.nn.Module):
    """Matrices of different QTYPES over one input, side by side (a Q4_K_M file's Q5_0 q and k
    beside its Q8_0 v): x [M, K] -> [M, sum N]. The input is quantized once, where all parts
    read one activation format (blocks of 32, or super-blocks), and each part's kernel writes
    its columns of one output. Each part's outputs are those it computes alone, bit for bit."""

    def __init__(self, parts: list[BlockLinear8]):
        super().__init__()
        if not self.shares_input(parts):
            raise ValueError("parts of a MixedBlockLinear8 share K, the activation format and the kernel")
        self.parts = parts
        self.in_features, self.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        self.act_dtype, self.kernel = torch.float32, parts[0].kernel
        self.columns = np.cumsum([0] + [p.out_features for p in parts[:-1]]).tolist()
        biases = [p.bias for p in parts]
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.cat([torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases, strict=True)])

    @staticmethod
    def shares_input(parts: list[BlockLinear8]) -> bool:
        """Whether the parts can run as one MixedBlockLinear8."""
        return len({(p.in_features, p.small_blocks, p.kernel) for p in parts}) == 1

    def numba_group(self) -> tuple | None:
        """The parts as gguf_jit_layer's linear group (small, parts, bias, width), or None where
        they do not run the numba kernel."""
        if self.kernel != "numba":
            return None
        parts = tuple(part.numba_part() for part in self.parts)
        return self.parts[0].small_blocks, parts, _bias_array(self.bias), self.out_features

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, sum N]
        if self.kernel != "numba":
            return torch.cat([p.forward(x) for p in self.parts], dim=-1)
        rows = float_rows(x)
        activations, y = quantized(rows, self.parts[0].small_blocks), np.empty((rows.shape[0], self.out_features), np.float32)
        for part, column in zip(self.parts, self.columns, strict=True):
            part.matmul_into(activations, y, column)
        out = torch.from_numpy(y) if self.bias is None else torch.from_numpy(y) + self.bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def _bias_array(bias: torch.Tensor | None) -> np.ndarray:
    return np.empty(0, np.float32) if bias is None else np.ascontiguousarray(bias.numpy(), np.float32)


def float_rows(x: torch.Tensor) -> np.ndarray:
    """x [M, K] as a C-contiguous fp32 array on the CPU: a view where it already is one (the
    usual case; each tensor operation costs about a microsecond at decode widths)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or not x.is_contiguous():
        x = x.detach().to("cpu", torch.float32).contiguous()
    return x.numpy()


def quantized(x: np.ndarray, small_blocks: bool) -> tuple[np.ndarray, ...]:
    """x [M, K] fp32 -> (xq [M, K] int8, xs [M, K // span] fp32, xsum [M, K // 32] and xsum4
    [M, K // 4] int32: the sums of each block's and each four's xq), the activations the numba
    kernels read, per block of 32 (small-block kinds) or per super-block of 256 (K-quants),
    gguf_jit_quant's rounding."""
    m, k = x.shape
    span = BLOCK if small_blocks else SUPER
    xq, xs = np.empty((m, k), np.int8), np.empty((m, k // span), np.float32)
    xsum, xsum4 = np.empty((m, k // BLOCK), np.int32), np.empty((m, k // 4), np.int32)
    (_quantizer().quantize_rows if small_blocks else _quantizer().quantize_rows_k)(x, xq, xs, xsum, xsum4)
    return xq, xs, xsum, xsum4


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 32, 32] integer-valued fp32, xs [M, K // 32], xsum [M, K // 32]),
    the operations of gguf_jit_quant.quantize_rows."""
    blocks = x.reshape(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / torch.where(d > 0, d, 1), 0)
    xq = torch.round(blocks * inv[..., None])  # half to even, as np.rint
    return xq, d, xq.sum(-1)


def quantize_activations_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 -> (xq [M, K // 256, 256] integer-valued fp32, xs [M, K // 256], xsum
    [M, K // 32]), the operations of gguf_jit_quant.quantize_rows_k (llama.cpp's Q8_K)."""
    blocks = x.reshape(x.shape[0], -1, SUPER)
    amax = blocks.abs().amax(-1)
    # tensor / tensor: a scalar's `127 / t` is 127 * (1 / t), rounded twice
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / torch.where(amax > 0, amax, 1), 0)
    xq = torch.round(blocks * inv[..., None])  # half to even, as np.rint
    xs = torch.where(amax > 0, torch.ones_like(inv) / torch.where(amax > 0, inv, 1), 0)
    return xq, xs, xq.reshape(x.shape[0], -1, BLOCK).sum(-1)


def decode_superblocks(qtype: str, raw: np.ndarray, scales: np.ndarray) -> tuple:
    """Rows of Q6_K or Q5_K super-blocks -> (w [n, S, 256] the file's integers, sc [n, S, 256]
    each element's integer sub-block scale, d [n, S], and for Q5_K (m [n, S, 8] the integer
    mins, dmin [n, S]), else None), as tensors; weight = d * sc * w (- dmin * m)."""
    n = raw.shape[0]
    if qtype == "Q6_K":
        b = raw.reshape(n, -1, 210)
        sc = np.repeat(b[..., 192:208].view(np.int8).astype(np.float32), 16, axis=-1)  # [n, S, 256]
        tensors = (_q6_k_values(b), sc, scales)
        return (*(torch.from_numpy(np.ascontiguousarray(t)) for t in tensors), None)
    values = _q5_k_values if qtype == "Q5_K" else _q4_k_values
    q, sc, mn = values(raw.reshape(n, -1, BLOCK_BYTES[qtype]))
    tensors = (q, np.repeat(sc, 32, axis=-1), scales[..., 0])
    return (*(torch.from_numpy(np.ascontiguousarray(t)) for t in tensors),
            (torch.from_numpy(mn), torch.from_numpy(np.ascontiguousarray(scales[..., 1]))))  # fmt: skip


def superblock_matmul(xq: torch.Tensor, xs: torch.Tensor, xsum: torch.Tensor, w: torch.Tensor, sc: torch.Tensor,
                      d: torch.Tensor, minimum: tuple | None) -> torch.Tensor:
    """The super-block kernels' arithmetic in PyTorch ops: xq [M, S, 256] -> y [M, n] fp32.
    Each lane's integer sum (lane j: elements 4j .. 4j + 3 of each chunk of 64) is below 2^31,
    exact in float64 whatever the order, then rounded once to fp32 (as the kernels' int32 ->
    fp32); the sums over super-blocks and then lanes run in the kernels' order."""
    lanes = torch.einsum("mscla,nscla->mnsl", xq.double().reshape(*xq.shape[:2], 4, LANES, 4),
                         (w * sc).double().reshape(*w.shape[:2], 4, LANES, 4)).float()  # [M, n, S, 16]
    scale = d[None] * xs[:, None]  # [M, n, S]
    c = torch.zeros(*lanes.shape[:2], LANES)
    for u in range(lanes.shape[2]):
        c = c + scale[..., u, None] * lanes[..., u, :]
    y = c[..., 0]
    for lane in range(1, LANES):
        y = y + c[..., lane]
    if minimum is None:
        return y
    mn, dmin = minimum
    imin = torch.einsum("msj,nsj->mns", xsum.reshape(xsum.shape[0], -1, 8).double(), mn.double()).float()
    low, mins = dmin[None] * xs[:, None], torch.zeros_like(y)
    for u in range(imin.shape[2]):
        mins = mins + low[..., u] * imin[..., u]
    return y - mins


def scale_table(qtype: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """The fp32 scales of a Q8_0, Q6_K, Q5_0, Q5_K or Q4_K matrix's blocks raw [N, bytes per
    row]: d [N, K // 32] (Q8_0) or [N, K // 256] (Q6_K); [N, K // 32, 1] d (Q5_0); [N, K //
    256, 2] d and dmin (Q5_K, Q4_K)."""
    span = BLOCK if qtype in SMALL_BLOCK_TYPES else SUPER
    blocks = raw.reshape(n, k // span, BLOCK_BYTES[qtype])
    if qtype == "Q8_0":
        return _fp16_at(blocks, 0)
    if qtype == "Q6_K":
        return _fp16_at(blocks, 208)
    if qtype == "Q5_0":
        return np.ascontiguousarray(_fp16_at(blocks, 0)[..., None])
    return np.ascontiguousarray(np.stack([_fp16_at(blocks, 0), _fp16_at(blocks, 2)], axis=-1))


def decode_integers(qtype: str, raw: np.ndarray, scales: np.ndarray) -> tuple:
    """Rows of raw Q8_0, Q5_0, Q6_K, Q5_K or Q4_K blocks, with their `scale_table` -> (w [n,
    K // 32, 32] the file's integers as fp32, scale_lo and scale_hi [n, K // 32] the scales of
    each 32's first and last 16 elements, offset [n, K // 32] or None): w * scale - offset
    are the file's weights (gguf_kernels_ort8 and the tests read them so)."""
    n = raw.shape[0]
    if qtype == "Q8_0":
        q = raw.reshape(n, -1, 34)[..., 2:].view(np.int8).astype(np.float32)
        return q, scales, scales, None
    if qtype == "Q5_0":
        q = _q5_values(raw.reshape(n, -1, BLOCK_BYTES[qtype]))
        return q - 16, scales[..., 0].copy(), scales[..., 0].copy(), None
    if qtype == "Q6_K":
        b = raw.reshape(n, -1, 210)
        q = _q6_k_values(b)
        sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [n, S, 16]
        scale = (scales[..., None] * sc).reshape(n, -1, 2)  # [n, K // 32, 2]: per sub-block of 16
        return q.reshape(n, -1, 32), scale[..., 0].copy(), scale[..., 1].copy(), None
    q, sc, mn = (_q5_k_values if qtype == "Q5_K" else _q4_k_values)(raw.reshape(n, -1, BLOCK_BYTES[qtype]))
    scale = (scales[..., 0:1] * sc).reshape(n, -1)
    offset = (scales[..., 1:2] * mn).reshape(n, -1)
    return q.reshape(n, -1, 32), scale, scale, offset


def _q6_k_values(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, S, 210] -> q - 32 [n, S, 256] fp32 (element h*128 + t*32 + l: nibble
    t // 2 of ql[h*64 + (t % 2)*32 + l], bit pair t of qh[h*32 + l])."""
    ql = b[..., :128].reshape(*b.shape[:2], 2, 2, 32)  # [n, S, half, t % 2, l]
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)  # [n, S, half, 1, l]
    low = np.concatenate([ql & 15, ql >> 4], axis=-2)  # [n, S, half, t, l], t = 0..3
    high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
    return ((low | (high << 4)).astype(np.float32) - 32).reshape(*b.shape[:2], 256)


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


def linear_for(tensor: QuantTensor, bias: torch.Tensor | None = None) -> BlockLinear8:
    """The layer for a matrix [N, K] of one of QTYPES, on this process's kernel."""
    return BlockLinear8(tensor, bias)


@functools.cache
def _superblock_jit():
    numba_threads()  # the threading layer and count, before the first parallel launch
    import specdec.backends.native.gguf_jit_8bit as jit  # compiles, or loads from disk

    return jit


@functools.cache
def _rows16_jit():
    numba_threads()
    import specdec.backends.native.gguf_jit_rows16 as jit  # compiles, or loads from disk

    return jit


@functools.cache
def _quantizer():
    import specdec.backends.native.gguf_jit_quant as quant  # compiles, or loads from disk

    return quant
