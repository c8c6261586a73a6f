"""What the thread-count invariance of the prompt GEMMs costs: a cold prefill of T tokens with
the prompt GEMMs (GGUF prompt tiles, dense prompt layers) run three ways, at the process's
thread count: medians of interleaved runs, wall milliseconds.

    python scripts/bench/prompt_gemm_threads.py [--target smollm2-135m] [--hf]
        [--lengths 128,256,512] [--repeats 5] [--threads N]

- `fixed blocks` (the default): `cpu.fixed_block_mm`, fixed 256-column blocks, each a
  one-thread GEMM, shared by the process's threads;
- `one thread`: the whole GEMM on one thread (thread-invariant, one core busy);
- `library threads`: oneDNN's or MKL's own threaded GEMM, whose bits may change with the
  thread count (the speed that invariance gives up, if any).

`--hf` runs the float checkpoint path instead of the GGUF file's: transformers' model of the
target at int4, whose prompts run dense bf16 (or fp32) layers. Prints one line per length and
ends with a JSON line (columns and rows) for record.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from specdec.backends.native import cpu, gguf_kernels, gguf_q4, quant
from specdec.backends.native.model import GGUF_PRECISION, NativeModel, native_model_for
from specdec.models import load_model

MODULES = (quant, gguf_q4, gguf_kernels)  # where the prompt GEMMs call fixed_block_mm


def _one_thread_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    with cpu.one_thread():
        return torch.mm(x, w_t, out=out)


def _library_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w_t, out=out)


SCHEMES = {"fixed blocks": cpu.fixed_block_mm, "one thread": _one_thread_mm, "library threads": _library_mm}


def prefill_ms(model, prompt: list[int], scheme: str) -> float:
    for module in MODULES:
        module.fixed_block_mm = SCHEMES[scheme]
    try:
        seq = model.new_pool(max_length=len(prompt) + 1).new_sequence()
        t0 = time.perf_counter()
        seq.prefill(prompt, all_logits=False)
        return (time.perf_counter() - t0) * 1e3
    finally:
        for module in MODULES:
            module.fixed_block_mm = cpu.fixed_block_mm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="a built-in name or a GGUF file")
    parser.add_argument("--hf", action="store_true", help="the float checkpoint path (transformers' model at int4)")
    parser.add_argument("--lengths", default="128,256,512", help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="runs per length and scheme, interleaved")
    parser.add_argument("--threads", type=int, default=None, help="torch and numba threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        os.environ["NUMBA_NUM_THREADS"] = str(args.threads)  # before numba's first import
        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    model = NativeModel.from_hf(target.model, "int4") if args.hf else native_model_for(target, GGUF_PRECISION)
    ids = target.tokenizer.encode("The harbour office opened at seven, and the ferry captains argued. " * 80)
    rows = []
    for length in (int(v) for v in args.lengths.split(",")):
        prompt = ids[:length]
        times: dict[str, list[float]] = {scheme: [] for scheme in SCHEMES}
        for scheme in SCHEMES:  # warm-up
            prefill_ms(model, prompt, scheme)
        for _ in range(args.repeats):
            for scheme in SCHEMES:
                times[scheme].append(prefill_ms(model, prompt, scheme))
        fixed, one, lib = (statistics.median(times[s]) for s in SCHEMES)
        print(f"T={length:4d}  fixed blocks {fixed:7.1f} ms  one thread {one:7.1f} ms  library threads {lib:7.1f} ms",
              flush=True)  # fmt: skip
        rows.append([length, f"{fixed:.1f}", f"{one:.1f}", f"{lib:.1f}", f"{one / fixed:.2f}x", f"{lib / fixed:.2f}x"])
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "columns": ["Prompt tokens", "Fixed blocks, ms", "One thread, ms", "Library threads, ms",
                    "One thread / fixed", "Library / fixed"],
        "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
