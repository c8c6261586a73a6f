"""Weight formats for the native backend: linear layers on kernels PyTorch ships.

Each layer maps activations x [M, K] to y [M, N] in x's dtype; the residual stream stays
fp32 and only the matmul input is cast to the kernel's dtype:
- "fp32": F.linear on the original weights (shared with the HF model, no copy);
- "bf16": bf16 weights and activations;
- "fp16": fp16 weights with fp32 activations on fbgemm's packed GEMM (x86 cpus);
- "int8": per-output-channel symmetric int8, `torch._weight_int8pack_mm`, bf16 activations
  (fp32 activations make that kernel many times slower);
- "int4": asymmetric 4-bit in groups of 32 along K, `aten._weight_int4pack_mm_for_cpu`,
  bf16 activations, bf16 scales and zeros (kernels/int4_blocks.py builds it from a GGUF's
  4-bit blocks).

The LM head has its own choice (`make_lm_head`): on int4/int8 models it runs 8-bit blocks on
ONNX Runtime where that is installed and batch-invariant on this CPU (kernels/ort.py).
`SPECDEC_CPU_KERNELS=fallback` (cpu.py) forces the pure-PyTorch paths.

bf16/int8/int4 compute every row on its own (bit-identical for 1 or k rows); fp32 and fp16
GEMMs differ from their one-row results at the ~1e-6 level. fp16, int8 and int4 are CPU
kernels; on other devices use fp32 or bf16.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from specdec.backends.native.kernels.cpu import (
    eager_in_graphs,
    forced_fallback,
    has_int4_kernel,
    one_thread_mm,
    one_thread_mm_op,
)
from specdec.backends.native.kernels.ort import OrtBlockLinear, ort_available

PRECISIONS = ("fp32", "bf16", "fp16", "int8", "int4")
# fbgemm's fp16 GEMM warns of its deprecation (once per process, from C++); we know
warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")
INT4_GROUP = 32
# the torch.* binding: the torch.ops.aten packet adds Python overhead to each of 120 calls a step
_int4_mm = getattr(torch, "_weight_int4pack_mm_for_cpu", None) or torch.ops.aten._weight_int4pack_mm_for_cpu


@torch.library.custom_op("specdec::int4_mm", mutates_args=())
def _int4_mm_compiled(x: torch.Tensor, packed: torch.Tensor, group: int,
                      scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The int4 kernel as compiled graphs call it: Inductor may hand an op it does not know
    the strides of a column-major buffer, and the kernel wants rows contiguous."""
    return _int4_mm(x.contiguous(), packed, group, scales_and_zeros)


@_int4_mm_compiled.register_fake
def _(x, packed, group, scales_and_zeros):
    return x.new_empty(x.shape[0], scales_and_zeros.shape[1])  # [M, N padded to 16]


class DenseLinear(torch.nn.Module):
    # Layers are modules holding their tensors as buffers, so that torch.compile treats them
    # as graph inputs and one compiled decoder layer serves every layer of the model.
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        weight = weight if dtype is None else weight.to(dtype)
        self.register_buffer("weight", weight, persistent=False)  # [N, K]
        self.register_buffer("bias", None if bias is None else bias.to(weight.dtype),
                             persistent=False)  # [N]
        self.out_features, self.act_dtype = weight.shape[0], weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        xw = x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)
        if x.dim() == 2 and x.shape[0] > 1 and x.device.type == "cpu":
            # several rows: oneDNN's and MKL's GEMMs split K by the thread count at some shapes
            # (fp32 from 4 rows, bf16 at 8960-wide K), so one thread keeps the bits; one row's
            # GEMV splits only N
            if torch.compiler.is_compiling():
                y = one_thread_mm_op(xw, self.weight.T)
            else:
                y = one_thread_mm(xw, self.weight.T,
                                  torch.empty(x.shape[0], self.out_features, dtype=xw.dtype))
            y = y if self.bias is None else y.add_(self.bias)
        else:
            y = F.linear(xw, self.weight, self.bias)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class FP16Linear(torch.nn.Module):
    """fp16 weights, fp32 activations and accumulation, on fbgemm's packed fp16 GEMM (x86).

    Half the bytes of fp32 at nearly its accuracy; on one AVX2 thread the fastest of these
    kernels for 1-16 rows, but it runs on one thread only. PyTorch marks these two functions
    deprecated (they are in 2.13).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _require_cpu(weight, "fp16")
        with warnings.catch_warnings():  # also under pytest, which resets the filters
            warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")
            packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        self.register_buffer("packed", packed, persistent=False)  # a handle to fbgemm's packed matrix
        bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()
        self.register_buffer("bias", bias, persistent=False)  # [N]; the kernel wants one
        self.out_features, self.act_dtype = weight.shape[0], torch.float32

    @eager_in_graphs  # dynamo cannot trace this op
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return torch.fbgemm_linear_fp16_weight(x.float(), self.packed, self.bias).to(x.dtype)


class Int8Linear(torch.nn.Module):
    """w ≈ q * scale[n], q int8 in [-127, 127], one scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        _require_cpu(weight, "int8")
        w = weight.detach().float()  # [N, K]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        qweight = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.register_buffer("qweight", qweight, persistent=False)  # [N, K]
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)  # [N]
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = weight.shape[0], torch.bfloat16

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(torch.nn.Module):
    """w = (q - 8) * scale[g, n] + zero[g, n] with q in 0..15 and g = k // 32.

    The kernel wants N to be a multiple of 16; other N are padded with zero rows and the
    output is sliced back.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 bias: torch.Tensor | None = None):
        # q: [N, K] int32 in 0..15; scale, zero: [K // 32, N]
        super().__init__()
        n, k = q.shape
        pad = -n % 16
        if pad:
            q = F.pad(q, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, pad)), F.pad(zero, (0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).to(torch.bfloat16).contiguous()  # [G, N, 2]
        self._hold(packed, scales_and_zeros, n, bias)

    def _hold(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int,
              bias: torch.Tensor | None) -> None:
        # packed: the kernel's [N padded, K / 2] uint8; scales_and_zeros [G, N padded, 2] bf16
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", scales_and_zeros, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = n, torch.bfloat16
        self._padded = packed.shape[0] > n
        self.eager_args = (packed, scales_and_zeros, self.bias)  # plain attributes: see DecoderLayer

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int,
                    bias: torch.Tensor | None = None) -> Int4Linear:
        """Over an already packed matrix (rows past `n` are padding), e.g. one built tile by tile."""
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._hold(packed, scales_and_zeros, n, bias)
        return layer

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int4Linear:
        _require_cpu(weight, "int4")
        q, scale, zero = quantize_int4(weight)
        return cls(q, scale.T, zero.T, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        # dtype checks in Python: a no-op .to() still costs a dispatch, and a step makes 120 calls
        if torch.compiler.is_compiling():
            mm, packed, scales_and_zeros, bias = (_int4_mm_compiled, self.packed, self.scales_and_zeros,
                                                  self.bias)
        else:
            mm, (packed, scales_and_zeros, bias) = _int4_mm, self.eager_args
        y = mm(x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16), packed, INT4_GROUP, scales_and_zeros)
        if self._padded:
            y = y[:, : self.out_features]
        if x.dtype != torch.bfloat16:
            y = y.to(x.dtype)
        return y if bias is None else y + bias


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int32 in 0..15, scale [N, K // 32], zero [N, K // 32]) with
    w ~ (q - 8) * scale + zero per group of 32 along K: the group's range in 16 steps."""
    w = weight.detach().float()
    n, k = w.shape
    if k % INT4_GROUP:
        raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {k}")
    groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
    lo, hi = groups.amin(-1), groups.amax(-1)  # [N, G]
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(n, k)
    return q.to(torch.int32), scale, lo + 8 * scale


PrecisionLinear = DenseLinear | FP16Linear | Int8Linear | Int4Linear | OrtBlockLinear


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, precision: str) -> PrecisionLinear:
    """A linear layer over `weight` [N, K] in `precision`; fp32 keeps the tensor itself."""
    if precision == "fp32":
        return DenseLinear(weight.detach(), None if bias is None else bias.detach(), torch.float32)
    if precision == "bf16":
        return DenseLinear(weight.detach(), None if bias is None else bias.detach(), torch.bfloat16)
    if precision == "fp16":
        return FP16Linear(weight, bias)
    if precision == "int8":
        return Int8Linear(weight, bias)
    if precision == "int4":
        if weight.shape[1] % INT4_GROUP or not has_int4_kernel():  # e.g. tiny test models: int8
            return Int8Linear(weight, bias)
        return Int4Linear.from_float(weight, bias)
    raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")


LM_HEADS = ("auto", "ort8", "int8", "int4")


def make_lm_head(weight: torch.Tensor, bias: torch.Tensor | None, precision: str,
                 kind: str = "auto") -> PrecisionLinear:
    """The LM head [V, hidden] for a model in `precision`. Only int4 and int8 models choose
    (the others keep their precision); `kind`:
    - "ort8": 8-bit blocks of 32 on ONNX Runtime's MatMulNBits (kernels/ort.py), the format of
      a GGUF's Q8_0 output matrix, int8 activations; used only if it is batch-invariant here;
    - "int8": per-row int8 on PyTorch's kernel (pure PyTorch; slower, further from fp32);
    - "int4": PyTorch's int4 kernel (pure PyTorch and fast, but 4-bit logits);
    - "auto": ort8 where onnxruntime is installed and passes the check, otherwise int8.
    """
    if kind not in LM_HEADS:
        raise ValueError(f"unknown lm_head {kind!r}; choose one of: {', '.join(LM_HEADS)}")
    if precision not in ("int4", "int8"):
        return make_linear(weight, bias, precision)
    if (kind in ("auto", "ort8") and bias is None and weight.shape[1] % INT4_GROUP == 0
            and weight.device.type == "cpu"):
        head = _ort_lm_head(weight)
        if head is not None:
            return head
        if kind == "ort8":
            raise ValueError("lm_head ort8 needs onnxruntime and onnx (pip install 'specdec[cpu]') "
                             "and a batch-invariant MatMulNBits on this cpu")
    return make_linear(weight, bias, "int4" if kind == "int4" else "int8")


def _ort_lm_head(weight: torch.Tensor):
    if forced_fallback() or not ort_available():
        return None
    head = OrtBlockLinear.from_float(weight, bits=8)
    return head if head.batch_invariant() else None


def _require_cpu(weight: torch.Tensor, precision: str) -> None:
    if weight.device.type != "cpu":
        raise ValueError(f"precision {precision} uses CPU kernels; on {weight.device.type} use fp32 or bf16")
