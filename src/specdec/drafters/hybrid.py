"""`hybrid:A+B[+...]`: ask drafters in order, keep the first draft that looks confident.

Model-free drafters (`suffix`, `ngram`) cost microseconds and are right when the text repeats
itself, but have nothing to say about fresh text; a trained head (`eagle`) costs milliseconds
a token and guesses fresh text too. A step asks the children in order and keeps the first
draft of at least `min_len` tokens (fewer when k is smaller), else the last child's: short
drafts are how the model-free drafters say a match is weak. A child that is not asked
catches up by itself the next time it is (eagle computes the features it missed then).

Usage: `hybrid:suffix+eagle:runs/smollm2-eagle-all`, `hybrid:suffix:tree=1+ngram`; the
children's options stay in their own parts, `min_len=N` goes last.
"""

from __future__ import annotations

from ..errors import SpecdecError
from . import Draft, Drafter, DrafterSpec, make_drafter, register


class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, children: list[Drafter], min_len: int = 2):
        if len(children) < 2:
            raise ValueError("a hybrid needs at least two drafters")
        if min_len < 1:
            raise ValueError(f"min_len must be >= 1, got {min_len}")
        self.children, self.min_len = children, min_len
        self.used = [0] * len(children)  # steps whose draft came from each child

    def begin(self, prompt_ids, params, generator) -> None:
        for child in self.children:
            child.begin(prompt_ids, params, generator)

    def bind_target(self, backend) -> None:
        for child in self.children:
            child.bind_target(backend)

    def propose(self, context_ids: list[int], k: int) -> Draft:
        if k <= 0:
            return Draft([])
        enough = min(k, self.min_len)
        for i, child in enumerate(self.children):
            draft = child.propose(context_ids, k)
            if len(draft) >= enough or i == len(self.children) - 1:
                self.used[i] += bool(len(draft))
                return draft
        raise AssertionError("unreachable")

    def on_verified(self, context_ids, num_accepted) -> None:
        for child in self.children:
            child.on_verified(context_ids, num_accepted)

    def end(self, context_ids) -> None:
        for child in self.children:
            child.end(context_ids)


@register("hybrid")
def _make(spec: DrafterSpec, target) -> Drafter:
    body = spec.text.partition(":")[2]
    parts = [p.strip() for p in body.split("+")]
    min_len = 2
    last, _, tail = parts[-1].rpartition(":min_len=")
    if _ and last:
        try:
            min_len = int(tail)
        except ValueError:
            raise SpecdecError(f"min_len must be an integer in {spec.text!r}", "drafter") from None
        parts[-1] = last
    if len(parts) < 2 or not all(parts):
        raise SpecdecError(f"a hybrid names two or more drafters joined by '+': hybrid:suffix+eagle:DIR, "
                           f"not {spec.text!r}", "drafter")  # fmt: skip
    if any(DrafterSpec.parse(p).name == "hybrid" for p in parts):
        raise SpecdecError(f"a hybrid cannot contain another hybrid: {spec.text!r}", "drafter")
    children = []
    for part in parts:
        child = DrafterSpec.parse(part)
        # the hybrid's own text keys a child's shared state (suffix's global store), so that
        # a hybrid never learns from a standalone drafter of the same name in this process
        child.text, child.device = f"{spec.text} [{part}]", spec.device
        children.append(make_drafter(child, target))
    try:
        return HybridDrafter(children, min_len)
    except ValueError as e:
        raise SpecdecError(f"bad hybrid {spec.text!r}: {e}", "drafter") from e
