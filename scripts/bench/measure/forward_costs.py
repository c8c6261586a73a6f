"""What the native backend's forwards cost on one GGUF file, for A/B runs of two source trees:
a one-token decode step, a 6-node token tree, a batch of two one-token rows, and a cold
760-token prefill.

    PYTHONPATH=OLD_TREE/src python scripts/bench/measure/forward_costs.py FILE [--threads 2]
    PYTHONPATH=src python scripts/bench/measure/forward_costs.py FILE

Each forward after a 100-token prefill (85 for the batch's second row), rolled back after
each call; medians of 40 calls (ms), and the three prefills (s). Run the trees in turns, a
fresh process each, and compare the ranges. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdec.backends.native.model.native_model import NativeModel

PROMPT = [(i * 7919) % 40000 + 100 for i in range(760)]


def median_ms(call, rounds: int = 40) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = NativeModel.from_gguf(args.path)
    pool = model.new_pool(slots=2, max_length=1024)
    a, b = pool.new_sequence(), pool.new_sequence()
    a.prefill(list(range(3, 103)))
    b.prefill(list(range(5, 90)))

    def step():
        n = a.length
        a.forward([10])
        a.rollback(n)

    def tree():
        n = a.length
        a.forward_tree([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 2, 3])
        a.rollback(n)

    def batch():
        na, nb = a.length, b.length
        pool.forward_batch([a, b], [[10], [11]])
        a.rollback(na)
        b.rollback(nb)

    out = {"step_ms": median_ms(step), "tree6_ms": median_ms(tree), "batch2_ms": median_ms(batch)}
    prefills = []
    for _ in range(3):
        a.reset()
        start = time.perf_counter()
        a.prefill(PROMPT)
        prefills.append(round(time.perf_counter() - start, 3))
    out["prefill760_s"] = prefills
    print(json.dumps(out))


if __name__ == "__main__":
    main()
