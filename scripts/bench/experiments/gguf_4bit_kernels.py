"""Time the 4-bit GGUF kernel designs on random valid blocks (a short, repeated measurement):
random normal weights encoded in each type (gguf/encode.py's `quantize_blocks`).

Usage: python scripts/bench/experiments/gguf_4bit_kernels.py [--threads 1] [--reps 7]
Prints medians in ms per call for decode rows M = 1..16 and prompt rows M = 128, 512.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType

from specdec.backends.native.gguf.encode import quantize_blocks
from specdec.backends.native.kernels.int4_blocks import ExactQ4Linear, Int4BlockLinear, decode_rows
from specdec.backends.native.kernels.ort import OrtBlockLinear, ort_available


def medians_ms(fns: dict, x: torch.Tensor, reps: int) -> dict:
    """Median ms per call of each function, the functions interleaved within each repetition."""
    times: dict = {name: [] for name in fns}
    for fn in fns.values():
        fn(x)
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[N, bytes per row]: random normal weights encoded in `kind`."""
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize_blocks(weights, GGMLQuantizationType[kind]).reshape(n, -1)


def designs(n: int, k: int) -> dict:
    q4k, q40 = random_blocks("Q4_K", n, k), random_blocks("Q4_0", n, k)
    out = {
        "int4 Q4_K (bf16 scales)": Int4BlockLinear.from_blocks("Q4_K", q4k, k),
        "exact Q4_K (fp32, torch mv)": ExactQ4Linear("Q4_K", q4k, k),
        "int4 Q4_0 (bf16 scales)": Int4BlockLinear.from_blocks("Q4_0", q40, k),
    }
    if ort_available():
        q, d, _, _ = decode_rows("Q4_0", q40)
        out["ort MatMulNBits Q4_0 (fp32 scales, int8 act)"] = OrtBlockLinear(torch.from_numpy(q), torch.from_numpy(d), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for n, k in ((1536, 512), (8960, 1536)):  # Q4_K needs K in 256s: 512 for SmolLM's 576
        layers = designs(n, k)
        print(f"\nN={n} K={k} threads={args.threads}")
        for m in (1, 2, 4, 8, 16, 128, 512):
            fns = {}
            for name, layer in layers.items():
                if m <= 16 or "exact" not in name:
                    fns[name] = layer.forward
                if m > 16 and isinstance(layer, Int4BlockLinear):
                    fns[name + " prompt tiles"] = layer.prompt_forward
            cells = medians_ms(fns, torch.randn(m, k), args.reps)
            print(f"M={m}: " + " | ".join(f"{name}: {ms:.3f}" for name, ms in cells.items()), flush=True)


if __name__ == "__main__":
    main()
