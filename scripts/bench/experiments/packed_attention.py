"""One layer's decode attention for a batch of rows, two ways, interleaved in one process:
each row on its own parallel loop (`attend_parallel`, the path before the packed one) and every
row's work items dealt to the threads together (`attend_packed`). SmolLM2's shape (9 query
heads over 3 kv heads of 64), a bf16 cache of random keys. Medians of `--repeats` calls.

    python scripts/bench/experiments/packed_attention.py --keys 4480 --repeats 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

from specdec.backends.native.kernels.jit import attention as jit_attention
from specdec.backends.native.kernels.numba_ops import numba_threads

HEADS, KV_HEADS, DIM = 9, 3, 64
SCALE = np.float32(DIM**-0.5)


def bf16_bits(rng, shape) -> np.ndarray:
    return (rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def case(rng, caches, keys: int, rows: int, tokens: int, threads: int, repeats: int) -> dict:
    k_cache, v_cache = caches
    n = rows * tokens
    q = rng.standard_normal((n, HEADS, DIM)).astype(np.float32)
    k = rng.standard_normal((n, KV_HEADS, DIM)).astype(np.float32)
    limits = np.tile(np.arange(keys + 1, keys + 1 + tokens, dtype=np.int64), rows)
    paths, starts = np.full((n, 1), -1, np.int64), np.zeros(n, np.int64)
    offsets, slots = np.arange(0, n + 1, tokens), np.arange(rows)

    def per_row():
        for r in range(rows):
            a, b = offsets[r], offsets[r + 1]
            jit_attention.attend_parallel(q[a:b], k[a:b], k[a:b], k_cache, v_cache, r, -1, limits[a:b],
                                          paths[a:b], starts[a:b], SCALE, threads)

    def packed():
        jit_attention.attend_packed(q, k, k, k_cache, v_cache, slots, offsets, limits, paths, starts, SCALE,
                                    threads)

    times = {"per row": [], "packed": []}
    for round_ in range(repeats + 1):
        for name, call in (("per row", per_row), ("packed", packed)):
            t0 = time.perf_counter()
            call()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: round(1e6 * statistics.median(ts)) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=4480)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    threads = numba_threads()
    rng = np.random.default_rng(0)
    caches = (bf16_bits(rng, (4, KV_HEADS, DIM, args.keys + 64)),
              bf16_bits(rng, (4, KV_HEADS, args.keys + 64, DIM + 1)))
    rows = []
    for batch, tokens in ((1, 1), (2, 1), (4, 1), (1, 4), (4, 4)):
        us = case(rng, caches, args.keys, batch, tokens, threads, args.repeats)
        rows.append([f"{batch} x {tokens}", us["per row"], us["packed"]])
        print(f"{batch} x {tokens}: per row {us['per row']} us, packed {us['packed']} us", flush=True)
    print(json.dumps({"columns": ["rows x tokens", "per row (us)", "packed (us)"], "rows": rows,
                      "keys": args.keys, "threads": threads}))


if __name__ == "__main__":
    main()
