"""`none`: never drafts, so every step is one plain decoding step. The baseline."""

from __future__ import annotations

from specdec.drafters import Draft, Drafter, DrafterSpec, register


class NoDrafter(Drafter):
    name = "none"

    def propose(self, context_ids: list[int], k: int) -> Draft:
        return Draft([])


@register("none")
def _make(spec: DrafterSpec, target: object) -> Drafter:
    return NoDrafter()
