"""The transformers backend: a causal LM over a DynamicCache; rollback is `DynamicCache.crop`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specdec.backends import SlotPool, register
from specdec.backends.native.model.draft_head import NativeDraftHead
from specdec.backends.prefix_cache import PrefixCache, chunked_prefill
from specdec.errors import SpecdecError
from specdec.tree import ancestor_mask, check_tree, tree_depths


class HFBackend:
    """A transformers causal LM over a DynamicCache; rollback is `DynamicCache.crop`.
    Implements `Backend`; sequences are scored one forward each (no pool)."""

    def __init__(self, model: torch.nn.Module, prefix_cache: str = "prompt"):
        self.model = model.eval()
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self.prefix_cache = PrefixCache(prefix_cache)
        self._length = 0
        self._tree_base: int | None = None  # cache length before a forward_tree awaiting keep()
        # Off until enable_hidden_states: the final post-norm hidden state of every cached
        # token, in a buffer that rolls back with the cache.
        self._keep_hidden = False
        self._hidden: torch.Tensor | None = None  # [capacity, H]
        self.reset()

    @property
    def pool(self) -> SlotPool | None:
        return None

    @property
    def compile_seconds(self) -> float:
        return 0.0

    def enable_hidden_states(self) -> None:
        self._keep_hidden = True
        self.prefix_cache.require_hidden()

    def feature_model(self) -> HFFeatures:
        return HFFeatures(self.model)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self._hidden[: self._length] if self._keep_hidden and self._hidden is not None else None

    def _store_hidden(self, rows: torch.Tensor) -> None:  # rows: [T, H] for positions length..length+T-1
        end = self._length + rows.shape[0]
        if self._hidden is None or self._hidden.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if self._hidden is None else self._hidden.shape[0]), 256),
                                rows.shape[1], dtype=rows.dtype, device=rows.device)
            if self._hidden is not None:
                grown[: self._length] = self._hidden[: self._length]
            self._hidden = grown
        self._hidden[self._length : end] = rows

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._tree_base = None
        self._cache = DynamicCache(config=self.model.config)
        # Sliding-window layers keep their full past until `crop`, so rollback stays possible.
        if hasattr(self._cache, "activate_past_recording"):
            self._cache.activate_past_recording()
        self._length = 0
        self.prefix_cache.truncate(0)

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        return chunked_prefill(self, self._prefill_chunk, token_ids, all_logits, keep)

    def _prefill_chunk(self, chunks: list[list[int]], last_only: bool) -> torch.Tensor:
        (chunk,) = chunks  # chunked_prefill's default: one chunk a call
        return self.forward(chunk, last_only=last_only)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], unscored: list[int] | tuple = (), *,
                last_only: bool = False) -> torch.Tensor:
        # `unscored` rows are scored anyway: transformers' forward computes every row's logits
        if not token_ids:
            return torch.empty(0, self.vocab_size)
        if self._length + len(token_ids) > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {len(token_ids)} > {self.max_length}")
        if self._tree_base is not None:
            raise ValueError("call keep() or rollback() after forward_tree before appending")
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        positions = torch.arange(self._length, self._length + len(token_ids), device=self.device)
        out = self.model(
            input_ids=input_ids,
            cache=self._cache,
            use_cache=True,
            cache_position=positions,
            position_ids=positions.unsqueeze(0),
            output_hidden_states=self._keep_hidden,
            logits_to_keep=1 if last_only else 0,
        )
        if self._keep_hidden:
            self._store_hidden(out.hidden_states[-1][0])
        self._length += len(token_ids)
        return out.logits[0].float().cpu()

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._cache.crop(length - self._length)  # a negative count removes that many tokens
        self._length = length
        self._tree_base = None
        self.prefix_cache.truncate(length)

    @property
    def supports_tree(self) -> bool:
        """Tree attention needs a custom 4D mask: only full-attention DynamicLayers under
        eager or SDPA attention accept one (sliding-window layers slice their keys)."""
        attn = getattr(self.model.config, "_attn_implementation", "eager")
        layers = getattr(self._cache, "layers", [])
        return attn in ("eager", "sdpa") and bool(layers) and all(type(x) is DynamicLayer for x in layers)

    @torch.inference_mode()
    def forward_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Append a token tree; return logits [T, V]. Token i sits at position length + depth(i)
        and attends to the whole cache, its ancestors and itself. Follow with `keep`."""
        check_tree(parents)
        n = len(token_ids)
        if n != len(parents) or n == 0:
            raise ValueError("forward_tree needs one parent per token and at least one token")
        if self._length + n > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {n} > {self.max_length}")
        if not self.supports_tree:
            raise ValueError("this model's cache or attention takes no tree mask; "
                             "token trees need full attention")
        if self._tree_base is not None:
            raise ValueError("call keep() or rollback() after forward_tree before appending")
        dtype = self.model.get_input_embeddings().weight.dtype
        allowed = torch.ones(n, self._length + n, dtype=torch.bool, device=self.device)  # [T, cache+T]
        allowed[:, self._length :] = ancestor_mask(parents).to(self.device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)  # additive: eager and SDPA both take it
        depths = torch.tensor(tree_depths(parents), dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=torch.tensor([token_ids], dtype=torch.long, device=self.device),
            attention_mask=mask[None, None],  # [1, 1, T, cache+T]
            position_ids=(self._length + depths).unsqueeze(0),
            cache=self._cache,
            use_cache=True,
            output_hidden_states=self._keep_hidden,
        )
        if self._keep_hidden:
            self._store_hidden(out.hidden_states[-1][0])  # rows for slots length..length+n-1
        self._tree_base, self._length = self._length, self._length + n
        return out.logits[0].float().cpu()

    @torch.inference_mode()
    def keep(self, indices: list[int]) -> None:
        """After `forward_tree`, keep only the tree nodes `indices` (a root-to-leaf path)."""
        base = self._tree_base
        if base is None:
            raise ValueError("keep() follows forward_tree()")
        if any(not 0 <= i < self._length - base for i in indices) or indices != sorted(set(indices)):
            raise ValueError(f"indices {indices} are not a root-to-leaf path of the tree")
        rows = torch.tensor(indices, dtype=torch.long, device=self.device) + base
        end = base + len(indices)
        for layer in self._cache.layers:
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # [B, H, length, D]
                kv[:, :, base:end] = kv[:, :, rows]  # the gather copies first
                setattr(layer, name, kv[:, :, :end])
        if self._keep_hidden and self._hidden is not None:
            self._hidden[base:end] = self._hidden[rows]  # [len(indices), H]
        self._length, self._tree_base = end, None


@dataclass(frozen=True)
class HFFeatures:
    """The transformers backend's `FeatureModel`: its model's own modules; the draft head runs
    on the native layer kernels (native/draft_head.py), which need nothing but torch."""

    model: torch.nn.Module

    @property
    def hidden_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def softcap(self) -> float | None:
        config = self.model.config
        return getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                       "final_logit_softcapping", None)

    @torch.inference_mode()
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(token_ids).float()  # Gemma's module scales its rows

    @torch.inference_mode()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        logits = self.model.get_output_embeddings()(features).float()
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def draft_head(self, state: dict[str, torch.Tensor], dims: dict, vocab_ids: torch.Tensor | None,
                   precision: str | None = None) -> NativeDraftHead:
        weight = self.model.get_output_embeddings().weight
        rows = None if vocab_ids is None else weight[vocab_ids.to(weight.device)].detach()
        return NativeDraftHead(state, dims, precision, weight.device, self.logits, rows, self.softcap)


@register("hf")
def make_hf_backend(target, prefix_cache: str = "prompt", **options) -> HFBackend:
    if options:
        raise SpecdecError(f"the hf backend takes no options, got {', '.join(sorted(options))}", "backend")
    return HFBackend(target.model, prefix_cache)
