"""RSS of one GGUF file loaded by the native backend, above the runtime's baseline (see
docs/performance-notes.md, "Memory after load"). One file per fresh interpreter:

    python scripts/bench/measure/memory_after_load.py FILE [--precision gguf|int4|...]

Prints one JSON line: the file's size, the KV cache of a 256-token pool, RSS above the
baseline after loading and after a 37-token prefill plus one decode step (MB).
"""

from __future__ import annotations

import argparse
import json
import os

from specdec.backends.native.model.native_model import GGUF_PRECISION, NativeModel
from specdec.backends.native.timing import load_kernels


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--precision", default=GGUF_PRECISION)
    args = parser.parse_args()
    load_kernels()  # the runtime's compiled kernels: per process, not per model
    before = rss()
    model = NativeModel.from_gguf(args.path, precision=args.precision)
    pool = model.new_pool(max_length=256)
    loaded = rss() - before
    seq = pool.new_sequence()
    seq.prefill(list(range(3, 40)))
    seq.forward([5])
    print(json.dumps({
        "file": os.path.basename(args.path), "size_MB": round(os.path.getsize(args.path) / 1e6, 1),
        "kv_MB": round(pool.k.numel() * pool.k.element_size() * 2 / 1e6, 1),
        "load_MB": round(loaded / 1e6, 1), "after_forward_MB": round((rss() - before) / 1e6, 1),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
