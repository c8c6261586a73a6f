"""The native backend's batch runner: `CachePool` owns the KV cache of several sequences,
laid out once as keys [layers, slots, kv_heads, length / 16, head_dim, 16] (blocks of 16 keys)
and values [layers, slots, kv_heads, length, head_dim + 1] over memory that is committed
as tokens are written (model/kv_memory.py), and runs their tokens as
packed forwards of the model (`forward_batch` for decode chains and prompts side by side,
`forward_prompt` for one prompt's chunks). A slot is one sequence (model/sequence.py's
`NativeSequence`); tokens are stored by position, so rollback is moving the length pointer.
What the pool uses of the model is `PackedModel`."""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.backends import KVMemory
from specdec.backends.native.kernels.attention import padded, plan_chain, uses_kernel
from specdec.backends.native.kernels.kv_layout import KEY_TILE, key_blocks
from specdec.backends.native.model.config import DECODE_ATTENTION_MAX, KVRow, NativeConfig
from specdec.backends.native.model.kv_memory import LazyTensor, committed_bytes
from specdec.backends.native.model.sequence import COMPILE_BUCKETS, NativeSequence, PooledModel
from specdec.backends.prefix_cache import prefix_cache_mode
from specdec.errors import SpecdecError

ONES_AHEAD = 256  # value rows given their column of ones this many positions at a time


class PackedModel(PooledModel, Protocol):
    """What a pool runs (model/native_model.NativeModel implements it)."""

    config: NativeConfig
    short_chunk_rows: int  # a prompt chunk shorter than this takes the decode kernels
    head_rows_independent: bool  # the LM head computes each row on its own

    def rope_tables(self, length: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward_packed(self, pool, token_ids: torch.Tensor, positions: torch.Tensor, rows: list[KVRow],
                       logits_at: torch.Tensor | None = None, compiled: bool = False,
                       dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...


class CachePool:
    """A KV cache for `slots` sequences of up to `max_length` tokens each (default: the
    model's window), whose memory is committed as tokens are held; every sequence's prefix
    cache runs in mode `prefix_cache`."""

    def __init__(self, model: PackedModel, slots: int = 1, max_length: int | None = None,
                 kv_dtype=torch.float32, prefix_cache: str = "prompt"):
        cfg = model.config
        if slots < 1:
            raise SpecdecError(f"a cache pool needs at least one slot, got {slots}", "slots")
        max_length = max_length or cfg.max_positions
        if not 1 <= max_length <= cfg.max_positions:
            raise SpecdecError(f"max_length must be in 1..{cfg.max_positions}, got {max_length}",
                               "max_length")
        self.model, self.slots, self.max_length, self.kv_dtype = model, slots, max_length, kv_dtype
        # keys [layers, slots, kv_heads, length / KEY_TILE, head_dim, KEY_TILE], values [layers, slots,
        # kv_heads, length, head_dim + 1] whose last column is ones up to `_ones`, in whole attention
        # chunks (attention.py)
        lead, length = (cfg.num_layers, slots), padded(max_length)
        key_shape = (cfg.num_kv_heads, length // KEY_TILE, cfg.head_dim, KEY_TILE)
        self._keys = LazyTensor((*lead, *key_shape), kv_dtype, model.device)
        self._values = LazyTensor((*lead, cfg.num_kv_heads, length, cfg.head_dim + 1), kv_dtype, model.device)
        self.k, self.v = self._keys.tensor, self._values.tensor
        self._ones = [0] * slots  # value rows of each slot that carry their ones
        self.layer_caches = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))  # views, made once
        self.kernel = uses_kernel(model.device, kv_dtype)  # numba_ops, or the PyTorch routine
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per kv head
        self.cos, self.sin = model.rope_tables(max_length)  # [max_length, head_dim]
        self.local_cos, self.local_sin = model.rope_tables(max_length, local=True)  # gemma3's sliding layers
        self._free = list(range(slots - 1, -1, -1))
        self.prefix_mode = prefix_cache_mode(prefix_cache)
        self._hidden: LazyTensor | None = None  # see hidden_buffer

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def new_sequence(self) -> NativeSequence:
        if not self._free:
            raise SpecdecError(f"all {self.slots} cache slots are in use", "slots")
        return NativeSequence(self, self._free.pop(), self.prefix_mode)

    def fork(self, source: NativeSequence, length: int) -> NativeSequence:
        """A new sequence holding a copy of `source`'s first `length` keys, values (and hidden
        states, if it keeps them): a conversation that shares a prefix with another's cache
        starts from it without evicting the rest."""
        if source.pool is not self or source.slot is None or not 0 <= length <= source.length:
            raise ValueError(f"cannot fork {length} tokens of this sequence")
        seq = self.new_sequence()
        self.reserve(seq.slot, length)
        blocks = key_blocks(length)  # whole blocks: no query weighs the positions past `length`
        self.k[:, seq.slot, :, :blocks] = self.k[:, source.slot, :, :blocks]
        self.v[:, seq.slot, :, :length] = self.v[:, source.slot, :, :length]
        seq.adopt(source, length)
        return seq

    def release(self, seq: NativeSequence) -> None:
        if seq.pool is not self or seq.slot is None:
            raise ValueError("this sequence does not hold a slot of this pool")
        self.clear(seq.slot)
        self._free.append(seq.slot)
        seq.slot = None

    def reserve(self, slot: int, length: int) -> None:
        """Make positions up to `length` of `slot` ready to be written: their value rows get
        the column of ones that attention's normaliser reads (a page is committed only when
        its tokens come near)."""
        if length > self._ones[slot]:
            end = min(self.v.shape[3], -(-length // ONES_AHEAD) * ONES_AHEAD)
            self.v[:, slot, :, self._ones[slot] : end, -1] = 1.0
            self._ones[slot] = end

    def clear(self, slot: int) -> None:
        """Give a slot's memory back to the system; its cache reads as empty afterwards."""
        if not self._ones[slot]:
            return
        for buffer in (self._keys, self._values):
            per_slot = buffer.tensor[0, 0].numel()
            for layer in range(buffer.shape[0]):
                buffer.release((layer * self.slots + slot) * per_slot, per_slot)
        if self._hidden is not None:
            per_slot = self._hidden.tensor[0].numel()
            self._hidden.release(slot * per_slot, per_slot)
        self._ones[slot] = 0

    def kv_memory(self) -> KVMemory:
        """The cache's size: what a token costs, the most it may hold and what it holds now."""
        cfg, item = self.model.config, self._keys.itemsize
        heads = cfg.num_layers * cfg.num_kv_heads
        hidden = 0 if self._hidden is None else cfg.hidden_size * self._hidden.itemsize
        buffers = [b for b in (self._keys, self._values, self._hidden) if b is not None]
        committed = sum(committed_bytes(key_blocks(n) * KEY_TILE * cfg.head_dim * item, heads)  # keys
                        + committed_bytes(n * (cfg.head_dim + 1) * item, heads)  # value rows
                        + committed_bytes(n * hidden, 1) for n in self._ones)
        return KVMemory(slots=self.slots, window=self.max_length, dtype=str(self._keys.dtype).split(".")[-1],
                        bytes_per_token=heads * (2 * cfg.head_dim + 1) * item + hidden,
                        limit_bytes=sum(b.nbytes for b in buffers), held_tokens=sum(self._ones),
                        committed_bytes=committed, lazy=self._keys.lazy)

    def forward_batch(self, sequences: list[NativeSequence], token_lists: list[list[int]],
                      unscored: list[list[int]] | None = None, last_only: bool = False,
                      prompt: bool = False) -> list[torch.Tensor]:
        """One packed forward that appends token_lists[i] to sequences[i]; logits [len_i, V]
        each, or with `last_only` just the last row [1, V] ([0, V] for an empty list). Rows
        unscored[i] of sequence i come back as zeros, the LM head skipped for them, where the
        head computes each row on its own (`head_rows_independent`); elsewhere all are scored.

        Lists of more than DECODE_ATTENTION_MAX tokens, or all of them with `prompt`, are
        prompt chunks: one causal pass each, through the dense layers where there are some (or
        decode chains, where `prompts_as_steps`).
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
        dense = any(is_prompt) and not self.prompts_as_steps  # only prompts (and empty lists) here
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
        hidden, logits = self.run_rows(tokens, positions, rows, compiled,
                                       lasts if last_only else scored if partial else None, dense)
        if partial:  # the unscored rows stay zeros
            logits = logits.new_zeros(len(tokens), logits.shape[-1]).index_copy_(
                0, torch.tensor(scored, dtype=torch.long), logits)
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

    @property
    def prompts_as_steps(self) -> bool:
        """Whether prompt chunks run as decode chains: the decode layers and the batch-invariant
        attention, so that every prompt row has the bits of a one-token step. A cache then holds
        the same keys for a token whether a prompt or a decode step wrote it, in any chunks, and
        the prefix cache keeps answers and off-grid prefixes bit-exactly (prefix_cache.py). On
        for models whose decode layers run prompts about as fast as their prompt layers (the
        int8-activation kernels) and attention on the kernel; off once compiled (a compiled
        step rounds otherwise than an eager one)."""
        return self.kernel and self.model.prompts_as_steps and not self.model.compiled

    def forward_prompt(self, seq: NativeSequence, chunks: list[list[int]],
                       last_only: bool = False) -> torch.Tensor:
        """A prompt's consecutive chunks in one pass: each chunk a causal row of its own, so its
        attention is that of a pass per chunk, and the layers' kernels over all their tokens at
        once (a prompt kernel computes each row on its own, so a chunk's bits do not depend on
        its neighbours; the tests compare the two). A prompt kernel that decodes weight tiles
        then decodes each tile once per group, not once per chunk. A chunk of fewer than the
        model's `short_chunk_rows` tokens takes the decode kernels instead (cheaper for a few
        rows than decoding every tile); the choice depends on the chunk alone, so a warm
        prefill still gives a cold one's bits. Where `prompts_as_steps`, the chunks run as one
        decode chain instead. Logits [T, V], or [1, V]."""
        seq._check_append(sum(len(chunk) for chunk in chunks))
        if not any(chunks):
            return torch.empty(0, self.model.config.vocab_size)
        if self.prompts_as_steps:  # one chain of all the chunks' tokens: the bits of one-token steps
            tokens = [token for chunk in chunks for token in chunk]
            return self.forward_batch([seq], [tokens], last_only=last_only)[0]
        parts, logits = _runs_of(chunks, self.model.short_chunk_rows), []
        for i, (short, part) in enumerate(parts):
            last = i == len(parts) - 1
            logits.append(self._prompt_part(seq, part, short, last_only, last))
        return logits[-1] if last_only else torch.cat(logits)

    def _prompt_part(self, seq: NativeSequence, chunks: list[list[int]], short: bool, last_only: bool,
                     last: bool) -> torch.Tensor:
        """Consecutive chunks of one kind (short or not) appended to `seq`: logits [T, V], or
        with `last_only` [1, V] for the prompt's last part and [0, V] (no head) before it."""
        start, tokens, positions, rows = seq._length, [], [], []
        for chunk in chunks:
            rows.append(self._row(seq.slot, len(tokens), start + len(tokens), len(chunk), dense=True))
            tokens.extend(chunk)
            positions.extend(range(start + len(tokens) - len(chunk), start + len(tokens)))
        logits_at = None if not last_only else [len(tokens) - 1] if last else []
        hidden, logits = self.run_rows(tokens, positions, rows, False, logits_at, dense=not short)
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

    def run_rows(self, tokens, positions, rows, compiled=False, logits_at=None,
                 dense=False) -> tuple[torch.Tensor, torch.Tensor]:
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
        """[slots, max_length, hidden] post-norm features of cached tokens, made on first use."""
        if self._hidden is None:
            cfg = self.model.config
            self._hidden = LazyTensor((self.slots, self.max_length, cfg.hidden_size), torch.float32,
                                      self.model.device)
        return self._hidden.tensor


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
