"""A sample of the closing fuzz (specdec.bench.closing_fuzz; the full 500 cases run in
scripts/bench/measure/fuzz_closing.py): random schemas x budgets from a model that never wants to stop.
Every reply whose closing completion fits is valid against its schema and the same under
speculation as plain; every other budget is refused."""

from __future__ import annotations

from hypothesis import HealthCheck, given, seed, settings

from conftest import tiny_tokenizer
from specdec.bench.closing_fuzz import cases, run_case

SAMPLE = 30


def test_a_sample_of_fuzzed_schemas_and_budgets():
    tok = tiny_tokenizer()
    eos, prompt = {tok.eos_token_id}, tok.encode("The quick brown fox")
    outcomes = []

    @seed(27)
    @settings(max_examples=SAMPLE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def check(case):
        outcome = run_case(case, tok, eos, prompt)
        assert not outcome.problems, (outcome.problems, outcome.text[:300])
        outcomes.append(outcome)

    check()
    served = [o for o in outcomes if not o.refused]
    assert len(served) > SAMPLE // 2
    assert sum(o.closed_by_budget for o in served) > 0  # budgets closed replies
    # and cut drafts
    assert sum(o.accepted for o in served) > 0 and sum(o.replaced_drafts for o in served) > 0
