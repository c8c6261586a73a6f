"""Registers the drafter `test-faulty` in a server process (tests/test_server_isolation.py):
ngram, except that it raises when a request whose prompt contains POISON ends."""

from __future__ import annotations

from specdec.drafters import Drafter, make_drafter, register

POISON = "POISON"


class FaultyDrafter(Drafter):
    name = "test-faulty"

    def __init__(self, target):
        self.inner, self.tokenizer = make_drafter("ngram:min=1", target), target.tokenizer
        self.poisoned = False

    def begin(self, prompt_ids, params, generator):
        self.poisoned = POISON in self.tokenizer.decode(prompt_ids)
        self.inner.begin(prompt_ids, params, generator)

    def propose(self, context_ids, k):
        return self.inner.propose(context_ids, k)

    def on_verified(self, context_ids, num_accepted):
        self.inner.on_verified(context_ids, num_accepted)

    def end(self, context_ids):
        if self.poisoned:
            raise RuntimeError("faulty drafter")
        self.inner.end(context_ids)


@register("test-faulty")
def _make(spec, target) -> Drafter:
    return FaultyDrafter(target)
