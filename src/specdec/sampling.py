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


# ---- draws keyed to the output position ------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _mix(seed: int, position: int, stream: int) -> int:
    """A 64-bit key for (seed, position, stream): splitmix64's finaliser over their sum."""
    x = (seed + position * 0x9E3779B97F4A7C15 + stream * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class PositionDraws:
    """A seeded request's random numbers, keyed to the output position they decide.

    The draws for output token i come from a generator seeded with (seed, i) alone, so they
    do not depend on how many tokens a step drafted or how earlier steps went: a seeded
    request gives the same reply whatever k the load policy picks. Stream 0 is the
    exponential noise of `sample_at`; stream 1 the uniforms that accept soft drafts.
    """

    def __init__(self, seed: int):
        self.seed = int(seed) & _MASK64

    def _generator(self, position: int, stream: int) -> torch.Generator:
        return torch.Generator().manual_seed(_mix(self.seed, position, stream))

    def exponentials(self, position: int, size: int) -> torch.Tensor:
        """[size] Exp(1) noise for output position `position`."""
        return torch.rand(size, generator=self._generator(position, 0)).log_().neg_()

    def uniforms(self, position: int, n: int) -> torch.Tensor:
        """[n] U[0, 1) draws for output position `position`."""
        return torch.rand(n, generator=self._generator(position, 1))


class StreamDraws:
    """Draws taken in turn from one torch.Generator, whatever the position: exact in
    distribution, but a seed's reply then depends on the order of the draws (on k)."""

    def __init__(self, generator: torch.Generator | None):
        self.generator = generator

    def exponentials(self, position: int, size: int) -> torch.Tensor:
        return torch.rand(size, generator=self.generator).log_().neg_()

    def uniforms(self, position: int, n: int) -> torch.Tensor:
        return torch.rand(n, generator=self.generator)


Draws = PositionDraws | StreamDraws


def as_draws(draws: Draws | torch.Generator | None) -> Draws:
    return draws if isinstance(draws, PositionDraws | StreamDraws) else StreamDraws(draws)


def sample_at(probs: torch.Tensor, draws: Draws, position: int) -> int:
    """probs: [V] -> one token, argmax(probs / E) with E ~ Exp(1) the position's noise.

    This is the Gumbel-max trick in the form of an exponential race: token x wins with
    probability probs[x]. With position-keyed noise the token at output position i is a
    function of (seed, i, probs) only, so speculative and plain decoding draw the same token.
    """
    noise = draws.exponentials(position, probs.shape[-1]).to(probs.device)  # [V]
    return int((probs / noise).argmax())
