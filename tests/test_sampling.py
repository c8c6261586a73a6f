"""logits_to_probs applies temperature, top-k and top-p exactly as transformers' warpers do."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams, logits_to_probs


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    warpers = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    return warpers(None, logits.clone()).softmax(-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(1.0),
        SamplingParams(0.5),
        SamplingParams(1.0, top_k=5),
        SamplingParams(0.8, top_p=0.9),
        SamplingParams(1.2, top_k=20, top_p=0.5),
        SamplingParams(1.0, top_p=0.01),  # keeps only the top token
    ],
    ids=str,
)
def test_matches_transformers_warpers(params):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(logits_to_probs(logits, params), hf_probs(logits, params))


def test_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingParams(0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(-0.1), "temperature"),
        (SamplingParams(float("nan")), "temperature"),
        (SamplingParams(1.0, top_p=0.0), "top_p"),
        (SamplingParams(1.0, top_p=1.5), "top_p"),
        (SamplingParams(1.0, top_k=-1), "top_k"),
    ],
)
def test_validation_names_the_param(params, param):
    with pytest.raises(SpecdecError) as err:
        params.validate()
    assert err.value.param == param
