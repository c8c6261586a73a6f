"""Rollback is a tested capability of every backend: a forward after rollback equals a fresh one."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llama
from specdec.backend import HFBackend, make_backend
from specdec.errors import SpecdecError

BACKEND_KINDS = ["hf"]


@pytest.mark.parametrize("kind", BACKEND_KINDS)
@pytest.mark.parametrize(("prefix", "junk", "keep"), [(7, 5, 3), (12, 1, 0), (1, 8, 8), (5, 4, 4)])
def test_forward_after_rollback_equals_fresh_forward(kind, prefix, junk, keep):
    target = tiny_llama(seed=0)
    tokens = torch.randint(5, 300, (prefix + junk + 6,), generator=torch.Generator().manual_seed(prefix)).tolist()
    tail = tokens[prefix + junk :]

    rolled = make_backend(kind, target)
    rolled.prefill(tokens[:prefix])
    rolled.forward(tokens[prefix : prefix + junk])  # tokens that will be rejected
    rolled.rollback(prefix + keep)
    assert rolled.length == prefix + keep
    kept = tokens[prefix : prefix + keep]
    after = rolled.forward(tail)

    fresh = make_backend(kind, target)
    fresh.prefill(tokens[:prefix] + kept)
    expected = fresh.forward(tail)
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-4)


def test_chunked_forward_equals_one_pass():
    target = tiny_llama(seed=0)
    tokens = list(range(10, 30))
    one = HFBackend(target.model).prefill(tokens)
    chunked = HFBackend(target.model)
    chunked.prefill(tokens[:9])
    rows = torch.cat([chunked.forward(tokens[9:12]), chunked.forward(tokens[12:])])
    torch.testing.assert_close(rows, one[9:], rtol=1e-4, atol=1e-4)


def test_rollback_rejects_bad_lengths():
    backend = HFBackend(tiny_llama(seed=0).model)
    backend.prefill([1, 2, 3])
    with pytest.raises(ValueError):
        backend.rollback(4)
    with pytest.raises(ValueError):
        backend.rollback(-1)


def test_context_overflow_is_refused():
    backend = HFBackend(tiny_llama(seed=0, max_positions=16).model)
    backend.prefill(list(range(10)))
    with pytest.raises(ValueError, match="context overflow"):
        backend.forward(list(range(7)))


def test_unknown_backend():
    with pytest.raises(SpecdecError, match="unknown backend"):
        make_backend("tpu", tiny_llama(seed=0))
