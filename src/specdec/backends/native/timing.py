"""A small documented hook of the native backend for kernel timings.

The benchmarks under scripts/bench reach the kernels through these functions (beside the
public API: `make_backend`, `NativeModel`, `read_gguf`), never through the kernel modules
themselves: a refactor of kernels/ changes this file, and tests/test_timing_hook.py checks
that it still does what it says. The backend never calls it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from specdec.backends.native.gguf.layers import linear_from_quant
from specdec.backends.native.gguf.reader import read_gguf
from specdec.backends.native.kernels import attention, cpu, kv_layout
from specdec.backends.native.kernels.int4_blocks import unpack_tile_t_jit
from specdec.backends.native.kernels.int8_blocks import BlockLinear8, quantized
from specdec.backends.native.kernels.numba_ops import attend_kernel, importable, numba_threads, rms_norm_f32
from specdec.backends.native.model.config import KVRow
from specdec.backends.native.model.one_call import glu_mul
from specdec.backends.native.quant_types import Q, quant_type
from specdec.gguf_file import QuantTensor

Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (x, w_t, out) -> out
Layer = torch.nn.Module  # kernels/linear.Linear: forward and prompt_forward, x [M, K] -> [M, N]


def load_kernels() -> int:
    """Set numba's threading layer and thread count (torch's: set that first), then run each
    numba kernel module of the backend (kernels/jit) once on tiny inputs, which compiles it or
    loads it from numba's disk cache, so that what is timed next excludes compilation (a
    kernel typed by its arguments may still compile for other types at its first real call).
    Returns numba's thread count; 0 where numba does not run (not installed, or
    SPECDEC_CPU_KERNELS=fallback: PyTorch runs)."""
    if not importable() or cpu.forced_fallback():
        return 0
    threads = numba_threads()
    for qtype in (Q.Q8_0, Q.Q6_K):  # jit/tiles16.py, jit/supertiles.py and their activations
        qt = quant_type(qtype)
        blocks = np.zeros((16, 256 // qt.block * qt.block_bytes), np.uint8)
        matrix_call(QuantTensor("w", qtype, (16, 256), blocks), np.ones((1, 256), np.float32))()
    rms_norm_f32(torch.ones(1, 8), torch.ones(8), 1e-6)  # jit/norms.py
    glu_mul(torch.ones(1, 2), False)  # jit/layer.py
    unpack_tile_t_jit(torch.zeros(64, 16, dtype=torch.uint8), torch.ones(1, 64, 2))  # jit/int4_unpack.py
    row = torch.ones(1, 1, 4)  # one query of one head, its key stored at 0 and read: jit/attention.py
    keys, values = attention.new_cache((1,), 1, 1, 4)
    attend_kernel(row, row, row, keys, values, 0, 0, np.ones(1, np.int64), np.full((1, 1), -1, np.int64))
    return threads


def file_layers(path: str | Path, names: list[str] | None = None) -> dict[str, tuple[QuantTensor, Layer]]:
    """name -> (tensor, layer) for every matrix (2-D tensor) of a GGUF file, or for `names`,
    under the Hugging Face names `read_gguf` gives them; each layer is built as a model load
    builds it, at the file's own type. Time M activation rows through `layer.forward` (x [M, K]
    fp32 -> [M, N]); `layer.prompt_forward` is what a prompt chunk runs."""
    tensors = read_gguf(path).tensors
    chosen = names if names is not None else [name for name, t in tensors.items() if len(t.shape) == 2]
    return {name: (tensors[name], linear_from_quant(tensors[name])) for name in chosen}


def matrix_call(tensor: QuantTensor, x: np.ndarray) -> Callable[[], np.ndarray]:
    """The call a decode step makes per matrix of a quantized type (Q8_0, Q5_0, Q5_1, Q4_0,
    Q4_1, Q6_K, Q5_K, Q4_K) on the numba kernel: the activations x [M, K] are quantized to int8
    once, here; each call of the result multiplies them by `tensor` [N, K] into one [M, N] fp32
    buffer and returns it (the same buffer every call)."""
    if not importable():
        raise RuntimeError("matrix_call times the numba kernel: install numba (the cpu extra)")
    layer = BlockLinear8(tensor, kernel="numba")
    activations = quantized(np.ascontiguousarray(x, np.float32), layer.small_blocks)
    out = np.empty((x.shape[0], layer.out_features), np.float32)

    def call() -> np.ndarray:
        layer.matmul_into(activations, out, 0)
        return out

    return call


@contextlib.contextmanager
def prompt_gemm(mm: Gemm | None) -> Iterator[int]:
    """Within the block, the backend's prompt GEMMs run `mm(x, w_t, out)` (out [M, N] = x [M, K]
    @ w_t [K, N], returning out) instead of kernels/cpu.one_thread_mm, the one-thread GEMM that
    keeps their bits independent of the thread count: for timing other schemes. Every loaded
    module of the backend that calls it is switched, and switched back on exit; build the model
    first, so that its layers' modules are loaded. Yields how many modules were switched (0
    where `mm` is None: the backend's own GEMM)."""
    own = cpu.one_thread_mm
    callers = [] if mm is None else [
        module for name, module in list(sys.modules.items())
        if name.startswith("specdec.backends.native.") and module is not cpu
        and getattr(module, "one_thread_mm", None) is own
    ]
    for module in callers:
        module.one_thread_mm = mm
    try:
        yield len(callers)
    finally:
        for module in callers:
            module.one_thread_mm = own


def attention_pass(cached: int, new: int, heads: int, kv_heads: int, dim: int, masked: bool,
                   seed: int = 0) -> Callable[[], torch.Tensor]:
    """One layer's attention for `new` queries after `cached` keys of a bf16 cache (random
    values), as a forward runs it: `masked` as one causal SDPA pass over a mask (the PyTorch
    path for prompt chunks), else each query on its own with a chain's plan (the numba kernel
    where it runs). Each call stores the new keys and values and returns [new, heads, dim]."""
    gen = torch.Generator().manual_seed(seed)
    length = cached + new
    k_cache, v_cache = attention.new_cache((1,), kv_heads, length, dim, dtype=torch.bfloat16)
    keys = torch.randn(kv_heads, dim, cached, generator=gen).bfloat16()
    kv_layout.store_keys(k_cache[0], 0, keys.transpose(1, 2))
    kv_layout.store_values(v_cache[0], 0, torch.randn(kv_heads, cached, dim, generator=gen).bfloat16())
    q, k, v = (torch.randn(new, n, dim, generator=gen) for n in (heads, kv_heads, kv_heads))
    mask = torch.ones(new, length, dtype=torch.bool).tril(cached)
    plan = attention.plan_chain(length, new, heads // kv_heads, q.device, attention.uses_kernel("cpu"))

    def call() -> torch.Tensor:
        row = (KVRow(0, 0, new, cached, length, mask) if masked
               else KVRow(0, 0, new, cached, length, None, plan=plan))
        return attention.attention(q, k, v, k_cache, v_cache, [row], True)

    return call
