"""native/timing.py, the hook the benchmarks under scripts/bench time the kernels through: each
function on a tiny synthetic GGUF (tests/gguf_factory.py), so a refactor of the kernels that
breaks the hook fails here rather than in a script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_factory import spec_for, write_gguf
from specdec.backends.native import timing
from specdec.backends.native.kernels.numba_ops import importable
from specdec.backends.native.model.native_model import NativeModel

VOCAB = 512
needs_numba = pytest.mark.skipif(not importable(), reason="numba is not installed (the cpu extra)")


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("timing") / "llama-Q8_0.gguf"
    write_gguf(path, spec_for("llama", "Q8_0", vocab=VOCAB))
    return path


@needs_numba
def test_load_kernels_loads_every_kernel_module_and_no_earlier(tmp_path):
    """In a fresh process: importing the hook loads no kernel; load_kernels loads every module
    of kernels/jit, on numba threads as many as torch's."""
    jit = Path(timing.__file__).parent / "kernels" / "jit"
    package = "specdec.backends.native.kernels.jit"
    expected = sorted(f"{package}.{p.stem}" for p in jit.glob("*.py") if p.stem != "__init__")
    script = (
        "import json, sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from specdec.backends.native import timing\n"
        "def jit(): return sorted(m for m in sys.modules "
        "if m.startswith('specdec.backends.native.kernels.jit.'))\n"
        "before = jit()\n"
        "threads = timing.load_kernels()\n"
        "print(json.dumps([before, jit(), threads]))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    before, after, threads = json.loads(run.stdout.splitlines()[-1])
    assert before == [] and after == expected and threads == 1


def test_load_kernels_loads_nothing_where_pytorch_runs(monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_KERNELS", "fallback")
    assert timing.load_kernels() == 0


def test_file_layers_are_the_files_matrices_as_a_load_builds_them(q8_file):
    layers = timing.file_layers(q8_file)
    assert {"model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight"} <= set(layers)
    assert all(len(tensor.shape) == 2 for tensor, _ in layers.values())
    name = "model.layers.0.mlp.gate_proj.weight"
    ((tensor, layer),) = timing.file_layers(q8_file, [name]).values()
    x = torch.randn(3, tensor.shape[1], generator=torch.Generator().manual_seed(0))
    y = layer.forward(x)
    assert y.shape == (3, tensor.shape[0])
    reference = x @ torch.from_numpy(tensor.dequantize()).reshape(tensor.shape).T
    scale = float(reference.abs().max())
    assert torch.allclose(y, reference, rtol=0.05, atol=0.05 * scale)  # int8 activations: close, not equal
    assert torch.equal(layer.prompt_forward(x), y)  # Q8_0: one kernel for decode steps and prompts


@needs_numba
def test_matrix_call_writes_the_layers_bits(q8_file):
    name = "model.layers.1.mlp.up_proj.weight"
    ((tensor, layer),) = timing.file_layers(q8_file, [name]).values()
    x = np.random.default_rng(0).standard_normal((2, tensor.shape[1]), dtype=np.float32)
    call = timing.matrix_call(tensor, x)
    out = call()
    assert out.shape == (2, tensor.shape[0]) and call() is out  # one buffer, rewritten
    assert np.array_equal(out, layer.forward(torch.from_numpy(x)).numpy())


def test_prompt_gemm_runs_the_prompt_gemms_on_another_and_switches_back(tmp_path):
    path = tmp_path / "llama-BF16.gguf"
    write_gguf(path, spec_for("llama", "BF16", vocab=VOCAB))  # bf16 matrices: prompts run one-thread GEMMs
    model = NativeModel.from_gguf(path)
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, VOCAB, 40)]

    def prefill() -> torch.Tensor:
        return model.new_pool(max_length=64).new_sequence().prefill(prompt)

    own = prefill()
    calls = []

    def counted(x: torch.Tensor, w_t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the one-thread GEMM's bits, for the comparison below
        try:
            return torch.mm(x, w_t, out=out)
        finally:
            torch.set_num_threads(threads)

    with timing.prompt_gemm(counted) as switched:
        swapped = prefill()
    assert switched >= 1 and calls  # the model's prompt GEMMs went through `counted`
    assert torch.equal(swapped, own)
    calls.clear()
    assert torch.equal(prefill(), own) and not calls  # switched back
    with timing.prompt_gemm(None) as switched:
        assert switched == 0


def test_attention_pass_attends_as_a_forward_does():
    """The kernel's pass and the SDPA pass over the same cache are the same attention (within
    rounding), and every call stores the new keys as a forward would, giving the same output."""
    kernel = timing.attention_pass(70, 5, heads=4, kv_heads=2, dim=16, masked=False)
    sdpa = timing.attention_pass(70, 5, heads=4, kv_heads=2, dim=16, masked=True)
    first = kernel()
    assert first.shape == (5, 4, 16)
    assert torch.equal(kernel(), first)
    torch.testing.assert_close(sdpa(), first, atol=2e-2, rtol=2e-2)
