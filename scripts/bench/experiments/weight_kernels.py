"""The native backend's weight kernels side by side (issue 15), on SmolLM2-135M's shapes:
time per op at 1, 2, 4 and 8 rows, a chain of the 120 decoder linears at one row, and batch
invariance per row (row 0 of a one-row call == row 0 of an eight-row call, bit for bit).

    taskset -c 1 python scripts/bench/experiments/weight_kernels.py [--threads 1] [--rounds 15]

Candidates: PyTorch's int4 kernel (`_weight_int4pack_mm_for_cpu`, bf16 activations, the
decoder's default), its int8 kernel (`_weight_int8pack_mm`, the LM head's old path), int8
weights times int8 activations on `torch._int_mm` (one scale per weight row and per input
row: integer sums, so batch-invariant whatever the GEMM's blocking), dense bf16 and fp32
`F.linear`, and, where onnxruntime and onnx are installed, ONNX Runtime's
`MatMulNBits` with 8-bit and 4-bit blocks of 32 at accuracy_level 4 (int8 activations) and 0
(fp32). The candidates are timed in turns, round after round, and each figure is the median
over rounds, so a busy machine slows them alike; compare within one run. Ends with a JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.backends.native.kernels.cpu import cpu_features
from specdec.backends.native.kernels.ort import OrtBlockLinear, ort_available
from specdec.backends.native.kernels.precisions import DenseLinear, Int4Linear, Int8Linear

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
DECODER = ("qkv", "o", "gate_up", "down")
LAYERS = 30
ROWS = (1, 2, 4, 8)


class DynamicInt8Linear(torch.nn.Module):
    """W8A8: int8 weights (a scale per output row) times int8 activations (a scale per input
    row) on torch._int_mm, the int32 sums rescaled in fp32."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
        self.qweight_t = torch.round(weight / self.scale[:, None]).to(torch.int8).contiguous().t()  # [K, N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] fp32 -> [M, N] fp32
        x_scale = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # [M, 1]
        y = torch._int_mm(torch.round(x / x_scale).to(torch.int8), self.qweight_t)
        return y.float() * x_scale * self.scale


def candidates() -> dict:
    """name -> (maker(weight) -> module, input dtype)."""
    out = {
        "torch int4": (Int4Linear.from_float, torch.bfloat16),
        "torch int8": (Int8Linear, torch.bfloat16),
        "torch w8a8 (_int_mm)": (DynamicInt8Linear, torch.float32),
        "dense bf16": (lambda w: DenseLinear(w, dtype=torch.bfloat16), torch.bfloat16),
        "dense fp32": (lambda w: DenseLinear(w, dtype=torch.float32), torch.float32),
    }
    if ort_available():
        for bits in (8, 4):
            for level in (4, 0):
                out[f"ort {bits}-bit acc{level}"] = (
                    lambda w, b=bits, a=level: OrtBlockLinear.from_float(w, bits=b, accuracy_level=a), torch.float32)
    return out


def invariant(layer, dtype, k: int) -> bool:
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    return torch.equal(layer(x[:1].clone())[0], layer(x)[0])


def timed_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1e6 * (time.perf_counter() - start) / calls


def measure(built: dict, rounds: int) -> tuple[dict, dict]:
    """Per-op medians {cand: {shape: [us per row count]}} and chain medians {cand: ms}."""
    inputs = {(name, m): torch.randn(m, SHAPES[name][0]) for name in SHAPES for m in ROWS}
    ops = {c: {n: [[] for _ in ROWS] for n in SHAPES} for c in built}
    chain = {c: [] for c in built}
    for _ in range(rounds):
        for cand, (layers, dtype) in built.items():
            for name in SHAPES:
                for j, m in enumerate(ROWS):
                    x, f = inputs[name, m].to(dtype), layers[name]
                    f(x)
                    ops[cand][name][j].append(timed_us(lambda f=f, x=x: f(x), 2 if name == "lm_head" else 10))
            xs = {n: inputs[n, 1].to(dtype) for n in DECODER}
            chain[cand].append(timed_us(lambda ls=layers, xs=xs: [ls[n](xs[n]) for _ in range(LAYERS) for n in DECODER], 1))
    med = {c: {n: [round(statistics.median(t), 1) for t in per] for n, per in v.items()} for c, v in ops.items()}
    return med, {c: round(statistics.median(t) / 1000, 2) for c, t in chain.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, k, generator=gen) * 0.05 for name, (k, n) in SHAPES.items()}
    built = {}
    for cand, (make, dtype) in candidates().items():
        built[cand] = ({name: make(w) for name, w in weights.items()}, dtype)
    inv = {c: all(invariant(ls[n], dt, SHAPES[n][0]) for n in SHAPES) for c, (ls, dt) in built.items()}
    ops, chain = measure(built, args.rounds)
    print(f"threads {args.threads}; median microseconds per op at {ROWS} rows over {args.rounds} rounds")
    for cand in built:
        print(f"\n{cand}: batch-invariant per row: {inv[cand]}; 120 decoder linears at 1 row: {chain[cand]} ms")
        for name, times in ops[cand].items():
            print(f"  {name:8s} " + " ".join(f"{t:9.1f}" for t in times))
    print(json.dumps({"threads": args.threads, "cpu": sorted(f for f in cpu_features() if "avx" in f or "amx" in f),
                      "invariant": inv, "ops_us": ops, "chain_ms": chain}))


if __name__ == "__main__":
    with torch.no_grad():
        main()
