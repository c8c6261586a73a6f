"""One request's decoding state and its step: propose -> score -> verify -> roll back -> emit.

`Sequence` is shared by `Engine` (one request at a time) and the server's scheduler (many
sequences scored in one batched forward). The target's KV cache holds every token of the
sequence except the last one, the "pending" token. A step feeds [pending, d1..dk] in one
forward, which yields the k+1 distributions verification needs; afterwards the cache is
rolled back to keep only the pending token and the accepted drafts, and the recovered or
bonus token becomes pending.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.backends import Backend
from specdec.backends.prefix_cache import chunk_end
from specdec.config import EngineConfig
from specdec.controller import CATCH_UP_LIMIT, ScoreCosts, make_controller
from specdec.drafters import Draft, Drafter
from specdec.grammar import MAX_FORCED, ConstrainedDraft
from specdec.logprobs import TokenLogprob, token_logprobs
from specdec.request import Prepared
from specdec.sampling import PositionDraws, logits_to_probs
from specdec.stats import SpecStats
from specdec.text import TextTracker
from specdec.tree import fit_tree, keep_path, tree_depth, verify_tree
from specdec.verify import verify_greedy, verify_sampling


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length", or "tool_calls" (tools.py)
    stats: SpecStats
    prompt_ids: list[int] = field(default_factory=list)
    # With tools: the calls the reply made ({id, type, function: {name, arguments}}) and the
    # text around them (None when the reply only called); `text` stays the raw reply.
    tool_calls: list[dict] = field(default_factory=list)
    content: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when asked for (logprobs.py)
    # A structured reply the token budget closed: complete and valid, ended by the closing
    # completion rather than by the model (grammar.py, docs/structured-budget.md).
    closed_by_budget: bool = False

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "closed_by_budget": self.closed_by_budget,
            "stats": self.stats.summary(),
        }
        if self.tool_calls:
            out.update(content=self.content, tool_calls=self.tool_calls)
        return out


@dataclass(frozen=True)
class Runtime:
    """What a Sequence takes from whoever runs it (Engine, the server's scheduler)."""

    tokenizer: object
    eos_token_ids: set[int]
    # decode_params (verify_strategy), draft_forced
    config: EngineConfig = field(default_factory=EngineConfig)
    costs: ScoreCosts | None = None  # the target's scoring costs, shared by the adaptive controllers


class Sequence:
    """One request's decoding state and its step, shared by Engine and the server's scheduler.

    A step is split around the target forward so that a scheduler can score many sequences
    in one batched forward: `plan()` drafts and returns the tokens to score ([pending,
    d1..dk]), the caller runs the forward, and `advance(logits)` verifies, rolls back the
    cache and emits. `finish()` ends the request and sets `result`.
    """

    def __init__(
        self,
        backend: Backend,
        drafter: Drafter,
        job: Prepared,  # the request, its prompt ids, budget and grammar (request.py)
        k: str | int,
        runtime: Runtime,
        *,
        track_text: bool = True,  # follow the text as it grows (streaming, stop strings)
        prior_alpha: float | None = None,  # the adaptive controller's starting acceptance rate
    ):
        self.start_time = time.perf_counter()
        self.backend, self.drafter, self.request = backend, drafter, job.request
        prompt_ids, self.prompt_ids, self.max_new_tokens = job.prompt_ids, job.prompt_ids, job.max_new_tokens
        self.params = runtime.config.decode_params(job.request.sampling)
        # ignore_eos: no token ends the reply (request.Request)
        self.eos_token_ids = frozenset() if job.request.ignore_eos else runtime.eos_token_ids
        self.track_text = track_text
        self.stats = SpecStats(prompt_tokens=len(prompt_ids))
        seed = job.request.seed if job.request.seed is not None else int(torch.seed() % 2**63)
        self.generator = torch.Generator().manual_seed(seed)  # the drafter's own draws
        self.draws = PositionDraws(seed)  # verification's, keyed to the output position: k cannot change them
        self.controller = make_controller(k, runtime.costs, prior_alpha)
        self.tracker = TextTracker(runtime.tokenizer, list(job.request.stop or []) or None)
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.finish_reason = "length"
        self.done = False
        self.result: GenerationResult | None = None
        # (k, draft_tokens, draft_probs, cache_len, propose_s) between plan and advance
        self._step: tuple | None = None
        self._drafter_saw = 0  # the context length at the last proposal (drafters without a backlog)
        self._steady = True  # the planned proposal's time is a sample of drafting (or of reading)
        self._read = 0  # context tokens the planned proposal caught up on (0: a steady proposal)
        self.tree_parents: list[int] | None = None  # parents of the planned tokens when they form a tree
        self.grammar, self.draft_forced = job.grammar, runtime.config.draft_forced
        self._constrained: ConstrainedDraft | None = None  # the grammar's view of the planned draft
        self._allowed: torch.Tensor | None = None  # the planned rows' grammar masks [rows, V]
        self._budget = job.max_new_tokens  # tokens the reply may still emit, as of the planned step
        self.closed_by_budget = False  # the closing completion ended the reply (grammar.py)
        # Rows of the planned step whose logits nobody reads: the grammar allows one token there,
        # so the masked row is that token whatever the logits say (greedy, sampling, logprobs).
        # The forward may skip their LM head (Backend.forward's `unscored`).
        self.unscored: list[int] = []
        self.logprobs = job.request.logprobs
        self.token_logprobs: list[TokenLogprob] = []  # aligned with `generated`
        self.prefilling = False  # between start(prefill=False) and the prefill_step that ends the prompt
        self._prefilled = 0  # prompt tokens the cache holds so far

    def start(self, prefill: bool = True) -> None:
        """Begin the request: the drafter's set-up, then the prefill of every prompt token but
        the last, which becomes the pending token, keeping the part the backend's cache holds
        from an earlier prompt (its `PrefixCache`). With prefill=False the caller feeds the
        prompt in pieces with `prefill_step` until `prefilling` is False (chunked prefill)."""
        self.drafter.begin(self.prompt_ids, self.params, self.generator)
        self._prefilled = self.backend.prefix_cache.cached_prefix(self.prompt_ids[:-1])
        self.stats.cached_prompt_tokens = self._prefilled
        self.prefilling = True
        if prefill:
            self.prefill_step()

    def prefill_step(self, budget: int | None = None) -> int:
        """Feed the next prompt tokens, about `budget` of them (None: all the rest), paused
        on a chunk boundary (`chunk_end`), so the cache ends up with the bits of a whole
        prefill. Returns how many tokens were fed."""
        prefix = self.prompt_ids[:-1]
        done = self._prefilled
        end = chunk_end(done, len(prefix), budget)
        self.backend.prefill(prefix[:end], all_logits=False, keep=done)  # nobody reads the prompt's logits
        self._prefilled = end
        if end == len(prefix):
            self.prefilling = False
            self.stats.prefill_s = time.perf_counter() - self.start_time
        return end - done

    def acceptance(self) -> tuple[float, ...] | None:
        """[j - 1]: the adaptive controller's chance that a draft's first j tokens are all
        accepted (None: a fixed k)."""
        return self.controller.acceptance()

    def plan(self, k_cap: int | None = None, tree: bool = False) -> list[int] | None:
        """Draft up to k tokens (at most k_cap); return the tokens to score, or None when done.

        With tree=True the caller scores a token tree with `backend.forward_tree(tokens,
        self.tree_parents)` whenever `tree_parents` is set; otherwise trees become chains.
        """
        self.tree_parents, self.unscored = None, []
        assert not self.prefilling, "plan() follows the prompt's prefill"
        if self.done:
            return None
        remaining = self.max_new_tokens - len(self.generated)
        room = self.backend.max_length - self.backend.length - 1  # cache slots left after the pending token
        if remaining <= 0 or room < 0:
            self.done = True
            return None
        k = max(0, min(self.controller.next_k(self.backend.length), remaining - 1, room))
        if k_cap is not None:
            k = min(k, max(0, k_cap))
        t0 = time.perf_counter()
        self._budget = min(remaining, room + 1)  # a step emits at most room + 1 tokens
        if self.grammar is not None:
            return self._plan_constrained(k, k_cap, remaining, room, t0)
        draft = self._propose(self.context, k)
        if draft is not None and draft.parents is not None:  # a tree: cut to fit, or its best chain
            # a tree may score as many tokens as cost what the controller priced for k, not more
            nodes = min(room, self.controller.tree_nodes(k))
            draft = fit_tree(draft, k, nodes, use_tree=tree and self.backend.supports_tree)
            if draft.parents is not None:
                self.tree_parents = [-1, *[p + 1 for p in draft.parents]]  # the pending token is the root
        draft_tokens = draft.tokens[: k if self.tree_parents is None else room] if draft else []
        draft_probs = draft.probs[: len(draft_tokens)] if draft and draft.probs is not None else None
        self._step = (k, draft_tokens, draft_probs, self.backend.length, time.perf_counter() - t0)
        return [self.context[-1], *draft_tokens]

    def _propose(self, context: list[int], k: int) -> Draft | None:
        """The drafter's proposal of at most k tokens (None for none). A first proposal after
        the prompt or a bypass must first read the tokens the drafter has not seen. A drafter
        that counts that backlog (a draft model's) has its catch-up priced by the controller,
        which may have it probe from a window of the last tokens instead (AdaptiveK.reading).
        For the others, reading is cheap: a catch-up is neither priced nor taken as drafting."""
        self._read, self._steady = 0, True
        if k <= 0:
            return None
        backlog = self.drafter.backlog(context)
        if backlog is None:
            self._steady = len(context) - self._drafter_saw <= CATCH_UP_LIMIT
            self._drafter_saw = len(context)
            return self.drafter.propose(context, k)
        k, read = self.controller.reading(k, backlog, self.drafter.probe_window())
        if k <= 0:
            return None
        if read < backlog:  # a probe: the drafter sees only the window, and catches up later
            context = context[-read:]
        self._read = read if read < backlog or backlog > CATCH_UP_LIMIT else 0
        return self.drafter.propose(context, k)

    def _plan_constrained(self, k: int, k_cap: int | None, remaining: int, room: int, t0: float) -> list[int]:
        """plan() under a grammar: the forced tokens, then the drafter's chain after them, cut
        where the grammar rejects it. Forced tokens are certain, so they are scored even past
        k (up to MAX_FORCED, and k_cap); the drafter gets what k leaves. Trees become chains:
        the masks follow one path."""
        limit = min(remaining - 1, room, MAX_FORCED if k_cap is None else k_cap) if self.draft_forced else 0
        closing = self.grammar.closing_due(self._budget)
        if closing is not None:  # the budget holds the closing completion and no more: emit it
            self.closed_by_budget = True
        forced = (closing or self.grammar.forced())[: max(0, limit)]
        budget = k - len(forced) if closing is None else 0
        draft = self._propose(self.context + forced, budget)
        if draft is not None and draft.parents is not None:
            draft = fit_tree(draft, budget, budget, use_tree=False)
        tokens = draft.tokens[:budget] if draft else []
        probs = draft.probs[: len(tokens)] if draft and draft.probs is not None else None
        planned = self._constrained = self.grammar.draft(forced, tokens, probs)
        scored = [self.context[-1], *planned.tokens]
        self._allowed = self.grammar.masks(scored, self.backend.vocab_size, self._budget)  # [rows, V]
        self.unscored = [i for i, n in enumerate(self._allowed.sum(dim=-1).tolist()) if n == 1]
        self._step = (k, planned.tokens, planned.probs, self.backend.length, time.perf_counter() - t0)
        return scored

    def advance(self, logits: torch.Tensor, score_s: float = 0.0, solo: bool = True) -> str:
        """logits: [k+1, V] for the planned tokens. Verify, roll back, emit; return a text delta.
        `solo`: the forward scored this sequence alone, so score_s is a sample of what scoring
        its tokens costs (a batch's time is not)."""
        assert self._step is not None, "advance() needs a plan() first"
        k, draft_tokens, draft_probs, cache_len, propose_s = self._step
        self._step = None
        constrained, self._constrained = self._constrained, None
        if constrained is not None:  # mask every scored row; the grammar-rejected token joins unscored
            logits = self.grammar.mask_logits(logits, [self.context[-1], *draft_tokens],
                                              allowed=self._allowed)  # [k+1, V]
            draft_tokens, draft_probs = constrained.for_verification()
        num_forced = constrained.num_forced if constrained is not None else 0
        t2 = time.perf_counter()
        result, num_drafted = self._verify(logits, draft_tokens, draft_probs, cache_len)
        t3 = time.perf_counter()

        remaining = self.max_new_tokens - len(self.generated)
        new, kept, done = self._fit(result.emitted(draft_tokens), result.num_accepted, cache_len)
        if self.grammar is not None and (end := self.grammar.advance(new)) is not None:  # the grammar stopped
            new, done, self.finish_reason = new[:end], True, "stop"  # the reply ends there, without an EOS
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                new, done, self.finish_reason = new[: i + 1], True, "stop"
                break
        if len(new) >= remaining:
            new, done = new[:remaining], True
        if self.finish_reason == "length" and len(new) >= self._budget and self._accepting():
            # complete at the budget's end
            done, self.finish_reason, self.closed_by_budget = True, "stop", True
        if self.track_text:
            keep = self.tracker.add(new)
            if keep is not None:
                new, done, self.finish_reason = new[:keep], True, "stop"
        self._add_logprobs(logits, result, new)
        self.context.extend(new)
        self.generated.extend(new)
        stats = self.stats
        forced = min(num_forced, kept)  # the drafter's counts leave forced tokens out
        # kept: the accepted drafts the output holds (the budget may cut a step, see _fit)
        stats.observe_step(num_drafted - num_forced, kept - forced, len(new), k, forced)
        stats.propose_s += propose_s
        stats.score_s += score_s
        stats.verify_s += t3 - t2
        drafter_accepted = result.num_accepted - min(num_forced, result.num_accepted)  # cut or not
        self.controller.observe(num_drafted - num_forced, drafter_accepted, logits.shape[0],
                                score_s if solo else 0.0, propose_s if self._steady else None,
                                read=self._read)
        if done:
            self.done = True
            return ""
        self.drafter.on_verified(self.context, kept - forced)
        return self.tracker.delta() if self.track_text else ""

    def _verify(self, logits: torch.Tensor, draft_tokens: list[int], draft_probs, cache_len: int):
        """Verify the planned chain or tree against logits [k+1, V] and keep the accepted
        tokens' cache; return the result and the number of drafted positions (a tree's depth)."""
        # at: the step's first output position
        params, backend, at = self.params, self.backend, len(self.generated)
        if self.tree_parents is not None:
            parents = [p - 1 for p in self.tree_parents[1:]]
            result = verify_tree(draft_tokens, parents, draft_probs, logits, params, self.draws, at)
            keep_path(backend, result.accepted)
            return result, tree_depth(parents)  # stats and controller count the tree's depth
        drafted = torch.tensor(draft_tokens, dtype=torch.long)
        if params.greedy:
            result = verify_greedy(drafted, logits.argmax(-1))
        else:
            result = verify_sampling(drafted, draft_probs, logits_to_probs(logits, params), self.draws, at)
        backend.rollback(cache_len + 1 + result.num_accepted)
        return result, len(draft_tokens)

    def _fit(self, emitted: list[int], accepted: int, cache_len: int) -> tuple[list[int], int, bool]:
        """A structured reply's step fitted to its budget (GrammarMatcher.fit): (the tokens it
        emits, the accepted drafts among them, whether the reply ends). A cut step gives back
        the cache of the drafts it drops."""
        if self.grammar is None:
            return emitted, accepted, False
        new, fitted = self.grammar.fit(emitted, self._budget)
        if fitted is None:
            return new, accepted, False
        self.closed_by_budget = True
        kept = min(accepted, len(new) - (fitted == "closed"))
        if kept < accepted:
            self.backend.rollback(cache_len + 1 + kept)
        if fitted == "ended":
            self.finish_reason = "stop"
        return new, kept, fitted == "ended"

    def _accepting(self) -> bool:
        """A structured reply whose grammar accepts what it emitted so far."""
        return self.grammar is not None and self.grammar.constraint.closes and self.grammar.is_accepting

    def _add_logprobs(self, logits: torch.Tensor, result, new: list[int]) -> None:
        """Keep the logprobs of the emitted tokens `new` when the request asks for them."""
        if self.logprobs is None:
            return
        # the row that scored each emitted token: a chain's i-th, or the accepted path's nodes
        rows = list(range(len(new))) if self.tree_parents is None else [0, *[i + 1 for i in result.accepted]]
        self.token_logprobs += token_logprobs(logits, rows[: len(new)], new, self.logprobs)

    def finish(self) -> str:
        """End the request: set `result`; return the last text delta."""
        self.done = True
        backend = self.backend
        if backend.prefix_cache.reuse_decoded and backend.length >= len(self.context) - 1:
            # keep what plain decoding would have fed (not drafts accepted past the end), and
            # let the next turn of the conversation reuse it
            backend.rollback(len(self.context) - 1)
            backend.prefix_cache.mark_decoded(self.context[:-1], backend.length)
        self.drafter.end(self.context)
        if not self.track_text:
            self.tracker.add(self.generated)
        final = self.tracker.delta(final=True)
        self.stats.wall_s = time.perf_counter() - self.start_time
        self.result = GenerationResult(
            self.tracker.text, self.generated, self.finish_reason, self.stats, self.prompt_ids,
            logprobs=self.token_logprobs if self.logprobs is not None else None,
            closed_by_budget=self.closed_by_budget and self.finish_reason != "length",
        )
        return final
