"""The adaptive k controller: grows with acceptance, shrinks without, bypasses when it cannot pay."""

from __future__ import annotations

import pytest

from specdec.controller import AdaptiveK, FixedK, ScoreCosts, expected_tokens, make_controller
from specdec.errors import SpecdecError


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
    costs = ScoreCosts()
    costs.calibrate(backend, sizes=(1, 2, 5), repeats=2)
    assert costs.calibrated and backend.length == 3
    assert all(costs.cost(n) > 0 for n in (1, 2, 5)) and set(costs._mean) == {1, 2, 5}
