"""What a cold prefill of T tokens costs on a GGUF model's native backend, with a short last
chunk on the decode kernels (the default: the model's `short_chunk_rows`) against every chunk
on the prompt kernels: medians of interleaved runs, milliseconds.

    python scripts/bench/measure/prefill_cost.py [--target smollm2-135m]
        [--lengths 8,16,24,32,48,64,96,128,160] [--repeats 7] [--threads N] [--clock wall|cpu]

`--clock cpu` times process CPU time instead of wall time: with `--threads 1` (which also
gives numba one thread) that figure holds beside other jobs, where wall time would not.

A length's last chunk holds T mod 128 tokens (128 when T is a multiple); only a chunk below
`short_chunk_rows` tokens runs another kernel, so the columns agree above it. Prints one line
per length and ends with a JSON line (columns and rows) for record.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from specdec.backends.native.model.native_model import NativeModel
from specdec.models import load_model


def prefill_ms(model, prompt: list[int], short_rows: int, clock) -> float:
    model.short_chunk_rows = short_rows
    seq = model.new_pool(max_length=len(prompt) + 1).new_sequence()
    t0 = clock()
    seq.prefill(prompt, all_logits=False)
    return (clock() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="a built-in name or a GGUF file")
    parser.add_argument("--lengths", default="8,16,24,32,48,64,96,128,160", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="runs per length and variant, interleaved")
    parser.add_argument("--threads", type=int, default=None, help="torch and numba threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or process CPU time")
    args = parser.parse_args()
    if args.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(args.threads)  # before numba's first import
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    target = load_model(args.target)
    if target.gguf_path is None:
        raise SystemExit(f"{args.target} is not a GGUF model")
    model = NativeModel.from_gguf(target.gguf_path)
    ids = target.tokenizer.encode("The harbour office opened at seven, and the ferry captains argued. " * 40)
    routed = model.short_chunk_rows  # the model's own threshold
    rows = []
    for length in (int(v) for v in args.lengths.split(",")):
        prompt = ids[:length]
        for short in (routed, 0):  # warm-up
            prefill_ms(model, prompt, short, clock)
        times: dict[int, list[float]] = {routed: [], 0: []}
        for _ in range(args.repeats):
            for short in (routed, 0):
                times[short].append(prefill_ms(model, prompt, short, clock))
        a, b = statistics.median(times[routed]), statistics.median(times[0])
        print(f"T={length:4d}  short chunk on decode kernels {a:7.1f} ms  all prompt kernels {b:7.1f} ms  {b / a:.2f}x",
              flush=True)  # fmt: skip
        rows.append([length, length % 128 or 128, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x"])
    model.short_chunk_rows = routed
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "clock": args.clock,
        "columns": ["Prompt tokens", "Last chunk", f"Short chunks (< {routed}) on decode kernels, ms",
                    "All chunks on prompt kernels, ms", "Speedup"],
        "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
