"""The numba GGUF kernels of this tree against another tree's, in turns, on the same blocks
and the same activations; both must write the same bits.

    git worktree add /tmp/base HEAD~1
    python scripts/bench/ab/gguf_8bit_ab.py --base /tmp/base [--threads 2] [--cases ...]

Each case is KIND:N:K:M (a quantized type such as Q6_K or Q5_K; N x K weights, M activation
rows) on random blocks with valid fp16 scales, written once to a temporary file that both
trees read. Each tree runs in a worker process of its own (`PYTHONPATH=TREE/src`, this script
with `--worker`), which builds the call a decode step makes per matrix (native/timing.py's
`matrix_call`, so both trees need that hook); per case the two workers' calls alternate, one
timed call at a time, the order flipping every round, and their outputs must be the same bits
(for two trees whose kernels compute different bits, `gguf_matrix_time.py` times each tree on
its own). The default cases are 1.5B-sized matrices from memory. Prints each case's medians
and ends with a JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_CASES = "Q6_K:131072:1536:1,Q5_K:131072:1536:1,Q6_K:131072:1536:4"


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[N, bytes per row] of random bytes whose fp16 scales (d, and m or dmin) are small and finite."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from specdec.backends.native.quant_types import quant_type

    qt = quant_type(qtype)
    block, width = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, width), dtype=np.uint8)
    for offset in qt.scales_at:
        scale = rng.uniform(1e-4, 1e-2, (n, k // block)).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def worker(threads: int) -> None:
    """Serve one tree's timings: JSON commands on stdin, one JSON reply per line on stdout."""
    import torch
    from gguf import GGMLQuantizationType

    from specdec.backends.native.timing import load_kernels, matrix_call
    from specdec.gguf_file import QuantTensor

    replies, sys.stdout = sys.stdout, sys.stderr  # stdout carries the replies alone
    torch.set_num_threads(threads)
    load_kernels()
    call = None
    for line in sys.stdin:
        command = json.loads(line)
        if "case" in command:
            qtype, n, k, m = command["case"].split(":")
            raw = np.load(command["blocks"], mmap_mode="r")
            x = np.random.default_rng(1).standard_normal((int(m), int(k)), dtype=np.float32)
            call = matrix_call(QuantTensor("w", GGMLQuantizationType[qtype], (int(n), int(k)), raw), x)
            reply = {"digest": hashlib.sha256(call().tobytes()).hexdigest()}
        else:
            start = time.perf_counter()
            call()
            reply = {"seconds": time.perf_counter() - start}
        print(json.dumps(reply), file=replies, flush=True)


class Worker:
    def __init__(self, tree: Path, threads: int):
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        command = [sys.executable, __file__, "--worker", "--threads", str(threads)]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(command, env=env, stdin=pipe, stdout=pipe, text=True)

    def ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("a worker exited (see its error above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run_case(workers: dict, case: str, seconds: float, path: Path) -> dict:
    qtype, n, k, _ = case.split(":")
    raw = random_blocks(qtype, int(n), int(k))
    np.save(path, raw)
    digests = {name: w.ask({"case": case, "blocks": str(path)})["digest"] for name, w in workers.items()}
    if digests["this"] != digests["base"]:
        raise SystemExit(f"{case}: the two trees' kernels wrote different bits")
    times: dict = {name: [] for name in workers}
    rounds = max(20, min(400, int(seconds * 4e8 // raw.nbytes)))
    for i in range(rounds):
        for name in list(workers) if i % 2 else list(workers)[::-1]:
            times[name].append(workers[name].ask({"time": 1})["seconds"])
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    return {"this_ms": round(medians["this"], 3), "base_ms": round(medians["base"], 3),
            "ratio": round(medians["this"] / medians["base"], 2), "rounds": rounds}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", type=Path, help="the other tree's root (required)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default=DEFAULT_CASES)
    p.add_argument("--seconds", type=float, default=1.0, help="scales the rounds per case")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.threads)
    if args.base is None:
        p.error("--base is required")
    workers = {"this": Worker(ROOT, args.threads), "base": Worker(args.base.resolve(), args.threads)}
    rows = []
    try:
        with tempfile.TemporaryDirectory() as folder:
            for i, case in enumerate(args.cases.split(",")):
                r = run_case(workers, case, args.seconds, Path(folder) / f"blocks-{i}.npy")
                print(f"{case}: this {r['this_ms']} ms, base {r['base_ms']} ms, {r['ratio']}x", flush=True)
                rows.append([case, f"{r['this_ms']:.3f}", f"{r['base_ms']:.3f}", f"**{r['ratio']:.2f}x**"])
    finally:
        for w in workers.values():
            w.close()
    print(json.dumps({"threads": args.threads, "base": str(args.base),
                      "columns": ["Case (type:N:K:M)", "This tree ms (median)", "Base ms (median)", "Ratio"],
                      "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
