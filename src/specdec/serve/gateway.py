"""The gateway's state: loading the model, admission, and turning a request body into a
GenRequest (the body's request value, then its tokenization and grammar: request.py).

`build_request` runs in the TokenizerPool's threads (serve/tokenize.py), never on the event
loop and never under a global lock; admission (`admit`) is checked before it, so a full
server refuses with 429 without tokenizing anything.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
import time

from fastapi.responses import JSONResponse

from specdec.config import split_k
from specdec.drafters import DrafterSpec, available
from specdec.errors import SpecdecError
from specdec.grammar import closing_vocabulary, ll_tokenizer
from specdec.models import load_model
from specdec.request import Request
from specdec.serve.bodies import chat_request, completion_request
from specdec.serve.logprobs import LogprobFormatter
from specdec.serve.metrics import ServerMetrics
from specdec.serve.protocol import error_body
from specdec.serve.responses import rename
from specdec.serve.scheduler import GenRequest, LoadPolicy, Scheduler
from specdec.serve.tokenize import TokenizerPool
from specdec.traffic_log import QueuedTrafficLog, TrafficLog

log = logging.getLogger("specdec.server")


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


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

    def request(self, body, kind: str) -> Request:
        """The body's request value (serve/bodies.py). A Responses request comes translated to
        chat (serve/responses.py); its limit keeps the name the client sent."""
        if kind == "completion":
            return completion_request(body, self.vocab_size)
        request = chat_request(body, self.config.tool_call_parser)
        if kind == "responses" and request.limit_field is not None:
            request = dataclasses.replace(request, limit_field=rename(request.limit_field))
        return request

    def warm_vocabulary(self) -> None:
        """llguidance's view of the vocabulary, built by the first constrained request only."""
        if not self._vocab_ready:
            with self._vocab_lock:  # the first one reads the whole vocabulary; later ones reuse it
                ll_tokenizer(self.tokenizer, self.eos_token_ids)
                closing_vocabulary(self.tokenizer, self.eos_token_ids)  # before a step needs it
                self._vocab_ready = True

    def build_request(self, body, kind: str, emit, tenant: str = "") -> GenRequest:
        """Validate everything that needs the tokenizer; return the GenRequest, or raise
        SpecdecError. `kind`: chat, completion or responses."""
        request = self.request(body, kind)
        if request.constraint() is not None:
            self.warm_vocabulary()
        job = request.prepare(self.tokenizer, self.eos_token_ids, self.max_length,
                              encoder=self.tokenizers.local())
        if body.drafter is not None and (problem := self.check_drafter(body.drafter)):
            raise SpecdecError(problem, "drafter")
        if request.logprobs is not None:
            self.logprob_format.prepare()
        return GenRequest(job, emit, drafter=body.drafter, k=body.k, stream=bool(body.stream),
                          timeout_s=self.config.request_timeout, tenant=tenant)
