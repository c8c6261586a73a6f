"""Verification of a drafted chain against the target's distributions. Pure functions.

Vocabulary (as in vLLM's rejection sampler):
- accepted tokens: draft tokens that the target kept;
- recovered token: the token sampled from the residual at the first rejection;
- bonus token: the token sampled from the target after every draft was accepted.
A step therefore emits num_accepted + 1 tokens, and always at least one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import Draws, as_draws, sample_at


@dataclass(frozen=True)
class VerifyResult:
    num_accepted: int
    next_token: int  # the recovered token, or the bonus token when every draft was accepted
    num_drafted: int

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        return list(draft_tokens[: self.num_accepted]) + [self.next_token]


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor) -> VerifyResult:
    """draft_tokens: [k]; target_argmax: [k+1], the target's choice after each prefix."""
    k = draft_tokens.shape[0]
    mismatch = (draft_tokens != target_argmax[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return VerifyResult(n, int(target_argmax[n]), k)


def verify_sampling(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    draws: Draws | torch.Generator | None,
    position: int = 0,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_tokens: [k]
    draft_probs:  [k, V] the distribution each draft token was sampled from, or None for a
                  deterministic drafter (treated as one-hot on the drafted token)
    target_probs: [k+1, V] the target's (temperature/top-k/top-p processed) distributions
    draws:        the request's random draws (sampling.PositionDraws), or a torch.Generator
    position:     the output position of the first verified token, which keys its draws

    A deterministic draft takes the target's own sample at each position (`sample_at`) and
    is accepted exactly when it equals it: for a one-hot draft that is rejection sampling,
    and the reply is token for token the one plain sampling draws with the same seed.
    """
    draws = as_draws(draws)
    if draft_probs is None:
        return _verify_one_hot(draft_tokens.tolist(), target_probs, draws, position)
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    target_of_draft = target_probs[positions, draft_tokens]  # [k]
    draft_of_draft = draft_probs[positions, draft_tokens]  # [k]
    accept_prob = (target_of_draft / draft_of_draft.clamp_min(1e-30)).clamp(max=1.0)  # [k]
    for n in range(k):
        if float(draws.uniforms(position + n, 1)) >= float(accept_prob[n]):
            residual = residual_distribution(target_probs[n], draft_probs[n], int(draft_tokens[n]))
            return VerifyResult(n, sample_at(residual, draws, position + n), k)
    return VerifyResult(k, sample_at(target_probs[k], draws, position + k), k)


def _verify_one_hot(draft_tokens: list[int], target_probs: torch.Tensor, draws: Draws,
                    position: int) -> VerifyResult:
    """Accept while each draft token equals the target's sample at its position; the first
    sample that differs (or the one after the last draft) is the next token."""
    k = len(draft_tokens)
    for n, drafted in enumerate(draft_tokens):
        token = sample_at(target_probs[n], draws, position + n)
        if token != drafted:
            return VerifyResult(n, token, k)  # the recovered token: the target's own sample
    return VerifyResult(k, sample_at(target_probs[k], draws, position + k), k)


def residual_distribution(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, draft_token: int
) -> torch.Tensor:
    """norm(max(target - draft, 0)) over [V]; a one-hot draft just removes the drafted token."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # only reachable through rounding, when target == draft
        return target_probs
    return residual / total
