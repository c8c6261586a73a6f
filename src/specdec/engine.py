"""The speculative decoding loop: propose -> score -> verify -> roll back -> emit.

The target's KV cache holds every token of the sequence except the last one, the
"pending" token. A step feeds [pending, d1..dk] in one forward, which yields the k+1
distributions verification needs; afterwards the cache is rolled back to keep only the
pending token and the accepted drafts, and the recovered or bonus token becomes pending.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdec.backends import make_backend
from specdec.controller import AdaptiveK, ScoreCosts, make_controller
from specdec.drafters import Drafter, DrafterSpec, make_drafter
from specdec.errors import SpecdecError
from specdec.models import DEFAULT_TARGET, LoadedModel, load_model
from specdec.sampling import SamplingParams, logits_to_probs
from specdec.stats import SpecStats
from specdec.text import TextTracker
from specdec.verify import verify_greedy, verify_sampling


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    stats: SpecStats
    prompt_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.summary(),
        }


PREFIX_CACHE_MODES = ("prompt", "decoded", "off")


def prefix_cache_mode(value: bool | str) -> str:
    """prompt: reuse prefilled prompt tokens, bit-exact against a cold start (the default);
    decoded: also the previous answers of a conversation; off: prefill every prompt whole."""
    mode = {True: "prompt", False: "off"}.get(value, value) if isinstance(value, bool) else value
    if mode not in PREFIX_CACHE_MODES:
        raise SpecdecError(f"prefix cache must be one of {', '.join(PREFIX_CACHE_MODES)}, got {value!r}",
                           "prefix_cache")
    return mode


class GenerationStream:
    """Iterates over text deltas; `result` is set once the iteration ends."""

    def __init__(self, deltas: Iterator[str]):
        self._deltas = deltas
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self._deltas


class Engine:
    """Lossless speculative generation for one target model.

    >>> engine = Engine(target="smollm2-135m", drafter="ngram", k="auto")
    >>> engine.generate("Write a haiku about caches.", max_new_tokens=64).text
    """

    def __init__(
        self,
        target: str | LoadedModel = DEFAULT_TARGET,
        drafter: str | Drafter = "ngram",
        k: str | int = "auto",
        backend: str = "hf",
        backend_options: dict | None = None,  # e.g. {"precision": "int8"} for the native backend
        prefix_cache: bool | str = True,  # True/"prompt", "decoded", or False/"off" (see PrefixCache)
        draft_device: str | None = None,  # where the `model` drafter runs (the target stays put)
    ):
        self.target = target if isinstance(target, LoadedModel) else load_model(target)
        self.tokenizer = self.target.tokenizer
        self.backend = make_backend(backend, self.target, **(backend_options or {}))
        if isinstance(drafter, Drafter):
            self.drafter, self.drafter_name = drafter, drafter.name
        else:
            spec = DrafterSpec.parse(drafter)
            k = spec.options.pop("k", k)
            self.drafter, self.drafter_name = make_drafter(spec, self.target, draft_device), spec.text
        self.drafter.bind_target(self.backend)  # drafters that read the target's states keep it
        make_controller(k)  # validate now rather than at the first request
        self.k = k
        self.eos_token_ids = self.target.eos_token_ids
        mode = prefix_cache_mode(prefix_cache)
        self.prefix_cache = mode != "off"  # keep the cached part of a prompt that repeats the last one's start
        self.backend.reuse_decoded = mode == "decoded"  # ... including the last answer
        # What the adaptive controller learns that outlives a request: the target's cost of
        # scoring n tokens on this machine, and how often this drafter's tokens are accepted.
        self.costs = ScoreCosts()
        self.alpha_prior: float | None = None

    # ---- prompts -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[dict] | list[int], chat: bool = True) -> list[int]:
        """A user message (chat-formatted), a list of chat messages, raw text, or token ids."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list):
            ids = self._apply_chat(prompt)
        elif not isinstance(prompt, str) or not prompt.strip():
            raise SpecdecError("the prompt is empty", "prompt")
        elif chat and getattr(self.tokenizer, "chat_template", None):
            ids = self._apply_chat([{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        if not ids:
            raise SpecdecError("the prompt is empty", "prompt")
        if len(ids) >= self.backend.max_length:
            raise SpecdecError(
                f"the prompt has {len(ids)} tokens; the maximum context length is "
                f"{self.backend.max_length}, with room for at least one new token",
                "prompt",
            )
        return ids

    def _apply_chat(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise SpecdecError("the prompt is empty", "messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[dict] | list[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        chat: bool = True,
    ) -> GenerationResult:
        stream = self.stream(prompt, max_new_tokens, temperature, top_k, top_p, stop, seed, chat, _text=bool(stop))
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: str | list[dict] | list[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        chat: bool = True,
        _text: bool = True,
    ) -> GenerationStream:
        """Validate now (so bad input fails before the first delta), generate lazily."""
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        params.validate()
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "max_new_tokens")
        prompt_ids = self.encode_prompt(prompt, chat)
        stream = GenerationStream(iter(()))
        stream._deltas = self._run(stream, prompt_ids, params, max_new_tokens, stop, seed, _text)
        return stream

    def _run(self, stream, prompt_ids, params, max_new_tokens, stop, seed, track_text) -> Iterator[str]:
        if self.k in ("auto", None) and self.drafter_name != "none" and not self.costs.calibrated:
            self.costs.calibrate(self.backend)  # once per engine, before the first prompt fills the cache
        seq = Sequence(
            self.backend, self.drafter, prompt_ids, params, max_new_tokens, self.k,
            self.tokenizer, self.eos_token_ids, stop, seed, track_text,
            costs=self.costs, prior_alpha=self.alpha_prior,
        )
        seq.start(reuse_prefix=self.prefix_cache)
        while (tokens := seq.plan(tree=True)) is not None:
            t0 = time.perf_counter()
            if seq.tree_parents is not None:  # a token tree: one forward with tree attention
                logits = self.backend.forward_tree(tokens, seq.tree_parents)  # [len(tokens), V]
            else:
                logits = self.backend.forward(tokens)  # [len(tokens), V]
            delta = seq.advance(logits, time.perf_counter() - t0)
            if delta:
                yield delta
        final = seq.finish()
        if isinstance(seq.controller, AdaptiveK) and seq.controller.drafted:
            self.alpha_prior = seq.controller.alpha  # the next request starts from it
        stream.result = seq.result
        if final:
            yield final


class Sequence:
    """One request's decoding state and its step, shared by Engine and the server's scheduler.

    A step is split around the target forward so that a scheduler can score many sequences
    in one batched forward: `plan()` drafts and returns the tokens to score ([pending,
    d1..dk]), the caller runs the forward, and `advance(logits)` verifies, rolls back the
    cache and emits. `finish()` ends the request and sets `result`.
    """

    def __init__(
        self,
        backend,
        drafter: Drafter,
        prompt_ids: list[int],
        params: SamplingParams,
        max_new_tokens: int,
        k: str | int,
        tokenizer,
        eos_token_ids: set[int],
        stop: list[str] | None = None,
        seed: int | None = None,
        track_text: bool = True,
        costs: ScoreCosts | None = None,
        prior_alpha: float | None = None,
    ):
        self.start_time = time.perf_counter()
        self.backend, self.drafter = backend, drafter
        self.prompt_ids, self.params, self.max_new_tokens = prompt_ids, params, max_new_tokens
        self.eos_token_ids, self.track_text = eos_token_ids, track_text
        self.stats = SpecStats(prompt_tokens=len(prompt_ids))
        self.generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.seed() % 2**63))
        self.controller = make_controller(k, costs, prior_alpha)
        self.tracker = TextTracker(tokenizer, stop)
        self.context = list(prompt_ids)
        self.generated: list[int] = []
        self.finish_reason = "length"
        self.done = False
        self.result: GenerationResult | None = None
        self._step: tuple | None = None  # (k, draft_tokens, draft_probs, cache_len, propose_s) between plan and advance
        self.tree_parents: list[int] | None = None  # parents of the planned tokens when they form a tree

    def start(self, reuse_prefix: bool = True) -> None:
        """Prefill every prompt token but the last, which becomes the pending token; keep the
        part the backend's cache holds from an earlier prompt (`PrefixCache`)."""
        self.drafter.begin(self.prompt_ids, self.params, self.generator)
        prefix = self.prompt_ids[:-1]
        keep = self.backend.cached_prefix(prefix) if reuse_prefix else 0
        self.backend.prefill(prefix, all_logits=False, keep=keep)  # nobody reads the prompt's logits
        self.stats.cached_prompt_tokens = keep
        self.stats.prefill_s = time.perf_counter() - self.start_time

    def plan(self, k_cap: int | None = None, tree: bool = False) -> list[int] | None:
        """Draft up to k tokens (at most k_cap); return the tokens to score, or None when done.

        With tree=True the caller scores a token tree with `backend.forward_tree(tokens,
        self.tree_parents)` whenever `tree_parents` is set; otherwise trees become chains.
        """
        self.tree_parents = None
        if self.done:
            return None
        remaining = self.max_new_tokens - len(self.generated)
        room = self.backend.max_length - self.backend.length - 1  # cache slots left after the pending token
        if remaining <= 0 or room < 0:
            self.done = True
            return None
        k = max(0, min(self.controller.next_k(), remaining - 1, room))
        if k_cap is not None:
            k = min(k, max(0, k_cap))
        t0 = time.perf_counter()
        draft = self.drafter.propose(self.context, k) if k > 0 else None
        if draft is not None and draft.parents is not None:  # a tree: cut to fit, or its best chain
            from specdec.tree import fit_tree, supports_tree

            # a tree may score as many tokens as cost what the controller priced for k, not more
            nodes = min(room, self.controller.tree_nodes(k))
            draft = fit_tree(draft, k, nodes, use_tree=tree and supports_tree(self.backend))
            if draft.parents is not None:
                self.tree_parents = [-1, *[p + 1 for p in draft.parents]]  # the pending token is the root
        draft_tokens = draft.tokens[: k if self.tree_parents is None else room] if draft else []
        draft_probs = draft.probs[: len(draft_tokens)] if draft and draft.probs is not None else None
        self._step = (k, draft_tokens, draft_probs, self.backend.length, time.perf_counter() - t0)
        return [self.context[-1], *draft_tokens]

    def advance(self, logits: torch.Tensor, score_s: float = 0.0, solo: bool = True) -> str:
        """logits: [k+1, V] for the planned tokens. Verify, roll back, emit; return a text delta.
        `solo`: the forward scored this sequence alone, so score_s is a sample of what scoring
        its tokens costs (a batch's time is not)."""
        assert self._step is not None, "advance() needs a plan() first"
        k, draft_tokens, draft_probs, cache_len, propose_s = self._step
        self._step = None
        t2 = time.perf_counter()
        params, backend = self.params, self.backend
        num_drafted = len(draft_tokens)
        if self.tree_parents is not None:
            from specdec.tree import keep_path, tree_depth, verify_tree

            parents = [p - 1 for p in self.tree_parents[1:]]
            result = verify_tree(draft_tokens, parents, draft_probs, logits, params, self.generator)
            keep_path(backend, result.accepted)
            num_drafted = tree_depth(parents)  # stats and controller count the tree's depth
        else:
            drafted = torch.tensor(draft_tokens, dtype=torch.long)
            if params.greedy:
                result = verify_greedy(drafted, logits.argmax(-1))
            else:
                result = verify_sampling(drafted, draft_probs, logits_to_probs(logits, params), self.generator)
            backend.rollback(cache_len + 1 + result.num_accepted)
        t3 = time.perf_counter()

        remaining = self.max_new_tokens - len(self.generated)
        new = result.emitted(draft_tokens)
        done = False
        for i, token in enumerate(new):
            if token in self.eos_token_ids:
                new, done, self.finish_reason = new[: i + 1], True, "stop"
                break
        if len(new) >= remaining:
            new, done = new[:remaining], True
        if self.track_text:
            keep = self.tracker.add(new)
            if keep is not None:
                new, done, self.finish_reason = new[:keep], True, "stop"
        self.context.extend(new)
        self.generated.extend(new)
        stats = self.stats
        stats.observe_step(num_drafted, result.num_accepted, len(new), k)
        stats.propose_s += propose_s
        stats.score_s += score_s
        stats.verify_s += t3 - t2
        self.controller.observe(num_drafted, result.num_accepted, len(draft_tokens) + 1, score_s if solo else 0.0,
                                propose_s)
        if done:
            self.done = True
            return ""
        self.drafter.on_verified(self.context, result.num_accepted)
        return self.tracker.delta() if self.track_text else ""

    def finish(self) -> str:
        """End the request: set `result`; return the last text delta."""
        self.done = True
        if getattr(self.backend, "reuse_decoded", False) and self.backend.length >= len(self.context) - 1:
            # keep what plain decoding would have fed (not drafts accepted past the end), and
            # let the next turn of the conversation reuse it
            self.backend.rollback(len(self.context) - 1)
            self.backend.mark_decoded(self.context[:-1])
        self.drafter.end(self.context)
        if not self.track_text:
            self.tracker.add(self.generated)
        final = self.tracker.delta(final=True)
        self.stats.wall_s = time.perf_counter() - self.start_time
        self.result = GenerationResult(
            self.tracker.text, self.generated, self.finish_reason, self.stats, self.prompt_ids
        )
        return final
