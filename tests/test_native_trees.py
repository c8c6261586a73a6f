"""Token trees on the native backend, eager and compiled: each node scores with the bits of
its path decoded one token per step, keep() leaves the cache a chain would, hidden states
follow, and a compiled model agrees with itself over chains, batches and trees."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec.backends import make_backend
from specdec.backends.native.model.native_model import NativeModel
from specdec.tree import tree_path
from test_native import TOL, fresh_logits, random_tokens


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


@pytest.fixture(scope="module")
def model(target):
    return NativeModel.from_hf(target.model)


# ---- trees -----------------------------------------------------------------------------------

TREES = {
    "chain": [-1, 0, 1, 2],
    "branches": [-1, 0, 0, 1, 2, 2, 5],
    "forest": [-1, -1, 0, 1, 1],
    "single": [-1],
}


@pytest.mark.parametrize("shape", list(TREES))
def test_tree_forward_matches_chain_forwards(model, shape):
    parents = TREES[shape]
    prefix, nodes, tail = (random_tokens(6, seed=1), random_tokens(len(parents), seed=2),
                           random_tokens(3, seed=4))
    seq = model.new_pool().new_sequence()
    seq.prefill(prefix)
    logits = seq.forward_tree(nodes, parents)  # [T, V]
    for i in range(len(parents)):
        path = [nodes[j] for j in tree_path(parents, i)]
        torch.testing.assert_close(logits[i], fresh_logits(model, prefix, path)[-1], **TOL)
    deepest = max(range(len(parents)), key=lambda i: len(tree_path(parents, i)))
    keep = tree_path(parents, deepest)
    seq.keep(keep)
    assert seq.length == len(prefix) + len(keep)
    expected = fresh_logits(model, prefix + [nodes[j] for j in keep], tail)
    torch.testing.assert_close(seq.forward(tail), expected, **TOL)


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("shape", ["branches", "forest"])
def test_tree_scores_every_path_with_the_bits_of_plain_decoding(target, precision, shape, kv_dtype):
    """Tree nodes attend with their path laid out as a chain would hold it (attention.py), so
    each node's logits, and the cache kept after `keep`, are bit-identical to decoding that
    path one token per step: token trees stay exact over a quantized target (whose kernels
    are row-wise; fp32 GEMM is not, see test_quantized_scoring_is_batch_invariant), with an
    fp32 or a bf16 cache."""
    parents = TREES[shape]
    prefix, nodes, tail = (random_tokens(7, seed=5), random_tokens(len(parents), seed=6),
                           random_tokens(2, seed=7))
    tree = make_backend("native", target, precision=precision, kv_dtype=kv_dtype)
    tree.prefill(prefix)
    logits = tree.forward_tree(nodes, parents)  # [T, V]
    deepest = max(range(len(parents)), key=lambda i: len(tree_path(parents, i)))
    for i in range(len(parents)):
        steps = make_backend("native", target, precision=precision, kv_dtype=kv_dtype)
        steps.prefill(prefix)
        path = [nodes[j] for j in tree_path(parents, i)]
        rows = torch.cat([steps.forward([token]) for token in path])
        assert torch.equal(logits[i], rows[-1]), i
        if i == deepest:
            tree.keep(tree_path(parents, i))
            assert torch.equal(tree.forward(tail), torch.cat([steps.forward([token]) for token in tail]))


def test_tree_keep_nothing_and_bad_paths(model):
    seq = model.new_pool().new_sequence()
    seq.prefill([5, 6, 7])
    seq.forward_tree([8, 9, 10], [-1, 0, 0])
    with pytest.raises(ValueError, match="keep"):
        seq.forward([1])  # the tree must be resolved first
    with pytest.raises(ValueError, match="root-to-leaf"):
        seq.keep([1, 2])
    seq.keep([])
    torch.testing.assert_close(seq.forward([11]), fresh_logits(model, [5, 6, 7], [11]), **TOL)
    with pytest.raises(ValueError, match="parent must come before"):
        seq.forward_tree([1, 2], [1, -1])


def test_hidden_states_follow_rollback_and_keep(target, model):
    tokens = random_tokens(12, seed=5)
    seq = model.new_pool().new_sequence()
    seq.enable_hidden_states()
    seq.prefill(tokens[:8])
    seq.forward(tokens[8:])
    seq.rollback(6)
    seq.forward_tree(tokens[6:9], [-1, 0, -1])
    seq.keep([0, 1])
    with torch.no_grad():
        out = target.model(torch.tensor([tokens[:8]]), output_hidden_states=True)
    torch.testing.assert_close(seq.hidden, out.hidden_states[-1][0], **TOL)


# ---- compiled ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_model_is_close_to_eager_and_consistent_with_itself(kv_dtype):
    """torch.compile of a tiny model at the cpu default, int4 (about a minute of compiling on
    two cores). Inductor fuses norms and rotations with its own rounding, so compiled logits
    are only close to eager ones; but a compiled model must agree with itself bit for bit
    whatever it scores at once: a chain of drafts, a batch of sequences (run one by one), a
    token tree (its compiled layers around the kernel's attention), and what keep() leaves;
    with an fp32 or a bf16 cache."""
    from torch._dynamo.utils import counters

    eager = NativeModel.from_hf(tiny_llama(seed=0, layers=1).model, "int4")
    compiled = NativeModel.from_hf(tiny_llama(seed=0, layers=1).model, "int4")
    pool = compiled.new_pool(slots=2, kv_dtype=kv_dtype)
    assert compiled.compile(pool) > 0  # traced in one slot
    graphs = counters["stats"]["unique_graphs"]
    tokens = random_tokens(20, seed=13)
    a, b = eager.new_pool(kv_dtype=kv_dtype).new_sequence(), pool.new_sequence()
    torch.testing.assert_close(b.prefill(tokens[:9]), a.prefill(tokens[:9]), **TOL)
    for chunk in (tokens[9:10], tokens[10:13], tokens[13:20]):  # 3 and 7 tokens are padded to 4 and 8
        torch.testing.assert_close(b.forward(chunk), a.forward(chunk), **TOL)
    b.rollback(11)
    chain = b.forward(tokens[11:14])
    b.rollback(11)
    steps = torch.cat([b.forward([t]) for t in tokens[11:14]])
    assert torch.equal(chain, steps) and b.length == 14
    other = pool.new_sequence()
    other.prefill(tokens[:5])
    b.rollback(11)
    batched = pool.forward_batch([b, other], [tokens[11:14], tokens[5:7]])
    assert torch.equal(batched[0], chain)
    other.rollback(5)
    assert torch.equal(batched[1], other.forward(tokens[5:7]))
    assert b.compile_seconds > 0 and a.compile_seconds == 0.0  # reported by generate and bench
    assert b.supports_tree
    pool.release(other)
    b.rollback(11)
    parents = TREES["branches"]  # 7 nodes, padded to 8 with an extra root
    nodes = random_tokens(len(parents), seed=14)
    tree = b.forward_tree(nodes, parents)
    assert tree.shape[0] == len(parents) and b.length == 11 + len(parents)
    for i in range(len(parents)):
        b2 = pool.new_sequence()
        b2.prefill(tokens[:9])
        b2.forward(tokens[9:11])  # as b's cache holds them: decoded, not prefilled
        path = [nodes[j] for j in tree_path(parents, i)]
        assert torch.equal(tree[i], torch.cat([b2.forward([t]) for t in path])[-1]), i
        if i == 6:  # the deepest: keep it, and the next steps see the bits a chain would have left
            b.keep(tree_path(parents, i))
            assert torch.equal(b.forward(tokens[14:16]), b2.forward(tokens[14:16]))
        pool.release(b2)
    # compile() traced every graph: the other slot took none of its own
    assert counters["stats"]["unique_graphs"] == graphs
