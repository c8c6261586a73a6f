"""Does specdec's native backend, reading a GGUF at its own quant types, pick the tokens
llama.cpp picks on the same file? Teacher-forced top-1 agreement along the decode path.

    python scripts/bench/measure/gguf_agreement.py [--files all] [--threads 1] [--min-tokens 2000] \\
        [--cache-dir ~/.cache/specdec/requant] [--fp32-reference below|always|never] [--no-f32-cache]

Per file: llama.cpp (llama-cpp-python) decodes the prompts below greedily (temperature 0)
until at least --min-tokens tokens are generated in total. Each prompt and its greedy tokens,
as llama.cpp tokenized them (the chat template rendered by the model's tokenizer), are fed
to specdec's native backend on the same file: the prompt prefilled, then the generated
tokens in chains of --chain (1 = one token per forward; the native decode path gives the
same bits for chains up to 8). A position agrees when specdec's argmax is llama.cpp's greedy
token. Also reported: llama.cpp's own argmax against its sampled token, the mean
KL(llama.cpp || specdec), the share of disagreements that were near-ties (llama.cpp's
top-2 logit gap under --tie-gap), and the greedy match length (how far specdec's own greedy
decoding follows llama.cpp's before the first difference: the first disagreement's index,
since teacher forcing up to there is free-running greedy decoding), median over prompts.
For a file below --bar (--fp32-reference), the same tokens also go through the file dequantized exactly (the
gguf package's decoder) into fp32 layers, to tell a kernel's error from a model's. Unless
--no-f32-cache, llama.cpp itself on an f32 KV cache (its default is f16) is scored the same
way on the same tokens: how often one engine agrees with itself under another cache type,
this measure's floor for two sound implementations.

The files: the embedded SmolLM2-135M (Q4_1), gemma3-270m (Q4_K_M), and the SmolLM2 file
re-quantized by llama.cpp's own quantizer (Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q4_0), made into
--cache-dir when missing. Ends its stdout with one JSON object (scripts/bench/record.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Held-out prompts written for this script (no benchmark data): code, prose, lists, JSON,
# arithmetic and other languages.
PROMPTS = (
    ("code", "Write a Python function that returns the running median of a list of integers, with a short docstring."),
    ("prose", "Describe a small fishing village on a foggy morning in two short paragraphs."),
    ("list", "List seven practical tips for keeping houseplants alive during a cold winter."),
    ("json", "Return a JSON object describing a fictional bookshop: name, city, opening hours and three "
             "bestselling titles with their authors."),
    ("arithmetic", "A train leaves at 9:40 and travels 180 km at 72 km/h. At what time does it arrive? "
                   "Show each step of the calculation."),
    ("french", "Écris une courte lettre à un voisin pour l'inviter à un repas de quartier samedi prochain."),
    ("code", "Explain what this shell command does, piece by piece: find . -name '*.log' -mtime +7 -delete"),
    ("spanish", "Explica en pocas frases por qué el cielo es azul durante el día y rojo al atardecer."),
    ("prose", "Tell a short story about a robot who learns to bake bread in an old bakery."),
    ("json", "Convert this to JSON with keys city and population: Lyon has 522000 people, Porto has "
             "232000, Graz has 291000."),
    ("list", "Give a numbered checklist for preparing a bicycle for a long weekend ride."),
    ("german", "Beschreibe kurz den Unterschied zwischen einem Fluss und einem Kanal."),
    ("arithmetic", "What is 17 multiplied by 23? Then add 145 and divide the result by 4. Explain briefly."),
    ("code", "Write a SQL query that finds the three customers with the highest total order value in 2023, "
             "given tables customers(id, name) and orders(id, customer_id, amount, created_at)."),
    ("prose", "Summarize the pros and cons of working from home in a balanced paragraph."),
    ("list", "Name five board games suited to a family evening and say in one line why each works."),
    # reached only when a file's answers end early (more prompts than 2,000 tokens need)
    ("code", "Write a JavaScript function that debounces another function, and show how to use it."),
    ("italian", "Descrivi in breve una passeggiata in montagna in autunno."),
    ("json", "Give a JSON array of four planets with their name, order from the sun and whether they have rings."),
    ("prose", "Write a short letter from a lighthouse keeper to a friend in the city."),
)

REQUANT_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0")
KEEP_VOCAB = 65536  # llama.cpp's logits are kept between passes for vocabularies up to this
GGML_TYPE_F32 = 0  # llama.cpp's KV-cache type for type_k / type_v
FILES = ("smollm2-135m", "gemma3-270m", *(f"smollm2-135m.{t}" for t in REQUANT_TYPES))


# ---- counting (pure, tested in tests/test_gguf_agreement.py) -------------------------------


@dataclass
class Tally:
    """Agreement counts over positions, accumulated prompt by prompt."""

    positions: int = 0
    agree: int = 0
    reference_self: int = 0  # llama.cpp's own argmax equals its greedy token
    near_tie_misses: int = 0
    kl_sum: float = 0.0
    match_lengths: list[int] = field(default_factory=list)
    misses: list[dict] = field(default_factory=list)  # the first few disagreements, for diagnosis
    hits: list[torch.Tensor] = field(default_factory=list)  # per prompt, bool [G]

    def add(self, greedy: torch.Tensor, reference: torch.Tensor, candidate: torch.Tensor, tie_gap: float,
            prompt: int = 0, keep_misses: int = 20) -> None:
        """greedy: llama.cpp's tokens [G]; reference, candidate: llama.cpp's and specdec's logits
        [G, V] for the positions that predicted them."""
        ref_lp = torch.log_softmax(reference.double(), -1)
        cand_lp = torch.log_softmax(candidate.double(), -1)
        top2 = reference.double().topk(2, dim=-1).values  # [G, 2]
        gaps = top2[:, 0] - top2[:, 1]
        picks = candidate.argmax(-1)
        hits = picks == greedy
        self.positions += len(greedy)
        self.agree += int(hits.sum())
        self.reference_self += int((reference.argmax(-1) == greedy).sum())
        self.near_tie_misses += int((~hits & (gaps < tie_gap)).sum())
        self.kl_sum += float((ref_lp.exp() * (ref_lp - cand_lp)).sum(-1).sum())
        self.match_lengths.append(first_difference(hits))
        self.hits.append(hits)
        for pos in torch.nonzero(~hits).flatten().tolist():
            if len(self.misses) < keep_misses:
                self.misses.append({"prompt": prompt, "pos": pos, "llama": int(greedy[pos]), "specdec": int(picks[pos]),
                                    "gap": round(float(gaps[pos]), 3),
                                    "specdec_gap": round(float(candidate[pos, picks[pos]] - candidate[pos, greedy[pos]]), 3)})  # fmt: skip

    def summary(self) -> dict:
        misses = self.positions - self.agree
        return {
            "positions": self.positions,
            "agreement": round(self.agree / max(self.positions, 1), 4),
            "disagreements": misses,
            "near_tie_share": None if misses == 0 else round(self.near_tie_misses / misses, 3),
            "mean_kl": float(f"{self.kl_sum / max(self.positions, 1):.3g}"),
            "match_length_median": statistics.median(self.match_lengths) if self.match_lengths else None,
        }


def shared_misses(a: Tally, b: Tally) -> int:
    """Positions where both tallies' candidates missed llama.cpp's token."""
    return sum(int((~x & ~y).sum()) for x, y in zip(a.hits, b.hits, strict=True))


def first_difference(hits: torch.Tensor) -> int:
    """Index of the first False in a bool vector, or its length if all are True."""
    misses = torch.nonzero(~hits).flatten()
    return int(misses[0]) if len(misses) else len(hits)


# ---- the files ------------------------------------------------------------------------------


def requantize(source: Path, qtype: str, cache_dir: Path, threads: int) -> Path:
    """The SmolLM2 file re-quantized by llama.cpp to `qtype`, made once into cache_dir."""
    import llama_cpp

    out = cache_dir / f"smollm2-135m.{qtype}.gguf"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{qtype}")
    params.allow_requantize, params.nthread = True, threads
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {qtype}")
    tmp.rename(out)
    return out


def file_path(label: str, cache_dir: Path, threads: int) -> Path:
    from specdec.models import builtin_gguf_path

    if "." not in label:
        return builtin_gguf_path(label)
    return requantize(builtin_gguf_path("smollm2-135m"), label.split(".", 1)[1], cache_dir, threads)


def tensor_types(path: Path) -> dict[str, int]:
    from specdec.gguf_file import GGUFFile

    counts = collections.Counter(t.qtype.name for t in GGUFFile(path).tensors.values())
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def kernel_classes(seq) -> dict[str, int]:
    """The classes of the native model's weight kernels (the leaf modules under the decoder
    linears and the LM head, wrappers such as a fused q/k/v unwrapped), counted."""
    model = seq.pool.model

    def leaves(module: torch.nn.Module) -> list[str]:
        children = list(module.children())
        return [name for child in children for name in leaves(child)] if children else [type(module).__name__]

    names = collections.Counter(name for layer in model.layers for part in ("qkv", "o", "gate_up", "down")
                                for name in leaves(getattr(layer, part)))
    for name in leaves(model.lm_head):
        names[f"{name} (LM head)"] += 1
    return dict(names)


# ---- the two engines --------------------------------------------------------------------------


# The Gemma 3 turn format, for a file whose metadata has no chat template (gemma3-270m's).
GEMMA_TURNS = "<bos><start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def render(tokenizer, text: str) -> str:
    """The user message in the model's chat template (its tokenizer's, else Gemma's turns)."""
    if not tokenizer.chat_template:
        return GEMMA_TURNS.format(text)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def llama_greedy(llm, prompt: list[int], max_new: int, eos: set[int]) -> tuple[list[int], torch.Tensor]:
    """llama.cpp's greedy tokens and the logits [G, V] of the positions that chose them."""
    llm.reset()
    tokens: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                              repeat_penalty=1.0, reset=True):
        tokens.append(int(token))
        if token in eos or len(tokens) >= max_new:
            break
    start = len(prompt) - 1
    logits = torch.from_numpy(llm.scores[start : start + len(tokens)].copy())  # [G, V] float32
    return tokens, logits


def llama_decode(llm, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """llama.cpp's logits [G, V] for `tokens` after `prompt`, fed one token at a time."""
    llm.reset()
    llm.eval(prompt)
    for token in tokens[:-1]:
        llm.eval([token])
    start = len(prompt) - 1
    return torch.from_numpy(llm.scores[start : start + len(tokens)].copy())


def specdec_logits(seq, prompt: list[int], tokens: list[int], chain: int) -> torch.Tensor:
    """specdec's logits [G, V] for each greedy token: prefill the prompt, then decode the
    tokens (all but the last) in chains of `chain`."""
    rows = [seq.prefill(prompt, all_logits=False)]  # [1, V]
    feed = tokens[:-1]
    rows += [seq.forward(feed[i : i + chain]) for i in range(0, len(feed), chain)]
    return torch.cat(rows).float()


def score(llm, runs: list, candidate, tally: Tally, args, eos: set[int]) -> float:
    """Score one candidate, `candidate(prompt, tokens)` -> logits [G, V], on llama.cpp's greedy
    runs [(prompt index, prompt ids, tokens, logits [G, V] or None)]; logits not kept are
    recomputed (llama.cpp's greedy decoding is deterministic), so a 262k vocabulary needs no
    [G, V] array per prompt. Returns the candidate's seconds."""
    seconds = 0.0
    for i, prompt, tokens, kept in runs:
        reference = kept
        if reference is None:
            again, reference = llama_greedy(llm, prompt, len(tokens), eos)
            if again != tokens:
                raise SystemExit(f"llama.cpp's greedy tokens changed between passes on prompt {i}")
        t0 = time.perf_counter()
        logits = candidate(prompt, tokens)
        seconds += time.perf_counter() - t0
        tally.add(torch.tensor(tokens), reference, logits, args.tie_gap, prompt=i, keep_misses=args.show_misses)
    return seconds


def greedy_runs(llm, tokenizer, args, eos: set[int]) -> tuple[list, int]:
    """llama.cpp's greedy runs over the prompts until --min-tokens, and how many prompts
    llama.cpp tokenized as specdec's tokenizer does."""
    runs, same_ids, generated = [], 0, 0
    for i, (_, text) in enumerate(PROMPTS):
        if generated >= args.min_tokens:
            break
        rendered = render(tokenizer, text)
        prompt = llm.tokenize(rendered.encode(), add_bos=False, special=True)
        same_ids += prompt == tokenizer.encode(rendered, add_special_tokens=False)
        tokens, logits = llama_greedy(llm, prompt, args.max_new, eos)
        runs.append((i, prompt, tokens, logits if llm.n_vocab() <= KEEP_VOCAB else None))
        generated += len(tokens)
    return runs, same_ids


def measure(label: str, args) -> dict:
    from llama_cpp import Llama

    from specdec.backends import make_backend
    from specdec.models import load_model

    path = file_path(label, args.cache_dir, args.threads)
    loaded = load_model("gemma3-270m" if label == "gemma3-270m" else str(path))
    llm = Llama(model_path=str(path), n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                n_batch=512, logits_all=True, verbose=False)
    seq = make_backend("native", loaded, prefix_cache="off", max_length=args.n_ctx)
    vocab = {"llama.cpp": llm.n_vocab(), "specdec": seq.pool.model.config.vocab_size}
    if vocab["llama.cpp"] != vocab["specdec"]:
        raise SystemExit(f"{label}: vocab sizes differ: {vocab}")
    eos = {llm.token_eos(), *loaded.eos_token_ids}
    started = time.perf_counter()
    runs, same_ids = greedy_runs(llm, loaded.tokenizer, args, eos)
    tallies = {"gguf": Tally()}
    seconds = {"gguf": score(llm, runs, lambda p, t: specdec_logits(seq, p, t, args.chain), tallies["gguf"], args, eos)}
    gguf = tallies["gguf"]
    print(f"{label}: gguf {gguf.agree}/{gguf.positions}", file=sys.stderr, flush=True)
    if args.fp32_reference == "always" or (args.fp32_reference == "below" and gguf.agree < args.bar * gguf.positions):
        tallies["fp32"] = Tally()
        reference = make_backend("native", loaded, prefix_cache="off", precision="fp32", max_length=args.n_ctx)
        seconds["fp32"] = score(llm, runs, lambda p, t: specdec_logits(reference, p, t, args.chain), tallies["fp32"],
                                args, eos)  # fmt: skip
    if args.f32_cache:  # llama.cpp against itself: the same file and tokens on an f32 KV cache
        tallies["llama_f32"] = Tally()
        llm32 = Llama(model_path=str(path), n_ctx=args.n_ctx, n_threads=args.threads, n_threads_batch=args.threads,
                      n_batch=512, logits_all=True, verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
        seconds["llama_f32"] = score(llm, runs, lambda p, t: llama_decode(llm32, p, t), tallies["llama_f32"], args, eos)
    report = {
        "file": path.name, "tensor_types": tensor_types(path), "kernels": kernel_classes(seq),
        "own_types": seq.pool.model.precision == "gguf", "vocab": vocab["specdec"],
        "prompts": len(runs), "prompt_ids_equal_specdec_tokenizer": f"{same_ids}/{len(runs)}",
        "short_of_min_tokens": sum(len(run[2]) for run in runs) < args.min_tokens,
        **gguf.summary(),
        "llamacpp_argmax_is_greedy": round(gguf.reference_self / max(gguf.positions, 1), 4),
        "seconds": {"total": round(time.perf_counter() - started, 1), **{k: round(v, 1) for k, v in seconds.items()}},
    }
    if "fp32" in tallies:
        report["fp32_reference"] = {**tallies["fp32"].summary(), "misses_shared_with_gguf": shared_misses(gguf, tallies["fp32"])}
    if "llama_f32" in tallies:
        report["llamacpp_f32_cache"] = tallies["llama_f32"].summary()
    for name, tally in tallies.items():  # the first disagreements, tokens as text, for a reader
        for miss in tally.misses[: args.show_misses]:
            words = [loaded.tokenizer.decode([miss[side]]) for side in ("llama", "specdec")]
            print(f"{label} {name} miss: {json.dumps({**miss, 'text': words}, ensure_ascii=False)}", file=sys.stderr)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default="all", help=f"comma-separated, from: {', '.join(FILES)} (default all)")
    p.add_argument("--threads", type=int, default=1, help="torch's and llama.cpp's threads (default 1)")
    p.add_argument("--min-tokens", type=int, default=2000, help="greedy tokens per file, at least (default 2000)")
    p.add_argument("--max-new", type=int, default=200, help="greedy tokens per prompt, at most (default 200)")
    p.add_argument("--chain", type=int, default=1, choices=range(1, 9), metavar="1..8",
                   help="tokens per specdec decode forward (default 1)")
    p.add_argument("--tie-gap", type=float, default=0.5, help="a near-tie: llama.cpp's top-2 logit gap below this")
    p.add_argument("--fp32-reference", choices=("below", "always", "never"), default="below",
                   help="also score the exactly dequantized fp32 model: on files below --bar (default), always, never")
    p.add_argument("--bar", type=float, default=0.98, help="the agreement a file should reach (default 0.98)")
    p.add_argument("--cache-dir", type=Path, default=Path("~/.cache/specdec/requant").expanduser(),
                   help="where the re-quantized SmolLM2 files are (made when missing)")
    p.add_argument("--n-ctx", type=int, default=512, help="context of both engines (prompt + max-new must fit)")
    p.add_argument("--no-f32-cache", dest="f32_cache", action="store_false",
                   help="skip llama.cpp on an f32 KV cache against its own default (f16) greedy tokens")
    p.add_argument("--show-misses", type=int, default=10, help="print the first N disagreements per file to stderr (default 10)")
    args = p.parse_args()
    labels = FILES if args.files == "all" else tuple(f.strip() for f in args.files.split(","))
    for label in labels:
        if label not in FILES:
            p.error(f"unknown file {label!r}; choose from: {', '.join(FILES)}")
    torch.set_num_threads(args.threads)
    results = {}
    for label in labels:
        results[label] = report = measure(label, args)
        fp32 = report.get("fp32_reference", {}).get("agreement")
        own = report.get("llamacpp_f32_cache", {}).get("agreement")
        print(f"{label:24s} agreement {report['agreement']:.4f} ({report['disagreements']} of {report['positions']}; "
              f"near-ties {report['near_tie_share']}) KL {report['mean_kl']:.3g} match median "
              f"{report['match_length_median']}" + (f" fp32 {fp32:.4f}" if fp32 is not None else "")
              + (f" llama.cpp f32 cache {own:.4f}" if own is not None else ""))
    print(json.dumps({"threads": args.threads, "min_tokens": args.min_tokens, "chain": args.chain,
                      "tie_gap": args.tie_gap, "files": results}, ensure_ascii=False))


if __name__ == "__main__":
    main()
