"""How many tokens each request may draft when several share one batched forward.

Alone, a request's controller weighs a k-token draft against its own step (controller.py). In a
batch the step is shared: its rows pass over the weights together, so a drafted row adds little
weight time, but every row reads its own sequence's cached keys, and at a context of thousands
that read is most of a row's price (`ScoreCosts.batch_cost`). A drafted row pays for the batch
only if the tokens it is expected to add, per second it adds, beat the batch's own tokens per
second; otherwise it slows every request in the step.

`draft_caps` grants rows one at a time, each to the request whose next drafted row adds the most
expected tokens per second (its j-th drafted token counts only when its first j are all
accepted: the request's measured chance, `AdaptiveK.acceptance`), while that rate beats the
batch's rate so far by `min_gain`. The batch's time is its forward (`ScoreCosts.batch_cost`) and
what a step costs besides (drafting, verifying, streaming: `StepOverhead`). A drafted row is
charged its keys and its drafting, not its share of the weights' pass: on short contexts that
share alone priced out drafts that paid in the load benchmark (the per-step costs it leaves out
fall with fewer, longer steps), while the keys are what make a row dear on long ones. A request's
controller may still draft fewer tokens than its cap. A request that has hardly drafted yet
drafts a token at least (`floor`): its acceptance is a prior until it does, and a prior that
prices it out of every batch would never learn better.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.controller import ScoreCosts


@dataclass(frozen=True)
class BatchRequest:
    # [j - 1]: the chance that its first j drafted tokens are all accepted, non-increasing;
    # None: a fixed k, which is not priced here
    acceptance: tuple[float, ...] | None
    context: int  # tokens in its cache: the keys each of its rows reads
    floor: int = 0  # tokens it drafts whatever they cost: a request still learning its acceptance


def draft_caps(requests: list[BatchRequest], costs: ScoreCosts, overhead: float = 0.0,
               min_gain: float = 1.02) -> list[int | None]:
    """Per request, the most tokens it may draft this step (None: not priced, a fixed k)."""
    caps: list[int | None] = [None if r.acceptance is None else min(r.floor, len(r.acceptance))
                              for r in requests]
    drafted = [c or 0 for c in caps]
    rows = len(requests) + sum(drafted)  # every request scores its pending token, and its floor's
    keys = sum((1 + n) * r.context + n * (n + 1) // 2 for r, n in zip(requests, drafted, strict=True))
    seconds = costs.batch_cost(rows, keys, len(requests)) + overhead + sum(drafted) * costs.t_draft
    tokens = sum(1.0 + (sum(r.acceptance[:n]) if n else 0.0) for r, n in zip(requests, drafted, strict=True))
    while True:
        best, best_rate, best_extra = -1, 0.0, 0.0
        for i, request in enumerate(requests):
            cap = caps[i]
            if cap is None or cap >= len(request.acceptance):
                continue
            extra = costs.t_key * (request.context + cap + 1) + costs.t_draft  # its keys, its drafting
            rate = request.acceptance[cap] / max(extra, 1e-12)
            if rate > best_rate:
                best, best_rate, best_extra = i, rate, extra
        if best < 0 or best_rate < min_gain * tokens / seconds:
            return caps
        caps[best] += 1
        seconds += best_extra
        tokens += requests[best].acceptance[caps[best] - 1]


class StepOverhead:
    """What a decode step costs each of its requests besides its forwards (an EMA of seconds):
    the time since the previous decode step ended, less the prefill in between and the forwards.
    That is drafting, verifying and admitting, and the threads that stream the replies, which
    share the cores and the interpreter with the model. An idle gap is no step's cost."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._last_end: float | None = None

    def idle(self) -> None:
        self._last_end = None

    def observe(self, start: float, end: float, forward_s: float, prefill_s: float, requests: int) -> None:
        """A decode step of `requests` requests ran from `start` to `end` (clock seconds), its
        forwards forward_s of it, after prefill_s of prefill since the previous one ended."""
        cycle = end - start if self._last_end is None else end - self._last_end - prefill_s
        spent = max(0.0, cycle - forward_s) / max(1, requests)
        self.seconds = 0.8 * self.seconds + 0.2 * spent if self.seconds else spent
        self._last_end = end
