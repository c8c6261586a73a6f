"""The scheduler under shared use (issue 16): bounded cache slots with LRU eviction, chunked
prefill interleaved with decode, one failing request failing alone, and tenants that never
see each other's prefix caches or suffix tries."""

from __future__ import annotations

import random

import pytest

import specdec.drafters.suffix as suffix_mod
import specdec.serve.slots as slots_mod
from conftest import tiny_llama
from specdec.backends import prefix_cache as prefix_cache_mod
from specdec.cli import build_parser
from specdec.config import EngineConfig
from specdec.drafters import REGISTRY, Draft, Drafter, make_drafter
from specdec.drafters.suffix import TenantStores
from specdec.engine import Engine
from specdec.request import Prepared
from specdec.sampling import SamplingParams
from specdec.serve.cli import serve_config
from specdec.serve.scheduler import GenRequest, LoadPolicy, Scheduler
from test_scheduler import PROMPTS, Recorder, run_until_idle


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def plain(target):
    return Engine(target, drafter="none", k=0)


def greedy(plain, ids: list[int], n: int) -> list[int]:
    return plain.generate(list(ids), max_new_tokens=n).token_ids


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 400) for _ in range(length)] for _ in range(count)]


# ---- fault 1: bounded cache slots ---------------------------------------------------------


def test_hf_slots_are_bounded_and_the_least_recently_used_is_evicted(target, plain, monkeypatch):
    """Twelve distinct prompts, two at a time, through at most three KV caches: no more
    backends are ever built, the most recent prompt's slot still serves its prefix, and the
    oldest prompt's was evicted."""
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", 4)
    built = []
    original = slots_mod.make_backend
    monkeypatch.setattr(slots_mod, "make_backend", lambda *a, **kw: built.append(1) or original(*a, **kw))
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1"), max_batch=2, cache_slots=3)
    prompts = random_prompts(12, 20)
    recs = [Recorder() for _ in prompts]
    for ids, rec in zip(prompts, recs, strict=True):
        sched.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 8), rec))
        sched.step()
        assert sched.slots.num_slots <= 3
    run_until_idle(sched)
    assert len(built) <= 3 and sched.slots.num_slots <= 3
    for ids, rec in list(zip(prompts, recs, strict=True))[::4]:
        assert rec.result.token_ids == greedy(plain, ids, 8)
    recent, oldest = Recorder(), Recorder()
    sched.submit(GenRequest(Prepared.tokens(list(prompts[-1]), SamplingParams(), 8), recent))
    sched.submit(GenRequest(Prepared.tokens(list(prompts[0]), SamplingParams(), 8), oldest))
    run_until_idle(sched)
    assert recent.result.stats.cached_prompt_tokens == 16 and oldest.result.stats.cached_prompt_tokens == 0
    assert oldest.result.token_ids == recs[0].result.token_ids
    with pytest.raises(Exception, match="cache_slots"):
        Scheduler(target, EngineConfig(), max_batch=4, cache_slots=2)


def test_serve_flags_bound_the_slots_and_the_prefill_per_step():
    args = build_parser().parse_args(["serve", "--target", "t", "--backend", "native", "--max-batch", "4",
                                      "--cache-slots", "6", "--max-prefill-tokens", "0"])
    config = serve_config(args)
    assert (config.cache_slots, config.max_prefill_tokens) == (6, 0)
    assert config.engine.backend_options == {"slots": 6}  # the native pool holds the idle slots too
    config = serve_config(build_parser().parse_args(["serve", "--target", "t", "--backend", "hf"]))
    assert (config.cache_slots, config.max_prefill_tokens) == (None, 256)


# ---- fault 3: chunked prefill ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(target, plain, monkeypatch, backend):
    """A long prompt arriving mid-stream is fed 8 tokens a step: the running request emits a
    token at every step of that prefill, and both outputs equal the target's greedy output
    served alone. With prefill_tokens=0 (prompts whole at admission) it is fed in one step."""
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", 4)
    options = {"slots": 2, "precision": "fp32"} if backend == "native" else {}
    short, long = target.tokenizer.encode(PROMPTS[1]), random_prompts(1, 150, seed=3)[0]
    for budget in (8, 0):
        sched = Scheduler(target, EngineConfig(drafter="none", backend=backend, backend_options=options),
                          max_batch=2, policy=LoadPolicy(prefill_tokens=budget))
        running, arriving = Recorder(sched), Recorder(sched)
        sched.submit(GenRequest(Prepared.tokens(list(short), SamplingParams(), 100), running))
        for _ in range(3):
            sched.step()
        stream = sched._active[0].seq
        sched.submit(GenRequest(Prepared.tokens(list(long), SamplingParams(), 10), arriving))
        sched.step()  # admits it and feeds the first chunks
        emitted = []  # tokens the running request got in each step of the prefill
        while "started" not in arriving.step_of:
            before = len(stream.generated)
            sched.step()
            emitted.append(len(stream.generated) - before)
        run_until_idle(sched)
        assert running.result.token_ids == greedy(plain, short, 100)
        assert arriving.result.token_ids == greedy(plain, long, 10)
        if budget:
            assert len(emitted) >= 149 // 8 - 1 and all(n == 1 for n in emitted)
        else:
            assert emitted == []  # whole at admission: started in the step that admitted it


# ---- fault 4: one failing request fails alone ---------------------------------------------


class FaultyDrafter(Drafter):
    """ngram, except on a request whose prompt starts with POISON: there `where` raises (or,
    for "score", drafts a token the target has no embedding for)."""

    POISON = 399

    def __init__(self, target, where: str):
        self.inner, self.where, self.poisoned = make_drafter("ngram:min=1", target), where, False

    def _maybe_raise(self, hook: str) -> None:
        if self.poisoned and self.where == hook:
            raise RuntimeError(f"faulty drafter: {hook}")

    def begin(self, prompt_ids, params, generator):
        self.poisoned = prompt_ids[0] == self.POISON
        self._maybe_raise("begin")
        self.inner.begin(prompt_ids, params, generator)

    def propose(self, context_ids, k):
        self._maybe_raise("propose")
        if self.poisoned and self.where == "score" and k > 0:
            return Draft([10**6])
        return self.inner.propose(context_ids, k)

    def on_verified(self, context_ids, num_accepted):
        self._maybe_raise("on_verified")
        self.inner.on_verified(context_ids, num_accepted)

    def end(self, context_ids):
        self._maybe_raise("end")
        self.inner.end(context_ids)


@pytest.mark.parametrize("backend", ["hf", "native"])
@pytest.mark.parametrize("where", ["begin", "propose", "score", "on_verified", "end"])
def test_one_failing_request_fails_alone(target, plain, monkeypatch, where, backend):
    monkeypatch.setitem(REGISTRY, "test-faulty", lambda spec, t: FaultyDrafter(t, where))
    options = {"slots": 4, "precision": "fp32"} if backend == "native" else {}
    sched = Scheduler(target,
                      EngineConfig(drafter="test-faulty", k=3, backend=backend, backend_options=options),
                      max_batch=4)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[:3]]
    poisoned = [FaultyDrafter.POISON, *prompts[0]]
    recs = [Recorder() for _ in range(4)]
    for ids, rec in zip([prompts[0], poisoned, prompts[1], prompts[2]], recs, strict=True):
        sched.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 24), rec))
    run_until_idle(sched)
    assert (isinstance(recs[1].error, RuntimeError | IndexError)
            and not any(k == "done" for k, _ in recs[1].events))
    for ids, rec in zip(prompts, [recs[0], recs[2], recs[3]], strict=True):
        assert rec.error is None and rec.result.token_ids == greedy(plain, ids, 24)
    stats = [r.result.stats for r in (recs[0], recs[2], recs[3])]
    assert sum(s.num_draft_tokens for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0
    assert sched.slots.in_use == 0 and sched.num_active == 0
    again = Recorder()  # the server goes on serving
    sched.submit(GenRequest(Prepared.tokens(list(prompts[0]), SamplingParams(), 24), again))
    run_until_idle(sched)
    assert again.result.token_ids == recs[0].result.token_ids


# ---- fault 5: tenants -----------------------------------------------------------------------


def tenant_run(target, turns: list[tuple[str, list[int]]]) -> list:
    """Serve `turns` (tenant, prompt) one after the other on a fresh scheduler; their stats."""
    sched = Scheduler(target, EngineConfig(drafter="suffix", k=4, prefix_cache="prompt"), max_batch=1)
    out = []
    for tenant, ids in turns:
        rec = Recorder()
        sched.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 40), rec, tenant=tenant))
        run_until_idle(sched)
        s = rec.result.stats
        out.append((s.cached_prompt_tokens, s.num_draft_tokens, s.num_accepted_tokens, rec.result.token_ids))
    return out


def test_a_tenant_sees_nothing_of_another_tenants_traffic(target, monkeypatch):
    """Tenant A's repeated prompt is cached and drafted from A's earlier answer; tenant B,
    sending the same prompt afterwards, gets exactly what B gets on a server A never used:
    no cached tokens, the same drafts and acceptance."""
    monkeypatch.setattr(prefix_cache_mod, "PREFILL_CHUNK", 4)
    ids = target.tokenizer.encode(PROMPTS[3])
    monkeypatch.setattr(suffix_mod, "_STORES", {})
    (alone,) = tenant_run(target, [("tenant-b", ids)])
    monkeypatch.setattr(suffix_mod, "_STORES", {})
    a1, a2, b = tenant_run(target, [("tenant-a", ids), ("tenant-a", ids), ("tenant-b", ids)])
    assert a1[0] == 0 and a2[0] > 0  # A's own prefix is cached for A
    assert a2[2] > a1[2]  # and A's own earlier answer is drafted from
    assert b == alone and b[0] == 0


def test_tenant_stores_are_bounded_together():
    """Past max_nodes in all, the least recently served tenants' tries are dropped whole."""
    stores = TenantStores(depth=4, max_nodes=60)
    for t in range(10):
        stores.get(f"t{t}").add(list(range(t * 20, t * 20 + 12)))
        assert sum(s.trie.num_nodes for s in stores._stores.values()) <= 2 * 60
    assert len(stores) <= 2 and "t9" in stores._stores and "t0" not in stores._stores
