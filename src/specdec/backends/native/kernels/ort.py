"""Block-quantized linear layers on ONNX Runtime's `MatMulNBits` (`pip install onnxruntime onnx`).

Weights are symmetric in blocks of 32 along K: w = (u - 2^(bits-1)) * scale[n, block], with u
unsigned in 0..2^bits-1 (`MatMulNBits`' default zero point). At 8 bits this is exactly GGUF's
Q8_0, the format of SmolLM2's tied embedding / LM head. At `accuracy_level=4` ONNX Runtime
quantizes each activation row to int8 per block and runs int8 dot products (AVX2,
AVX-512-VNNI or AMX kernels, chosen by ONNX Runtime for the CPU), as llama.cpp does.

ONNX Runtime keeps the initializer beside its packed copy (about twice the weights' bytes),
so the GGUF path uses it for the LM head only. Each row is computed on its own, so a row's
result should not depend on how many rows share the call; `batch_invariant` checks that on
this machine, and the native backend only uses a layer that passes it (see
quant.make_lm_head). A float zero point would leave MLAS's fast kernels (a hundred times
slower here), so Q4_1's asymmetric blocks do not map onto it.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from specdec.backends.native.kernels.cpu import eager_in_graphs

BLOCK = 32


def ort_available() -> bool:
    """Both packages installed; found, not imported (onnx alone takes a second to import)."""
    return all(importlib.util.find_spec(name) is not None for name in ("onnx", "onnxruntime"))


def quantize_symmetric(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> u [N, K] uint8 in 0..2^bits-1 and scale [N, K // 32] fp32, with
    w ≈ (u - 2^(bits-1)) * scale. Dequantized Q8_0 weights come back exactly at 8 bits."""
    w = weight.detach().float()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"block quantization needs in_features divisible by {BLOCK}, got {k}")
    levels = 2 ** (bits - 1) - 1  # 127 for 8 bits, 7 for 4
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1) / levels  # [N, K // 32]
    q = torch.round(blocks / scale.clamp(min=1e-30)[..., None]).clamp(-levels - 1, levels)
    return (q + 2 ** (bits - 1)).to(torch.uint8).reshape(n, k), scale


def matmul_nbits_model(u: torch.Tensor, scale: torch.Tensor, bits: int, accuracy_level: int = 4,
                       block: int = BLOCK) -> bytes:
    """A one-node ONNX graph Y[M, N] = A[M, K] @ W.T for u [N, K] and scale [N, K // block]."""
    from onnx import TensorProto, helper, numpy_helper

    n, k = u.shape
    un = u.numpy().reshape(n, k // block, block)
    if bits == 4:  # two elements a byte, the first in the low nibble
        un = un[..., 0::2] | (un[..., 1::2] << 4)
    inits = [numpy_helper.from_array(np.ascontiguousarray(un, dtype=np.uint8), "B"),
             numpy_helper.from_array(scale.float().numpy().reshape(-1), "scales")]
    node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=block, accuracy_level=accuracy_level)
    graph = helper.make_graph(
        [node], "linear", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits,
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


class OrtBlockLinear(torch.nn.Module):
    """x [M, K] -> y [M, N] fp32 through one ONNX Runtime session (no bias)."""

    def __init__(self, u: torch.Tensor, scale: torch.Tensor, bits: int = 8, accuracy_level: int = 4,
                 threads: int | None = None, block: int = BLOCK):
        super().__init__()
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        # its pool must not spin between calls: PyTorch's threads need those cores
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(matmul_nbits_model(u, scale, bits, accuracy_level, block),
                                            options, providers=["CPUExecutionProvider"])
        self.out_features, self.in_features, self.bits = u.shape[0], u.shape[1], bits

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int = 8, **kwargs) -> OrtBlockLinear:
        return cls(*quantize_symmetric(weight, bits), bits=bits, **kwargs)

    @eager_in_graphs  # an external runtime
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N] fp32
        a = x.detach().to("cpu", torch.float32).contiguous().numpy()
        return torch.from_numpy(self.session.run(None, {"A": a})[0])

    def batch_invariant(self, rows: int = 8, seed: int = 0) -> bool:
        """Row 0 of a one-row call equals row 0 of a `rows`-row call, bit for bit."""
        x = torch.randn(rows, self.in_features, generator=torch.Generator().manual_seed(seed))
        return torch.equal(self(x[:1].clone())[0], self(x)[0])
