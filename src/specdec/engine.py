"""The engine: a target, its backend and a drafter, running one request at a time.

`Engine.generate` / `Engine.stream` prepare a request (prompt, sampling, tools, grammar) and
run its `sequence.Sequence` step by step: propose -> score -> verify -> roll back -> emit.
What outlives a request (the target's scoring costs, the drafter's acceptance rate) lives
here; the server's scheduler runs the same Sequence over many requests at once.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator

from specdec.backends import make_backend
from specdec.config import EngineConfig
from specdec.controller import AdaptiveK, ScoreCosts
from specdec.drafters import Drafter, make_drafter
from specdec.errors import SpecdecError
from specdec.grammar import Constraint
from specdec.models import LoadedModel, load_model
from specdec.prompts import Prompt, encode
from specdec.request import Prepared, Request
from specdec.sequence import GenerationResult, Runtime, Sequence
from specdec.tools import DEFAULT_PARSER, ToolPlan

__all__ = ["Engine", "GenerationResult", "GenerationStream", "Runtime", "Sequence"]


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
        target: str | LoadedModel | EngineConfig | None = None,
        drafter: str | Drafter | None = None,
        *,
        config: EngineConfig | None = None,
        **settings,  # EngineConfig fields: k, backend, backend_options, prefix_cache, draft_device, ...
    ):
        """Settings come from `config` (default EngineConfig()), then from the arguments, as
        `EngineConfig.override` applies them. `target` may also be a loaded model (its weights
        are shared) or the EngineConfig itself; `drafter` may be a Drafter instance."""
        if isinstance(target, EngineConfig):
            config, target = target, None
        loaded = target if isinstance(target, LoadedModel) else None
        instance = drafter if isinstance(drafter, Drafter) else None
        self.config = (config or EngineConfig()).override(
            target=loaded.name if loaded else target, drafter=instance.name if instance else drafter,
            **settings
        )
        cfg = self.config
        self.target = loaded or load_model(cfg.target)
        self.tokenizer = self.target.tokenizer
        self.backend = make_backend(cfg.backend, self.target, prefix_cache=cfg.prefix_cache,
                                    **cfg.backend_options)
        if instance is not None:
            self.drafter, self.drafter_name = instance, instance.name
        else:
            self.drafter = make_drafter(cfg.drafter, self.target, cfg.draft_device)
            self.drafter_name = cfg.drafter
        self.drafter.bind_target(self.backend)  # drafters that read the target's states keep it
        self.k = cfg.k
        self.eos_token_ids = self.target.eos_token_ids
        # What the adaptive controller learns that outlives a request: the target's cost of
        # scoring n tokens on this machine, and how often this drafter's tokens are accepted.
        self.costs = ScoreCosts()
        self.alpha_prior: float | None = None

    # ---- prompts -------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, chat: bool = True, tools: ToolPlan | None = None) -> list[int]:
        """`prompts.encode` with this engine's context length."""
        return encode(self.tokenizer, prompt, chat=chat, max_length=self.backend.max_length, tools=tools)

    # ---- generation ----------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt | Request,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        chat: bool = True,
        *,
        response_format: dict | Constraint | None = None,
        json_schema: dict | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        **tool_args,  # tools, tool_choice, parallel_tool_calls, tool_parser: see stream()
    ) -> GenerationResult:
        """The whole reply, for a `request.Request` or the arguments that build one
        (`Request.build`). `response_format` (OpenAI's shape, or a grammar.Constraint) or
        `json_schema` (a schema, enforced strictly) constrain it: see grammar.py. `logprobs=n`
        fills `result.logprobs`: each token's logprob and its n likeliest rivals (logprobs.py).
        `ignore_eos`: the reply runs to max_new_tokens past end-of-sequence tokens."""
        request = _as_request(prompt, dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
            seed=seed, chat=chat, response_format=response_format, json_schema=json_schema, logprobs=logprobs,
            ignore_eos=ignore_eos, **tool_args))
        stream = self.stream(request, _text=bool(request.stop))
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: Prompt | Request,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: list[str] | None = None,
        seed: int | None = None,
        chat: bool = True,
        _text: bool = True,
        *,
        response_format: dict | Constraint | None = None,
        json_schema: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        tool_parser: str = DEFAULT_PARSER,
        logprobs: int | None = None,
        ignore_eos: bool = False,
    ) -> GenerationStream:
        """Validate now (so bad input fails before the first delta), generate lazily.
        `tools` (OpenAI function tools), `tool_choice` and `parallel_tool_calls` as in the
        OpenAI API (see tools.py): the result then has `tool_calls`; the deltas stay raw text
        (`tools.ToolStream` turns them into OpenAI deltas)."""
        request = _as_request(prompt, dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop=stop,
            seed=seed, chat=chat, response_format=response_format, json_schema=json_schema, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, tool_parser=tool_parser,
            logprobs=logprobs, ignore_eos=ignore_eos))
        job = request.prepare(self.tokenizer, self.eos_token_ids, max_length=self.backend.max_length)
        stream = GenerationStream(iter(()))
        stream._deltas = self._run(stream, job, _text)
        return stream

    def _run(self, stream: GenerationStream, job: Prepared, track_text: bool) -> Iterator[str]:
        if self.k in ("auto", None) and self.drafter_name != "none" and not self.costs.calibrated:
            self.costs.calibrate(self.backend)  # once per engine, before the first prompt fills the cache
            self.costs.calibrate_drafter(self.drafter)
        runtime = Runtime(self.tokenizer, self.eos_token_ids, self.config, self.costs)
        seq = Sequence(self.backend, self.drafter, job, self.k, runtime, track_text=track_text,
                       prior_alpha=self.alpha_prior)
        seq.start()
        while (tokens := seq.plan(tree=True)) is not None:
            t0 = time.perf_counter()
            if seq.tree_parents is not None:  # a token tree: one forward with tree attention
                logits = self.backend.forward_tree(tokens, seq.tree_parents)  # [len(tokens), V]
            else:
                logits = self.backend.forward(tokens, seq.unscored)  # [len(tokens), V]
            delta = seq.advance(logits, time.perf_counter() - t0)
            if delta:
                yield delta
        final = seq.finish()
        if isinstance(seq.controller, AdaptiveK) and seq.controller.drafted:
            self.alpha_prior = seq.controller.alpha  # the next request starts from it
        plan = job.request.tools
        stream.result = plan.finish(seq.result) if plan is not None else seq.result
        if final:
            yield final


_BUILD_DEFAULTS = {name: p.default for name, p in inspect.signature(Request.build).parameters.items()
                   if p.default is not inspect.Parameter.empty}


def _as_request(prompt: Prompt | Request, arguments: dict) -> Request:
    """A Request given as such (then no other argument may be set), or built from the arguments."""
    if not isinstance(prompt, Request):
        return Request.build(prompt, **arguments)
    given = sorted(name for name, value in arguments.items() if value != _BUILD_DEFAULTS.get(name))
    if given:
        raise SpecdecError(f"a Request carries its own settings; do not pass {', '.join(given)} too",
                           given[0])
    return prompt
