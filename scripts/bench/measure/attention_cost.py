"""What scoring n tokens costs at a given context on the native backend (eager): the time of
one target forward of n = 1, 2, 4, 8 tokens after contexts of 100, 1000 and 3000 tokens, and
each n's cost relative to one token.

    python scripts/bench/measure/attention_cost.py [--target smollm2-135m] [--precision int4]
        [--contexts 100,1000,3000] [--sizes 1,2,4,8] [--repeats 15] [--routine kernel|torch] [--compile]

`--routine torch` runs the PyTorch implementation of the batch-invariant attention instead of
the numba kernel (SPECDEC_ATTENTION=torch), for a side-by-side table; `--compile` times the
torch.compile'd layers (backend option compile=1) instead of the eager ones. Prints one
line per context and ends with a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from specdec.backends import make_backend
from specdec.models import load_model


def cost(seq, context: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    """Median milliseconds of one forward of n tokens after `context`, sizes interleaved."""
    seq.prefill(context, all_logits=False)
    start = seq.length
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(2):  # warm-up
        for n in sizes:
            seq.forward(context[:n])
            seq.rollback(start)
    for _ in range(repeats):
        for n in sizes:
            t0 = time.perf_counter()
            seq.forward(context[:n])
            times[n].append(time.perf_counter() - t0)
            seq.rollback(start)
    return {n: 1000 * statistics.median(ts) for n, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--precision", default=None, help="native precision (default: the cpu default, int4)")
    p.add_argument("--contexts", default="100,1000,3000")
    p.add_argument("--sizes", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--routine", choices=("kernel", "torch"), default="kernel")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--compile", action="store_true", help="the compiled layers (compile=1)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ["SPECDEC_ATTENTION"] = args.routine  # the backend's documented choice (docs/configuration.md)
    contexts = [int(c) for c in args.contexts.split(",")]
    sizes = [int(n) for n in args.sizes.split(",")]
    target = load_model(args.target)
    seq = make_backend("native", target, prefix_cache="off", precision=args.precision,
                       max_length=max(contexts) + max(sizes) + 1, compile=int(args.compile))
    ids = target.tokenizer.encode("The harbour office opened at seven, and the ferries waited for the fog. " * 400)
    report = {"target": args.target, "routine": args.routine, "compiled": args.compile,
              "threads": torch.get_num_threads(), "ms": {}}
    for context in contexts:
        ms = cost(seq, ids[:context], sizes, args.repeats)
        report["ms"][context] = ms
        cells = "  ".join(f"n={n}: {ms[n]:.1f} ms ({ms[n] / ms[sizes[0]]:.2f}x)" for n in sizes)
        print(f"context {context}: {cells}", flush=True)
    report["columns"] = ["Context", *(f"{n} token{'s' * (n > 1)}" for n in sizes)]
    report["rows"] = [[context, *(f"{ms[n]:.1f} ({ms[n] / ms[sizes[0]]:.2f}x)" for n in sizes)]
                      for context, ms in report["ms"].items()]  # fmt: skip
    print(json.dumps(report))


if __name__ == "__main__":
    main()
