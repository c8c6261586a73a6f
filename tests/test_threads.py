"""The same bits at one and two threads (issue 25: replicas with different core counts must
agree): the one-thread GEMM, and whole models from GGUF files and HF directories, eager and
compiled, each count in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from specdec.backends.native.kernels import cpu
from test_gguf_loader import _write

# A whole model's logits at a thread count: a 270-token prefill (two whole chunks and a short
# one), 8 greedy steps and a 4-token chain; one digest per file (bf16kv:...: over a bf16 KV
# cache). Run in a fresh interpreter per count, since numba fixes its thread count at its first
# parallel launch.
THREADS_SCRIPT = """
import hashlib, json, sys
import torch
torch.set_num_threads(int(sys.argv[1]))
from specdec.backends.native.model.native_model import NativeModel
digests = {}
for spec in sys.argv[2:]:
    kv_dtype = torch.bfloat16 if spec.startswith("bf16kv:") else torch.float32
    path = spec.removeprefix("bf16kv:").removeprefix("compiled:")  # compiled:...: the layers torch.compile'd
    if path.startswith("hf:"):  # hf:PRECISION:DIRECTORY, over transformers' model as the loader builds it
        from transformers import AutoModelForCausalLM
        _, precision, directory = path.split(":", 2)
        model = NativeModel.from_hf(AutoModelForCausalLM.from_pretrained(directory).eval(), precision)
    else:
        model = NativeModel.from_gguf(path)
    vocab = model.config.vocab_size
    pool = model.new_pool(max_length=512, kv_dtype=kv_dtype)
    if spec.startswith("compiled:"):
        model.compile(pool)
    seq = pool.new_sequence()
    ids = [int(t) for t in torch.randint(3, vocab, (270,), generator=torch.Generator().manual_seed(0))]
    logits, h = seq.prefill(ids), hashlib.sha256()
    h.update(logits.numpy().tobytes())
    token = int(logits[-1].argmax())
    for _ in range(8):
        out = seq.forward([token])
        h.update(out.numpy().tobytes())
        token = int(out[-1].argmax())
    h.update(seq.forward([token, 5, 6, 7]).numpy().tobytes())
    digests[spec] = h.hexdigest()
digests["torch threads at the end"] = torch.get_num_threads()  # numba's pool must not reset it
print(json.dumps(digests))
"""


def _digests_at_one_and_two_threads(paths: list) -> tuple[dict, dict]:
    """Each count's digests, from two interpreters run side by side: the digests do not
    depend on timing, and two cores halve the wall time of loading and compiling. Their
    output goes to files, so that neither blocks on a full pipe while the other is read."""
    digests = {}
    with tempfile.TemporaryDirectory() as folder:
        logs = {threads: (Path(folder, f"{threads}.out"), Path(folder, f"{threads}.err"))
                for threads in (1, 2)}
        runs = {}
        for threads, (out, err) in logs.items():
            with out.open("w") as stdout, err.open("w") as stderr:
                runs[threads] = subprocess.Popen([sys.executable, "-c", THREADS_SCRIPT, str(threads),
                                                  *map(str, paths)],
                                                 stdout=stdout, stderr=stderr)
        try:
            for threads, run in runs.items():
                out, err = logs[threads]
                assert run.wait() == 0, err.read_text()[-3000:]
                digests[threads] = json.loads(out.read_text().splitlines()[-1])
                # else the counts compared are not these
                assert digests[threads].pop("torch threads at the end") == threads, digests[threads]
        finally:  # one failed: the other is not left running
            for run in runs.values():
                run.kill()
                run.wait()
    return digests[1], digests[2]


def test_whole_models_give_the_same_bits_at_one_and_two_threads(tmp_path_factory):
    """Prefill (prompt kernels, a short chunk's decode kernels, SDPA), decode steps and a
    verify chain, every architecture with a quant type each: bit-identical logits at 1 and 2
    threads on the CPU at hand; and a few of them over a bf16 KV cache (the one-call layers,
    gemma3's sliding window, F16's separate calls)."""
    pairs = [("llama", "Q4_K"), ("mistral", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "Q6_K"), ("gemma3", "Q5_K"),
             ("phi3", "Q4_1"), ("llama", "F16")]
    paths = [_write(tmp_path_factory, arch, qtype)[0] for arch, qtype in pairs]
    paths += [f"bf16kv:{paths[i]}" for i in (0, 4, 6)]
    one, two = _digests_at_one_and_two_threads(paths)
    assert one == two


@pytest.mark.slow
def test_the_embedded_model_gives_the_same_bits_at_one_and_two_threads():
    """The same on the real SmolLM2 file, whose 576/1536-wide matrices take other GEMM paths,
    with an fp32 and a bf16 KV cache."""
    from specdec.models import builtin_gguf_path

    path = builtin_gguf_path("smollm2-135m")
    one, two = _digests_at_one_and_two_threads([path, f"bf16kv:{path}"])
    assert one == two


def test_hf_directories_give_the_same_bits_at_one_and_two_threads(tmp_path):
    """A float checkpoint at int4 (dense bf16 or fp32 prompt layers, cpu.one_thread_mm) and at
    fp32 (whose 4-row verify chains took MKL's thread-split GEMM on an AMX Xeon), at the
    embedded model's widths."""
    directory = _hf_directory(tmp_path)
    specs = [f"hf:{precision}:{directory}" for precision in ("int4", "fp32")]
    one, two = _digests_at_one_and_two_threads(specs)
    assert one == two


@pytest.mark.slow
def test_a_compiled_model_gives_the_same_bits_at_one_and_two_threads(tmp_path):
    """compile=1 at fp32: Inductor's own mm summed a 4-row chain's K in another order at 2
    threads; the compiled layers now call one_thread_mm as an opaque op."""
    spec = f"compiled:hf:fp32:{_hf_directory(tmp_path)}"
    one, two = _digests_at_one_and_two_threads([spec])
    assert one == two


def _hf_directory(path) -> str:
    """A random llama checkpoint at the embedded model's widths, two layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=2048, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m, k, n", [(4, 576, 576), (40, 2048, 2048), (128, 1536, 576), (40, 8960, 1536),
                                     (270, 1536, 256), (1, 576, 1000)])
def test_the_prompt_gemm_gives_the_same_bits_at_any_thread_count(dtype, m, k, n):
    """Shapes where oneDNN's or MKL's own GEMM changed its bits between 1 and 2 threads on an AMX
    Xeon: the same bits at 1, 2 and 1 threads, and the process's count comes back. The large
    bf16 shapes run where the CPU has bf16 instructions: elsewhere they are emulated at a
    fraction of a GFLOP/s, and the small ones test the same path."""
    if dtype == torch.bfloat16 and m * k * n > 10**8 and not cpu.cpu_features() & {"avx512_bf16", "amx_bf16"}:
        pytest.skip("no bf16 instructions on this CPU: the large bf16 shapes are emulated")
    g = torch.Generator().manual_seed(k + n)
    x, w_t = torch.randn(m, k, generator=g).to(dtype), torch.randn(k, n, generator=g).to(dtype)
    threads, outs = torch.get_num_threads(), {}
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            outs.setdefault(count, []).append(cpu.one_thread_mm(x, w_t, torch.empty(m, n, dtype=dtype)))
            assert torch.get_num_threads() == count
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[1][0], outs[2][0]) and torch.equal(outs[1][0], outs[1][1])
    torch.testing.assert_close(outs[1][0].float(), (x.float() @ w_t.float()), rtol=2e-2, atol=2e-2 * k**0.5)


def test_a_failing_gemm_raises_and_restores_the_thread_count():
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError):  # an out of another dtype
            cpu.one_thread_mm(torch.ones(3, 64), torch.ones(64, 600),
                              torch.empty(3, 600, dtype=torch.float64))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
