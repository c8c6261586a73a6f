"""This machine's two rates that bound a forward: memory read bandwidth and int8 multiply-adds
per second on the instructions the native kernels use (jit/ir.py's `dot4`: vpdpbusd with
AVX-512 VNNI, pmaddubsw on AVX2), each at 1 and at N threads; the roofline in
docs/performance-notes.md divides a forward's bytes and multiply-adds by them.

    python scripts/bench/measure/machine_rates.py [--threads 2] [--mib 512] [--rounds 5]

- bandwidth: a parallel sum over a buffer far larger than the caches (GB/s, best of rounds);
- int8 rate: per thread, eight independent chains of `dot4` over weights cycling through L1
  (so nothing is hoisted), 64 multiply-adds each (G MAC/s, best of rounds).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, set_num_threads, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.ir import DOT, const, data_pointer, dot4, i8, i32, int_sum, load, vec
from specdec.backends.native.kernels.numba_ops import numba_threads

CHAINS = 8  # independent accumulators: the dot's latency hidden behind its throughput
WEIGHTS = 16  # weight vectors cycled through (1 KiB: L1)


@intrinsic
def _dot_loop(typingctx, weights, x, iterations):
    """sum over `iterations` of CHAINS dot4s of a cycling weight vector by x: an int32."""

    def codegen(context, b, signature, args):
        wp, xp = data_pointer(context, b, signature, args, 0), data_pointer(context, b, signature, args, 1)
        xs = [load(b, xp, const(64 * c), vec(i8, 64)) for c in range(CHAINS)]
        accs = [cgutils.alloca_once_value(b, ir.Constant(vec(i32, 16), None)) for _ in range(CHAINS)]
        with cgutils.for_range(b, args[2]) as loop:
            for c in range(CHAINS):
                slot = b.and_(b.add(b.mul(loop.index, const(CHAINS)), const(c)), const(WEIGHTS - 1))
                w = load(b, wp, b.mul(slot, const(64)), vec(i8, 64))
                # the sum enters the dot as its accumulator (vpdpbusd's own): with `acc + dot`,
                # LLVM summed the loop's periodic terms in closed form (15x the machine's peak)
                b.store(dot4(b, w, False, 1, xs[c], b.load(accs[c])), accs[c])
        total = b.load(accs[0])
        for acc in accs[1:]:
            total = b.add(total, b.load(acc))
        return int_sum(b, total)

    return types.int32(weights, x, iterations), codegen


@njit(parallel=True, nogil=True)
def _dot_rate(weights, x, iterations, threads):  # pragma: no cover - compiled
    out = np.zeros(threads, np.int64)
    for t in prange(threads):
        out[t] = _dot_loop(weights[t], x[t], iterations)
    return out


@njit(parallel=True, nogil=True)
def _read(buffer, chunks):  # pragma: no cover - compiled
    words = buffer.view(np.int32)
    size = words.shape[0] // chunks
    out = np.zeros(chunks, np.int32)
    for c in prange(chunks):
        # a slice per chunk: indexing the whole buffer from c * size kept the loop scalar (a
        # third of the bandwidth, and no faster on a buffer that fits in the L3)
        chunk = words[c * size : (c + 1) * size]
        total = np.int32(0)
        for i in range(chunk.shape[0]):
            total += chunk[i]
        out[c] = total
    return out


def bandwidth(threads: int, mib: int, rounds: int) -> float:
    set_num_threads(threads)
    buffer = np.random.default_rng(0).integers(0, 255, mib << 20, dtype=np.uint8)
    _read(buffer, 64)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        _read(buffer, 64)
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best / 1e9


def int8_rate(threads: int, rounds: int, iterations: int = 20_000_000) -> float:
    set_num_threads(threads)
    rng = np.random.default_rng(1)
    weights = rng.integers(-64, 64, (threads, WEIGHTS * 64), dtype=np.int8)
    x = rng.integers(-64, 64, (threads, CHAINS * 64), dtype=np.int8)
    _dot_rate(weights, x, 1000, threads)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        _dot_rate(weights, x, iterations, threads)
        best = min(best, time.perf_counter() - start)
    return threads * iterations * CHAINS * 64 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    numba_threads()
    rows = []
    for threads in sorted({1, args.threads}):
        rows.append({"threads": threads, "read GB/s": round(bandwidth(threads, args.mib, args.rounds), 1),
                     f"int8 G MAC/s ({DOT})": round(int8_rate(threads, args.rounds), 1)})
        print(rows[-1], flush=True)
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "dot": DOT,
                      "rates": rows, "columns": ["Threads", "read GB/s", f"int8 G multiply-adds/s ({DOT})"],
                      "rows": [list(row.values()) for row in rows]}))


if __name__ == "__main__":
    main()
