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

from .backend import make_backend
from .controller import make_controller
from .drafters import Drafter, DrafterSpec, make_drafter
from .errors import SpecdecError
from .models import DEFAULT_TARGET, LoadedModel, load_model
from .sampling import SamplingParams, logits_to_probs
from .stats import SpecStats
from .text import TextTracker
from .verify import verify_greedy, verify_sampling


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
    ):
        self.target = target if isinstance(target, LoadedModel) else load_model(target)
        self.tokenizer = self.target.tokenizer
        self.backend = make_backend(backend, self.target)
        if isinstance(drafter, Drafter):
            self.drafter, self.drafter_name = drafter, drafter.name
        else:
            spec = DrafterSpec.parse(drafter)
            k = spec.options.pop("k", k)
            self.drafter, self.drafter_name = make_drafter(spec, self.target), spec.text
        make_controller(k)  # validate now rather than at the first request
        self.k = k
        self.eos_token_ids = self.target.eos_token_ids

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
        stats = SpecStats(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        generator = torch.Generator().manual_seed(seed if seed is not None else int(torch.seed() % 2**63))
        controller = make_controller(self.k)
        tracker = TextTracker(self.tokenizer, stop)
        backend, drafter = self.backend, self.drafter

        drafter.begin(prompt_ids, params, generator)
        backend.prefill(prompt_ids[:-1])
        stats.prefill_s = time.perf_counter() - start
        context = list(prompt_ids)
        generated: list[int] = []
        finish_reason = "length"
        while True:
            remaining = max_new_tokens - len(generated)
            room = backend.max_length - backend.length - 1  # cache slots left after the pending token
            if remaining <= 0 or room < 0:
                break
            k = max(0, min(controller.next_k(), remaining - 1, room))

            t0 = time.perf_counter()
            draft = drafter.propose(context, k) if k > 0 else None
            draft_tokens = draft.tokens[:k] if draft else []
            draft_probs = draft.probs[: len(draft_tokens)] if draft and draft.probs is not None else None
            t1 = time.perf_counter()
            cache_len = backend.length
            logits = backend.forward([context[-1], *draft_tokens])  # [k+1, V]
            t2 = time.perf_counter()
            drafted = torch.tensor(draft_tokens, dtype=torch.long)
            if params.greedy:
                result = verify_greedy(drafted, logits.argmax(-1))
            else:
                result = verify_sampling(drafted, draft_probs, logits_to_probs(logits, params), generator)
            backend.rollback(cache_len + 1 + result.num_accepted)
            t3 = time.perf_counter()

            new = result.emitted(draft_tokens)
            done = False
            for i, token in enumerate(new):
                if token in self.eos_token_ids:
                    new, done, finish_reason = new[: i + 1], True, "stop"
                    break
            if len(new) >= remaining:
                new, done = new[:remaining], True
            if track_text:
                keep = tracker.add(new)
                if keep is not None:
                    new, done, finish_reason = new[:keep], True, "stop"
            context.extend(new)
            generated.extend(new)
            stats.observe_step(len(draft_tokens), result.num_accepted, len(new), k)
            stats.propose_s += t1 - t0
            stats.score_s += t2 - t1
            stats.verify_s += t3 - t2
            controller.observe(len(draft_tokens), result.num_accepted, len(draft_tokens) + 1, t2 - t1, t1 - t0)
            if done:
                break
            drafter.on_verified(context, result.num_accepted)
            if track_text:
                delta = tracker.delta()
                if delta:
                    yield delta
        drafter.end(context)
        if not track_text:
            tracker.add(generated)
        final = tracker.delta(final=True)
        stats.wall_s = time.perf_counter() - start
        stream.result = GenerationResult(tracker.text, generated, finish_reason, stats, prompt_ids)
        if final:
            yield final
