"""Decode speed by KV-cache element type: one-token decode steps on the native backend after
contexts of c tokens, with an fp32 cache and a bf16 cache attended by the numba kernel, and a
bf16 cache on the PyTorch routine (the path bf16 took before the kernel read it), in turns.

    python scripts/bench/measure/kv_dtype_decode.py [--target smollm2-135m] [--contexts 100,1000,4000]
        [--rounds 8] [--steps 5] [--threads 2] [--batch 1]

Per context, each configuration prefills the same tokens into a cache of its own, then the
configurations take turns (A B C A B C ...): each turn times `--steps` decode steps, each
rolled back after it, so every step runs at the context given. `--batch 4` makes each step
one packed forward of four sequences at that context (four agents sharing the machine);
tokens/s counts every sequence's token. Reports medians of all steps (ms and tokens/s) per
context and configuration, and ends with a JSON line.
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

# (label, kv_dtype, SPECDEC_ATTENTION): the routine is chosen when a pool is made and again by
# each forward, so the variable is set for the whole of a configuration's turn
CONFIGS = [("fp32 kernel", "fp32", "kernel"), ("bf16 kernel", "bf16", "kernel"),
           ("bf16 torch", "bf16", "torch")]


def build(target, kv_dtype: str, routine: str, length: int, batch: int) -> list:
    """`batch` sequences over one pool (a cache of their own) with this element type and routine."""
    os.environ["SPECDEC_ATTENTION"] = routine
    first = make_backend("native", target, prefix_cache="off", max_length=length, slots=batch,
                         kv_dtype=kv_dtype)
    return [first] + [first.pool.new_sequence() for _ in range(batch - 1)]


def turn(seqs: list, routine: str, token: int, steps: int) -> list[float]:
    """Seconds of each of `steps` decode steps (one token for each sequence), each rolled back."""
    os.environ["SPECDEC_ATTENTION"] = routine
    pool, starts, times = seqs[0].pool, [s.length for s in seqs], []
    for _ in range(steps):
        t0 = time.perf_counter()
        if len(seqs) == 1:
            seqs[0].forward([token])
        else:
            pool.forward_batch(seqs, [[token]] * len(seqs))
        times.append(time.perf_counter() - t0)
        for seq, start in zip(seqs, starts, strict=True):
            seq.rollback(start)
    return times


def measure(target, ids: list[int], context: int, args) -> dict:
    configs = {label: (build(target, kv, routine, context + 8, args.batch), routine)
               for label, kv, routine in CONFIGS}
    for seqs, routine in configs.values():
        os.environ["SPECDEC_ATTENTION"] = routine
        for i, seq in enumerate(seqs):
            seq.prefill(ids[i : i + context], all_logits=False)
        turn(seqs, routine, ids[context], 2)  # warm-up
    times: dict[str, list[float]] = {label: [] for label in configs}
    for _ in range(args.rounds):
        for label, (seqs, routine) in configs.items():
            times[label] += turn(seqs, routine, ids[context], args.steps)
    return {label: {"ms": round(1e3 * statistics.median(ts), 2),
                    "tokens_per_s": round(args.batch / statistics.median(ts), 1)}
            for label, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--contexts", default="100,1000,4000")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="decode steps per turn")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step (one packed forward)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    text = "The harbour office opened at seven, and the ferries waited for the fog. "
    ids = target.tokenizer.encode(text * 600)
    report = {"target": args.target, "threads": torch.get_num_threads(), "batch": args.batch, "results": {}}
    for context in (int(c) for c in args.contexts.split(",")):
        result = measure(target, ids, context, args)
        report["results"][context] = result
        cells = "  ".join(f"{label}: {r['ms']:.2f} ms ({r['tokens_per_s']:.1f} tok/s)"
                          for label, r in result.items())
        print(f"context {context}: {cells}", flush=True)
    report["columns"] = ["Context", *(label for label, _, _ in CONFIGS)]
    report["rows"] = [[context, *(f"{r['tokens_per_s']:.1f} tok/s ({r['ms']:.2f} ms)"
                                  for r in result.values())]
                      for context, result in report["results"].items()]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
