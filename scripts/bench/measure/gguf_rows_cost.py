"""What M activation rows cost on the native backend's own kernels, over one GGUF file's
matrices (e.g. the synthetic Qwen2.5-1.5B of synthetic_qwen2_gguf.py): the curve that says
how many tokens a verification step scores for about the price of one.

    python scripts/bench/measure/gguf_rows_cost.py FILE [--rows 1,2,4,8,16] [--rounds 15] [--threads 1]
        [--clock cpu] [--by-kernel]

Each matrix is built as a model load builds it (native/timing.py's `file_layers`; a Q4_K
matrix: PyTorch's int4 kernel, bf16 activations; a Q6_K one: the numba kernel on int8
activations), and the Q6_K matrix once more re-quantized to int4 groups (`Int4Linear`: the
fp-arithmetic-on-int4 path on the very same weights). Default matrices: layer 0's ffn_down
(Q6_K in a Q4_K_M file), layer 3's ffn_down (Q4_K, same shape) and layer 0's ffn_gate (Q4_K,
the widest per layer). Per matrix and M: the median ms of one `forward`, the designs in turns,
and its cost relative to M = 1. `--by-kernel`: every matrix of the file instead (the tied
embedding as the head), summed per kernel: the weight kernels' share of a decode step. Ends
with a JSON line (columns and rows: record.py's table) that also names the CPU's int8
features (avx512_vnni, avx_vnni, amx_int8).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.backends.native.kernels.cpu import cpu_features
from specdec.backends.native.kernels.precisions import Int4Linear
from specdec.backends.native.timing import file_layers

MATRICES = ("model.layers.0.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight",
            "model.layers.0.mlp.gate_proj.weight")  # fmt: skip
INT8_FEATURES = ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def designs(layers: dict) -> dict:
    """label -> (forward over [M, K] fp32, K), per matrix as the loader builds it (+ int4 of the 8-bit ones)."""
    out = {}
    for name, (tensor, layer) in layers.items():
        short = name.removeprefix("model.layers.").removesuffix(".weight").replace(".mlp.", " ")
        kernel = "int4 kernel, bf16 act." if tensor.qtype.name.startswith("Q4") else "numba, int8 act."
        label = f"{short} {tensor.qtype.name} {tensor.shape[0]}x{tensor.shape[1]}"
        out[f"{label}: {kernel}"] = (layer.forward, tensor.shape[1])
        if not tensor.qtype.name.startswith("Q4"):
            dense = torch.from_numpy(tensor.dequantize()).reshape(tensor.shape)
            out[f"{label} as int4 groups: int4 kernel"] = (Int4Linear.from_float(dense).forward, tensor.shape[1])
    return out


def kernel_groups(layers: dict) -> dict:
    """kernel label -> (forwards over [M, K], K per forward, MB of file), every matrix of the file."""
    groups: dict = {}
    for tensor, layer in layers.values():
        kernel = "Q4 types: int4 kernel, bf16 act." if tensor.qtype.name.startswith("Q4") else \
            f"{tensor.qtype.name}: numba, int8 act." if tensor.qtype.name != "F32" else "F32"
        forwards, ks, mb = groups.setdefault(kernel, ([], [], [0.0]))
        forwards.append(layer.forward)
        ks.append(tensor.shape[1])
        mb[0] += tensor.data.nbytes / 1e6  # a tied embedding counts once, as the head (its lookups are free)
    return groups


def by_kernel(built: dict) -> dict:
    """One design per kernel: every matrix of that kernel called in turn (the sum of a decode step's calls)."""
    layers = {}
    for kernel, (forwards, ks, mb) in kernel_groups(built).items():
        def run(xs, forwards=forwards):
            for f, x in zip(forwards, xs, strict=True):
                f(x)

        layers[f"{kernel} ({len(forwards)} matrices, {mb[0]:.0f} MB)"] = (run, ks)
    return layers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="a GGUF file (its tensors' HF names: see --matrices)")
    p.add_argument("--matrices", default=",".join(MATRICES))
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--by-kernel", action="store_true", help="every matrix of the file, summed per kernel")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the calling thread's CPU time (with --threads 1: steadier on a shared machine)")  # fmt: skip
    args = p.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts the calling thread only: use --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)  # the native backend's numba kernels follow it
    rows = [int(r) for r in args.rows.split(",")]
    built = file_layers(args.path, None if args.by_kernel else args.matrices.split(","))
    layers = by_kernel(built) if args.by_kernel else designs(built)
    ms = measure(layers, rows, args.rounds, clock)
    features = sorted(f for f in cpu_features() if f in INT8_FEATURES or f.startswith("torch:"))
    print(json.dumps({
        "file": args.path, "threads": args.threads, "clock": args.clock, "cpu_features": features, "ms": ms,
        "columns": ["Kernel (matrices, file MB)" if args.by_kernel else "Matrix: kernel", *(f"M={m}" for m in rows)],
        "rows": [[label, *(f"{t[m]:.3f} ({t[m] / t[rows[0]]:.2f}x)" for m in rows)] for label, t in ms.items()],
    }))  # fmt: skip


def measure(layers: dict, rows: list[int], rounds: int, clock) -> dict:
    """label -> {M: median ms}, every design once per round for each M."""
    out: dict = {label: {} for label in layers}
    for m in rows:
        inputs = {label: [torch.randn(m, n) for n in k] if isinstance(k, list) else torch.randn(m, k)
                  for label, (_, k) in layers.items()}  # [M, K] (a list: one per matrix of a kernel)
        times: dict = {label: [] for label in layers}
        for label, (f, _) in layers.items():
            f(inputs[label])  # warm: first-call compiles, page faults
        for _ in range(rounds):
            for label, (f, _) in layers.items():
                start = clock()
                f(inputs[label])
                times[label].append(clock() - start)
        for label, t in times.items():
            out[label][m] = statistics.median(t) * 1e3
        print(f"M={m}: " + "  ".join(f"{label} {out[label][m]:.3f}" for label in layers), flush=True)
    return out


if __name__ == "__main__":
    main()
