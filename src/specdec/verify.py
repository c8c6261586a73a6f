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

from specdec.sampling import sample


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
    generator: torch.Generator | None,
) -> VerifyResult:
    """Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    draft_tokens: [k]
    draft_probs:  [k, V] the distribution each draft token was sampled from, or None for a
                  deterministic drafter (treated as one-hot on the drafted token)
    target_probs: [k+1, V] the target's (temperature/top-k/top-p processed) distributions
    """
    k = draft_tokens.shape[0]
    positions = torch.arange(k)
    target_of_draft = target_probs[positions, draft_tokens]  # [k]
    if draft_probs is None:
        accept_prob = target_of_draft
    else:
        draft_of_draft = draft_probs[positions, draft_tokens]  # [k]
        accept_prob = (target_of_draft / draft_of_draft.clamp_min(1e-30)).clamp(max=1.0)
    uniform = torch.rand(k, generator=generator, dtype=target_probs.dtype)  # [k]
    rejected = (uniform >= accept_prob).nonzero()
    n = int(rejected[0, 0]) if rejected.numel() else k
    if n == k:
        return VerifyResult(k, int(sample(target_probs[k], generator)), k)
    residual = residual_distribution(
        target_probs[n], None if draft_probs is None else draft_probs[n], int(draft_tokens[n])
    )
    return VerifyResult(n, int(sample(residual, generator)), k)


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
