"""The adaptive k controller: grows with acceptance, shrinks without, bypasses when it cannot pay."""

from __future__ import annotations

import pytest

from specdec.controller import (
    FIXED_COSTS_ENV,
    AdaptiveK,
    FixedK,
    ScoreCosts,
    context_bucket,
    expected_tokens,
    make_controller,
    parse_fixed_costs,
)
from specdec.errors import SpecdecError


@pytest.fixture(autouse=True)
def measured_costs(monkeypatch):
    """These tests feed the measuring cost model fake timings; conftest fixes costs for the
    rest of the suite through the environment."""
    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)


def drive(controller, accept_fraction, steps, t1=0.03, slope=0.15, t_draft=0.0):
    ks = []
    for _ in range(steps):
        k = controller.next_k()
        ks.append(k)
        accepted = int(k * accept_fraction) if accept_fraction < 1 else k
        controller.observe(k, accepted, k + 1, t1 * (1 + slope * k), t_draft * k)
    return ks


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_grows_while_drafts_are_accepted():
    ks = drive(AdaptiveK(), 1.0, 20)
    assert ks[0] <= 4 and ks[-1] == 16
    assert all(b - a <= 2 for a, b in zip(ks, ks[1:], strict=False))


def test_bypasses_when_nothing_is_accepted_and_probes_again():
    controller = AdaptiveK()
    ks = drive(controller, 0.0, 200)
    assert ks.count(0) > 150  # mostly plain decoding
    assert any(k > 0 for k in ks[50:])  # but it keeps probing



def run_request(controller, tokens: int, slope: float, draft_cost: float, accepted=lambda k: 0, t1=0.03):
    """One request on cost-model time: each step scores k + 1 rows at t1 * (1 + slope * k) and
    drafts k tokens at draft_cost * t1 each. Returns (seconds spent, the ks chosen)."""
    spent, made, ks = 0.0, 0, []
    while made < tokens:
        k = controller.next_k()
        score_s, propose_s = t1 * (1 + slope * k), k * draft_cost * t1
        n = min(accepted(k), k)
        controller.observe(k, n, k + 1, score_s, propose_s)
        spent, made = spent + score_s + propose_s, made + n + 1
        ks.append(k)
    return spent, ks


def calibrated(slope: float, t1=0.03) -> ScoreCosts:
    costs = ScoreCosts()
    for n in ScoreCosts.CALIBRATION_SIZES:
        costs.observe(n, t1 * (1 + slope * (n - 1)))
    return costs


@pytest.mark.parametrize(("slope", "draft_cost"),
                         [(0.15, 0.0), (0.5, 0.0), (0.15, 0.3), (0.05, 1.0), (0.3, 0.5)])
@pytest.mark.parametrize("tokens", [64, 128, 512])
def test_a_drafter_that_never_wins_costs_at_most_three_percent(slope, draft_cost, tokens):
    """From a cold controller (the prior says speculate), a drafter none of whose tokens is
    accepted costs at most 3% over plain decoding, on cheap and on dear drafts; and it was
    tried. Without the loss budget the dear drafts cost more than that."""
    spent, ks = run_request(AdaptiveK(costs=calibrated(slope)), tokens, slope, draft_cost)
    assert any(ks) and spent <= 1.03 * tokens * 0.03, (spent / (tokens * 0.03), ks)
    unguarded, _ = run_request(AdaptiveK(costs=calibrated(slope), waste_allowance=1e9, waste_share=1.0),
                               tokens, slope, draft_cost)
    if draft_cost >= 0.5 and tokens <= 128:
        assert unguarded > 1.03 * tokens * 0.03


@pytest.mark.parametrize(("slope", "draft_cost"), [(0.15, 0.0), (0.15, 0.1), (0.3, 0.05)])
def test_the_loss_budget_does_not_hold_back_a_drafter_that_wins(slope, draft_cost):
    """Accepted drafts build credit: a drafter that is mostly right speculates from the first
    step, its k grows as without the budget, and the request takes the same time."""
    def request(**budget):
        return run_request(AdaptiveK(costs=calibrated(slope), **budget), 256, slope, draft_cost,
                           accepted=lambda k: k - k // 10)

    spent, ks = request()
    assert (spent, ks) == request(waste_allowance=1e9, waste_share=1.0)
    assert ks[0] == 1 and max(ks) >= 8 and 0 not in ks and spent < 0.5 * 256 * 0.03


def test_expensive_drafts_turn_speculation_off():
    # A draft token that costs as much as a target step cannot pay at 60% acceptance.
    ks = drive(AdaptiveK(), 0.6, 100, t_draft=0.03)
    assert ks[-20:].count(0) >= 15


def test_make_controller():
    assert isinstance(make_controller("auto"), AdaptiveK)
    assert make_controller("3").next_k() == 3
    assert isinstance(make_controller(0), FixedK)
    for bad in ("-1", "x", "2.5"):
        with pytest.raises(SpecdecError):
            make_controller(bad)


@pytest.mark.parametrize(("t1", "slope"), [(0.03, 0.15), (0.025, 0.27), (0.05, 0.0)])
def test_score_costs_recover_the_line_from_measured_steps(t1, slope):
    costs = ScoreCosts()
    assert costs.cost(5) == pytest.approx(1.0 + 4 * costs.prior_slope)  # relative, before any step
    costs.observe(5, t1 * (1 + 4 * slope))
    assert costs.cost(5) == pytest.approx(t1 * (1 + 4 * slope))  # one point: the prior slope through it
    for n in (1, 3, 9):
        costs.observe(n, t1 * (1 + slope * (n - 1)))
    assert costs.fit() == pytest.approx((t1, slope))
    assert costs.cost(17) == pytest.approx(t1 * (1 + 16 * slope))


def test_a_shared_cost_model_and_alpha_prior_carry_over_between_requests():
    """A second request on the same engine starts from what the first measured: with costly
    verification (slope 0.5) and low acceptance it bypasses from its first step."""
    costs = ScoreCosts()
    first = AdaptiveK(costs=costs)
    drive(first, 0.2, 60, slope=0.5)
    second = make_controller("auto", costs, prior_alpha=first.alpha)
    assert second.costs is costs and second.next_k() == 0
    fresh = make_controller("auto")  # no history: the prior says speculate
    assert fresh.next_k() > 0


def test_staircase_costs_pick_the_cheap_block():
    """int4 GEMMs work in blocks of 4 rows: scoring 4 tokens costs 1.3x one, 5 tokens 2.4x.
    A line through those points would hide the step; the per-n table stops at k = 3."""
    costs = ScoreCosts()
    for n, t in {1: 1.0, 2: 1.1, 3: 1.2, 4: 1.3, 5: 2.4, 6: 2.4, 7: 2.4, 8: 2.5, 9: 2.6}.items():
        costs.observe(n, t)
    controller = AdaptiveK(costs=costs, prior_alpha=0.6, prior_weight=1e9)  # α pinned at 0.6
    assert controller.best_k() == 3
    assert costs.cost(12) > costs.cost(9)  # beyond the table: the fitted line


STAIRCASE = {1: 1.0, 2: 1.07, 3: 1.28, 4: 1.39, 5: 2.2, 6: 2.2, 7: 2.2, 8: 2.2, 9: 4.0}


@pytest.mark.parametrize(
    "costs, k, nodes",
    [
        (STAIRCASE, 1, 1),  # 3 tokens cost more than the 2 the chain pays for
        (STAIRCASE, 3, 3),  # the 4-row block is full
        (STAIRCASE, 4, 7),  # 5 tokens pay for the second block: 8 tokens cost the same
        (STAIRCASE, 7, 7),
        ({n: 1.0 for n in range(1, 18)}, 2, 16),  # flat costs (a GPU): branches are free up to k_max
        ({}, 5, 5),  # nothing measured: the prior line, every token costs
    ],
)
def test_tree_nodes_fill_what_the_chain_costs(costs, k, nodes):
    model = ScoreCosts()
    for n, t in costs.items():
        model.observe(n, t)
    assert AdaptiveK(costs=model).tree_nodes(k) == nodes
    assert FixedK(k).tree_nodes(k) == k


@pytest.mark.parametrize("kind", ["hf", "native"])
def test_calibrate_times_every_size_and_leaves_the_cache_as_it_was(kind):
    from conftest import tiny_llama
    from specdec.backends import make_backend

    backend = make_backend(kind, tiny_llama())
    backend.prefill([1, 2, 3])
    clock = FakeClock(backend)
    costs = ScoreCosts(clock=clock)
    costs.calibrate(backend, sizes=(1, 2, 5), repeats=2)
    assert costs.calibrated and backend.length == 3
    assert {n: costs.cost(n) for n in (1, 2, 5)} == {n: pytest.approx(clock.seconds(n)) for n in (1, 2, 5)}
    assert costs.sizes(3) == {1, 2, 5}


class FakeClock:
    """A clock that a backend's forward of n tokens advances by a fixed staircase, whatever
    the machine does meanwhile."""

    def __init__(self, backend):
        self.now = 0.0
        forward = backend.forward

        def timed_forward(token_ids, *args, **kwargs):
            self.now += self.seconds(len(token_ids))
            return forward(token_ids, *args, **kwargs)

        backend.forward = timed_forward

    @staticmethod
    def seconds(n: int) -> float:
        return 0.01 * (1 + (n - 1) // 4)

    def __call__(self) -> float:
        return self.now


def test_fixed_costs_learn_nothing_from_measured_steps():
    fixed = {1: 1.0, 4: 1.3, 5: 2.2}
    costs = ScoreCosts(fixed=fixed)
    assert costs.calibrated and costs.frozen
    costs.calibrate(None)  # nothing to time: it never touches the backend
    costs.observe(1, 50.0)  # a busy machine's step
    costs.observe_draft(4, 9.0)
    assert {n: costs.cost(n) for n in fixed} == fixed and costs.t_draft == 0.0
    assert (drive(AdaptiveK(costs=costs), 1.0, 10, t1=5.0)
            == drive(AdaptiveK(costs=ScoreCosts(fixed=fixed)), 1.0, 10))


def test_fixed_costs_from_the_environment(monkeypatch):
    monkeypatch.setenv(FIXED_COSTS_ENV, "1=1.0,17=2.6")
    costs = ScoreCosts()
    assert costs.frozen and costs.cost(9) == pytest.approx(1.8)  # on the line through the two
    for bad in ("", "x", "0=1", "1=0", "1=1,2"):
        with pytest.raises(ValueError, match=FIXED_COSTS_ENV):
            parse_fixed_costs(bad)


# ---- costs that know the context ---------------------------------------------------------------


def long_context_time(n: int, context: int) -> float:
    """Fake seconds to score n tokens after `context` cached ones: a 4-row staircase plus
    attention that grows with n * context (at 3000 tokens, 8 rows cost twice what they do
    after an empty cache)."""
    return 0.02 * (1.0 + 0.4 * ((n - 1) // 4)) + ATTENTION_S * n * context


ATTENTION_S = 1.2e-6  # seconds per query per cached key, for the fake timings


def test_costs_are_kept_per_context_bucket():
    costs = ScoreCosts()
    for n in range(1, 10):
        costs.observe(n, long_context_time(n, 0), context=0)  # the reference: what calibrate times
    costs.observe(1, long_context_time(1, 3000), context=3000)
    costs.observe(5, long_context_time(5, 3000), context=3000)
    assert context_bucket(3000) == context_bucket(2500) != context_bucket(0)
    assert costs.cost(5, 3000) == pytest.approx(long_context_time(5, 3000))  # timed there
    assert costs.cost(5, 0) == pytest.approx(long_context_time(5, 0))  # unchanged at short contexts
    # an n not timed at 3000: the reference's staircase plus the line through what 3000 adds
    assert costs.cost(3, 3000) == pytest.approx(long_context_time(3, 0) + ATTENTION_S * 3000 * 3, rel=1e-6)
    assert costs.cost(5, 5000) == costs.cost(5, 3000)  # nothing timed at 5000: the nearest shorter bucket
    assert costs.cost(5, 100) == costs.cost(5, 0)


@pytest.mark.parametrize(("context", "alpha", "speculates"),
                         [(100, 0.15, True), (3000, 0.15, False), (3000, 0.9, True)])
def test_the_bypass_holds_on_long_contexts(context, alpha, speculates):
    """Calibrated at an empty cache, the controller meets a long prompt: its first step there
    is plain (it times t(1) at that length), and from then on it speculates only where the
    wider step pays at that length. With α = 0.15 (ngram on summaries) a 2-token step pays
    after 100 tokens but not after 3000."""
    costs = ScoreCosts()
    for n in range(1, 18):
        costs.observe(n, long_context_time(n, 0))
    controller = AdaptiveK(costs=costs, prior_alpha=alpha, prior_weight=1e9)  # α pinned
    ks = []
    for step in range(60):
        k = controller.next_k(context + step)
        ks.append(k)
        controller.observe(k, int(alpha * k), k + 1, long_context_time(k + 1, context + step), 0.0)
    assert (ks[0] == 0) == (context >= CONTEXT_EDGE)
    assert (sum(k > 0 for k in ks[30:]) >= 25) == speculates, ks


CONTEXT_EDGE = 512


def test_a_bypassed_drafter_stays_bypassed_across_requests():
    """The back-off lives in the shared cost model: a second request on the same engine,
    whose drafter never paid, probes after 64 plain steps instead of 4."""
    costs = ScoreCosts()
    first = AdaptiveK(costs=costs)
    drive(first, 0.0, 300, slope=0.5)
    second = make_controller("auto", costs, prior_alpha=first.alpha)
    ks = [second.next_k() for _ in range(40)]
    assert ks == [0] * 40 and costs.backoff == second.max_backoff


@pytest.mark.parametrize(
    ("table", "k", "filled"),
    [
        # rows 5-8: one block
        ({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0, 9: 3.0}, 4, 7),
        ({1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0, 9: 3.0}, 3, 3),  # already full
        ({n: 1.0 + 0.5 * (n - 1) for n in range(1, 18)}, 4, 4),  # every row costs: no free fill
        ({n: 1.0 for n in range(1, 18)}, 14, 15),  # flat, but never past k_max + 1 rows
    ],
)
def test_verification_widths_fill_the_row_block_when_free(table, k, filled):
    costs = ScoreCosts()
    for n, t in table.items():
        costs.observe(n, t)
    controller = AdaptiveK(costs=costs, prior_alpha=0.8, prior_weight=1e9, k_max=15)
    assert controller.fill_block(k) == filled


class BusyClock:
    """Time as an engine on a busy machine reads it: every step slow, and each by another amount."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0 + self.now % 7
        return self.now


def test_with_fixed_costs_k_does_not_depend_on_the_machines_load(monkeypatch):
    """What failed on a busy machine: measured step times bypassed speculation. With fixed
    costs, an engine whose every timing is erratic chooses the same k, step for step."""
    import specdec.engine as engine_mod
    import specdec.sequence as sequence_mod
    from conftest import tiny_llama
    from specdec.engine import Engine

    monkeypatch.setenv(FIXED_COSTS_ENV, "1=1.0,17=2.6")
    target = tiny_llama()
    prompt = target.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)

    def stats():
        return Engine(target, drafter="ngram:min=1", k="auto").generate(prompt, max_new_tokens=24).stats

    idle = stats()
    clock = BusyClock()  # the forwards' times (engine) and the drafts' (sequence)
    monkeypatch.setattr(engine_mod, "time", clock)
    monkeypatch.setattr(sequence_mod, "time", clock)
    busy = stats()
    assert busy.k_history == idle.k_history and busy.num_draft_tokens == idle.num_draft_tokens > 0


def test_acceptance_is_measured_per_draft_position():
    """A drafter kept whole or not at all (suffix's runs): its fourth token is nearly as likely
    kept as its first, where α^j would say far less; a fixed k gives no curve."""
    controller = AdaptiveK(costs=ScoreCosts(fixed={1: 1.0}))
    for step in range(40):
        controller.observe(4, 4 if step % 2 else 0, 5, 0.0, None)
    curve = controller.acceptance()
    assert len(curve) == controller.k_max and list(curve) == sorted(curve, reverse=True)
    assert curve[0] == pytest.approx(0.5, abs=0.05) and curve[3] > 0.9 * curve[0]
    assert curve[3] / curve[0] > 1.5 * controller.alpha**3  # geometric: the fourth at α^3 of the first
    assert make_controller(3).acceptance() is None


def true_steps(n, steps, slower=1.0):
    """(width, seconds) samples after 3000 cached tokens: a one-token step then width n, `steps`
    times, each `slower` times its true cost."""
    return [(w, slower * long_context_time(w, 3000)) for _ in range(steps) for w in (1, n)]


@pytest.mark.parametrize(
    ("name", "samples", "n", "within"),
    [
        # one step of width 5 stalled 20x (a page fault, another process): it counts as 2x at most,
        # and the true times that follow bring it back
        ("a stall at one width", true_steps(5, 1) + [(5, 20 * long_context_time(5, 3000))]
         + true_steps(5, 10), 5, 0.15),
        # the long prompt's first steps timed while the whole machine ran 5x slow, then only plain
        # steps at the true cost: width 5, never timed again, comes down with them
        ("a slow machine", true_steps(5, 3, slower=5) + [(1, long_context_time(1, 3000))] * 30, 5, 0.15),
        # a real rise at one width (3x what the model expected) still gets through
        ("a real rise", true_steps(1, 1) + [(5, 3 * long_context_time(5, 3000))] * 12, 5, 0.15),
    ],
)
def test_a_timing_that_stood_out_does_not_price_a_width_out(name, samples, n, within):
    """What `SPIKE` and the ratios to t(1) are for: a width priced out is never chosen, so never
    timed again, and a time that stood out would have held it out for good."""
    costs = ScoreCosts()
    for w in range(1, 18):
        costs.observe(w, long_context_time(w, 0))
    for width, seconds in samples:
        costs.observe(width, seconds, context=3000)
    truth = (3 if name == "a real rise" else 1) * long_context_time(n, 3000)
    assert costs.cost(n, 3000) == pytest.approx(truth, rel=within), name
