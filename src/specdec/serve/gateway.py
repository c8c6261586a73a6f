"""The gateway's state: loading the model, admission, and turning a request body into a
GenRequest (validation that needs the tokenizer, tokenization, the reply's grammar).

`build_request` runs in the TokenizerPool's threads (serve/tokenize.py), never on the event
loop and never under a global lock; admission (`admit`) is checked before it, so a full
server refuses with 429 without tokenizing anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from fastapi.responses import JSONResponse

from specdec.config import split_k
from specdec.drafters import DrafterSpec, available
from specdec.errors import SpecdecError
from specdec.grammar import GrammarMatcher, closing_vocabulary, constraint_from_response_format, ll_tokenizer
from specdec.models import load_model
from specdec.prompts import encode
from specdec.sampling import SamplingParams
from specdec.serve.logprobs import LogprobFormatter, requested
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import error_body, message_text, stop_list
from specdec.serve.scheduler import GenRequest, LoadPolicy, Scheduler
from specdec.serve.tokenize import TokenizerPool
from specdec.tools import ToolPlan, tool_plan
from specdec.traffic_log import QueuedTrafficLog, TrafficLog

log = logging.getLogger("specdec.server")


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def chat_message(i: int, m) -> dict:
    """A request message as prompts.encode takes it: text content, calls and results kept."""
    try:
        content = None if m.content is None else message_text(m.content)
    except ValueError as e:
        raise SpecdecError(str(e), f"messages[{i}].content") from None
    msg = {"role": m.role, "content": content}
    if m.tool_calls is not None:
        msg["tool_calls"] = m.tool_calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        if m.role != "tool":  # the chat template has no place for a speaker's name
            raise SpecdecError(f"messages[{i}].name is supported on tool messages only", f"messages[{i}].name")
        msg["name"] = m.name
    return msg


class Gateway:
    """Server state: loading, the scheduler, admission and request building."""

    def __init__(self, config):  # a ServeConfig (serve/settings.py)
        self.config = config
        self.metrics = ServerMetrics(config.model_name)
        self.traffic = None
        if config.log_dir:  # served prompts and completions, for `specdec distill --from-logs`
            self.traffic = QueuedTrafficLog(TrafficLog(config.log_dir, config.log_max_bytes))
        self.scheduler = None
        self.tokenizer = None
        self.tokenizers: TokenizerPool | None = None
        self.max_length: int | None = None
        self.load_error: str | None = None
        self.created = int(time.time())
        self._vocab_lock = threading.Lock()  # the first build of llguidance's view of the vocabulary
        self._vocab_ready = False
        self.logprob_format: LogprobFormatter | None = None
        self._allowed: set[str] = set()
        self.admitted = 0  # generation requests past admission, not yet answered (event loop only)
        self.in_flight = 0  # /v1 requests being served (ops.RequestContext)
        self.draining = False  # set on SIGTERM (ops.DrainingServer)

    # ---- loading -------------------------------------------------------------------------

    def load(self) -> None:
        """Runs in a background thread so the server answers /health (503) meanwhile."""
        try:
            delay = float(os.environ.get("SPECDEC_SERVE_LOAD_DELAY", "0") or 0)  # for tests
            if delay > 0:
                time.sleep(delay)
            cfg = self.config
            target = load_model(cfg.engine.target)
            policy = LoadPolicy(cfg.batch_tokens(), cfg.spec_off_above, cfg.max_prefill_tokens)
            scheduler = Scheduler(target, cfg.engine, cfg.max_batch, cfg.max_queue, policy, self.metrics,
                                  cache_slots=cfg.cache_slots)
            self._allowed = {split_k(s)[0] for s in [cfg.engine.drafter, "none", *cfg.allow_drafters]}
            self.metrics.bind_scheduler(scheduler)
            self.tokenizer, self.max_length = target.tokenizer, scheduler.max_length
            self.tokenizers = TokenizerPool(target.tokenizer)
            self.eos_token_ids = target.eos_token_ids
            self.logprob_format = LogprobFormatter(target.tokenizer, target.eos_token_ids, self._vocab_lock)
            self.vocab_size = target.vocab_size
            scheduler.start()
            self.scheduler = scheduler  # last: from here on the server is ready
            if callable(cfg.on_ready):
                cfg.on_ready()
        except Exception as e:
            self.load_error = e.message if isinstance(e, SpecdecError) else f"{type(e).__name__}: {e}"
            if callable(self.config.on_load_error):
                self.config.on_load_error(self.load_error)  # the CLI prints it and exits
            else:
                log.error("loading failed: %s", self.load_error)

    @property
    def ready(self) -> bool:
        s = self.scheduler
        return s is not None and s.alive

    def not_ready(self) -> JSONResponse:
        if self.draining:
            return error_response(503, "the server is shutting down", headers={"Retry-After": "1"})
        message = f"model failed to load: {self.load_error}" if self.load_error else "Loading model"
        return error_response(503, message, headers={"Retry-After": "1"})

    async def stop_scheduler(self) -> None:
        """End what runs (each request gets a "shutting down" error) and stop the worker."""
        if self.scheduler is not None:
            await asyncio.to_thread(self.scheduler.stop)

    def close(self) -> None:
        if self.traffic is not None:
            self.traffic.close()
        if self.tokenizers is not None:
            self.tokenizers.close()

    # ---- admission (event loop only) -----------------------------------------------------

    def admit(self) -> bool:
        """Take one of the max_batch + max_queue places, before any expensive work."""
        if self.admitted >= self.config.max_batch + self.config.max_queue:
            return False
        self.admitted += 1
        return True

    def release(self) -> None:
        self.admitted -= 1

    def retry_after(self) -> int:
        return self.scheduler.retry_after() if self.scheduler is not None else 1

    # ---- validation (pool threads) -------------------------------------------------------

    def check_drafter(self, text: str) -> str | None:
        """Clients may pick `none`, a bare registered drafter name, or a spec the server
        configured; specs with paths or options only come from the server's own flags."""
        try:
            spec_text, _ = split_k(text)  # also checks the k
            name = DrafterSpec.parse(spec_text).name
        except SpecdecError as e:
            return e.message
        if spec_text in self._allowed or (spec_text == name and name in available()):
            return None
        if name not in available():
            return f"unknown drafter {name!r}; choose one of: {', '.join(available())}"
        return f"drafter {spec_text!r} is not enabled on this server (see specdec serve --allow-drafter)"

    def encode(self, body, chat: bool, tools: ToolPlan | None = None) -> list[int]:
        """The request's prompt as token ids (`prompts.encode`, with this thread's tokenizer),
        its tools shown to the model. The context-length check is build_request's."""
        if chat:
            prompt = [chat_message(i, m) for i, m in enumerate(body.messages)]
        else:
            prompt = body.prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list):
                if not all(isinstance(t, int) for t in prompt):
                    raise SpecdecError("only one prompt per request is supported", "prompt")
                if not all(0 <= t < self.vocab_size for t in prompt):  # ids from the client
                    raise SpecdecError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return encode(self.tokenizers.local(), prompt, chat=chat, tools=tools)

    def grammar(self, body, tools: ToolPlan | None) -> GrammarMatcher | None:
        """The reply's constraint: the response_format, or the tool calls (tools.py)."""
        constraint = constraint_from_response_format(body.response_format)
        if tools is not None:
            constraint = tools.constraint(constraint)
        if constraint is None:
            return None
        if not self._vocab_ready:
            with self._vocab_lock:  # the first one reads the whole vocabulary; later ones reuse it
                ll_tokenizer(self.tokenizer, self.eos_token_ids)
                closing_vocabulary(self.tokenizer, self.eos_token_ids)  # before a step needs it
                self._vocab_ready = True
        return GrammarMatcher(constraint, self.tokenizer, self.eos_token_ids)

    def build_request(self, body, chat: bool, emit, tenant: str = "") -> tuple[GenRequest, ToolPlan | None]:
        """Validate everything that needs the tokenizer; return a GenRequest and the request's
        tools, or raise SpecdecError."""
        prompt_param = "messages" if chat else "prompt"
        tools = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, self.config.tool_call_parser) if chat else None
        prompt_ids = self.encode(body, chat, tools)
        max_tokens, max_param = self._max_tokens(body, chat, len(prompt_ids), prompt_param)
        try:
            stop = stop_list(body.stop)
        except ValueError as e:
            raise SpecdecError(str(e), "stop") from None
        top_k = body.top_k if body.top_k and body.top_k > 0 else 0
        params = SamplingParams(
            1.0 if body.temperature is None else float(body.temperature), top_k,
            1.0 if body.top_p is None else float(body.top_p),
        )
        params.validate()
        if body.drafter is not None and (problem := self.check_drafter(body.drafter)):
            raise SpecdecError(problem, "drafter")
        if (logprobs := requested(body, chat)) is not None:
            self.logprob_format.prepare()
        grammar = self.grammar(body, tools) if chat else None
        if grammar is not None:  # a structured reply that cannot be complete within its budget: a 400
            asked = body.max_completion_tokens if max_param == "max_completion_tokens" else body.max_tokens
            grammar.require_budget(max_tokens, max_param if asked is not None else prompt_param, context=asked is None)
        req = GenRequest(
            prompt_ids, params, max_tokens, emit, stop=stop, seed=body.seed, drafter=body.drafter,
            k=body.k, stream=bool(body.stream), timeout_s=self.config.request_timeout,
            grammar=grammar, logprobs=logprobs, tenant=tenant,
        )
        return req, tools

    def _max_tokens(self, body, chat: bool, n_prompt: int, prompt_param: str) -> tuple[int, str]:
        """The completion's token budget, checked against the context in OpenAI's words."""
        context = self.max_length
        if n_prompt >= context:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, your "
                f"{prompt_param} resulted in {n_prompt} tokens, leaving no room for a completion.",
                prompt_param,
            )
        max_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if max_param == "max_completion_tokens" else body.max_tokens
        if max_tokens is None:
            max_tokens = context - n_prompt if chat else min(16, context - n_prompt)
        elif n_prompt + max_tokens > context:
            raise SpecdecError(
                f"This model's maximum context length is {context} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the {prompt_param}, {max_tokens} in the "
                f"completion). Please reduce the length of the {prompt_param} or completion.",
                max_param,
            )
        return max_tokens, max_param
