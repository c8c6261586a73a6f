"""The native backend's layers over GGUF tensors as the file holds them (gguf_tensors.py's seam).

- `build_linear` picks a kernel per type: Q8_0, Q5_K, Q6_K, Q5_0 and Q5_1 in
  gguf_kernels_8bit.py, and Q4_0, Q4_1 and Q4_K there too where numba runs its kernels
  (`int8_activation_types`; without numba they take gguf_q4.py's int4 kernel); F32, F16 and
  BF16 here, at the file's own precision.
- A list of tensors of one type and K (q/k/v, gate/up) becomes one kernel over their rows
  concatenated (a `FusedLinear` that splits the output). Mixed 8-bit types that read one
  activation format share its quantization and one output (`MixedBlockLinear8`); other
  mixes keep separate parts.
- Every layer has `forward` (decode steps, drafts: any M) and `prompt_forward` (prompt chunks:
  compute-bound, may run another kernel); `prompt_view` wraps a layer so that a second stack of
  decoder layers runs the prompt kernels over the same buffers (no copy).

Float matrices, and their reduction orders (a row's bits depend neither on the other rows nor
on the thread count; tests/test_gguf_kernels.py checks both):
- F32 `RowwiseLinear`: one fp32 matrix-vector product per activation row, over the file's own
  (memory-mapped) tensor; prompts cast 512-row tiles to bf16 and run the bf16 GEMM on one
  thread (cpu.one_thread_mm).
- F16 on fbgemm's fp16 GEMM (quant.FP16Linear; one thread, K in order per output). Its
  packing reads an fp32 copy of the matrix while the layer is built (transient). Where fbgemm
  is missing, `RowwiseLinear` over fp32 tiles of the fp16 tensor.
- BF16: oneDNN's bf16 GEMM on the file's tensor (quant.DenseLinear): one row's GEMV splits
  only N; several rows run on one thread (cpu.one_thread_mm).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES

from specdec.backends.native.cpu import forced_fallback, has_int4_kernel, one_thread_mm
from specdec.backends.native.gguf_kernels_8bit import MixedBlockLinear8
from specdec.backends.native.gguf_kernels_8bit import kernel_name as eight_bit_kernel_name
from specdec.backends.native.gguf_kernels_8bit import linear_for as eight_bit_linear
from specdec.backends.native.gguf_kernels_ort8 import ORT_TYPES, OrtBlockLinear8, ort_8bit_usable
from specdec.backends.native.gguf_q4 import Q4_TYPES, ExactQ4Linear, Int4BlockLinear
from specdec.backends.native.gguf_rows16 import ROWS16_TYPES
from specdec.backends.native.gguf_tensors import QuantTensor, check_type
from specdec.backends.native.quant import DenseLinear, FP16Linear, FusedLinear
from specdec.errors import SpecdecError

EIGHT_BIT_TYPES = ("Q8_0", "Q5_K", "Q6_K", "Q5_0", "Q5_1")  # gguf_kernels_8bit.py's
NUMBA_Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # on gguf_kernels_8bit's kernels too, where numba runs them
FLOAT_TYPES = ("F32", "F16", "BF16")
ROW_TILE = 512


def build_linear(tensors: QuantTensor | list[QuantTensor], bias=None):
    """A linear layer over one tensor [N, K], or over several of one K side by side (a
    FusedLinear whose parts are the tensors' outputs). `bias`: a tensor, or one per tensor."""
    if isinstance(tensors, QuantTensor):
        check_type(tensors.name, tensors.qtype)
        return _single(tensors, bias)
    biases = list(bias) if isinstance(bias, (list, tuple)) else [bias] if len(tensors) == 1 else None
    if biases is None or len(biases) != len(tensors):
        raise ValueError("a fused linear takes one bias (or None) per tensor")
    for t in tensors:
        check_type(t.name, t.qtype)
    if len({t.shape[1] for t in tensors}) != 1:
        raise SpecdecError("tensors fused into one linear must share K: "
                           + ", ".join(f"{t.name} {list(t.shape)}" for t in tensors), "target")  # fmt: skip
    sizes = [t.shape[0] for t in tensors]
    if len({t.qtype for t in tensors}) != 1:  # e.g. a Q4_K_M file's Q6_K attn_v beside Q4_K q, k
        if all(t.qtype.name in int8_activation_types() for t in tensors):
            parts = [eight_bit_linear(t, b) for t, b in zip(tensors, biases, strict=True)]
            if MixedBlockLinear8.shares_input(parts):  # one quantization of the input, one output
                return FusedLinear.from_layers([PromptSame(MixedBlockLinear8(parts))], sizes)
        return FusedLinear.from_layers([_single(t, b) for t, b in zip(tensors, biases, strict=True)], sizes)
    joined = None
    if any(b is not None for b in biases):
        joined = torch.cat([torch.zeros(n) if b is None else b.detach().float().cpu()
                            for b, n in zip(biases, sizes, strict=True)])  # fmt: skip
    return FusedLinear.from_layers([_single(concat_rows(tensors), joined)], sizes)


def concat_rows(tensors: list[QuantTensor]) -> QuantTensor:
    """Tensors of one type and K as one [sum N, K] tensor (a copy of their bytes, unless one)."""
    if len(tensors) == 1:
        return tensors[0]
    first = tensors[0]
    data = np.concatenate([np.asarray(t.data) for t in tensors])
    return QuantTensor("+".join(t.name for t in tensors), first.qtype, (data.shape[0], first.shape[1]), data)


def _single(tensor: QuantTensor, bias):
    kind, (n, k) = tensor.qtype.name, _matrix_shape(tensor)
    if kind in int8_activation_types():
        return _eight_bit(tensor, bias)
    if kind in Q4_TYPES:
        if has_int4_kernel():
            return Int4BlockLinear.from_blocks(kind, tensor.data, k, bias)
        return ExactQ4Linear(kind, tensor.data, k, bias)
    if kind == "BF16":
        weight = _shared(tensor.data, np.int16).view(torch.bfloat16)
        return PromptSame(DenseLinear(weight.reshape(n, k), None if bias is None else bias.detach().float()))
    if kind == "F16":
        weight = _shared(tensor.data, np.float16).reshape(n, k)
        if _fbgemm_usable():
            return PromptSame(FP16Linear(weight.float(), bias))
        return RowwiseLinear(weight, bias)
    weight = _shared(tensor.data, np.float32).reshape(n, k)  # F32
    return RowwiseLinear(weight, bias)


def copies_weights(tensor: QuantTensor) -> bool:
    """Whether `build_linear` keeps a copy of this tensor (the 4-bit repacking, fbgemm's fp16
    packing) rather than reading the file's mapped bytes: the loader then drops those pages."""
    kind = tensor.qtype.name
    if kind in ROWS16_TYPES and kind in int8_activation_types():  # BlockLinear8 repacks them in tiles of 16 rows
        return True
    return (kind in Q4_TYPES and kind not in int8_activation_types()) or (kind == "F16" and _fbgemm_usable())


def int8_activation_types() -> tuple[str, ...]:
    """The types whose layers multiply int8 activations by the file's blocks (gguf_kernels_8bit):
    the 8-bit family always, and the 4-bit family where numba runs those kernels (elsewhere it
    takes the int4 kernel, faster than the kernels' PyTorch replicas)."""
    return EIGHT_BIT_TYPES + NUMBA_Q4_TYPES if eight_bit_kernel_name() == "numba" else EIGHT_BIT_TYPES


def _eight_bit(tensor: QuantTensor, bias):
    # Q8_0 / Q5_K / Q6_K / Q5_0 / Q5_1 (Q4_0 / Q4_1): one kernel over the file's blocks for decode steps and prompts alike
    return PromptSame(eight_bit_linear(tensor, bias))


def _matrix_shape(tensor: QuantTensor) -> tuple[int, int]:
    """[N, K], after checking that the bytes hold N rows of K weights in whole blocks."""
    if len(tensor.shape) != 2:
        raise SpecdecError(f"tensor {tensor.name!r} has shape {list(tensor.shape)}, not a matrix", "target")
    n, k = tensor.shape
    block, width = GGML_QUANT_SIZES[tensor.qtype]
    if k % block or tensor.data.nbytes != n * k // block * width:
        raise SpecdecError(f"tensor {tensor.name!r} ({tensor.qtype.name}, {list(tensor.shape)}) does not hold whole "
                           f"blocks of {block}: {tensor.data.nbytes} bytes", "target")  # fmt: skip
    return n, k


def _shared(data: np.ndarray, dtype) -> torch.Tensor:
    """The file's bytes as a tensor of `dtype`, sharing the memory map (no copy). torch warns
    on read-only arrays; no layer writes its weights."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(data).view(dtype))


def _fbgemm_usable() -> bool:
    return not forced_fallback() and "fbgemm" in torch.backends.quantized.supported_engines


class PromptSame(torch.nn.Module):
    """A layer whose prompt kernel is its decode kernel."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer, self.out_features, self.act_dtype = layer, layer.out_features, layer.act_dtype
        self.forward = self.prompt_forward = layer.forward  # no extra frame per call


class RowwiseLinear(torch.nn.Module):
    """Float weights [N, K] (fp32, or fp16 dequantized a 512-row tile at a time): one fp32
    matrix-vector product per activation row; prompts multiply bf16 tiles (see module doc)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # [N, K], the file's own tensor
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.act_dtype = weight.shape[0], torch.float32

    def _tiles(self, dtype: torch.dtype):
        for start in range(0, self.out_features, ROW_TILE):
            stop = min(start + ROW_TILE, self.out_features)
            yield start, stop, self.weight[start:stop].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        xf, out = x.float(), torch.empty(x.shape[0], self.out_features)
        if self.weight.dtype == torch.float32:
            for m in range(x.shape[0]):
                torch.mv(self.weight, xf[m], out=out[m])
        else:
            for start, stop, w in self._tiles(torch.float32):
                for m in range(x.shape[0]):
                    torch.mv(w, xf[m], out=out[m, start:stop])
        out = out if self.bias is None else out + self.bias
        return out.to(x.dtype)

    def prompt_forward(self, x: torch.Tensor) -> torch.Tensor:
        xb, out = x.to(torch.bfloat16), torch.empty(x.shape[0], self.out_features, dtype=torch.bfloat16)
        for start, stop, w in self._tiles(torch.bfloat16):
            one_thread_mm(xb, w.T, out[:, start:stop])  # the same bits at any thread count
        out = out.float() if self.bias is None else out.float() + self.bias
        return out.to(x.dtype)


class PromptView(torch.nn.Module):
    """A layer's prompt kernel as its forward (same buffers)."""

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer, self.out_features, self.act_dtype = layer, layer.out_features, layer.act_dtype
        self.forward = layer.prompt_forward


def prompt_view(linear):
    """The same layer (or FusedLinear) running its prompt kernels, for a prompt stack of layers."""
    if isinstance(linear, FusedLinear):
        if linear.fused is not None:
            return FusedLinear.from_layers([PromptView(linear.fused)], linear.sizes)
        return FusedLinear.from_layers([PromptView(p) for p in linear.parts], linear.sizes)
    return PromptView(linear)


# ---- embeddings ---------------------------------------------------------------------------


class QuantEmbedding:
    """Row lookups that decode only the rows asked for, exactly as the gguf reference does."""

    def __init__(self, tensor: QuantTensor):
        self.tensor = tensor
        self.num_embeddings, self.embedding_dim = _matrix_shape(tensor)
        kind = tensor.qtype.name
        self._float = None
        if kind in FLOAT_TYPES:  # rows by indexing, widened to fp32 (exact)
            view = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}[kind]
            self._float = _shared(tensor.data, view).reshape(tensor.shape)
            if kind == "BF16":
                self._float = self._float.view(torch.bfloat16)

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] fp32
        if self._float is not None:
            return self._float[token_ids.cpu()].float().to(token_ids.device)
        index = token_ids.cpu().numpy()
        if self.tensor.qtype.name == "Q8_0":  # d * q, exact in fp32 (an fp16 times an int8): the
            # reference's bits without its per-call cost (~0.25 ms a decode step)
            blocks = np.asarray(self.tensor.data[index]).reshape(len(index), -1, 34)
            d = np.ascontiguousarray(blocks[..., :2]).view(np.float16).astype(np.float32)  # [T, K // 32, 1]
            rows = (blocks[..., 2:].view(np.int8).astype(np.float32) * d).reshape(len(index), self.embedding_dim)
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
    at the price of about twice the head's bytes held (ort_linear.py). Float checkpoints'
    kinds (int8, int4) do not apply to a GGUF head, whose type the file fixes."""
    if kind == "auto":
        return linear_from_quant(tensor)
    if kind != "ort8":
        raise SpecdecError(f"lm_head {kind!r} requantizes a float head; a GGUF head keeps its file's type "
                           "(lm_head auto) or runs on ONNX Runtime (lm_head ort8)", "lm_head")  # fmt: skip
    if tensor.qtype.name not in ORT_TYPES:
        raise SpecdecError(f"lm_head ort8 takes a {', '.join(ORT_TYPES)} head; {tensor.name!r} is "
                           f"{tensor.qtype.name}", "lm_head")  # fmt: skip
    if not ort_8bit_usable():
        raise SpecdecError("lm_head ort8 needs onnxruntime and onnx (pip install 'specdec[cpu]') and a "
                           "batch-invariant MatMulNBits on this cpu", "lm_head")  # fmt: skip
    _matrix_shape(tensor)
    return PromptSame(OrtBlockLinear8(tensor))


def head_copies_weights(tensor: QuantTensor, kind: str = "auto") -> bool:
    """Whether `head_from_quant` copies this tensor (so the loader may drop its mapped pages)."""
    return kind == "ort8" or copies_weights(tensor)


def embedding_from_quant(tensor: QuantTensor):
    """Row lookups: token ids [T] -> [T, hidden] fp32, decoding only those rows."""
    check_type(tensor.name, tensor.qtype)
    return QuantEmbedding(tensor)
