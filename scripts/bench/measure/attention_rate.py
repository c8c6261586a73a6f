"""One layer's attention after C cached keys, for a decode row (1 query) and a prompt chunk of
N queries: each query on its own (the numba kernel, as decode steps run it) against one causal
SDPA pass, side by side in one process, in turns; medians, and the multiply-adds a second that
the scores and the weighted sums make (2 x heads x dim per query and key it reads).

    python scripts/bench/measure/attention_rate.py [--cached 4000] [--new 256] [--rounds 15]
        [--heads 9 --kv-heads 3 --dim 64] [--threads 2] [--layers 1]

The shapes default to SmolLM2-135M's; the cache is bf16, as the native backend's default for
quantized weights. With --layers N each call runs N layers' caches in turn, so that they stream
from memory as a forward's do (30 layers of SmolLM2 after 4,000 tokens read 96 MB, past a 32 MB
L3); times and rates are a layer's. Ends with a JSON line for record.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.backends.native.timing import attention_pass, load_kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cached", type=int, default=4000)
    parser.add_argument("--new", type=int, default=256, help="queries of the prompt chunk")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1, help="layers' caches run in turn by each call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_kernels()
    rows = []
    for new in (1, args.new):
        calls = {routine: layers([attention_pass(args.cached, new, args.heads, args.kv_heads, args.dim,
                                                 masked=routine == "sdpa", seed=layer)
                                  for layer in range(args.layers)]) for routine in ("kernel", "sdpa")}
        times = {routine: [] for routine in calls}
        for call in calls.values():
            call()
        for _ in range(args.rounds):
            for routine, call in calls.items():
                start = time.perf_counter()
                call()
                times[routine].append(time.perf_counter() - start)
        macs = 2 * args.heads * args.dim * sum(args.cached + j + 1 for j in range(new))
        for routine, ts in times.items():
            seconds = statistics.median(ts) / args.layers
            rows.append([routine, new, round(1e3 * seconds, 3), round(macs / seconds / 1e9, 1)])
            print(f"{routine:7s} {new:4d} queries after {args.cached}: {1e3 * seconds:8.3f} ms "
                  f"{macs / seconds / 1e9:6.1f} G multiply-adds/s", flush=True)
    columns = ["routine", "queries", "ms a layer (median)", "G multiply-adds/s"]
    print(json.dumps({"columns": columns, "rows": rows, "layers": args.layers, "threads": args.threads}))


def layers(calls):
    """One call that runs every layer's in turn."""
    def call():
        for one in calls:
            one()
    return call


if __name__ == "__main__":
    main()
