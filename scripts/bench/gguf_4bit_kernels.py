"""Time the 4-bit GGUF kernel designs on random valid blocks (a short, repeated measurement).

Usage: python scripts/bench/gguf_4bit_kernels.py [--threads 1] [--reps 7]
Prints medians in ms per call for decode rows M = 1..16 and prompt rows M = 128, 512.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from specdec.backends.native.gguf_q4 import ExactQ4Linear, Int4BlockLinear, decode_rows  # noqa: E402
from specdec.backends.native.ort_linear import OrtBlockLinear, ort_available  # noqa: E402
from test_gguf_kernels import random_tensor  # noqa: E402


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


def designs(n: int, k: int) -> dict:
    q4k, q40 = random_tensor("Q4_K", n, k), random_tensor("Q4_0", n, k)
    out = {
        "int4 Q4_K (bf16 scales)": Int4BlockLinear.from_blocks("Q4_K", q4k.data, k),
        "exact Q4_K (fp32, torch mv)": ExactQ4Linear("Q4_K", q4k.data, k),
        "int4 Q4_0 (bf16 scales)": Int4BlockLinear.from_blocks("Q4_0", q40.data, k),
    }
    if ort_available():
        q, d, _, _ = decode_rows("Q4_0", q40.data)
        out["ort MatMulNBits Q4_0 (fp32 scales, int8 act)"] = OrtBlockLinear(torch.from_numpy(q), torch.from_numpy(d), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
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
