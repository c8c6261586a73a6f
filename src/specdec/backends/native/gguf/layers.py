"""The native backend's layers over GGUF tensors as the file holds them.

The contract between the GGUF reader (reader.py) and the kernels: the reader yields a
`QuantTensor` per matrix (specdec.gguf_file: the file's raw bytes, memory-mapped, in the
file's own type, and the logical shape in PyTorch order); `linear_from_quant` turns one into
a linear layer (kernels/linear.Linear: x [M, K] -> y [M, N]) and `embedding_from_quant` into
a row lookup (token ids [T] -> [T, hidden] fp32). Neither keeps a dense fp32 or bf16 copy of
a quantized matrix.

- `build_linear` picks the layers by the type's family (quant_types.py): the quantized types
  on kernels/int8_blocks.py's int8-activation kernels, except the 4-bit ones where numba does
  not run (kernels/int4_blocks.py, PyTorch's int4 kernel); F32, F16 and BF16 at the file's own
  precision.
- A list of tensors of one type and K (q/k/v, gate/up) becomes one kernel over their rows
  concatenated (a `FusedLinear` that splits the output). Mixed quantized types that read one
  activation format share its quantization and one output (`MixedBlockLinear8`); other
  mixes keep separate parts.
- Every layer has `forward` (decode steps, drafts: any M) and `prompt_forward` (prompt chunks:
  compute-bound, may run another kernel); `prompt_view` wraps a layer so that a second stack of
  decoder layers runs the prompt kernels over the same buffers (no copy).

Float matrices, and their reduction orders (a row's bits depend neither on the other rows nor
on the thread count; tests/test_gguf_kernels.py checks both):
- F32 `RowwiseLinear` (kernels/float_rows.py) over the file's own (memory-mapped) tensor.
- F16 on fbgemm's fp16 GEMM (precisions.FP16Linear; one thread, K in order per output). Its
  packing reads an fp32 copy of the matrix while the layer is built (transient). Where fbgemm
  is missing, `RowwiseLinear` over fp32 tiles of the fp16 tensor.
- BF16: oneDNN's bf16 GEMM on the file's tensor (precisions.DenseLinear): one row's GEMV
  splits only N; several rows run on one thread (cpu.one_thread_mm).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import torch

from specdec.backends.native.kernels.cpu import forced_fallback, has_int4_kernel
from specdec.backends.native.kernels.float_rows import RowwiseLinear
from specdec.backends.native.kernels.int4_blocks import ExactQ4Linear, Int4BlockLinear
from specdec.backends.native.kernels.int8_blocks import MixedBlockLinear8, linear_for
from specdec.backends.native.kernels.int8_blocks import kernel_name as int8_kernel_name
from specdec.backends.native.kernels.int8_ort import OrtBlockLinear8, ort_8bit_usable
from specdec.backends.native.kernels.linear import FusedLinear, PromptSame
from specdec.backends.native.kernels.precisions import DenseLinear, FP16Linear
from specdec.backends.native.quant_types import (
    ORT_TYPES,
    QUANTIZED,
    Family,
    Q,
    QuantType,
    check_type,
)
from specdec.errors import SpecdecError
from specdec.gguf_file import QuantTensor


def build_linear(tensors: QuantTensor | list[QuantTensor], bias=None):
    """A linear layer over one tensor [N, K], or over several of one K side by side (a
    FusedLinear whose parts are the tensors' outputs). `bias`: a tensor, or one per tensor."""
    if isinstance(tensors, QuantTensor):
        return _single(tensors, bias)
    biases = list(bias) if isinstance(bias, (list, tuple)) else [bias] if len(tensors) == 1 else None
    if biases is None or len(biases) != len(tensors):
        raise ValueError("a fused linear takes one bias (or None) per tensor")
    types = [check_type(t.name, t.qtype) for t in tensors]
    if len({t.shape[1] for t in tensors}) != 1:
        shapes = ", ".join(f"{t.name} {list(t.shape)}" for t in tensors)
        raise SpecdecError(f"tensors fused into one linear must share K: {shapes}", "target")
    sizes = [t.shape[0] for t in tensors]
    if len(set(types)) != 1:  # e.g. a Q4_K_M file's Q6_K attn_v beside Q4_K q, k
        if all(runs_int8_activations(qt) for qt in types):
            parts = [linear_for(t, b) for t, b in zip(tensors, biases, strict=True)]
            if MixedBlockLinear8.shares_input(parts):  # one quantization of the input, one output
                return FusedLinear.from_layers([PromptSame(MixedBlockLinear8(parts))], sizes)
        return FusedLinear.from_layers([_single(t, b) for t, b in zip(tensors, biases, strict=True)], sizes)
    joined = None
    if any(b is not None for b in biases):
        parts = [torch.zeros(n) if b is None else b.detach().float().cpu()
                 for b, n in zip(biases, sizes, strict=True)]
        joined = torch.cat(parts)
    return FusedLinear.from_layers([_single(concat_rows(tensors), joined)], sizes)


def concat_rows(tensors: list[QuantTensor]) -> QuantTensor:
    """Tensors of one type and K as one [sum N, K] tensor (a copy of their bytes, unless one)."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    data = np.concatenate([np.asarray(t.data) for t in tensors])
    return QuantTensor("+".join(t.name for t in tensors), first.qtype, (data.shape[0], first.shape[1]), data)


def _single(tensor: QuantTensor, bias):
    qt, (n, k) = check_type(tensor.name, tensor.qtype), _matrix_shape(tensor)
    if qt.family is Family.FLOAT:
        return _float_layer(qt, tensor, bias, n, k)
    if runs_int8_activations(qt):  # one kernel over the file's blocks for decode steps and prompts alike
        return PromptSame(linear_for(tensor, bias))
    if has_int4_kernel():  # a 4-bit type where numba does not run
        return Int4BlockLinear.from_blocks(qt, tensor.data, k, bias)
    return ExactQ4Linear(qt, tensor.data, k, bias)


def _float_layer(qt: QuantType, tensor: QuantTensor, bias, n: int, k: int):
    if qt.ggml is Q.BF16:
        weight = _shared(tensor.data, np.int16).view(torch.bfloat16)
        return PromptSame(DenseLinear(weight.reshape(n, k), None if bias is None else bias.detach().float()))
    if qt.ggml is Q.F16:
        weight = _shared(tensor.data, np.float16).reshape(n, k)
        if _fbgemm_usable():
            return PromptSame(FP16Linear(weight.float(), bias))
        return RowwiseLinear(weight, bias)
    return RowwiseLinear(_shared(tensor.data, np.float32).reshape(n, k), bias)  # F32


def copies_weights(tensor: QuantTensor) -> bool:
    """Whether `build_linear` keeps a copy of this tensor (the tiles of 16 rows, the int4
    repacking, fbgemm's fp16 packing) rather than reading the file's mapped bytes: the loader
    then drops those pages."""
    qt = check_type(tensor.name, tensor.qtype)
    if runs_int8_activations(qt):
        return True  # BlockLinear8 repacks them in tiles of 16 rows
    return qt.four_bit or (qt.ggml is Q.F16 and _fbgemm_usable())


def runs_int8_activations(qt: QuantType) -> bool:
    """Whether a type's layers multiply int8 activations by the file's blocks (int8_blocks.py):
    every quantized type where numba runs those kernels; elsewhere the 4-bit ones take the int4
    kernel, faster than the kernels' PyTorch replicas."""
    return qt.family is not Family.FLOAT and (not qt.four_bit or int8_kernel_name() == "numba")


def int8_activation_types() -> tuple[QuantType, ...]:
    """The types `runs_int8_activations` holds for in this process."""
    return tuple(qt for qt in QUANTIZED if runs_int8_activations(qt))


def _matrix_shape(tensor: QuantTensor) -> tuple[int, int]:
    """[N, K], after checking that the bytes hold N rows of K weights in whole blocks."""
    if len(tensor.shape) != 2:
        raise SpecdecError(f"tensor {tensor.name!r} has shape {list(tensor.shape)}, not a matrix", "target")
    n, k = tensor.shape
    qt = check_type(tensor.name, tensor.qtype)
    if k % qt.block or tensor.data.nbytes != n * k // qt.block * qt.block_bytes:
        raise SpecdecError(f"tensor {tensor.name!r} ({qt.name}, {list(tensor.shape)}) does not hold whole "
                           f"blocks of {qt.block}: {tensor.data.nbytes} bytes", "target")
    return n, k


def _shared(data: np.ndarray, dtype) -> torch.Tensor:
    """The file's bytes as a tensor of `dtype`, sharing the memory map (no copy). torch warns
    on read-only arrays; no layer writes its weights."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data).view(dtype))


def _fbgemm_usable() -> bool:
    """fbgemm's fp16 GEMM is built here, the fallback is not forced, and it computes a row the
    same alone as among 8. The fallback is read at each call (a test forces it after another
    built an F16 layer); the check itself runs once per process."""
    return not forced_fallback() and _fbgemm_batch_invariant()


@functools.cache
def _fbgemm_batch_invariant() -> bool:
    """Checked on random weights: on an AVX2 EPYC fbgemm does not compute a row the same alone as
    among 8, and an F16 matrix then takes RowwiseLinear."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    g = torch.Generator().manual_seed(0)
    layer = FP16Linear(torch.randn(320, 512, generator=g))
    x = torch.randn(8, 512, generator=g)
    return all(torch.equal(layer(x[i : i + 1])[0], layer(x)[i]) for i in (0, 5))


FLOAT_VIEWS = {Q.F32: np.float32, Q.F16: np.float16, Q.BF16: np.int16}  # how a float type's bytes read


class QuantEmbedding:
    """Row lookups that decode only the rows asked for, exactly as the gguf reference does."""

    def __init__(self, tensor: QuantTensor):
        self.tensor = tensor
        self.num_embeddings, self.embedding_dim = _matrix_shape(tensor)
        self._float = None
        if tensor.qtype in FLOAT_VIEWS:  # rows by indexing, widened to fp32 (exact)
            self._float = _shared(tensor.data, FLOAT_VIEWS[tensor.qtype]).reshape(tensor.shape)
            if tensor.qtype is Q.BF16:
                self._float = self._float.view(torch.bfloat16)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
        if self._float is not None:
            return self._float[token_ids.cpu()].float().to(token_ids.device)
        index = token_ids.cpu().numpy()
        if self.tensor.qtype is Q.Q8_0:  # d * q, exact in fp32 (an fp16 times an int8): the
            # reference's bits without its per-call cost (~0.25 ms a decode step)
            blocks = np.asarray(self.tensor.data[index]).reshape(len(index), -1, 34)
            d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)  # [T, K // 32, 1]
            rows = (blocks[..., 2:].view(np.int8).astype(np.float32) * d).reshape(len(index),
                                                                                  self.embedding_dim)
        else:
            rows = self.tensor.rows(index)
        return torch.from_numpy(rows).to(token_ids.device)


def vector_from_quant(tensor: QuantTensor) -> torch.Tensor:
    """A 1-D tensor (a norm's weight, a bias) as fp32."""
    check_type(tensor.name, tensor.qtype)
    return torch.from_numpy(np.ascontiguousarray(tensor.dequantize()).reshape(tensor.shape).copy())


def linear_from_quant(tensor: QuantTensor | list[QuantTensor], bias=None):
    """A linear layer over `tensor` [N, K] in its own quant type, or over a list of tensors of
    one K side by side (a FusedLinear; `bias` then one per tensor)."""
    return build_linear(tensor, bias)


def head_from_quant(tensor: QuantTensor, kind: str = "auto"):
    """The LM head [V, hidden]. kind "auto": the file's own kernel, as every other matrix;
    "ort8": a Q8_0, Q6_K or Q5_0 head on ONNX Runtime's 8-bit kernel (exact weights), whose
    cost several rows share (a speculative step scores 2-9) where numba's grows with each row,
    at the price of about twice the head's bytes held (kernels/int8_ort.py). Float checkpoints'
    kinds (int8, int4) do not apply to a GGUF head, whose type the file fixes."""
    if kind == "auto":
        return linear_from_quant(tensor)
    if kind != "ort8":
        raise SpecdecError(f"lm_head {kind!r} requantizes a float head; a GGUF head keeps its file's type "
                           "(lm_head auto) or runs on ONNX Runtime (lm_head ort8)", "lm_head")
    if check_type(tensor.name, tensor.qtype) not in ORT_TYPES:
        names = ", ".join(t.name for t in ORT_TYPES)
        raise SpecdecError(f"lm_head ort8 takes a {names} head; {tensor.name!r} is {tensor.qtype.name}",
                           "lm_head")
    if not ort_8bit_usable():
        raise SpecdecError("lm_head ort8 needs onnxruntime and onnx (pip install 'specdec[cpu]') and a "
                           "batch-invariant MatMulNBits on this cpu", "lm_head")
    _matrix_shape(tensor)
    return PromptSame(OrtBlockLinear8(tensor))


def head_copies_weights(tensor: QuantTensor, kind: str = "auto") -> bool:
    """Whether `head_from_quant` copies this tensor (so the loader may drop its mapped pages)."""
    return kind == "ort8" or copies_weights(tensor)


def embedding_from_quant(tensor: QuantTensor):
    """Row lookups: token ids [T] -> [T, hidden] fp32, decoding only those rows."""
    check_type(tensor.name, tensor.qtype)
    return QuantEmbedding(tensor)


class ReferenceLinear(torch.nn.Module):
    """The file's values, dequantized by the gguf package, on an fp32 GEMM: the correctness
    baseline the fast kernels are tested against (it holds a dense copy; tests only)."""

    def __init__(self, tensor: QuantTensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", torch.from_numpy(tensor.dequantize().copy()),
                             persistent=False)  # [N, K]
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = tensor.shape[0], torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return torch.nn.functional.linear(x.float(), self.weight, self.bias).to(x.dtype)
