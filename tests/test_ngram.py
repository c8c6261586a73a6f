"""Prompt lookup: table-driven."""

from __future__ import annotations

import pytest

from specdec.drafters import DrafterSpec, make_drafter
from specdec.drafters.ngram import NgramDrafter
from specdec.errors import SpecdecError


@pytest.mark.parametrize(
    ("context", "k", "min_n", "max_n", "expected"),
    [
        ([5, 6, 7, 1, 2, 5, 6], 3, 2, 2, [7, 1, 2]),  # suffix [5 6] seen at 0 -> continue with 7 1 2
        ([5, 6, 7, 1, 2, 5, 6], 10, 2, 2, [7, 1, 2, 5, 6]),  # continuation runs up to the context's end
        ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 2, 2, 3, [9, 2]),  # longest match (3) wins over the later 2-gram
        ([4, 2, 3, 8, 4, 2, 3, 9, 2, 3], 1, 2, 3, [9]),  # most recent occurrence among equals
        ([1, 2, 3, 4], 3, 2, 4, []),  # nothing repeats
        ([7, 7], 4, 1, 2, [7]),
        ([3, 4, 9, 1, 3, 4], 0, 2, 2, []),  # k = 0 drafts nothing
    ],
)
def test_proposals(context, k, min_n, max_n, expected):
    drafter = NgramDrafter(min_n, max_n)
    drafter.begin(context, None, None)
    assert drafter.propose(context, k).tokens == expected


def test_incremental_index_matches_fresh_index():
    context = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    incremental = NgramDrafter(2, 4)
    incremental.begin(context[:4], None, None)
    for n in range(4, len(context) + 1):
        got = incremental.propose(context[:n], 3).tokens
        fresh = NgramDrafter(2, 4)
        assert got == fresh.propose(context[:n], 3).tokens


def test_never_drafts_past_eos():
    drafter = NgramDrafter(2, 4, eos_token_ids={0})
    context = [5, 6, 7, 0, 8, 9, 5, 6]
    assert drafter.propose(context, 5).tokens == [7, 0]


def test_rebuilds_when_context_is_not_an_extension():
    drafter = NgramDrafter(2, 2)
    assert drafter.propose([1, 2, 3, 1, 2], 1).tokens == [3]
    assert drafter.propose([4, 2, 9, 4, 2], 1).tokens == [9]


@pytest.mark.parametrize("spec", ["ngram:min=0", "ngram:min=5:max=2", "ngram:max=x"])
def test_bad_options(spec):
    with pytest.raises(SpecdecError):
        make_drafter(spec, None)


def test_spec_parsing():
    spec = DrafterSpec.parse("model:/tmp/a:b:k=4")
    assert (spec.name, spec.arg, spec.options) == ("model", "/tmp/a:b", {"k": "4"})
    with pytest.raises(SpecdecError, match="unknown drafter"):
        make_drafter("telepathy", None)
