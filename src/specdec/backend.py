"""Model backends: a causal LM with a KV cache that can be rolled back.

A backend holds one sequence. `forward` appends tokens to the cache and returns one
next-token logit row per input token; `rollback` truncates the cache to an earlier length.
Speculative decoding relies on rollback, so every backend must implement and test it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ModelBackend(Protocol):
    vocab_size: int
    max_length: int  # context window in tokens

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        ...

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        """Reset the cache, feed `token_ids`; return logits [len(token_ids) - keep, V], or only
        the last row [1, V] with all_logits=False (skips the LM head over a long prompt).
        With keep > 0 the first `keep` tokens stay cached from an earlier prefill (see
        `cached_prefix`) and only the rest is fed."""
        ...

    def cached_prefix(self, token_ids: list[int]) -> int:
        """How many leading `token_ids` this cache holds from earlier prefills: the `keep`
        a prefill of `token_ids` may pass."""
        ...

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        """Append `token_ids` after the cached ones; return logits [len(token_ids), V].

        Row i is the next-token distribution after token i, so k drafts plus the pending
        token give the k+1 distributions verification needs.
        """
        ...

    def rollback(self, length: int) -> None:
        """Truncate the cache to its first `length` tokens."""
        ...


PREFILL_CHUNK = 128  # prompts are fed in chunks that start at multiples of this position


def prefill_chunks(token_ids: list[int], start: int) -> list[list[int]]:
    """Split the tokens that go at positions start.. into chunks cut at multiples of
    PREFILL_CHUNK. Chunk boundaries depend on positions only, so a prompt's keys and values
    come out of the same passes whether it is prefilled cold or after a cached prefix."""
    chunks, pos, i = [], start, 0
    while i < len(token_ids):
        n = PREFILL_CHUNK - pos % PREFILL_CHUNK
        chunks.append(list(token_ids[i : i + n]))
        i, pos = i + n, pos + n
    return chunks


class PrefixCache:
    """Remembers which cached tokens came from prefills, so that a later prompt starting with
    them keeps their keys and values and prefills only the rest: prefix caching with one
    entry per KV cache. Multi-turn agents resend their conversation and share system prompts
    and tool lists, so most of a prompt is usually cached already.

    Reuse changes no bits: only prefilled tokens count (not decoded ones, which a drafter's
    chunks computed), the kept prefix ends at a chunk boundary, and prefills cut their chunks
    at fixed positions (`prefill_chunks`), so a prompt's keys and values are those of a cold
    prefill whatever the cache held before.

    With `reuse_decoded` set (`--prefix-cache decoded`), a finished request's answer counts
    too (`mark_decoded`): the next turn of a conversation skips re-reading the answer, as
    vLLM's and SGLang's prefix caches do. A prompt that shares only cold-prefilled tokens
    with the cache is kept as above, bit-exact; one that reaches into the decoded answer keeps
    all it shares, and then reads keys written by decode steps, so a warm conversation may
    continue differently from a cold one. Speculative and plain decoding still agree: the
    native backend writes a decoded token's keys with the same bits whether it was scored
    alone, among drafts or in a tree, and a request ends with its cache holding exactly the
    tokens plain decoding would have fed.
    """

    reuse_decoded = False

    def _init_prefix(self) -> None:
        self._prefilled: list[int] = []  # the cache's first tokens, written by prefills (or marked)
        self._cold = 0  # how many of them hold the bits of a cold prefill
        self._prefilled_hidden = False  # whether their hidden states were kept too

    def cached_prefix(self, token_ids: list[int]) -> int:
        if self.keep_hidden and not self._prefilled_hidden:
            return 0  # a drafter needs features that the cached prefix did not keep
        n, cached = 0, self._prefilled
        for a, b in zip(cached, token_ids, strict=False):
            if a != b:
                break
            n += 1
        if self.reuse_decoded and n > self._cold:
            return n  # it reaches into a decoded answer: keep all of it
        return n - n % PREFILL_CHUNK

    def mark_decoded(self, token_ids: list[int]) -> None:
        """Record that the cache holds exactly `token_ids` (a finished request's prompt and
        answer, all but its last token); with `reuse_decoded`, later prompts may keep them."""
        if self.reuse_decoded and self.length == len(token_ids) and self._prefilled == list(token_ids[: len(self._prefilled)]):
            self._prefilled = list(token_ids)

    def _start_prefill(self, token_ids: list[int], keep: int) -> list[int]:
        """Roll back to `keep` cached tokens (or reset); return the tokens left to feed."""
        if keep:
            off_grid = keep % PREFILL_CHUNK and not (self.reuse_decoded and keep > self._cold)
            if off_grid or keep > len(self._prefilled) or self._prefilled[:keep] != list(token_ids[:keep]):
                self.reset()
                raise ValueError(f"keep={keep}: the cache does not hold these tokens up to a chunk boundary")
            cold = self._cold
            self.rollback(keep)
            # the rest is prefilled on the chunk grid: cold bits too, if what it follows has them
            self._cold = len(token_ids) if keep <= cold and keep % PREFILL_CHUNK == 0 else min(keep, cold)
        else:
            self.reset()
            self._cold = len(token_ids)
        self._prefilled_hidden = self.keep_hidden and (self._prefilled_hidden or not keep)
        self._prefilled = list(token_ids)  # written once the caller's forward has run
        return list(token_ids[keep:])

    def _drop_prefix(self, length: int) -> None:  # after rollback(length) or reset()
        del self._prefilled[length:]
        self._cold = min(self._cold, length)

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        """Reset (or keep `keep` cached tokens) and feed the rest of `token_ids` chunk by chunk;
        logits [T, V], or with all_logits=False only [1, V] of the last token, which skips the
        LM head for the rest of a long prompt."""
        rest = self._start_prefill(token_ids, keep)
        try:
            logits = [self._prefill_chunk(chunk, not all_logits) for chunk in prefill_chunks(rest, keep)]
        except BaseException:
            self.reset()  # a half-written prefix must not be reused
            raise
        if not logits:
            return torch.empty(0, self.vocab_size)
        return torch.cat(logits) if all_logits else logits[-1]

    def _prefill_chunk(self, chunk: list[int], last_only: bool) -> torch.Tensor:
        raise NotImplementedError


class HFBackend(PrefixCache):
    """A transformers causal LM over a DynamicCache; rollback is `DynamicCache.crop`."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.device = next(model.parameters()).device
        self._length = 0
        self._tree_base: int | None = None  # cache length before a forward_tree awaiting keep()
        # Opt-in (set by the eagle drafter): keep the final post-norm hidden state of every
        # cached token, in a buffer that rolls back with the cache.
        self.keep_hidden = False
        self._init_prefix()
        self.reset()
        self.last_hidden: torch.Tensor | None = None  # [T, H] of the last forward, for drafters
        self._hidden: torch.Tensor | None = None  # [capacity, H]

    @property
    def hidden(self) -> torch.Tensor | None:
        """[length, H] features of the cached tokens, when `keep_hidden` is set."""
        return self._hidden[: self._length] if self.keep_hidden and self._hidden is not None else None

    def _store_hidden(self, rows: torch.Tensor) -> None:  # rows: [T, H] for positions length..length+T-1
        end = self._length + rows.shape[0]
        if self._hidden is None or self._hidden.shape[0] < end:
            grown = torch.empty(max(end, 2 * (0 if self._hidden is None else self._hidden.shape[0]), 256),
                                rows.shape[1], dtype=rows.dtype, device=rows.device)
            if self._hidden is not None:
                grown[: self._length] = self._hidden[: self._length]
            self._hidden = grown
        self._hidden[self._length : end] = rows
        self.last_hidden = rows

    @property
    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self._tree_base = None
        self._cache = self._cache_cls(config=self.model.config)
        # Sliding-window layers keep their full past until `crop`, so rollback stays possible.
        if hasattr(self._cache, "activate_past_recording"):
            self._cache.activate_past_recording()
        self._length = 0
        self._drop_prefix(0)

    def _prefill_chunk(self, chunk: list[int], last_only: bool) -> torch.Tensor:
        return self.forward(chunk, last_only=last_only)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
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
            output_hidden_states=self.keep_hidden,
            logits_to_keep=1 if last_only else 0,
        )
        if self.keep_hidden:
            self._store_hidden(out.hidden_states[-1][0])
        self._length += len(token_ids)
        return out.logits[0].float().cpu()

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._cache.crop(length - self._length)  # a negative count removes that many tokens
        self._length = length
        self._tree_base = None
        self._drop_prefix(length)

    @property
    def supports_tree(self) -> bool:
        """Tree attention needs a custom 4D mask: only full-attention DynamicLayers under
        eager or SDPA attention accept one (sliding-window layers slice their keys)."""
        from transformers.cache_utils import DynamicLayer

        attn = getattr(self.model.config, "_attn_implementation", "eager")
        layers = getattr(self._cache, "layers", [])
        return attn in ("eager", "sdpa") and bool(layers) and all(type(x) is DynamicLayer for x in layers)

    @torch.inference_mode()
    def forward_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Append a token tree; return logits [T, V]. Token i sits at position length + depth(i)
        and attends to the whole cache, its ancestors and itself. Follow with `keep`."""
        from .tree import ancestor_mask, check_tree, tree_depths

        check_tree(parents)
        n = len(token_ids)
        if n != len(parents) or n == 0:
            raise ValueError("forward_tree needs one parent per token and at least one token")
        if self._length + n > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {n} > {self.max_length}")
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
            output_hidden_states=self.keep_hidden,
        )
        if self.keep_hidden:
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
        if self.keep_hidden and self._hidden is not None:
            self._hidden[base:end] = self._hidden[rows]  # [len(indices), H]
        self._length, self._tree_base = end, None


def forward_batch(sequences: list[ModelBackend], token_lists: list[list[int]]) -> list[torch.Tensor]:
    """One scoring pass for several sequences: returns logits [len(tokens_i), V] for each.

    Backends whose sequences share a batched pool (attribute `pool` with `forward_batch`)
    run one batched forward; others fall back to one forward per sequence.
    """
    pool = getattr(sequences[0], "pool", None) if sequences else None
    if pool is not None and all(getattr(s, "pool", None) is pool for s in sequences):
        return pool.forward_batch(sequences, token_lists)
    return [seq.forward(tokens) for seq, tokens in zip(sequences, token_lists, strict=True)]


BACKENDS = ("hf", "native")


def make_backend(kind: str, target, **options) -> ModelBackend:
    """A fresh backend (its own KV cache) over the loaded target's weights.

    Options (None values are ignored): native takes precision (fp32|bf16|int8|int4), device,
    max_length and slots; hf takes none.
    """
    from .errors import SpecdecError

    options = {key: value for key, value in options.items() if value is not None}
    if kind == "hf":
        if options:
            raise SpecdecError(f"the hf backend takes no options, got {', '.join(options)}", "backend")
        return HFBackend(target.model)
    if kind == "native":
        from .native import NATIVE_OPTIONS, make_native_backend

        unknown = sorted(set(options) - set(NATIVE_OPTIONS))
        if unknown:
            raise SpecdecError(
                f"unknown native backend option(s) {', '.join(unknown)}; known: {', '.join(NATIVE_OPTIONS)}",
                "backend",
            )
        return make_native_backend(target, **options)
    raise SpecdecError(f"unknown backend {kind!r}; choose one of: {', '.join(BACKENDS)}", "backend")
