"""The native model: a lean PyTorch Llama-family model over a static, slotted KV cache.

In gpt-fast's spirit: one plain forward function, weights in plain tensors, no framework.
- `NativeModel` owns the weights (built from a loaded HF model without copying fp32
  tensors, or straight from a GGUF / safetensors directory) and runs one packed forward.
- `CachePool` (batch_runner.py) owns the static KV cache and packs sequences' tokens into
  forwards; `NativeSequence` (sequence.py) implements the `Backend` protocol over one slot of
  it; `DecoderLayer` (layer.py) is one decoder layer; backend.py builds it all for a target.

A forward packs the new tokens of every row into one [N, hidden] batch, so the matmuls
(where the time goes) run once; attention then runs per row over that row's own cache
prefix, so rows of different lengths need no padding. Short chains (up to 32 tokens) attend
query by query, and with the row-wise bf16/int8/int4 kernels a token's logits are then the
same bits whether it is scored alone, among k drafts, or batched with other sequences.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.backends.native.gguf.reader import read_gguf
from specdec.backends.native.gguf.state import float_state, quant_state
from specdec.backends.native.kernels.attention import kernel_rows, windowed
from specdec.backends.native.kernels.cpu import cpu_features, forced_fallback, gemm_rows_independent
from specdec.backends.native.kernels.linear import FusedLinear, Linear, bind_for_graphs, prompt_view
from specdec.backends.native.kernels.precisions import PRECISIONS, make_linear, make_lm_head
from specdec.backends.native.model.batch_runner import COMPILE_BUCKETS, CachePool
from specdec.backends.native.model.config import SUPPORTED_TYPES, KVRow, NativeConfig, default_inv_freq
from specdec.backends.native.model.hf_config import hf_state
from specdec.backends.native.model.layer import DecoderLayer, compiled_layer, rms_norm
from specdec.backends.native.model.one_call import StepStack
from specdec.errors import SpecdecError

# The precision of a GGUF read as it is: each matrix in the file's own quant type, through the
# per-type kernels of gguf/layers.py (CPU); the default for GGUF targets on a CPU.
GGUF_PRECISION = "gguf"


class NativeModel:
    """Weights and the forward pass; the cache lives in a `CachePool`."""

    def __init__(self, config: NativeConfig, state: dict, precision: str = "fp32", device=None,
                 dense_prompts: bool = False, lm_head: str = "auto"):
        """`state`: HF tensor names (see module doc); a value is a tensor or a layer the loader
        already built, and the embedding a tensor [V, hidden] or a lookup object (gguf/layers.
        QuantEmbedding: token ids [N] -> rows [N, hidden] fp32)."""
        self.config, self.precision = config, precision
        embed = state["model.embed_tokens.weight"]
        self.device = torch.device(device or (embed.device if isinstance(embed, torch.Tensor) else "cpu"))
        _check_precision(precision, self.device)
        weights = _StateReader(state, self.device)
        # fp32 rows for lookups, or the loader's own lookup
        self.embed = weights.tensor("model.embed_tokens.weight") if isinstance(embed, torch.Tensor) else embed
        self.layers = [_layer(config, weights, i, precision) for i in range(config.num_layers)]
        self.norm = weights.tensor("model.norm.weight")
        if "lm_head.weight" not in state:  # tied embeddings
            if not isinstance(embed, torch.Tensor):
                raise SpecdecError("a tied head over a quantized embedding needs the loader's "
                                   "lm_head.weight", "model")
            weights.state = {**state, "lm_head.weight": self.embed}
        # int4 keeps the LM head at 8 bits, as 4-bit GGUFs keep their output matrix at 6-8 bits
        head = weights.weight("lm_head")
        self.lm_head = (make_lm_head(head, weights.bias("lm_head"), precision, lm_head)
                        if isinstance(head, torch.Tensor) else head)
        # The head's rows as floats for a draft head's vocabulary subset (head_rows): the
        # loader's row lookup, or a tied embedding's; None reads them back through the head.
        self._head_lookup = state.get("lm_head.rows", self.embed if "lm_head.weight" not in state else None)
        self._head_bias = weights.bias("lm_head")
        # Prompts (forwards of more than DECODE_ATTENTION_MAX tokens) are compute-bound, and a
        # dense GEMM runs them faster than the int kernels: with `dense_prompts` they use dense
        # layers (prompt_precision): bf16 copies where the CPU multiplies bf16 natively, else
        # fp32 layers over the same tensors (no copy when the state is a loaded model's
        # own); decode steps and drafts stay in `precision`.
        # GGUF layers carry their own prompt kernels (bf16 tiles decoded from the blocks, see
        # gguf/layers.py): a second stack of layers over the same buffers runs them, no copy.
        self.dense = None
        if dense_prompts and precision != "fp32":
            dense = prompt_precision(self.device, precision)
            self.dense = ([_layer(config, weights, i, dense) for i in range(config.num_layers)],
                          weights.linear("lm_head", "fp32"))
        elif precision == GGUF_PRECISION:
            views = _StateReader({k: prompt_view(v) if isinstance(v, torch.nn.Module) else v
                                  for k, v in state.items()}, self.device)
            self.dense = ([_layer(config, views, i, precision) for i in range(config.num_layers)],
                          self.lm_head)
        intermediate = sum(self.layers[0].gate_up.sizes) // 2  # [gate, up] or phi3's [gate | up]
        self.prompt_group_tokens = prompt_group_tokens(config, intermediate, self.device, precision)
        self.short_chunk_rows = SHORT_CHUNK_ROWS if precision == GGUF_PRECISION else 0  # see forward_prompt
        # which layers take windowed rows
        self.sliding = [config.sliding(i) for i in range(config.num_layers)]
        self.local_rope = [config.local_rope(i) for i in range(config.num_layers)]
        # the decode rows of a forward through every layer's one-call step, its per-forward work done once
        self.step_stack = StepStack.build([layer.step for layer in self.layers], self.local_rope,
                                          self.sliding)
        self.inv_freq = rope_inv_freq(config).to(self.device)  # [head_dim / 2]
        self.attention_scaling = config.rope_attention_scaling
        local = config.rope_local_theta
        self.local_inv_freq = (None if local is None
                               else default_inv_freq(local, config.head_dim).to(self.device))
        self.compiled = False  # see compile()
        self.compile_seconds = 0.0

    @property
    def head_rows_independent(self) -> bool:
        """Whether the LM head computes each row on its own (the int kernels on a CPU), so that
        leaving rows out of it (CachePool.forward_batch's `unscored`) changes no other row's bits."""
        return self.precision in ("int4", "int8", GGUF_PRECISION) and self.device.type == "cpu"

    def compile(self, pool: CachePool | None = None) -> float:
        """torch.compile the decoder layer for single-sequence forwards, chains and token trees
        (a batch runs its sequences one by one), then trace every bucket on a scratch slot of
        `pool`; returns the seconds it took."""
        if not self.compiled:
            # each bucket (and the first cache lengths) traces its own graph; keep them all
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
            for layer in self.layers:
                bind_for_graphs(layer.modules())  # numba's and ORT's layers run eagerly in the graphs
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
            if seq.supports_tree:  # token trees take graphs of their own (the kernel's tree attention)
                for count in COMPILE_BUCKETS[1:]:
                    for _ in range(2):
                        seq.forward_tree([0] * count, [-1] + [i // 2 for i in range(count - 1)])
                        seq.keep([0])
                    seq.rollback(1)
        finally:
            pool.release(seq)
        self.compile_seconds += time.perf_counter() - start
        return self.compile_seconds

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_hf(cls, model: torch.nn.Module, precision: str = "fp32", device=None,
                lm_head: str = "auto") -> NativeModel:
        """Share the loaded transformers model's tensors (no copy for fp32 on its device)."""
        embed = model.get_input_embeddings().weight
        config = NativeConfig.from_hf(model.config, embed.dtype)
        state = hf_state(config.model_type, model.state_dict())
        state["lm_head.rows"] = model.get_output_embeddings().weight  # shared, for head_rows
        shared = device is None or torch.device(device) == embed.device
        return cls(config, state, precision, device, dense_prompts=shared,
                   lm_head=lm_head)  # fp32 prompt layers cost nothing when they share its tensors

    @classmethod
    def from_pretrained(cls, directory: str | Path, precision: str = "fp32", device=None) -> NativeModel:
        """A transformers model directory with safetensors weights, without building the HF model."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        state: dict = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            state.update(load_file(str(file)))
        embed = state.get("model.embed_tokens.weight")
        hf_config = AutoConfig.from_pretrained(str(directory), trust_remote_code=False)
        config = NativeConfig.from_hf(hf_config, embed.dtype if embed is not None else torch.float32)
        return cls(config, hf_state(config.model_type, state), precision, device)

    @classmethod
    def from_gguf(cls, path: str | Path, precision: str = GGUF_PRECISION, device=None,
                  lm_head: str = "auto") -> NativeModel:
        """Read a GGUF directly, memory-mapped. With the "gguf" precision every matrix stays in
        the file's quant type (gguf/layers.py' kernels); another precision dequantizes each
        tensor and builds that precision's layers from the floats."""
        model = read_gguf(path)
        if model.config["model_type"] not in SUPPORTED_TYPES:  # the layers would silently skip its features
            raise SpecdecError(f"the native backend supports {', '.join(SUPPORTED_TYPES)} models, not "
                               f"{model.config['model_type']!r} ({Path(path).name}); use the hf backend",
                               "backend")
        state = quant_state(model, lm_head) if precision == GGUF_PRECISION else float_state(model)
        inv_freq = None if model.rope_inv_freq is None else tuple(float(f) for f in model.rope_inv_freq)
        config = NativeConfig(**model.config, rope_inv_freq=inv_freq,
                              rope_attention_scaling=model.rope_attention_scaling)
        # another precision keeps the floats, so prompts may run dense over them (as from_hf's)
        return cls(config, state, precision, device, dense_prompts=precision != GGUF_PRECISION,
                   lm_head=lm_head)

    def new_pool(self, slots: int = 1, max_length: int | None = None, kv_dtype: torch.dtype | None = None,
                 prefix_cache: str = "prompt") -> CachePool:
        """A KV cache for `slots` sequences whose prefix caches run in mode `prefix_cache`, its
        elements `kv_dtype` (default: `default_kv_dtype`)."""
        return CachePool(self, slots, max_length, kv_dtype or self.default_kv_dtype, prefix_cache)

    @property
    def prompts_as_steps(self) -> bool:
        """Whether prompts may run as decode chains: where every linear is an int8-activation
        kernel (the layers run one call each), prompts already run on the decode kernels, so as
        chains they cost about what a prompt pass does (a little more attention at long
        contexts), and every row keeps a one-token step's bits."""
        return self.step_stack is not None

    @property
    def default_kv_dtype(self) -> torch.dtype:
        """bf16 for quantized or bf16 weights on a CPU: half the bytes a decode step reads at long
        contexts, with every row's bits still its own (a key is rounded once, when it is stored,
        whichever forward stores it; llama.cpp keeps 16-bit keys too). fp32 weights keep an fp32
        cache (they ask for full precision), and so does any other device."""
        quantized = self.device.type == "cpu" and self.precision != "fp32"
        return torch.bfloat16 if quantized else torch.float32

    def rope_tables(self, length: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [length, head_dim], computed as transformers does (bit for bit);
        with `local`, those of the sliding layers' own rope base (gemma3; else the same).

        transformers rotates with x * cos + cat(-x2, x1) * sin; the same products come from
        roll(x) * cat(-sin1, sin2), since negation is exact, in one op fewer.
        """
        local = local and self.local_inv_freq is not None
        inv_freq, scaling = (self.local_inv_freq, 1.0) if local else (self.inv_freq, self.attention_scaling)
        freqs = torch.arange(length, device=self.device).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * scaling, emb.sin() * scaling
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    # ---- forward -----------------------------------------------------------------------

    @torch.no_grad()  # not inference_mode: compiled graphs write the cache in place
    def forward_packed(self, pool: CachePool, token_ids: torch.Tensor, positions: torch.Tensor,
                       rows: list[KVRow], logits_at: torch.Tensor | None = None, compiled: bool = False,
                       dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run N packed tokens (token j at rotary position positions[j]), storing keys and values
        where `rows` say. Returns the final post-norm hidden states [N, hidden] and the logits
        [N, V], or only those of the rows `logits_at` (a long prompt needs just its last)."""
        cfg = self.config
        layers, lm_head = self.dense if dense and self.dense else (self.layers, self.lm_head)
        x = self.embed_tokens(token_ids)  # [N, hidden]
        tables = [(pool.cos[positions].unsqueeze(1), pool.sin[positions].unsqueeze(1))]  # [N, 1, dim] each
        if self.local_inv_freq is not None:
            tables.append((pool.local_cos[positions].unsqueeze(1), pool.local_sin[positions].unsqueeze(1)))
        row_sets = (rows, windowed(rows, cfg.sliding_window, pool.group, self.device, pool.kernel)
                    if any(self.sliding) else rows)
        one_call = self._one_call_rows(pool, row_sets) if not compiled and layers is self.layers else None
        if one_call is not None:
            x = self.step_stack(x, tables, one_call, pool.layer_caches)
            for row in rows:  # a tree's nodes are in the cache at store.. (kernel_rows), not kept aside
                row.tree_kv = None
        else:
            x = self._layers(layers, x, tables, row_sets, pool, compiled)
        x = rms_norm(x, self.norm, cfg.rms_eps, torch.float32)
        if logits_at is not None and logits_at.numel() == 0:  # every row unscored: no LM head at all
            return x, x.new_zeros(0, cfg.vocab_size)
        return x, self.head_logits(x if logits_at is None else x[logits_at], lm_head)

    def _layers(self, layers: list, x: torch.Tensor, tables: list, row_sets: tuple, pool: CachePool,
                compiled: bool) -> torch.Tensor:
        """x [N, hidden] through the decoder layers one call each, residuals included."""
        pending = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(layers, pool.layer_caches, strict=True)):
            (cos, sin), layer_rows = tables[self.local_rope[i]], row_sets[self.sliding[i]]
            if compiled:  # calling the module runs its compiled graph
                x = compiled_layer(layer, x, cos, sin, k_cache, v_cache, layer_rows)
            else:  # each residual add joins the norm after it (forward_open)
                x, pending = layer.forward_open(x, pending, cos, sin, k_cache, v_cache, layer_rows)
        return x if pending is None else x + pending

    def _one_call_rows(self, pool: CachePool, row_sets: tuple) -> tuple | None:
        """kernel_rows' arrays of each row set where every layer runs the rows as one call
        (StepStack), else None."""
        if self.step_stack is None:
            return None
        arrays = tuple(kernel_rows(rows, pool.group, self.device, pool.k.dtype) for rows in row_sets)
        return None if any(a is None for a in arrays) else arrays

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [N] -> the first layer's inputs [N, hidden] fp32 (scaled where the architecture
        scales them)."""
        x = (F.embedding(token_ids, self.embed) if isinstance(self.embed, torch.Tensor)
             else self.embed(token_ids))
        return x * self.config.embedding_scale if self.config.embedding_scale != 1.0 else x

    def head_logits(self, hidden: torch.Tensor, lm_head: Linear | None = None) -> torch.Tensor:
        """Post-norm hidden states [N, hidden] -> logits [N, V] fp32, soft-capped where the model
        caps them."""
        logits = (self.lm_head if lm_head is None else lm_head)(hidden).float()
        cap = self.config.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap is not None else logits

    @torch.no_grad()
    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the LM head's weights -> [n, hidden] fp32. Without a row lookup they
        are read back through the head, one basis vector per hidden unit (its bias taken off):
        the kernel's own weights, for a draft head's logits, which need only be close."""
        rows = self._head_lookup
        if isinstance(rows, torch.Tensor):
            return F.embedding(ids, rows).float()
        if rows is not None:
            return rows(ids).float()
        out = self.lm_head(torch.eye(self.config.hidden_size, device=self.device)).float()  # [hidden, V]
        if self._head_bias is not None:
            out = out - self._head_bias.float()
        return out[:, ids].T.contiguous()


class _StateReader:
    """A state dict's entries on the model's device: fp32 tensors (norms), weights (a tensor,
    or a layer the loader already built), biases and linears."""

    def __init__(self, state: dict, device: torch.device):
        self.state, self.device = state, device

    def tensor(self, name: str) -> torch.Tensor:
        return self.state[name].detach().to(self.device, torch.float32)

    def weight(self, name: str):
        w = self.state[name + ".weight"]
        return w.detach().to(self.device) if isinstance(w, torch.Tensor) else w

    def bias(self, name: str) -> torch.Tensor | None:
        b = self.state.get(name + ".bias")
        return None if b is None else b.detach().to(self.device)

    def linear(self, name: str, precision: str) -> Linear:
        w = self.weight(name)
        return make_linear(w, self.bias(name), precision) if isinstance(w, torch.Tensor) else w

    def fused(self, names: list[str], joined: str, precision: str) -> FusedLinear:
        """The linears `names` as one FusedLinear, or the checkpoint's own fused matrix
        `joined` (phi3's qkv_proj, gate_up_proj) as its single part."""
        if isinstance(self.state.get(joined + ".weight"), FusedLinear):  # the loader fused them already
            return self.state[joined + ".weight"]
        names = [joined] if joined + ".weight" in self.state else names
        return FusedLinear([self.weight(n) for n in names], [self.bias(n) for n in names], precision)


def _layer(config: NativeConfig, weights: _StateReader, i: int, precision: str) -> DecoderLayer:
    """Layer i from HF names (gemma3's sandwich: post_attention_layernorm normalizes the
    attention's output and pre_feedforward_layernorm the MLP's input)."""
    p = f"model.layers.{i}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv = weights.fused([attn + "q_proj", attn + "k_proj", attn + "v_proj"], attn + "qkv_proj", precision)
    gate_up = weights.fused([mlp + "gate_proj", mlp + "up_proj"], mlp + "gate_up_proj", precision)
    sandwich = config.sandwich_norms
    mlp_norm = p + ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm") + ".weight"
    qk_norms = ((weights.tensor(attn + "q_norm.weight"), weights.tensor(attn + "k_norm.weight"))
                if config.qk_norm else (None, None))
    post_norms = ((weights.tensor(p + "post_attention_layernorm.weight"),
                   weights.tensor(p + "post_feedforward_layernorm.weight"))
                  if sandwich else (None, None))
    return DecoderLayer(config, weights.tensor(p + "input_layernorm.weight"), qkv,
                        weights.linear(attn + "o_proj", precision), weights.tensor(mlp_norm), gate_up,
                        weights.linear(mlp + "down_proj", precision), *qk_norms, *post_norms)


def rope_inv_freq(config: NativeConfig) -> torch.Tensor:
    """The full layers' inverse frequencies [head_dim / 2]: the config's (a scaled rope) or the default."""
    if config.rope_inv_freq is not None:
        return torch.tensor(config.rope_inv_freq, dtype=torch.float32)
    return default_inv_freq(config.rope_theta, config.head_dim)


# prompt tokens per forward where the prompt layers compute each row on its own: a GGUF layer
# decodes its weight tiles once per forward, so more chunks share that cost, and a bigger GEMM
# runs faster; the activations of this many tokens stay small beside the weights
PROMPT_GROUP_TOKENS = 512
# a GGUF prompt chunk shorter than this runs the decode kernels: decoding every int4 weight tile
# to bf16 costs more than the int4 kernel's per-row work up to about this many rows
# (docs/performance-notes.md); at or above it, the prompt kernels
SHORT_CHUNK_ROWS = 32


def prompt_group_tokens(config: NativeConfig, intermediate: int, device: torch.device,
                        precision: str) -> int | None:
    """How many prompt tokens one forward may take (CachePool.forward_prompt): several chunks
    for GGUF layers on a CPU whose bf16 GEMM gives a row the same bits in any row count
    (gemm_rows_independent; their other prompt kernels compute each row on its own), so a
    chunk's bits do not depend on its group; otherwise None: one chunk a forward, whose shape
    its positions fix (prefix_cache.prefill_chunks). Float checkpoints' dense prompt layers
    keep one chunk a forward: their fp32 prompt head is not row-independent."""
    if device.type != "cpu" or precision != GGUF_PRECISION:
        return None
    widths = {config.hidden_size, intermediate, config.num_heads * config.head_dim}
    # every K a prompt tile multiplies, at a whole tile (512 rows) and at a narrow remainder
    if not all(gemm_rows_independent(torch.bfloat16, k, n) for k in sorted(widths) for n in (512, 64)):
        return None
    return PROMPT_GROUP_TOKENS


def prompt_precision(device: torch.device, precision: str) -> str:
    """The dense layers' precision for the prompts of a model decoding in `precision`: bf16
    for int4 and int8 (whose kernels take bf16 activations anyway) where the CPU multiplies
    bf16 natively (about 1.5x fp32's prefill on an AMX CPU), else fp32 (AVX2 emulates bf16)."""
    native_bf16 = {"amx_bf16", "avx512_bf16"} & cpu_features()
    bf16 = precision in ("int4", "int8") and device.type == "cpu" and native_bf16 and not forced_fallback()
    return "bf16" if bf16 else "fp32"


def _check_precision(precision: str, device: torch.device) -> None:
    if precision not in (*PRECISIONS, GGUF_PRECISION):
        raise SpecdecError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}, "
                           f"{GGUF_PRECISION} (a GGUF's own types)", "precision")
    if precision in ("fp16", "int8", "int4", GGUF_PRECISION) and device.type != "cpu":
        raise SpecdecError(f"precision {precision} runs on cpu only; use fp32 or bf16 on {device}",
                           "precision")
    if precision == "fp16" and "fbgemm" not in torch.backends.quantized.supported_engines:
        raise SpecdecError("precision fp16 needs fbgemm (x86 cpus); use int4", "precision")


# ---- building backends ---------------------------------------------------------------------


