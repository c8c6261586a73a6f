"""The native backend's KV cache: a preallocated pool of slots, and one sequence per slot.

- `CachePool` owns the KV cache of several sequences, preallocated once as
  [layers, slots, kv_heads, max_length, head_dim]. A slot is one sequence; tokens are stored
  by position, so rollback is moving the length pointer.
- `NativeSequence` is one slot; it implements the `Backend` protocol (the pool is its
  `SlotPool`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.backends.native.attention import new_cache, plan_chain, plan_tree, uses_kernel
from specdec.backends.native.draft_head import NativeFeatures
from specdec.backends.native.layer import DECODE_ATTENTION_MAX, KVRow
from specdec.backends.prefix_cache import PrefixCache, chunked_prefill, prefix_cache_mode
from specdec.errors import SpecdecError
from specdec.tree import check_tree, depth_first, tree_depths

if TYPE_CHECKING:
    from specdec.backends.native.model import NativeModel

DEFAULT_MAX_LENGTH = 4096
COMPILE_BUCKETS = (1, 2, 3, 4, 8, 16, 32)  # token counts the compiled forward is traced for


class CachePool:
    """A preallocated KV cache for `slots` sequences of up to `max_length` tokens each; every
    sequence's prefix cache runs in mode `prefix_cache`."""

    def __init__(self, model: NativeModel, slots: int = 1, max_length: int | None = None, kv_dtype=torch.float32,
                 prefix_cache: str = "prompt"):
        cfg = model.config
        if slots < 1:
            raise SpecdecError(f"a cache pool needs at least one slot, got {slots}", "slots")
        max_length = max_length or min(cfg.max_positions, DEFAULT_MAX_LENGTH)
        if not 1 <= max_length <= cfg.max_positions:
            raise SpecdecError(f"max_length must be in 1..{cfg.max_positions}, got {max_length}", "max_length")
        self.model, self.slots, self.max_length = model, slots, max_length
        # keys [layers, slots, kv_heads, head_dim, length], values [layers, slots, kv_heads, length,
        # head_dim + 1], in whole attention chunks (attention.py)
        self.k, self.v = new_cache((cfg.num_layers, slots), cfg.num_kv_heads, max_length, cfg.head_dim, kv_dtype,
                                   model.device)  # fmt: skip
        self.layer_caches = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))  # views, made once
        self.kernel = uses_kernel(model.device, kv_dtype)  # jit_ops, or the PyTorch routine
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per kv head
        self.cos, self.sin = model.rope_tables(max_length)  # [max_length, head_dim]
        self.local_cos, self.local_sin = model.rope_tables(max_length, local=True)  # gemma3's sliding layers
        self._free = list(range(slots - 1, -1, -1))
        self.prefix_mode = prefix_cache_mode(prefix_cache)
        self._hidden: torch.Tensor | None = None  # see hidden_buffer

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def new_sequence(self) -> NativeSequence:
        if not self._free:
            raise SpecdecError(f"all {self.slots} cache slots are in use", "slots")
        return NativeSequence(self, self._free.pop(), self.prefix_mode)

    def release(self, seq: NativeSequence) -> None:
        if seq.pool is not self or seq.slot is None:
            raise ValueError("this sequence does not hold a slot of this pool")
        self._free.append(seq.slot)
        seq.slot = None

    def forward_batch(self, sequences: list[NativeSequence], token_lists: list[list[int]],
                      unscored: list[list[int]] | None = None, last_only: bool = False,
                      prompt: bool = False) -> list[torch.Tensor]:
        """One packed forward that appends token_lists[i] to sequences[i]; logits [len_i, V]
        each, or with `last_only` just the last row [1, V] ([0, V] for an empty list). Rows
        unscored[i] of sequence i come back as zeros, the LM head skipped for them, where the
        head computes each row on its own (`head_rows_independent`); elsewhere all are scored.

        Lists of more than DECODE_ATTENTION_MAX tokens, or all of them with `prompt`, are
        prompt chunks: one causal pass each, through the dense layers where there are some.
        Shorter lists are decode chains, scored by the batch-invariant attention (attention.py)."""
        if len(sequences) != len(token_lists):
            raise ValueError("one token list per sequence")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one batch")
        for seq, ids in zip(sequences, token_lists, strict=True):
            seq._check_append(len(ids))  # all checked before any is changed
        is_prompt = [prompt or len(ids) > DECODE_ATTENTION_MAX for ids in token_lists]
        if any(is_prompt) and not all(p or not ids for p, ids in zip(is_prompt, token_lists, strict=True)):
            # prompts and steps in two passes, so that no step's logits depend on its batch
            out: list = [None] * len(sequences)
            for kind in (True, False):
                idx = [i for i, p in enumerate(is_prompt) if p == kind]
                part = self.forward_batch([sequences[i] for i in idx], [token_lists[i] for i in idx],
                                          [unscored[i] for i in idx] if unscored else None, last_only, kind)
                for i, logits in zip(idx, part, strict=True):
                    out[i] = logits
            return out
        if not self.model.head_rows_independent:
            unscored = None
        dense = any(is_prompt)  # only prompts (and empty lists) here
        compiled = self.model.compiled and not dense
        if compiled and len(sequences) > 1:
            # Inductor fuses norms and rotations with its own rounding, so a compiled step and
            # an eager one differ in the last bits. Every decode forward of a compiled model
            # therefore runs through the compiled graph, one sequence at a time, so that no
            # reply depends on what it was batched with.
            return [self.forward_batch([seq], [ids], [unscored[i]] if unscored else None, last_only)[0]
                    for i, (seq, ids) in enumerate(zip(sequences, token_lists, strict=True))]
        tokens, positions, rows, lasts, scored = self._pack(sequences, token_lists, unscored, compiled, dense)
        partial = not last_only and len(scored) < len(tokens)
        hidden, logits = self._run(tokens, positions, rows, compiled, lasts if last_only else scored if partial else None,
                                   dense)  # fmt: skip
        if partial:  # the unscored rows stay zeros
            logits = logits.new_zeros(len(tokens), logits.shape[-1]).index_copy_(0, torch.tensor(scored, dtype=torch.long), logits)
        out, offset, row = [], 0, 0
        for seq, ids in zip(sequences, token_lists, strict=True):
            end = offset + len(ids)
            if last_only:
                out.append(logits[row : row + 1] if ids else logits[:0])
                row += bool(ids)
            else:
                out.append(logits[offset:end])
            seq._store_hidden(seq._length, hidden[offset:end])
            seq._length, offset = seq._length + len(ids), end
        return out

    def forward_prompt(self, seq: NativeSequence, chunks: list[list[int]], last_only: bool = False) -> torch.Tensor:
        """A prompt's consecutive chunks in one pass: each chunk a causal row of its own, so its
        attention is that of a pass per chunk, and the layers' kernels over all their tokens at
        once (a prompt kernel computes each row on its own, so a chunk's bits do not depend on
        its neighbours; the tests compare the two). A prompt kernel that decodes weight tiles
        then decodes each tile once per group, not once per chunk. A chunk of fewer than the
        model's `short_chunk_rows` tokens takes the decode kernels instead (cheaper for a few
        rows than decoding every tile); the choice depends on the chunk alone, so a warm
        prefill still gives a cold one's bits. Logits [T, V], or [1, V]."""
        seq._check_append(sum(len(chunk) for chunk in chunks))
        if not any(chunks):
            return torch.empty(0, self.model.config.vocab_size)
        parts, logits = _runs_of(chunks, self.model.short_chunk_rows), []
        for i, (short, part) in enumerate(parts):
            last = i == len(parts) - 1
            logits.append(self._prompt_part(seq, part, short, last_only, last))
        return logits[-1] if last_only else torch.cat(logits)

    def _prompt_part(self, seq: NativeSequence, chunks: list[list[int]], short: bool, last_only: bool,
                     last: bool) -> torch.Tensor:  # fmt: skip
        """Consecutive chunks of one kind (short or not) appended to `seq`: logits [T, V], or
        with `last_only` [1, V] for the prompt's last part and [0, V] (no head) before it."""
        start, tokens, positions, rows = seq._length, [], [], []
        for chunk in chunks:
            rows.append(self._row(seq.slot, len(tokens), start + len(tokens), len(chunk), dense=True))
            tokens.extend(chunk)
            positions.extend(range(start + len(tokens) - len(chunk), start + len(tokens)))
        logits_at = None if not last_only else [len(tokens) - 1] if last else []
        hidden, logits = self._run(tokens, positions, rows, False, logits_at, dense=not short)
        seq._store_hidden(start, hidden)
        seq._length = start + len(tokens)
        return logits

    def _pack(self, sequences, token_lists, unscored, compiled: bool, dense: bool) -> tuple:
        """The packed tokens, their positions, each sequence's KVRow, each one's last packed
        row, and the packed rows whose logits are wanted (all but the unscored and the pads)."""
        tokens, positions, rows, lasts, scored = [], [], [], [], []
        for i, (seq, ids) in enumerate(zip(sequences, token_lists, strict=True)):
            start, t = seq._check_append(len(ids)), len(ids)
            if t == 0:
                continue
            lasts.append(len(tokens) + t - 1)
            skip = set(unscored[i]) if unscored else ()
            scored.extend(len(tokens) + j for j in range(t) if j not in skip)
            if compiled:  # pad to a bucket so a few compiled shapes serve every k; pads come last
                t = next((b for b in COMPILE_BUCKETS if b >= t and start + b <= self.max_length), t)
                ids = list(ids) + [ids[-1]] * (t - len(ids))
            tokens.extend(ids)
            positions.extend(range(start, start + t))
            rows.append(self._row(seq.slot, len(tokens) - t, start, t, dense))
        return tokens, positions, rows, lasts, scored

    def _row(self, slot: int, first: int, start: int, t: int, dense: bool) -> KVRow:
        """Packed rows first.. of a sequence whose t tokens go to cache positions start..."""
        if dense:  # a prompt chunk: one causal pass
            mask = torch.ones(t, start + t, dtype=torch.bool, device=self.model.device).tril(start)
            return KVRow(slot, first, first + t, start, start + t, mask)
        # a decode chain: batch-invariant attention, bit-identical to one-token steps
        plan = plan_chain(start + t, t, self.group, self.model.device, self.kernel)
        return KVRow(slot, first, first + t, start, start + t, None, plan=plan)

    def _run(self, tokens, positions, rows, compiled=False, logits_at=None, dense=False) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] on the model's device, logits [N, V] on the cpu."""
        cfg, dev = self.model.config, self.model.device
        if not tokens:
            return torch.empty(0, cfg.hidden_size, device=dev), torch.empty(0, cfg.vocab_size)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)

        at = None if logits_at is None else as_tensor(logits_at)
        hidden, logits = self.model.forward_packed(
            self, as_tensor(tokens), as_tensor(positions), rows, at, compiled, dense)
        return hidden, logits.cpu()

    def hidden_buffer(self) -> torch.Tensor:
        """[slots, max_length, hidden] post-norm features of cached tokens, allocated on first use."""
        if self._hidden is None:
            cfg = self.model.config
            self._hidden = torch.zeros(self.slots, self.max_length, cfg.hidden_size, device=self.model.device)
        return self._hidden


class NativeSequence:
    """One cache slot of a pool; implements `Backend`."""

    def __init__(self, pool: CachePool, slot: int, prefix_cache: str = "prompt"):
        self.pool, self.slot = pool, slot
        self.vocab_size = pool.model.config.vocab_size
        self.max_length = pool.max_length
        self.device = pool.model.device
        self.prefix_cache = PrefixCache(prefix_cache)
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

    def reset(self) -> None:
        self._length, self._tree = 0, None
        self.prefix_cache.truncate(0)

    def prefill(self, token_ids: list[int], all_logits: bool = True, keep: int = 0) -> torch.Tensor:
        return chunked_prefill(self, self._prefill_chunks, token_ids, all_logits, keep, self.pool.model.prompt_group_tokens)

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
            raise ValueError("a compiled native model scores token trees only with the numba attention kernel "
                             "(pip install 'specdec[cpu]'); use compile=0")
        base = self._check_append(t)
        if t == 0:
            return torch.empty(0, self.vocab_size)
        compiled = self.pool.model.compiled
        if compiled:  # pad to a bucket with extra roots, as chains are padded; keep() never picks them
            padded = next((b for b in COMPILE_BUCKETS if b >= t), t)
            token_ids, parents = list(token_ids) + [token_ids[-1]] * (padded - t), list(parents) + [-1] * (padded - t)
        depths = tree_depths(parents)
        row = KVRow(self.slot, 0, len(parents), base, base + len(parents), None, tree=(depth_first(parents), depths),
                    tree_kv=[], plan=plan_tree(base, parents, depths, self.pool.group, self.device, self.pool.kernel))
        hidden, logits = self.pool._run(list(token_ids), [base + d for d in depths], [row], compiled)
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
        end = base + len(indices)
        for layer, (k_nodes, v_nodes) in enumerate(tree_kv):  # [T, kv_heads, dim] each
            self.pool.k[layer, self.slot, :, :, base:end] = k_nodes.index_select(0, path).permute(1, 2, 0)
            self.pool.v[layer, self.slot, :, base:end, :-1] = v_nodes.index_select(0, path).transpose(0, 1)
        if indices != list(range(len(indices))):
            src = path + base
            if self._keep_hidden:
                rows = self.pool.hidden_buffer()[self.slot]  # [max_length, hidden]
                rows[base : base + len(indices)] = rows.index_select(0, src)
        self._length, self._tree = base + len(indices), None


def _runs_of(chunks: list[list[int]], short_rows: int) -> list[tuple[bool, list[list[int]]]]:
    """Consecutive non-empty chunks split where their kind changes: (short, chunks), short
    meaning fewer than `short_rows` tokens."""
    runs: list[tuple[bool, list[list[int]]]] = []
    for chunk in chunks:
        if not chunk:
            continue
        short = len(chunk) < short_rows
        if runs and runs[-1][0] == short:
            runs[-1][1].append(chunk)
        else:
            runs.append((short, [chunk]))
    return runs
