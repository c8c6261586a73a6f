"""Distillation data: the target's own outputs, with its top-k logits and features, on disk.

Sources are prompts (a JSONL file, the built-in training set, or a traffic log). For each
source the target generates its answer (through the specdec engine with the ngram drafter,
which is lossless and faster than plain decoding); then one teacher-forced forward over
prompt + answer records, at every position:
- the target's top-k next-token logits (`topk_ids` int32 [N, K], `topk_logits` fp16 [N, K]),
- its final post-norm hidden state (`hidden` bf16 [N, H]), which the EAGLE head learns from.
Training then never reruns the target. A traffic log already holds the target's outputs, so
its records skip generation.

Shards of `shard_size` sequences are written as they complete, with `meta.json` counting
the sources done, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.prompts import encode
from specdec.tools import tool_plan
from specdec.traffic_log import read_traffic

DATA_FORMAT = "specdec-distill-data"


@dataclass
class Source:
    """One training conversation: user turns answered by the target in turn, or a logged answer."""

    turns: list[str] | None = None  # user messages (Spec-Bench `turns`)
    messages: list[dict] | None = None  # a chat prefix, answered once
    text: str | None = None  # a raw-text prompt (no chat template)
    logged_output: str | None = None  # the target's answer, from a traffic log
    logged_stop: bool = False  # the logged answer ended with EOS
    tools: list[dict] | None = None  # the request's tools, shown to the model as the server showed them
    category: str = ""

    def key(self) -> str:
        fields = ([self.turns, self.messages, self.text, self.logged_output]
                  + ([self.tools] if self.tools else []))
        return json.dumps(fields, sort_keys=True)

    def first_prompt(self) -> str | list[dict]:
        """The prompt used to measure τ: chat messages, or raw text (no chat template)."""
        if self.turns:
            return [{"role": "user", "content": self.turns[0]}]
        return self.messages if self.messages else self.text or ""


def load_sources(path: str | os.PathLike) -> list[Source]:
    """JSONL, one of per line: {"turns": [...]} (Spec-Bench), {"prompt": "..."}, {"messages": [...]}."""
    path = Path(path)
    if not path.is_file():
        raise SpecdecError(f"data file not found: {path}", "data")
    sources = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecError(f"{where}: not JSON ({e.msg})", "data") from None
            sources.append(_parse_source(obj, where))
    if not sources:
        raise SpecdecError(f"{path} holds no prompts", "data")
    return sources


def _parse_source(obj, where: str) -> Source:
    if not isinstance(obj, dict):
        raise SpecdecError(f"{where}: expected a JSON object", "data")
    category = str(obj.get("category", ""))
    if "turns" in obj:
        turns = obj["turns"]
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise SpecdecError(f"{where}: turns must be a non-empty list of non-empty strings", "data")
        return Source(turns=turns, category=category)
    if "messages" in obj:
        msgs = obj["messages"]
        if not _valid_messages(msgs):
            raise SpecdecError(f"{where}: messages must be a list of {{role, content}} objects", "data")
        return Source(messages=msgs, category=category)
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return Source(turns=[obj["prompt"]], category=category)
    raise SpecdecError(f"{where}: expected a 'turns', 'messages' or 'prompt' field", "data")


def _valid_messages(msgs, tool_messages: bool = False) -> bool:
    """A list of {role, content} messages; with `tool_messages`, an assistant message may
    carry `tool_calls` instead of content (prompts.encode checks the calls themselves)."""
    def valid(m) -> bool:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return False
        return isinstance(m.get("content"), str) or (tool_messages and m.get("content") is None
                                                      and bool(m.get("tool_calls")))
    return isinstance(msgs, list) and bool(msgs) and all(valid(m) for m in msgs)


def sources_from_logs(directory: str | os.PathLike, target_name: str) -> tuple[list[Source], int]:
    """Logged (prompt, output) pairs made by this target; returns (sources, records skipped)."""
    sources, skipped = [], 0
    for rec in read_traffic(directory):
        meta = rec.get("meta") or {}
        if meta.get("target") not in (None, target_name):
            skipped += 1  # another model's outputs are not this target's distribution
            continue
        prompt = rec["prompt"]
        stop = meta.get("finish_reason") in ("stop", "tool_calls")  # both ended with EOS
        tools = meta.get("tools") or None
        if isinstance(prompt, str):
            if meta.get("chat", True):
                sources.append(Source(turns=[prompt], logged_output=rec["output"], logged_stop=stop))
            else:
                sources.append(Source(text=prompt, logged_output=rec["output"], logged_stop=stop))
        elif _valid_messages(prompt, tool_messages=True):
            sources.append(Source(messages=prompt, logged_output=rec["output"], logged_stop=stop,
                                  tools=tools))
        else:
            skipped += 1
    if not sources:
        raise SpecdecError(f"{directory} holds no usable records for target {target_name!r}", "from_logs")
    return sources, skipped


def split_heldout(sources: list[Source], max_heldout: int) -> tuple[list[Source], list[Source]]:
    """Every tenth source (at least one, at most `max_heldout`) is kept out of training."""
    if len(sources) < 2 or max_heldout <= 0:
        return sources, []
    held = set(range(9, len(sources), 10)) or {len(sources) - 1}
    held = set(sorted(held)[:max_heldout])
    train = [s for i, s in enumerate(sources) if i not in held]
    return train, [sources[i] for i in sorted(held)]


def fingerprint(sources: list[Source]) -> str:
    h = hashlib.sha256()
    for s in sources:
        h.update(s.key().encode())
    return h.hexdigest()[:16]


@dataclass
class DataSettings:
    max_new_tokens: int = 192
    temperature: float = 0.0
    topk: int = 64
    max_seq_len: int = 1024  # longer conversations are cut (prompt kept first)
    shard_size: int = 16
    seed: int = 0
    backend: str = "hf"  # the engine backend that generates the answers


@dataclass
class TokenSeq:
    tokens: list[int]
    gen_start: int  # index of the first token the target generated


def _generate_sequences(engine, source: Source, settings: DataSettings, seed: int) -> list[TokenSeq]:
    """Run the target on one source: one sequence per answered turn."""
    tok = engine.tokenizer
    if source.logged_output is not None:
        prompt = source.text if source.text is not None else (source.messages or [
            {"role": "user", "content": source.turns[0]}])
        plan = tool_plan(source.tools) if source.tools else None
        ids = encode(tok, prompt, chat=source.text is None, max_length=engine.backend.max_length, tools=plan)
        out = tok.encode(source.logged_output, add_special_tokens=False)
        if source.logged_stop and tok.eos_token_id is not None:
            out.append(tok.eos_token_id)
        return [TokenSeq(ids + out, len(ids))]
    kwargs = dict(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, seed=seed)
    if source.text is not None:
        r = engine.generate(source.text, chat=False, **kwargs)
        return [TokenSeq(r.prompt_ids + r.token_ids, len(r.prompt_ids))]
    messages = list(source.messages or [])
    turns = source.turns or [None]
    seqs = []
    for turn in turns:
        if turn is not None:
            messages.append({"role": "user", "content": turn})
        if len(encode(tok, messages)) + 2 > engine.backend.max_length:
            break
        r = engine.generate(messages, **kwargs)
        seqs.append(TokenSeq(r.prompt_ids + r.token_ids, len(r.prompt_ids)))
        messages.append({"role": "assistant", "content": r.text})
    return seqs


@torch.inference_mode()
def teacher_forward(model, tokens: list[int], topk: int) -> dict[str, torch.Tensor]:
    """One forward over a whole sequence: top-k logits [N, K] and features [N, H]."""
    ids = torch.tensor([tokens], dtype=torch.long, device=next(model.parameters()).device)
    out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    logits = out.logits[0].float()  # [N, V]
    values, indices = torch.topk(logits, min(topk, logits.shape[-1]), dim=-1)
    return {
        "topk_ids": indices.to(torch.int32).cpu(),
        "topk_logits": values.to(torch.float16).cpu(),
        "hidden": out.hidden_states[-1][0].to(torch.bfloat16).cpu(),
    }


@dataclass
class DataMeta:
    target: str
    fingerprint: str
    num_sources: int
    topk: int
    hidden_size: int
    vocab_size: int
    done: int = 0  # sources processed into shards
    shards: list[str] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    format: str = DATA_FORMAT

    def save(self, directory: Path) -> None:
        tmp = directory / "meta.json.tmp"
        tmp.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        os.replace(tmp, directory / "meta.json")


def load_meta(directory: Path) -> DataMeta | None:
    path = directory / "meta.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != DATA_FORMAT:
        raise SpecdecError(f"{directory} is not a distillation data directory", "data_dir")
    return DataMeta(**data)


def build_data(
    target,
    sources: list[Source],
    directory: str | os.PathLike,
    settings: DataSettings,
    progress: Callable[[int, int], None] | None = None,
) -> DataMeta:
    """Generate (or finish generating) the data for `sources` into `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = target.model
    meta = load_meta(directory)
    fp = fingerprint(sources) + f"-t{settings.temperature}-n{settings.max_new_tokens}-k{settings.topk}"
    if meta is not None and (meta.fingerprint != fp or meta.target != target.name):
        raise SpecdecError(
            f"{directory} holds data from other prompts, settings or target; pass another --data-dir "
            "or delete it", "data_dir",
        )
    if meta is None:
        meta = DataMeta(
            target=target.name, fingerprint=fp, num_sources=len(sources), topk=settings.topk,
            hidden_size=int(model.get_output_embeddings().weight.shape[1]),
            vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        )
        meta.save(directory)
    engine = (Engine(target, drafter="ngram", k="auto", backend=settings.backend)
              if meta.done < len(sources) else None)
    pending: list[tuple[TokenSeq, dict]] = []
    first_pending = meta.done
    for index in range(meta.done, len(sources)):
        for seq in _generate_sequences(engine, sources[index], settings, settings.seed + index):
            tokens = seq.tokens[: settings.max_seq_len]
            if len(tokens) > seq.gen_start:
                pending.append((TokenSeq(tokens, seq.gen_start),
                                teacher_forward(model, tokens, settings.topk)))
        last = index == len(sources) - 1
        if (index + 1 - first_pending) >= settings.shard_size or last:
            if pending:
                name = f"shard-{len(meta.shards):05d}.safetensors"
                save_file(_pack(pending), str(directory / name))
                meta.shards.append(name)
                meta.sequences += len(pending)
                meta.tokens += sum(len(s.tokens) for s, _ in pending)
            meta.done = index + 1
            meta.save(directory)
            pending, first_pending = [], index + 1
        if progress:
            progress(index + 1, len(sources))
    return meta


def _pack(items: list[tuple[TokenSeq, dict]]) -> dict[str, torch.Tensor]:
    lengths = [len(s.tokens) for s, _ in items]
    offsets = torch.zeros(len(items) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths).cumsum(0)
    return {
        "tokens": torch.tensor([t for s, _ in items for t in s.tokens], dtype=torch.int32),
        "offsets": offsets,
        "gen_starts": torch.tensor([s.gen_start for s, _ in items], dtype=torch.int64),
        "topk_ids": torch.cat([d["topk_ids"] for _, d in items]),
        "topk_logits": torch.cat([d["topk_logits"] for _, d in items]),
        "hidden": torch.cat([d["hidden"] for _, d in items]),
    }


@dataclass
class Example:
    """One training sequence, as stored."""

    tokens: torch.Tensor  # [N] int64
    gen_start: int
    topk_ids: torch.Tensor  # [N, K] int64
    topk_logits: torch.Tensor  # [N, K] float32
    hidden: torch.Tensor  # [N, H] bfloat16


def load_examples(directory: str | os.PathLike) -> tuple[DataMeta, list[Example]]:
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = load_meta(directory)
    if meta is None or not meta.shards:
        raise SpecdecError(f"{directory} holds no distillation data yet", "data_dir")
    examples = []
    for name in meta.shards:
        t = load_file(str(directory / name))
        offsets = t["offsets"].tolist()
        for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:], strict=True)):
            examples.append(Example(
                tokens=t["tokens"][a:b].long(),
                gen_start=int(t["gen_starts"][i]),
                topk_ids=t["topk_ids"][a:b].long(),
                topk_logits=t["topk_logits"][a:b].float(),
                hidden=t["hidden"][a:b],
            ))
    return meta, examples


def token_ranking(examples: list[Example], vocab_size: int) -> torch.Tensor:
    """All token ids, most frequent in the data first; unseen ones by id (BPE ids are
    roughly ordered by merge frequency). FR-Spec's vocabulary subset is a prefix of this."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ex in examples:
        counts += torch.bincount(ex.tokens[ex.gen_start:], minlength=vocab_size)[:vocab_size].double()
        counts += 0.1 * torch.bincount(ex.tokens[: ex.gen_start], minlength=vocab_size)[:vocab_size].double()
    # Stable sort on -count keeps id order among ties.
    return torch.sort(-counts, stable=True).indices
