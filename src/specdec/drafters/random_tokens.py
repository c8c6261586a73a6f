"""`random[:seed=N]`: k tokens drawn uniformly from the vocabulary, which the target almost
never accepts. A baseline for what speculation's machinery costs when it cannot win: the
adaptive controller should make it run within a few percent of `none`."""

from __future__ import annotations

import torch

from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.errors import SpecdecError


class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, vocab_size: int, seed: int):
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, context_ids: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        return Draft(torch.randint(self.vocab_size, (k,), generator=self.generator).tolist())


@register("random")
def _make(spec: DrafterSpec, target) -> Drafter:
    unknown = sorted(set(spec.options) - {"seed", "k"})
    if unknown:
        raise SpecdecError(f"unknown random option {unknown[0]!r} in {spec.text!r}; it takes seed=N",
                           "drafter")
    try:
        seed = int(spec.options.get("seed", 0))
    except ValueError:
        raise SpecdecError(f"bad random options in {spec.text!r}: seed must be an integer",
                           "drafter") from None
    return RandomDrafter(target.vocab_size, seed)
