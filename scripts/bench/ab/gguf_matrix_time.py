"""Hot time of one GGUF matrix call on the native 8-bit kernels, per case; run it once per
tree, in turns, to compare two trees whose kernels compute different bits.

    PYTHONPATH=TREE/src python scripts/bench/ab/gguf_matrix_time.py [--threads 2] [CASE ...]

A case is KIND:N:K:M (Q8_0, Q5_0, Q5_1, Q6_K or Q5_K; N x K random weights encoded in the
type, M activation rows). Each case warms up, then takes the median of 7 timings of
`--reps` calls of the numba kernel on activations quantized once (the call a decode step
makes per matrix: native/timing.py's `matrix_call`, so both trees need that hook). Prints
microseconds per call and nanoseconds per block of 32 and output row per thread, and ends
with a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.backends.native.timing import load_kernels, matrix_call
from specdec.gguf_file import QuantTensor

DEFAULT_CASES = ["Q5_0:4096:640:1", "Q5_1:3072:576:1", "Q8_0:4096:640:1", "Q5_0:3072:576:2", "Q5_0:3072:576:8"]


def time_case(case: str, reps: int) -> dict:
    qtype, n, k, m = case.split(":")
    n, k, m = int(n), int(k), int(m)
    rng = np.random.default_rng(0)
    raw = quantize_blocks(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
    call = matrix_call(QuantTensor("w", GGMLQuantizationType[qtype], (n, k), raw),
                       rng.standard_normal((m, k)).astype(np.float32))
    for _ in range(20):
        call()
    timings = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        timings.append((time.perf_counter() - start) / reps)
    return {"case": case, "us": round(statistics.median(timings) * 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cases", nargs="*", default=DEFAULT_CASES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    threads = load_kernels() or 1  # numba's threading layer and count (torch's), the kernels compiled
    results = []
    for case in args.cases:
        r = time_case(case, args.reps)
        _, n, k, m = case.split(":")
        per_block = r["us"] * 1e3 * threads / (int(n) * int(k) // 32 * int(m))
        print(f"{case}: {r['us']} us, {per_block:.2f} ns per block-row per thread")
        results.append(r)
    print(json.dumps({"threads": threads, "results": results}))


if __name__ == "__main__":
    main()
