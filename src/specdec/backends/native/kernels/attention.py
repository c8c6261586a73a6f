"""Batch-invariant attention over the slotted KV cache: one routine for every query count.

A query's result must not depend on how many queries share the call, or scoring k drafts
would not reproduce k one-token steps bit for bit: SDPA and the BLAS kernels pick their
blocking from the shapes they are given (on AVX2, MKL's GEMM rounds a row differently by
where it falls in the row tiles). As in "Defeating Nondeterminism in LLM Inference"
(Thinking Machines, 2025) and SGLang's deterministic mode, every reduction here runs with a
fixed shape or in a fixed order, aligned to absolute key positions:
- scores: keys [S, dim] @ queries [dim, BLOCK] per kv head, always BLOCK columns (a query's
  heads; up to BLOCK // group queries share a block, the rest is padding), keys as rows;
- softmax: minus each column's maximum over its visible keys (a max is exact in any order),
  masked with -inf, so a key a query cannot see weighs exactly 0;
- weights @ [values | 1]: one fixed-shape GEMM per CHUNK keys (the ones column gives the
  normaliser), and the chunks are added by a pairwise tree over a power-of-two count, so a
  fully masked chunk is an exact no-op.

A sliding-window layer (mistral, gemma3's local layers) attends through its own rows
(`windowed`): the same plans with the keys older than the window masked, as exact zeros.

A chain row (decode steps) attends over its slot. A token tree uses the same steps: the
whole chunks before the tree come from the cache, and each node gets its own copy of the
tree's last chunks, its ancestors laid out where a chain would hold them (base + depth),
so every node scores with the bits of a one-token-per-step decode. Prompt chunks and eagle's
draft trees (rows with an explicit mask) take one SDPA call: nothing verifies them.

Two implementations keep this contract: on the cpu with numba installed, one compiled kernel
per layer computes each query on its own (kernels/numba_ops.py: batch-invariant by
construction, and far fewer ops at one query); elsewhere the PyTorch routine below. A cache
pool picks one when it is made (`plan_chain`, `plan_tree`); they differ in the last bits, so
a process never mixes them for one cache. The kernel reads fp32 and bf16 caches; an fp16
cache takes the routine. Over a bf16 cache the kernel multiplies bf16 by bf16: the queries
are rounded to bf16 like the keys, and a score adds each pair of dims' two products, the odd
dim's first, which is what AVX-512 BF16's vdpbf16ps computes at twice the fp32 rate (its
replica on other CPUs gives the same bits); the softmax weights are rounded to bf16 too (their
sum, the normaliser, is of the rounded ones), and the weighted sums add a key's product at a
time, two keys to a vdpbf16ps where it exists. The rest is fp32. Either way a tree's own
keys and values are rounded to the cache's type before they are read, as a step reads them back.

The cache's layout (keys in blocks of KEY_TILE, values [kv_heads, length, dim + 1] with a last
column of ones: the routine's normaliser) is kv_layout.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from specdec.backends.native.kernels.kv_layout import KEY_TILE, keys_of, store_keys, store_values
from specdec.backends.native.kernels.numba_ops import attend_kernel, attend_op, usable

CHUNK = 64  # keys per block of the weights @ values reduction, aligned to absolute positions
BLOCK = 16  # score columns per GEMM: a fixed shape whatever the number of queries


@dataclass
class QueryBlock:
    """Up to BLOCK // group queries scored together, and what they see (shared by all layers)."""

    first: int  # queries first .. first + count - 1 of the row
    count: int
    bias: torch.Tensor  # [keys, BLOCK]: 0 (visible) or -inf per score column; padding columns see all
    tail_index: torch.Tensor | None = None  # tree only: [count, tail] rows of cache[keys:base] ++ nodes
    tail_bias: torch.Tensor | None = None  # tree only: [count, tail, group]


@dataclass
class KeyPlan:
    keys: int  # cached keys every query reads from the slot: a multiple of CHUNK
    blocks: list[QueryBlock]


@dataclass
class KernelPlan:
    """What each query reads, for numba_ops (shared by all layers)."""

    limits: torch.Tensor  # [T] int64: query j reads the slot's keys starts[j] .. limits[j] - 1
    paths: torch.Tensor  # [T, E] int64: then these of the row's own tokens, a tree path (-1: none)
    starts: torch.Tensor | None = None  # [T] int64; None: zeros (no sliding window)

    def __post_init__(self):
        if self.starts is None:
            self.starts = torch.zeros_like(self.limits)
        # what the eager kernel call takes
        self.arrays = (self.limits.numpy(), self.paths.numpy(), self.starts.numpy())


def new_cache(lead: tuple[int, ...], kv_heads: int, length: int, dim: int, dtype=torch.float32, device=None):
    """Empty keys [*lead, kv_heads, padded(length) / KEY_TILE, dim, KEY_TILE] and values [*lead,
    kv_heads, padded(length), dim + 1] (whose last column is ones), as `attention` reads them."""
    length = padded(length)
    if dtype == torch.bfloat16 and dim % 2:
        raise ValueError(f"a bf16 cache holds keys in pairs of dims; head_dim {dim} is odd")
    keys = torch.zeros(*lead, kv_heads, length // KEY_TILE, dim, KEY_TILE, dtype=dtype, device=device)
    return keys, ones_column(torch.zeros(*lead, kv_heads, length, dim, dtype=dtype, device=device))


def uses_kernel(device, kv_dtype: torch.dtype = torch.float32) -> bool:
    return usable(torch.device(device), kv_dtype)


def padded(length: int) -> int:
    """`length` rounded up to whole chunks: how long a cache must be for `attention`."""
    return -(-length // CHUNK) * CHUNK


def _column_bias(visible: torch.Tensor, group: int) -> torch.Tensor:
    """visible [keys, n] -> bias [keys, BLOCK]: each query's column repeated for its heads."""
    keys, n = visible.shape
    bias = torch.zeros(keys, BLOCK, device=visible.device)
    bias[:, : n * group].masked_fill_(~visible.repeat_interleave(group, dim=1), float("-inf"))
    return bias


def _blocks(t: int, group: int) -> list[tuple[int, int]]:
    if group > BLOCK:
        raise ValueError(f"attention blocks hold {BLOCK} heads per kv head; this model has {group}")
    per = BLOCK // group
    return [(first, min(per, t - first)) for first in range(0, t, per)]


def plan_chain(kv_len: int, t: int, group: int, device, kernel: bool = False,
               window: int | None = None) -> KeyPlan | KernelPlan:
    """T queries at positions kv_len - T .. kv_len - 1, each seeing the keys up to its own (and,
    with a sliding window, none before its last `window` positions)."""
    positions = torch.arange(kv_len - t, kv_len)
    if kernel:
        starts = None if window is None else (positions - window + 1).clamp(min=0)
        return KernelPlan(positions + 1, torch.empty(t, 0, dtype=torch.long), starts)
    keys = padded(kv_len)
    key_index, positions = torch.arange(keys, device=device)[:, None], positions.to(device)[None, :]
    visible = key_index <= positions
    if window is not None:
        visible &= key_index > positions - window
    blocks = [QueryBlock(a, n, _column_bias(visible[:, a : a + n], group)) for a, n in _blocks(t, group)]
    return KeyPlan(keys, blocks)


def plan_tree(base: int, parents: list[int], depths: list[int], group: int, device,
              kernel: bool = False, window: int | None = None) -> KeyPlan | KernelPlan:
    """Tree nodes after `base` cached tokens (parents[i] < i, -1 for a root): node i at depth d
    sees the cache and, at positions base..base+d, the path from a root down to itself (with
    a sliding window, only what lies in its last `window` positions)."""
    t = len(parents)
    # first visible position
    firsts = [0 if window is None else max(0, base + depths[i] - window + 1) for i in range(t)]
    if kernel:
        paths = torch.full((t, max(depths) + 1), -1, dtype=torch.long)
        for i in range(t):
            node, dropped = i, max(0, firsts[i] - base)  # ancestors the window has left behind
            while node >= 0:
                if depths[node] >= dropped:
                    paths[i, depths[node] - dropped] = node
                node = parents[node]
        starts = torch.tensor([min(first, base) for first in firsts], dtype=torch.long)
        return KernelPlan(torch.full((t,), base, dtype=torch.long), paths, starts)
    split = base // CHUNK * CHUNK  # whole chunks before the tree are shared by all nodes
    head = base - split  # cached keys in the tree's first chunk
    tail = padded(head + max(depths) + 1)
    index = torch.zeros(t, tail, dtype=torch.long)
    visible = torch.zeros(t, tail, dtype=torch.bool)
    index[:, :head] = torch.arange(head)
    for i in range(t):
        visible[i, :head] = torch.arange(split, base) >= firsts[i]
        node = i
        while node >= 0:
            index[i, head + depths[node]], visible[i, head + depths[node]] = (
                head + node, base + depths[node] >= firsts[i])
            node = parents[node]
    tail_bias = torch.zeros(t, tail).masked_fill_(~visible, float("-inf"))[:, :, None].expand(t, tail, group)
    index, tail_bias = index.to(device), tail_bias.to(device)
    shared = (torch.arange(split)[:, None] >= torch.tensor(firsts)[None, :]).to(device)  # [split, T]
    blocks = [QueryBlock(a, n, _column_bias(shared[:, a : a + n], group), index[a : a + n],
                         tail_bias[a : a + n])
              for a, n in _blocks(t, group)]
    return KeyPlan(split, blocks)


def ones_column(values: torch.Tensor) -> torch.Tensor:
    """A value cache [..., dim] with a column of ones appended: weights @ [values | 1] gives the
    softmax's normaliser from the same GEMM as its numerator. CachePool allocates it so."""
    return F.pad(values, (0, 1), value=1.0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, rows: list, gqa: bool, masked_dtype: torch.dtype | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Store each row's new keys and values, then let its queries attend (see the module doc).
    q [N, heads, dim], k, v [N, kv_heads, dim]; k_cache [slots, kv_heads, blocks, dim, KEY_TILE], v_cache
    [slots, kv_heads, length, dim + 1] (see new_cache); rows are layer.KVRow (plan: a KeyPlan or
    KernelPlan, or None to make one here). Rows with a mask (prompt chunks, eagle's draft
    trees) run SDPA in `masked_dtype` (default: the cache's). `scale` multiplies the scores
    (None: head_dim ** -0.5). Returns [N, heads, dim]."""
    outs, dim = [], q.shape[-1]
    group = q.shape[1] // k.shape[1]
    for row in rows:
        t = row.end - row.start
        if row.plan is None and row.mask is None:
            kernel = uses_kernel(q.device, k_cache.dtype)
            row.plan = (plan_tree(row.store, *tree_parents(*row.tree), group, q.device, kernel, row.window)
                        if row.tree
                        else plan_chain(row.kv_len, t, group, q.device, kernel, row.window))
        if row.tree is not None:
            outs.append(_tree_row(q, k, v, k_cache, v_cache, row, scale))
            continue
        rows_k, rows_v = k[row.start : row.end], v[row.start : row.end]
        if isinstance(row.plan, KernelPlan) and not torch.compiler.is_compiling():  # it stores them too
            outs.append(attend_kernel(q[row.start : row.end], rows_k, rows_v, k_cache, v_cache,
                                      row.slot, row.store, *row.plan.arrays, scale))
            continue
        store_keys(k_cache[row.slot], row.store, rows_k.transpose(0, 1))
        store_values(v_cache[row.slot], row.store, rows_v.transpose(0, 1))
        if row.mask is not None:  # a prompt chunk or an eagle draft tree: one masked pass
            outs.append(_masked_row(q[row.start : row.end], k_cache, v_cache[..., :dim], row, gqa,
                                    masked_dtype or k_cache.dtype, scale))
        elif isinstance(row.plan, KernelPlan):
            outs.append(attend_op(q[row.start : row.end], rows_k, rows_v, k_cache, v_cache, row.slot,
                                  row.plan.limits, row.plan.paths, row.plan.starts, _scale(scale, dim)))
        else:
            keys, values = _slot_keys(k_cache, v_cache, row.slot, row.plan.keys)
            outs.append(attend(q[row.start : row.end], keys, values, row.plan, scale=scale))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _scale(scale: float | None, dim: int) -> float:
    return dim**-0.5 if scale is None else scale


def windowed(rows: list, window: int | None, group: int, device, kernel: bool) -> list:
    """The rows a sliding-window layer attends through: each row's keys older than `window`
    positions masked, with a plan of its own shared by the sliding layers (the same tree_kv
    list, so keep() sees every layer's nodes in order). `kernel`: plans for numba_ops."""
    if window is None:
        return rows
    out = []
    for row in rows:
        t, mask, plan = row.end - row.start, row.mask, None
        if mask is not None:  # [T, kv_len]: query j at position kv_len - T + j
            query = torch.arange(row.kv_len - t, row.kv_len, device=mask.device)[:, None]
            mask = mask & (torch.arange(row.kv_len, device=mask.device)[None, :] > query - window)
        elif row.tree is not None:
            plan = plan_tree(row.store, *tree_parents(*row.tree), group, device, kernel, window)
        else:
            plan = plan_chain(row.kv_len, t, group, device, kernel, window)
        out.append(replace(row, mask=mask, plan=plan, window=window))
    return out



def kernel_chain_row(rows: list, group: int, device, kv_dtype: torch.dtype):
    """The forward's row when it is a single chain row that the kernel attends (its plan made
    here if need be, as `attention` would make it), else None: such a row may rotate, attend
    and cast in one call (numba_ops.rotate_attend)."""
    if len(rows) != 1 or rows[0].tree is not None or rows[0].mask is not None:
        return None
    row = rows[0]
    if row.plan is None and uses_kernel(device, kv_dtype):
        row.plan = plan_chain(row.kv_len, row.end - row.start, group, device, kernel=True, window=row.window)
    return row if isinstance(row.plan, KernelPlan) else None


def kernel_rows(rows: list, group: int, device, kv_dtype: torch.dtype) -> tuple | None:
    """The rows of a forward as one call attends them, when the kernel attends every one of
    them (chains and token trees; a masked row, a prompt chunk, takes SDPA): (slots [R], stores
    [R], offsets [R + 1] of each row's packed tokens, then limits [T], paths [T, E] and starts
    [T] of every token, the rows' KernelPlans side by side), their plans made here where need
    be, as `attention` would make them; else None. A tree row's nodes are written to the cache
    at store.. (`_tree_row` keeps them aside instead): keep() then reads them there."""
    if not rows or any(row.mask is not None for row in rows) or not uses_kernel(device, kv_dtype):
        return None
    if [row.start for row in rows] != [0] + [row.end for row in rows[:-1]]:
        return None  # not packed back to back
    plans = []
    for row in rows:
        if row.plan is None:
            t = row.end - row.start
            if row.tree:
                row.plan = plan_tree(row.store, *tree_parents(*row.tree), group, device, True, row.window)
            else:
                row.plan = plan_chain(row.kv_len, t, group, device, kernel=True, window=row.window)
        if not isinstance(row.plan, KernelPlan):
            return None
        plans.append(row.plan.arrays)
    width = max(paths.shape[1] for _, paths, _ in plans)
    paths = np.full((rows[-1].end, width), -1, np.int64)
    for row, (_, own, _) in zip(rows, plans, strict=True):
        paths[row.start : row.end, : own.shape[1]] = own
    offsets = np.array([row.start for row in rows] + [rows[-1].end], np.int64)
    slots = np.array([row.slot for row in rows], np.int64)
    stores = np.array([row.store for row in rows], np.int64)
    limits, starts = np.concatenate([p[0] for p in plans]), np.concatenate([p[2] for p in plans])
    return slots, stores, offsets, limits, paths, starts


def _slot_keys(k_cache, v_cache, slot: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [kv_heads, keys, dim] and values [kv_heads, keys, dim + 1] of a slot, in fp32;
    zero-padded where the cache is shorter."""
    k_row, v_row = keys_of(k_cache[slot], keys), v_cache[slot, :, :keys]
    if k_row.dtype != torch.float32:
        k_row, v_row = k_row.float(), v_row.float()
    if k_row.shape[1] < keys:
        k_row, v_row = (F.pad(k_row, (0, 0, 0, keys - k_row.shape[1])),
                        F.pad(v_row, (0, 0, 0, keys - v_row.shape[1])))
    return k_row, v_row


def _masked_row(q_row, k_cache, v_cache, row, gqa: bool, dtype: torch.dtype,
                scale: float | None) -> torch.Tensor:
    t, heads, dim = q_row.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads if gqa else 1
    # [1, kv_heads, group * T, dim]: the heads that share a kv head as more queries of it, so
    # the fused kernel reads each key once for all of them (enable_gqa would not)
    q_row = q_row.to(dtype).view(t, kv_heads, group, dim).permute(1, 2, 0, 3)
    q_row = q_row.reshape(1, kv_heads, group * t, dim)
    # keys and values copied contiguous: SDPA's fused CPU kernel wants the last dim contiguous
    # (the cache holds keys in blocks, values beside their column of ones); with views it
    # takes a path about 2x slower at 4k keys. (.to(memory_format=...) returns a view as it is
    # where the dtype already matches, so .contiguous())
    k_row = keys_of(k_cache[row.slot : row.slot + 1], row.kv_len).to(dtype).contiguous()
    v_row = v_cache[row.slot : row.slot + 1, :, : row.kv_len].to(dtype).contiguous()
    mask = row.mask if group == 1 else row.mask.repeat(group, 1)  # [group * T, S]
    out = F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=mask, scale=scale)
    return out.view(kv_heads, group, t, dim).permute(2, 0, 1, 3).reshape(t, heads, dim)  # [T, heads, dim]


def attend(q_row: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: KeyPlan,
           tails: tuple[torch.Tensor, torch.Tensor] | None = None,
           scale: float | None = None) -> torch.Tensor:
    """q_row [T, heads, dim] over shared keys [kv_heads, S, dim] and values [kv_heads, S, dim + 1]
    (S = plan.keys; a last column of ones), plus, for a tree, each query's own keys and values
    `tails` [kv_heads, T, L, dim (+ 1)]. Returns [T, heads, dim] in fp32."""
    t, heads, dim = q_row.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # [kv_heads, dim, T, group]
    queries = (q_row.float() * _scale(scale, dim)).view(t, kv_heads, group, dim).permute(1, 3, 0, 2)
    outs = []
    for block in plan.blocks:
        cols = queries[:, :, block.first : block.first + block.count].reshape(kv_heads, dim, -1)
        # [kv_heads, dim, BLOCK], contiguous: a full block (group 1) would stay a strided view,
        # and MKL's AVX2 GEMM rounds a transposed operand differently
        cols = F.pad(cols, (0, BLOCK - cols.shape[2])).contiguous()
        # keys are the GEMM's rows, a block's queries its columns: the same shape every call
        scores = torch.baddbmm(block.bias, keys, cols)  # [kv_heads, S, BLOCK]
        own = None
        if tails is not None:
            own = tuple(x[:, block.first : block.first + block.count] for x in tails)
            scores = torch.cat([scores, _tail_scores(cols, own[0], block.tail_bias, group)], dim=1)
        weights = scores.sub_(scores.max(dim=1, keepdim=True).values).exp_()  # masked keys weigh 0
        shared = keys.shape[1]
        sums = _chunk_sums(values, weights[:, :shared])  # [kv_heads, chunks, dim + 1, BLOCK]
        if own is not None:
            sums = torch.cat([sums, _tail_sums(own[1], weights[:, shared:], block.count, group)], dim=1)
        sums = in_order_sum(sums)  # [kv_heads, dim + 1, BLOCK]
        out = (sums[:, :dim] / sums[:, dim:])[:, :, : block.count * group]  # [kv_heads, dim, n * group]
        outs.append(out.view(kv_heads, dim, block.count, group).permute(2, 0, 3, 1).reshape(-1, heads, dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def in_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """parts [A, n, ...] summed over n by a pairwise tree over n padded to a power of two, so
    trailing zero parts (fully masked chunks) leave every bit of the sum as it is."""
    n = parts.shape[1]
    if n & (n - 1):
        parts = torch.cat([parts, parts.new_zeros(parts.shape[0], (1 << n.bit_length()) - n,
                                                  *parts.shape[2:])], 1)
    while parts.shape[1] > 1:
        parts = parts[:, 0::2] + parts[:, 1::2]
    return parts[:, 0]


def _chunk_sums(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """values [kv_heads, S, dim + 1], weights [kv_heads, S, BLOCK] -> [kv_heads, S / CHUNK,
    dim + 1, BLOCK]: each chunk's weighted values (and weights, from the ones column), one
    fixed-shape GEMM per chunk."""
    kv_heads, length, columns = values.shape
    chunks = length // CHUNK
    out = values.new_empty(kv_heads, chunks, columns, BLOCK)
    for h in range(kv_heads):
        torch.bmm(values[h].view(chunks, CHUNK, columns).transpose(1, 2),
                  weights[h].view(chunks, CHUNK, BLOCK), out=out[h])
    return out


def _tail_scores(cols: torch.Tensor, tail_keys: torch.Tensor, tail_bias: torch.Tensor,
                 group: int) -> torch.Tensor:
    """Each query of a block over its own keys [kv_heads, n, L, dim], in a BLOCK of its own
    (its heads first) -> [kv_heads, L, BLOCK] laid out as the block's columns."""
    kv_heads, n, length, dim = tail_keys.shape
    # [kv_heads, n, dim, group]
    own = cols[:, :, : n * group].reshape(kv_heads, dim, n, group).permute(0, 2, 1, 3)
    own = torch.bmm(tail_keys.reshape(-1, length, dim),
                    F.pad(own, (0, BLOCK - group)).reshape(-1, dim, BLOCK))
    # bias 0 or -inf: as baddbmm's
    own = own.view(kv_heads, n, length, BLOCK)[..., :group].add(tail_bias)
    return F.pad(own.permute(0, 2, 1, 3).reshape(kv_heads, length, n * group), (0, BLOCK - n * group))


def _tail_sums(values: torch.Tensor, weights: torch.Tensor, n: int, group: int) -> torch.Tensor:
    """values [kv_heads, n, L, dim + 1], weights [kv_heads, L, BLOCK] -> [kv_heads, L / CHUNK,
    dim + 1, BLOCK]: each query's chunks in a BLOCK of its own, laid back as the block's columns."""
    kv_heads, _, length, columns = values.shape
    chunks = length // CHUNK
    w = weights[:, :, : n * group].reshape(kv_heads, chunks, CHUNK, n, group).permute(0, 3, 1, 2, 4)
    w = F.pad(w, (0, BLOCK - group)).reshape(-1, CHUNK, BLOCK)  # [kv_heads * n * chunks, CHUNK, BLOCK]
    sums = torch.bmm(values.reshape(-1, CHUNK, columns).transpose(1, 2), w)[..., :group]
    sums = sums.reshape(kv_heads, n, chunks, columns, group).permute(0, 2, 3, 1, 4)
    return F.pad(sums.reshape(kv_heads, chunks, columns, n * group), (0, BLOCK - n * group))


def _tree_row(q, k, v, k_cache, v_cache, row, scale: float | None) -> torch.Tensor:
    """A token tree: its nodes' keys and values stay out of the cache (kept in row.tree_kv
    for keep()); each node reads the shared chunks from the cache and its own tail."""
    t, base, plan = row.end - row.start, row.store, row.plan
    k_nodes, v_nodes = k[row.start : row.end], v[row.start : row.end]  # [T, kv_heads, dim]
    row.tree_kv.append((k_nodes, v_nodes))  # for keep(), one entry per layer
    if isinstance(plan, KernelPlan):  # store -1: the nodes' keys stay out of the cache
        if torch.compiler.is_compiling():
            return attend_op(q[row.start : row.end], k_nodes, v_nodes, k_cache, v_cache, row.slot,
                             plan.limits, plan.paths, plan.starts, _scale(scale, q.shape[-1]))
        return attend_kernel(q[row.start : row.end], k_nodes, v_nodes, k_cache, v_cache, row.slot, -1,
                             *plan.arrays, scale)
    keys, values = _slot_keys(k_cache, v_cache, row.slot, base)
    index = torch.cat([block.tail_index for block in plan.blocks]).reshape(-1)

    def own(cached: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:  # -> [kv_heads, T, L, columns]
        # rounded as the cache will hold them (bf16, fp16): a step would read them from there
        nodes = nodes.transpose(0, 1).to(k_cache.dtype).to(cached.dtype)
        if nodes.shape[2] < cached.shape[2]:
            nodes = ones_column(nodes)
        source = torch.cat([cached[:, plan.keys :], nodes], dim=1)
        return source.index_select(1, index).view(source.shape[0], t, -1, source.shape[2])

    tails = (own(keys, k_nodes), own(values, v_nodes))
    return attend(q[row.start : row.end], keys[:, : plan.keys], values[:, : plan.keys], plan, tails, scale)


def tree_parents(order: list[int], depths: list[int]) -> tuple[list[int], list[int]]:
    """(parents, depths) of a tree given as (depth-first order, depths)."""
    parents, path = [-1] * len(order), []
    for node in order:
        del path[depths[node] :]
        parents[node] = path[-1] if path else -1
        path.append(node)
    return parents, depths
