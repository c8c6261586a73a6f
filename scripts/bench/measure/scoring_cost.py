"""What scoring n tokens costs on one GGUF file: specdec's native backend and llama.cpp side by
side, with the roofline of each forward.

    python scripts/bench/measure/scoring_cost.py [--target smollm2-135m] [--contexts 100,1000,4000]
        [--sizes 1,2,4,8,16] [--repeats 15] [--threads 2] [--rates GBPS,GMACS] [--no-llamacpp]
        [--kv-dtype bf16|fp32]

Per context c (a prefill of c tokens, then forwards rolled back after each): the median
milliseconds of a chain of n tokens, a 6-node token tree and a batch of 4 sequences x 4
tokens (specdec), and llama.cpp's batch of n tokens (llama-cpp-python, logits for every
token, in a process of its own so that neither engine's threads wait beside the other's), the
engines in turns, a block of every case each, so that a noisy moment hits both. The roofline of a
forward: the bytes it must read (the file's matrices once, and each sequence's keys and
values) at the machine's read bandwidth, against its multiply-adds (n x the matrices' weights,
and attention's) at the int8 rate, whichever is longer (`--rates`, from machine_rates.py;
without it, no roofline). Prints a line per context and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from specdec.backends import make_backend
from specdec.gguf_file import gguf_file
from specdec.models import load_model, resolve

TREE = [-1, 0, 0, 1, 1, 2]  # 6 nodes: the root's two children, two below the first, one below the second
BATCH = (4, 4)  # sequences x tokens
# seconds between the engines' blocks: each one's thread pool spins for a while after its last
# call, and a block that starts while the other's threads still spin runs on half the cores.
# Each block then starts with an untimed call, since the first call after a pause runs slow.
SETTLE = 0.2


def file_costs(path, kv_element_bytes: int) -> dict:
    """Bytes of the file's matrices (the weights one forward reads once) and their weights per
    token, i.e. multiply-adds; and each token's cache bytes (elements of `kv_element_bytes`) and
    multiply-adds per context token."""
    f = gguf_file(path)
    arch = f.meta("general.architecture")
    matrices = [t for name, t in f.tensors.items() if len(t.shape) == 2 and name != "token_embd.weight"]
    if "output.weight" not in f.tensors:  # a tied head reads the embedding's matrix
        matrices.append(f.tensors["token_embd.weight"])
    layers, heads = int(f.meta(f"{arch}.block_count")), int(f.meta(f"{arch}.attention.head_count"))
    kv_heads = int(f.meta(f"{arch}.attention.head_count_kv", heads))
    dim = int(f.meta(f"{arch}.attention.key_length", int(f.meta(f"{arch}.embedding_length")) // heads))
    return {"weight_bytes": sum(t.data.nbytes for t in matrices),
            "weights": sum(t.shape[0] * t.shape[1] for t in matrices),
            "kv_bytes_per_token": layers * kv_heads * dim * 2 * kv_element_bytes,  # keys and values
            "attention_macs_per_key": layers * heads * dim * 2}  # scores and weighted sums, per query


def roofline_ms(costs: dict, rates: tuple[float, float] | None, tokens: int,
                contexts: list[int]) -> float | None:
    """The longer of a forward's bytes at the bandwidth and its multiply-adds at the int8 rate:
    `tokens` queries in all, over sequences whose contexts are `contexts`."""
    if rates is None:
        return None
    gbps, gmacs = rates
    read = costs["weight_bytes"] + sum(costs["kv_bytes_per_token"] * c for c in contexts)
    per_seq = tokens // len(contexts)
    macs = tokens * costs["weights"] + sum(costs["attention_macs_per_key"] * per_seq * c for c in contexts)
    return 1000 * max(read / (gbps * 1e9), macs / (gmacs * 1e9))


def timed(call, undo) -> float:
    t0 = time.perf_counter()
    call()
    elapsed = time.perf_counter() - t0
    undo()
    return elapsed


LLAMACPP_WORKER = """
import json, sys, time
from llama_cpp import Llama
path, threads, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=length, n_threads=threads, n_threads_batch=threads, n_batch=512,
            verbose=False)
ctx, batch = llm._ctx, llm._batch
for line in sys.stdin:
    tokens, start = json.loads(line)
    t0 = time.perf_counter()
    ctx.kv_cache_seq_rm(-1, start, -1)  # roll back to start, then append
    batch.set_batch(batch=tokens, n_past=start, logits_all=True)
    ctx.decode(batch)
    print(time.perf_counter() - t0, flush=True)
"""


class LlamaCpp:
    """llama.cpp (llama-cpp-python) in a child process: feed(tokens, start) -> seconds of one batch
    after rolling its cache back to `start`."""

    def __init__(self, path, threads: int, length: int):
        command = [sys.executable, "-c", LLAMACPP_WORKER, str(path), str(threads), str(length)]
        self.child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def feed(self, tokens: list[int], start: int) -> float:
        self.child.stdin.write(json.dumps([tokens, start]) + "\n")
        self.child.stdin.flush()
        return float(self.child.stdout.readline())


def measure_context(seqs, peer, c: int, ids: list[int], sizes: list[int],
                    repeats: int) -> dict[str, list[float]]:
    """Seconds per call of every case at context c: each engine's cases in a block, in turns."""
    main, others = seqs[0], seqs[1:]
    for i, seq in enumerate(seqs):
        seq.prefill(ids[i : i + c], all_logits=False)
    if peer is not None:
        for start in range(0, c, 512):
            peer.feed(ids[start : min(c, start + 512)], start)
    new = ids[c : c + max(sizes)]
    cases = {f"chain {n}": (lambda n=n: main.forward(new[:n]), lambda: main.rollback(c)) for n in sizes}
    cases["tree 6"] = (lambda: main.forward_tree(new[: len(TREE)], TREE), lambda: main.rollback(c))
    group = [main, *others[: BATCH[0] - 1]]
    cases["batch 4x4"] = (lambda: main.pool.forward_batch(group, [new[: BATCH[1]]] * len(group)),
                          lambda: [s.rollback(c) for s in group])
    times: dict[str, list[float]] = {name: [] for name in cases}
    times.update({f"llama.cpp {n}": [] for n in sizes} if peer is not None else {})
    first = next(iter(cases.values()))
    for round_ in range(repeats + 2):  # two warm-up rounds
        time.sleep(SETTLE)
        timed(*first)  # untimed: the first call after an idle moment runs slow
        for name, (call, undo) in cases.items():
            elapsed = timed(call, undo)
            if round_ >= 2:
                times[name].append(elapsed)
        time.sleep(SETTLE)
        if peer is not None:
            peer.feed(new[:1], c)
        for n in sizes if peer is not None else ():
            elapsed = peer.feed(new[:n], c)
            if round_ >= 2:
                times[f"llama.cpp {n}"].append(elapsed)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--contexts", default="100,1000,4000")
    p.add_argument("--sizes", default="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rates", default=None, help="GB/s,G MAC/s of machine_rates.py, for the roofline")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--kv-dtype", default=None, help="specdec's KV-cache type (default: the backend's)")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    contexts, sizes = [int(c) for c in args.contexts.split(",")], [int(n) for n in args.sizes.split(",")]
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else None
    target = load_model(args.target)
    path = resolve(args.target)[1]
    length = max(contexts) + max(sizes) + BATCH[0] + 8
    seq = make_backend("native", target, prefix_cache="off", slots=BATCH[0], max_length=length,
                       kv_dtype=args.kv_dtype)
    seqs = [seq] + [seq.pool.new_sequence() for _ in range(BATCH[0] - 1)]
    peer = None if args.no_llamacpp else LlamaCpp(path, args.threads, length + 64)
    text = "The harbour office opened at seven, and the ferries waited for the fog. " * 800
    ids = target.tokenizer.encode(text)
    costs = file_costs(path, seq.pool.kv_dtype.itemsize)
    kv_dtype = str(seq.pool.kv_dtype).removeprefix("torch.")
    report = {"target": args.target, "threads": args.threads, "kv_dtype": kv_dtype, "rates": rates,
              "costs": costs, "ms": {},
              "rows": []}
    for c in contexts:
        times = measure_context(seqs, peer, c, ids, sizes, args.repeats)
        ms = {name: 1000 * statistics.median(ts) for name, ts in times.items()}
        report["ms"][c] = ms
        roof = {f"chain {n}": roofline_ms(costs, rates, n, [c]) for n in sizes}
        roof["tree 6"] = roofline_ms(costs, rates, len(TREE), [c])
        roof["batch 4x4"] = roofline_ms(costs, rates, BATCH[0] * BATCH[1], [c] * BATCH[0])
        one, peer_one = ms["chain 1"], ms.get("llama.cpp 1")
        for name in [*(f"chain {n}" for n in sizes), "tree 6", "batch 4x4"]:
            n = name.split()[1]
            theirs = ms.get(f"llama.cpp {n}") if name.startswith("chain") else None
            cells = [c, name, f"{ms[name]:.1f} ({ms[name] / one:.2f}x)",
                     "-" if theirs is None else f"{theirs:.1f} ({theirs / peer_one:.2f}x)",
                     "-" if roof[name] is None else f"{roof[name]:.1f} ({roof[name] / ms[name]:.0%})"]
            report["rows"].append(cells)
            print("  ".join(str(x) for x in cells), flush=True)
    report["columns"] = ["Context", "Forward", "specdec ms (x one token)", "llama.cpp ms (x one token)",
                         "roofline ms (share reached)"]
    print(json.dumps(report))


if __name__ == "__main__":
    main()
