"""Log-probabilities of the emitted tokens, read from the rows the target already scored.

Semantics (vLLM's default `raw_logprobs`): the log-softmax of the target's logits at the
token's position, before temperature, top-k and top-p; under a grammar (structured output,
tool calls), after its mask, since vLLM also applies the structured-output bitmask first.
A token gets the same row whether it was emitted as an accepted draft, a recovered or bonus
token, or by plain decoding: the row is the target's distribution after the same prefix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit, and vLLM's default max_logprobs
MIN_LOGPROB = -9999.0  # the floor of a reported logprob, as in vLLM: JSON has no -inf


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the row's likeliest tokens, likeliest first; never masked ones


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int],
                   top_n: int) -> list[TokenLogprob]:
    """logits: [T, V] a step's scored rows; rows[i]: the row that predicted tokens[i].
    Returns each token's logprob and the row's `top_n` likeliest tokens."""
    if not tokens:
        return []
    logprobs = logits[rows].float().log_softmax(-1)  # [len(tokens), V]
    chosen = logprobs.gather(-1, torch.tensor(tokens, dtype=torch.long, device=logprobs.device).unsqueeze(-1))
    chosen_list = chosen.squeeze(-1).clamp_min(MIN_LOGPROB).tolist()
    if top_n > 0:
        values, ids = logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)  # [len(tokens), top_n]
        finite = values.isfinite().tolist()  # a grammar's masked tokens (-inf) are no one's alternative
        values = values.clamp_min(MIN_LOGPROB)
        tops = [tuple((i, v) for i, v, ok in zip(ri, rv, rf, strict=True) if ok)
                for ri, rv, rf in zip(ids.tolist(), values.tolist(), finite, strict=True)]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen_list, tops, strict=True)]
