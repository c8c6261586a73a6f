"""Peers for `specdec bench`: the tools people already use, run in-process on the same
prompt token ids as the methods.

- `hf`: transformers `generate()`, plain;
- `hf-pld`: `generate(prompt_lookup_num_tokens=10)` (prompt lookup decoding);
- `hf-assisted`: `generate(assistant_model=...)` with the draft of the first `model:` method;
- `llamacpp`: llama-cpp-python on the target's GGUF file (an optional extra). Its weights are
  quantized, so its tokens may differ from the float baseline; its match count is reported
  but is not a losslessness failure.

Prefix reuse, as each tool does it in service: the `llamacpp` peer keeps its KV cache across
turns and questions and feeds only what follows the longest prefix it already holds (the
earlier turns' prompts and replies), as llama-server's prompt cache does; the `hf` peers run
`generate()`, which prefills every prompt whole; specdec's methods reuse what
`--prefix-cache` says (prompt: earlier prompts; decoded: their replies too).

Peers cannot constrain their output: they decode tool sessions without the grammar.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from specdec.bench.run import Runner, TurnRecord
from specdec.drafters import DrafterSpec
from specdec.drafters.draft_model import ModelDrafter
from specdec.errors import SpecdecError
from specdec.models import load_model, resolve

PEERS = ("hf", "hf-pld", "hf-assisted", "llamacpp")
PLD_TOKENS = 10


def llamacpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _gguf_path(target_name: str):
    """The GGUF file behind a built-in name or .gguf path, or None for an HF directory."""
    try:
        kind, path = resolve(target_name)
    except SpecdecError:
        return None
    return path if kind == "gguf" else None


def parse_peers(text: str | None, methods: Sequence[str], target_name: str) -> tuple[list[str], list[str]]:
    """Validate `--peers`; return (peers to run, notes about peers skipped). None = the default."""
    has_model = any(DrafterSpec.parse(m).name == "model" for m in methods)
    notes: list[str] = []
    if text is None or text.strip() == "auto":
        peers = ["hf", "hf-pld"] + (["hf-assisted"] if has_model else [])
        if llamacpp_available() and _gguf_path(target_name) is not None:
            peers.append("llamacpp")
        elif not llamacpp_available():
            notes.append("llamacpp peer skipped: llama-cpp-python is not installed "
                         "(pip install llama-cpp-python)")
        return peers, notes
    if text.strip() == "none":
        return [], notes
    peers = [p.strip() for p in text.split(",")]
    for p in peers:
        if p not in PEERS:
            raise SpecdecError(f"unknown peer {p!r}; choose from: {', '.join(PEERS)}, or none", "peers")
    if len(set(peers)) != len(peers):
        raise SpecdecError(f"a peer is listed twice in {text!r}", "peers")
    if "hf-assisted" in peers and not has_model:
        raise SpecdecError("peer 'hf-assisted' needs a model:PATH method to take its draft model from",
                           "peers")
    if "llamacpp" in peers:
        if not llamacpp_available():
            notes.append("llamacpp peer skipped: llama-cpp-python is not installed "
                         "(pip install llama-cpp-python)")
            peers.remove("llamacpp")
        elif _gguf_path(target_name) is None:
            notes.append(f"llamacpp peer skipped: target {target_name!r} is not a GGUF file")
            peers.remove("llamacpp")
    return peers, notes


class HFPeer(Runner):
    kind = "peer"

    def __init__(self, name: str, target, assistant: torch.nn.Module | None = None, prompt_lookup: int = 0):
        self.name, self.model = name, target.model
        self.eos = sorted(target.eos_token_ids)
        self.assistant, self.prompt_lookup = assistant, prompt_lookup

    @torch.inference_mode()
    def run(self, prompt_ids, max_new_tokens, temperature, seed, constraint=None) -> TurnRecord:
        from transformers import GenerationConfig

        sampling = temperature > 0
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sampling, eos_token_id=self.eos,
                                  pad_token_id=self.eos[0])
        if sampling:  # plain temperature sampling, as the methods run it (transformers defaults top_k to 50)
            config.temperature, config.top_k, config.top_p = temperature, 0, 1.0
        kwargs = {}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        if self.prompt_lookup:
            config.prompt_lookup_num_tokens = self.prompt_lookup
        if sampling:
            torch.manual_seed(seed)
        input_ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, T]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, **kwargs
        )
        return TurnRecord(out[0, len(prompt_ids) :].tolist())


class LlamaCppPeer(Runner):
    kind = "peer"
    name = "llamacpp"
    exact = False  # quantized GGUF weights, not the float weights the baseline runs

    def __init__(self, gguf_path, eos_token_ids: set[int], n_ctx: int, threads: int | None = None,
                 reuse_prefix: bool = True):
        from llama_cpp import Llama  # optional extra

        self.reuse_prefix = reuse_prefix  # False: a cold prefill every turn
        threads = threads or torch.get_num_threads()  # the same thread budget as the torch runners
        self.llm = Llama(
            model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
            n_batch=512, verbose=False,
        )
        self.eos = set(eos_token_ids) | {self.llm.token_eos()}

    def run(self, prompt_ids, max_new_tokens, temperature, seed, constraint=None) -> TurnRecord:
        if not self.reuse_prefix:
            self.llm.reset()
        if temperature > 0:
            self.llm.set_seed(seed)
        tokens: list[int] = []
        # reset=True keeps the longest prefix the KV cache shares with the prompt (llama-cpp-python
        # drops only the rest), so a conversation's next turn feeds just its new tokens
        for token in self.llm.generate(
            list(prompt_ids), temp=temperature, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
            repeat_penalty=1.0, reset=True,
        ):
            tokens.append(int(token))
            if token in self.eos or len(tokens) >= max_new_tokens:
                break
        return TurnRecord(tokens)


def make_peers(peers: Sequence[str], target, target_name: str, methods: Sequence[str],
               engines: dict) -> list[Runner]:
    """Build peer runners. `engines` maps method string -> Engine (for the assisted draft)."""
    out: list[Runner] = []
    for name in peers:
        if name == "hf":
            out.append(HFPeer("hf", target))
        elif name == "hf-pld":
            out.append(HFPeer("hf-pld", target, prompt_lookup=PLD_TOKENS))
        elif name == "hf-assisted":
            method = next(m for m in methods if DrafterSpec.parse(m).name == "model")
            out.append(HFPeer("hf-assisted", target,
                              assistant=_draft_model(method, engines.get(method), target)))
        elif name == "llamacpp":
            out.append(LlamaCppPeer(_gguf_path(target_name), target.eos_token_ids,
                                    n_ctx=min(target.max_length, 8192)))
    return out


def _draft_model(method: str, engine, target) -> torch.nn.Module:
    """The transformers model behind `method` (model:NAME): the one its engine's drafter
    already runs on the hf backend, else the target's own or a freshly loaded one."""
    from specdec.backends.hf import HFBackend  # transformers' model code, for this peer only

    drafter = engine.drafter if engine is not None else None
    if isinstance(drafter, ModelDrafter) and isinstance(drafter.backend, HFBackend):
        return drafter.backend.model
    arg = DrafterSpec.parse(method).arg
    return target.model if arg == target.name else load_model(arg).model
