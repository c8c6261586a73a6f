"""GGUF Q8_0, Q6_K and Q5_0 matrices (quant_types.ORT_TYPES) on ONNX Runtime's 8-bit
`MatMulNBits` (exact weights), for the LM head on request (`lm_head=ort8`,
gguf/layers.head_from_quant); kernels/int8_blocks.py holds the file's own kernels."""

from __future__ import annotations

import functools

import numpy as np
import torch

from specdec.backends.native.kernels.cpu import forced_fallback
from specdec.backends.native.kernels.int8_reference import decode_integers, scale_table
from specdec.backends.native.kernels.ort import OrtBlockLinear, ort_available
from specdec.backends.native.quant_types import ORT_TYPES, Q, quant_type
from specdec.gguf_file import QuantTensor

DECODE_ROWS = 2048  # rows decoded to ONNX Runtime's layout at a time (fp32 transients)


class OrtBlockLinear8(torch.nn.Module):
    """A Q8_0, Q6_K or Q5_0 matrix on ONNX Runtime's 8-bit `MatMulNBits`: the file's integers
    (Q8_0 q, Q6_K q - 32, Q5_0 q - 16) as u = q + 128 with the default zero point 128, and the
    blocks' scales as fp32 (d; Q6_K's d * sc per sub-block of 16, exact), so the weights are
    exactly the file's. Activations are quantized to int8 per block and multiplied with int8
    dot products (accuracy_level 4: VNNI or AMX kernels where the CPU has them), as llama.cpp
    does. Used where `ort_8bit_usable` (a row's bits independent of the batch here): its GEMM
    keeps several rows near one row's cost, which the numba lanes do not
    (docs/performance-notes.md). Each output is one reduction over K in block order; MLAS
    splits the work over rows and columns, never over K. Holds 1 byte a weight plus the
    scales (Q6_K and Q5_0 files hold 0.82 and 0.69)."""

    def __init__(self, tensor: QuantTensor, bias: torch.Tensor | None = None, threads: int | None = None):
        super().__init__()
        qt, (n, k) = quant_type(tensor.qtype), tensor.shape
        if qt not in ORT_TYPES:
            names = ", ".join(t.name for t in ORT_TYPES)
            raise ValueError(f"OrtBlockLinear8 reads {names}, not {qt.name} (tensor {tensor.name!r})")
        raw = np.ascontiguousarray(tensor.data).reshape(n, -1)  # the file's blocks
        scales = scale_table(qt, raw, n, k)
        u, scale = np.empty((n, k), np.uint8), np.empty((n, k // qt.ort_block), np.float32)
        for start in range(0, n, DECODE_ROWS):
            stop = min(start + DECODE_ROWS, n)
            w, lo, hi, _ = decode_integers(qt, raw[start:stop], scales[start:stop])
            u[start:stop] = (w.reshape(stop - start, k) + 128).astype(np.uint8)
            scale[start:stop] = np.stack([lo, hi], -1).reshape(stop - start, -1) if qt.ort_block == 16 else lo
        self.kernel = OrtBlockLinear(
            torch.from_numpy(u), torch.from_numpy(scale), bits=8, threads=threads, block=qt.ort_block
        )
        self.bias = None if bias is None else bias.detach().float().cpu()  # [N]
        self.qtype, self.in_features, self.out_features, self.act_dtype = qt, k, n, torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        y = self.kernel.forward(x)
        y = y if self.bias is None else y + self.bias
        return y if x.dtype == torch.float32 else y.to(x.dtype)


@functools.cache
def ort_8bit_usable() -> bool:
    """ONNX Runtime is installed, the fallback is not forced, and its 8-bit kernel computes a
    row the same alone as among 8, at blocks of 32 and of 16 (checked once per process on
    random blocks)."""
    if forced_fallback() or not ort_available():
        return False
    rng = np.random.default_rng(0)
    for qt in (quant_type(Q.Q8_0), quant_type(Q.Q6_K)):  # blocks of 32, and of 16
        per_row, (scale_at,) = 256 // qt.block, qt.scales_at
        raw = rng.integers(0, 256, (64, per_row, qt.block_bytes), dtype=np.uint8)
        raw[..., scale_at : scale_at + 2] = (rng.uniform(1e-3, 1e-2, (64, per_row, 1)).astype(np.float16)
                                             .view(np.uint8))
        tensor = QuantTensor("probe", qt.ggml, (64, 256), raw.reshape(64, -1))
        if not OrtBlockLinear8(tensor).kernel.batch_invariant():
            return False
    return True
