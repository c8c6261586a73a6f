"""`eagle:DIR`: an EAGLE-style draft head (Li et al. 2024) trained by `specdec distill --kind eagle`.

The head is one decoder layer that works on the target's features (its last, post-norm hidden
state). At position i it reads the feature f_i and the embedding of the next token x_{i+1},
and predicts f_{i+1}; the target's frozen LM head turns a predicted feature into a token:

    f_{n-2}, emb(x_{n-1}) -> f'_{n-1} -> d1;   f'_{n-1}, emb(d1) -> f'_n -> d2; ...

x_{n-1} is the engine's pending token, whose own feature the target computes only in the next
verification pass. Positions holding real features stay in the head's KV cache; positions
holding its own guesses are rolled back before the next proposal.

The head can score only a frequency-ranked subset of the vocabulary (FR-Spec, Zhao et al.
2025), which keeps drafting cheap for large vocabularies; verification stays exact because
drafted tokens are checked by the target as usual.

The engine hands its backend over through `Drafter.bind_target`. The drafter reads the
target's features (`Backend.hidden`) and, through `Backend.feature_model()`, its embedding and
LM head as the backend holds them (a GGUF target's own blocks, no float model). The trained
head runs as the backend's `DraftHead`: a decoder layer on its kernels over a KV cache of its
own, rolled back by position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from specdec.backends import Backend, DraftHead, FeatureModel
from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.drafters.common import common_prefix
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams, logits_to_probs, sample

FORMAT = "specdec-eagle"
CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "eagle.safetensors"
_DIMS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "max_position_embeddings",
)


def head_config_from_target(model: nn.Module) -> dict:
    """The head's dimensions follow the target's, so its features and layer fit."""
    c = model.config.get_text_config()
    rope = getattr(c, "rope_parameters", None) or {}
    if "full_attention" in rope:  # Gemma 3 keeps rope settings per layer type
        rope = rope["full_attention"]
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": getattr(c, "num_key_value_heads", c.num_attention_heads),
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "rms_norm_eps": float(getattr(c, "rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "max_position_embeddings": int(getattr(c, "max_position_embeddings", 2048)),
    }


class EagleHead(nn.Module):
    """fc(concat(embedding, feature)) -> one Llama decoder layer -> predicted next feature."""

    def __init__(self, dims: dict):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

        self.dims = {k: dims[k] for k in _DIMS}
        config = LlamaConfig(
            vocab_size=1,  # the head has no vocabulary of its own
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
            hidden_size=dims["hidden_size"],
            intermediate_size=dims["intermediate_size"],
            num_hidden_layers=1,
            num_attention_heads=dims["num_attention_heads"],
            num_key_value_heads=dims["num_key_value_heads"],
            head_dim=dims["head_dim"],
            rms_norm_eps=dims["rms_norm_eps"],
            rope_parameters={"rope_type": "default", "rope_theta": dims["rope_theta"]},
            max_position_embeddings=dims["max_position_embeddings"],
        )
        config._attn_implementation = "sdpa"
        hidden = dims["hidden_size"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] target features f_i (or the head's own guesses)
        embeds: torch.Tensor,  # [B, T, H] embeddings of x_{i+1}
        mask: torch.Tensor | None,  # additive [B or 1, 1, T, keys] or None
        past: int = 0,
        cache=None,
    ) -> torch.Tensor:  # [B, T, H] predicted f_{i+1}
        x = self.fc(torch.cat([embeds, features], dim=-1))
        positions = torch.arange(past, past + x.shape[1], device=x.device).unsqueeze(0)  # [1, T]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary(x, positions),
        )
        return out[0] if isinstance(out, tuple) else out


def save_head(
    directory: str | Path, head: EagleHead, target_name: str, vocab_ids: torch.Tensor | None, extra: dict
) -> None:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if vocab_ids is not None:
        tensors["vocab_ids"] = vocab_ids.to(torch.int64).contiguous()
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"format": FORMAT, "target": target_name, **head.dims, **extra}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def load_head(directory: str | Path) -> tuple[EagleHead, torch.Tensor | None, dict]:
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.exists() or not weights_path.exists():
        raise SpecdecError(
            f"{directory} has no {CONFIG_FILE} + {WEIGHTS_FILE}; "
            "train one with `specdec distill --kind eagle`",
            "drafter",
        )
    config = json.loads(config_path.read_text())
    if config.get("format") != FORMAT:
        raise SpecdecError(f"{config_path} is not an EAGLE head config", "drafter")
    tensors = load_file(str(weights_path))
    vocab_ids = tensors.pop("vocab_ids", None)
    head = EagleHead(config)
    head.load_state_dict(tensors)
    return head.eval(), vocab_ids, config


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, head: EagleHead, vocab_ids: torch.Tensor | None, eos_token_ids,
                 precision: str | None = None, tree: bool = False, width: int = 4, max_nodes: int = 24):
        self.trained, self.vocab_ids, self.precision = head, vocab_ids, precision
        self.eos_token_ids = set(eos_token_ids)
        # EAGLE-2 trees: each level expands the `width` likeliest open nodes by their `width`
        # likeliest children; the `max_nodes` likeliest nodes of all levels are proposed.
        self.tree, self.width, self.max_nodes = tree, width, max_nodes
        self.backend: Backend | None = None  # the target backend, from bind_target
        self.features: FeatureModel | None = None  # its embedding and LM head, and the head's kernels
        self.head: DraftHead | None = None  # the trained head on those kernels, built on first bind
        self._params, self._generator = SamplingParams(), None
        self._reset()

    def bind_target(self, backend: Backend) -> None:
        """Read features from `backend`; the head is built on the first binding to its model
        (a pooled drafter is bound to each request's sequence of the same model)."""
        backend.enable_hidden_states()
        self.backend = backend
        features = backend.feature_model()
        if features == self.features:
            return
        if self.trained.dims["hidden_size"] != features.hidden_size:
            raise SpecdecError("the EAGLE head was trained for hidden size "
                               f"{self.trained.dims['hidden_size']}, the target has {features.hidden_size}",
                               "drafter")
        # FR-Spec: only the frequent rows of the LM head, which keeps drafting cheap for large vocabularies
        self.head = features.draft_head(self.trained.state_dict(), self.trained.dims, self.vocab_ids,
                                        self.precision)
        self.features = features
        self._reset()

    def _reset(self) -> None:
        self._exact = 0  # head positions computed from real target features
        self._tokens: list[int] = []  # the context those positions were computed for

    def begin(self, prompt_ids, params, generator) -> None:
        self._params, self._generator = params, generator
        self._reset()

    def _logits(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [H] -> logits [V] (or [len(vocab_ids)] on the FR-Spec subset)."""
        return self._logits_rows(feature.unsqueeze(0))[0]

    def _pick(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        if self._params.greedy:
            index = int(logits.argmax())
            return self._token(index), None
        if self.vocab_ids is not None:  # back to the full vocabulary, zero outside the subset
            full = torch.full((self.features.vocab_size,), float("-inf"), device=logits.device)
            full[self.vocab_ids] = logits
            logits = full
        probs = logits_to_probs(logits.cpu(), self._params)  # [V]
        return int(sample(probs, self._generator)), probs

    @torch.inference_mode()
    def propose(self, context_ids: list[int], k: int) -> Draft:
        if self.backend is None or self.head is None:
            raise SpecdecError("the eagle drafter was not bound to a target backend", "drafter")
        n = len(context_ids)
        features = self.backend.hidden  # [n-1, H]: every cached token, all but the pending one
        if k <= 0 or features is None or features.shape[0] != n - 1 or n < 2:
            return Draft([])
        # The head's cache holds positions computed from real features up to `exact`; later
        # ones (its own guesses, or another context's) are overwritten in place.
        exact = min(self._exact, max(0, common_prefix(self._tokens, context_ids, n) - 1))
        # New exact positions i = exact..n-2 read f_i and x_{i+1}.
        new_ids = torch.tensor(context_ids[exact + 1 : n], device=features.device)
        out = self._step(features[exact : n - 1], new_ids, exact)  # [T, H]
        self._exact, self._tokens = n - 1, list(context_ids)

        if self.tree and k > 1:
            return self._propose_tree(out[-1], n, min(k, self.backend.max_length - n))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        feature = out[-1]  # [H] predicted f_{n-1}, which predicts d1
        for i in range(k):
            token, probs = self._pick(self._logits(feature))
            tokens.append(token)
            if probs is not None:
                rows.append(probs)
            if token in self.eos_token_ids or i == k - 1 or n + i >= self.backend.max_length:
                break
            ids = torch.tensor([token], device=features.device)
            feature = self._step(feature.view(1, -1), ids, n - 1 + i)[-1]
        return Draft(tokens, torch.stack(rows) if rows else None)

    def _propose_tree(self, feature: torch.Tensor, n: int, depth: int) -> Draft:
        """An EAGLE-2 draft tree (Li et al. 2024) below the pending token, grown from the
        head's confidence: a node's score is the log-probability of its path under the head.
        Each level runs the head once over the `width` best nodes of the level above, all
        attending to the context and their own ancestors. The best `max_nodes` nodes of all
        levels form the tree, listed best first: parents come before children (a path's score
        only falls), and each node's first child is its likeliest, as `first_path` expects.

        The tree is deterministic (probs None): under sampling, verification follows the
        target's own sample down it, which keeps its distribution exactly (tree.verify_tree_sampling)."""
        dev = feature.device
        slot0 = n - 1  # head slots from here on hold tree nodes (the exact context is below)
        logp = torch.log_softmax(self._logits(feature), -1)  # [V'] scores of the roots
        best = logp.topk(min(self.width, logp.shape[-1]))
        # nodes: (score, depth, token, parent node or -1); node i's input feature is feeds[i]
        nodes = [(float(s), 0, self._token(int(i)), -1)
                 for s, i in zip(best.values, best.indices, strict=True)]
        feeds = [feature] * len(nodes)
        slot_of: dict[int, int] = {}  # node -> the head slot holding its keys and values
        level = list(range(len(nodes)))
        for d in range(depth - 1):
            level = sorted((i for i in level if nodes[i][2] not in self.eos_token_ids),
                           key=lambda i: -nodes[i][0])
            level = level[: self.width]
            if not level:
                break
            store, t = slot0 + len(slot_of), len(level)
            visible = torch.zeros(t, store + t, dtype=torch.bool, device=dev)  # [T, slots]
            visible[:, :slot0] = True
            for j, i in enumerate(level):
                slot_of[i] = store + j
                node = i
                while node >= 0:  # the node itself and its ancestors
                    visible[j, slot_of[node]] = True
                    node = nodes[node][3]
            ids = torch.tensor([nodes[i][2] for i in level], device=dev)
            out = self.head.forward_nodes(torch.stack([feeds[i] for i in level]).float(),
                                          self.features.embed(ids), [n - 1 + d] * t, store, visible)
            logp = torch.log_softmax(self._logits_rows(out), -1)  # [T, V']
            best = logp.topk(min(self.width, logp.shape[-1]), dim=-1)
            level_next = []
            for j, i in enumerate(level):
                for s, index in zip(best.values[j].tolist(), best.indices[j].tolist(), strict=True):
                    level_next.append(len(nodes))
                    nodes.append((nodes[i][0] + s, d + 1, self._token(index), i))
                    feeds.append(out[j])
            level = level_next
        # the best nodes of all levels; ties go to the shallower node, so parents stay first
        chosen = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))[: self.max_nodes]
        kept = set(chosen)
        chosen = [i for i in chosen if nodes[i][3] < 0 or nodes[i][3] in kept]
        index = {node: j for j, node in enumerate(chosen)}
        tokens = [nodes[i][2] for i in chosen]
        parents = [index.get(nodes[i][3], -1) for i in chosen]
        if all(p == j - 1 for j, p in enumerate(parents)):
            return Draft(tokens)
        return Draft(tokens, None, parents)

    def _token(self, index: int) -> int:
        """A row of the head's logits -> a token id (FR-Spec rows are a vocabulary subset)."""
        return index if self.vocab_ids is None else int(self.vocab_ids[index])

    def _logits_rows(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, H] -> logits [T, V] (or [T, len(vocab_ids)] on the FR-Spec subset)."""
        return self.head.logits(features).float()

    def _step(self, features: torch.Tensor, token_ids: torch.Tensor, past: int) -> torch.Tensor:
        embeds = self.features.embed(token_ids).float()  # [T, H]
        return self.head.forward(features.float(), embeds, past)


@register("eagle")
def _make(spec: DrafterSpec, target) -> Drafter:
    if not spec.arg:
        raise SpecdecError("the eagle drafter needs a directory: eagle:DIR "
                           "(made by `specdec distill --kind eagle`)", "drafter")
    head, vocab_ids, config = load_head(spec.arg)
    if config.get("vocab_size") not in (None, target.vocab_size):
        raise SpecdecError(f"the EAGLE head in {spec.arg} was trained for another vocabulary", "drafter")
    if "vocab" in spec.options:  # eagle:DIR:vocab=N keeps only the N most frequent of the saved ranking
        try:
            keep = int(spec.options["vocab"])
        except ValueError:
            raise SpecdecError(f"vocab must be an integer in {spec.text!r}", "drafter") from None
        if vocab_ids is not None and keep > 0:
            vocab_ids = vocab_ids[:keep]
        elif keep == 0:
            vocab_ids = None
    precision = spec.options.get("precision")  # eagle:DIR:precision=fp32 drafts without quantizing the head
    if precision not in (None, "fp32", "bf16", "int8"):
        raise SpecdecError(f"precision must be fp32, bf16 or int8 in {spec.text!r}", "drafter")
    try:  # eagle:DIR:tree=1[:width=4][:nodes=24] drafts EAGLE-2 trees
        tree = spec.options.get("tree", "0") not in ("0", "false", "no")
        width, max_nodes = int(spec.options.get("width", 4)), int(spec.options.get("nodes", 24))
    except ValueError:
        raise SpecdecError(f"width and nodes must be integers in {spec.text!r}", "drafter") from None
    if width < 1 or max_nodes < 1:
        raise SpecdecError(f"width and nodes must be at least 1 in {spec.text!r}", "drafter")
    return EagleDrafter(head, vocab_ids, target.eos_token_ids, precision, tree, width, max_nodes)
