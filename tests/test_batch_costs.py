"""Pricing drafted rows in a shared batched forward (batch_costs.py) and the price of a cached key
it rests on (ScoreCosts.observe_keys). Costs are fixed or fed by hand: nothing here is timed."""

from __future__ import annotations

import pytest

from specdec.batch_costs import BatchRequest, StepOverhead, draft_caps
from specdec.controller import FIXED_COSTS_ENV, KEY_SAMPLE_MIN, ScoreCosts

# The weights' pass: 1.0 for one row, then 0.1 a row (t(17) = 2.6); a cached key 1e-4 a row.
WEIGHTS = {1: 1.0, 17: 2.6}
PER_KEY = 1e-4


def fixed(per_key: float = PER_KEY) -> ScoreCosts:
    return ScoreCosts(fixed=WEIGHTS, fixed_key=per_key)


def geometric(alpha: float | None, k_max: int = 16) -> tuple[float, ...] | None:
    """A drafter accepted token by token at rate alpha: its first j tokens all kept w.p. alpha^j."""
    return None if alpha is None else tuple(alpha**j for j in range(1, k_max + 1))


CAP_CASES = [
    # (what it shows, requests as (alpha, context), the caps it must give)
    ("short contexts: cheap rows, so every request drafts", [(0.8, 100)] * 4, "all > 0"),
    ("long contexts: a row costs nearly a step's share, so nobody drafts", [(0.8, 20_000)] * 4, [0, 0, 0, 0]),
    ("a fixed k is left to the load policy", [(None, 100), (0.8, 100)], "first None"),
    ("the sure drafter gets more rows than the doubtful one", [(0.95, 2000), (0.3, 2000)], "first larger"),
    ("a drafter that is never accepted gets none", [(0.0, 100), (0.9, 100)], "first 0"),
]


@pytest.mark.parametrize("case", CAP_CASES, ids=[c[0] for c in CAP_CASES])
def test_draft_caps_grant_rows_only_where_they_pay_for_the_batch(case):
    _, requests, expect = case
    caps = draft_caps([BatchRequest(geometric(a), c) for a, c in requests], fixed())
    if expect == "all > 0":
        assert all(c > 0 for c in caps), caps
    elif expect == "first None":
        assert caps[0] is None and caps[1] > 0, caps
    elif expect == "first larger":
        assert caps[0] > caps[1], caps
    elif expect == "first 0":
        assert caps[0] == 0 and caps[1] > 0, caps
    else:
        assert caps == expect


def _rate(requests, caps, costs, overhead=0.0):
    """The batch's expected tokens per second with these caps, as draft_caps prices it: the
    forward of one row each, the step's other costs, and each drafted row's keys and drafting."""
    base = costs.batch_cost(len(requests), sum(r.context for r in requests), len(requests)) + overhead
    drafted = sum(costs.t_key * (r.context + j) + costs.t_draft
                  for r, c in zip(requests, caps, strict=True) for j in range(1, c + 1))
    tokens = sum(1 + sum(r.acceptance[:c]) for r, c in zip(requests, caps, strict=True))
    return tokens / (base + drafted)


RUNS = (0.9, 0.85, 0.85, 0.85, 0.85, 0.8, 0.8, 0.8)  # accepted in runs: deep tokens nearly as likely


@pytest.mark.parametrize("context", [50, 500, 2000, 8000])
@pytest.mark.parametrize("overhead", [0.0, 2.0])
def test_the_granted_rows_beat_one_more_or_one_fewer_at_every_request(context, overhead):
    costs = fixed()
    requests = [BatchRequest(geometric(0.9, 8), context), BatchRequest(geometric(0.5, 8), context),
                BatchRequest(RUNS, context)]
    caps = draft_caps(requests, costs, overhead=overhead, min_gain=1.0)
    best = _rate(requests, caps, costs, overhead)
    for i in range(len(caps)):
        for step in (-1, 1):
            other = list(caps)
            other[i] += step
            if 0 <= other[i] <= 8:
                assert _rate(requests, other, costs, overhead) <= best * (1 + 1e-9), (caps, other)


def test_a_drafter_accepted_in_runs_drafts_deeper_than_a_geometric_one_at_the_same_first_token():
    costs, context = fixed(), 3000
    runs, geo = draft_caps([BatchRequest(RUNS, context), BatchRequest(geometric(0.9, 8), context)], costs)
    assert runs > geo


def test_what_a_step_costs_besides_its_forward_makes_rows_cheaper_in_proportion():
    requests = [BatchRequest(geometric(0.8), 20_000)] * 4
    assert draft_caps(requests, fixed()) == [0, 0, 0, 0]
    assert all(c > 0 for c in draft_caps(requests, fixed(), overhead=4.0))


def test_caps_stop_at_the_curves_end():
    assert draft_caps([BatchRequest(geometric(1.0, 5), 0)] * 2, fixed(0.0)) == [5, 5]


def test_a_key_is_priced_from_long_forwards_only(monkeypatch):
    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)  # this cost model learns from the times fed to it
    costs = ScoreCosts()
    for n, seconds in WEIGHTS.items():  # the weights' pass, as steps at a short context time it
        costs.observe(n, seconds, context=0)
    rows, context = 4, 3000
    costs.observe_keys(rows, rows * context, costs.cost(rows) + rows * context * 2e-6)
    assert costs.t_key == pytest.approx(2e-6)
    costs.observe_keys(rows, rows * (KEY_SAMPLE_MIN - 1), 10.0)  # short contexts: the weights' noise
    assert costs.t_key == pytest.approx(2e-6)
    frozen = fixed(PER_KEY)
    frozen.observe_keys(rows, rows * context, 50.0)
    assert frozen.t_key == PER_KEY


def test_step_overhead_is_the_cycle_less_prefill_and_forwards_per_request():
    overhead = StepOverhead()
    overhead.observe(start=0.0, end=10.0, forward_s=8.0, prefill_s=0.0, requests=2)  # the first: its own
    assert overhead.seconds == pytest.approx(1.0)
    # the next step ends 30 s later: 15 s of prefill between, 12 s of forwards, so 3 s for 2 requests
    overhead.observe(start=25.0, end=40.0, forward_s=12.0, prefill_s=15.0, requests=2)
    assert overhead.seconds == pytest.approx(0.8 * 1.0 + 0.2 * 1.5)
    overhead.idle()  # an idle gap: the next cycle starts at its own step
    overhead.observe(start=100.0, end=101.0, forward_s=1.0, prefill_s=0.0, requests=1)
    assert overhead.seconds == pytest.approx(0.8 * 1.1 + 0.2 * 0.0)


def test_a_sequence_past_the_first_is_priced_from_short_batched_forwards(monkeypatch):
    monkeypatch.delenv(FIXED_COSTS_ENV, raising=False)
    costs = ScoreCosts()
    for n, seconds in WEIGHTS.items():
        costs.observe(n, seconds, context=0)
    costs.observe_keys(4, 4 * 100, costs.cost(4) + 3 * 0.5, sequences=4)  # short contexts: 0.5 s each
    assert costs.t_sequence == pytest.approx(0.5) and costs.t_key == 0.0
    costs.observe_keys(4, 4 * 3000, costs.cost(4) + 3 * 0.5 + 4 * 3000 * 2e-6, sequences=4)
    assert costs.t_key == pytest.approx(2e-6)
    # a drafted row adds its weights' share and its keys, not another sequence
    wider = costs.batch_cost(5, 5 * 3000, 4) - costs.batch_cost(4, 4 * 3000, 4)
    assert wider == pytest.approx(0.1 + 3000 * 2e-6)
