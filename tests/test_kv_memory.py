"""KV memory committed as tokens are held: the lazy tensor behind the cache, the pool's
accounting, the model's own window by default, and the server's start-up line."""

import sys

import pytest
import torch

from conftest import tiny_llama
from specdec.backends import KVMemory
from specdec.backends.native.kernels.attention import padded as padded_length  # `padded` names a pool here
from specdec.backends.native.kernels.kv_layout import KEY_TILE, keys_of, store_keys
from specdec.backends.native.model import kv_memory
from specdec.backends.native.model.kv_memory import LazyTensor, resident_bytes
from specdec.backends.native.model.native_model import NativeModel
from specdec.serve.cli import ready_line

MIB = 1024**2
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="demand paging is read from /proc")


@linux_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lazy_tensor_commits_what_is_written_and_gives_it_back(dtype):
    before = resident_bytes()
    lazy = LazyTensor((1024, 1024 * 1024 // 2), dtype)  # 1 or 2 GiB of address space
    assert lazy.lazy and resident_bytes() - before < 16 * MIB
    rows = 64 if dtype == torch.bfloat16 else 32  # 64 MiB either way
    lazy.tensor[:rows] = 1.0
    written = resident_bytes() - before
    assert 60 * MIB < written < 80 * MIB
    lazy.release(0, rows * lazy.shape[1])
    assert resident_bytes() - before < written - 56 * MIB
    assert float(lazy.tensor[:rows].abs().sum()) == 0.0  # given back pages read as zeros


def test_release_keeps_the_pages_it_only_partly_covers():
    lazy = LazyTensor((4 * kv_memory.PAGE,), torch.uint8)
    lazy.tensor[:] = 7
    lazy.release(1, 2 * kv_memory.PAGE)  # covers page 1 whole, pages 0 and 2 in part
    expected = torch.full((4 * kv_memory.PAGE,), 7, dtype=torch.uint8)
    expected[kv_memory.PAGE : 2 * kv_memory.PAGE] = 0
    assert torch.equal(lazy.tensor, expected)


def test_elsewhere_the_tensor_is_allocated_whole(monkeypatch):
    monkeypatch.setattr(kv_memory.sys, "platform", "darwin")
    whole = LazyTensor((8, 8), torch.float32)
    assert not whole.lazy and whole.tensor.sum() == 0
    whole.release(0, 64)  # a no-op
    assert whole.tensor.shape == (8, 8)


@pytest.fixture(scope="module")
def model():
    return NativeModel.from_hf(tiny_llama(max_positions=2048).model)


def _greedy(seq, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    logits = seq.prefill(prompt)
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits = seq.forward(tokens[-1:])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def test_the_window_is_the_models_own_by_default(model):
    pool = model.new_pool(slots=3)
    assert pool.max_length == model.config.max_positions == 2048
    memory = pool.kv_memory()
    assert memory.window == 2048 and memory.slots == 3 and memory.held_tokens == 0
    cfg = model.config
    assert memory.bytes_per_token == cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim + 1) * 4
    assert memory.limit_bytes >= 3 * 2048 * memory.bytes_per_token


def test_a_heads_keys_are_one_stretch_of_memory_in_blocks(model):
    """Keys [layers, slots, kv_heads, length / 16, dim, 16]: position p in block p // 16, so a
    head's keys are one stretch that a pass reads as one stream. An fp32 block holds dim d of
    its keys in row d; a bf16 block holds pairs, dims 2j and 2j + 1 of key c at flat 32j + 2c
    and 32j + 2c + 1 (vdpbf16ps's operand: 16 keys' pair j in one stretch of 64 bytes)."""
    for dtype in (torch.bfloat16, torch.float32):
        pool = model.new_pool(slots=2, kv_dtype=dtype)
        assert pool.k.is_contiguous()
        assert pool.k.shape[3:] == (padded_length(pool.max_length) // KEY_TILE, pool.k.shape[4], KEY_TILE)
        keys = torch.randn(pool.k.shape[2], 40, pool.k.shape[4]).to(dtype)  # [kv_heads, 40, dim]
        store_keys(pool.k[0, 1], 5, keys)
        block = pool.k[0, 1, :, 39 // KEY_TILE]  # position 39: column 7 of its block
        if dtype == torch.bfloat16:
            flat = block.flatten(-2)
            assert torch.equal(flat[:, 2 * 7 :: 2 * KEY_TILE], keys[:, 39 - 5, 0::2])  # even dims
            assert torch.equal(flat[:, 2 * 7 + 1 :: 2 * KEY_TILE], keys[:, 39 - 5, 1::2])
        else:
            assert torch.equal(block[:, :, 7], keys[:, 39 - 5])
        assert torch.equal(keys_of(pool.k[0, 1], 45)[:, 5:], keys) and not pool.k[0, 0].any()


def test_keys_past_a_sequence_in_its_last_block_are_never_read(model):
    """A step reads its keys in whole blocks only where they are all held: keys past the
    sequence in its last block (NaN here) leave the bits as they are."""
    prompt = [5 + i % 300 for i in range(300)]  # 300 = 18 blocks and 12 keys
    runs = []
    for poison in (True, False):
        pool = model.new_pool(slots=1, kv_dtype=torch.bfloat16)
        seq = pool.new_sequence()
        logits = seq.prefill(prompt)
        if poison:  # positions 306 .. 319: past the six steps below, inside their last block
            layers, kv_heads, dim = pool.k.shape[0], pool.k.shape[2], pool.k.shape[4]
            store_keys(pool.k[:, 0], 306, torch.full((layers, kv_heads, 14, dim), float("nan")))
        tokens = [int(logits[-1].argmax())]
        for _ in range(6):
            logits = seq.forward(tokens[-1:])
            tokens.append(int(logits[-1].argmax()))
        runs.append((tokens, logits))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("precision, option, dtype", [
    (None, None, torch.bfloat16), ("int8", None, torch.bfloat16), ("fp32", None, torch.float32),
    (None, "bf16", torch.bfloat16), (None, "fp32", torch.float32), ("fp32", "fp16", torch.float16)])
def test_the_cache_is_bf16_on_the_cpu_unless_the_option_or_fp32_weights_say_so(precision, option, dtype):
    """The backend's default halves the bytes a step reads at long contexts; fp32 weights keep an
    fp32 cache; the option still chooses, and an unknown type is a one-line error naming it."""
    from specdec.backends import make_backend
    from specdec.errors import SpecdecError

    target = tiny_llama(max_positions=256)
    seq = make_backend("native", target, max_length=64, kv_dtype=option, precision=precision)
    assert seq.pool.kv_dtype == dtype and seq.pool.kv_memory().bytes_per_token % dtype.itemsize == 0
    with pytest.raises(SpecdecError, match="kv_dtype"):
        make_backend("native", target, max_length=64, kv_dtype="int3")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lazy", [True, False])
def test_memory_follows_the_tokens_held_and_cleared_slots_read_as_new(model, monkeypatch, lazy, kv_dtype):
    if not lazy:
        monkeypatch.setattr(kv_memory.sys, "platform", "darwin")
    pool = model.new_pool(slots=2, kv_dtype=kv_dtype)
    assert pool.kv_memory().lazy == (lazy and sys.platform == "linux")
    prompt = [5 + i % 300 for i in range(400)]
    first, second = pool.new_sequence(), pool.new_sequence()
    fresh, fresh_logits = _greedy(first, prompt, 8)
    alone = pool.kv_memory()
    assert 408 <= alone.held_tokens <= 408 + 256 and alone.committed_bytes >= 408 * alone.bytes_per_token // 2
    _greedy(second, prompt[:50], 4)
    both = pool.kv_memory()
    assert alone.held_tokens < both.held_tokens <= alone.held_tokens + 54 + 256
    first.reset()  # an evicted slot: its memory goes back
    assert pool.kv_memory().held_tokens == both.held_tokens - alone.held_tokens
    again, again_logits = _greedy(first, prompt, 8)  # over given-back pages: the same bits
    assert again == fresh and torch.equal(again_logits, fresh_logits)
    pool.release(second)
    assert pool.kv_memory().held_tokens == alone.held_tokens


def test_the_ready_line_states_the_memory_and_warns_past_what_is_available(monkeypatch):
    memory = KVMemory(slots=16, window=8192, dtype="float32", bytes_per_token=46_000,
                      limit_bytes=16 * 8192 * 46_000, held_tokens=0, committed_bytes=0, lazy=True)

    class Scheduler:
        def kv_memory(self):
            return memory

    line = ready_line(Scheduler())
    assert line.startswith("specdec serve: ready; KV cache: 16 slots x 8192 tokens, float32")
    assert "committed as tokens are held, at most 5.62 GiB" in line
    monkeypatch.setattr("specdec.serve.cli.available_memory", lambda: 2 * 1024**3)
    assert "more than the 2.0 GiB available now" in ready_line(Scheduler())

    class NoPool:
        def kv_memory(self):
            return None

    assert ready_line(NoPool()) == "specdec serve: ready"
