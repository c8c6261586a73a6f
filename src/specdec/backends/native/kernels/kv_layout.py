"""The layout of the slotted KV cache that the attention kernels read, by position.

Keys sit in blocks of KEY_TILE, [kv_heads, length / KEY_TILE, dim, KEY_TILE]: a block's scores
run along contiguous keys, and a pass over a head's keys is one stream from memory. An fp32 block
holds dim d of its keys in row d; a bf16 block holds them in pairs of dims, [dim / 2, KEY_TILE,
2], so that one 64-byte load is 16 keys' pair (`keys_of`, `keys_at` and `store_keys` read and
write either by position). Values are [kv_heads, length, dim + 1] with a last column of ones
(the PyTorch routine's normaliser; the kernel adds a query's weights itself, in a fixed order
of its own). Into a bf16 cache, keys and values below PAIR_FLOOR are stored as 0, as the
kernel stores them.
"""

from __future__ import annotations

import torch

KEY_TILE = 16  # keys a block of the key cache holds (jit/attention_tiles.TILE: the kernel's score tile)
# A bf16 cache's keys and values, and the queries and weights multiplied with them, below this
# are 0: every product of two such bf16 values is then a multiple of 2^-126, so no partial sum is
# subnormal, and vdpbf16ps (which flushes subnormals) gives the bits of fp32 multiplies and adds
PAIR_FLOOR = 2.0**-56


def key_blocks(positions: int) -> int:
    """Blocks of the key cache that hold positions 0 .. positions - 1."""
    return -(-positions // KEY_TILE)


def _by_key(k_cache: torch.Tensor) -> torch.Tensor:
    """k_cache [..., blocks, dim, KEY_TILE] as a view [..., blocks, KEY_TILE, *each key]: a
    key's dims (fp32), or its dim / 2 pairs of dims (bf16: a block holds [dim / 2, KEY_TILE, 2])."""
    if k_cache.dtype != torch.bfloat16:
        return k_cache.transpose(-2, -1)
    *lead, dim, tile = k_cache.shape
    return k_cache.view(*lead, dim // 2, tile, 2).movedim(-2, -3)


def _at(k_cache: torch.Tensor, positions: torch.Tensor) -> tuple:
    """The index of `positions`' keys in _by_key(k_cache)."""
    each_key = 2 if k_cache.dtype == torch.bfloat16 else 1
    return (..., positions // KEY_TILE, positions % KEY_TILE) + (slice(None),) * each_key


def keys_of(k_cache: torch.Tensor, count: int) -> torch.Tensor:
    """k_cache [..., blocks, dim, KEY_TILE] -> its first `count` keys [..., count, dim] (a copy;
    fewer where the cache holds fewer)."""
    blocks = _by_key(k_cache[..., : key_blocks(count), :, :])
    lead = k_cache.shape[:-3]
    return blocks.reshape(*lead, -1, k_cache.shape[-2])[..., :count, :]


def keys_at(k_cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """k_cache [..., blocks, dim, KEY_TILE] -> the keys at `positions` [P], [..., P, dim] (a copy)."""
    keys = _by_key(k_cache)[_at(k_cache, positions)]
    return keys.flatten(-2) if k_cache.dtype == torch.bfloat16 else keys


def store_keys(k_cache: torch.Tensor, first: int, keys: torch.Tensor) -> None:
    """Write keys [..., n, dim] at positions first .. first + n - 1 of k_cache [..., blocks, dim,
    KEY_TILE]; into a bf16 cache, 0 below PAIR_FLOOR, as the kernel stores them."""
    positions = torch.arange(first, first + keys.shape[-2], device=k_cache.device)
    if k_cache.dtype == torch.bfloat16:
        keys = _floored(keys).unflatten(-1, (-1, 2))
    _by_key(k_cache)[_at(k_cache, positions)] = keys.to(k_cache.dtype)


def store_values(v_cache: torch.Tensor, first: int, values: torch.Tensor) -> None:
    """Write values [..., n, dim] at positions first .. first + n - 1 of v_cache [..., length,
    dim + 1] (not its ones); into a bf16 cache, 0 below PAIR_FLOOR, as the kernel stores them."""
    values = _floored(values) if v_cache.dtype == torch.bfloat16 else values
    v_cache[..., first : first + values.shape[-2], : values.shape[-1]] = values


def _floored(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x.abs() < PAIR_FLOOR, torch.zeros_like(x), x)
