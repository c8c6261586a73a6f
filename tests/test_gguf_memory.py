"""Memory after loading a GGUF file: RSS above the runtime's baseline, bounded by the file, and
the mapped pages of copied tensors released (docs/performance-notes.md, "Memory after load")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.backends.native.gguf import layers, state
from specdec.backends.native.gguf.layers import ReferenceLinear
from specdec.backends.native.gguf.reader import read_gguf
from specdec.backends.native.model.native_model import NativeModel
from test_gguf_loader import _write

# The baseline is the runtime, not the model: `import specdec`'s native modules and the
# compiled kernels (numba's kernels/jit/ modules, loaded from its disk cache or compiled:
# LLVM's code pages and numba's tables, ~50 MB, once per process whatever it loads). What is left
# above it is the model's: the repacked (copied) matrices, the mapped pages still resident, the
# header's arrays and the allocator's slack. Measured in a fresh interpreter, as the issue does.
MEMORY_SCRIPT = """
import json, os, sys
import specdec.backends.native.model.native_model as m
from specdec.backends.native.kernels import numba_ops
if numba_ops.importable():
    import specdec.backends.native.kernels.jit.attention, specdec.backends.native.kernels.jit.supertiles
    import specdec.backends.native.kernels.jit.activations
    import specdec.backends.native.kernels.jit.norms
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = rss()
model = m.NativeModel.from_gguf(sys.argv[1])
pool = model.new_pool(max_length=256)
print(json.dumps({"delta": rss() - before, "kv": pool.k.numel() * pool.k.element_size() * 2}))
"""


def test_memory_after_load_is_bounded_by_the_file(tmp_path_factory):
    """RSS after loading, above the process with the runtime imported and its kernels compiled:
    at most 1.3x the file plus the KV cache (and 40 MB of allocator slack)."""
    path, _ = _write(tmp_path_factory, "llama", "Q4_0", vocab=None, hidden=512, ffn=1536, layers=6)
    model = NativeModel.from_gguf(path)
    if isinstance(model.layers[0].o, ReferenceLinear):
        pytest.skip("linear_from_quant still returns the dense reference layer "
                    "(the per-type kernels come separately)")
    out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)], capture_output=True, text=True,
                         check=True)
    report = json.loads(out.stdout)
    assert report["delta"] <= 1.3 * path.stat().st_size + report["kv"] + 40e6, report


def test_copied_tensors_pages_are_dropped_after_load(tmp_path_factory):
    """An F16 file's matrices are packed for fbgemm (copies; where numba runs, the quantized
    types' kernels read the mapping in place): after quant_state, their mapped pages are no
    longer resident in this process (/proc/self/smaps of the file's mapping)."""
    path, _ = _write(tmp_path_factory, "llama", "F16")
    model = read_gguf(path)
    if not layers.copies_weights(model.tensors["model.layers.0.self_attn.o_proj.weight"]):
        pytest.skip("F16 is not copied here (no fbgemm)")
    for tensor in model.tensors.values():
        np.asarray(tensor.data).sum()  # every page resident
    before = _mapped_rss(path)
    state.quant_state(model)
    assert _mapped_rss(path) < before / 2, (before, _mapped_rss(path))


def _mapped_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of `path`."""
    total, current, target = 0, None, str(path.resolve())
    for line in Path("/proc/self/smaps").read_text().splitlines():
        parts = line.split()
        if parts and "-" in parts[0] and not parts[0].endswith(":"):
            current = parts[5] if len(parts) > 5 else None
        elif parts[:1] == ["Rss:"] and current == target:
            total += int(parts[1]) * 1024
    return total
