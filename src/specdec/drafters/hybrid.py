"""`hybrid:A+B[+...]`: ask drafters in order, keep the first draft that looks confident.

Model-free drafters (`suffix`, `ngram`) cost microseconds and are right when the text repeats
itself, but have nothing to say about fresh text; a trained head (`eagle`) costs milliseconds
a token and guesses fresh text too. A step asks the children in order and keeps the first
draft of at least `min_len` tokens (fewer when k is smaller), else the last child's: short
drafts are how the model-free drafters say a match is weak. A child that is not asked
catches up by itself the next time it is (eagle computes the features it missed then).

The hybrid keeps each child's acceptance rate (the controller sees one rate for all of
them), and a later child whose rate is below `min_alpha` is not asked, except for a probe
every `probe_every` steps: where the head guesses badly (translation, say) its misses would
otherwise drag k down for the suffix drafter's sure copies.

Usage: `hybrid:suffix+eagle:runs/smollm2-eagle-all`, `hybrid:suffix:tree=1+ngram`; the
children's options stay in their own parts, `min_len=N` goes last.
"""

from __future__ import annotations

from specdec.drafters import Draft, Drafter, DrafterSpec, make_drafter, register
from specdec.errors import SpecdecError


class HybridDrafter(Drafter):
    name = "hybrid"

    def __init__(self, children: list[Drafter], min_len: int = 2, min_alpha: float = 0.3,
                 probe_every: int = 16, decay: float = 0.95):
        if len(children) < 2:
            raise ValueError("a hybrid needs at least two drafters")
        if min_len < 1:
            raise ValueError(f"min_len must be >= 1, got {min_len}")
        if not 0.0 <= min_alpha < 1.0:
            raise ValueError(f"min_alpha must be in [0, 1), got {min_alpha}")
        self.children, self.min_len, self.min_alpha = children, min_len, min_alpha
        self.probe_every, self.decay = probe_every, decay
        self.used = [0] * len(children)  # steps whose draft came from each child
        # per child: decayed accepted tokens and rejections, from a neutral prior (α = 0.5)
        # worth a few steps, so that a couple of early misses do not silence a child
        self._accepted, self._rejected = [2.0] * len(children), [2.0] * len(children)
        self._skipped = [0] * len(children)
        self._last: tuple[int, int] | None = None  # (child, draft length) of the current step

    def alpha(self, i: int) -> float:
        return self._accepted[i] / (self._accepted[i] + self._rejected[i])

    def _asks(self, i: int) -> bool:
        if i == 0 or self.alpha(i) >= self.min_alpha:
            return True
        self._skipped[i] += 1
        if self._skipped[i] >= self.probe_every:  # probe: conditions change within a request
            self._skipped[i] = 0
            return True
        return False

    def begin(self, prompt_ids, params, generator) -> None:
        for child in self.children:
            child.begin(prompt_ids, params, generator)

    def bind_target(self, backend) -> None:
        for child in self.children:
            child.bind_target(backend)

    def scope(self, tenant: str) -> None:
        for child in self.children:
            child.scope(tenant)

    def propose(self, context_ids: list[int], k: int) -> Draft:
        self._last = None
        if k <= 0:
            return Draft([])
        enough = min(k, self.min_len)
        best, source = Draft([]), 0
        for i, child in enumerate(self.children):
            if not self._asks(i):
                continue
            draft = child.propose(context_ids, k)
            if len(draft) > len(best) or i == 0:
                best, source = draft, i
            if len(draft) >= enough:
                break
        if len(best):
            self.used[source] += 1
            self._last = (source, len(best))
        return best

    def on_verified(self, context_ids, num_accepted) -> None:
        if self._last is not None:  # the same geometric estimate as the controller's
            i, drafted = self._last
            self._accepted[i] = self.decay * self._accepted[i] + num_accepted
            self._rejected[i] = self.decay * self._rejected[i] + (num_accepted < drafted)
            self._last = None
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
                           f"not {spec.text!r}", "drafter")
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
