"""Where a native decode step spends its time (issue 15): a torch.profiler breakdown of one
forward of 1 token (and of 8 tokens) after a short prompt, on the embedded SmolLM2 or `--target`
(a built-in name or a GGUF file, e.g. the synthetic 1.5B of synthetic_qwen2_gguf.py).

    taskset -c 1 python scripts/bench/profile_step.py [--threads 1] [--repeats 20] [--precision int4]
        [--target smollm2-135m]

Each part is timed inclusively through a `record_function` range wrapped around it (the
wrappers add a few microseconds each): the decoder linears, the LM head, the RMSNorms, the
rotary embeddings and attention. "other" is the rest of the profiled step: embedding, residual
adds, activation, dtype casts, slicing, Python. The first line per width is the median wall
time of the same forward without the profiler. Prints a table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
import torch.nn.functional as F

import specdec.backends.native.layer as layer_mod
import specdec.backends.native.model as model_mod
from specdec.backends import make_backend
from specdec.models import load_model

PROMPT_TOKENS = 40
PARTS = ("decoder linears", "LM head", "RMSNorm", "residual add + RMSNorm", "rotary", "attention",
         "rotary + attention + cast", "SwiGLU")


def _labelled(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return wrapper


def instrument(model) -> None:
    """Wrap each part of the forward in a labelled profiler range (module functions looked up
    by name, so the script follows layer.py as it changes)."""
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            part = getattr(layer, name)
            for method in ("forward", "joined"):
                if hasattr(part, method):
                    setattr(part, method, _labelled("decoder linears", getattr(part, method)))
        # eager layers call their parts through this tuple (layer.py), bound before the wrapping
        layer.eager_parts = (layer.attn_norm, layer.qkv.joined, layer.o.forward, layer.mlp_norm, layer.gate_up.forward,
                             layer.down.forward, layer.gate_up.joined, layer.eager_parts[-1])  # fmt: skip
    model.lm_head.forward = _labelled("LM head", model.lm_head.forward)
    if not callable(getattr(layer_mod, "rms_norm", None)):  # layer.py's own wraps F.rms_norm
        F.rms_norm = _labelled("RMSNorm", F.rms_norm)
    names = (("rms_norm", "RMSNorm"), ("rope", "rotary"), ("split_rotate", "rotary"), ("attention", "attention"),
             ("batch_invariant_attention", "attention"), ("silu_mul_bf16", "SwiGLU"), ("silu_mul", "SwiGLU"),
             ("add_rms_norm_bf16", "residual add + RMSNorm"), ("rotate_attend", "rotary + attention + cast"))
    for module in (layer_mod, model_mod):
        for name, label in names:
            if callable(getattr(module, name, None)):
                setattr(module, name, _labelled(label, getattr(module, name)))


def step(seq, width: int) -> None:
    start = seq.length
    seq.forward(list(range(1000, 1000 + width)))
    seq.rollback(start)


def wall_ms(seq, width: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(seq, width)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def profile(seq, width: int, repeats: int) -> dict:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, \
            torch.profiler.record_function("step"):
        for _ in range(repeats):
            step(seq, width)
    totals = {e.key: (e.cpu_time_total / 1000 / repeats, e.count // repeats) for e in prof.key_averages()}
    out = {part: totals.get(part, (0.0, 0)) for part in PARTS}
    step_ms = totals["step"][0]
    out["other (small ops, Python)"] = (step_ms - sum(ms for ms, _ in out.values()), 0)
    # aten calls (nested ones included): a count that a busy machine does not change
    out["profiled step"] = (step_ms, sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")) // repeats)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--precision", default=None, help="native precision (default: the backend's)")
    p.add_argument("--widths", default="1,8")
    p.add_argument("--target", default="smollm2-135m", help="a built-in name or a GGUF file")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    options = {"precision": args.precision} if args.precision else {}
    seq = make_backend("native", load_model(args.target), **options)
    seq.prefill(list(range(2000, 2000 + PROMPT_TOKENS)))
    widths = [int(w) for w in args.widths.split(",")]
    for w in widths:  # warm-up
        for _ in range(3):
            step(seq, w)
    walls = {w: wall_ms(seq, w, args.repeats) for w in widths}
    instrument(seq.pool.model)
    report = {}
    for w in widths:
        rows = profile(seq, w, args.repeats)
        report[w] = {"wall_ms": round(walls[w], 2), **{k: round(ms, 3) for k, (ms, _) in rows.items()}}
        print(f"\n{w}-token forward after a {PROMPT_TOKENS}-token prompt: {walls[w]:.2f} ms (median, no profiler)")
        print(f"{'part':28s} {'ms/forward':>10s} {'calls':>6s} {'share':>6s}  (step calls: aten ops)")
        for part, (ms, calls) in rows.items():
            share = 100 * ms / rows["profiled step"][0]
            print(f"{part:28s} {ms:10.2f} {calls or '':>6} {share:5.0f}%")
    print(json.dumps({"target": args.target, "threads": args.threads, "precision": seq.pool.model.precision, "forwards": report}))


if __name__ == "__main__":
    main()
