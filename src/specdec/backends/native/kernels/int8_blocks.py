"""Linear layers over GGUF's quantized matrices on int8 activations (quant_types.QUANTIZED: the
blocks of 32 and the K-quants' super-blocks; the 4-bit types only where numba runs, see
gguf/layers.py), read from the file's own blocks.

`linear_for(tensor, bias)` is the entry point (gguf/layers.py dispatches these types to it).
No dense float copy of a matrix is made: the blocks are repacked in tiles of 16 rows, their
scales inside (kernels/tiles16.py for the blocks of 32, kernels/supertiles.py for the
K-quants: the file's bits in another order), and the loader drops the file's pages of them.

Arithmetic (jit/tiles16.py and jit/supertiles.py state it exactly): int8 activations times
the file's integers, as llama.cpp does. The blocks of 32 quantize each row per block of 32
(scale max|x| / 127, llama.cpp's Q8_0 activations); the K-quants per super-block of 256
(scale 1 / (127 / max|x|), llama.cpp's Q8_K). The weights' scales are the file's, exact in
fp32 (d, dmin, m; the K-quants' sub-block scales stay integers), so the weights used equal
the gguf package's reference dequantization as real numbers. The only roundings are the
activations' quantization and the fp32 accumulation. Reduction order, for each output:
- blocks of 32: per block the exact integer sum times (d * xs), added block after block;
  the min term of Q4_1 and Q5_1, (m * xs) * xsum, summed apart and added last;
- Q6_K, Q5_K, Q4_K: per super-block the exact integer sum of its sub-blocks' sums times their
  integer scales, times (d * xs), added super-block after super-block; the min term of Q5_K
  and Q4_K likewise, subtracted last.
A vector's lanes are a tile's 16 rows. Nothing depends on M or on the thread count: rows
share no arithmetic, threads split the tiles, never a reduction (no split-K). Prompts (any
M) run the same kernel, so a row's bits do not depend on the path.

Kernels, chosen per process (`kernel_name`):
- "numba": jit/tiles16.py and jit/supertiles.py (vpdpbusd with AVX-512 VNNI, pmaddubsw on
  AVX2, plain IR elsewhere: the same integers), compiled by LLVM for this CPU, tiles on
  numba's threads (as many as torch's);
- "torch": the same operations in the same order on PyTorch tensors (tiles16.py's and
  supertiles.py's replicas), TORCH_TILE output rows at a time (transient memory only);
  bit-identical to "numba", and much slower. Runs where numba is not installed or
  `SPECDEC_CPU_KERNELS=fallback`.
kernels/int8_ort.py holds the ONNX Runtime alternative for an LM head (`lm_head=ort8`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.backends.native.kernels import supertiles
from specdec.backends.native.kernels.cpu import eager_in_graphs, forced_fallback
from specdec.backends.native.kernels.int8_reference import (
    BLOCK,
    SUPER,
    quantize_activations,
    quantize_activations_k,
)
from specdec.backends.native.kernels.numba_ops import importable as numba_importable
from specdec.backends.native.kernels.numba_ops import numba_threads
from specdec.backends.native.kernels.tiles16 import TILE as TILE_ROWS
from specdec.backends.native.kernels.tiles16 import repack, rows16_matmul, unpack
from specdec.backends.native.quant_types import BY_GGML, QUANTIZED, Family
from specdec.gguf_file import QuantTensor

TORCH_TILE = 256  # output rows the torch kernel decodes at a time (whole tiles of 16)


def kernel_name() -> str:
    """"numba" where numba imports and the fallback is not forced, else "torch"."""
    return "torch" if forced_fallback() or not numba_importable() else "numba"


class BlockLinear8(torch.nn.Module):
    """x [M, K] -> y [M, N] = x @ W.T (+ bias) for a matrix W [N, K] of a quantized type
    (quant_types.QUANTIZED); fp32 activations in, x's dtype out."""

    def __init__(self, tensor: QuantTensor, bias: torch.Tensor | None = None, kernel: str | None = None):
        super().__init__()
        qt = BY_GGML.get(tensor.qtype)
        if qt not in QUANTIZED:
            names = ", ".join(t.name for t in QUANTIZED)
            raise ValueError(f"BlockLinear8 reads {names}, not {tensor.qtype.name} (tensor {tensor.name!r})")
        n, k = tensor.shape
        span = qt.activation_block
        if k % span:
            raise ValueError(f"tensor {tensor.name!r}: {qt.name} rows of {k} are not whole blocks of {span}")
        self.qtype, self.in_features, self.out_features = qt, k, n
        self.act_dtype = torch.float32
        raw = np.ascontiguousarray(tensor.data).reshape(n, -1)  # [N, bytes per row]: the file's own
        self.bias = None if bias is None else bias.detach().float().cpu()  # [N]
        self.kernel = kernel or kernel_name()
        self.small_blocks, self.units = qt.family is Family.BLOCKS32, k // span
        # in tiles of 16 rows (kernels/tiles16.py, supertiles.py), scales inside: the loader then drops
        # the file's pages of the blocks (and a joined q/k/v keeps no second copy)
        self.tiles = (repack if self.small_blocks else supertiles.repack)(raw, qt, n, k)
        self.rows = np.empty((n, 0), np.float32)  # N for jit/layer.py's parts, whatever the layout

    def nbytes(self) -> int:
        """Bytes this layer holds (the tiles, the bias)."""
        return self.tiles.nbytes + (0 if self.bias is None else self.bias.nbytes)

    @eager_in_graphs  # numba and numpy
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
        xq, xs, xsum, xsum4 = activations
        if self.small_blocks:
            _tiles16_jit().matmul(self.qtype.code, self.tiles, self.out_features, self.units, xq, xs, xsum, y,
                                  column)
        else:
            _supertiles_jit().matmul(self.qtype.code, self.tiles, self.out_features, self.units, xq, xs, xsum,
                                     xsum4, y, column)

    def numba_part(self) -> tuple:
        """(code, tiles, rows, units): this matrix as the numba matmuls take it (jit/layer.py);
        rows [N, 0] carries N."""
        return self.qtype.code, self.tiles, self.rows, self.units

    def numba_group(self) -> tuple | None:
        """This layer as jit/layer.py's linear group (small, parts, bias, width), or None where
        it does not run the numba kernel."""
        if self.kernel != "numba":
            return None
        return self.small_blocks, (self.numba_part(),), _bias_array(self.bias), self.out_features

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        return self._torch_tiles(x) if self.small_blocks else self._torch_supertiles(x)

    def _torch_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """rows16_matmul over the tiles, TORCH_TILE output rows (whole tiles) unpacked at a time."""
        acts, outputs = quantize_activations(x), []
        for start in range(0, self.out_features, TORCH_TILE):
            rows = min(TORCH_TILE, self.out_features - start)
            tiles = self.tiles[start // TILE_ROWS : (start + TORCH_TILE) // TILE_ROWS]
            q, d, m = (None if a is None else torch.from_numpy(a)
                       for a in unpack(tiles, self.qtype, rows, self.in_features))
            outputs.append(rows16_matmul(*acts, q, d, m, self.qtype.offset))
        return torch.cat(outputs, dim=1)


    def _torch_supertiles(self, x: torch.Tensor) -> torch.Tensor:
        """supertile_matmul over the tiles, TORCH_TILE output rows unpacked at a time."""
        xq, xs, xsum = quantize_activations_k(x)
        outputs = []
        for start in range(0, self.out_features, TORCH_TILE):
            rows = min(TORCH_TILE, self.out_features - start)
            tiles = self.tiles[start // TILE_ROWS : (start + TORCH_TILE) // TILE_ROWS]
            fields = supertiles.unpack(tiles, self.qtype, rows, self.in_features)
            outputs.append(supertiles.supertile_matmul(
                xq, xs, xsum, *(None if f is None else torch.from_numpy(f) for f in fields)))
        return torch.cat(outputs, dim=1)


class MixedBlockLinear8(torch.nn.Module):
    """Matrices of different quantized types over one input, side by side (a Q4_K_M file's Q5_0 q and k
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
            self.bias = torch.cat([torch.zeros(p.out_features) if b is None else b
                                   for p, b in zip(parts, biases, strict=True)])

    @staticmethod
    def shares_input(parts: list[BlockLinear8]) -> bool:
        """Whether the parts can run as one MixedBlockLinear8."""
        return len({(p.in_features, p.small_blocks, p.kernel) for p in parts}) == 1

    def numba_group(self) -> tuple | None:
        """The parts as jit/layer.py's linear group (small, parts, bias, width), or None where
        they do not run the numba kernel."""
        if self.kernel != "numba":
            return None
        parts = tuple(part.numba_part() for part in self.parts)
        return self.parts[0].small_blocks, parts, _bias_array(self.bias), self.out_features

    @eager_in_graphs
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, sum N]
        if self.kernel != "numba":
            return torch.cat([p.forward(x) for p in self.parts], dim=-1)
        rows = float_rows(x)
        activations, y = (quantized(rows, self.parts[0].small_blocks),
                          np.empty((rows.shape[0], self.out_features), np.float32))
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
    jit/activations.py's rounding."""
    m, k = x.shape
    span = BLOCK if small_blocks else SUPER
    xq, xs = np.empty((m, k), np.int8), np.empty((m, k // span), np.float32)
    xsum, xsum4 = np.empty((m, k // BLOCK), np.int32), np.empty((m, k // 4), np.int32)
    (_quantizer().quantize_rows if small_blocks else _quantizer().quantize_rows_k)(x, xq, xs, xsum, xsum4)
    return xq, xs, xsum, xsum4


def linear_for(tensor: QuantTensor, bias: torch.Tensor | None = None) -> BlockLinear8:
    """The layer for a matrix [N, K] of a quantized type, on this process's kernel."""
    return BlockLinear8(tensor, bias)


@functools.cache
def _supertiles_jit():
    numba_threads()  # the threading layer and count, before the first parallel launch
    import specdec.backends.native.kernels.jit.supertiles as jit  # compiles, or loads from disk

    return jit


@functools.cache
def _tiles16_jit():
    numba_threads()
    import specdec.backends.native.kernels.jit.tiles16 as jit  # compiles, or loads from disk

    return jit


@functools.cache
def _quantizer():
    import specdec.backends.native.kernels.jit.activations as quant  # compiles, or loads from disk

    return quant
