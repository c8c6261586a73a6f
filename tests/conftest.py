"""Shared fixtures: tiny random models built from a config (nothing is downloaded), a tiny
byte-level BPE tokenizer trained in-process, and the real embedded model for slow tests."""

from __future__ import annotations

import functools
import os

import pytest
import torch

# The adaptive k prices steps from fixed costs in every engine and server the suite makes,
# spawned servers included (they inherit the environment): a k never depends on how busy the
# machine is, only on the tokens. A line t(n) = 1 + 0.1 (n - 1), where speculation pays.
# tests/test_controller.py clears it to test the measuring cost model itself.
FIXED_SCORE_COSTS = "1=1.0,17=2.6"
os.environ["SPECDEC_SCORE_COSTS"] = FIXED_SCORE_COSTS

# Under pytest-xdist (`make test` runs two workers) each worker and the processes it spawns run
# one thread: two workers of two threads each oversubscribe the cores, and OpenMP's spinning
# then slowed small matmuls tenfold. Tests of thread counts set theirs explicitly.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    '{"name": "search", "arguments": {"query": "weather in Paris"}}',
    "The quick brown fox jumps over the lazy dog. " * 3,
    "| name | value |\n|------|-------|\n| a | 1 |\n",
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
]


@functools.cache
def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, max_positions: int = 256,
               vocab: int | None = None):
    """A randomly initialised Llama whose vocabulary matches `tiny_tokenizer()` (or its first `vocab` ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models import LoadedModel

    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Sharpen the random logits so greedy choices are far from ties.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return LoadedModel(name=f"tiny-llama-{seed}", model=model, tokenizer=tok)


def save_loaded(loaded, path) -> str:
    loaded.model.save_pretrained(str(path))
    loaded.tokenizer.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default model: its tokenizer and facts; `.model` (transformers) builds
    on first use (slow: converts the GGUF once, then loads from the cache)."""
    from specdec.models import load_model

    return load_model("smollm2-135m")


def spy_trees(backend) -> list[list[int]]:
    """Record the parents of every token tree the backend scores (one list per forward_tree)."""
    trees: list[list[int]] = []
    original = backend.forward_tree

    def forward_tree(token_ids, parents):
        trees.append(list(parents))
        return original(token_ids, parents)

    backend.forward_tree = forward_tree
    return trees
