"""Whole GGUF models give the same bits at one and two threads (issue 25: replicas with
different core counts must agree), checked in a fresh interpreter per thread count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_gguf_loader import _write

# A whole model's logits at a thread count: a 270-token prefill (two whole chunks and a short
# one), 8 greedy steps and a 4-token chain; one digest per file. Run in a fresh interpreter per
# count, since numba fixes its thread count at its first parallel launch.
THREADS_SCRIPT = """
import hashlib, json, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from specdec.backends.native.model import NativeModel
digests = {}
for path in sys.argv[2:]:
    model = NativeModel.from_gguf(path)
    vocab = model.config.vocab_size
    seq = model.new_pool(max_length=512).new_sequence()
    ids = [int(t) for t in torch.randint(3, vocab, (270,), generator=torch.Generator().manual_seed(0))]
    logits, h = seq.prefill(ids), hashlib.sha256()
    h.update(logits.numpy().tobytes())
    token = int(logits[-1].argmax())
    for _ in range(8):
        out = seq.forward([token])
        h.update(out.numpy().tobytes())
        token = int(out[-1].argmax())
    h.update(seq.forward([token, 5, 6, 7]).numpy().tobytes())
    digests[path] = h.hexdigest()
digests["torch threads at the end"] = torch.get_num_threads()  # numba's pool must not reset it
print(json.dumps(digests))
"""


def _digests_at(threads: int, paths: list[Path]) -> dict:
    out = subprocess.run([sys.executable, "-c", THREADS_SCRIPT, str(threads), *map(str, paths)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    digests = json.loads(out.stdout.splitlines()[-1])
    assert digests.pop("torch threads at the end") == threads, digests  # else the counts compared are not these
    return digests


def test_whole_models_give_the_same_bits_at_one_and_two_threads(tmp_path_factory):
    """Prefill (prompt kernels, a short chunk's decode kernels, SDPA), decode steps and a
    verify chain, every architecture with a quant type each: bit-identical logits at 1 and 2
    threads on the CPU at hand."""
    pairs = [("llama", "Q4_K"), ("mistral", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "Q6_K"), ("gemma3", "Q5_K"),
             ("phi3", "Q4_1"), ("llama", "F16")]  # fmt: skip
    paths = [_write(tmp_path_factory, arch, qtype)[0] for arch, qtype in pairs]
    assert _digests_at(1, paths) == _digests_at(2, paths)


@pytest.mark.slow
def test_the_embedded_model_gives_the_same_bits_at_one_and_two_threads():
    """The same on the real SmolLM2 file, whose 576/1536-wide matrices take other GEMM paths."""
    from specdec.models import builtin_gguf_path

    path = builtin_gguf_path("smollm2-135m")
    assert _digests_at(1, [path]) == _digests_at(2, [path])
