"""The hybrid drafter: children asked in order, the first confident draft kept, output exact."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec.drafters import Draft, Drafter, make_drafter
from specdec.drafters.eagle import EagleDrafter, EagleHead, head_config_from_target
from specdec.drafters.hybrid import HybridDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixDrafter
from specdec.engine import Engine
from specdec.errors import SpecdecError

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=4, hidden=64)


class Fixed(Drafter):
    """Proposes a fixed number of tokens (7s) and records what it was told."""

    def __init__(self, length: int):
        self.length, self.calls, self.verified, self.ended = length, 0, 0, 0

    def propose(self, context_ids, k):
        self.calls += 1
        return Draft([7] * min(k, self.length))

    def on_verified(self, context_ids, num_accepted):
        self.verified += 1

    def end(self, context_ids):
        self.ended += 1


@pytest.mark.parametrize(
    "lengths, k, min_len, used",
    [
        ((3, 5), 4, 2, 0),  # the first is confident enough
        ((1, 5), 4, 2, 1),  # too short: the next one drafts
        ((1, 5), 1, 2, 0),  # k = 1: one token is all a draft can be
        ((0, 0), 4, 2, 1),  # nobody drafts: the last child's (empty) draft
        ((1, 1, 4), 4, 2, 2),
        ((2, 5), 4, 3, 1),
    ],
)
def test_first_confident_child_drafts(lengths, k, min_len, used):
    children = [Fixed(n) for n in lengths]
    hybrid = HybridDrafter(children, min_len)
    draft = hybrid.propose([1, 2, 3], k)
    assert len(draft) == min(k, lengths[used])
    assert [c.calls for c in children] == [1] * (used + 1) + [0] * (len(lengths) - used - 1)
    hybrid.on_verified([1, 2, 3, 7], 1)
    hybrid.end([1, 2, 3, 7])
    assert all(c.verified == 1 and c.ended == 1 for c in children)  # every child follows the request


def test_factory_parses_children_and_rejects_bad_specs(target):
    hybrid = make_drafter("hybrid:suffix:depth=16+ngram:max=4:min_len=3", target)
    assert isinstance(hybrid, HybridDrafter) and hybrid.min_len == 3
    suffix, ngram = hybrid.children
    assert isinstance(suffix, SuffixDrafter) and suffix.depth == 16
    assert isinstance(ngram, NgramDrafter) and ngram.max_n == 4
    # its suffix child keeps its own global store, not the one of a standalone `suffix:depth=16`
    assert suffix.store is not make_drafter("suffix:depth=16", target).store
    for bad, match in [("hybrid", "two or more"),
                       ("hybrid:suffix", "two or more"),
                       ("hybrid:suffix+", "two or more"),
                       ("hybrid:suffix+colour", "unknown drafter"),
                       ("hybrid:suffix+ngram:min_len=x", "min_len"),
                       ("hybrid:suffix+hybrid:ngram+none", "another hybrid"),
                       ("hybrid:suffix+ngram:min_len=0", "min_len")]:
        with pytest.raises(SpecdecError, match=match):
            make_drafter(bad, target)


def test_suffix_then_eagle_is_lossless_and_uses_both(target):
    plain = Engine(target, "none", k=0).generate(PROMPT, max_new_tokens=32, chat=False)
    torch.manual_seed(0)
    head = EagleHead(head_config_from_target(target.model)).eval()
    eagle = EagleDrafter(head, None, target.eos_token_ids)
    hybrid = HybridDrafter([SuffixDrafter(None, depth=16, eos_token_ids=target.eos_token_ids), eagle])
    engine = Engine(target, hybrid, k=3)
    out = engine.generate(PROMPT, max_new_tokens=32, chat=False)
    assert engine.backend.hidden is not None  # eagle, inside the hybrid, was bound to the target
    assert out.token_ids == plain.token_ids
    assert out.stats.num_draft_tokens > 0
    assert all(n > 0 for n in hybrid.used), hybrid.used  # the prompt repeats itself; the head fills in
    sampled = engine.generate(PROMPT, max_new_tokens=12, chat=False, temperature=0.8, seed=1)
    assert len(sampled.token_ids) == 12


def test_a_child_that_keeps_missing_is_asked_only_to_probe():
    short, head = Fixed(1), Fixed(5)
    hybrid = HybridDrafter([short, head], min_len=2, min_alpha=0.3, probe_every=16)
    for _ in range(3):  # the head drafts 4 tokens and misses them: from the prior 0.5 to 0.27
        assert len(hybrid.propose([1, 2, 3], 4)) == 4
        hybrid.on_verified([1, 2, 3, 9], 0)
    assert hybrid.alpha(1) < 0.3
    asked = head.calls
    drafts = [len(hybrid.propose([1, 2, 3], 4)) for _ in range(32)]  # no verification: no new evidence
    assert head.calls - asked == 2  # two probes in 32 steps
    assert drafts.count(4) == 2 and drafts.count(1) == 30  # otherwise the first child's short draft
    for _ in range(5):  # the head starts hitting again (on its probes)
        hybrid._skipped[1] = hybrid.probe_every - 1
        hybrid.propose([1, 2, 3], 4)
        hybrid.on_verified([1, 2, 3, 7, 7, 7, 7, 7], 4)
    assert hybrid.alpha(1) >= 0.3 and len(hybrid.propose([1, 2, 3], 4)) == 4
