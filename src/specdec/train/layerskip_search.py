"""`specdec layerskip search`: pick the target layers a self-speculative draft keeps.

After Draft&Verify (which searches the skipped layers offline) and SWIFT (which scores layer
sets by how well the draft matches the target), with a cheap and exact evaluation: under
greedy decoding a draft's chain is accepted exactly as far as its teacher-forced predictions
match the target's, so one teacher-forced forward of a layer set over calibration outputs
gives the accepted length of every step, for every k, without running the engine.

Objective: predicted speedup = τ_k · t_target / (k · t_draft(layers) + t_verify(k+1)),
maximised over k, with the three times measured on this machine.

Search: greedy addition. Starting from no layers, each round adds the layer that maximises
the objective (ties broken by the draft's log-probability of the target's token). Prefix
hidden states are cached, so trying layer j only reruns the kept layers after j. The best
set seen within the time budget wins; during the search the draft's LM head is evaluated
only on the target's top-32 tokens per position, and the winner is re-scored exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.drafters.common import DecoderParts
from specdec.drafters.layerskip import LayerStack, default_layers
from specdec.engine import Engine
from specdec.errors import SpecdecError


@dataclass
class SearchSettings:
    prompts: int = 8
    max_new_tokens: int = 96
    time_budget: float = 300.0
    max_k: int = 8
    topk: int = 32


@dataclass
class Calibration:
    embeds: list[torch.Tensor]  # per sequence [1, N, H]
    positions: list[torch.Tensor]  # per sequence: scored positions p (predicting token p+1)
    target_next: list[torch.Tensor]  # per sequence [P] target argmax at those positions
    cand_ids: list[torch.Tensor]  # per sequence [P, K] target's top-K candidates (index 0 = argmax)


def simulate_tau(match: list[bool], k: int) -> tuple[int, int]:
    """Greedy chain steps over a match vector: returns (emitted tokens, steps)."""
    p, emitted, steps = 0, 0, 0
    n = len(match)
    while p < n:
        accepted = 0
        while accepted < k and p + accepted < n and match[p + accepted]:
            accepted += 1
        step = min(accepted + 1, n - p)
        emitted, steps, p = emitted + step, steps + 1, p + step
    return emitted, steps


def _min_time(fn: Callable[[], object], repeats: int = 5) -> float:
    """The fastest of a few runs: on a shared machine, load only ever adds time."""
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_costs(target, max_k: int, context: list[int]) -> dict:
    """Seconds for: a target decode step, verifying k+1 tokens, and a draft step per layer count."""
    from specdec.backends.hf import HFBackend  # transformers' model code, for this search only

    backend = HFBackend(target.model)
    backend.prefill(context)
    base = backend.length

    def target_step(n: int):
        def run():
            backend.forward(context[:n])
            backend.rollback(base)
        return run

    t_target = _min_time(target_step(1))
    t_verify = {k: _min_time(target_step(k + 1), 2) for k in range(1, max_k + 1)}
    num_layers = DecoderParts.of(target.model).num_layers
    draft_times = {}
    for n in (1, num_layers):
        stack = LayerStack(target.model, list(range(n)))
        stack.prefill(context)
        draft_times[n] = _min_time(lambda s=stack: (s.forward(context[:1]), s.rollback(len(context))), 3)
    per_layer = max(0.0, (draft_times[num_layers] - draft_times[1]) / max(1, num_layers - 1))
    return {
        "target_step_s": t_target, "verify_s": t_verify,
        "draft_base_s": max(0.0, draft_times[1] - per_layer), "draft_per_layer_s": per_layer,
    }


def speedup(match: list[bool], num_kept: int, costs: dict, max_k: int) -> tuple[float, int, float]:
    """Best (speedup, k, τ) over k for a layer set with this match vector."""
    t_draft = costs["draft_base_s"] + num_kept * costs["draft_per_layer_s"]
    best = (0.0, 1, 1.0)
    for k in range(1, max_k + 1):
        emitted, steps = simulate_tau(match, k)
        tau = emitted / steps if steps else 1.0
        s = tau * costs["target_step_s"] / (k * t_draft + costs["verify_s"][k])
        if s > best[0]:
            best = (s, k, tau)
    return best


@torch.inference_mode()
def calibrate(target, prompts, settings: SearchSettings) -> Calibration:
    engine = Engine(target, drafter="ngram", k="auto")
    model = target.model
    parts = DecoderParts.of(model)
    cal = Calibration([], [], [], [])
    for prompt in prompts[: settings.prompts]:
        r = engine.generate(prompt, max_new_tokens=settings.max_new_tokens, chat=not isinstance(prompt, str))
        ids = r.prompt_ids + r.token_ids
        if len(r.token_ids) < 2:
            continue
        x = torch.tensor([ids])
        logits = model(input_ids=x, use_cache=False).logits[0].float()  # [N, V]
        positions = torch.arange(len(r.prompt_ids) - 1, len(ids) - 1)
        cal.embeds.append(parts.embed(x))
        cal.positions.append(positions)
        cal.target_next.append(logits[positions].argmax(-1))
        cal.cand_ids.append(torch.topk(logits[positions], settings.topk, dim=-1).indices)
    return cal


class Evaluator:
    """Match vectors of layer sets over the calibration data, with cached prefixes."""

    def __init__(self, parts: DecoderParts, cal: Calibration):
        self.parts, self.cal = parts, cal
        rows = parts.lm_head.weight.detach()
        self.cand_rows = [rows[c] for c in cal.cand_ids]  # [P, K, H] each

    @torch.inference_mode()
    def prefix_states(self, layers: list[int]) -> list[list[torch.Tensor]]:
        """For each sequence: hidden after 0, 1, ..., len(layers) kept layers."""
        out = []
        for emb in self.cal.embeds:
            states = [emb]
            for i in layers:
                states.append(self.parts.run_layers(states[-1], [i], 0))
            out.append(states)
        return out

    @torch.inference_mode()
    def score(self, hiddens: list[torch.Tensor], exact: bool = False) -> tuple[list[bool], float]:
        """Final hidden per sequence -> (match vector over all scored positions, mean log-prob)."""
        match, logp = [], []
        for h, pos, nxt, rows in zip(hiddens, self.cal.positions, self.cal.target_next, self.cand_rows,
                                     strict=True):
            h = self.parts.norm(h)[0, pos]  # [P, H]
            if exact:
                pred = self.parts.logits(h).argmax(-1)
                match.extend((pred == nxt).tolist())
                continue
            logits = torch.einsum("ph,pkh->pk", h, rows)  # [P, K] on the target's top-K only
            match.extend((logits.argmax(-1) == 0).tolist())
            logp.append(logits.float().log_softmax(-1)[:, 0])
        return match, float(torch.cat(logp).mean()) if logp else 0.0

    def run_from(self, states: list[list[torch.Tensor]], kept: list[int], add: int) -> list[torch.Tensor]:
        """Hidden after the set kept ∪ {add}, reusing the prefix of `kept` below `add`."""
        before = sum(1 for i in kept if i < add)
        rest = [add] + [i for i in kept if i > add]
        return [self.parts.run_layers(s[before], rest, 0) for s in states]


def search(target, prompts, settings: SearchSettings, say: Callable[[str], None] = print) -> dict:
    parts = DecoderParts.of(target.model)
    t0 = time.perf_counter()
    cal = calibrate(target, prompts, settings)
    if not cal.embeds:
        raise SpecdecError("the calibration prompts produced no output to measure", "data")
    context = [int(t) for t in torch.cat([c for c in cal.target_next])[:64].tolist()] or [0]
    costs = measure_costs(target, settings.max_k, context)
    say(f"calibration: {sum(len(p) for p in cal.positions)} positions; target step "
        f"{1000 * costs['target_step_s']:.1f} ms, draft {1000 * costs['draft_base_s']:.1f} ms + "
        f"{1000 * costs['draft_per_layer_s']:.2f} ms/layer")
    ev = Evaluator(parts, cal)
    deadline = time.perf_counter() + settings.time_budget

    def objective(match, logp, n):
        s, k, tau = speedup(match, n, costs, settings.max_k)
        return (s, logp), k, tau

    trace: list[dict] = []
    best = _early_exits(ev, parts.num_layers, objective, trace)
    best = _add_layers(ev, parts.num_layers, objective, best, trace, deadline, say)
    return _summary(ev, parts.num_layers, best[1], costs, settings.max_k, trace, t0)


def _early_exits(ev: Evaluator, num_layers: int, objective, trace: list[dict]) -> tuple:
    """Score the first n layers for every n: one pass over all layers gives them all.
    Returns the best (objective, layers)."""
    full = ev.prefix_states(list(range(num_layers)))
    best = None
    for depth in range(1, num_layers + 1):
        match, logp = ev.score([s[depth] for s in full])
        obj, k, tau = objective(match, logp, depth)
        trace.append({"layers": list(range(depth)), "speedup": round(obj[0], 4), "tau": round(tau, 3),
                      "k": k})
        if best is None or obj > best[0]:
            best = (obj, list(range(depth)))
    return best


def _add_layers(ev: Evaluator, num_layers: int, objective, best: tuple, trace: list[dict], deadline: float,
                say: Callable[[str], None]) -> tuple:
    """Greedy addition from no layers, until the deadline or past the optimum; returns the
    best (objective, layers) seen, `best` included."""
    kept: list[int] = []
    states = ev.prefix_states(kept)
    stale = 0
    while len(kept) < num_layers and time.perf_counter() < deadline:
        round_best = None
        for j in range(num_layers):
            if j in kept:
                continue
            match, logp = ev.score(ev.run_from(states, kept, j))
            obj, k, tau = objective(match, logp, len(kept) + 1)
            if round_best is None or obj > round_best[0]:
                round_best = (obj, j, k, tau)
            if time.perf_counter() > deadline:
                break
        if round_best is None:
            break
        obj, j, k, tau = round_best
        kept = sorted(kept + [j])
        states = ev.prefix_states(kept)
        trace.append({"layers": kept, "speedup": round(obj[0], 4), "tau": round(tau, 3), "k": k})
        say(f"  {len(kept):2d} layers {kept}: predicted speedup {obj[0]:.3f} (tau {tau:.2f} at k={k})")
        if obj > best[0]:
            best, stale = (obj, kept), 0
        else:
            stale += 1
            if stale >= 4:  # past the optimum: more layers cost more than they add
                break
    return best


def _summary(ev: Evaluator, num_layers: int, chosen: list[int], costs: dict, max_k: int, trace: list[dict],
             t0: float) -> dict:
    """The chosen set re-scored exactly (full LM head), next to the default set."""
    final = ev.score([s[-1] for s in ev.prefix_states(chosen)], exact=True)[0]
    s, k, tau = speedup(final, len(chosen), costs, max_k)
    default = default_layers(num_layers)
    d_match = ev.score([s_[-1] for s_ in ev.prefix_states(default)], exact=True)[0]
    d_s, d_k, d_tau = speedup(d_match, len(default), costs, max_k)
    return {
        "num_layers": num_layers, "layers": chosen, "k": k, "tau": round(tau, 4), "speedup": round(s, 4),
        "acceptance": round(sum(final) / len(final), 4),
        "default": {"layers": default, "tau": round(d_tau, 4), "k": d_k, "speedup": round(d_s, 4)},
        "costs": {k_: (v if isinstance(v, float) else {str(a): b for a, b in v.items()})
                  for k_, v in costs.items()},
        "calibration_positions": len(final), "search_seconds": round(time.perf_counter() - t0, 1),
        "trace": trace,
    }
