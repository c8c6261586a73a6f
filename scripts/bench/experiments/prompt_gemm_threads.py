"""What the thread-count invariance of the prompt GEMMs costs: a cold prefill of T tokens with
the prompt GEMMs (GGUF prompt tiles, dense prompt layers) run four ways, at the process's
thread count: medians of interleaved runs, wall milliseconds.

    python scripts/bench/experiments/prompt_gemm_threads.py [--target smollm2-135m] [--hf]
        [--lengths 128,256,512] [--repeats 5] [--threads N]

- `one thread` (what specdec runs): `cpu.one_thread_mm`, the whole GEMM on one thread;
- `library threads`: oneDNN's or MKL's own threaded GEMM, whose bits may change with the
  thread count (the speed that invariance gives up);
- `column-block pool` (tried, not adopted): fixed 256-column blocks, each a one-thread GEMM,
  shared by a pool of the process's thread count (invariant, and every core busy);
- `dedicated worker` (tried, not adopted): the GEMM handed to one long-lived thread whose
  count stays 1, which spares the set_num_threads calls (each clears oneDNN's primitive cache).

`--hf` runs the float checkpoint path instead of the GGUF file's: transformers' model of the
target at int4, whose prompts run dense bf16 (or fp32) layers. The schemes replace the
backend's one-thread GEMM through native/timing.py's `prompt_gemm`; `gemm_calls` in the JSON
counts the GEMMs one prefill of each length makes. Since the blocks of 32 and the K-quants run
the int8 kernels for prompts too (where numba runs), a GGUF file of those types makes none:
its four columns then time the same kernels. Prints one line per length and ends with a JSON
line (columns and rows) for record.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from specdec.backends.native.kernels.cpu import one_thread
from specdec.backends.native.model.native_model import NativeModel
from specdec.backends.native.timing import prompt_gemm
from specdec.models import load_model

COLUMN_BLOCK = 256
_pools: dict[int, ThreadPoolExecutor] = {}


def _one_thread_worker() -> None:
    if torch.get_num_threads() != 1:  # OpenMP's count is per thread
        torch.set_num_threads(1)


def _library_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(x, w_t, out=out)


def _column_block_pool_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    threads, n = torch.get_num_threads(), w_t.shape[1]
    pool = _pools.get(threads) or _pools.setdefault(threads, ThreadPoolExecutor(threads))

    def block(start: int) -> None:
        _one_thread_worker()
        torch.mm(x, w_t[:, start : start + COLUMN_BLOCK], out=out[:, start : start + COLUMN_BLOCK])

    with one_thread():
        list(pool.map(block, range(0, n, COLUMN_BLOCK)))
    return out


def _dedicated_worker_mm(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    worker = _pools.get(0) or _pools.setdefault(0, ThreadPoolExecutor(1))

    def gemm() -> torch.Tensor:
        _one_thread_worker()
        return torch.mm(x, w_t, out=out)

    return worker.submit(gemm).result()


SCHEMES = {"one thread": None, "library threads": _library_mm,  # None: the backend's own (one_thread_mm)
           "column-block pool": _column_block_pool_mm, "dedicated worker": _dedicated_worker_mm}  # fmt: skip


def prefill_ms(model, prompt: list[int], scheme) -> float:
    """One cold prefill's wall milliseconds, the prompt GEMMs on `scheme` (a SCHEMES name, or a GEMM)."""
    with prompt_gemm(SCHEMES[scheme] if isinstance(scheme, str) else scheme):
        seq = model.new_pool(max_length=len(prompt) + 1).new_sequence()
        t0 = time.perf_counter()
        seq.prefill(prompt, all_logits=False)
        return (time.perf_counter() - t0) * 1e3


def gemm_calls(model, prompt: list[int]) -> int:
    """How many prompt GEMMs one prefill of `prompt` makes."""
    calls = []

    def counted(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return _library_mm(x, w_t, out)

    prefill_ms(model, prompt, counted)
    return len(calls)


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
    if not args.hf and target.gguf_path is None:
        raise SystemExit(f"{args.target} is not a GGUF model: use --hf")
    model = NativeModel.from_hf(target.model, "int4") if args.hf else NativeModel.from_gguf(target.gguf_path)
    ids = target.tokenizer.encode("The harbour office opened at seven, and the ferry captains argued. " * 80)
    rows, calls = [], {}
    for length in (int(v) for v in args.lengths.split(",")):
        prompt = ids[:length]
        times: dict[str, list[float]] = {scheme: [] for scheme in SCHEMES}
        calls[length] = gemm_calls(model, prompt)
        if not calls[length]:
            print(f"T={length}: this model's prompts make no one-thread GEMM; the schemes time the same kernels",
                  file=sys.stderr)  # fmt: skip
        for scheme in SCHEMES:  # warm-up
            prefill_ms(model, prompt, scheme)
        for _ in range(args.repeats):
            for scheme in SCHEMES:
                times[scheme].append(prefill_ms(model, prompt, scheme))
        one, *others = (statistics.median(times[s]) for s in SCHEMES)
        print(f"T={length:4d}  " + "  ".join(f"{s} {statistics.median(times[s]):7.1f} ms" for s in SCHEMES), flush=True)
        rows.append([length, f"{one:.1f}"] + [f"{v:.1f} ({one / v:.2f}x)" for v in others])
    print(json.dumps({
        "threads": torch.get_num_threads(),
        "gemm_calls": calls,
        "columns": ["Prompt tokens", "One thread, ms"] + [f"{s.capitalize()}, ms (speed vs one thread)" for s in list(SCHEMES)[1:]],
        "rows": rows,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
