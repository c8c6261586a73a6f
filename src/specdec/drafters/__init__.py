"""The drafter interface and its registry.

A drafter guesses the next tokens of a sequence. The engine calls:
- `begin(prompt_ids, params, generator)` once per request;
- `propose(context_ids, k) -> Draft` every step; the draft may be shorter than k, or empty,
  which makes the step plain decoding;
- `on_verified(context_ids, num_accepted)` after verification, with the context now holding
  the accepted tokens plus the recovered or bonus token;
- `backlog(context_ids)` and `probe_window()`, for drafters whose reading of the context is
  dear (a model's): the tokens still to read, and the trailing tokens a probe may be drafted
  from instead (`propose` then gets only those).

A drafter with `Draft.probs = None` is deterministic; verification treats it as one-hot.
A drafter that samples must return the distributions it sampled from.

Drafters register themselves by name with `@register("name")`; `make_drafter("name:arg")` is
the only place that turns a method string into a drafter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdec.errors import SpecdecError
from specdec.registry import Registry
from specdec.sampling import SamplingParams


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), V] or None for a deterministic drafter
    # A token tree instead of a chain: parents[i] is the index of token i's parent in
    # `tokens`, or -1 when its parent is the pending token. None means a chain.
    parents: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter:
    name = "base"

    def begin(self, prompt_ids: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        """Start a new request."""

    def bind_target(self, backend) -> None:
        """Called once by the engine with its target backend. Drafters that read the
        target's own states (eagle reads its hidden states) keep it; others ignore it."""

    def scope(self, tenant: str) -> None:
        """Called by the server before `begin` with the request's tenant (its API key and
        cache_salt). Drafters that learn across requests (suffix's global trie) keep what they
        learn per tenant, so no caller's drafts reveal another's text; others ignore it."""

    def backlog(self, context_ids: list[int]) -> int | None:
        """How many tokens of `context_ids` this drafter must read before it can draft: what
        its state has not seen, for a drafter whose reading is dear (a model's); the controller
        prices that catch-up. None: reading is cheap, and a catch-up is not priced."""
        return None

    def probe_window(self) -> int | None:
        """How many of the last context tokens this drafter can draft a probe from. A drafter
        that runs a model over the context pays to read its backlog (the prompt, the tokens
        since a bypass); when the controller cannot afford that, it probes from this window
        (`propose` then gets only those tokens). None: reading is cheap, or it needs the
        whole context."""
        return None

    def propose(self, context_ids: list[int], k: int) -> Draft:
        raise NotImplementedError

    def on_verified(self, context_ids: list[int], num_accepted: int) -> None:
        """Called after each step with the updated context."""

    def end(self, context_ids: list[int]) -> None:
        """Called when the request finishes, with the whole sequence."""


@dataclass
class DrafterSpec:
    """A parsed method string: `name[:arg][:key=value...]`, e.g. `ngram:k=8` or `model:/path`."""

    name: str
    arg: str | None = None
    options: dict[str, str] = field(default_factory=dict)
    text: str = ""
    # Where a drafter that runs a model of its own puts it (--draft-device); an explicit
    # `device=` option wins. Drafters without a model of their own ignore it.
    device: str | None = None

    @classmethod
    def parse(cls, text: str) -> DrafterSpec:
        text = text.strip()
        parts = text.split(":")
        name, args, options = parts[0], [], {}
        for part in parts[1:]:
            key, eq, value = part.partition("=")
            if eq and key.isidentifier():
                options[key] = value
            else:
                args.append(part)
        if not name:
            raise SpecdecError(f"empty drafter name in {text!r}", "drafter")
        return cls(name, ":".join(args) or None, options, text)


# A factory builds a drafter from its spec and the loaded target (for tokenizer checks or
# shared weights).
DrafterFactory = Callable[[DrafterSpec, object], Drafter]
REGISTRY: Registry[DrafterFactory] = Registry(
    "drafter", __name__,
    ("none", "ngram", "draft_model", "layerskip", "eagle", "suffix", "retrieval", "hybrid", "random_tokens"),
    "drafter",
)
register, available = REGISTRY.register, REGISTRY.available


def make_drafter(spec: str | DrafterSpec, target: object, device: str | None = None) -> Drafter:
    """Build a drafter from a method string. Engine-level options (like `k`) are ignored here.
    `device` places a drafter's own model (the draft on cpu while the target is on cuda)."""
    parsed = spec if isinstance(spec, DrafterSpec) else DrafterSpec.parse(spec)
    if device is not None:
        parsed.device = device
    return REGISTRY.lookup(parsed.name)(parsed, target)
