"""The one-call path of the native backend: decode rows, batches of sequences and token trees
run each layer as one compiled call (model/one_call.py), with the bits of the separate calls,
on synthetic files of every architecture, over an fp32 and a bf16 KV cache."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.native.model import layer as native_layer
from specdec.backends.native.model.native_model import NativeModel
from specdec.backends.native.model.one_call import LayerStep
from test_gguf_loader import TOKENS, _write

ONE_CALL_FILES = [("gemma3", "Q8_0", True), ("gemma3", "Q4_K", True), ("qwen2", "Q8_0", True),
                  ("qwen3", "Q5_1", True), ("mistral", "Q6_K", True), ("phi3", "Q5_K", True),
                  ("llama", "Q4_0", True), ("llama", "Q4_K", True), ("llama", "F16", False)]


def _separate(model, monkeypatch) -> None:
    """Every layer on its separate calls: no StepStack, no layer's own one-call step."""
    monkeypatch.setattr(model, "step_stack", None)
    for layer in model.layers:
        monkeypatch.setattr(layer, "step", None)


KV_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the caches the numba kernel reads


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize(("arch", "qtype", "whole_layer"), ONE_CALL_FILES)
def test_decode_rows_run_in_one_call_with_the_bits_of_the_separate_calls(tmp_path_factory, arch, qtype,
                                                                         whole_layer, kv_dtype, monkeypatch):
    """A forward's decode rows take one numba call per layer: the whole layer where every linear
    is a numba 8-bit kernel (model/one_call.py: gemma3's q/k norms, sublayer output norms, GELU
    and sliding windows, a qkv bias (qwen2), q/k norms (qwen3), a window (mistral), phi3's fused
    matrices, the small blocks and the K-quants), else the norm, rotation and attention
    (jit.norm_rotate_attend, F16). The whole layers run back to back in the model's StepStack;
    without it each layer makes its own call. One token, a chain of four, and both as a batch
    with another sequence's row: bit for bit what the separate calls give."""
    path, _ = _write(tmp_path_factory, arch, qtype)
    model = NativeModel.from_gguf(path)
    assert all((layer.step is not None) == whole_layer for layer in model.layers)
    assert (model.step_stack is not None) == whole_layer
    calls = []
    one_call, layer_call = native_layer.norm_rotate_attend, LayerStep.run
    monkeypatch.setattr(native_layer, "norm_rotate_attend", lambda *a: calls.append("attend") or one_call(*a))
    monkeypatch.setattr(LayerStep, "run", lambda self, *a: calls.append("layer") or layer_call(self, *a))
    pool = model.new_pool(slots=2, max_length=256, kv_dtype=KV_DTYPES[kv_dtype])
    a, b = pool.new_sequence(), pool.new_sequence()
    for seq, start in ((a, 0), (b, 7)):
        seq.prefill(TOKENS[start : start + 30])

    def steps(expected: set, batch: bool) -> list[torch.Tensor]:
        calls.clear()
        a.rollback(30)
        b.rollback(30)
        chunks = (TOKENS[30:31], TOKENS[31:35])
        if batch:
            out = [pool.forward_batch([a, b], [chunk, TOKENS[3:5]])[0] for chunk in chunks]
        else:
            out = [a.forward(chunk) for chunk in chunks]
        assert set(calls) == expected, calls[:3]
        return out

    one = {"layer"} if whole_layer else {"attend"}
    runs = [steps(one, batch=False), steps({"layer"} if whole_layer else set(), batch=True)]
    monkeypatch.setattr(model, "step_stack", None)  # each layer's own call (DecoderLayer.forward_open)
    runs += [steps(one, batch=False), steps({"layer"} if whole_layer else set(), batch=True)]
    _separate(model, monkeypatch)
    reference = steps(set(), batch=True)
    assert all(torch.equal(x, y) for run in runs for x, y in zip(run, reference, strict=True))


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize(("arch", "qtype"), [(a, q) for a, q, whole in ONE_CALL_FILES if whole])
def test_a_token_tree_runs_in_one_call_with_the_bits_of_the_separate_calls(tmp_path_factory, arch, qtype,
                                                                           kv_dtype, monkeypatch):
    """A token tree through the StepStack (its nodes' keys written to the cache, and keep()
    compacting the chosen path there) gives the logits, and leaves the cache, of the separate
    calls (the nodes' keys kept aside): the next step after keep() has the same bits too."""
    path, _ = _write(tmp_path_factory, arch, qtype)
    model = NativeModel.from_gguf(path)
    calls = []
    layer_call = LayerStep.run
    monkeypatch.setattr(LayerStep, "run", lambda self, *a: calls.append("layer") or layer_call(self, *a))
    seq = model.new_pool(max_length=256, kv_dtype=KV_DTYPES[kv_dtype]).new_sequence()
    seq.prefill(TOKENS[:30])
    parents = [-1, 0, 0, 1, 1, 3, -1]

    def tree(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        seq.rollback(30)
        logits = seq.forward_tree(TOKENS[1:8], parents)
        seq.keep(path)
        return logits, seq.forward(TOKENS[9:11])

    for path_kept in ([0, 1, 3, 5], [6], [0, 2]):
        calls.clear()
        one_call = tree(path_kept)
        assert calls, "the one-call path did not run"
        with monkeypatch.context() as patched:
            _separate(model, patched)
            separate = tree(path_kept)
        assert torch.equal(one_call[0], separate[0]) and torch.equal(one_call[1], separate[1]), path_kept


SHARED_THREADS_CASES = [("gemma3", "Q4_K", "fp32"), ("qwen3", "Q5_1", "bf16"), ("llama", "Q4_0", "bf16")]


@pytest.mark.parametrize(("arch", "qtype", "kv_dtype"), SHARED_THREADS_CASES)
def test_rows_sharing_the_threads_keep_the_bits_of_the_separate_calls(tmp_path_factory, arch, qtype,
                                                                      kv_dtype, monkeypatch):
    """With every forward's attention above the parallel threshold, a batch's rows (chains of
    uneven lengths and contexts) and a token tree deal their work items to the threads together
    (jit/attention.attend_packed): their logits, and the cache the next step reads, are the
    separate calls' bit for bit."""
    from specdec.backends.native.model import one_call

    path, _ = _write(tmp_path_factory, arch, qtype)
    model = NativeModel.from_gguf(path)
    monkeypatch.setattr(one_call, "PARALLEL_WORK", 0)
    pool = model.new_pool(slots=3, max_length=256, kv_dtype=KV_DTYPES[kv_dtype])
    seqs = [pool.new_sequence() for _ in range(3)]
    for seq, length in zip(seqs, (30, 37, 9), strict=True):
        seq.prefill(TOKENS[:length])

    def run() -> list[torch.Tensor]:
        for seq, length in zip(seqs, (30, 37, 9), strict=True):
            seq.rollback(length)
        out = pool.forward_batch(seqs, [TOKENS[30:31], TOKENS[31:36], TOKENS[3:5]])
        out.append(seqs[0].forward_tree(TOKENS[1:8], [-1, 0, 0, 1, 1, 3, -1]))
        seqs[0].keep([0, 1, 3, 5])
        out += pool.forward_batch(seqs[:2], [TOKENS[9:11], TOKENS[12:13]])
        return out

    fast = run()
    assert model.step_stack is not None
    with monkeypatch.context() as patched:
        _separate(model, patched)
        separate = run()
    assert all(torch.equal(x, y) for x, y in zip(fast, separate, strict=True))
