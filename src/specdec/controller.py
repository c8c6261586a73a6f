"""Choosing k, the number of tokens to draft each step.

`AdaptiveK` feeds the expected-speedup model of Leviathan et al. (2023) with numbers it
measures online:
- α, the per-token acceptance rate, from (accepted, rejected) counts with exponential decay;
- the cost of scoring n tokens in one target forward, t(n) = t1 * (1 + slope * (n - 1));
- the cost of drafting one token.
A k-token draft then yields (1 - α^(k+1)) / (1 - α) tokens per step at a cost of
t(k+1) + k * t_draft, against 1 token per t(1) for plain decoding. The controller picks
the k with the best rate, grows it by at most `grow` per step, and bypasses speculation
(k = 0) when no k beats plain decoding. While bypassed it probes again after a back-off
that doubles each time the probe does not pay.
"""

from __future__ import annotations

from dataclasses import dataclass


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, num_drafted: int, num_accepted: int, num_scored: int, score_s: float, propose_s: float) -> None:
        pass


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per step for a k-token draft whose tokens are each accepted with prob α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class AdaptiveK:
    k_init: int = 4
    k_max: int = 16
    grow: int = 2
    decay: float = 0.95
    prior_alpha: float = 0.7
    prior_weight: float = 2.0
    prior_slope: float = 0.15  # scoring 8 tokens ≈ 2x one token on the reference CPU
    min_gain: float = 1.02  # speculate only when it beats plain decoding by this factor
    max_backoff: int = 64

    def __post_init__(self) -> None:
        self.k = self.k_init
        self._accepted = self.prior_alpha * self.prior_weight
        self._rejected = (1.0 - self.prior_alpha) * self.prior_weight
        self._t1: float | None = None  # seconds to score one token
        self._slope = self.prior_slope
        self._t_draft = 0.0  # seconds to draft one token
        self._bypass_left = 0
        self._backoff = 4
        self.bypassed = False

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def score_cost(self, n: int) -> float:
        return (self._t1 or 1.0) * (1.0 + self._slope * (n - 1))

    def rate(self, k: int) -> float:
        """Expected tokens per second with a k-token draft (k = 0 is plain decoding)."""
        if k == 0:
            return 1.0 / self.score_cost(1)
        return expected_tokens(self.alpha, k) / (self.score_cost(k + 1) + k * self._t_draft)

    def best_k(self) -> int:
        return max(range(1, self.k_max + 1), key=self.rate)

    def next_k(self) -> int:
        if self._bypass_left > 0:
            self._bypass_left -= 1
            return 0
        if self.bypassed:  # probe: try speculation again
            self.bypassed = False
            self.k = max(1, min(self.k_init, self.best_k()))
            return self.k
        best = self.best_k()
        if self.rate(best) < self.min_gain * self.rate(0):
            self.bypassed = True
            self._bypass_left = self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff)
            return 0
        self._backoff = max(4, self._backoff // 2)
        self.k = min(best, self.k + self.grow)
        return self.k

    def observe(self, num_drafted: int, num_accepted: int, num_scored: int, score_s: float, propose_s: float) -> None:
        """num_scored tokens went through one target forward that took score_s seconds."""
        if num_scored == 1:
            self._t1 = score_s if self._t1 is None else 0.8 * self._t1 + 0.2 * score_s
        elif num_scored > 1:
            if self._t1 is None:
                self._t1 = score_s / (1.0 + self._slope * (num_scored - 1))
            else:
                slope = max(0.0, (score_s / self._t1 - 1.0) / (num_scored - 1))
                self._slope = 0.8 * self._slope + 0.2 * slope
        if num_drafted == 0:
            return
        self._t_draft = 0.8 * self._t_draft + 0.2 * (propose_s / num_drafted)
        self._accepted = self.decay * self._accepted + num_accepted
        self._rejected = self.decay * self._rejected + (1 if num_accepted < num_drafted else 0)


def make_controller(k: str | int) -> FixedK | AdaptiveK:
    from .errors import SpecdecError

    if k in ("auto", None):
        return AdaptiveK()
    try:
        value = int(k)
    except (TypeError, ValueError):
        raise SpecdecError(f"k must be 'auto' or an integer >= 0, got {k!r}", "k") from None
    if value < 0:
        raise SpecdecError(f"k must be 'auto' or an integer >= 0, got {k!r}", "k")
    return FixedK(value)
