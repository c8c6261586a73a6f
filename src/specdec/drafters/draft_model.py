"""`model:PATH_OR_NAME`: a smaller causal LM with the target's tokenizer drafts k tokens.

PATH is a GGUF file or a model directory; the draft runs on the native kernels where they
run its architecture (a GGUF in its own quant types, no transformers model), on the device
`--draft-device` names (a CPU draft beside an accelerator target). The vocabularies are
compared from the tokenizers alone (models.check_same_tokenizer).

The draft keeps its own KV cache. Before each proposal it rolls back to the longest prefix
it shares with the context, so tokens the target accepted are never recomputed.
"""

from __future__ import annotations

import torch

from specdec.backends import RollbackLM, make_backend
from specdec.backends.auto import backend_for
from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.drafters.common import common_prefix
from specdec.errors import SpecdecError
from specdec.models import LoadedModel, check_same_tokenizer, load_model
from specdec.sampling import SamplingParams, logits_to_probs, sample

# The trailing tokens a probe reads when catching up on the whole context is not affordable.
PROBE_WINDOW = 32


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, backend: RollbackLM, eos_token_ids: set[int]):
        self.backend = backend
        self.eos_token_ids = eos_token_ids
        self._cached: list[int] = []  # tokens whose keys/values sit in the draft cache
        self._params = SamplingParams()
        self._generator: torch.Generator | None = None

    def begin(self, prompt_ids, params, generator) -> None:
        # the draft cache is kept: `propose` reuses whatever prefix the new context shares with it
        self._params, self._generator = params, generator

    def backlog(self, context_ids: list[int]) -> int:
        return len(context_ids) - common_prefix(self._cached, context_ids, limit=len(context_ids) - 1)

    def probe_window(self) -> int:
        return PROBE_WINDOW  # reading the context runs the draft model over it

    def propose(self, context_ids: list[int], k: int) -> Draft:
        room = self.backend.max_length - len(context_ids)
        k = min(k, room)
        if k <= 0:
            return Draft([])
        shared = common_prefix(self._cached, context_ids, limit=len(context_ids) - 1)
        self._cached = []  # unknown until the forward below has run
        self.backend.rollback(shared)
        logits = self.backend.forward(context_ids[shared:])[-1]  # [V]
        self._cached = list(context_ids)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if self._params.greedy:
                token = int(logits.argmax())
            else:
                probs = logits_to_probs(logits, self._params)  # [V]
                token = int(sample(probs, self._generator))
                rows.append(probs)
            tokens.append(token)
            if token in self.eos_token_ids or i == k - 1:
                break
            logits = self.backend.forward([token])[-1]
            self._cached.append(token)
        return Draft(tokens, torch.stack(rows) if rows else None)


@register("model")
def _make(spec: DrafterSpec, target: LoadedModel) -> Drafter:
    if not spec.arg:
        raise SpecdecError("the model drafter needs a path or name: model:PATH_OR_NAME", "drafter")
    if spec.arg == target.name:  # the target drafting for itself shares its weights
        draft = target
    else:
        try:
            draft = load_model(spec.arg)
        except SpecdecError as e:
            raise SpecdecError(f"draft model: {e.message}", "drafter") from e
        check_same_tokenizer(target, draft)
    # model:NAME:backend=hf:device=cpu:precision=int4; by default the draft runs where `auto`
    # puts it: the native kernels for the architectures they run (a GGUF read as it is), with
    # a notice where it falls back to transformers
    options = {key: spec.options[key] for key in ("device", "precision") if key in spec.options}
    if spec.device is not None and "device" not in options:
        options["device"] = spec.device
    kind = spec.options.get("backend", "auto")
    if kind == "auto":
        kind = backend_for(draft)
    if kind != "native" and "device" in options:  # only the native backend places weights on a device
        raise SpecdecError(f"the draft's device option needs the native backend, not {kind!r}", "drafter")
    backend = make_backend(kind, draft, prefix_cache="off", **options)  # it never prefills
    return ModelDrafter(backend, target.eos_token_ids)
