"""The adaptive k controller: grows with acceptance, shrinks without, bypasses when it cannot pay."""

from __future__ import annotations

import pytest

from specdec.controller import AdaptiveK, FixedK, expected_tokens, make_controller
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
