"""A draft head's decoder layer on the native kernels, and the target's parts it reads.

EAGLE's head (drafters/eagle.py) is one Llama decoder layer over the target's features. It
drafts through the `DraftHead` protocol (backends/__init__.py): this module builds that head
from the trained weights, on the native `DecoderLayer` (weight-only int8 on a cpu) over a
static KV cache of its own, so rollback is a position and a drafted token costs a few small
GEMMs. Its predictions only need to be close to the trained module's: the target verifies.

`NativeFeatures` is the native backend's `FeatureModel`: the target's embedding and LM head
as the backend holds them (a GGUF's own blocks, no fp32 model), and this head's builder. The
transformers backend builds the same head over its model's modules (hf.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.backends.native.kernels.attention import new_cache
from specdec.backends.native.kernels.linear import FusedLinear
from specdec.backends.native.kernels.precisions import make_linear
from specdec.backends.native.model.config import DECODE_ATTENTION_MAX, KVRow, NativeConfig, default_inv_freq
from specdec.backends.native.model.layer import DecoderLayer


class HeadSource(Protocol):
    """What the draft head reads of the target model (model/native_model.NativeModel)."""

    config: NativeConfig
    device: torch.device

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> the first layer's inputs [T, hidden] fp32."""
        ...

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden states [T, hidden] -> logits [T, V] fp32."""
        ...

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [n] of the LM head's weights -> [n, hidden] fp32."""
        ...

# The head's weights as `drafters.eagle.EagleHead.state_dict()` names them (transformers' Llama layer).
_LAYER = "layer."
_ATTN, _MLP = _LAYER + "self_attn.", _LAYER + "mlp."


class NativeDraftHead:
    """fc(concat(embedding, feature)) -> one decoder layer -> predicted next feature, then the
    target's LM head (or its rows `vocab_ids`, FR-Spec) for logits. Implements `DraftHead`."""

    def __init__(self, state: dict[str, torch.Tensor], dims: dict, precision: str | None,
                 device: torch.device, full_logits: Callable[[torch.Tensor], torch.Tensor],
                 head_rows: torch.Tensor | None, softcap: float | None):
        if precision is None:  # int8 GEMMs on a cpu (bf16 activations); fp32 elsewhere
            precision = "int8" if device.type == "cpu" else "fp32"
        self.config = NativeConfig(
            model_type="llama", vocab_size=1, hidden_size=dims["hidden_size"], num_layers=1,
            num_heads=dims["num_attention_heads"], num_kv_heads=dims["num_key_value_heads"],
            head_dim=dims["head_dim"], rms_eps=dims["rms_norm_eps"],
            max_positions=dims["max_position_embeddings"], rope_theta=dims["rope_theta"],
        )

        def w(name: str) -> torch.Tensor:
            return state[name + ".weight"].detach().to(device, torch.float32)

        def b(name: str) -> torch.Tensor | None:
            bias = state.get(name + ".bias")
            return None if bias is None else bias.detach().to(device, torch.float32)

        qkv = [_ATTN + "q_proj", _ATTN + "k_proj", _ATTN + "v_proj"]
        gate_up = [_MLP + "gate_proj", _MLP + "up_proj"]
        self.layer = DecoderLayer(
            self.config, w(_LAYER + "input_layernorm"),
            FusedLinear([w(n) for n in qkv], [b(n) for n in qkv], precision),
            make_linear(w(_ATTN + "o_proj"), b(_ATTN + "o_proj"), precision),
            w(_LAYER + "post_attention_layernorm"),
            FusedLinear([w(n) for n in gate_up], [b(n) for n in gate_up], precision),
            make_linear(w(_MLP + "down_proj"), b(_MLP + "down_proj"), precision),
        )
        self.fc = make_linear(w("fc"), b("fc"), precision)
        self.device = device
        # [head_dim / 2]
        self.inv_freq = default_inv_freq(self.config.rope_theta, self.config.head_dim).to(device)
        # FR-Spec rows of the LM head: int8 on a cpu, where an fp32 GEMV over them is most of a
        # drafted token's cost (docs/performance-notes.md); draft logits need not match the target's.
        self._full_logits, self._softcap = full_logits, softcap
        self._rows = (None if head_rows is None
                      else make_linear(head_rows.to(device, torch.float32), None,
                                       "int8" if device.type == "cpu" else "fp32"))
        self._alloc(256)

    def _alloc(self, length: int) -> None:
        c = self.config
        # see attention.py
        self.k, self.v = new_cache((1,), c.num_kv_heads, length, c.head_dim, device=self.device)
        positions = torch.arange(length, device=self.device).float()
        freqs = positions[:, None] * self.inv_freq[None, :]
        # the rotation transformers applies (see NativeModel.rope_tables)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sin = emb.sin()
        self.cos, self.sin = emb.cos(), torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def _fit(self, length: int) -> None:
        if length > self.cos.shape[0]:  # grow the cache (doubling), keeping what it holds
            old_k, old_v = self.k, self.v
            self._alloc(max(2 * self.cos.shape[0], length))
            held = old_v.shape[2]  # positions (old_k holds them in its blocks)
            self.k[..., : old_k.shape[-3], :, :], self.v[:, :, :held] = old_k, old_v

    @torch.no_grad()
    def forward(self, features: torch.Tensor, embeds: torch.Tensor, past: int) -> torch.Tensor:
        t = features.shape[0]
        self._fit(past + t)
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [T, H]
        mask = None  # a few tokens attend query by query; a long first call takes one causal pass
        if t > DECODE_ATTENTION_MAX:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)
        rows = [KVRow(0, 0, t, past, past + t, mask)]
        # [T, 1, dim]
        cos, sin = self.cos[past : past + t].unsqueeze(1), self.sin[past : past + t].unsqueeze(1)
        return self.layer.forward(x, cos, sin, self.k, self.v, rows)

    @torch.no_grad()
    def forward_nodes(self, features: torch.Tensor, embeds: torch.Tensor, positions: list[int],
                      store: int, visible: torch.Tensor) -> torch.Tensor:
        t = features.shape[0]
        self._fit(store + t)
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [T, H]
        at = torch.tensor(positions, device=self.device)
        cos, sin = self.cos[at].unsqueeze(1), self.sin[at].unsqueeze(1)  # [T, 1, dim]
        return self.layer.forward(x, cos, sin, self.k, self.v, [KVRow(0, 0, t, store, store + t, visible)])

    @torch.no_grad()
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        if self._rows is None:
            return self._full_logits(features)
        logits = self._rows(features)
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()


@dataclass(frozen=True)
class NativeFeatures:
    """The native backend's `FeatureModel`: one per model, equal for sequences that share it."""

    model: HeadSource

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.head_logits(features)

    def draft_head(self, state: dict[str, torch.Tensor], dims: dict, vocab_ids: torch.Tensor | None,
                   precision: str | None = None) -> NativeDraftHead:
        rows = None if vocab_ids is None else self.model.head_rows(vocab_ids.to(self.model.device))
        softcap = self.model.config.final_logit_softcap
        return NativeDraftHead(state, dims, precision, self.model.device, self.logits, rows, softcap)
