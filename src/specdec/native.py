"""The native backend: a lean PyTorch Llama-family model over a static, slotted KV cache.

In gpt-fast's spirit: one plain forward function, weights in plain tensors, no framework.
- `NativeModel` owns the weights (built from a loaded HF model without copying fp32
  tensors, or straight from a GGUF / safetensors directory) and runs one packed forward.
- `CachePool` owns the KV cache of several sequences, preallocated once as
  [layers, slots, kv_heads, max_length, head_dim]. A slot is one sequence; tokens are stored
  by position, so rollback is moving the length pointer.
- `NativeSequence` is one slot; it implements the ModelBackend protocol plus tree forwards.

A forward packs the new tokens of every row into one [N, hidden] batch, so the matmuls
(where the time goes) run once; attention then runs per row over that row's own cache
prefix, so rows of different lengths need no padding.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import SpecdecError
from .quant import PRECISIONS, FusedLinear, Linear, make_linear, read_gguf
from .tree import ancestor_mask, check_tree, tree_depths

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_MAX_LENGTH = 4096
NATIVE_OPTIONS = ("precision", "device", "max_length", "slots", "compile")
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32)  # token counts the compiled forward is traced for
DECODE_ATTENTION_MAX = 32  # chains up to this long attend query by query (see _attention)


@dataclass(frozen=True)
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int  # the model's context window (already capped by any sliding window)
    rope_theta: float

    @classmethod
    def from_hf(cls, config) -> NativeConfig:
        if config.model_type not in SUPPORTED_TYPES:
            raise SpecdecError(
                f"the native backend supports {', '.join(SUPPORTED_TYPES)} models, not "
                f"{config.model_type!r}; use the hf backend",
                "backend",
            )
        rope = getattr(config, "rope_parameters", None) or {}
        max_positions = int(getattr(config, "max_position_embeddings", 2048))
        window = getattr(config, "sliding_window", None)
        if window and getattr(config, "use_sliding_window", True):
            max_positions = min(max_positions, int(window))  # never past the window: exact
        return cls(
            model_type=config.model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            rms_eps=float(config.rms_norm_eps),
            max_positions=max_positions,
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
        )


@dataclass
class _Row:
    """One sequence's share of a packed forward."""

    slot: int
    start: int  # its tokens are packed rows start:end
    end: int
    store: int  # their keys and values go to cache[slot, :, store : store + end - start]
    kv_len: int  # they attend to cache[slot, :, :kv_len]
    mask: torch.Tensor | None  # [end - start, kv_len] bool, True = attend; None = attend to all


class _Layer(torch.nn.Module):
    """One decoder layer. A module whose tensors are buffers, so torch.compile traces it once
    and the graph serves all layers (regional compilation)."""

    def __init__(self, config: NativeConfig, attn_norm: torch.Tensor, qkv: FusedLinear, o: Linear,
                 mlp_norm: torch.Tensor, gate_up: FusedLinear, down: Linear):
        super().__init__()
        self.register_buffer("attn_norm", attn_norm, persistent=False)  # [hidden]
        self.register_buffer("mlp_norm", mlp_norm, persistent=False)  # [hidden]
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down  # qkv -> q, k, v; gate_up -> gate, up
        self.heads, self.kv_heads, self.dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.eps, self.gqa = config.rms_eps, config.num_heads != config.num_kv_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        # x [N, hidden]; cos, sin [N, 1, dim]; caches [slots, kv_heads, max_length, dim]
        n, hidden = x.shape
        h = F.rms_norm(x, (hidden,), self.attn_norm, self.eps)
        q, k, v = self.qkv(h)
        q = _rope(q.view(n, self.heads, self.dim), cos, sin)  # [N, heads, dim]
        k = _rope(k.view(n, self.kv_heads, self.dim), cos, sin)  # [N, kv_heads, dim]
        attn = _attention(q, k, v.view(n, self.kv_heads, self.dim), k_cache, v_cache, rows, self.gqa)
        x = x + self.o(attn.reshape(n, self.heads * self.dim))
        h = F.rms_norm(x, (hidden,), self.mlp_norm, self.eps)
        gate, up = self.gate_up(h)
        return x + self.down(F.silu(gate) * up)


class NativeModel:
    """Weights and the forward pass; the cache lives in a `CachePool`."""

    def __init__(self, config: NativeConfig, state: dict, precision: str = "fp32", device=None,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0):
        if precision not in PRECISIONS:
            raise SpecdecError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}",
                               "precision")
        self.config, self.precision = config, precision
        self.device = torch.device(device or state["model.embed_tokens.weight"].device)
        if precision in ("fp16", "int8", "int4") and self.device.type != "cpu":
            raise SpecdecError(f"precision {precision} runs on cpu only; use fp32 or bf16 on {self.device}",
                               "precision")
        if precision == "fp16" and "fbgemm" not in torch.backends.quantized.supported_engines:
            raise SpecdecError("precision fp16 needs fbgemm (x86 cpus); use int4", "precision")

        def tensor(name: str) -> torch.Tensor:
            return state[name].detach().to(self.device, torch.float32)

        def weight(name: str):  # a tensor, or a layer the loader already quantized
            w = state[name + ".weight"]
            return w.detach().to(self.device) if isinstance(w, torch.Tensor) else w

        def bias(name: str) -> torch.Tensor | None:
            b = state.get(name + ".bias")
            return None if b is None else b.detach().to(self.device)

        def linear(name: str) -> Linear:
            w = weight(name)
            return make_linear(w, bias(name), precision) if isinstance(w, torch.Tensor) else w

        def fused(*names: str) -> FusedLinear:
            return FusedLinear([weight(n) for n in names], [bias(n) for n in names], precision)

        self.embed = tensor("model.embed_tokens.weight")  # [V, hidden], fp32 for lookups
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            self.layers.append(_Layer(
                config, tensor(p + "input_layernorm.weight"),
                fused(attn + "q_proj", attn + "k_proj", attn + "v_proj"), linear(attn + "o_proj"),
                tensor(p + "post_attention_layernorm.weight"),
                fused(mlp + "gate_proj", mlp + "up_proj"), linear(mlp + "down_proj"),
            ))  # fmt: skip
        self.norm = tensor("model.norm.weight")
        if "lm_head.weight" not in state:  # tied embeddings
            state = {**state, "lm_head.weight": self.embed}
        # int4 keeps the LM head at int8, as 4-bit GGUFs keep their output matrix at 6-8 bits
        self.lm_head = make_linear(weight("lm_head"), bias("lm_head"), "int8" if precision == "int4" else precision)
        if inv_freq is None:
            inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.inv_freq = inv_freq.float().to(self.device)  # [head_dim / 2]
        self.attention_scaling = attention_scaling
        self.compiled = False  # see compile()
        self.compile_seconds = 0.0

    def compile(self, pool: CachePool | None = None) -> float:
        """torch.compile the decoder layer for single-sequence chain forwards (batched and tree
        forwards stay eager), then trace every bucket on a scratch slot of `pool`; returns the
        seconds it took."""
        if not self.compiled:
            # each bucket (and the first cache lengths) traces its own graph; keep them all
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            for layer in self.layers:
                layer.compile(dynamic=True)  # one graph, shared by all layers
            self.compiled = True
        pool = pool or self.new_pool(max_length=2 * COMPILE_BUCKETS[-1] + 1)
        start, seq = time.perf_counter(), pool.new_sequence()
        try:
            seq.prefill([0])
            for count in COMPILE_BUCKETS:  # twice: dynamic shapes are only marked on a second length
                seq.forward([0] * count)
                seq.forward([0] * count)
                seq.rollback(1)
        finally:
            pool.release(seq)
        self.compile_seconds += time.perf_counter() - start
        return self.compile_seconds

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model: torch.nn.Module, precision: str = "fp32", device=None) -> NativeModel:
        """Share the loaded transformers model's tensors (no copy for fp32 on its device)."""
        config = NativeConfig.from_hf(model.config)
        rotary = model.model.rotary_emb  # reuse HF's own frequencies (covers llama3/yarn scaling)
        return cls(config, model.state_dict(), precision, device, rotary.inv_freq, float(rotary.attention_scaling))

    @classmethod
    def from_pretrained(cls, directory: str | Path, precision: str = "fp32", device=None) -> NativeModel:
        """A transformers model directory with safetensors weights, without building the HF model."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
        config = NativeConfig.from_hf(hf_config)
        state: dict = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            state.update(load_file(str(file)))
        inv_freq, scaling = None, 1.0
        rope = getattr(hf_config, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, torch.device("cpu"))
        return cls(config, state, precision, device, inv_freq, scaling)

    @classmethod
    def from_gguf(cls, path: str | Path, precision: str = "fp32", device=None) -> NativeModel:
        """Read a GGUF directly. With int4, Q4_0/Q4_1 blocks become int4 weights as they are."""
        meta, state = read_gguf(path, int4_blocks=precision == "int4")
        return cls(NativeConfig(**meta), state, precision, device)

    def new_pool(self, slots: int = 1, max_length: int | None = None, kv_dtype=torch.float32) -> CachePool:
        return CachePool(self, slots, max_length, kv_dtype)

    def rope_tables(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [length, head_dim], computed as transformers does (bit for bit).

        transformers rotates with x * cos + cat(-x2, x1) * sin; the same products come from
        roll(x) * cat(-sin1, sin2), since negation is exact, in one op fewer.
        """
        freqs = torch.arange(length, device=self.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    # ---- forward -----------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: compiled graphs write the cache in place
    def forward_packed(self, pool: CachePool, token_ids: torch.Tensor, positions: torch.Tensor, rows: list[_Row],
                       logits_at: torch.Tensor | None = None, compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run N packed tokens (token j at rotary position positions[j]), storing keys and values
        where `rows` say. Returns the final post-norm hidden states [N, hidden] and the logits
        [N, V], or only those of the rows `logits_at` (a long prompt needs just its last)."""
        x = F.embedding(token_ids, self.embed)  # [N, hidden]
        cos, sin = pool.cos[positions].unsqueeze(1), pool.sin[positions].unsqueeze(1)  # [N, 1, dim]
        for i, layer in enumerate(self.layers):
            # calling the module runs its compiled graph, if any; .forward always runs eagerly
            x = (layer if compiled else layer.forward)(x, cos, sin, pool.k[i], pool.v[i], rows)
        x = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_eps)
        return x, self.lm_head(x if logits_at is None else x[logits_at]).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # x [N, heads, dim]; see rope_tables
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               rows: list[_Row], gqa: bool) -> torch.Tensor:
    """Store each row's new keys and values, then let its queries attend to its cache prefix.
    q [N, heads, dim], k, v [N, kv_heads, dim], caches [slots, kv_heads, max_length, dim].

    A row without a mask is a short chain: each of its queries attends exactly as a one-token
    decode step would (keys sliced to its position, no mask), because SDPA's results depend
    on the query count and the mask. Scoring k drafts then gives each the bits a plain step
    would, so speculation reproduces plain greedy decoding exactly.
    """
    outs = []
    for row in rows:
        t = row.end - row.start
        k_cache[row.slot, :, row.store : row.store + t] = k[row.start : row.end].transpose(0, 1)
        v_cache[row.slot, :, row.store : row.store + t] = v[row.start : row.end].transpose(0, 1)
        q_row = q[row.start : row.end].transpose(0, 1).unsqueeze(0)  # [1, heads, T, dim]
        if q_row.dtype != k_cache.dtype:
            q_row = q_row.to(k_cache.dtype)
        k_row = k_cache[row.slot : row.slot + 1, :, : row.kv_len]  # [1, kv_heads, S, dim]
        v_row = v_cache[row.slot : row.slot + 1, :, : row.kv_len]
        if row.mask is not None:
            outs.append(F.scaled_dot_product_attention(q_row, k_row, v_row, attn_mask=row.mask, enable_gqa=gqa))
            continue
        for j in range(t):  # query j sits at cache position kv_len - t + j
            end = row.kv_len - t + j + 1
            outs.append(F.scaled_dot_product_attention(
                q_row[:, :, j : j + 1], k_row[:, :, :end], v_row[:, :, :end], enable_gqa=gqa))  # fmt: skip
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, heads, N, dim]
    out = out[0].transpose(0, 1)  # [N, heads, dim]
    return out if out.dtype == q.dtype else out.to(q.dtype)


class CachePool:
    """A preallocated KV cache for `slots` sequences of up to `max_length` tokens each."""

    def __init__(self, model: NativeModel, slots: int = 1, max_length: int | None = None, kv_dtype=torch.float32):
        cfg = model.config
        if slots < 1:
            raise SpecdecError(f"a cache pool needs at least one slot, got {slots}", "slots")
        max_length = max_length or min(cfg.max_positions, DEFAULT_MAX_LENGTH)
        if not 1 <= max_length <= cfg.max_positions:
            raise SpecdecError(f"max_length must be in 1..{cfg.max_positions}, got {max_length}", "max_length")
        self.model, self.slots, self.max_length = model, slots, max_length
        shape = (cfg.num_layers, slots, cfg.num_kv_heads, max_length, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=kv_dtype, device=model.device)
        self.v = torch.zeros(shape, dtype=kv_dtype, device=model.device)
        self.cos, self.sin = model.rope_tables(max_length)  # [max_length, head_dim]
        self._free = list(range(slots - 1, -1, -1))
        self._hidden: torch.Tensor | None = None  # see hidden_buffer

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def new_sequence(self) -> NativeSequence:
        if not self._free:
            raise SpecdecError(f"all {self.slots} cache slots are in use", "slots")
        return NativeSequence(self, self._free.pop())

    def release(self, seq: NativeSequence) -> None:
        if seq.pool is not self or seq.slot is None:
            raise ValueError("this sequence does not hold a slot of this pool")
        self._free.append(seq.slot)
        seq.slot = None

    def forward_batch(self, sequences: list[NativeSequence], token_lists: list[list[int]],
                      last_only: bool = False) -> list[torch.Tensor]:
        """One packed forward that appends token_lists[i] to sequences[i]; logits [len_i, V]
        each, or with `last_only` just the last row [1, V] ([0, V] for an empty list)."""
        if len(sequences) != len(token_lists):
            raise ValueError("one token list per sequence")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in one batch")
        compiled = self.model.compiled and len(sequences) == 1
        tokens, positions, rows, lasts = [], [], [], []
        for seq, ids in zip(sequences, token_lists, strict=True):
            start, t = seq._check_append(len(ids)), len(ids)
            if t == 0:
                continue
            lasts.append(len(tokens) + t - 1)
            if compiled:  # pad to a bucket so a few compiled shapes serve every k; pads come last
                t = next((b for b in COMPILE_BUCKETS if b >= t and start + b <= self.max_length), t)
                ids = list(ids) + [ids[-1]] * (t - len(ids))
            tokens.extend(ids)
            positions.extend(range(start, start + t))
            mask = None  # a short chain attends query by query, bit-identical to decode steps
            if t > DECODE_ATTENTION_MAX:  # a long prompt: one causal pass
                mask = torch.ones(t, start + t, dtype=torch.bool, device=self.model.device).tril(start)
            rows.append(_Row(seq.slot, len(tokens) - t, len(tokens), start, start + t, mask))
        hidden, logits = self._run(tokens, positions, rows, compiled, lasts if last_only else None)
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

    def _run(self, tokens, positions, rows, compiled=False, logits_at=None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] on the model's device, logits [N, V] on the cpu."""
        cfg, dev = self.model.config, self.model.device
        if not tokens:
            return torch.empty(0, cfg.hidden_size, device=dev), torch.empty(0, cfg.vocab_size)

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(dev, non_blocking=True)

        at = None if logits_at is None else as_tensor(logits_at)
        hidden, logits = self.model.forward_packed(self, as_tensor(tokens), as_tensor(positions), rows, at, compiled)
        return hidden, logits.cpu()

    def hidden_buffer(self) -> torch.Tensor:
        """[slots, max_length, hidden] post-norm features of cached tokens, allocated on first use."""
        if self._hidden is None:
            cfg = self.model.config
            self._hidden = torch.zeros(self.slots, self.max_length, cfg.hidden_size, device=self.model.device)
        return self._hidden


class NativeSequence:
    """One cache slot of a pool: the ModelBackend protocol, plus `forward_tree` and `keep`."""

    def __init__(self, pool: CachePool, slot: int):
        self.pool, self.slot = pool, slot
        self.vocab_size = pool.model.config.vocab_size
        self.max_length = pool.max_length
        self.device = pool.model.device
        self._length = 0
        self._tree: tuple[int, list[int]] | None = None  # (length before the tree, parents)
        # Drafters that read target features (eagle) set keep_hidden; `hidden` then holds the
        # final post-norm hidden state of every cached token and rolls back with the cache.
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None  # [T, hidden] of the last forward
        self.supports_tree = True

    @property
    def length(self) -> int:
        return self._length

    @property
    def hidden(self) -> torch.Tensor | None:
        """[length, hidden] features of the cached tokens, when `keep_hidden` is set."""
        if not self.keep_hidden or self.slot is None:
            return None
        return self.pool.hidden_buffer()[self.slot, : self._length]

    def _store_hidden(self, start: int, rows: torch.Tensor) -> None:  # rows: [T, hidden]
        if self.keep_hidden:
            self.pool.hidden_buffer()[self.slot, start : start + rows.shape[0]] = rows
        self.last_hidden = rows

    def reset(self) -> None:
        self._length, self._tree = 0, None

    def prefill(self, token_ids: list[int], all_logits: bool = True) -> torch.Tensor:
        """Reset and feed `token_ids`; logits [T, V], or with all_logits=False only [1, V] of the
        last token, which skips the LM head for the rest of a long prompt."""
        self.reset()
        return self.pool.forward_batch([self], [list(token_ids)], last_only=not all_logits)[0]

    def forward(self, token_ids: list[int]) -> torch.Tensor:
        return self.pool.forward_batch([self], [list(token_ids)])[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}; the cache holds {self._length}")
        self._length, self._tree = length, None

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
        base = self._check_append(t)
        if t == 0:
            return torch.empty(0, self.vocab_size)
        mask = torch.cat([torch.ones(t, base, dtype=torch.bool), ancestor_mask(parents)], dim=1)  # [T, base+T]
        positions = [base + d for d in tree_depths(parents)]
        row = _Row(self.slot, 0, t, base, base + t, mask.to(self.device))
        hidden, logits = self.pool._run(list(token_ids), positions, [row])
        self._store_hidden(base, hidden)
        self._length, self._tree = base + t, (base, list(parents))
        return logits

    def keep(self, indices: list[int]) -> None:
        """Keep the tree path `indices` (root to leaf, in order) right after the pre-tree cache."""
        if self._tree is None:
            raise ValueError("keep() follows forward_tree()")
        base, parents = self._tree
        for j, node in enumerate(indices):
            if not 0 <= node < len(parents) or parents[node] != (indices[j - 1] if j else -1):
                raise ValueError(f"indices {indices} are not a root-to-leaf path of the tree")
        if indices != list(range(len(indices))):
            src = torch.tensor(indices, device=self.device) + base
            for cache in (self.pool.k, self.pool.v):
                view = cache[:, self.slot]  # [layers, kv_heads, max_length, dim]
                view[:, :, base : base + len(indices)] = view.index_select(2, src)
            if self.keep_hidden:
                rows = self.pool.hidden_buffer()[self.slot]  # [max_length, hidden]
                rows[base : base + len(indices)] = rows.index_select(0, src)
        self._length, self._tree = base + len(indices), None


# ---- building backends ---------------------------------------------------------------------

_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> {(precision, device): model}


def native_model_for(hf_model: torch.nn.Module, precision: str = "fp32", device=None,
                     compile: bool = False) -> NativeModel:
    """The NativeModel over a loaded HF model, built once per (precision, device) and shared."""
    device = torch.device(device) if device is not None else next(hf_model.parameters()).device
    models = _SHARED.setdefault(hf_model, {})
    key = (precision, str(device), bool(compile))
    if key not in models:
        models[key] = NativeModel.from_hf(hf_model, precision, device)
    return models[key]


def default_precision(device=None) -> str:
    """fp16 on x86 cpus (fbgemm's fp16 GEMM: the fastest kernel measured here, for 1 to 16
    tokens, at fp32's accuracy), else int4 on cpus; bf16 on accelerators."""
    if torch.device(device or "cpu").type != "cpu":
        return "bf16"
    return "fp16" if "fbgemm" in torch.backends.quantized.supported_engines else "int4"


def make_native_backend(target, precision: str | None = None, device=None, max_length: int | None = None,
                        slots: int = 1, compile: bool = False) -> NativeSequence:
    """A sequence over a fresh pool (its own KV cache) for a LoadedModel's weights."""
    if device is None:
        device = next(target.model.parameters()).device
    model = native_model_for(target.model, precision or default_precision(device), device, _flag(compile))
    pool = model.new_pool(int(slots), int(max_length) if max_length else None)
    if _flag(compile) and not model.compiled:
        model.compile(pool)  # traced on this pool's cache shapes; the seconds are in compile_seconds
    return pool.new_sequence()


def _flag(value) -> bool:  # options may arrive as strings from drafter specs or the CLI
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
