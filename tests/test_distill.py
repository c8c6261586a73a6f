"""`specdec distill` end to end on a tiny random target, its pieces, and the traffic log."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import CORPUS, save_loaded, tiny_llama
from specdec.cli import main
from specdec.engine import Engine
from specdec.errors import SpecdecError
from specdec.models import load_model
from specdec.prompts import encode
from specdec.tools import tool_plan
from specdec.traffic_log import TrafficLog, read_traffic
from specdec.train.data import (
    DataSettings,
    _generate_sequences,
    load_sources,
    sources_from_logs,
    split_heldout,
)
from specdec.train.distill import draft_layer_ids, init_draft, new_eagle_head, topk_kl

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A saved tiny target, a prompt file, and one shared data directory."""
    root = tmp_path_factory.mktemp("distill")
    target = tiny_llama(seed=5, layers=4, hidden=64)
    model_dir = save_loaded(target, root / "target")
    data = root / "prompts.jsonl"
    with open(data, "w") as f:
        for text in CORPUS + [c[::-1] for c in CORPUS]:
            f.write(json.dumps({"turns": [text[:48]]}) + "\n")
    return {"root": root, "target": model_dir, "data": str(data), "data_dir": str(root / "data")}


def _distill(ws, kind: str, out, *extra: str) -> dict:
    main(["distill", "--target", ws["target"], "--data", ws["data"], "--data-dir", ws["data_dir"],
          "--out", str(out), "--kind", kind, "--quick", *extra])
    return json.loads((out / f"report-{kind}.json").read_text())


def test_draft_distillation_trains_saves_and_resumes(workspace, capsys):
    out = workspace["root"] / "draft"
    report = _distill(workspace, "draft", out, "--steps", "12")
    assert report["steps"] == 12
    assert report["kl_last"] < report["kl_first"]  # the KL to the target goes down
    assert report["top1_last"] > report["top1_first"]
    assert report["same_output"] is True
    state = json.loads((out / "checkpoint-draft" / "state.json").read_text())
    assert state["step"] == 12 and (out / "checkpoint-draft" / "params.safetensors").exists()

    capsys.readouterr()
    report = _distill(workspace, "draft", out, "--steps", "20")  # a later run resumes
    assert "resuming from step 12 of 20" in capsys.readouterr().err
    assert (report["steps"] == 20
            and len(json.loads((out / "checkpoint-draft" / "state.json").read_text())["history"]) == 20)

    target = load_model(workspace["target"])
    plain = Engine(target, "none", k=0).generate(PROMPT, max_new_tokens=32, chat=False)
    out_run = Engine(target, f"model:{out}", k=4).generate(PROMPT, max_new_tokens=32, chat=False)
    assert out_run.token_ids == plain.token_ids
    assert out_run.stats.num_accepted_tokens > 0  # trained on the target, it agrees with it


def test_eagle_distillation_loss_decreases_and_loads(workspace):
    out = workspace["root"] / "eagle"
    report = _distill(workspace, "eagle", out, "--steps", "20")
    assert report["loss_last"] < report["loss_first"]
    assert report["same_output"] is True
    config = json.loads((out / "eagle_config.json").read_text())
    assert config["format"] == "specdec-eagle" and config["steps"] == 20
    target = load_model(workspace["target"])
    plain = Engine(target, "none", k=0).generate(PROMPT, max_new_tokens=32, chat=False)
    run = Engine(target, f"eagle:{out}", k=4).generate(PROMPT, max_new_tokens=32, chat=False)
    assert run.token_ids == plain.token_ids and run.stats.num_draft_tokens > 0


def test_lora_fine_tunes_an_existing_draft(workspace, tmp_path):
    pytest.importorskip("peft")
    out = tmp_path / "lora"
    # The target itself stands in for an existing draft with the same tokenizer.
    report = _distill(workspace, "draft", out, "--init", workspace["target"], "--lora", "2", "--steps", "3")
    assert report["steps"] == 3 and report["same_output"] is True
    saved = load_model(str(out))  # merged: a plain model, no peft needed to load it
    assert not any("lora" in name for name, _ in saved.model.named_parameters())


def test_init_draft_with_every_layer_is_the_target():
    target = tiny_llama(seed=1, layers=3, hidden=64).model
    draft = init_draft(target, 3)
    ids = torch.tensor([[3, 9, 27, 81]])
    assert torch.allclose(draft(input_ids=ids).logits, target(input_ids=ids).logits, atol=1e-5)
    assert draft_layer_ids(30, 4) == [0, 10, 19, 29]
    assert len(init_draft(target, 2).model.layers) == 2
    with pytest.raises(SpecdecError, match="--layers"):
        init_draft(target, 5)


def test_new_eagle_head_starts_by_repeating_the_feature():
    target = tiny_llama(seed=1, layers=2, hidden=64).model
    head = new_eagle_head(target)
    feats, embeds = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    out = head(feats, embeds, None)
    # Zeroed output projections: the prediction is fc's pass-through plus a little embedding.
    assert torch.allclose(out, feats + embeds @ head.fc.weight[:, :64].T, atol=1e-5)


def test_topk_kl():
    target = torch.tensor([[2.0, 1.0, 0.0]])
    same = target.log_softmax(-1)
    assert topk_kl(same, target).abs().item() < 1e-6
    assert topk_kl(torch.log(torch.tensor([[0.2, 0.3, 0.5]])), target).item() > 0.1
    # Only tokens the draft can score count; the target is renormalised over them.
    support = torch.tensor([[True, True, False]])
    draft = torch.cat([target[:, :2].log_softmax(-1), torch.tensor([[-5.0]])], dim=-1)
    assert topk_kl(draft, target, support).abs().item() < 1e-6


def test_prompt_files_and_heldout_split(tmp_path):
    good = tmp_path / "ok.jsonl"
    good.write_text('{"turns": ["a", "b"]}\n\n{"prompt": "c"}\n'
                    '{"messages": [{"role": "user", "content": "d"}]}\n')
    sources = load_sources(good)
    assert [s.turns for s in sources[:2]] == [["a", "b"], ["c"]] and sources[2].messages
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["a"]}\n{"turns": []}\n')
    with pytest.raises(SpecdecError, match="bad.jsonl:2"):
        load_sources(bad)
    (tmp_path / "nojson.jsonl").write_text("nope\n")
    with pytest.raises(SpecdecError, match="not JSON"):
        load_sources(tmp_path / "nojson.jsonl")
    train, held = split_heldout(sources * 10, max_heldout=2)
    assert len(held) == 2 and len(train) == 28


def test_traffic_log_is_bounded_and_readable(tmp_path):
    log = TrafficLog(tmp_path / "log", max_bytes=4096)
    for i in range(200):
        log.record([{"role": "user", "content": f"question {i}"}], "answer " * 10, {"target": "t", "i": i})
    files = list((tmp_path / "log").iterdir())
    assert 1 < len(files) <= 5
    assert sum(f.stat().st_size for f in files) <= 4096 + log.segment_bytes
    records = list(read_traffic(tmp_path / "log"))
    ids = [r["meta"]["i"] for r in records]
    assert ids == sorted(ids) and ids[-1] == 199 and ids[0] > 0  # the oldest were rotated away
    log.record("x" * 5000, "too big for the bound")
    assert [r["meta"].get("i") for r in read_traffic(tmp_path / "log")] == ids  # dropped, nothing rotated
    with pytest.raises(SpecdecError, match="log directory not found"):
        list(read_traffic(tmp_path / "missing"))


def test_generate_logs_and_distill_reads_the_log(workspace, tmp_path, capsys):
    log_dir = tmp_path / "log"
    for prompt in ("def add(a, b):", "The quick brown fox", '{"name": "search"'):
        main(["generate", "--target", workspace["target"], "--drafter", "ngram", "--prompt", prompt,
              "--max-new-tokens", "8", "--log-dir", str(log_dir)])
    records = list(read_traffic(log_dir))
    assert len(records) == 3 and records[0]["meta"]["target"] == workspace["target"]
    out = tmp_path / "from-logs"
    main(["distill", "--target", workspace["target"], "--from-logs", str(log_dir), "--out", str(out),
          "--quick", "--steps", "3"])
    report = json.loads((out / "report-draft.json").read_text())
    assert report["data_sequences"] == 2 and report["steps"] == 3  # one of three is held out


def test_logged_tool_conversations_are_rendered_with_their_tools(tmp_path):
    """A served tool conversation (a past call with null content, its result, the request's
    tools in the meta) is a training source, rendered with the tools the server showed."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
                {"role": "user", "content": "And in Rome?"}]
    target = save_loaded(tiny_llama(seed=5, layers=2, hidden=64, max_positions=2048), tmp_path / "target")
    log = TrafficLog(tmp_path / "log")
    log.record(messages, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
               {"target": target, "finish_reason": "tool_calls", "tools": tools})
    sources, skipped = sources_from_logs(tmp_path / "log", target)
    assert skipped == 0 and len(sources) == 1
    source = sources[0]
    assert source.tools == tools and source.logged_stop
    engine = Engine(target, drafter="none")
    [seq] = _generate_sequences(engine, source, DataSettings(), seed=0)
    prompt_ids = encode(engine.tokenizer, messages, tools=tool_plan(tools))
    assert seq.tokens[:seq.gen_start] == prompt_ids
    assert prompt_ids != encode(engine.tokenizer, messages)  # the tools block is part of the prompt
    assert seq.tokens[-1] == engine.tokenizer.eos_token_id
