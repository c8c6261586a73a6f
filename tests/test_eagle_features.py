"""EAGLE through the backend protocol: the head reads the target's embedding and LM head from
the backend's `FeatureModel`, so a GGUF target drafts from its own blocks, with no float model."""

from __future__ import annotations

import pytest
import torch

from conftest import save_loaded, tiny_llama
from gguf_factory import spec_for, write_gguf
from specdec.backends import make_backend
from specdec.backends.native.model.native_model import NativeModel
from specdec.drafters import make_drafter
from specdec.drafters.eagle import EagleHead, head_config_from_target, save_head
from specdec.engine import Engine
from specdec.models import LoadedModel, load_tokenizer

VOCAB = 300  # synthetic files take SmolLM2's first VOCAB tokens
PROMPT = [1, 40, 41, 42, 200, 201, 40, 41, 42, 200, 201, 40]  # token ids below VOCAB


def _gguf_target(tmp_path_factory, tied: bool):
    path = tmp_path_factory.mktemp("eagle-gguf") / "model.gguf"
    weights = write_gguf(path, spec_for("llama", "Q8_0", vocab=VOCAB, tied=tied))
    return LoadedModel(path.name, tokenizer=load_tokenizer("smollm2-135m"), gguf_path=path), weights


def _repeating_head(hidden: int) -> EagleHead:
    """A head that predicts the feature it is given (fc picks the feature; the layer's output
    projections are zero), so it drafts what the target predicted last: a model that loops is
    drafted for and accepted."""
    dims = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": hidden // 4, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 2048}
    head = EagleHead(dims).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.fc.weight[:, hidden:] = torch.eye(hidden)
        head.layer.input_layernorm.weight.fill_(1.0)
        head.layer.post_attention_layernorm.weight.fill_(1.0)
    return head


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
@pytest.mark.parametrize("subset", [False, True], ids=["full-vocab", "fr-spec"])
def test_eagle_on_a_gguf_target_is_exact_without_a_float_model(tmp_path_factory, tied, subset):
    """Greedy EAGLE drafts on a GGUF target equal plain decoding. Random weights rarely repeat,
    so the FR-Spec case keeps one row: the token plain decoding emits most, which the
    drafter then proposes every step and the target accepts where it comes next."""
    target, _ = _gguf_target(tmp_path_factory, tied)
    plain = Engine(target, "none", k=0, backend="native").generate(PROMPT, max_new_tokens=40, chat=False)
    directory = tmp_path_factory.mktemp("head")
    counts = torch.bincount(torch.tensor(plain.token_ids), minlength=VOCAB)
    ranking = counts.argmax().view(1) if subset else None
    save_head(directory, _repeating_head(256), "synthetic", ranking, {"vocab_size": VOCAB})
    engine = Engine(target, make_drafter(f"eagle:{directory}", target), k=4, backend="native")
    out = engine.generate(PROMPT, max_new_tokens=40, chat=False)
    assert out.token_ids == plain.token_ids
    assert out.stats.num_draft_tokens > 0
    if subset:
        assert counts.max() > 1 and out.stats.num_accepted_tokens > 0, out.stats
    assert not target.model_loaded  # embedding and head rows came from the file's blocks


@pytest.mark.parametrize("tied", [False, True], ids=["own-head", "tied"])
def test_gguf_head_rows_are_the_files_values(tmp_path_factory, tied):
    target, weights = _gguf_target(tmp_path_factory, tied)
    model = NativeModel.from_gguf(target.gguf_path)
    ids = torch.tensor([0, 7, 299, 7])
    want = torch.from_numpy(weights["model.embed_tokens.weight" if tied else "lm_head.weight"])[ids]
    torch.testing.assert_close(model.head_rows(ids), want, rtol=0, atol=0)
    assert make_backend("native", target).feature_model() == make_backend("native", target).feature_model()


def test_head_rows_without_a_lookup_read_the_kernels_weights(tmp_path):
    """A float checkpoint's int8 head keeps no float copy: its rows are read back through the
    head, within int8's rounding of the checkpoint's."""
    target = tiny_llama(seed=1, hidden=64)
    model = NativeModel.from_pretrained(save_loaded(target, tmp_path), precision="int8")
    assert model._head_lookup is None
    ids = torch.tensor([3, 1, 40])
    want = target.model.get_output_embeddings().weight[ids].detach()
    torch.testing.assert_close(model.head_rows(ids), want, rtol=0, atol=float(want.abs().max()) / 100)


def test_hf_and_native_feature_models_agree():
    target = tiny_llama(seed=2, hidden=64)
    native, hf = (make_backend(kind, target, precision="fp32" if kind == "native" else None).feature_model()
                  for kind in ("native", "hf"))
    ids = torch.tensor([5, 9, 2])
    torch.testing.assert_close(native.embed(ids), hf.embed(ids), rtol=0, atol=0)
    features = torch.randn(3, 64)
    torch.testing.assert_close(native.logits(features), hf.logits(features), rtol=1e-5, atol=1e-5)
    assert (native.hidden_size, native.vocab_size) == (hf.hidden_size, hf.vocab_size)
    head = EagleHead(head_config_from_target(target.model)).eval()
    rows = torch.tensor([1, 2, 3])
    x = torch.randn(2, 64)
    for features_model in (native, hf):
        draft = features_model.draft_head(head.state_dict(), head.dims, rows, "fp32")
        want = features_model.logits(x)[:, rows]  # the subset's rows are int8 on a cpu
        torch.testing.assert_close(draft.logits(x), want, rtol=0, atol=0.03)


def test_a_pooled_drafter_builds_its_head_once_per_model(tmp_path):
    target = tiny_llama(seed=3, hidden=64)
    head = EagleHead(head_config_from_target(target.model)).eval()
    save_head(tmp_path, head, "tiny", None, {})
    drafter = make_drafter(f"eagle:{tmp_path}", target)
    pool_backend = make_backend("native", target, slots=2)
    first, second = pool_backend, pool_backend.pool.new_sequence()
    drafter.bind_target(first)
    built = drafter.head
    drafter.bind_target(second)
    assert drafter.head is built and drafter.backend is second
    drafter.bind_target(make_backend("native", target, precision="fp32"))  # another model: another head
    assert drafter.head is not built
