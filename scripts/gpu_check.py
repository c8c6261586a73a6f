"""One short check for a lent GPU (issue 7): the target on cuda, its draft on the cpu
(--draft-device cpu) or on cuda, against plain decoding on cuda. Prints one JSON object.

    python scripts/gpu_check.py [--draft runs/smollm2-draft] [--tokens 128]

The default draft is the target itself (`model:smollm2-135m`): every draft is accepted, so
the numbers isolate the cost of drafting on each device.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specdec import Engine
from specdec.models import load_model

PROMPT = "Write a Python function that parses an ISO date string and returns (year, month, day), with a docstring."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="smollm2-135m", help="model drafter path or built-in name")
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here")
    target = load_model("smollm2-135m")
    on_gpu = {"device": "cuda", "precision": "bf16"}
    engines = {
        "plain (cuda)": Engine(target, drafter="none", k=0, backend="native", backend_options=on_gpu),
        "draft on cuda": Engine(target, drafter=f"model:{args.draft}", k=4, backend="native",
                                backend_options=on_gpu, draft_device="cuda"),
        "draft on cpu": Engine(target, drafter=f"model:{args.draft}", k=4, backend="native",
                               backend_options=on_gpu, draft_device="cpu"),
    }
    rows, reference = {}, None
    for name, engine in engines.items():
        engine.generate(PROMPT, max_new_tokens=16)  # warm-up: kernels, caches
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = engine.generate(PROMPT, max_new_tokens=args.tokens)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        reference = reference if reference is not None else result.token_ids
        rows[name] = {
            "tokens": len(result.token_ids), "tok_per_s": round(len(result.token_ids) / seconds, 1),
            "tau": round(result.stats.mean_accepted_length, 2), "exact": result.token_ids == reference,
        }
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "draft": args.draft, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
