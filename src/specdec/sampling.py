"""Turning logits into a sampling distribution, and drawing from it.

Plain decoding and speculative verification both go through `logits_to_probs`, so the
distribution that verification preserves is exactly the one plain sampling draws from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.errors import SpecdecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1 disables nucleus filtering

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpecdecError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise SpecdecError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise SpecdecError(f"top_k must be >= 0, got {self.top_k}", "top_k")


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [..., V] -> probs: [..., V] after temperature, then top-k, then top-p.

    The order is the one transformers' logits warpers use. Greedy params give a one-hot
    distribution on the argmax, so greedy is a special case of the same verifier.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop the low tail whose total mass is <= 1 - top_p, but always keep the top token.
        drop_sorted = cumulative <= (1.0 - params.top_p)
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs: [..., V] -> token ids: [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
