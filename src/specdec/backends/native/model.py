"""The native backend: a lean PyTorch Llama-family model over a static, slotted KV cache.

In gpt-fast's spirit: one plain forward function, weights in plain tensors, no framework.
- `NativeModel` owns the weights (built from a loaded HF model without copying fp32
  tensors, or straight from a GGUF / safetensors directory) and runs one packed forward.
- `CachePool` and `NativeSequence` (native_cache.py) own the static KV cache and implement
  the ModelBackend protocol over one slot of it.

A forward packs the new tokens of every row into one [N, hidden] batch, so the matmuls
(where the time goes) run once; attention then runs per row over that row's own cache
prefix, so rows of different lengths need no padding. Short chains (up to 32 tokens) attend
query by query, and with the row-wise bf16/int8/int4 kernels a token's logits are then the
same bits whether it is scored alone, among k drafts, or batched with other sequences.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdec.backends.native.quant import PRECISIONS, FusedLinear, Linear, make_linear, read_gguf
from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.backends.native.cache import CachePool, NativeSequence

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")
DEFAULT_MAX_LENGTH = 4096
NATIVE_OPTIONS = ("precision", "device", "max_length", "slots", "compile")
COMPILE_BUCKETS = (1, 2, 3, 4, 8, 16, 32)  # token counts the compiled forward is traced for
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
    # A token tree: (nodes in depth-first order, depth of each node), attended query by query
    # (see _tree_attention); the nodes' keys and values of every layer are kept in tree_kv.
    tree: tuple[list[int], list[int]] | None = None
    tree_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None


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
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0, dense_prompts: bool = False):
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

        def linear(name: str, precision: str) -> Linear:
            w = weight(name)
            return make_linear(w, bias(name), precision) if isinstance(w, torch.Tensor) else w

        def layers(precision: str) -> list[_Layer]:
            out = []
            for i in range(config.num_layers):
                p = f"model.layers.{i}."
                qkv = [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]
                gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
                out.append(_Layer(
                    config, tensor(p + "input_layernorm.weight"),
                    FusedLinear([weight(n) for n in qkv], [bias(n) for n in qkv], precision),
                    linear(p + "self_attn.o_proj", precision), tensor(p + "post_attention_layernorm.weight"),
                    FusedLinear([weight(n) for n in gate_up], [bias(n) for n in gate_up], precision),
                    linear(p + "mlp.down_proj", precision),
                ))  # fmt: skip
            return out

        self.embed = tensor("model.embed_tokens.weight")  # [V, hidden], fp32 for lookups
        self.layers = layers(precision)
        self.norm = tensor("model.norm.weight")
        if "lm_head.weight" not in state:  # tied embeddings
            state = {**state, "lm_head.weight": self.embed}
        # int4 keeps the LM head at int8, as 4-bit GGUFs keep their output matrix at 6-8 bits
        self.lm_head = linear("lm_head", "int8" if precision == "int4" else precision)
        # Prompts (forwards of more than DECODE_ATTENTION_MAX tokens) are compute-bound, and the
        # dense fp32 GEMM runs them about 1.5x faster here than the int kernels: with
        # `dense_prompts` they use fp32 layers over the same tensors (no copy when the state
        # is a loaded model's own); decode steps and drafts stay in `precision`.
        self.dense = None
        if dense_prompts and precision != "fp32":
            self.dense = (layers("fp32"), linear("lm_head", "fp32"))
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
        state = model.state_dict()
        shared = device is None or torch.device(device) == state["model.embed_tokens.weight"].device
        return cls(config, state, precision, device, rotary.inv_freq, float(rotary.attention_scaling),
                   dense_prompts=shared)  # fp32 prompt layers cost nothing when they share its tensors

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
        from specdec.backends.native.cache import CachePool  # it imports this module

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
                       logits_at: torch.Tensor | None = None, compiled: bool = False,
                       dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run N packed tokens (token j at rotary position positions[j]), storing keys and values
        where `rows` say. Returns the final post-norm hidden states [N, hidden] and the logits
        [N, V], or only those of the rows `logits_at` (a long prompt needs just its last)."""
        layers, lm_head = self.dense if dense and self.dense else (self.layers, self.lm_head)
        x = F.embedding(token_ids, self.embed)  # [N, hidden]
        cos, sin = pool.cos[positions].unsqueeze(1), pool.sin[positions].unsqueeze(1)  # [N, 1, dim]
        for i, layer in enumerate(layers):
            # calling the module runs its compiled graph, if any; .forward always runs eagerly
            x = (layer if compiled else layer.forward)(x, cos, sin, pool.k[i], pool.v[i], rows)
        x = F.rms_norm(x, (self.config.hidden_size,), self.norm, self.config.rms_eps)
        return x, lm_head(x if logits_at is None else x[logits_at]).float()


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
        if row.tree is not None:
            outs.append(_tree_attention(q, k, v, k_cache, v_cache, row, gqa))
            continue
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


def _tree_attention(q, k, v, k_cache, v_cache, row: _Row, gqa: bool) -> torch.Tensor:
    """A token tree, query by query: node i at depth d attends to the cache, its ancestors
    and itself laid out at positions base..base+d, exactly as a chain would hold them, so a
    tree scores each path with the bits of a one-token-per-step decode. Walking the nodes in
    depth-first order keeps a node's ancestors in place: it only writes its own keys at
    base+d. Returns [1, heads, T, dim] in node order."""
    order, depths = row.tree
    t, base = row.end - row.start, row.store
    k_nodes, v_nodes = k[row.start : row.end], v[row.start : row.end]  # [T, kv_heads, dim]
    row.tree_kv.append((k_nodes, v_nodes))  # for keep(), one entry per layer
    outs: list[torch.Tensor | None] = [None] * t
    for i in order:
        pos = base + depths[i]
        k_cache[row.slot, :, pos] = k_nodes[i]
        v_cache[row.slot, :, pos] = v_nodes[i]
        q_i = q[row.start + i].unsqueeze(0).unsqueeze(2)  # [1, heads, 1, dim]
        if q_i.dtype != k_cache.dtype:
            q_i = q_i.to(k_cache.dtype)
        outs[i] = F.scaled_dot_product_attention(
            q_i, k_cache[row.slot : row.slot + 1, :, : pos + 1], v_cache[row.slot : row.slot + 1, :, : pos + 1],
            enable_gqa=gqa)  # fmt: skip
    return torch.cat(outs, dim=2)


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


def check_device(device) -> torch.device:
    """A torch.device that exists on this machine, or a one-line SpecdecError."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SpecdecError(f"unknown device {str(device)!r}: {str(e).splitlines()[0]}", "device") from None
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        available = getattr(module, "is_available", lambda: False)()
        count = getattr(module, "device_count", lambda: 1)() if available else 0
        if not available or (device.index or 0) >= count:
            raise SpecdecError(f"device {str(device)!r} is not available on this machine", "device")
    return device


def compile_seconds(backend) -> float:
    """Seconds spent compiling the native model behind `backend`; 0 when it is not compiled."""
    model = getattr(getattr(backend, "pool", None), "model", None)
    return float(model.compile_seconds) if getattr(model, "compiled", False) else 0.0


def default_precision(device=None) -> str:
    """int4 on cpus, bf16 elsewhere. On SmolLM2-135M here (2 threads) int4 decodes at 2.0x the
    HF backend (fp16 1.7x: fbgemm's fp16 GEMM uses one thread; fp32 1.04x), it keeps the
    model's own Q4_1 weights up to bf16 rounding, and its logits do not depend on how many
    tokens a forward scores, so speculation reproduces plain greedy decoding bit for bit."""
    return "int4" if torch.device(device or "cpu").type == "cpu" else "bf16"


def make_native_backend(target, precision: str | None = None, device=None, max_length: int | None = None,
                        slots: int = 1, compile: bool = False) -> NativeSequence:
    """A sequence over a fresh pool (its own KV cache) for a LoadedModel's weights."""
    if device is None:
        device = next(target.model.parameters()).device
    device = check_device(device)
    model = native_model_for(target.model, precision or default_precision(device), device, _flag(compile))
    pool = model.new_pool(int(slots), int(max_length) if max_length else None)
    if _flag(compile) and not model.compiled:
        model.compile(pool)  # traced on this pool's cache shapes; the seconds are in compile_seconds
    return pool.new_sequence()


def _flag(value) -> bool:  # options may arrive as strings from drafter specs or the CLI
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
