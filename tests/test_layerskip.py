"""Self-speculative layer skipping and the EAGLE drafter on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import save_loaded, tiny_llama
from specdec.backends import make_backend
from specdec.backends.hf import HFBackend
from specdec.drafters import make_drafter
from specdec.drafters.eagle import EagleDrafter, EagleHead, head_config_from_target
from specdec.drafters.layerskip import LayerSkipDrafter, LayerStack, load_choice, parse_layers, save_choice
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.train.layerskip_search import simulate_tau

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=4, hidden=64)


def _lean(target, head: EagleHead, precision: str, backend: str = "native"):
    """The head on a backend's kernels, built through its FeatureModel as the drafter builds it."""
    return make_backend(backend, target).feature_model().draft_head(head.state_dict(), head.dims, None,
                                                                    precision)


def _plain(target, n=40):
    return Engine(target, "none", k=0).generate(PROMPT, max_new_tokens=n, chat=False)


def test_all_layers_give_the_target_logits(target):
    ids = [5, 17, 33, 2, 90, 41, 7]
    stack = LayerStack(target.model, [0, 1, 2, 3])
    full = HFBackend(target.model).prefill(ids)  # [7, V]
    mine = torch.cat([stack.prefill(ids[:3]), stack.forward(ids[3:5]), stack.forward(ids[5:])])
    assert torch.allclose(mine, full, atol=1e-4)


def test_rollback_then_forward_equals_fresh(target):
    ids = [5, 17, 33, 2, 90, 41, 7, 8]
    stack = LayerStack(target.model, [0, 2])
    fresh = stack.prefill(ids)
    stack.prefill(ids[:4] + [100, 101, 102])
    stack.rollback(4)
    assert stack.length == 4
    again = stack.forward(ids[4:])
    assert torch.allclose(again, fresh[4:], atol=1e-5)
    with pytest.raises(ValueError):
        stack.rollback(9)


@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [0, 3], [1]])
def test_greedy_output_matches_plain(target, layers):
    plain = _plain(target)
    drafter = LayerSkipDrafter(LayerStack(target.model, layers), target.eos_token_ids)
    out = Engine(target, drafter, k=4).generate(PROMPT, max_new_tokens=40, chat=False)
    assert out.token_ids == plain.token_ids
    assert out.stats.num_draft_tokens > 0
    if layers == [0, 1, 2, 3]:  # the whole target drafts for itself: everything is accepted
        assert out.stats.num_accepted_tokens == out.stats.num_draft_tokens


def test_sampling_returns_the_draft_distributions(target):
    drafter = LayerSkipDrafter(LayerStack(target.model, [0, 3]), target.eos_token_ids)
    out = Engine(target, drafter, k=3).generate(PROMPT, max_new_tokens=20, chat=False, temperature=1.0,
                                                seed=0)
    assert len(out.token_ids) == 20 and out.stats.num_draft_tokens > 0


def test_method_strings_and_choice_files(target, tmp_path):
    assert parse_layers("0-2,5") == [0, 1, 2, 5]
    assert make_drafter("layerskip", target).backend.layer_ids == [0]  # first third of 4 layers
    assert make_drafter("layerskip:layers=1-3", target).backend.layer_ids == [1, 2, 3]
    path = tmp_path / "ls.json"
    save_choice(path, target.name, 4, [0, 2], {"tau": 1.5})
    assert load_choice(path, 4) == [0, 2]
    assert make_drafter(f"layerskip:{path}", target).backend.layer_ids == [0, 2]
    with pytest.raises(SpecdecError, match="4-layer target; this one has 6"):
        load_choice(path, 6)
    with pytest.raises(SpecdecError, match="out of range"):
        make_drafter("layerskip:layers=0-9", target)
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(SpecdecError, match="not JSON"):
        make_drafter(f"layerskip:{tmp_path / 'bad.json'}", target)
    with pytest.raises(SpecdecError, match="bad layer list"):
        parse_layers("a-b")


@pytest.mark.parametrize(
    "match, k, expected",
    [
        ([True, True, False, True], 2, (4, 2)),  # steps: accept 2 (+1) = 3 tokens, then 1 left
        ([False, False, False], 4, (3, 3)),  # nothing accepted: one token a step
        ([True] * 6, 8, (6, 1)),  # one step covers all (cut at the end)
        ([True] * 6, 2, (6, 2)),  # 3 tokens a step
    ],
)
def test_simulate_tau(match, k, expected):
    assert simulate_tau(match, k) == expected


def test_search_cli_writes_a_loadable_choice(target, tmp_path):
    from specdec.cli import main

    model_dir = save_loaded(target, tmp_path / "target")
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"prompt": "The quick brown"}) + "\n")
    out = tmp_path / "choice.json"
    main(["layerskip", "search", "--target", model_dir, "--data", str(data), "--out", str(out), "--quick",
          "--max-k", "3"])
    saved = json.loads(out.read_text())
    assert saved["num_layers"] == 4 and saved["layers"] and saved["search"]["calibration_positions"] > 0
    drafter = make_drafter(f"layerskip:{out}", target)
    plain = _plain(target, 24)
    assert (Engine(target, drafter, k=3).generate(PROMPT, max_new_tokens=24, chat=False).token_ids
            == plain.token_ids)


def test_untrained_eagle_head_is_lossless(target):
    torch.manual_seed(0)
    head = EagleHead(head_config_from_target(target.model)).eval()
    plain = _plain(target, 24)
    for vocab_ids in (None, torch.arange(50)):
        drafter = EagleDrafter(head, vocab_ids, target.eos_token_ids)
        engine = Engine(target, drafter, k=4)
        out = engine.generate(PROMPT, max_new_tokens=24, chat=False)
        assert engine.backend.hidden is not None  # the engine handed its backend to the drafter
        assert out.token_ids == plain.token_ids
        assert out.stats.num_draft_tokens > 0
        sampled = engine.generate(PROMPT, max_new_tokens=12, chat=False, temperature=0.8, seed=1)
        assert len(sampled.token_ids) == 12


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("precision, atol", [("fp32", 1e-5), ("int8", 0.1)])
def test_lean_head_follows_the_trained_module(target, precision, atol, backend):
    """The drafting runtime (native layer, static cache) predicts what the transformers head
    does: a 40-token first call (one causal pass), steps of 1 and 3 tokens, and an overwrite
    after a rollback."""
    torch.manual_seed(0)
    head = EagleHead(head_config_from_target(target.model)).eval()
    for p in head.parameters():  # a trained head: no zeroed projections
        torch.nn.init.normal_(p, std=0.05)
    lean = _lean(target, head, precision, backend)
    lean._alloc(32)  # a small cache, so that the calls below grow it
    feats, embeds = torch.randn(50, 64), torch.randn(50, 64)
    with torch.no_grad():
        want = head(feats[None], embeds[None], torch.full((50, 50), float("-inf")).triu(1)[None, None])[0]
    got = torch.cat([lean.forward(feats[:40], embeds[:40], 0), lean.forward(feats[40:41], embeds[40:41], 40),
                     lean.forward(feats[41:44], embeds[41:44], 41)])
    torch.testing.assert_close(got, want[:44], atol=atol, rtol=0)
    lean.forward(torch.randn(2, 64), torch.randn(2, 64), 44)  # guesses, then rolled back over
    again = lean.forward(feats[44:50], embeds[44:50], 44)
    torch.testing.assert_close(again, want[44:50], atol=atol, rtol=0)


def test_eagle_needs_a_trained_directory(target, tmp_path):
    with pytest.raises(SpecdecError, match="eagle:DIR"):
        make_drafter("eagle", target)
    with pytest.raises(SpecdecError, match="distill --kind eagle"):
        make_drafter(f"eagle:{tmp_path}", target)
