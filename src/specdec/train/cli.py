"""`specdec distill` and `specdec layerskip search`."""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from specdec.cli_args import engine_config, positive_int
from specdec.drafters.draft_model import ModelDrafter
from specdec.drafters.eagle import EagleDrafter, save_head
from specdec.drafters.layerskip import save_choice
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.models import check_same_tokenizer, load_model
from specdec.train import distill as D
from specdec.train.data import (
    DataSettings,
    build_data,
    load_examples,
    load_sources,
    sources_from_logs,
    split_heldout,
    token_ranking,
)
from specdec.train.layerskip_search import SearchSettings, search
from specdec.train.prompts import builtin_sources

QUICK = {  # a minutes-long run, for tests and smoke checks
    "sources": 6, "heldout": 1, "max_new_tokens": 24, "eval_tokens": 24, "steps": 20, "seq_len": 256,
    "batch_tokens": 512, "layers": 2, "vocab": 4096, "save_every": 10,
}


_positive = positive_int


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train a draft model or an EAGLE head on the target's own outputs")
    p.add_argument("--config", metavar="FILE", help="YAML engine settings; distill reads target and backend "
                                                   "(flags override it)")
    p.add_argument("--target", help="built-in name, .gguf file or HF model directory (default smollm2-135m)")
    p.add_argument("--kind", choices=("draft", "eagle"), default="draft")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="prompts JSONL ({'turns': [...]}, {'prompt': ...} or "
                                    "{'messages': [...]}); default: the built-in training prompts")
    src.add_argument("--from-logs", metavar="DIR", help="a traffic log written by --log-dir")
    p.add_argument("--out", required=True, help="output directory (model, checkpoints, report)")
    p.add_argument("--data-dir", help="where the target's outputs are stored (default OUT/data); "
                                      "draft and eagle runs can share one")
    p.add_argument("--layers", type=_positive, default=4, help="draft depth (kind=draft)")
    p.add_argument("--init", metavar="MODEL", help="start from this existing draft (same tokenizer) "
                                                   "instead of the target's layers (kind=draft)")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="fine-tune LoRA adapters of this rank (needs peft), merged into the saved draft")
    p.add_argument("--steps", type=_positive, default=None, help="optimizer steps (default: --epochs passes)")
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--lr", type=float, default=0.0, help="default 5e-4 (draft) or 1e-3 (eagle)")
    p.add_argument("--batch-tokens", type=_positive, default=2048)
    p.add_argument("--seq-len", type=_positive, default=512)
    p.add_argument("--vocab", type=int, default=16384,
                   help="EAGLE head's frequency-ranked vocabulary (0 = all)")
    p.add_argument("--kl-weight", type=float, default=0.1, help="EAGLE: weight of the token KL next to the "
                                                                "feature regression")
    p.add_argument("--unroll", type=int, choices=(1, 2), default=2,
                   help="EAGLE: 2 also trains on the head's own predicted features")
    p.add_argument("--max-new-tokens", type=_positive, default=192, help="length of the target's answers")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the target's answers")
    p.add_argument("--topk", type=_positive, default=64, help="target logits kept per position")
    p.add_argument("--backend",
                   help="engine backend that generates the target's answers: hf (default) or native")
    p.add_argument("--max-sources", type=_positive, default=None, help="use at most this many prompts")
    p.add_argument("--heldout", type=int, default=8, help="prompts kept out of training to measure tau")
    p.add_argument("--eval-tokens", type=_positive, default=128, help="tokens generated per held-out prompt")
    p.add_argument("--eval-k", type=_positive, default=5, help="draft length when measuring tau")
    p.add_argument("--save-every", type=_positive, default=50, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="a minutes-long run: few prompts, short answers, 20 steps")
    p.set_defaults(func=run_distill)

    ls = sub.add_parser("layerskip", help="self-speculation with the target's own layers")
    ls_sub = ls.add_subparsers(dest="layerskip_command", required=True, parser_class=type(p))
    s = ls_sub.add_parser("search",
                          help="choose the layers the draft keeps, by measured tau per unit of cost")
    s.add_argument("--target", default="smollm2-135m")
    s.add_argument("--data", help="calibration prompts JSONL (default: built-in training prompts)")
    s.add_argument("--out", default="layerskip.json", help="where to save the choice (JSON)")
    s.add_argument("--prompts", type=_positive, default=8, help="calibration prompts used")
    s.add_argument("--max-new-tokens", type=_positive, default=96)
    s.add_argument("--time-budget", type=float, default=300.0, help="seconds for the greedy search")
    s.add_argument("--max-k", type=_positive, default=8)
    s.add_argument("--quick", action="store_true", help="2 prompts, 24 tokens, 20 s budget")
    s.set_defaults(func=run_layerskip_search)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _sources(args, target_name: str):
    if getattr(args, "from_logs", None):
        sources, skipped = sources_from_logs(args.from_logs, target_name)
        if skipped:
            _say(f"skipped {skipped} log records of other targets or unusable prompts")
        return sources
    return load_sources(args.data) if args.data else builtin_sources()


def measure_tau(target, drafter, prompts, max_new_tokens: int, k: int) -> dict:
    """Greedy generation on `prompts` with `drafter`: pooled τ, acceptance, outputs."""
    engine = Engine(target, drafter, k=k)
    steps = emitted = drafted = accepted = 0
    outputs, wall = [], 0.0
    for prompt in prompts:
        r = engine.generate(prompt, max_new_tokens=max_new_tokens, chat=not isinstance(prompt, str))
        s = r.stats
        steps, emitted = steps + s.num_steps, emitted + s.num_emitted_tokens
        drafted, accepted = drafted + s.num_draft_tokens, accepted + s.num_accepted_tokens
        wall += s.wall_s
        outputs.append(r.token_ids)
    return {
        "tau": round(emitted / steps, 4) if steps else 0.0,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
        "drafted": drafted, "accepted": accepted, "tokens": emitted, "prompts": len(prompts),
        "tokens_per_second": round(emitted / wall, 2) if wall else 0.0, "k": k, "outputs": outputs,
    }


def run_distill(args: argparse.Namespace) -> None:
    config = engine_config(args)  # the target, and the engine that writes its answers
    settings, data_settings, limits = _settings(args, config.backend)
    out = Path(args.out)
    t_start = time.perf_counter()
    target = load_model(config.target)
    heldout, meta, examples = _target_outputs(args, target, data_settings, *limits[:2])
    t_data = time.perf_counter() - t_start
    _say(f"data: {meta.sequences} sequences, {meta.tokens} tokens ({t_data:.0f}s)")

    checkpoint = D.Checkpoint(out / f"checkpoint-{args.kind}")
    state = _resume(args, checkpoint, meta, settings)
    model, params, loss_fn, make_drafter, vocab_ids = _trainee(args, target, settings, meta, examples)
    eval_tokens = limits[2]
    prompts = [s.first_prompt() for s in heldout]
    if prompts and "tau_before" not in state and checkpoint.state() is None:
        state["tau_before"] = measure_tau(target, make_drafter(), prompts, eval_tokens, args.eval_k)
        _say(f"held-out tau before training: {state['tau_before']['tau']:.2f}")
    model.train()
    state = D.train(params, loss_fn, examples, settings, checkpoint, state, _say)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    _save_artifacts(args.kind, out, model, target, vocab_ids, state)
    if prompts:
        state["tau_after"] = measure_tau(target, make_drafter(), prompts, eval_tokens, args.eval_k)
    report = _report(args, config.target, state, meta, t_data, time.perf_counter() - t_start)
    (out / f"report-{args.kind}.json").write_text(json.dumps(report, indent=2) + "\n")
    drafter_flag = f"model:{out}" if args.kind == "draft" else f"eagle:{out}"
    b, a = report.get("tau_before"), report.get("tau_after")
    if a is not None:
        print(f"held-out tau (k={args.eval_k}, greedy): {b if b is not None else 'n/a'} -> {a}; "
              f"acceptance {report['acceptance_after']}; same output before/after: {report['same_output']}")
    print(f"trained {state['step']} steps in {state.get('train_s', 0):.0f}s; "
          f"use it with --drafter {drafter_flag}")
    print(json.dumps(report))


def _settings(args: argparse.Namespace, backend: str):
    """Training and data settings from the flags (--quick shrinks them), and the limits
    (max_sources, max_heldout, eval_tokens)."""
    if args.temperature < 0:
        raise SpecdecError(f"--temperature must be >= 0, got {args.temperature}", "temperature")
    if args.lora < 0:
        raise SpecdecError(f"--lora must be a positive rank, got {args.lora}", "lora")
    if args.vocab < 0:
        raise SpecdecError(f"--vocab must be >= 0, got {args.vocab}", "vocab")
    settings = D.TrainSettings(
        kind=args.kind, steps=args.steps or 0, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
        seq_len=args.seq_len, layers=args.layers, vocab=args.vocab, save_every=args.save_every,
        seed=args.seed, kl_weight=args.kl_weight, unroll=args.unroll,
    )
    data_settings = DataSettings(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 topk=args.topk, seed=args.seed, backend=backend)
    limits = (args.max_sources, args.heldout, args.eval_tokens)
    if args.quick:
        q = QUICK
        limits = (q["sources"] + q["heldout"], q["heldout"], q["eval_tokens"])
        data_settings.max_new_tokens = q["max_new_tokens"]
        settings.steps = args.steps or q["steps"]
        settings.seq_len = q["seq_len"]
        settings.batch_tokens = q["batch_tokens"]
        settings.save_every = q["save_every"]
        settings.layers = min(args.layers, q["layers"])
        settings.vocab = min(args.vocab, q["vocab"]) if args.vocab else 0
    return settings, data_settings, limits


def _target_outputs(args, target, data_settings, max_sources, max_heldout):
    """Write (or resume) the target's answers to the training prompts; return the held-out
    sources, the data's metadata and the training examples."""
    sources = _sources(args, target.name)
    if max_sources:
        sources = sources[:max_sources]
    train_sources, heldout = split_heldout(sources, max_heldout)
    data_dir = Path(args.data_dir) if args.data_dir else Path(args.out) / "data"
    _say(f"{len(train_sources)} training prompts, {len(heldout)} held out; target outputs -> {data_dir}")
    with tqdm(total=len(train_sources), desc="target outputs", unit="prompt", dynamic_ncols=True) as bar:
        def progress(done: int, total: int) -> None:
            bar.n = done
            bar.refresh()
        build_data(target, train_sources, data_dir, data_settings, progress)
    meta, examples = load_examples(data_dir)
    return heldout, meta, examples


def _resume(args, checkpoint, meta, settings) -> dict:
    state = checkpoint.state() or {"kind": args.kind, "step": 0, "data": meta.fingerprint,
                                   "settings": D.settings_dict(settings)}
    if state.get("data") != meta.fingerprint:
        raise SpecdecError(f"{checkpoint.directory} was trained on other data; pass another --out", "out")
    if state.get("settings", {}).get("layers", settings.layers) != settings.layers and args.kind == "draft":
        raise SpecdecError(f"{checkpoint.directory} holds a {state['settings']['layers']}-layer draft",
                           "layers")
    return state


def _trainee(args, target, settings, meta, examples):
    """The model to train, its trainable parameters, its loss, a drafter over it (for τ) and
    the EAGLE head's vocabulary (None for a draft)."""
    eos = target.eos_token_ids
    if args.kind == "draft":
        from specdec.backends.hf import HFBackend  # transformers' model code: a draft's trainer only

        model = _initial_draft(args, target, settings)
        if args.lora:
            model = D.apply_lora(model, args.lora)
            params = D.lora_params(model)
        else:
            params = D.trainable_draft_params(model)
        loss_fn = lambda batch: D.draft_loss(model, batch)  # noqa: E731
        make_drafter = lambda: ModelDrafter(HFBackend(model), eos)  # noqa: E731
        return model, params, loss_fn, make_drafter, None
    vocab_size = meta.vocab_size
    vocab_ids = (token_ranking(examples, vocab_size)[: settings.vocab]
                 if 0 < settings.vocab < vocab_size else None)
    model = D.new_eagle_head(target.model)
    trainer = D.EagleTrainer(target.model, model, vocab_ids, settings)
    make_drafter = lambda: EagleDrafter(model.eval(), vocab_ids, eos)  # noqa: E731
    return model, dict(model.named_parameters()), trainer.loss, make_drafter, vocab_ids


def _save_artifacts(kind: str, out: Path, model, target, vocab_ids, state: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if kind == "draft":
        if hasattr(model, "merge_and_unload"):  # LoRA: save a plain model that model:DIR loads
            model = copy.deepcopy(model).merge_and_unload()
        model.save_pretrained(str(out), safe_serialization=True)
        target.tokenizer.save_pretrained(str(out))
    else:
        save_head(out, model, target.name, vocab_ids,
                  {"vocab_size": int(target.model.get_output_embeddings().weight.shape[0]),
                   "steps": state["step"]})


def _initial_draft(args, target, settings):
    if not args.init:
        return D.init_draft(target.model, settings.layers)
    try:
        draft = load_model(args.init)
    except SpecdecError as e:
        raise SpecdecError(f"--init: {e.message}", "init") from e
    check_same_tokenizer(target, draft)
    return draft.model


def _report(args, target_name: str, state: dict, meta, t_data: float, t_total: float) -> dict:
    before, after = state.get("tau_before"), state.get("tau_after")
    history = state.get("history", [])
    first, last = history[:5], history[-5:]

    def avg(rows, key):
        vals = [r[key] for r in rows if key in r]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {
        "kind": args.kind, "target": target_name, "steps": state["step"],
        "train_seconds": state.get("train_s"), "data_seconds": round(t_data, 1),
        "total_seconds": round(t_total, 1),
        "data_sequences": meta.sequences, "data_tokens": meta.tokens,
        "loss_first": avg(first, "loss"), "loss_last": avg(last, "loss"),
        "kl_first": avg(first, "kl"), "kl_last": avg(last, "kl"),
        "top1_first": avg(first, "top1"), "top1_last": avg(last, "top1"),
        "tau_before": before["tau"] if before else None,
        "tau_after": after["tau"] if after else None,
        "acceptance_before": before["acceptance_rate"] if before else None,
        "acceptance_after": after["acceptance_rate"] if after else None,
        "same_output": (before["outputs"] == after["outputs"]) if before and after else None,
    }


def run_layerskip_search(args: argparse.Namespace) -> None:
    settings = SearchSettings(prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                              time_budget=args.time_budget, max_k=args.max_k)
    if args.quick:
        settings.prompts, settings.max_new_tokens, settings.time_budget = 2, 24, 20.0
    target = load_model(args.target)
    sources = _sources(args, target.name)
    result = search(target, [s.first_prompt() for s in sources], settings, _say)
    save_choice(args.out, target.name, result["num_layers"], result["layers"], result)
    print(f"kept {len(result['layers'])}/{result['num_layers']} layers {result['layers']}: "
          f"predicted tau {result['tau']:.2f} at k={result['k']}, speedup {result['speedup']:.2f}x; "
          f"saved to {args.out}; use it with --drafter layerskip:{args.out}")
    print(json.dumps({k: v for k, v in result.items() if k != "trace"}))
