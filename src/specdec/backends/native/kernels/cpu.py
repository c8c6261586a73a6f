"""What this CPU offers, for choosing the native backend's kernels.

`SPECDEC_CPU_KERNELS=fallback` forces the pure-PyTorch paths everywhere (what a CPU without
the fast paths' features runs), so a test or a user can compare the two on one machine.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform

import torch

FORCE_ENV = "SPECDEC_CPU_KERNELS"


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (avx2, avx512_vnni, amx_int8, ...), plus
    PyTorch's own dispatch level ("torch:AVX512", "torch:AVX2", ...); empty where unknown."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
    if capability:
        flags.add(f"torch:{capability}")
    return frozenset(flags)


@contextlib.contextmanager
def one_thread():
    """Run the block's PyTorch ops on one thread. oneDNN's and MKL's GEMMs split their work by
    the thread count, and at some shapes then sum K in another order (on an AMX Xeon: bf16
    [128, 1536] @ [1536, 512], fp32 from 4 rows), so a GEMM whose bits must not depend on
    the process's count runs on one thread (one_thread_mm)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = x [M, K] @ w_t [K, N] on one thread, in bits that do not depend on the
    process's thread count (one_thread's reason). A pool of one-thread column blocks, and a
    dedicated one-thread worker, kept more cores busy but measured slower on two cores
    (docs/performance-notes.md; scripts/bench/experiments/prompt_gemm_threads.py)."""
    with one_thread():
        return torch.mm(x, w_t, out=out)


@torch.library.custom_op("specdec::one_thread_mm", mutates_args=())
def one_thread_mm_op(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """one_thread_mm as compiled graphs call it: Dynamo cannot trace set_num_threads, and
    Inductor's own mm would split K by the thread count (fp32 chains on an AMX Xeon)."""
    return one_thread_mm(x, w_t, x.new_empty(x.shape[0], w_t.shape[1]))


@one_thread_mm_op.register_fake
def _(x, w_t):
    return x.new_empty(x.shape[0], w_t.shape[1])  # [M, N]


_MARKED: list[tuple[type, str]] | None = []  # methods still plain; None once compiling has begun


class eager_in_graphs:  # noqa: N801 - a decorator
    """Marks a layer method that compiled graphs must call eagerly (numba, numpy, ONNX Runtime,
    an op Dynamo cannot trace). torch.compiler.disable on the class would import torch._dynamo
    with the module, about 2 s of every process's start; `disable_marked_in_graphs` wraps the
    marked methods when a model is first compiled instead, and eager calls run them plain."""

    def __init__(self, method):
        self.method = method

    def __set_name__(self, owner: type, name: str) -> None:
        if _MARKED is None:  # compiling has begun: wrapped at once
            setattr(owner, name, torch.compiler.disable(self.method))
            return
        setattr(owner, name, self.method)
        _MARKED.append((owner, name))


def disable_marked_in_graphs() -> None:
    """Before a first torch.compile: each marked method becomes torch.compiler.disable's
    wrapper of itself, and methods marked later are wrapped as they are defined."""
    global _MARKED
    if _MARKED is None:
        return
    for owner, name in _MARKED:
        setattr(owner, name, torch.compiler.disable(owner.__dict__[name]))
    _MARKED = None


def forced_fallback() -> bool:
    return os.environ.get(FORCE_ENV, "").lower() == "fallback"


def has_int4_kernel() -> bool:
    """PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) is built for x86 and arm64."""
    if forced_fallback():
        return False
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and platform.machine().lower() in (
        "x86_64", "amd64", "aarch64", "arm64")


@functools.cache
def gemm_rows_independent(dtype: torch.dtype, k: int = 512, n: int = 320) -> bool:
    """Whether PyTorch's GEMM in `dtype`, [M, k] @ [k, n], gives each row of its first operand
    the same bits however many rows share the call (checked once per process and shape at a
    few row counts on random values: it depends on the library's kernels for this CPU and
    shape; oneDNN's fp32 takes a GEMV path for one row, for one). Where it does, a prefill may
    run several chunks through one GEMM."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(300, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    def mm(rows: torch.Tensor) -> torch.Tensor:  # as the prompt GEMMs run
        return one_thread_mm(rows, w, torch.empty(rows.shape[0], n, dtype=dtype))

    whole = mm(x)
    return all(torch.equal(mm(x[lo:hi]), whole[lo:hi]) for lo, hi in ((0, 1), (5, 12), (128, 300), (7, 135)))
