"""One sequence of the native backend: a slot of a `CachePool`, implementing the `Backend`
protocol (backends/__init__.py). Its tokens live in the pool's cache by position, so rollback
moves a length; a token tree keeps its nodes' keys and values until `keep` compacts the chosen
path. The pool it runs on is described by `SequencePool`, what this module uses of it."""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.backends.native.kernels.attention import plan_tree
from specdec.backends.native.kernels.kv_layout import keys_at, store_keys, store_values
from specdec.backends.native.model.config import KVRow
from specdec.backends.native.model.draft_head import HeadSource, NativeFeatures
from specdec.backends.prefix_cache import PrefixCache, chunked_prefill
from specdec.tree import check_tree, depth_first, tree_depths

COMPILE_BUCKETS = (1, 2, 3, 4, 8, 16, 32)  # token counts the compiled forward is traced for


class PooledModel(HeadSource, Protocol):
    """What a sequence reads of the model its pool runs."""

    compiled: bool
    compile_seconds: float
    prompt_group_tokens: int | None
    prompts_as_steps: bool  # its decode layers may run prompts, each row with a one-token step's bits


class SequencePool(Protocol):
    """What a sequence uses of its pool (model/batch_runner.CachePool implements it)."""

    model: PooledModel
    max_length: int
    kernel: bool  # attention runs on the numba kernel
    group: int  # query heads per kv head
    prompts_as_steps: bool  # prompt chunks run as decode chains (CachePool.prompts_as_steps)
    k: torch.Tensor  # [layers, slots, kv_heads, length / 16, dim, 16]: blocks of 16 keys
    v: torch.Tensor  # [layers, slots, kv_heads, length, dim + 1]

    def hidden_buffer(self) -> torch.Tensor: ...

    def reserve(self, slot: int, length: int) -> None: ...

    def clear(self, slot: int) -> None: ...

    def forward_batch(self, sequences: list, token_lists: list[list[int]],
                      unscored: list[list[int]] | None = None, last_only: bool = False,
                      prompt: bool = False) -> list[torch.Tensor]: ...

    def forward_prompt(self, seq, chunks: list[list[int]], last_only: bool = False) -> torch.Tensor: ...

    def run_rows(self, tokens: list[int], positions: list[int], rows: list[KVRow],
                 compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...


class NativeSequence:
    """One cache slot of a pool; implements `Backend`."""

    def __init__(self, pool: SequencePool, slot: int, prefix_cache: str = "prompt"):
        self.pool, self.slot = pool, slot
        self.vocab_size = pool.model.config.vocab_size
        self.max_length = pool.max_length
        self.device = pool.model.device
        self.prefix_cache = PrefixCache(prefix_cache, steps_exact=lambda: pool.prompts_as_steps)
        self._length = 0
        self._tree: tuple[int, list[int]] | None = None  # (length before the tree, parents)
        # Off until enable_hidden_states: `hidden` then holds the final post-norm hidden state
        # of every cached token and rolls back with the cache.
        self._keep_hidden = False

    @property
    def length(self) -> int:
        return self._length

    @property
    def supports_tree(self) -> bool:
        # a compiled model's decode steps must all be compiled (so that it agrees with itself):
        # its trees run the compiled layers around the kernel's attention (attention.attend_op)
        return not self.pool.model.compiled or self.pool.kernel

    @property
    def compile_seconds(self) -> float:
        return float(self.pool.model.compile_seconds) if self.pool.model.compiled else 0.0

    def enable_hidden_states(self) -> None:
        self._keep_hidden = True
        self.prefix_cache.require_hidden()

    def feature_model(self) -> NativeFeatures:
        return NativeFeatures(self.pool.model)

    @property
    def hidden(self) -> torch.Tensor | None:
        if not self._keep_hidden or self.slot is None:
            return None
        return self.pool.hidden_buffer()[self.slot, : self._length]

    def _store_hidden(self, start: int, rows: torch.Tensor) -> None:  # rows: [T, hidden]
        if self._keep_hidden:
            self.pool.hidden_buffer()[self.slot, start : start + rows.shape[0]] = rows

    def adopt(self, source: NativeSequence, length: int) -> None:
        """Take `source`'s first `length` tokens as this slot's, once the pool has copied their
        keys and values here (CachePool.fork): the length, the prefix record, hidden states."""
        self._length, self._tree = length, None
        self.prefix_cache.adopt(source.prefix_cache, length)
        hidden = source.hidden  # None unless the source keeps hidden states
        if hidden is not None:
            self.enable_hidden_states()
            self._store_hidden(0, hidden[:length])

    def reset(self) -> None:
        self._length, self._tree = 0, None
        self.prefix_cache.truncate(0)
        if self.slot is not None:
            self.pool.clear(self.slot)  # its memory goes back until tokens come again

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        return chunked_prefill(self, self._prefill_chunks, token_ids, all_logits, keep,
                               self.pool.model.prompt_group_tokens)

    def _prefill_chunks(self, chunks: list[list[int]], last_only: bool) -> torch.Tensor:
        return self.pool.forward_prompt(self, chunks, last_only)

    def forward(self, token_ids: list[int], unscored: list[int] | tuple = ()) -> torch.Tensor:
        return self.pool.forward_batch([self], [list(token_ids)], [list(unscored)] if unscored else None)[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._length, self._tree = length, None
        self.prefix_cache.truncate(length)

    def _check_append(self, count: int) -> int:
        if self.slot is None:
            raise ValueError("this sequence was released")
        if self._tree is not None:
            raise ValueError("call keep() or rollback() after forward_tree before appending")
        if self._length + count > self.max_length:
            raise ValueError(f"context overflow: {self._length} + {count} > {self.max_length}")
        self.pool.reserve(self.slot, self._length + count)
        return self._length

    def forward_tree(self, token_ids: list[int], parents: list[int]) -> torch.Tensor:
        """Score a token tree in one forward; returns logits [T, V].

        parents[i] < i is the index of token i's parent, or -1 for a child of the last cached
        token. Token i sits at position length + depth(i) and sees the cache, its ancestors and
        itself. Its keys are stored at length + i until `keep` compacts the chosen path.
        """
        t = len(token_ids)
        if len(parents) != t:
            raise ValueError("one parent per tree token")
        check_tree(parents)
        if not self.supports_tree:
            raise ValueError("a compiled native model scores token trees only with the numba attention "
                             "kernel (pip install 'specdec[cpu]'); use compile=0")
        base = self._check_append(t)
        if t == 0:
            return torch.empty(0, self.vocab_size)
        compiled = self.pool.model.compiled
        if compiled:  # pad to a bucket with extra roots, as chains are padded; keep() never picks them
            padded = next((b for b in COMPILE_BUCKETS if b >= t), t)
            token_ids, parents = (list(token_ids) + [token_ids[-1]] * (padded - t),
                                  list(parents) + [-1] * (padded - t))
        depths = tree_depths(parents)
        row = KVRow(self.slot, 0, len(parents), base, base + len(parents), None,
                    tree=(depth_first(parents), depths), tree_kv=[],
                    plan=plan_tree(base, parents, depths, self.pool.group, self.device, self.pool.kernel))
        hidden, logits = self.pool.run_rows(list(token_ids), [base + d for d in depths], [row], compiled)
        hidden, logits = hidden[:t], logits[:t]
        self._store_hidden(base, hidden)
        self._length, self._tree = base + t, (base, list(parents[:t]), row.tree_kv)
        return logits

    def keep(self, indices: list[int]) -> None:
        """Keep the tree path `indices` (root to leaf, in order) right after the pre-tree cache."""
        if self._tree is None:
            raise ValueError("keep() follows forward_tree()")
        base, parents, tree_kv = self._tree
        for j, node in enumerate(indices):
            if not 0 <= node < len(parents) or parents[node] != (indices[j - 1] if j else -1):
                raise ValueError(f"indices {indices} are not a root-to-leaf path of the tree")
        path = torch.tensor(indices, dtype=torch.long, device=self.device)
        end, src, moved = base + len(indices), path + base, indices != list(range(len(indices)))
        if tree_kv is None and moved:  # the one-call layers wrote node i's keys and values at base + i
            keys = self.pool.k[:, self.slot]
            store_keys(keys, base, keys_at(keys, src))
            self.pool.v[:, self.slot, :, base:end] = self.pool.v[:, self.slot, :, src]
        elif tree_kv is not None:
            for layer, (k_nodes, v_nodes) in enumerate(tree_kv):  # [T, kv_heads, dim] each
                k_path, v_path = (x.index_select(0, path).transpose(0, 1) for x in (k_nodes, v_nodes))
                store_keys(self.pool.k[layer, self.slot], base, k_path)
                store_values(self.pool.v[layer, self.slot], base, v_path)
        if moved and self._keep_hidden:
            rows = self.pool.hidden_buffer()[self.slot]  # [max_length, hidden]
            rows[base : base + len(indices)] = rows.index_select(0, src)
        self._length, self._tree = base + len(indices), None


