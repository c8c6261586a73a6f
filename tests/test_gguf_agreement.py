"""The counting of scripts/bench/measure/gguf_agreement.py: agreement, near-ties, KL, match length."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "gguf_agreement", Path(__file__).parent.parent / "scripts" / "bench" / "measure" / "gguf_agreement.py")
script = sys.modules["gguf_agreement"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(script)


@pytest.mark.parametrize(("hits", "expected"), [
    ([True, True, True], 3),
    ([False, True], 0),
    ([True, True, False, False], 2),
    ([], 0),
])
def test_first_difference(hits, expected):
    assert script.first_difference(torch.tensor(hits, dtype=torch.bool)) == expected


def logits_with_top(tokens: list[int], vocab: int = 5, gap: float = 2.0) -> torch.Tensor:
    """Logits [G, vocab] whose argmax at row i is tokens[i], the runner-up `gap` below it."""
    out = torch.zeros(len(tokens), vocab)
    for i, t in enumerate(tokens):
        out[i, t] = gap
        out[i, (t + 1) % vocab] = 0.5 * gap if gap else 0.0
    return out


def test_tally_counts_agreement_near_ties_and_match_length():
    greedy = torch.tensor([1, 2, 3, 4])
    reference = logits_with_top([1, 2, 3, 4], gap=2.0)
    reference[2] = logits_with_top([3], gap=0.4)[0]  # a near-tie: top-2 gap 0.2 < 0.5
    candidate = logits_with_top([1, 2, 4, 0])  # misses at 2 (near-tie) and 3 (not)
    tally = script.Tally()
    tally.add(greedy, reference, candidate, tie_gap=0.5, prompt=7)
    tally.add(greedy, reference, reference, tie_gap=0.5, prompt=8)  # the reference itself: all agree, KL 0
    s = tally.summary()
    assert (s["positions"], s["disagreements"], s["agreement"]) == (8, 2, 0.75)
    assert s["near_tie_share"] == 0.5
    assert tally.reference_self == 8
    assert tally.match_lengths == [2, 4] and s["match_length_median"] == 3
    assert ([(m["prompt"], m["pos"], m["llama"], m["specdec"]) for m in tally.misses]
            == [(7, 2, 3, 4), (7, 3, 4, 0)])
    assert s["mean_kl"] > 0


def test_kl_is_the_reference_weighted_log_ratio():
    reference = torch.tensor([[0.0, math.log(3.0)]])  # p = (1/4, 3/4)
    candidate = torch.tensor([[0.0, 0.0]])  # q = (1/2, 1/2)
    tally = script.Tally()
    tally.add(torch.tensor([1]), reference, candidate, tie_gap=0.5)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert tally.kl_sum == pytest.approx(expected, rel=1e-6)  # fp32 logits
    assert tally.summary()["near_tie_share"] == 0.0  # q ties, argmax 0: a miss where p was not near a tie


def test_shared_misses_counts_positions_both_missed():
    a, b = script.Tally(), script.Tally()
    a.hits = [torch.tensor([True, False, False]), torch.tensor([False])]
    b.hits = [torch.tensor([False, False, True]), torch.tensor([False])]
    assert script.shared_misses(a, b) == 2
