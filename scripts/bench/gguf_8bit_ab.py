"""The numba GGUF K-quant kernels (gguf_jit_8bit.py) of this tree against another tree's, in
one process, in turns.

    git worktree add /tmp/base HEAD~1
    python scripts/bench/gguf_8bit_ab.py --base /tmp/base [--threads 2] [--cases ...]

Each case is KIND:N:K:M (Q6_K or Q5_K; N x K weights, M activation rows) on random blocks.
Both modules compile (or load) their own cached kernels; per case the two `matmul` calls
alternate, and both must write the same bits (both trees from the K-quants' move to
`vpdpbusd` on: the activations and the call are this tree's). The default cases are 1.5B-sized matrices from
memory. Prints each case's medians and ends with a JSON line. (The blocks of 32 run on
gguf_jit_rows16.py with another arithmetic: `gguf_matrix_time.py` times them per tree.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_CASES = "Q6_K:131072:1536:1,Q5_K:131072:1536:1,Q6_K:131072:1536:4"
# bytes per block, elements per block, fp32 table entries per block (gguf_kernels_8bit's tables)
LAYOUT = {"Q6_K": (210, 256, 1), "Q5_K": (176, 256, 2)}


def load_base(tree: Path):
    path = tree / "src/specdec/backends/native/gguf_jit_8bit.py"
    spec = importlib.util.spec_from_file_location("base_gguf_jit_8bit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_case(mods: dict, case: str, seconds: float) -> dict:
    qtype, n, k, m = case.split(":")
    n, k, m = int(n), int(k), int(m)
    width, span, per_block = LAYOUT[qtype]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (n, k // span * width), dtype=np.uint8)
    table = rng.random((n, k // span * per_block), dtype=np.float32)
    x = rng.standard_normal((m, k), dtype=np.float32)
    from specdec.backends.native import gguf_jit_quant as quant

    xq, xs = np.empty((m, k), np.int8), np.empty((m, k // span), np.float32)
    xsum, xsum4 = np.empty((m, k // 32), np.int32), np.empty((m, k // 4), np.int32)
    quant.quantize_rows_k(x, xq, xs, xsum, xsum4)
    outs = {name: np.empty((m, n), np.float32) for name in mods}
    kinds = {name: mod.KIND_CODES[qtype.lower()] for name, mod in mods.items()}  # each tree's own codes
    calls = {name: (lambda mod=mod, y=outs[name], kind=kinds[name]:
                    mod.matmul(kind, raw, table, k // span, xq, xs, xsum, xsum4, y, 0)) for name, mod in mods.items()}  # fmt: skip
    times = {name: [] for name in mods}
    rounds = max(20, min(400, int(seconds * 4e8 // raw.nbytes)))
    for i in range(rounds):
        for name in list(mods) if i % 2 else list(mods)[::-1]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    if not np.array_equal(outs["this"], outs["base"], equal_nan=True):
        raise SystemExit(f"{case}: the two trees' kernels wrote different bits")
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"this_ms": round(medians["this"], 3), "base_ms": round(medians["base"], 3),
            "ratio": round(medians["this"] / medians["base"], 2), "rounds": rounds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, type=Path, help="the other tree's root")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--seconds", type=float, default=1.0, help="scales the rounds per case")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from specdec.backends.native import jit_ops

    jit_ops.numba_threads()  # the threading layer and count, before either module's first launch
    import specdec.backends.native.gguf_jit_8bit as this

    mods = {"this": this, "base": load_base(args.base)}
    rows = []
    for case in args.cases.split(","):
        r = run_case(mods, case, args.seconds)
        print(f"{case}: this {r['this_ms']} ms, base {r['base_ms']} ms, {r['ratio']}x")
        rows.append([case, f"{r['this_ms']:.3f}", f"{r['base_ms']:.3f}", f"**{r['ratio']:.2f}x**"])
    print(json.dumps({"threads": args.threads, "base": str(args.base),
                      "columns": ["Case (type:N:K:M)", "This tree ms (median)", "Base ms (median)", "Ratio"],
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
