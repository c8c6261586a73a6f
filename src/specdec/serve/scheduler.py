"""Continuous batching for the server: a bounded request queue and one model worker thread.

Every scheduler step:
1. admits waiting requests while fewer than `max_batch` are active: a cache slot, a drafter,
   `sequence.Sequence.start`;
2. drops cancelled and timed-out requests, returning their cache slot;
3. prefills new prompts a few chunks at a time (`LoadPolicy.prefill_tokens` a step, all
   prefilling requests together), so a long prompt does not freeze the running streams;
4. lets every prefilled request draft (`sequence.Sequence.plan`), with k capped by the load policy
   and, while several requests share a batched forward, by what their rows earn there
   (`batch_costs.draft_caps`: chains only);
5. scores all drafts in one `backends.forward_batch` (a true batched forward when the
   backend has a pool, one forward per sequence otherwise);
6. verifies, rolls back and emits per request (`sequence.Sequence.advance`).
Requests join between steps and finish independently. Each request has its own drafter,
controller, generator and k, so the step logic is exactly Engine's. An exception in one
request's part of a step (drafting, prefill, scoring, verifying, finishing) fails that
request alone; a batched forward that fails is retried one sequence at a time.

The worker talks to the outside only through `GenRequest.emit(kind, payload)`, called from
the worker thread with kind "started" (prefilled), "delta" (text, streamed requests only),
"logprobs" (the new tokens' logprobs, before their delta, streamed requests that ask only),
"done" (a GenerationResult) or "error" (an exception).
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specdec.backends import Backend, KVMemory, forward_batch
from specdec.batch_costs import BatchRequest, StepOverhead, draft_caps
from specdec.config import EngineConfig, split_k
from specdec.controller import ScoreCosts
from specdec.drafters import Drafter
from specdec.errors import SpecdecError
from specdec.request import Prepared
from specdec.sequence import GenerationResult, Runtime, Sequence
from specdec.serve.slots import BackendSlots, DrafterPool, LoadPolicy

__all__ = ["GenRequest", "LoadPolicy", "QueueFull", "RequestTimeout", "Scheduler", "ServerShutdown"]

log = logging.getLogger("specdec.scheduler")
# Drafts a request makes in shared forwards whatever they cost, to learn its acceptance from
LEARNING_DRAFTS = 3
_ids = itertools.count()


class QueueFull(Exception):
    """The waiting queue is full; try again after `retry_after` seconds."""

    def __init__(self, retry_after: int):
        super().__init__(f"the request queue is full; retry after {retry_after}s")
        self.retry_after = retry_after


class RequestTimeout(Exception):
    pass


class ServerShutdown(Exception):
    pass


@dataclass
class GenRequest:
    """A prepared request (request.Prepared) and how the server runs it."""

    job: Prepared
    emit: Callable[[str, object], None]  # called from the worker thread
    drafter: str | None = None  # drafter spec text; None means the server's default
    k: str | int | None = None  # None means the drafter spec's or the server's k
    stream: bool = False  # emit text deltas
    timeout_s: float | None = None
    # whose prefix caches and suffix trie this request may use and feed (API key + cache_salt)
    tenant: str = ""
    id: int = field(default_factory=lambda: next(_ids))
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    cancelled: bool = False  # set from any thread; the worker drops the request at its next step
    # how the request ended is counted once: as a success by the worker, or as an abort by its
    # handler, whichever claims it first (a request can finish as its client leaves)
    _ended: bool = field(default=False, repr=False)
    _end_lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True

    def claim_end(self) -> bool:
        """True for the first caller only: that caller counts how the request ended."""
        with self._end_lock:
            first, self._ended = not self._ended, True
            return first

    def expired(self, now: float) -> bool:
        return self.timeout_s is not None and now - self.submitted_at > self.timeout_s


@dataclass
class _Active:
    req: GenRequest
    seq: Sequence
    backend: Backend
    drafter: Drafter
    spec: str
    logprobs_sent: int = 0  # entries of seq.token_logprobs already emitted


class Scheduler:
    """Owns the target's KV caches and runs every request through one worker thread."""

    def __init__(
        self,
        target,
        engine: EngineConfig | None = None,  # drafter, k, backend (+ options), prefix cache, draft device
        max_batch: int = 16,
        max_queue: int = 64,
        policy: LoadPolicy | None = None,  # speculation and prefill per step
        metrics=None,
        cache_slots: int | None = None,  # KV caches kept, in use and idle (default max_batch)
    ):
        if max_batch < 1 or max_queue < 0:
            raise SpecdecError(f"need max_batch >= 1 and max_queue >= 0, got {max_batch}, {max_queue}",
                               "max_batch")
        if cache_slots is not None and cache_slots < max_batch:
            raise SpecdecError(f"cache_slots must be at least max_batch ({max_batch}), got {cache_slots}",
                               "cache_slots")
        self.engine = engine = engine or EngineConfig()
        self.target, self.tokenizer = target, target.tokenizer
        self.eos_token_ids = target.eos_token_ids
        self.default_drafter, self.default_k = engine.drafter, engine.k
        self.slots = BackendSlots(engine.backend, target, engine.backend_options, engine.prefix_cache,
                                  max_slots=cache_slots or max_batch)
        self.max_length = self.slots.max_length
        # What scoring n tokens costs, timed once now and then learned from steps that scored
        # one sequence alone; shared by every request's adaptive controller, as in Engine.
        self.costs = ScoreCosts()
        self.runtime = Runtime(self.tokenizer, self.eos_token_ids, engine, self.costs)
        backend_for_timing = self.slots.acquire()
        try:
            self.costs.calibrate(backend_for_timing)
        finally:
            self.slots.release(backend_for_timing, keep_cache=False)
        self.drafters = DrafterPool(target, engine.draft_device)
        drafter = self.drafters.acquire(self.default_drafter)  # fail early
        try:
            self.costs.calibrate_drafter(drafter)
        finally:
            self.drafters.release(self.default_drafter, drafter)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.policy = policy or LoadPolicy()
        self.metrics = metrics
        self.batched = self.slots.pool is not None
        memory = self.kv_memory()
        self._kv_token_bytes = memory.bytes_per_token if memory is not None else 0
        self.overhead = StepOverhead()  # what a decode step costs a request besides its forwards
        self._first_acceptance: dict[str, float] = {}  # drafter spec -> its last request's first-token rate
        self._pending: deque[GenRequest] = deque()
        self._cond = threading.Condition()
        self._active: list[_Active] = []
        self._num_active = 0  # admitted and not yet released; read by submit() under _cond
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._latency_ema = 1.0
        self.num_steps = 0
        self.max_batch_seen = 0

    # ---- called from any thread ----------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._pending)

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def kv_memory(self) -> KVMemory | None:
        """The shared KV cache's size, where the backend has a pool (None otherwise)."""
        return self.slots.pool.kv_memory() if self.slots.pool is not None else None

    def retry_after(self) -> int:
        """Seconds until a slot is likely free, from recent request latencies."""
        waves = (len(self._pending) + 1) / self.max_batch
        return max(1, min(60, math.ceil(self._latency_ema * waves)))

    def submit(self, req: GenRequest) -> None:
        with self._cond:
            if self._stopping:
                raise ServerShutdown("the server is shutting down")
            if len(self._pending) + self._num_active >= self.max_batch + self.max_queue:
                raise QueueFull(self.retry_after())
            self._pending.append(req)
            self._cond.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run_forever, name="specdec-model", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the worker ----------------------------------------------------------------------

    def _run_forever(self) -> None:
        while not self._stopping:
            try:
                self.step(wait=0.05)
            except Exception as e:  # a bug in the step: fail what is running, keep serving
                log.exception("scheduler step failed")
                for a in list(self._active):
                    self._fail(a, e)
        for a in list(self._active):
            self._fail(a, ServerShutdown("the server is shutting down"))
        with self._cond:
            pending, self._pending = list(self._pending), deque()
        for req in pending:
            _emit(req, "error", ServerShutdown("the server is shutting down"))

    def step(self, wait: float = 0.0) -> bool:
        """One scheduling iteration; returns whether any request was stepped."""
        self._admit(wait)
        now = time.perf_counter()
        for a in list(self._active):
            if a.req.cancelled:
                self._release(a)
            elif a.req.expired(now):
                self._fail(a, RequestTimeout(f"the request timed out after {a.req.timeout_s:g}s"))
        if not self._active:
            self.overhead.idle()
            return False
        t0 = time.perf_counter()
        prefilled = self._prefill()
        prefill_s = time.perf_counter() - t0
        if prefilled and self.metrics is not None:
            self.metrics.observe_busy("prefill", prefill_s)
        decoding = [a for a in self._active if not a.seq.prefilling]
        if decoding:
            t0 = time.perf_counter()
            self._decode(decoding, prefill_s)
            if self.metrics is not None:
                self.metrics.observe_busy("decode", time.perf_counter() - t0)
        else:
            self.overhead.idle()
        return True

    def _prefill(self) -> bool:
        """Feed prompts, oldest request first, up to the step's prefill budget; whether any
        request was prefilling."""
        budget = self.policy.prefill_tokens
        prefilling = [a for a in self._active if a.seq.prefilling]
        for a in prefilling:
            if budget <= 0:
                break
            try:
                budget -= a.seq.prefill_step(budget)
            except Exception as e:
                self._fail(a, e)
                continue
            if not a.seq.prefilling:
                _emit(a.req, "started", None)
        return bool(prefilling)

    def _decode(self, decoding: list[_Active], prefill_s: float) -> None:
        """Draft, score, verify and emit for every prefilled request; learn what else a step costs."""
        start = time.perf_counter()
        forward_s = self._decode_step(decoding)
        if forward_s is not None and not self.costs.frozen:  # fixed costs: k depends on the tokens alone
            self.overhead.observe(start, time.perf_counter(), forward_s, prefill_s, len(decoding))

    def _decode_step(self, decoding: list[_Active]) -> float | None:
        # A token tree takes a forward of its own; with several requests on a pool, chains
        # share one batched forward, which costs far less than a forward per request.
        tree = not (self.batched and len(decoding) > 1)
        planned: list[tuple[_Active, list[int]]] = []
        for a, cap in zip(decoding, self._caps(decoding, shared=not tree), strict=True):
            try:
                tokens = a.seq.plan(cap, tree=tree)
            except Exception as e:
                self._fail(a, e)
                continue
            if tokens is None:
                self._complete(a)
            else:
                planned.append((a, tokens))
        if not planned:
            return None
        keys = sum(len(tokens) * a.backend.length for a, tokens in planned)  # cached keys the rows read
        logits, times, forward_s = self._score(planned)
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(planned))
        if self.metrics is not None:
            self.metrics.observe_batch(len(planned), sum(len(t) for _, t in planned))
            self.metrics.observe_reads(keys * self._kv_token_bytes, keys * self.costs.t_key)
        for (a, _), row, score_s in zip(planned, logits, times, strict=True):
            try:
                if isinstance(row, Exception):
                    raise row
                delta = a.seq.advance(row, score_s, solo=len(planned) == 1)
            except Exception as e:
                self._fail(a, e)
                continue
            if a.req.first_token_at is None and a.seq.generated:
                a.req.first_token_at = time.perf_counter()
            _stream_step(a, delta)
            if self.metrics is not None:  # spec-decode counters and inter-token latency, per step
                self.metrics.observe_step(a.req.id, a.seq.stats, len(a.seq.generated))
            if a.seq.done:
                self._complete(a)
        return forward_s

    def _caps(self, decoding: list[_Active], shared: bool) -> list[int | None]:
        """Each request's cap on k: the load policy's, and in a shared forward what its rows
        earn beside the others' (batch_costs.draft_caps)."""
        cap = self.policy.k_cap(len(decoding))
        if not shared:
            return [cap] * len(decoding)
        requests = [BatchRequest(a.seq.acceptance(), a.backend.length,
                                 floor=int(a.seq.stats.num_drafts < LEARNING_DRAFTS)) for a in decoding]
        priced = draft_caps(requests, self.costs, overhead=self.overhead.seconds * len(requests))
        return [p if cap is None else cap if p is None else min(cap, p) for p in priced]

    def _score(self, planned: list[tuple[_Active, list[int]]]) -> tuple[list, list[float], float]:
        """logits [len(tokens_i), V] per sequence (or the exception its forward raised), the
        score time each one saw, and the time of the step's forwards together.

        Chains go through one `forward_batch` (a pool) or one forward each; a token tree
        (a drafter's tree, when the backend has tree attention) gets its own forward_tree.
        A batched forward that fails is retried one sequence at a time, so that one bad
        sequence fails alone.
        """
        n = len(planned)
        out: list = [None] * n
        times = [0.0] * n
        forward_s = 0.0  # the forwards' time, all of them
        chains = [i for i, (a, _) in enumerate(planned) if a.seq.tree_parents is None]
        if self.batched and len(chains) > 1:
            lengths = [planned[i][0].backend.length for i in chains]
            t0 = time.perf_counter()
            try:
                rows = forward_batch([planned[i][0].backend for i in chains], [planned[i][1] for i in chains],
                                     [planned[i][0].seq.unscored for i in chains])
            except Exception:
                log.warning("a batched forward failed; scoring its sequences one at a time", exc_info=True)
                for i, length in zip(chains, lengths, strict=True):
                    backend = planned[i][0].backend
                    try:
                        backend.rollback(min(length, backend.length))
                    except Exception as e:
                        out[i] = e
            else:
                forward_s = time.perf_counter() - t0
                for i, row in zip(chains, rows, strict=True):
                    out[i], times[i] = row, forward_s
                widths = [len(planned[i][1]) for i in chains]
                self.costs.observe_keys(sum(widths), sum(w * n for w, n in zip(widths, lengths, strict=True)),
                                        forward_s, sequences=len(chains))
        for i, (a, tokens) in enumerate(planned):
            if out[i] is not None:
                continue
            t0 = time.perf_counter()
            try:
                if a.seq.tree_parents is not None:
                    out[i] = a.backend.forward_tree(tokens, a.seq.tree_parents)  # [len(tokens), V]
                else:
                    out[i] = forward_batch([a.backend], [tokens], [a.seq.unscored])[0]
            except Exception as e:
                log.warning("the target forward of request %d failed", a.req.id, exc_info=True)
                out[i] = e
            times[i] = time.perf_counter() - t0
            forward_s += times[i]
        return out, times, forward_s

    def _admit(self, wait: float) -> None:
        with self._cond:
            if not self._active and not self._pending and wait > 0:
                self._cond.wait(wait)
            now = time.perf_counter()
            for req in [r for r in self._pending if r.cancelled or r.expired(now)]:
                self._pending.remove(req)
                if not req.cancelled:
                    _emit(req, "error",
                          RequestTimeout(f"the request timed out after {req.timeout_s:g}s in the queue"))
            taken = []
            while self._pending and len(self._active) + len(taken) < self.max_batch:
                taken.append(self._pending.popleft())
            self._num_active += len(taken)
        for req in taken:
            self._start(req)

    def _start(self, req: GenRequest) -> None:
        """Give the request a drafter and a cache slot and start its Sequence; with chunked
        prefill (`LoadPolicy.prefill_tokens`) the steps feed its prompt, else it is fed now."""
        drafter = backend = None
        spec = self.default_drafter
        chunked = self.policy.prefill_tokens > 0
        try:
            spec, spec_k = (self.default_drafter, None) if req.drafter is None else split_k(req.drafter)
            k = req.k if req.k is not None else spec_k if spec_k is not None else self.default_k
            drafter = self.drafters.acquire(spec)
            drafter.scope(req.tenant)  # what it learns across requests stays the tenant's
            backend = self.slots.acquire(req.job.prompt_ids, req.tenant)
            drafter.bind_target(backend)  # drafters that read the target's states follow this request's cache
            seq = Sequence(backend, drafter, req.job, k, self.runtime,
                           track_text=req.stream or bool(req.job.request.stop),
                           prior_alpha=self._first_acceptance.get(spec))
            t0 = time.perf_counter()
            seq.start(prefill=not chunked)
            if not chunked and self.metrics is not None:
                self.metrics.observe_busy("prefill", time.perf_counter() - t0)
        except Exception as e:
            if not isinstance(e, SpecdecError):
                log.error("request %d failed to start: %r", req.id, e)
            if backend is not None:
                self.slots.release(backend, keep_cache=False)
            if drafter is not None and isinstance(e, SpecdecError):
                self.drafters.release(spec, drafter)  # a drafter that raised is not trusted again
            self._forget()
            _emit(req, "error", e)
            return
        self._active.append(_Active(req, seq, backend, drafter, spec))
        if not seq.prefilling:
            _emit(req, "started", None)

    def _complete(self, a: _Active) -> None:
        try:
            final = a.seq.finish()
        except Exception as e:  # a drafter's end() or the text tracker: this request alone
            self._fail(a, e)
            return
        if final and a.req.stream:
            _emit(a.req, "delta", final)
        result: GenerationResult = a.seq.result
        curve = a.seq.acceptance()
        if curve is not None and a.seq.stats.num_drafts >= LEARNING_DRAFTS:
            self._first_acceptance[a.spec] = curve[0]  # the prior of the drafter's next request
        latency = time.perf_counter() - a.req.submitted_at
        self._latency_ema = 0.8 * self._latency_ema + 0.2 * latency
        if self.metrics is not None and a.req.claim_end():
            try:
                self.metrics.observe_request(a.req, result, latency)
            except Exception:
                log.exception("metrics for request %d failed", a.req.id)
        self._release(a)
        _emit(a.req, "done", result)

    def _fail(self, a: _Active, error: Exception) -> None:
        if not isinstance(error, SpecdecError | RequestTimeout | ServerShutdown):
            log.error("request %d failed: %r", a.req.id, error)
        self._release(a, reuse_drafter=False)
        _emit(a.req, "error", error)

    def _release(self, a: _Active, reuse_drafter: bool = True) -> None:
        """Return the request's cache slot (and its drafter) to the pools."""
        if a not in self._active:
            return
        self._active.remove(a)
        if self.metrics is not None:
            self.metrics.observe_spec(a.seq.stats, a.req.id)
        self.slots.release(a.backend, keep_cache=reuse_drafter)  # a failed request's cache is not trusted
        if reuse_drafter:
            self.drafters.release(a.spec, a.drafter)
        self._forget()

    def _forget(self) -> None:
        with self._cond:
            self._num_active -= 1


def _stream_step(a: _Active, delta: str) -> None:
    """A streamed request's news after a step: its new tokens' logprobs (when asked), then its text."""
    if not a.req.stream:
        return
    if a.req.job.request.logprobs is not None and len(a.seq.token_logprobs) > a.logprobs_sent:
        _emit(a.req, "logprobs", a.seq.token_logprobs[a.logprobs_sent :])
        a.logprobs_sent = len(a.seq.token_logprobs)
    if delta:
        _emit(a.req, "delta", delta)


def _emit(req: GenRequest, kind: str, payload) -> None:
    try:
        req.emit(kind, payload)
    except Exception:  # a closed event loop or a gone client must not stop the worker
        log.debug("dropping %s event for request %d", kind, req.id)
