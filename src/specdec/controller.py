"""Choosing k, the number of tokens to draft each step.

`AdaptiveK` feeds the expected-speedup model of Leviathan et al. (2023) with numbers it
measures online:
- α, the per-token acceptance rate, from (accepted, rejected) counts with exponential decay;
- t(n), the cost of scoring n tokens in one target forward after c cached tokens, and the
  cost of drafting one token (`ScoreCosts`: timed per n at start-up, tracked online per n
  and per context-length bucket, since attention makes wide steps dearer on long contexts;
  an Engine shares one across its requests, since the hardware and the model do not
  change between them).
A k-token draft then yields (1 - α^(k+1)) / (1 - α) tokens per step at a cost of
t(k+1) + k * t_draft, against 1 token per t(1) for plain decoding. The controller picks the k with
the best rate, grows it by at most `grow` per step, and bypasses speculation (k = 0) when no k beats
plain decoding. While bypassed it probes again after a back-off that doubles each time the probe does not
pay, and the back-off outlives the request (it lives in the shared ScoreCosts): a bypassed drafter
is not even asked to propose, so it costs nothing between probes. The first step at a new context
bucket is a plain one, which times t(1) there. A chosen k is raised to fill the int4 kernel's 4-row
block when that is free.

A loss budget bounds what a drafter that never wins can cost, from a request's first step:
each speculative step is priced at the cost model's rates (the extra rows it scored and the
drafting, less one step for each accepted token), and a step whose worst case (nothing
accepted) would push the request's net loss past `waste_allowance` one-token steps plus
`waste_share` of the time it has run is cut to the k that fits, or made plain. Winning steps
build credit, so a drafter that pays is never held back. Until a drafting cost has been
measured, the first speculative step drafts one token: it prices the drafter.

A drafter that runs a model over the context must first read the tokens it has not seen: the
prompt, or everything since its last proposal after a bypass. That catch-up is priced too, per
token read (`ScoreCosts.t_read`). When reading all of it does not fit the budget (or its cost is
not known yet) and the drafter can draft from a window of recent tokens, a probe reads only
that window (`AdaptiveK.reading`): a drafter that never wins then costs a few short reads, not
a second pass over the whole sequence, while one that wins earns the credit for a full read.
Such a drafter is also timed at start-up with the target (`ScoreCosts.calibrate_drafter`), so
a draft model too slow to ever pay is priced out before its first proposal.

Fixed costs (`ScoreCosts(fixed={n: seconds})`, or `SPECDEC_SCORE_COSTS="1=1.0,8=2.2"` for every cost
model a process makes) freeze t(n): nothing is timed or learned, so k depends on the tokens alone,
never on how busy the machine is. The test suite runs that way."""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.backends import RollbackLM
from specdec.config import parse_k
from specdec.drafters import Drafter


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def next_k(self, context: int = 0) -> int:
        return self.k

    def tree_nodes(self, k: int) -> int:
        return k  # a tree scores as many tokens as the chain would

    def acceptance(self) -> tuple[float, ...] | None:
        return None  # a fixed k is not priced

    def reading(self, k: int, backlog: int, window: int | None) -> tuple[int, int]:
        return k, backlog  # a fixed k reads whatever the drafter has not seen

    def observe(self, num_drafted: int, num_accepted: int, num_scored: int, score_s: float,
                propose_s: float | None, context: int | None = None, read: int = 0) -> None:
        pass


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens per step for a k-token draft whose tokens are each accepted with prob α."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


CONTEXT_BUCKETS = (0, 512, 1024, 2048, 4096, 8192, 16384)  # bucket i: contexts from edge i to edge i + 1
ROW_BLOCK = 4  # rows the int4 CPU GEMM works in (BLOCK_M): a 5th scored token starts a new block


def context_bucket(context: int) -> int:
    return bisect.bisect_right(CONTEXT_BUCKETS, max(0, context)) - 1


FIXED_COSTS_ENV = "SPECDEC_SCORE_COSTS"
# Tokens a drafter reads before a proposal in steady speculation: what the last step emitted (at
# most k_max + 1), whose time is part of drafting. More is a catch-up (the prompt, a bypass).
CATCH_UP_LIMIT = 32
FIRST_READ = 8  # the fewest tokens a probe from a window reads: the first, while reading has no price
PROBE_READ = 32  # the context calibrate_drafter reads
KEY_SAMPLE_MIN = 512  # cached keys a row must read for its forward to price them (observe_keys)
SPIKE = 2.0  # a timing counts as at most SPIKE x the model's estimate (ScoreCosts.observe says why)


def parse_fixed_costs(text: str) -> dict[int, float]:
    """"1=1.0,4=1.4,8=2.2" -> {1: 1.0, 4: 1.4, 8: 2.2}: seconds (or any unit) to score n tokens."""
    try:
        table = {int(n): float(t) for n, t in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError:
        table = {}
    if not table or min(table) < 1 or min(table.values()) <= 0:
        raise ValueError(f"{FIXED_COSTS_ENV} must read like '1=1.0,8=2.2' (n >= 1, costs > 0), got {text!r}")
    return table


class ScoreCosts:
    """Seconds to score n tokens in one target forward, per n and per context-length bucket,
    plus seconds to draft one token.

    Kernels make t(n) a staircase rather than a line: PyTorch's int4 CPU GEMM works in
    blocks of 4 rows (a fifth token starts a new block; docs/performance-notes.md), and a
    compiled forward pads to shape buckets. Attention makes it grow with the context: n
    queries over c cached keys. So each (bucket, n) keeps its own time (`calibrate` times
    them at start-up at the backend's current length, `observe` tracks steps as an EMA), and
    an n not timed in a bucket is estimated from the reference bucket (the one timed at the
    most sizes, normally the calibration's) plus the extra this bucket measured, a line in n
    through the differences at the sizes it did measure. In the reference bucket, an n never
    timed falls back to the line t(n) = t1 * (1 + slope * (n - 1)) fitted by least squares;
    before anything is measured, t1 = 1 and slope = `prior_slope`.

    A batched forward of several sequences is priced as one pass of the weights over all its
    rows, a cost per sequence, and the cached keys each row reads (`batch_cost`): batching
    shares the weights, not the keys. Both prices are learned from the forwards (`observe_keys`).
    """

    CALIBRATION_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17)  # 17 = the default k_max + 1

    def __init__(self, prior_slope: float = 0.15, clock: Callable[[], float] = time.perf_counter,
                 fixed: dict[int, float] | None = None, fixed_read: float = 0.0, fixed_key: float = 0.0):
        self.prior_slope = prior_slope
        self.clock = clock  # what calibrate times forwards with
        self._tables: dict[int, dict[int, float]] = {}  # bucket -> n -> EMA of seconds
        self.t_draft = 0.0
        self.draft_known = fixed is not None  # t_draft measured at least once (fixed costs: it is 0)
        self.t_read = fixed_read  # seconds per token a drafter reads when it catches up (fixed: given)
        self.read_known = fixed is not None
        self.t_key = fixed_key  # seconds a scored row pays per cached key it reads (fixed: given)
        self.key_known = fixed is not None
        self.t_sequence = 0.0  # seconds each sequence past the first adds to a batched forward
        self._fit: tuple[float, float] | None = None  # the reference bucket's (t1, slope), refitted lazily
        self.calibrated = False
        if fixed is None and os.environ.get(FIXED_COSTS_ENV):
            fixed = parse_fixed_costs(os.environ[FIXED_COSTS_ENV])
        # Fixed costs: the bucket-0 table, never timed nor updated (other sizes on its line).
        self.frozen = fixed is not None
        if self.frozen:
            self._tables[0] = dict(fixed)
            self.calibrated = True
        # The bypass back-off earlier requests reached: a drafter that does not pay stays
        # bypassed from a new request's first steps instead of being probed every 4 steps.
        self.backoff = 4

    def sizes(self, context: int = 0) -> set[int]:
        """The n timed in the bucket of `context`."""
        return set(self._tables.get(context_bucket(context), {}))

    def calibrate(self, backend: RollbackLM, sizes: tuple[int, ...] = CALIBRATION_SIZES,
                  repeats: int = 3) -> None:
        """Time target forwards of each size on `backend` (median of `repeats`, interleaved so
        that a noisy moment does not hit one size only) and roll the cache back after each."""
        if self.frozen:
            return
        start = backend.length
        sizes = [n for n in sizes if start + n <= backend.max_length]
        times: dict[int, list[float]] = {n: [] for n in sizes}
        backend.forward([0])  # the first forward of a process pays for allocations
        backend.rollback(start)
        for _ in range(repeats):
            for n in sizes:
                t0 = self.clock()
                backend.forward([0] * n)
                times[n].append(self.clock() - t0)
                backend.rollback(start)
        table = self._tables.setdefault(context_bucket(start), {})
        for n, ts in times.items():
            table[n] = sorted(ts)[len(ts) // 2]
        self._fit, self.calibrated = None, True

    def calibrate_drafter(self, drafter: Drafter, repeats: int = 3) -> None:
        """Time a drafter whose reading is dear (one that counts its backlog: a draft model) on
        made-up contexts, so that its first proposal is priced like the target's rows: a read
        of PROBE_READ tokens drafting one, then a steady proposal of two (medians of
        `repeats`). Drafters that read cheaply are priced by their first proposals."""
        if self.frozen or drafter.backlog([1]) is None:
            return
        probes, steady = [], []
        for r in range(repeats):
            context = [1 + r] * PROBE_READ  # a new token each time: nothing cached is reused
            t0 = self.clock()
            drafted = drafter.propose(context, 1).tokens
            t1 = self.clock()
            drafter.propose(context + drafted[:1], 2)
            probes.append(t1 - t0)
            steady.append(self.clock() - t1)
        self.t_draft = sorted(steady)[repeats // 2] / 2
        self.t_read = max(0.0, sorted(probes)[repeats // 2] - self.t_draft) / PROBE_READ
        self.draft_known = self.read_known = True

    def observe(self, num_scored: int, score_s: float, context: int = 0) -> None:
        """One forward of num_scored tokens after `context` cached ones took score_s seconds. A width
        priced out is never timed again (too low an estimate corrects itself): a timing counts as at
        most SPIKE times the estimate, and a bucket's wider steps keep their ratio to its t(1), which
        plain steps keep timing, so times taken while the whole machine was slow come down."""
        if self.frozen or num_scored < 1 or score_s <= 0:
            return
        bucket = context_bucket(context)
        if self._tables.get(bucket):  # a bucket's first time stands: it has nothing to compare with
            score_s = min(score_s, SPIKE * self.cost(num_scored, context))
        table = self._tables.setdefault(bucket, {})
        old = table.get(num_scored)
        table[num_scored] = score_s if old is None else 0.8 * old + 0.2 * score_s
        if num_scored == 1 and old is not None:
            table.update({n: t * table[1] / old for n, t in table.items() if n > 1})
        self._fit = None
        self.observe_keys(num_scored, num_scored * context, score_s)

    def observe_keys(self, rows: int, keys: int, score_s: float, sequences: int = 1) -> None:
        """A forward of `rows` rows of `sequences` sequences that read `keys` cached keys in all
        (each row its sequence's context) took score_s. Over short contexts the weights' pass is
        most of it, and a batch of several sequences says what each sequence past the first adds
        to it (`t_sequence`: its own attention call, its cache writes; EMAs both). Over long ones,
        what is left beyond that, shared by the keys, is the price of a key (`t_key`)."""
        if self.frozen or rows < 1 or score_s <= 0:
            return
        beyond = score_s - self.cost(rows)
        if keys < KEY_SAMPLE_MIN * rows:
            if sequences > 1:
                sample = max(0.0, beyond) / (sequences - 1)
                self.t_sequence = 0.8 * self.t_sequence + 0.2 * sample if self.t_sequence else sample
            return
        per_key = max(0.0, beyond - self.t_sequence * (sequences - 1)) / keys
        self.t_key = 0.8 * self.t_key + 0.2 * per_key if self.key_known else per_key
        self.key_known = True

    def batch_cost(self, rows: int, keys: int, sequences: int = 1) -> float:
        """Seconds for one forward of `rows` rows of `sequences` sequences that read `keys` cached
        keys in all: the weights' pass for that many rows, what each sequence past the first
        adds, and each key at its price."""
        return self.cost(rows) + self.t_sequence * (sequences - 1) + self.t_key * keys

    def observe_draft(self, num_drafted: int, propose_s: float | None, read: int = 0) -> None:
        """A proposal of num_drafted tokens took propose_s seconds (None: not timed), after
        reading `read` context tokens in a catch-up (0: a steady proposal, whose few new tokens
        are part of drafting). A catch-up teaches the cost of reading: its time less the
        drafting, or, before drafting has a cost, its time shared by every token it handled."""
        if num_drafted <= 0 or propose_s is None or self.frozen:
            return
        if read <= 0:
            per_token = propose_s / num_drafted
            self.t_draft = 0.8 * self.t_draft + 0.2 * per_token if self.draft_known else per_token
            self.draft_known = True
            return
        drafting = num_drafted * self.t_draft if self.draft_known else 0.0
        per_read = max(0.0, propose_s - drafting) / (read if self.draft_known else read + num_drafted)
        self.t_read = 0.8 * self.t_read + 0.2 * per_read if self.read_known else per_read
        self.read_known = True

    def _reference(self) -> int:
        return max(self._tables, key=lambda b: (len(self._tables[b]), -b)) if self._tables else 0

    def fit(self) -> tuple[float, float]:
        """(t1, slope) of the line through the reference bucket's times."""
        if self._fit is None:
            points = sorted(self._tables.get(self._reference(), {}).items())
            if not points:
                self._fit = (1.0, self.prior_slope)
            elif len(points) == 1:
                n, t = points[0]
                self._fit = (t / (1.0 + self.prior_slope * (n - 1)), self.prior_slope)
            else:
                a, b = _line([n - 1 for n, _ in points], [t for _, t in points])
                if a <= 0:  # noise pushed the intercept below zero: keep the smallest n's time
                    a = points[0][1]
                self._fit = (a, max(0.0, b) / a)
        return self._fit

    def cost(self, n: int, context: int = 0) -> float:
        reference = self._reference()
        bucket = context_bucket(context)
        while bucket > reference and not self._tables.get(bucket):
            bucket -= 1  # nothing timed at this context yet: the nearest shorter one that was
        table = self._tables.get(bucket, {})
        if n in table:
            return table[n]
        if bucket == reference or not table:
            return self._reference_cost(n)
        extra = [(m - 1, t - self._reference_cost(m)) for m, t in table.items()]  # what this context adds
        if len(extra) == 1:
            return self._reference_cost(n) + extra[0][1]
        a, b = _line([x for x, _ in extra], [y for _, y in extra])
        return self._reference_cost(n) + a + max(0.0, b) * (n - 1)

    def _reference_cost(self, n: int) -> float:
        table = self._tables.get(self._reference(), {})
        if n in table:
            return table[n]
        t1, slope = self.fit()
        return t1 * (1.0 + slope * (n - 1))


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / spread if spread else 0.0
    return my - b * mx, b


@dataclass
class AdaptiveK:
    k_init: int = 4
    k_max: int = 16
    grow: int = 2
    decay: float = 0.95
    prior_alpha: float = 0.7
    prior_weight: float = 2.0
    min_gain: float = 1.02  # speculate only when it beats plain decoding by this factor
    max_backoff: int = 64
    waste_allowance: float = 0.5  # one-token steps a request may lose to drafts before any credit
    waste_share: float = 0.02  # and this share of the time the request has run
    costs: ScoreCosts | None = None  # shared across requests by an Engine; else private

    def __post_init__(self) -> None:
        self.k = self.k_init
        self._accepted = self.prior_alpha * self.prior_weight
        self._rejected = (1.0 - self.prior_alpha) * self.prior_weight
        self.costs = self.costs or ScoreCosts()
        self._bypass_left = 0
        self.bypassed = False
        self.drafted = 0  # tokens drafted in this request
        self.context = 0  # tokens in the target's cache at the step being planned
        self._timed: set[int] = set()  # context buckets where this request asked for a plain step
        self.loss = 0.0  # seconds this request's drafts cost beyond what their accepted tokens saved
        self._reached: list[float] = []  # [j]: drafts that had a token j (decayed counts)
        self._kept: list[float] = []  # [j]: drafts whose token j was accepted, so all before it too
        self.credit = 0.0  # seconds of loss the request may carry: the allowance plus a share of its time

    @property
    def alpha(self) -> float:
        return self._accepted / (self._accepted + self._rejected)

    def acceptance(self) -> tuple[float, ...]:
        """[j - 1]: the chance that a draft's first j tokens are all accepted, j = 1 .. k_max,
        for a scheduler pricing this request's rows beside others' (batch_costs.py). Measured
        per draft position (decayed counts), since drafters such as `suffix` are accepted in
        runs, far more often whole than α^j says; α^j weighs in as a prior of
        `prior_weight` drafts."""
        curve, alpha, w = [], self.alpha, self.prior_weight
        for j in range(1, self.k_max + 1):
            reached, kept = ((self._reached[j - 1], self._kept[j - 1]) if j <= len(self._reached)
                             else (0.0, 0.0))
            p = (kept + w * alpha**j) / (reached + w)
            curve.append(min(p, curve[-1]) if curve else p)
        return tuple(curve)

    @property
    def _backoff(self) -> int:  # shared through the cost model, so it outlives a request
        return self.costs.backoff

    @_backoff.setter
    def _backoff(self, steps: int) -> None:
        self.costs.backoff = steps

    def score_cost(self, n: int) -> float:
        return self.costs.cost(n, self.context)

    def rate(self, k: int) -> float:
        """Expected tokens per second with a k-token draft (k = 0 is plain decoding)."""
        if k == 0:
            return 1.0 / self.score_cost(1)
        return expected_tokens(self.alpha, k) / (self.score_cost(k + 1) + k * self.costs.t_draft)

    def best_k(self) -> int:
        return max(range(1, self.k_max + 1), key=self.rate)

    def fill_block(self, k: int, free: float = 1.02) -> int:
        """k raised so that the k + 1 scored rows fill the kernel's last row block, when the
        fuller step costs no more (within `free`) and does not lower the expected rate: on
        the int4 CPU staircase rows 5 to 8 cost what row 5 does."""
        fuller = min(self.k_max, -(-(k + 1) // ROW_BLOCK) * ROW_BLOCK - 1)
        if fuller <= k or self.score_cost(fuller + 1) > free * self.score_cost(k + 1):
            return k
        return fuller if self.rate(fuller) >= self.rate(k) else k

    def tree_nodes(self, k: int, slack: float = 1.05) -> int:
        """How many draft nodes a token tree may have when the controller priced a k-token
        chain: the most whose forward costs no more than the chain's (within `slack`). A
        tree spends what it gets on branches instead of depth; on a staircase t(n) it can
        fill the rest of the chain's step for free (k = 5 on the int4 CPU backend: 7)."""
        limit, n = self.score_cost(k + 1) * slack, k
        while n < self.k_max and self.score_cost(n + 2) <= limit:
            n += 1
        return n

    def next_k(self, context: int = 0) -> int:
        """k for a step whose target cache holds `context` tokens."""
        self.context = context
        bucket = context_bucket(context)
        if bucket > 0 and bucket not in self._timed and 1 not in self.costs.sizes(context):
            self._timed.add(bucket)
            return 0  # first step at this context length: a plain one times t(1) here
        if self._bypass_left > 0:
            self._bypass_left -= 1
            return 0
        if self.bypassed:  # probe: try speculation again
            self.bypassed = False
            self.k = self.affordable(max(1, min(self.k_init, self.best_k())))
            return self.k
        best = self.best_k()
        if self.rate(best) < self.min_gain * self.rate(0):
            self.bypassed = True
            self._bypass_left = self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff)
            return 0
        self._backoff = max(4, self._backoff // 2)
        self.k = self.affordable(self.fill_block(min(best, self.k + self.grow)))
        return self.k

    def worst_loss(self, k: int) -> float:
        """What a k-token draft loses if nothing is accepted: its extra rows and its drafting."""
        return self.score_cost(k + 1) - self.score_cost(1) + k * self.costs.t_draft

    def budget(self) -> float:
        """Seconds the request may still lose: the allowance and its credit, less its loss."""
        return self.waste_allowance * self.score_cost(1) + self.credit - self.loss

    def affordable(self, k: int, read: int = 0) -> int:
        """k cut to what the loss budget allows: the largest k whose worst case, after reading
        `read` tokens to catch up, keeps the request's net loss within its credit (0: plain)."""
        if not self.costs.draft_known:
            k = min(k, 1)  # the drafting cost is unknown: one token prices it
        budget = self.budget() - read * self.costs.t_read
        while k > 0 and self.worst_loss(k) > budget:
            k -= 1
        return k

    def reading(self, k: int, backlog: int, window: int | None) -> tuple[int, int]:
        """(k, tokens to read) for a proposal whose drafter has `backlog` context tokens to
        catch up on and can draft from its last `window` (None: it must read them all). The
        whole backlog when it fits the loss budget; else as many of the last tokens as fit, up
        to the window (FIRST_READ while reading has no price yet), with k cut to what fits."""
        if k == 0 or backlog <= CATCH_UP_LIMIT:
            return k, backlog
        known, t_read = self.costs.read_known, self.costs.t_read
        if known and self.affordable(k, backlog) == k:
            return k, backlog
        if window is None or window >= backlog:
            return (self.affordable(k, backlog) if known else min(k, 1)), backlog
        if not known:
            return min(k, 1), min(window, FIRST_READ)
        spare = self.budget() - self.worst_loss(1)
        read = min(window, int(spare / t_read)) if t_read > 0 else window
        return (self.affordable(k, read), read) if read >= FIRST_READ else (0, 0)

    def observe(self, num_drafted: int, num_accepted: int, num_scored: int, score_s: float,
                propose_s: float | None, context: int | None = None, read: int = 0) -> None:
        """num_scored tokens went through one target forward that took score_s seconds, after
        `context` cached tokens (default: the context next_k was given); the proposal took
        propose_s (None: not timed), after a catch-up on `read` context tokens (0: none)."""
        self.costs.observe(num_scored, score_s, self.context if context is None else context)
        self.costs.observe_draft(num_drafted, propose_s, read)
        self._account(num_drafted, num_accepted, num_scored, read)
        if num_drafted == 0:
            return
        self.drafted += num_drafted
        self._accepted = self.decay * self._accepted + num_accepted
        self._rejected = self.decay * self._rejected + (1 if num_accepted < num_drafted else 0)
        if len(self._reached) < num_drafted:
            grow = num_drafted - len(self._reached)
            self._reached, self._kept = self._reached + [0.0] * grow, self._kept + [0.0] * grow
        for j in range(len(self._reached)):  # drafts that had a token j, and those that kept it
            self._reached[j] = self.decay * self._reached[j] + (j < num_drafted)
            self._kept[j] = self.decay * self._kept[j] + (j < num_accepted)

    def _account(self, num_drafted: int, num_accepted: int, num_scored: int, read: int = 0) -> None:
        """Price the step at the cost model's rates: the drafted rows, their drafting and the
        catch-up read before it, less a one-token step for each accepted token; and earn
        credit for the tokens made."""
        t1 = self.score_cost(1)
        self.credit += self.waste_share * t1 * (1 + num_accepted)
        if num_drafted > 0:
            extra_rows = self.score_cost(num_scored) - self.score_cost(max(1, num_scored - num_drafted))
            self.loss += (extra_rows + num_drafted * self.costs.t_draft + read * self.costs.t_read
                          - num_accepted * t1)


def make_controller(k: str | int, costs: ScoreCosts | None = None,
                    prior_alpha: float | None = None) -> FixedK | AdaptiveK:
    """FixedK for an integer; AdaptiveK for "auto", starting from a shared cost model and
    the acceptance rate the drafter had on earlier requests, when given."""
    k = "auto" if k is None else parse_k(k)
    if k == "auto":
        alpha = 0.7 if prior_alpha is None else min(0.95, max(0.05, prior_alpha))
        return AdaptiveK(costs=costs, prior_alpha=alpha)
    return FixedK(k)
