"""EAGLE-2 draft trees from the EAGLE head, on tiny random models."""

from __future__ import annotations

import pytest
import torch

from conftest import spy_trees, tiny_llama
from specdec.backends import make_backend
from specdec.drafters import make_drafter
from specdec.drafters.eagle import EagleDrafter, EagleHead, head_config_from_target
from specdec.engine import Engine
from specdec.tree import check_tree, first_path, tree_depths

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=4, hidden=64)


def _lean(target, head: EagleHead, precision: str, backend: str = "native"):
    """The head on a backend's kernels, built through its FeatureModel as the drafter builds it."""
    return make_backend(backend, target).feature_model().draft_head(head.state_dict(), head.dims, None,
                                                                    precision)


def _head(target, std: float = 0.05) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(head_config_from_target(target.model)).eval()
    for p in head.parameters():  # a trained head: no zeroed projections
        torch.nn.init.normal_(p, std=std)
    return head


def test_tree_nodes_see_what_their_chains_see(target):
    """A level of tree nodes, run in one call with an ancestor mask, predicts for each node
    what the head predicts when its path is drafted alone as a chain."""
    head = _head(target)
    feats, embeds = torch.randn(10, 64), torch.randn(10, 64)
    node_feats, node_embeds = torch.randn(4, 64), torch.randn(4, 64)
    # roots a (0), b (1) at position 10, slots 10, 11; then c (2) under a, d (3) under b at position 11
    tree = _lean(target, head, "fp32")
    tree.forward(feats, embeds, 0)
    visible = torch.zeros(2, 12, dtype=torch.bool)
    visible[:, :10] = True
    visible[0, 10] = visible[1, 11] = True
    roots = tree.forward_nodes(node_feats[:2], node_embeds[:2], [10, 10], 10, visible)
    visible = torch.zeros(2, 14, dtype=torch.bool)
    visible[:, :10] = True
    visible[0, [10, 12]] = True
    visible[1, [11, 13]] = True
    leaves = tree.forward_nodes(node_feats[2:], node_embeds[2:], [11, 11], 12, visible)

    chain = _lean(target, head, "fp32")
    chain.forward(feats, embeds, 0)
    for root, leaf in ((0, 2), (1, 3)):  # each path from position 10, over the other's guesses
        got_root = chain.forward(node_feats[root : root + 1], node_embeds[root : root + 1], 10)
        got_leaf = chain.forward(node_feats[leaf : leaf + 1], node_embeds[leaf : leaf + 1], 11)
        torch.testing.assert_close(roots[root], got_root[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(leaves[root], got_leaf[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab_ids", [None, torch.arange(60)], ids=["full-vocab", "fr-spec"])
def test_proposed_tree_is_ranked_best_first(target, vocab_ids):
    drafter = EagleDrafter(_head(target), vocab_ids, target.eos_token_ids, tree=True, width=3,
                           max_nodes=10)
    engine = Engine(target, drafter, k=4)
    engine.backend.prefill([5, 17, 33, 2, 90, 41])  # the cache holds all but the pending token
    draft = drafter.propose([5, 17, 33, 2, 90, 41, 7], 4)
    assert draft.parents is not None and draft.probs is None and len(draft.tokens) == 10
    check_tree(draft.parents)
    assert max(tree_depths(draft.parents)) <= 3  # within k
    for node in range(-1, len(draft.tokens)):  # siblings are distinct tokens, at most `width`
        kids = [draft.tokens[i] for i, p in enumerate(draft.parents) if p == node]
        assert len(kids) == len(set(kids)) <= 3
        if vocab_ids is not None:
            assert all(t < 60 for t in kids)
    # The best chain is the head's own greedy chain, as far as the tree follows it.
    chain = EagleDrafter(_head(target), vocab_ids, target.eos_token_ids)
    chain.bind_target(engine.backend)
    greedy = chain.propose([5, 17, 33, 2, 90, 41, 7], 4).tokens
    best = [draft.tokens[i] for i in first_path(draft.parents)]
    assert len(best) >= 2 and best == greedy[: len(best)]


def _engine(target, tree: bool, backend: str, vocab_ids=None, **options):
    drafter = EagleDrafter(_head(target, std=0.02), vocab_ids, target.eos_token_ids, tree=tree,
                           **options)
    return Engine(target, drafter, k=4, backend=backend)


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_greedy_tree_drafting_is_lossless(target, backend):
    plain = Engine(target, "none", k=0, backend=backend).generate(PROMPT, max_new_tokens=40, chat=False)
    # An untrained head guesses at random; on a vocabulary subset holding the answer's tokens
    # (FR-Spec), a tree of its 8 best guesses per level hits often enough to accept some.
    vocab_ids = torch.tensor(sorted(set(plain.token_ids)))
    engine = _engine(target, True, backend, vocab_ids, width=8)
    trees = spy_trees(engine.backend)
    out = engine.generate(PROMPT, max_new_tokens=40, chat=False)
    assert out.token_ids == plain.token_ids
    assert trees and any(len(set(p)) < len(p) for p in trees)  # some steps really branched
    assert out.stats.num_draft_tokens > 0 and out.stats.num_accepted_tokens > 0


def test_sampling_with_tree_drafts_is_reproducible(target):
    """Under sampling the tree is deterministic (one-hot drafts), verified by recursive
    rejection (tree.verify_tree_sampling, tested for exactness in test_tree)."""
    runs = []
    for _ in range(2):
        engine = _engine(target, True, "native")
        trees = spy_trees(engine.backend)
        runs.append(engine.generate(PROMPT, max_new_tokens=24, chat=False, temperature=0.8, seed=3))
        assert trees
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 24


def test_tree_options_parse(target, tmp_path):
    from specdec.drafters.eagle import save_head
    from specdec.errors import SpecdecError

    save_head(tmp_path, _head(target), "tiny", None, {"vocab_size": target.model.config.vocab_size})
    drafter = make_drafter(f"eagle:{tmp_path}:tree=1:width=2:nodes=6", target)
    assert drafter.tree and drafter.width == 2 and drafter.max_nodes == 6
    assert not make_drafter(f"eagle:{tmp_path}", target).tree
    for bad in ("width=0", "nodes=x"):
        with pytest.raises(SpecdecError, match="width and nodes"):
            make_drafter(f"eagle:{tmp_path}:tree=1:{bad}", target)
