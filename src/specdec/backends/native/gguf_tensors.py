"""GGUF tensors as the file holds them, and the layers the native backend builds from them.

The contract between the GGUF reader (gguf.py) and the weight kernels:
- the reader yields a `QuantTensor` per matrix: the file's raw bytes (memory-mapped, in the
  file's own quant type) plus the type and the logical shape in PyTorch order;
- `gguf_kernels.linear_from_quant` turns one into a linear layer (x [M, K] -> y [M, N], the `Linear`
  interface of quant.py: `forward`, `out_features`, `act_dtype`);
- `gguf_kernels.embedding_from_quant` turns one into a row lookup (token ids [N] -> [N, hidden] fp32).

Neither may keep a dense fp32 or bf16 copy of a quantized matrix.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from specdec.errors import SpecdecError
from specdec.gguf_file import QuantTensor

# The types the native backend reads; any other is refused by name (see check_type).
SUPPORTED_QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1")


def check_type(name: str, qtype: GGMLQuantizationType) -> None:
    if qtype.name not in SUPPORTED_QTYPES:
        raise SpecdecError(f"tensor {name!r} has GGUF type {qtype.name}, which the native backend does not read "
                           f"(it reads {', '.join(SUPPORTED_QTYPES)})", "target")


class ReferenceLinear(torch.nn.Module):
    """The file's values, dequantized by the gguf package, on an fp32 GEMM: the correctness
    baseline the fast kernels are tested against (it holds a dense copy; tests only)."""

    def __init__(self, tensor: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", torch.from_numpy(tensor.dequantize().copy()), persistent=False)  # [N, K]
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = tensor.shape[0], torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return torch.nn.functional.linear(x.float(), self.weight, self.bias).to(x.dtype)
