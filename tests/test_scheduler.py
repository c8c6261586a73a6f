"""Continuous batching: batched outputs equal Engine's, requests join and leave between
steps, cancelled requests free their cache slot, the queue is bounded, k shrinks under load."""

from __future__ import annotations

import threading

import pytest

import specdec.serve.slots as slots_mod
from conftest import tiny_llama
from specdec.backends import KVMemory
from specdec.backends import prefix_cache as backend_mod
from specdec.backends.hf import HFBackend
from specdec.config import EngineConfig
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.request import Prepared
from specdec.sampling import SamplingParams
from specdec.serve.scheduler import GenRequest, LoadPolicy, QueueFull, RequestTimeout, Scheduler

PROMPTS = [
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
    '{"name": "search", "arguments": {"query": "weather in Paris"}} {"name": "search", "arguments":',
    "| name | value |\n|------|-------|\n| a | 1 |\n| b | 2 |\n| c |",
    "Speculative decoding drafts tokens and verifies them. Speculative decoding drafts",
    "The lazy dog",
]


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


class Recorder:
    """Collects a request's events; `step_of` notes the scheduler step each event arrived at."""

    def __init__(self, scheduler: Scheduler | None = None):
        self.events: list[tuple[str, object]] = []
        self.scheduler = scheduler
        self.step_of: dict[str, int] = {}
        self.done = threading.Event()

    def __call__(self, kind: str, payload) -> None:
        self.events.append((kind, payload))
        if self.scheduler is not None:
            self.step_of.setdefault(kind, self.scheduler.num_steps)
        if kind in ("done", "error"):
            self.done.set()

    @property
    def result(self):
        return next(p for k, p in self.events if k == "done")

    @property
    def error(self):
        return next((p for k, p in self.events if k == "error"), None)


def make_request(target, prompt: str, emit, max_new: int = 24, **kw) -> GenRequest:
    ids = target.tokenizer.encode(prompt)
    params = kw.pop("params", SamplingParams())
    job = Prepared.tokens(ids, params, max_new,
                          **{n: kw.pop(n) for n in ("seed", "stop", "logprobs") if n in kw})
    return GenRequest(job, emit, **kw)


def run_until_idle(sched: Scheduler, limit: int = 2000) -> None:
    for _ in range(limit):
        if not sched.step() and not sched.queue_depth:
            return
    raise AssertionError("the scheduler did not drain")


def test_batched_greedy_equals_engine_with_continuous_batching(target):
    """Six requests with different drafters and k through a batch of 4: every output equals
    the target's plain greedy output, speculation actually happened, and the two requests
    that waited joined while the first ones were still decoding."""
    plain = Engine(target, drafter="none", k=0)
    expected = [plain.generate(target.tokenizer.encode(p), max_new_tokens=24).token_ids for p in PROMPTS]
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1"), max_batch=4, max_queue=8)
    settings = [{}, {"k": 3}, {"drafter": "none"}, {"drafter": "ngram:k=5"}, {"k": 1}, {"drafter": "ngram"}]
    recorders = [Recorder(sched) for _ in PROMPTS]
    for prompt, rec, extra in zip(PROMPTS, recorders, settings, strict=True):
        sched.submit(make_request(target, prompt, rec, **extra))
    assert sched.queue_depth == 6
    run_until_idle(sched)
    for rec, want in zip(recorders, expected, strict=True):
        assert rec.error is None
        assert rec.result.token_ids == want
    stats = [rec.result.stats for rec in recorders]
    assert sum(s.num_draft_tokens for s in stats) > 0 and sum(s.num_accepted_tokens for s in stats) > 0
    assert stats[2].num_draft_tokens == 0  # drafter "none" never drafts
    assert sched.max_batch_seen == 4
    late = [rec.step_of["started"] for rec in recorders[4:]]
    last_done = max(rec.step_of["done"] for rec in recorders[:4])
    assert all(0 < s < last_done for s in late)  # joined between steps, before the batch drained
    assert sched.slots.in_use == 0 and sched.num_active == 0


def test_seeded_sampling_in_a_batch_equals_engine(target):
    """Each request has its own generator: a seeded sample does not depend on its batch mates."""
    params = SamplingParams(temperature=0.9, top_k=50)
    ids = target.tokenizer.encode(PROMPTS[0])
    want = Engine(target, drafter="ngram:min=1", k=3).generate(ids, max_new_tokens=30, temperature=0.9,
                                                               top_k=50, seed=11)
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1", k=3), max_batch=4)
    recs = [Recorder() for _ in range(3)]
    sched.submit(make_request(target, PROMPTS[0], recs[0], 30, params=params, seed=11))
    sched.submit(make_request(target, PROMPTS[1], recs[1], 30, params=params, seed=5))
    sched.submit(make_request(target, PROMPTS[2], recs[2], 30))
    run_until_idle(sched)
    assert recs[0].result.token_ids == want.token_ids
    assert recs[0].result.stats.num_draft_tokens == want.stats.num_draft_tokens


class PooledHF(HFBackend):
    """An HF backend that says it belongs to a FakePool."""

    def __init__(self, model, pool):
        super().__init__(model)
        self._pool = pool

    @property
    def pool(self):
        return self._pool


class FakePool:
    """The SlotPool interface of a native backend, over HF backends; records each call."""

    def __init__(self, target):
        self.target = target
        self.batch_sizes: list[int] = []
        self.widths: list[list[int]] = []  # tokens each sequence scored, per call
        self.free_slots = 99

    def new_sequence(self):
        return PooledHF(self.target.model, self)

    def kv_memory(self) -> KVMemory:
        return KVMemory(slots=self.free_slots, window=2048, dtype="float32", bytes_per_token=1024,
                        limit_bytes=0, held_tokens=0, committed_bytes=0, lazy=False)

    def forward_batch(self, sequences, token_lists, unscored=None):
        self.batch_sizes.append(len(sequences))
        self.widths.append([len(t) for t in token_lists])
        return [s.forward(t) for s, t in zip(sequences, token_lists, strict=True)]


def test_pooled_backend_gets_one_forward_per_step_and_slots_back(target, monkeypatch):
    pool = FakePool(target)
    monkeypatch.setattr(slots_mod, "make_backend", lambda kind, t, **o: pool.new_sequence())
    sched = Scheduler(target, EngineConfig(backend="fake", drafter="ngram:min=1"), max_batch=3)
    assert sched.batched
    plain = Engine(target, drafter="none", k=0)
    recs = [Recorder() for _ in range(3)]
    for prompt, rec in zip(PROMPTS[:3], recs, strict=True):
        sched.submit(make_request(target, prompt, rec, 20))
    run_until_idle(sched)
    for prompt, rec in zip(PROMPTS[:3], recs, strict=True):
        assert (rec.result.token_ids
                == plain.generate(target.tokenizer.encode(prompt), max_new_tokens=20).token_ids)
    assert max(pool.batch_sizes) == 3  # all three verified in one forward
    assert len(pool.batch_sizes) == sched.num_steps
    assert sched.slots.in_use == 0  # the slots wait, caches kept, for prompts that share a prefix


def test_cancel_frees_the_slot_and_others_continue(target):
    sched = Scheduler(target, EngineConfig(), max_batch=4)
    gone, stay = Recorder(), Recorder()
    req = make_request(target, PROMPTS[1], gone, 200)
    sched.submit(req)
    sched.submit(make_request(target, PROMPTS[0], stay, 20))
    for _ in range(3):
        sched.step()
    assert sched.slots.in_use == 2
    req.cancel()
    sched.step()
    assert sched.slots.in_use == 1 and sched.num_active == 1
    run_until_idle(sched)
    assert not any(k == "done" for k, _ in gone.events)
    assert stay.result.finish_reason == "length" and len(stay.result.token_ids) == 20
    assert sched.slots.in_use == 0 and sched.num_active == 0
    # A request cancelled while it waits is never started.
    queued = Recorder()
    req = make_request(target, PROMPTS[2], queued, 20)
    sched.submit(req)
    req.cancel()
    run_until_idle(sched)
    assert queued.events == []


def test_bounded_queue_timeouts_and_bad_requests(target):
    sched = Scheduler(target, EngineConfig(), max_batch=1, max_queue=1)
    sched.submit(make_request(target, PROMPTS[0], Recorder(), 10))
    sched.submit(make_request(target, PROMPTS[1], Recorder(), 10))
    with pytest.raises(QueueFull) as info:
        sched.submit(make_request(target, PROMPTS[2], Recorder(), 10))
    assert info.value.retry_after >= 1
    run_until_idle(sched)

    sched = Scheduler(target, EngineConfig(), max_batch=2, max_queue=4)
    late = Recorder()
    sched.submit(make_request(target, PROMPTS[0], late, 10, timeout_s=0.0))
    bad, good = Recorder(), Recorder()
    sched.submit(make_request(target, PROMPTS[0], bad, 10, drafter="no-such-drafter"))
    sched.submit(make_request(target, PROMPTS[0], good, 10))
    run_until_idle(sched)
    assert isinstance(late.error, RequestTimeout)
    assert isinstance(bad.error, SpecdecError) and bad.error.param == "drafter"
    assert good.error is None and len(good.result.token_ids) == 10
    assert sched.slots.in_use == 0 and sched.num_active == 0


def test_load_policy_shrinks_k_and_turns_speculation_off():
    policy = LoadPolicy(max_batch_tokens=32, spec_off_above=0)
    assert [policy.k_cap(n) for n in (1, 4, 8, 16, 32)] == [31, 7, 3, 1, 0]
    assert LoadPolicy(max_batch_tokens=0, spec_off_above=2).k_cap(3) == 0
    assert LoadPolicy(max_batch_tokens=0).k_cap(100) is None


def test_speculation_off_under_load_but_on_when_alone(target):
    ids = target.tokenizer.encode(PROMPTS[1])
    busy = Scheduler(target, EngineConfig(drafter="ngram:min=1", k=4), max_batch=4,
                     policy=LoadPolicy(max_batch_tokens=4))
    recs = [Recorder() for _ in range(4)]
    for rec in recs:
        busy.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 20), rec))
    run_until_idle(busy)
    assert all(rec.result.stats.num_draft_tokens == 0 for rec in recs)  # cap 4 // 4 - 1 = 0
    alone = Recorder()
    busy.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 20), alone))
    run_until_idle(busy)
    assert alone.result.stats.num_draft_tokens > 0
    assert alone.result.token_ids == recs[0].result.token_ids


def test_worker_thread_serves_and_stops(target):
    sched = Scheduler(target, EngineConfig(), max_batch=2)
    sched.start()
    try:
        recs = [Recorder() for _ in range(3)]
        for prompt, rec in zip(PROMPTS, recs, strict=False):
            sched.submit(make_request(target, prompt, rec, 12, stream=True))
        for rec in recs:
            assert rec.done.wait(60)
            deltas = "".join(p for k, p in rec.events if k == "delta")
            assert deltas == rec.result.text and rec.events[0][0] == "started"
    finally:
        sched.stop()
    assert not sched._thread.is_alive()


def test_native_pool_is_batched_and_lossless(target):
    """With the native backend's cache pool, one packed forward scores every request."""
    native = pytest.importorskip("specdec.backends.native.model.native_model")
    if not hasattr(native, "make_native_backend"):
        pytest.skip("no native backend")
    plain = Engine(target, drafter="none", k=0)
    sched = Scheduler(
        target,
        EngineConfig(drafter="ngram:min=1", backend="native",
                     backend_options={"slots": 3, "precision": "fp32"}),
        max_batch=3,
    )
    assert sched.batched
    recs = [Recorder() for _ in PROMPTS[:4]]
    for prompt, rec, extra in zip(PROMPTS[:4], recs, [{}, {"k": 3}, {"drafter": "none"}, {}], strict=True):
        sched.submit(make_request(target, prompt, rec, 20, **extra))
    run_until_idle(sched)
    for prompt, rec in zip(PROMPTS[:4], recs, strict=True):
        assert (rec.result.token_ids
                == plain.generate(target.tokenizer.encode(prompt), max_new_tokens=20).token_ids)
    assert sched.max_batch_seen == 3 and sched.slots.in_use == 0 and sched.slots.pool.free_slots == 0


def serve_greedy(sched: Scheduler, prompts: list[list[int]], lengths, full: list[list[int]]) -> list:
    """Submit greedy requests, run the scheduler dry, and check each reply is the target's own
    continuation `full`; returns the recorders."""
    recs = [Recorder() for _ in prompts]
    for ids, rec, n in zip(prompts, recs, lengths, strict=True):
        sched.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), n), rec))
    run_until_idle(sched)
    for seq, rec in zip(full, recs, strict=True):
        assert rec.result.prompt_ids + rec.result.token_ids == seq
    return recs


def oracle_tree(full: list[list[int]]):
    """A drafter that knows the greedy continuations `full` and proposes a token tree: a wrong
    token, and beside it the right next two."""
    from specdec.drafters import Draft, Drafter

    class OracleTree(Drafter):
        def propose(self, context, k):
            seq = next((s for s in full if s[: len(context)] == context), None)
            nxt = seq[len(context) : len(context) + 2] if seq else []
            if len(nxt) < 2 or k < 2:
                return Draft([])
            return Draft([(nxt[0] + 1) % 400, nxt[0], nxt[1]], parents=[-1, -1, 1])

    return OracleTree()


def test_tree_drafts_are_scored_with_tree_attention(target, monkeypatch):
    """A drafter that proposes a token tree (a wrong branch and the right one) gets a
    forward_tree in the batch; the output stays the target's greedy output."""
    from specdec.drafters import REGISTRY

    plain = Engine(target, drafter="none", k=0)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    full = [ids + plain.generate(ids, max_new_tokens=20).token_ids for ids in prompts]

    monkeypatch.setitem(REGISTRY, "test-oracle-tree", lambda spec, t: oracle_tree(full))
    trees = []
    original = HFBackend.forward_tree
    monkeypatch.setattr(HFBackend, "forward_tree", lambda self, *a: trees.append(1) or original(self, *a))
    sched = Scheduler(target, EngineConfig(drafter="test-oracle-tree", k=4), max_batch=2)
    recs = [Recorder() for _ in prompts]
    for ids, rec in zip(prompts, recs, strict=True):
        sched.submit(GenRequest(Prepared.tokens(list(ids), SamplingParams(), 20), rec))
    run_until_idle(sched)
    for seq, rec in zip(full, recs, strict=True):
        assert rec.result.prompt_ids + rec.result.token_ids == seq
        assert rec.result.stats.num_accepted_tokens > 0
    assert trees


def test_tree_drafters_draft_chains_while_requests_share_a_batched_forward(target, monkeypatch):
    """On a pool, a tree would take a forward of its own: while two requests decode, their
    drafts are chains in one batched forward; alone, a request scores its tree again. The
    output stays the target's greedy output, with drafts accepted once trees return."""
    from specdec.drafters import REGISTRY

    plain = Engine(target, drafter="none", k=0)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    lengths = (8, 30)
    full = [ids + plain.generate(ids, max_new_tokens=n).token_ids
            for ids, n in zip(prompts, lengths, strict=True)]

    monkeypatch.setitem(REGISTRY, "test-oracle-tree", lambda spec, t: oracle_tree(full))
    pool = FakePool(target)
    monkeypatch.setattr(slots_mod, "make_backend", lambda kind, t, **o: pool.new_sequence())
    trees = []
    original = HFBackend.forward_tree
    monkeypatch.setattr(HFBackend, "forward_tree",
                        lambda self, *a: trees.append(len(pool.batch_sizes)) or original(self, *a))
    sched = Scheduler(target, EngineConfig(backend="fake", drafter="test-oracle-tree", k=4), max_batch=2)
    recs = serve_greedy(sched, prompts, lengths, full)
    assert recs[1].result.stats.num_accepted_tokens > 0
    together = pool.batch_sizes.count(2)
    assert together >= 2  # both requests' chains shared forwards
    assert trees and min(trees) >= together  # trees only once a request was alone


@pytest.mark.parametrize("per_key, drafts_together", [(0.0, True), (1.0, False)])
def test_requests_sharing_a_forward_draft_only_where_their_rows_pay(target, monkeypatch, per_key,
                                                                     drafts_together):
    """batch_costs prices each drafted row beside the others': with free keys two requests whose
    drafts are always right draft deep in their shared forwards; when a row's keys cost far more
    than the weights' pass, each drafts the one token a request may while it learns its
    acceptance, then they decode plain together, and the one left alone drafts again. The output
    is the target's either way."""
    from specdec.drafters import REGISTRY, Draft, Drafter

    plain = Engine(target, drafter="none", k=0)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS[:2]]
    lengths = (12, 40)
    full = [ids + plain.generate(ids, max_new_tokens=n).token_ids
            for ids, n in zip(prompts, lengths, strict=True)]

    class OracleChain(Drafter):  # the greedy continuation itself
        def propose(self, context, k):
            seq = next((s for s in full if s[: len(context)] == context), context)
            return Draft(seq[len(context) : len(context) + k])

    monkeypatch.setitem(REGISTRY, "test-oracle-chain", lambda spec, t: OracleChain())
    pool = FakePool(target)
    monkeypatch.setattr(slots_mod, "make_backend", lambda kind, t, **o: pool.new_sequence())
    sched = Scheduler(target, EngineConfig(backend="fake", drafter="test-oracle-chain"), max_batch=2)
    sched.costs.t_key = per_key  # the test suite's costs are fixed (conftest): a given key price
    sched.costs.draft_known = True  # drafting is free: k is not held to one token to price it
    recs = serve_greedy(sched, prompts, lengths, full)
    together = [w for w in pool.widths if len(w) == 2]
    assert len(together) >= 2
    assert any(max(w) > 2 for w in together) == drafts_together  # past a learning request's one token
    if not drafts_together:
        assert [2, 2] in together and together[-1] == [1, 1]
    alone = [w[0] for w in pool.widths if len(w) == 1]
    assert max(alone) > 2
    assert recs[1].result.stats.num_accepted_tokens > 0  # alone, it drafts


@pytest.mark.parametrize("mode", ["prompt", "decoded"])
def test_a_request_gets_the_slot_that_caches_its_prompt_prefix(target, monkeypatch, mode):
    """Agents resend their conversation: turn 2 lands on the slot that served turn 1 and
    prefills only the new tokens: with prompt caching, turn 1's prompt in whole chunks and
    the output of a cold start; with decoded caching, turn 1's answer too and the output of
    plain decoding through the same conversation."""
    monkeypatch.setattr(backend_mod, "PREFILL_CHUNK", 4)
    plain = Engine(target, drafter="none", k=0, prefix_cache=False if mode == "prompt" else "decoded")
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1", prefix_cache=mode), max_batch=2)
    first, other = target.tokenizer.encode(PROMPTS[0]), target.tokenizer.encode(PROMPTS[2])
    recs = [Recorder(), Recorder()]
    sched.submit(make_request(target, PROMPTS[0], recs[0], 12))
    sched.submit(make_request(target, PROMPTS[2], recs[1], 12))
    run_until_idle(sched)
    assert [r.result.stats.cached_prompt_tokens for r in recs] == [0, 0]
    turn2 = first + recs[0].result.token_ids + first[1:]  # the conversation so far plus a new message
    rec = Recorder()
    sched.submit(GenRequest(Prepared.tokens(turn2, SamplingParams(), 12), rec))
    run_until_idle(sched)
    if mode == "prompt":
        # turn 1's prefill, whole chunks
        assert rec.result.stats.cached_prompt_tokens == (len(first) - 1) // 4 * 4
    else:  # turn 1's prompt and answer, all but the answer's last token (never fed)
        assert rec.result.stats.cached_prompt_tokens == len(first) + len(recs[0].result.token_ids) - 1
        plain.generate(first, max_new_tokens=12)  # plain decoding through the same conversation
    assert rec.result.token_ids == plain.generate(turn2, max_new_tokens=12).token_ids
    assert len(other) > 1 and sched.slots.in_use == 0


def test_requests_share_a_calibrated_cost_model_fed_by_solo_steps_only(target, monkeypatch):
    """The scheduler times the target's forwards once at start; a step that scored a batch
    must not teach the shared cost model (its time is the batch's), a step scored alone does."""
    sched = Scheduler(target, EngineConfig(drafter="ngram:min=1"), max_batch=4)
    assert sched.costs.calibrated and sched.slots.in_use == 0
    seen: list[tuple[int, float]] = []
    monkeypatch.setattr(sched.costs, "observe", lambda n, s, context=0: seen.append((n, s)))
    recorders = [Recorder(sched) for _ in PROMPTS[:2]]
    for prompt, rec, max_new in zip(PROMPTS[:2], recorders, (6, 24), strict=True):
        sched.submit(make_request(target, prompt, rec, max_new=max_new))
    run_until_idle(sched)
    assert all(rec.error is None for rec in recorders)
    assert any(s == 0.0 for _, s in seen)  # batched steps: no cost sample (observe ignores 0)
    assert all(s > 0 for _, s in seen[-3:])  # the longer request finishes alone
    assert sched.max_batch_seen == 2


@pytest.mark.parametrize("max_slots", [3, 1])
def test_a_conversation_sharing_only_a_prefix_forks_it_and_both_stay_warm(max_slots):
    """Two agents share a system prompt: the second one's first turn finds its prefix in the
    first one's idle slot. With a free slot, the prefix is copied there and the first agent's
    next turn still finds its whole prompt; with none, the slot is taken (the first agent's
    cache past the shared prefix is lost)."""
    target = tiny_llama(seed=0, max_positions=512)
    slots = slots_mod.BackendSlots("native", target, {"slots": max_slots, "precision": "int8"}, "prompt",
                         max_slots=max_slots)
    shared = [5 + i % 200 for i in range(130)]  # one whole chunk of 128 is shared
    ours = shared + [5 + i * 7 % 390 for i in range(140)]  # 270 tokens: two whole chunks
    theirs = shared + list(range(260, 270))
    first = slots.acquire(ours)
    first.prefill(ours)
    slots.release(first)
    second = slots.acquire(theirs)
    assert second.prefix_cache.cached_prefix(theirs) == 128 and (second is first) == (max_slots == 1)
    second.prefill(theirs, keep=128)
    slots.release(second)
    again = slots.acquire(ours + [7, 8])
    kept = again.prefix_cache.cached_prefix(ours + [7, 8])
    assert again is first and kept == (128 if max_slots == 1 else 256)
