"""Prompts as decode chains (CachePool.prompts_as_steps): where every linear is an
int8-activation kernel, a prompt's rows carry the bits of one-token steps, whatever the chunks.
So the default prefix cache keeps a conversation's answers and any prefix, not only prompt
tokens on the 128-token grid, and a warm turn still gives a cold one's bits."""

from __future__ import annotations

import pytest
import torch

from specdec.backends import make_backend
from specdec.backends.native.kernels.kv_layout import keys_of
from specdec.backends.native.model import batch_runner
from specdec.backends.native.model.native_model import NativeModel
from specdec.backends.prefix_cache import PREFILL_CHUNK, PrefixCache
from specdec.engine import Engine
from specdec.models import LoadedModel, load_tokenizer
from test_gguf_loader import _write

# (arch, qtype, prompts as steps): the int8-activation files run them; F16 keeps its prompt layers
FILES = [("llama", "Q4_1", True), ("gemma3", "Q4_K", True), ("qwen2", "Q8_0", True), ("llama", "F16", False)]
KV = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(10, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _slot_cache(pool, seq, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot's keys and values of its first `length` tokens, every layer."""
    return keys_of(pool.k[:, seq.slot], length), pool.v[:, seq.slot, :, :length].clone()


@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize(("arch", "qtype", "as_steps"), FILES)
def test_a_prompt_in_any_chunks_has_the_bits_of_one_token_steps(tmp_path_factory, arch, qtype, as_steps, kv):
    """A 150-token prompt prefilled whole, prefilled as 61 tokens then 89, and fed as 140 then
    ten one-token steps: the same cache and the same last logits, where prompts run as steps.
    A file whose prompts take their own layers (F16) differs from the steps, so the comparison
    can fail."""
    model = NativeModel.from_gguf(_write(tmp_path_factory, arch, qtype)[0])
    pool = model.new_pool(slots=3, max_length=256, kv_dtype=KV[kv])
    assert pool.prompts_as_steps == as_steps
    prompt = _tokens(150, seed=1)
    whole, split, steps = pool.new_sequence(), pool.new_sequence(), pool.new_sequence()
    last = whole.prefill(prompt, all_logits=False)
    split.prefill(prompt[:61], all_logits=False)
    split_last = split.prefill(prompt, all_logits=False, keep=split.prefix_cache.cached_prefix(prompt))
    steps.prefill(prompt[:140], all_logits=False)
    for token in prompt[140:]:
        step_last = steps.forward([token])[-1:]
    same = [torch.equal(a, b) for a, b in zip(_slot_cache(pool, whole, 150), _slot_cache(pool, steps, 150),
                                              strict=True)]
    if as_steps:
        assert split.prefix_cache.cached_prefix(prompt) == 150  # kept off the chunk grid
        assert all(same) and torch.equal(last, step_last) and torch.equal(last, split_last)
        assert all(torch.equal(a, b) for a, b in zip(_slot_cache(pool, whole, 150),
                                                     _slot_cache(pool, split, 150), strict=True))
    else:
        assert not (all(same) and torch.equal(last, step_last))


def test_a_compiled_model_keeps_its_prompt_layers(tmp_path_factory, monkeypatch):
    """A compiled step rounds otherwise than an eager chain, so compiling turns it off."""
    model = NativeModel.from_gguf(_write(tmp_path_factory, "llama", "Q4_1")[0])
    pool = model.new_pool(slots=1, max_length=64)
    assert pool.prompts_as_steps and pool.new_sequence().prefix_cache.steps_exact
    monkeypatch.setattr(model, "compiled", True)
    assert not pool.prompts_as_steps


@pytest.mark.parametrize(("mode", "exact", "keeps_answer"), [
    ("prompt", True, True), ("decoded", True, True), ("off", True, False),
    ("prompt", False, False), ("decoded", False, True),
])
def test_the_record_keeps_answers_and_off_grid_prefixes_where_steps_are_exact(mode, exact, keeps_answer):
    record = PrefixCache(mode, steps_exact=lambda: exact)
    prompt, answer = list(range(PREFILL_CHUNK + 5)), [7] * 9
    record.start_prefill(prompt, 0)
    record.mark_decoded(prompt + answer, len(prompt) + len(answer))
    follow_up = prompt + answer + [1, 2]
    want = {("off", True): 0, ("prompt", False): PREFILL_CHUNK}.get((mode, exact), len(prompt) + len(answer))
    assert record.cached_prefix(follow_up) == want
    assert record.reuse_decoded == keeps_answer


def _target(tmp_path_factory, arch: str, qtype: str) -> LoadedModel:
    path = _write(tmp_path_factory, arch, qtype)[0]
    return LoadedModel(path.name, tokenizer=load_tokenizer("smollm2-135m"), gguf_path=path)


def test_a_conversation_reuses_its_answer_and_continues_as_a_cold_start(smollm2):
    """Turn 2 of a conversation with the embedded model resends turn 1's prompt and answer plus
    a new message: with `suffix` drafting, the default prefix cache keeps all of turn 1 (answer
    included, off the grid) and turn 2's reply equals a cold plain engine's, token for token,
    with drafts accepted."""
    lines = "".join(f"item {i}: the cache keeps every token of the turn.\n" for i in range(12))
    prompt = smollm2.tokenizer.encode(f"Repeat these lines exactly.\n{lines}")
    warm = Engine(smollm2, drafter="suffix", k=4, backend="native")
    first = warm.generate(prompt, max_new_tokens=32, chat=False).token_ids
    turn2 = prompt + first + smollm2.tokenizer.encode(f"\nAgain, the same lines.\n{lines[:120]}")
    second = warm.generate(turn2, max_new_tokens=32, chat=False)
    assert second.stats.cached_prompt_tokens == len(prompt) + len(first) - 1
    assert (len(prompt) + len(first) - 1) % PREFILL_CHUNK  # off the grid: the old record would not keep it
    cold = Engine(smollm2, drafter="none", k=0, backend="native").generate(turn2, max_new_tokens=32,
                                                                           chat=False)
    assert second.token_ids == cold.token_ids
    assert second.stats.num_accepted_tokens > 0


def test_the_pool_runs_a_prompt_as_one_chain(tmp_path_factory, monkeypatch):
    """The chunks of a prefill go through forward_batch as one chain row (no causal mask)."""
    seq = make_backend("native", _target(tmp_path_factory, "qwen2", "Q8_0"))
    assert seq.pool.prompts_as_steps
    masks = []
    row = batch_runner.CachePool._row

    def spy(self, *args):
        made = row(self, *args)
        masks.append(made.mask)
        return made

    monkeypatch.setattr(batch_runner.CachePool, "_row", spy)
    seq.prefill(_tokens(300, seed=4), all_logits=False)
    assert masks and all(mask is None for mask in masks)
