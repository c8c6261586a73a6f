"""The native backend's numba kernels (jit/attention.py, jit/norms.py) on tensors, and when they run.

- Attention: one kernel per layer computes each query on its own, so batch-invariant by
  construction (attention.py states the contract it shares with the PyTorch routine). A
  query reads the keys and values of its slot up to its limit, then, for a token tree, its
  ancestors' (and its own) from the tree's nodes, in order of position. Every reduction runs
  in that order, in float32 with separate multiplies and adds (numba compiles without
  fastmath, so LLVM neither reassociates nor fuses them), and the vectorised loops run across
  keys or value columns, never across a reduction. A query's bits therefore do not depend on
  how many queries share the call, nor on whether its keys came from the cache or from the
  tree's nodes. exp is written out in the same basic arithmetic (a libm call would not
  vectorise, and a vector exp could round differently in a loop's remainder). The kv heads
  run on numba's threads (as many as torch's) where a thread-safe layer (OpenMP, TBB) loads.
- RMSNorm into bf16 (the int4 and int8 kernels' input) in one call per norm, row by row; the
  q|k|v projection split, converted to fp32 and rotated in one call; SwiGLU in one call.

numba is optional (the `cpu` extra); without it, or with SPECDEC_CPU_KERNELS=fallback, the
native backend runs PyTorch ops (SPECDEC_ATTENTION=torch picks the PyTorch attention alone).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from specdec.backends.native.kernels.cpu import forced_fallback

CHOICE_ENV = "SPECDEC_ATTENTION"


@functools.cache
def importable() -> bool:
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


# Caches the kernel reads: fp32, and bf16 as its bits (jit/kv.py widens them). fp16 takes the
# PyTorch routine.
KERNEL_KV_DTYPES = (torch.float32, torch.bfloat16)


def usable(device: torch.device, kv_dtype: torch.dtype) -> bool:
    """Whether a cache on `device` holding `kv_dtype` is attended by the kernel
    (SPECDEC_ATTENTION=torch picks the PyTorch routine, for comparisons)."""
    if os.environ.get(CHOICE_ENV, "").lower() == "torch" or forced_fallback():
        return False
    return device.type == "cpu" and kv_dtype in KERNEL_KV_DTYPES and importable()


def cache_array(cache: torch.Tensor) -> np.ndarray:
    """A cache tensor as the kernels take it: fp32 as it is, bf16 as its bits (uint16; numpy
    has no bf16). A view either way: the kernels write into the tensor's memory."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.uint16).numpy()
    if cache.dtype != torch.float32:  # fp16 bits would be read as bf16's
        raise ValueError(f"the attention kernel reads fp32 and bf16 caches, not {cache.dtype}")
    return cache.numpy()


# Below this many (keys x query heads) a call stays on the calling thread: starting numba's
# threads costs more than they save on short contexts (same bits either way).
PARALLEL_WORK = 4096


@functools.cache
def numba_threads() -> int:
    """Run numba's parallel loops on as many threads as torch's where a thread-safe threading
    layer (OpenMP or TBB) loads; returns the count (1: none loads, parallel loops run serially).
    Called before any parallel kernel runs, since the layer is chosen at its first launch."""
    threads = torch.get_num_threads()
    try:
        return _set_numba_threads(threads)
    finally:
        # starting numba's OpenMP pool resets the process's OpenMP count to every core, which
        # is torch's too: a process set to one thread ran its GEMMs on two
        torch.set_num_threads(threads)


def _set_numba_threads(threads: int) -> int:
    import numba

    if threads > 1:
        numba.config.THREADING_LAYER = "threadsafe"
        try:
            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
            return numba.get_num_threads()
        except (ValueError, RuntimeError):  # no thread-safe layer here
            pass
    numba.set_num_threads(1)  # numba's default is every core
    return 1


@functools.cache
def _compiled() -> tuple:
    """((attend, rotate_attend, norm_rotate_attend) on the calling thread, the same on numba's
    threads): the second where numba_threads() runs more than one thread, else the first."""
    threads = numba_threads()
    import specdec.backends.native.kernels.jit.attention as jit  # compiles, or loads from disk

    serial = jit.attend, jit.rotate_attend, jit.norm_rotate_attend
    parallel = tuple(functools.partial(_with_threads, kernel, threads) for kernel in (
        jit.attend_parallel, jit.rotate_attend_parallel, jit.norm_rotate_attend_parallel))
    return (serial, parallel) if threads > 1 else (serial, serial)


def _with_threads(kernel, threads: int, *args):
    """A parallel kernel called with its serial twin's arguments, plus the thread count its work
    items are dealt to."""
    return kernel(*args, threads)


def _kernels(limits: np.ndarray, query_heads: int) -> tuple:
    serial, parallel = _compiled()
    return parallel if int(limits[-1]) * query_heads >= PARALLEL_WORK else serial


def attend_kernel(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot: int, store: int, limits: np.ndarray, paths: np.ndarray,
                  starts: np.ndarray | None = None, scale: float | None = None) -> torch.Tensor:
    """The kernel on tensors (see jit/attention.attend for the shapes; starts None: every query from key
    0; scale None: head_dim ** -0.5); returns [T, heads, dim]."""
    attend = _kernels(limits, q.shape[0] * q.shape[1])[0]
    starts = np.zeros_like(limits) if starts is None else starts
    return torch.from_numpy(attend(q.numpy(), k_new.numpy(), v_new.numpy(), cache_array(k_cache),
                                   cache_array(v_cache), slot, store, limits, paths, starts,
                                   _scale(scale, q.shape[-1])))


def _scale(scale: float | None, dim: int) -> np.float32:
    return np.float32(dim**-0.5 if scale is None else scale)


@torch.library.custom_op("specdec::attend", mutates_args=())
def attend_op(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot: int, limits: torch.Tensor, paths: torch.Tensor,
              starts: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel as compiled graphs call it (dynamo cannot trace numba); the graph has stored
    the row's keys and values already."""
    return attend_kernel(q, k_new, v_new, k_cache, v_cache, slot, -1, limits.numpy(), paths.numpy(),
                         starts.numpy(), scale)


@attend_op.register_fake
def _(q, k_new, v_new, k_cache, v_cache, slot, limits, paths, starts, scale):
    return q.new_empty(q.shape)


def fast_layer_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a layer whose kernels take `dtype` on `device` runs its norms (rms_norm_bf16),
    its q/k/v split and rotation (split_rotate) and its SwiGLU (silu_mul_bf16) as numba calls."""
    return dtype == torch.bfloat16 and device.type == "cpu" and not forced_fallback() and importable()


def split_rotate(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
                 kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (heads + 2 kv_heads) * dim] bf16 -> rotated q, k and v in fp32
    (jit/norms.split_rotate)."""
    q, k, v = _norms().split_rotate(qkv.view(torch.uint16).numpy(), cos.numpy(), signed_sin.numpy(), heads,
                                    kv_heads)
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)


def silu_mul_bf16(gate_up: torch.Tensor) -> torch.Tensor:
    """The fused gate|up projection [N, 2 I] bf16 -> silu(gate) * up [N, I] bf16
    (jit/norms.silu_mul_bf16)."""
    return torch.from_numpy(_norms().silu_mul_bf16(gate_up.contiguous().view(torch.uint16).numpy())).view(
        torch.bfloat16)


def rotate_attend(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int, kv_heads: int,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, store: int, limits: np.ndarray,
                  paths: np.ndarray, starts: np.ndarray | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """split_rotate, attend_kernel and the cast to bf16 in one call (jit/attention.rotate_attend), for a
    chain row: qkv [T, (heads + 2 kv_heads) * dim] bf16 -> [T, heads * dim] bf16."""
    kernel = _kernels(limits, qkv.shape[0] * heads)[1]
    starts = np.zeros_like(limits) if starts is None else starts
    bits = kernel(qkv.view(torch.uint16).numpy(), cos.numpy(), signed_sin.numpy(), heads, kv_heads,
                  cache_array(k_cache), cache_array(v_cache), slot, store, limits, paths, starts,
                  _scale(scale, cos.shape[-1]))
    return torch.from_numpy(bits).view(torch.bfloat16)


def norm_rotate_attend(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
                       kv_heads: int, norms: tuple[torch.Tensor, torch.Tensor] | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot: int, store: int,
                       limits: np.ndarray, paths: np.ndarray, starts: np.ndarray | None = None,
                       scale: float | None = None) -> torch.Tensor:
    """split_norm_rotate and attend_kernel in one call (jit/attention.norm_rotate_attend), for a chain
    row: qkv [T, (heads + 2 kv_heads) * dim] fp32 -> [T, heads * dim] fp32."""
    kernel = _kernels(limits, qkv.shape[0] * heads)[2]
    starts = np.zeros_like(limits) if starts is None else starts
    q_weight, k_weight = norms if norms is not None else (_NO_NORM, _NO_NORM)
    out = kernel(qkv.contiguous().numpy(), cos.numpy(), signed_sin.numpy(), heads, kv_heads,
                 q_weight.numpy(), k_weight.numpy(), np.float32(eps), cache_array(k_cache),
                 cache_array(v_cache), slot, store, limits, paths, starts, _scale(scale, cos.shape[-1]))
    return torch.from_numpy(out)


def add_rms_norm_bf16(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, hidden] fp32 + delta [N, hidden] bf16 -> (the fp32 sum, rms_norm_bf16 of it)."""
    total, bits = _norms().add_rms_norm_bf16(x.numpy(), delta.view(torch.uint16).numpy(), weight.numpy(),
                                             np.float32(eps))
    return torch.from_numpy(total), torch.from_numpy(bits).view(torch.bfloat16)


def fast_norms_usable(device: torch.device) -> bool:
    """Whether fp32 norms on `device` run as numba calls (rms_norm_f32, split_norm_rotate)."""
    return device.type == "cpu" and not forced_fallback() and importable()


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden] fp32 -> RMSNorm(x) * weight [N, hidden] fp32 (jit/norms.rms_norm_f32)."""
    return torch.from_numpy(_norms().rms_norm_f32(x.contiguous().numpy(), weight.numpy(), np.float32(eps)))


_NO_NORM = torch.empty(0)


def split_norm_rotate(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                      norms: tuple[torch.Tensor, torch.Tensor] | None,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [N, (heads + 2 kv_heads) * dim] fp32 -> rotated q, k (each head RMS-normed first when
    `norms` gives the q and k weights) and v, fp32 (jit/norms.split_norm_rotate)."""
    q_weight, k_weight = norms if norms is not None else (_NO_NORM, _NO_NORM)
    q, k, v = _norms().split_norm_rotate(qkv.contiguous().numpy(), cos.numpy(), sin.numpy(), heads, kv_heads,
                                       q_weight.numpy(), k_weight.numpy(), np.float32(eps))
    return torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, hidden] fp32 -> RMSNorm(x) * weight [N, hidden] bf16 (jit/norms.rms_norm_bf16)."""
    return torch.from_numpy(_norms().rms_norm_bf16(x.numpy(), weight.numpy(), np.float32(eps))).view(
        torch.bfloat16)


@functools.cache
def _norms():
    numba_threads()  # the threading layer and count, before any kernel module loads
    import specdec.backends.native.kernels.jit.norms as norms  # compiles the kernels, or loads them from disk

    return norms
