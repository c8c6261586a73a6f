"""Do two source trees compute the same bits? Greedy outputs and logit digests of the native
backend on every architecture x quant type of the test suite's synthetic files, and on the real
models, each tree in a process of its own (`PYTHONPATH=TREE/src`), compared file by file.

    python scripts/bench/ab/bits_ab.py OLD_TREE NEW_TREE [--real smollm2-135m,gemma3-270m] [--threads 1,2]

Per file and thread count: the sha256 of the fp32 logits of a 40-token prefill, of a 5-token
chain, of a 6-node token tree and of a batch of two sequences, and 16 greedy tokens of plain
decoding and of `ngram` speculation (which must equal plain's). Only the public API is used
(`specdec.models.load_model`, `specdec.backends.make_backend`, the Backend protocol), so any
tree since the native backend's layout can be measured. The synthetic files are written once,
by this tree's tests/gguf_factory.py, and both trees read the same files. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3")
TOKENS = list(range(20, 60))
STEPS = 16


def write_files(folder: Path) -> list[str]:
    """Every architecture x quant type of the suite as a small synthetic file."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf_factory import QTYPES, spec_for, write_gguf

    paths = []
    for arch in ARCHS:
        for qtype in QTYPES:
            path = folder / f"{arch}-{qtype}.gguf"
            write_gguf(path, spec_for(arch, qtype))  # the whole tokenizer: Engine needs its merges
            paths.append(str(path))
    path = folder / "llama3-Q4_K.gguf"
    write_gguf(path, spec_for("llama", "Q4_K", llama3_rope=True))
    return [*paths, str(path)]


def digest(t) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()[:16]


def measure_one(name: str) -> dict:
    """long: every path a forward can take, on one file, in this process's tree."""
    import torch

    from specdec import Engine
    from specdec.backends import make_backend
    from specdec.models import load_model

    target = load_model(name)
    seq = make_backend("native", target, prefix_cache="off", slots=2, max_length=256)
    out = {"prefill": digest(seq.prefill(TOKENS))}
    out["chain"] = digest(seq.forward([61, 62, 63, 64, 65]))
    seq.rollback(len(TOKENS))
    out["tree"] = digest(seq.forward_tree([70, 71, 72, 73, 74, 75], [-1, 0, 0, 1, 1, 3]))
    seq.keep([0, 1, 3])
    other = seq.pool.new_sequence()  # two sequences in one packed forward
    other.prefill(TOKENS[:17])
    out["batch"] = digest(torch.cat(seq.pool.forward_batch([seq, other], [[80, 81], [82, 83, 84]])))
    prompt = "The harbour office opened at seven, and"
    plain = Engine(target=target, drafter="none", backend="native")
    spec = Engine(target=target, drafter="ngram", backend="native")
    plain, spec = (e.generate(prompt, max_new_tokens=STEPS, chat=False) for e in (plain, spec))
    out["greedy"] = list(plain.token_ids)
    out["speculative_equals_plain"] = list(spec.token_ids) == list(plain.token_ids)
    return out


def measure(names: list[str], threads: list[int]) -> dict:
    import torch

    results = {}
    for count in threads:
        torch.set_num_threads(count)
        for name in names:
            try:
                results[f"{Path(name).name}@{count}"] = measure_one(name)
            except Exception as e:  # recorded, so that a refusal in one tree shows as a difference
                results[f"{Path(name).name}@{count}"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return results


def run_tree(tree: str, names: list[str], threads: list[int]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src")}
    cmd = [sys.executable, __file__, "--measure", ",".join(names), "--threads", ",".join(map(str, threads))]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode:
        raise SystemExit(f"{tree}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="*", help="two source trees (folders holding src/)")
    parser.add_argument("--real", default="smollm2-135m,gemma3-270m",
                        help="real models or GGUF paths, comma-separated")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # the per-tree child
    args = parser.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.measure:
        print(json.dumps(measure(args.measure.split(","), threads)))
        return
    if len(args.trees) != 2:
        parser.error("give two trees")
    with tempfile.TemporaryDirectory() as folder:
        names = write_files(Path(folder)) + [n for n in args.real.split(",") if n]
        old, new = (run_tree(tree, names, threads) for tree in args.trees)
    different = sorted(key for key in old if old[key] != new.get(key))
    for key in different:
        print(f"DIFFERENT {key}: {old[key]} != {new.get(key)}")
    lossless = all(r.get("speculative_equals_plain", False) for r in new.values() if "error" not in r)
    errors = sorted(key for key, r in new.items() if "error" in r)
    summary = {"cases": len(old), "identical": len(old) - len(different), "different": different,
               "errors_new": errors, "speculative_equals_plain": lossless}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
