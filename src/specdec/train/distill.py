"""`specdec distill`: train a draft model or an EAGLE head to match the target (DistillSpec, EAGLE).

kind=draft: a causal LM of the target's own architecture and tokenizer with a few layers,
initialised from the target's embeddings, LM head and evenly spaced layers. The embeddings
and LM head stay frozen (so the draft keeps the target's token space); the layers and the
final norm learn. Loss: forward KL(target || draft) on the target's top-k support. The target
is renormalised over its top-k tokens; the draft is normalised over the full vocabulary.

kind=eagle: one decoder layer over the target's features (see drafters/eagle.py). Loss, as in
EAGLE: smooth-L1 regression of the next feature plus a weighted forward KL of the tokens the
frozen LM head reads from the predicted feature. Input features get uniform noise so the head
tolerates its own errors when it drafts several tokens in a row. The head scores a
frequency-ranked vocabulary subset (FR-Spec) during training and drafting alike.

Both train on the target's generated tokens (weight 1) and on its prompt tokens (a smaller
weight): every position's target distribution is valid distillation signal.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.drafters.common import DecoderParts, causal_mask
from specdec.drafters.eagle import EagleHead, head_config_from_target
from specdec.errors import SpecdecError
from specdec.train.data import Example


@dataclass
class TrainSettings:
    kind: str = "draft"  # "draft" | "eagle"
    steps: int = 0  # 0: `epochs` passes over the data
    epochs: float = 3.0
    lr: float = 0.0  # 0: 5e-4 for a draft, 1e-3 for an EAGLE head
    batch_tokens: int = 2048
    seq_len: int = 512
    prompt_weight: float = 0.2
    layers: int = 4  # draft depth
    vocab: int = 16384  # EAGLE head's FR-Spec subset; 0 = the full vocabulary
    reg_weight: float = 1.0
    kl_weight: float = 0.1
    noise: float = 0.1  # EAGLE input noise, relative to the features' RMS
    unroll: int = 2  # EAGLE: also train on the head's own predicted features (1 = off)
    warmup: float = 0.05
    save_every: int = 50
    seed: int = 0

    def learning_rate(self) -> float:
        return self.lr or (5e-4 if self.kind == "draft" else 1e-3)


# ---- models ------------------------------------------------------------------------------

def draft_layer_ids(num_target_layers: int, num_layers: int) -> list[int]:
    """Evenly spaced, always including the first and last layers."""
    if num_layers >= num_target_layers:
        return list(range(num_target_layers))
    if num_layers == 1:
        return [0]
    step = (num_target_layers - 1) / (num_layers - 1)
    return sorted({round(i * step) for i in range(num_layers)})


def init_draft(target_model: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A shallow copy of the target's architecture with `num_layers` of its layers."""
    config = copy.deepcopy(target_model.config)
    text = config.get_text_config()
    total = text.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise SpecdecError(f"--layers must be between 1 and {total}, got {num_layers}", "layers")
    ids = draft_layer_ids(total, num_layers)
    text.num_hidden_layers = len(ids)
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[i] for i in ids]
    draft = type(target_model)(config)
    source = target_model.state_dict()
    state = {}
    for name in draft.state_dict():
        src = name
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            parts[at] = str(ids[int(parts[at])])
            src = ".".join(parts)
        state[name] = source[src].clone()
    draft.load_state_dict(state)
    draft.generation_config = copy.deepcopy(target_model.generation_config)
    return draft.to(next(target_model.parameters()).dtype)


def trainable_draft_params(draft: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    frozen = {id(draft.get_input_embeddings().weight), id(draft.get_output_embeddings().weight)}
    params = {}
    for name, p in draft.named_parameters():
        p.requires_grad_(id(p) not in frozen)
        if p.requires_grad:
            params[name] = p
    return params


# ---- batches -----------------------------------------------------------------------------

def make_chunks(examples: list[Example], seq_len: int) -> list[tuple[int, int, int]]:
    """(example, start, end) windows; a window is kept if it has a position to learn from."""
    chunks = []
    for i, ex in enumerate(examples):
        n = len(ex.tokens)
        for start in range(0, max(1, n - 1), seq_len):
            end = min(n, start + seq_len)
            if end - start >= 2:
                chunks.append((i, start, end))
    return chunks


def epoch_batches(chunks: list[tuple[int, int, int]], batch_tokens: int, seed: int) -> list[list[tuple]]:
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed)).tolist()
    batches, current, longest = [], [], 0
    for j in order:
        length = chunks[j][2] - chunks[j][1]
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(chunks[j])
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def collate(examples: list[Example], batch: list[tuple[int, int, int]], prompt_weight: float) -> dict:
    t = max(end - start for _, start, end in batch)
    b = len(batch)
    k = examples[0].topk_ids.shape[1]
    h = examples[0].hidden.shape[1]
    out = {
        "tokens": torch.zeros(b, t, dtype=torch.long),
        "valid": torch.zeros(b, t, dtype=torch.bool),
        "weight": torch.zeros(b, t),  # loss weight of the prediction made at each position
        "topk_ids": torch.zeros(b, t, k, dtype=torch.long),
        "topk_logits": torch.zeros(b, t, k),
        "hidden": torch.zeros(b, t, h),
    }
    for row, (i, start, end) in enumerate(batch):
        ex, n = examples[i], end - start
        out["tokens"][row, :n] = ex.tokens[start:end]
        out["valid"][row, :n] = True
        out["topk_ids"][row, :n] = ex.topk_ids[start:end]
        out["topk_logits"][row, :n] = ex.topk_logits[start:end]
        out["hidden"][row, :n] = ex.hidden[start:end].float()
        # Position p predicts token p+1: generated tokens weigh 1, prompt tokens less, and
        # the sequence's last position predicts nothing that was kept.
        nxt = torch.arange(start + 1, end + 1)
        w = torch.where(nxt >= ex.gen_start, 1.0, prompt_weight)
        w[nxt >= len(ex.tokens)] = 0.0
        out["weight"][row, :n] = w
    return out


def topk_kl(draft_logprobs: torch.Tensor, topk_logits: torch.Tensor, support: torch.Tensor | None = None):
    """Forward KL on the target's top-k support.

    draft_logprobs: [..., K] the draft's log-probabilities of the target's top-k tokens;
    topk_logits: [..., K] the target's logits for them; support: [..., K] bool, tokens the
    draft can score (all when None). Returns [...].
    """
    if support is not None:
        topk_logits = topk_logits.masked_fill(~support, float("-inf"))
    target_logprobs = topk_logits.log_softmax(-1)
    target_probs = target_logprobs.exp()
    terms = target_probs * (target_logprobs - draft_logprobs)
    return torch.nan_to_num(terms, nan=0.0, posinf=0.0, neginf=0.0).sum(-1)


def draft_loss(draft: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, dict]:
    logits = draft(input_ids=batch["tokens"], attention_mask=batch["valid"].long(), use_cache=False).logits
    logprobs = logits.float().log_softmax(-1)  # [B, T, V]
    kl = topk_kl(logprobs.gather(-1, batch["topk_ids"]), batch["topk_logits"])  # [B, T]
    w = batch["weight"]
    agree = (logits.argmax(-1) == batch["topk_ids"][..., 0]).float()
    loss = (kl * w).sum() / w.sum()
    return loss, {"kl": loss.item(), "top1": ((agree * w).sum() / w.sum()).item()}


class EagleTrainer:
    """Loss of an EAGLE head against stored features and top-k logits of the frozen target."""

    def __init__(self, target_model, head: EagleHead, vocab_ids: torch.Tensor | None,
                 settings: TrainSettings):
        self.parts = DecoderParts.of(target_model)
        self.head, self.settings = head, settings
        weight = self.parts.lm_head.weight.detach()
        self.rows = weight if vocab_ids is None else weight[vocab_ids]  # [Vs, H]
        self.index = None
        if vocab_ids is not None:  # token id -> position in the subset, or -1
            self.index = torch.full((weight.shape[0],), -1, dtype=torch.long)
            self.index[vocab_ids] = torch.arange(len(vocab_ids))
        self.generator = torch.Generator().manual_seed(settings.seed)

    def _predict(self, inputs: torch.Tensor, embeds: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
        """inputs, embeds: [B, T, H]; key_valid: [B, T] -> predicted next features [B, T, H]."""
        t = inputs.shape[1]
        mask = causal_mask(t, t, inputs.dtype, inputs.device).expand(len(inputs), 1, t, t).clone()
        mask.masked_fill_(~key_valid[:, None, None, :], torch.finfo(inputs.dtype).min)
        return self.head(inputs, embeds, mask)

    def _terms(self, pred, target, topk_ids, topk_logits, w) -> tuple[torch.Tensor, dict]:
        """Weighted regression + KL of predicted features [B, T, H] against the target's."""
        s = self.settings
        reg = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)  # [B, T]
        logits = pred @ self.rows.T  # [B, T, Vs]
        if self.parts.softcap:
            logits = torch.tanh(logits / self.parts.softcap) * self.parts.softcap
        logprobs = logits.float().log_softmax(-1)
        support = None
        if self.index is not None:
            topk_ids = self.index[topk_ids]
            support = topk_ids >= 0
            topk_ids = topk_ids.clamp(min=0)
        kl = topk_kl(logprobs.gather(-1, topk_ids), topk_logits, support)
        total = w.sum().clamp(min=1e-6)
        loss = (w * (s.reg_weight * reg + s.kl_weight * kl)).sum() / total
        top1 = logprobs.argmax(-1) == topk_ids[..., 0]
        if support is not None:
            top1 &= support[..., 0]
        return loss, {
            "reg": ((w * reg).sum() / total).item(),
            "kl": ((w * kl).sum() / total).item(),
            "top1": ((w * top1.float()).sum() / total).item(),
        }

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict]:
        s = self.settings
        feats = batch["hidden"]  # [B, T, H]
        valid = batch["valid"]
        inputs = feats[:, :-1]  # f_i, predicting f_{i+1}
        if s.noise > 0:
            rms = feats[valid].pow(2).mean().sqrt()
            noise = torch.rand(inputs.shape, generator=self.generator) * 2 - 1
            inputs = inputs + noise * s.noise * rms
        with torch.no_grad():
            embeds = self.parts.embed(batch["tokens"][:, 1:])  # [B, T-1, H] embeddings of x_{i+1}
        pair_valid = valid[:, 1:]  # position i+1 exists
        ids, logits, weight = batch["topk_ids"], batch["topk_logits"], batch["weight"]
        pred = self._predict(inputs, embeds, pair_valid)  # [B, T-1, H] predicted f_{i+1}
        loss, metrics = self._terms(pred, feats[:, 1:], ids[:, 1:], logits[:, 1:], weight[:, 1:] * pair_valid)
        if s.unroll >= 2 and pred.shape[1] >= 2:
            # Training-time test (after EAGLE-3): feed the head its own predicted features, as
            # drafting does from the second token of a chain on.
            pred2 = self._predict(pred[:, :-1], embeds[:, 1:], pair_valid[:, 1:])  # predicts f_{i+2}
            w2 = weight[:, 2:] * valid[:, 2:]
            loss2, m2 = self._terms(pred2, feats[:, 2:], ids[:, 2:], logits[:, 2:], w2)
            loss = loss + 0.5 * loss2
            metrics["top1_2"] = m2["top1"]
        return loss, metrics


# ---- the loop, with checkpoints ----------------------------------------------------------

class Checkpoint:
    """`state.json` + `params.safetensors` + `optimizer.safetensors` in one directory."""

    def __init__(self, directory: Path):
        self.directory = directory

    @property
    def state_path(self) -> Path:
        return self.directory / "state.json"

    def state(self) -> dict | None:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else None

    def save(self, params: dict, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from safetensors.torch import save_file

        self.directory.mkdir(parents=True, exist_ok=True)
        save_file({n: p.detach().contiguous() for n, p in params.items()},
                  str(self.directory / "params.safetensors"))
        moments = {}
        for name, p in params.items():
            st = optimizer.state.get(p)
            if st:
                moments[f"{name}.exp_avg"] = st["exp_avg"].contiguous()
                moments[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].contiguous()
                state.setdefault("adam_step", float(st["step"]))
        save_file(moments, str(self.directory / "optimizer.safetensors"))
        tmp = self.directory / "state.json.tmp"
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_path)  # the JSON lands last: it marks the checkpoint complete

    def load_into(self, params: dict, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from safetensors.torch import load_file

        saved = load_file(str(self.directory / "params.safetensors"))
        moments = load_file(str(self.directory / "optimizer.safetensors"))
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved[name])
                if f"{name}.exp_avg" in moments:
                    optimizer.state[p] = {
                        "step": torch.tensor(state.get("adam_step", state["step"]), dtype=torch.float32),
                        "exp_avg": moments[f"{name}.exp_avg"],
                        "exp_avg_sq": moments[f"{name}.exp_avg_sq"],
                    }


def batches_from(chunks, settings: TrainSettings, start_step: int) -> Iterator[list[tuple]]:
    """The batch of every global step from `start_step` on; epochs reshuffle deterministically."""
    step, epoch = 0, 0
    while True:
        for batch in epoch_batches(chunks, settings.batch_tokens, settings.seed + epoch):
            if step >= start_step:
                yield batch
            step += 1
        epoch += 1


def total_steps(chunks, settings: TrainSettings) -> int:
    if settings.steps:
        return settings.steps
    per_epoch = len(epoch_batches(chunks, settings.batch_tokens, settings.seed))
    return max(1, math.ceil(per_epoch * settings.epochs))


def train(
    params: dict[str, torch.nn.Parameter],
    loss_fn: Callable[[dict], tuple[torch.Tensor, dict]],
    examples: list[Example],
    settings: TrainSettings,
    checkpoint: Checkpoint,
    state: dict,
    say: Callable[[str], None] = print,
) -> dict:
    """Run (or resume) the loop up to the planned step count; returns the final state."""
    from tqdm import tqdm

    chunks = make_chunks(examples, settings.seq_len)
    if not chunks:
        raise SpecdecError("the distillation data has no sequence of two or more tokens", "data")
    steps = total_steps(chunks, settings)
    lr = settings.learning_rate()
    optimizer = torch.optim.AdamW(list(params.values()), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    start = 0
    if checkpoint.state() is not None:
        start = state["step"]
        checkpoint.load_into(params, optimizer, state)
        say(f"resuming from step {start} of {steps} ({checkpoint.directory})")
    state.update(total_steps=steps)
    history = state.setdefault("history", [])
    if start >= steps:
        return state
    warmup = max(1, int(settings.warmup * steps))
    bar = tqdm(total=steps, initial=start, desc=f"distill {settings.kind}", unit="step", dynamic_ncols=True)
    t0 = time.perf_counter()
    running = None
    batches = batches_from(chunks, settings, start)
    for step in range(start, steps):
        scale = ((step + 1) / warmup if step < warmup
                 else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup))))
        for group in optimizer.param_groups:
            group["lr"] = lr * scale
        batch = collate(examples, next(batches), settings.prompt_weight)
        loss, metrics = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
        optimizer.step()
        metrics["loss"] = loss.item()
        running = metrics if running is None else {k: 0.9 * running[k] + 0.1 * v for k, v in metrics.items()}
        history.append({"step": step + 1, **{k: round(v, 5) for k, v in metrics.items()}})
        bar.set_postfix({k: f"{v:.3f}" for k, v in running.items()})
        bar.update(1)
        state["step"] = step + 1
        state["train_s"] = round(state.get("train_s", 0.0) + time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        if (step + 1) % settings.save_every == 0 or step + 1 == steps:
            checkpoint.save(params, optimizer, state)
    bar.close()
    return state


def settings_dict(settings: TrainSettings) -> dict:
    return asdict(settings)


def new_eagle_head(target_model) -> EagleHead:
    """A head that starts as "the next feature is the current one": fc passes the feature
    half through and the layer's output projections start at zero, so its first predictions
    have the scale of real features (a copy of a target layer gave outputs far larger)."""
    head = EagleHead(head_config_from_target(target_model))
    hidden = head.dims["hidden_size"]
    with torch.no_grad():
        head.fc.weight.mul_(0.1)  # a little of the token embedding from the start
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.fc.bias.zero_()
        for name, param in head.layer.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
    return head.to(next(target_model.parameters()).dtype)


def apply_lora(draft: torch.nn.Module, rank: int) -> torch.nn.Module:
    """Wrap a draft with LoRA adapters on its attention and MLP projections (needs peft)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SpecdecError("--lora needs peft: pip install peft", "lora") from None
    names = {n.rsplit(".", 1)[-1] for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = sorted(names & {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
    if not targets:
        raise SpecdecError("--lora found no q/k/v/o or MLP projections in the draft", "lora")
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, bias="none")
    return get_peft_model(draft, config)


def lora_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}
