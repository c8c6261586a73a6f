"""One request value: what a caller asks the model for, built once and read everywhere.

A `Request` is checked when it is built, before any tokenizer is involved: its prompt,
sampling, stop strings, tools and tool_choice, response_format, logprobs, seed and token
limit. It comes from exactly one builder per front door:

- Python arguments and CLI flags: `Request.build(...)` (Engine.generate/stream's keywords);
- an HTTP body: `serve/bodies.py` (chat and legacy completions), `serve/responses.py` (the
  Responses API, translated to the chat messages chat would send, then the same builder).

`prepare(tokenizer, ...)` binds it to a model: the prompt's token ids, the token budget left
in the context, and a fresh grammar matcher for the reply (response_format or tool calls).
The result, a `Prepared`, is what `sequence.Sequence` and the server's scheduler take.

Adding an API field: one field here, one line in its builder(s), and its use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.errors import SpecdecError
from specdec.grammar import Constraint, GrammarMatcher, request_constraint
from specdec.logprobs import MAX_TOP_LOGPROBS
from specdec.prompts import Prompt, encode
from specdec.sampling import SamplingParams
from specdec.tools import DEFAULT_PARSER, ToolPlan, tool_plan


@dataclass(frozen=True)
class Request:
    """A validated request. `max_tokens` is the reply's token limit and `limit_field` the name
    the caller gave it (`max_new_tokens`, `max_tokens`, `max_completion_tokens`,
    `max_output_tokens`), so that errors about it name what the caller sent; with
    `limit_field` None the caller set no limit, and `max_tokens` (None: unbounded) only caps
    what the context leaves."""

    prompt: Prompt
    chat: bool = True  # wrap a text prompt in the chat template
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    limit_field: str | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    tools: ToolPlan | None = None  # tools, tool_choice, parallel_tool_calls (tools.py)
    response_format: Constraint | None = None  # the reply's structure, besides the tools' (grammar.py)
    logprobs: int | None = None  # None: off; n: each token's logprob and its n likeliest rivals
    # an end-of-sequence token does not end the reply, which runs to its limit (vLLM's field: load
    # tests give every reply one length); a grammar's end still ends it
    ignore_eos: bool = False

    def __post_init__(self):
        self.sampling.validate()
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            field_name = self.limit_field or "max_tokens"
            raise SpecdecError(f"{field_name} must be >= 1, got {self.max_tokens}", field_name)
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS
        ):
            raise SpecdecError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                               "logprobs")
        self.constraint()  # the tools and the response_format must agree (and the plan learns which rules)

    @classmethod
    def build(
        cls,
        prompt: Prompt,
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
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        tool_parser: str = DEFAULT_PARSER,
        logprobs: int | None = None,
        ignore_eos: bool = False,
    ) -> Request:
        """From Engine.generate's keyword arguments (and the CLI's flags, which are those)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise SpecdecError(f"max_new_tokens must be >= 1, got {max_new_tokens}", "max_new_tokens")
        return cls(
            prompt, chat, SamplingParams(float(temperature), int(top_k), float(top_p)), max_new_tokens,
            "max_new_tokens", tuple(stop) if stop else None, seed,
            tool_plan(tools, tool_choice, parallel_tool_calls, tool_parser),
            request_constraint(response_format, json_schema), logprobs, bool(ignore_eos),
        )

    def constraint(self) -> Constraint | None:
        """The reply's whole constraint: the response_format, or the tool calls' grammar."""
        if self.tools is not None:
            return self.tools.constraint(self.response_format)
        return self.response_format

    @property
    def prompt_param(self) -> str:
        """The field an error about the prompt names: messages for a conversation, else prompt."""
        conversation = (self.chat and isinstance(self.prompt, list) and bool(self.prompt)
                        and isinstance(self.prompt[0], dict))
        return "messages" if conversation else "prompt"

    def budget(self, n_prompt: int, context: int | None) -> int:
        """The reply's token budget for a prompt of n_prompt tokens in `context` tokens (None:
        not checked here; the sequence ends where the cache does). A limit the caller set that
        does not fit is refused in OpenAI's words, naming the caller's field."""
        prompt_param = self.prompt_param
        if context is None:
            return self.max_tokens if self.max_tokens is not None else 2**62
        if n_prompt >= context:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, your "
                f"{prompt_param} resulted in {n_prompt} tokens, leaving no room for a completion.",
                prompt_param,
            )
        room = context - n_prompt
        if self.limit_field is None:
            return min(room, self.max_tokens or math.inf)
        if self.max_tokens > room:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{n_prompt + self.max_tokens} tokens ({n_prompt} in the {prompt_param}, "
                f"{self.max_tokens} in the completion). "
                f"Please reduce the length of the {prompt_param} or completion.",
                self.limit_field,
            )
        return self.max_tokens

    def prepare(self, tokenizer, eos_token_ids: set[int], context: int | None = None, *,
                max_length: int | None = None, encoder=None) -> Prepared:
        """Bind to a model: prompt ids (encoded with `encoder`, default `tokenizer`; checked
        against `max_length`), the budget in `context` (see `budget`) and a fresh grammar
        matcher over `tokenizer`'s vocabulary."""
        prompt_ids = encode(encoder or tokenizer, self.prompt, chat=self.chat, max_length=max_length,
                            tools=self.tools)
        budget = self.budget(len(prompt_ids), context)
        constraint = self.constraint()
        grammar = GrammarMatcher(constraint, tokenizer, eos_token_ids) if constraint is not None else None
        if grammar is not None:  # a structured reply that cannot be complete within its budget is refused
            self._require_closing(grammar, len(prompt_ids), budget, context, max_length)
        return Prepared(self, prompt_ids, budget, grammar)

    def _require_closing(self, grammar: GrammarMatcher, n_prompt: int, budget: int, context: int | None,
                         max_length: int | None) -> None:
        # the binding limit is the caller's field, or the context when no field was sent or it is smaller
        prompt_param = self.prompt_param
        room = budget if context is not None else (max_length - n_prompt + 1 if max_length else budget)
        if self.limit_field is not None and budget <= room:
            grammar.require_budget(budget, self.limit_field)
        else:
            grammar.require_budget(min(budget, room), prompt_param, context=True)


@dataclass
class Prepared:
    """A request bound to a model, ready for a Sequence: its prompt ids, its token budget, and
    its grammar matcher (None: unconstrained), which the Sequence advances, so it is fresh
    per run."""

    request: Request
    prompt_ids: list[int]
    max_new_tokens: int
    grammar: GrammarMatcher | None = None

    @classmethod
    def tokens(cls, prompt_ids: list[int], sampling: SamplingParams | None = None, max_new_tokens: int = 128,
               **fields) -> Prepared:
        """A request that is already token ids, unconstrained: `fields` are Request's (seed,
        stop, logprobs)."""
        if "stop" in fields and fields["stop"] is not None:
            fields["stop"] = tuple(fields["stop"])
        request = Request(list(prompt_ids), False, sampling or SamplingParams(), max_new_tokens,
                          "max_new_tokens", **fields)
        return cls(request, list(prompt_ids), max_new_tokens)
