"""Candidate kernels for GGUF Q8_0 / Q6_K / Q5_K matrices (issue 25), timed side by side.

    python scripts/bench/gguf_8bit_kernels.py [--threads 2] [--rounds 7] [--rows 1,2,4,8,16,128,512] [--clock cpu]

Random weights encoded into each type (gguf_encode), in two shapes (576 x 1536, SmolLM2's
q_proj; 1536 x 8960, Qwen2.5-1.5B's down_proj). Per type and rows M, median milliseconds of
one call, the designs in turns:
- numba: gguf_kernels_8bit's default (int8 activations per block of 32; Q8_0, Q5_0, Q5_1 in
  pairs of blocks on vpdpbusd where the CPU has VNNI, the K-quants on vpmaddwd lanes);
- ort8: ONNX Runtime's MatMulNBits, 8 bits, blocks of 32 (Q8_0) or 16 (Q6_K, zero point 32),
  accuracy level 4 (int8 activations); Q5_K's float zero points are not tried (ort_linear.py:
  they leave MLAS's fast kernels);
- int8row: PyTorch's `_weight_int8pack_mm`, one bf16 scale per row (NOT the file's values);
- int4: PyTorch's int4 kernel on the same matrix re-quantized to int4 groups of 32 (the
  native backend's fp-arithmetic-on-int4 path, for the rows-vs-cost question);
- bf16tile: prompts only (M >= 128): dequantize 256 rows at a time to bf16, then a GEMM.
Ends with a JSON line of all medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from specdec.backends.native.gguf_encode import quantize_blocks
from specdec.backends.native.gguf_kernels_8bit import BlockLinear8
from specdec.backends.native.gguf_tensors import QuantTensor
from specdec.backends.native.quant import Int4Linear

SHAPES = [(576, 1536), (1536, 8960)]


def ort_layer(tensor: QuantTensor, threads: int):
    """MatMulNBits over the file's integers (exact weights), or None where it does not apply."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    n, k = tensor.shape
    if tensor.qtype.name == "Q8_0":
        blocks = tensor.data.reshape(n, k // 32, 34)
        u = (blocks[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, K/32, 32]
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        block, zero = 32, None
    elif tensor.qtype.name == "Q6_K":
        from specdec.backends.native.gguf_kernels_8bit import _q6_k_values

        b = tensor.data.reshape(n, k // 256, 210)
        u = (_q6_k_values(b) + 32).astype(np.uint8).reshape(n, k // 16, 16)
        d = b[..., 208:].copy().view(np.float16)[..., 0].astype(np.float32)
        scales = (d[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)).reshape(n, -1)
        block, zero = 16, np.full((n, k // 16), 32, np.uint8)
    else:
        return None
    inits = [numpy_helper.from_array(np.ascontiguousarray(u), "B"), numpy_helper.from_array(scales.reshape(-1), "scales")]
    inputs = ["A", "B", "scales"]
    if zero is not None:
        inits.append(numpy_helper.from_array(zero.reshape(-1), "zp"))
        inputs.append("zp")
    node = helper.make_node("MatMulNBits", inputs, ["Y"], domain="com.microsoft", K=k, N=n, bits=8,
                            block_size=block, accuracy_level=4)  # fmt: skip
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # leave the cores to the others
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"A": x.numpy()})[0]


def designs(tensor: QuantTensor, threads: int) -> dict:
    dense = torch.from_numpy(tensor.dequantize())
    scale = (dense.abs().amax(1) / 127).clamp(min=1e-12)
    q8 = torch.round(dense / scale[:, None]).to(torch.int8)
    scale_bf16 = scale.to(torch.bfloat16)
    int4 = Int4Linear.from_float(dense)
    out = {"numba": BlockLinear8(tensor, kernel="numba"),
           "int8row": lambda x: torch._weight_int8pack_mm(x.to(torch.bfloat16), q8, scale_bf16),
           "int4": int4}  # fmt: skip
    try:
        layer = ort_layer(tensor, threads)
        if layer is not None:
            out["ort8"] = layer
    except Exception as error:  # noqa: BLE001 - a measurement script reports and goes on
        print(f"  ort8 {tensor.qtype.name}: {type(error).__name__}: {str(error)[:120]}")
    del dense
    return out


def bf16_tiles(tensor: QuantTensor):
    n = tensor.shape[0]

    def run(x):
        xb = x.to(torch.bfloat16)
        parts = [torch.nn.functional.linear(xb, torch.from_numpy(dequantize(tensor.data[s : s + 256], tensor.qtype)
                                            .reshape(-1, tensor.shape[1])).to(torch.bfloat16)) for s in range(0, n, 256)]  # fmt: skip
        return torch.cat(parts, 1)

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--rows", default="1,2,4,8,16,128,512")
    p.add_argument("--types", default="Q8_0,Q6_K,Q5_K")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the calling thread's CPU time (with --threads 1: steadier on a shared machine)")
    args = p.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts the calling thread only: use --threads 1")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    results = {}
    for n, k in SHAPES:
        w = rng.standard_normal((n, k)).astype(np.float32)
        for qtype in args.types.split(","):
            tensor = QuantTensor("w", GGMLQuantizationType[qtype], (n, k), quantize_blocks(w, GGMLQuantizationType[qtype]))
            layers = designs(tensor, args.threads)
            layers["bf16tile"] = bf16_tiles(tensor)
            for m in rows:
                x = torch.randn(m, k)
                chosen = {name: f for name, f in layers.items() if (name == "bf16tile") == (m >= 128) or name == "numba"}
                times = {name: [] for name in chosen}
                for f in chosen.values():
                    f(x)  # warm
                for _ in range(args.rounds):
                    for name, f in chosen.items():
                        start = clock()
                        f(x)
                        times[name].append(clock() - start)
                medians = {name: round(statistics.median(t) * 1e3, 3) for name, t in times.items()}
                results[f"{n}x{k} {qtype} M={m}"] = medians
                print(f"{n}x{k} {qtype} M={m}: " + "  ".join(f"{a} {b}" for a, b in medians.items()), flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
