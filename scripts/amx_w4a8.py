"""Candidate weight kernel measured for issue 15 and not adopted: w4a8 on Intel AMX.

int4 weights (groups of 32 along K, as the native backend's int4), int8 activations per
row and group of 32 (scale = max |x| / 127, as llama.cpp's Q8_1), and AMX's int8 tiles
(tdpbssd) for the group dot products: up to 16 rows share each pass over the weights, so
the cost of a call should stay flat from 1 to 8 rows, where PyTorch's int4 kernel (blocks
of 4 rows) doubles. Every group's dot product is an exact integer and the scaling runs per
(row, column) in a fixed order, so a row's result does not depend on the other rows.

numba has no AMX intrinsics: the tile instructions are inline assembly (llvmlite's `asm`,
with the native asm parser initialised), and Linux must grant the tile state
(arch_prctl ARCH_REQ_XCOMP_PERM). Needs a CPU with amx_int8 and amx_tile.

    python scripts/amx_w4a8.py [--rounds 20]

Prints, for 1, 4, 8 and 16 rows: each decoder shape with its weights hot in the cache, and a
chain of the 120 decoder linears over 30 layers' own weights (cold, as in a decode step),
w4a8 against PyTorch's int4 kernel in turns; then the batch-invariance and exactness checks
(against an integer reference in numpy). Ends with a JSON line. The README's performance
notes give the figures and why it was not adopted.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import statistics
import threading
import time

import llvmlite.binding as llvm
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from specdec.backends.native.cpu import cpu_features
from specdec.backends.native.jit import to_bf16_bits
from specdec.backends.native.jit_ops import numba_threads
from specdec.backends.native.quant import Int4Linear, quantize_int4

GROUP = 32  # along K, for the weights' and the activations' scales
TILE_ROWS = 16  # activation rows per AMX tile; more rows run in blocks of 16
TILE_COLUMNS = 16  # output columns per tile
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (K, N)
LAYERS = 30
ROWS = (1, 4, 8, 16)
llvm.initialize_native_asmparser()  # inline assembly needs it; numba initialises only the target


def _asm(template: str, arguments: int):
    """A numba intrinsic that emits `template` with `arguments` int64 operands ($0, $1)."""
    constraint = ",".join(["r"] * arguments + ["~{memory}"])

    def codegen(context, builder, signature, args):
        builder.asm(ir.FunctionType(ir.VoidType(), [ir.IntType(64)] * arguments), template, constraint, args,
                    side_effect=True)  # fmt: skip
        return context.get_dummy_value()

    if arguments == 0:
        return intrinsic(lambda typingctx: (types.void(), codegen))
    if arguments == 1:
        return intrinsic(lambda typingctx, a: (types.void(types.int64), codegen))
    return intrinsic(lambda typingctx, a, b: (types.void(types.int64, types.int64), codegen))


load_config = _asm("ldtilecfg ($0)", 1)
zero_c0, zero_c1 = _asm("tilezero %tmm0", 0), _asm("tilezero %tmm3", 0)
load_a0, load_a1 = _asm("tileloadd ($0,$1,1), %tmm1", 2), _asm("tileloadd ($0,$1,1), %tmm4", 2)
load_b0, load_b1 = _asm("tileloadd ($0,$1,1), %tmm2", 2), _asm("tileloadd ($0,$1,1), %tmm5", 2)
dot_0, dot_1 = _asm("tdpbssd %tmm2, %tmm1, %tmm0", 0), _asm("tdpbssd %tmm5, %tmm4, %tmm3", 0)
store_c0, store_c1 = _asm("tilestored %tmm0, ($0,$1,1)", 2), _asm("tilestored %tmm3, ($0,$1,1)", 2)


def tile_config(rows: int) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for `rows` activation rows (1..16)."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    colsb, tile_rows = config[16:32].view(np.uint16), config[48:56]
    for c, a, b in ((0, 1, 2), (3, 4, 5)):
        colsb[c], tile_rows[c] = 64, rows  # C: rows x 16 int32
        colsb[a], tile_rows[a] = 32, rows  # A: rows x 32 int8 (one 32-group)
        colsb[b], tile_rows[b] = 64, 8  # B: 32 x 16 int8, VNNI
    return config


@njit(cache=True, nogil=True)
def quantize_rows(x_bits, xq, scale, total):  # pragma: no cover - compiled
    """bf16 rows x_bits [M, K] -> int8 xq [M, K] per 32-group, as llama.cpp's Q8_1: scale[m, g]
    = max |x| / 127, xq = round-half-even(x / scale), total[m, g] = scale * sum of the group's xq."""
    rows, width = x_bits.shape
    x = np.empty(32, np.float32)
    bits = x.view(np.uint32)
    for m in range(rows):
        for g in range(width // 32):
            peak = np.float32(0.0)
            for k in range(32):
                bits[k] = np.uint32(x_bits[m, 32 * g + k]) << np.uint32(16)
            for k in range(32):
                peak = max(peak, abs(x[k]))
            step = peak / np.float32(127.0)
            inverse = np.float32(1.0) / step if peak > 0 else np.float32(0.0)
            count = 0
            for k in range(32):
                q = np.int32(np.rint(x[k] * inverse))
                xq[m, 32 * g + k] = q
                count += q
            scale[m, g], total[m, g] = step, step * np.float32(count)


@njit(inline="always")
def _unpack_pair(packed, t, g, b):  # pragma: no cover - compiled
    # two 32-groups of column tile t: 256 packed bytes each (low nibbles: B bytes 0..255,
    # high nibbles: 256..511) -> b [2, 512] int8 in the VNNI layout
    p0, p1 = packed[t, g], packed[t, g + 1]
    for i in range(256):
        b[0, i] = p0[i] & 15
        b[0, 256 + i] = p0[i] >> 4
        b[1, i] = p1[i] & 15
        b[1, 256 + i] = p1[i] >> 4


@njit(parallel=True, cache=True)
def w4a8_mm(config, packed, w_scale, w_min, x_bits, xq, scale, total, out, b_buf, c_buf, acc, workers):  # pragma: no cover - compiled
    """out [M, T * 16] bf16 bits = x . w^T for bf16 rows x_bits [M, K] (M <= 16), quantized
    by quantize_rows into the scratch xq, scale, total, and w = w_scale * q + w_min per
    32-group (q in 0..15).

    packed [T, G, 256] uint8 (see pack_weights); w_scale, w_min [T, G, 16] float32;
    scratch b_buf [T, 2, 512] int8, c_buf [T, 2, M, 16] int32, acc [T, M, 16] float32.
    Each output is the exact integer dot product of every group, scaled and summed over the
    groups in order, the same arithmetic for every row whatever M is: batch-invariant.
    """
    quantize_rows(x_bits, xq, scale, total)
    tiles = packed.shape[0]
    for w in prange(workers):  # one tile configuration per thread and call (workers <= tiles)
        load_config(config.ctypes.data)
        for t in range(w * tiles // workers, (w + 1) * tiles // workers):
            _column_tile(packed, w_scale, w_min, xq, scale, total, out, b_buf[t], c_buf[t], acc[t], t)


@njit(inline="always")
def _column_tile(packed, w_scale, w_min, xq, scale, total, out, b, c, a, t):  # pragma: no cover - compiled
    # output columns 16t..16t+15 for all rows: two groups a pass, each group's int32 tile
    # scaled by the weight's and the row's scales, plus the weights' minimum times the row's sum
    groups = packed.shape[1]
    rows, width = xq.shape
    a[:] = 0
    for g in range(0, groups, 2):
        _unpack_pair(packed, t, g, b)
        zero_c0()
        zero_c1()
        load_a0(xq.ctypes.data + 32 * g, width)
        load_b0(b.ctypes.data, 64)
        load_a1(xq.ctypes.data + 32 * g + 32, width)
        load_b1(b.ctypes.data + 512, 64)
        dot_0()
        dot_1()
        store_c0(c.ctypes.data, 64)
        store_c1(c.ctypes.data + rows * 64, 64)
        for m in range(rows):
            s0, t0, s1, t1 = scale[m, g], total[m, g], scale[m, g + 1], total[m, g + 1]
            for n in range(16):
                first = np.float32(c[0, m, n]) * w_scale[t, g, n] * s0 + w_min[t, g, n] * t0
                second = np.float32(c[1, m, n]) * w_scale[t, g + 1, n] * s1 + w_min[t, g + 1, n] * t1
                a[m, n] += first + second
    for m in range(rows):
        to_bf16_bits(a[m].view(np.uint32), out[m, t * 16 : t * 16 + 16])


@functools.cache
def available() -> bool:
    """AMX in the CPU, and Linux's permission for the tile state (requested once per process)."""
    if not {"amx_int8", "amx_tile"} <= cpu_features():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def pack_weights(q: np.ndarray) -> np.ndarray:
    """q [N, K] uint8 in 0..15 (N a multiple of 16, K of 64) -> [N/16, K/32, 256] uint8: for each
    tile of 16 columns and group of 32, the group's bytes in AMX's VNNI layout for B (row r =
    the bytes k = 4r..4r+3 of each column), bytes 0..255 in the low nibbles, 256..511 high."""
    n, k = q.shape
    tiles, groups = n // TILE_COLUMNS, k // GROUP
    vnni = q.reshape(tiles, TILE_COLUMNS, groups, GROUP // 4, 4).transpose(0, 2, 3, 1, 4).reshape(tiles, groups, 512)
    return np.ascontiguousarray(vnni[..., :256] | (vnni[..., 256:] << 4)).astype(np.uint8)


def _per_tile(values: np.ndarray) -> np.ndarray:
    """[N, G] -> [N/16, G, 16] float32, a column tile's values side by side."""
    n, groups = values.shape
    return np.ascontiguousarray(values.reshape(n // TILE_COLUMNS, TILE_COLUMNS, groups).transpose(0, 2, 1), np.float32)


class W4A8Linear(torch.nn.Module):
    """y = x . w^T (+ bias) for w = scale * q + minimum per 32-group of K, q in 0..15; x bf16
    (other dtypes are cast, as `Int4Linear` does), y bf16 (fp32 with a bias)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None = None):
        # q: [N, K] integers in 0..15; scale, minimum: [N, K // 32]
        super().__init__()
        if not available():
            raise SystemExit("this CPU or kernel offers no AMX tiles (amx_int8, amx_tile)")
        n, k = q.shape
        if k % (2 * GROUP):
            raise ValueError(f"w4a8 needs in_features divisible by {2 * GROUP}, got {k}")
        pad = -n % TILE_COLUMNS
        q8 = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad)).numpy()  # padded columns: all zero
        self.packed = pack_weights(q8)
        self.w_scale = _per_tile(np.pad(scale.float().numpy(), ((0, pad), (0, 0))))
        self.w_min = _per_tile(np.pad(minimum.float().numpy(), ((0, pad), (0, 0))))
        self.register_buffer("bias", None if bias is None else bias.detach().float(), persistent=False)
        self.out_features, self.in_features, self.act_dtype = n, k, torch.bfloat16
        self._local = threading.local()
        self._padded = pad > 0
        self._workers = min(numba_threads(), self.packed.shape[0])

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> W4A8Linear:
        q, scale, zero = quantize_int4(weight)  # w = (q - 8) * scale + zero
        return cls(q, scale, zero - 8 * scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        # a step makes 120 calls: the Python here is a few tensor-to-array views
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        bits = (x if x.is_contiguous() else x.contiguous()).view(torch.uint16).numpy()
        out = np.empty((bits.shape[0], self.packed.shape[0] * TILE_COLUMNS), np.uint16)
        for first in range(0, bits.shape[0], TILE_ROWS):  # blocks of 16 rows: each row's result is its own
            block = bits if bits.shape[0] <= TILE_ROWS else bits[first : first + TILE_ROWS]
            config, xq, scale, total, b_buf, c_buf, acc = self._scratch(block.shape[0])
            w4a8_mm(config, self.packed, self.w_scale, self.w_min, block, xq, scale, total,
                    out[first : first + TILE_ROWS], b_buf, c_buf, acc, self._workers)  # fmt: skip
        y = torch.from_numpy(out).view(torch.bfloat16)
        if self._padded:
            y = y[:, : self.out_features]
        return y if self.bias is None else y + self.bias

    def _scratch(self, rows: int) -> tuple:
        """The tile configuration and the kernel's scratch arrays for `rows` rows, kept per
        thread (two engines may share this model's layers)."""
        cache = self._local.__dict__.setdefault("scratch", {})
        scratch = cache.get(rows)
        if scratch is None:
            numba_threads()  # the threading layer, before the first parallel launch
            tiles, groups = self.packed.shape[0], self.in_features // GROUP
            scratch = cache[rows] = (
                tile_config(rows), np.empty((rows, self.in_features), np.int8),
                np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32),
                np.empty((tiles, 2, 512), np.int8), np.empty((tiles, 2, rows, TILE_COLUMNS), np.int32),
                np.empty((tiles, rows, TILE_COLUMNS), np.float32),
            )  # fmt: skip
        return scratch


def reference(layer: W4A8Linear, x: torch.Tensor) -> torch.Tensor:
    """The same arithmetic in numpy: integer group sums, then the float steps in the kernel's order."""
    bits = x.to(torch.bfloat16).view(torch.uint16).numpy()
    rows = bits.shape[0]
    xq = np.empty((rows, layer.in_features), np.int8)
    scale, total = (np.empty((rows, layer.in_features // GROUP), np.float32) for _ in range(2))
    quantize_rows(bits, xq, scale, total)
    vnni = np.concatenate([layer.packed & 15, layer.packed >> 4], axis=-1)  # [T, G, 512]
    tiles, groups = vnni.shape[:2]
    q = vnni.reshape(tiles, groups, GROUP // 4, TILE_COLUMNS, 4).transpose(0, 3, 1, 2, 4).reshape(tiles * 16, -1)
    sums = np.einsum("mgk,ngk->gmn", xq.reshape(rows, groups, GROUP).astype(np.int64),
                     q.reshape(-1, groups, GROUP).astype(np.int64)).astype(np.float32)  # [G, M, N], exact
    w_scale = layer.w_scale.transpose(1, 0, 2).reshape(groups, -1)  # [G, N]
    w_min = layer.w_min.transpose(1, 0, 2).reshape(groups, -1)
    acc = np.zeros((rows, tiles * 16), np.float32)
    for g in range(0, groups, 2):
        first = sums[g] * w_scale[g] * scale[:, g : g + 1] + w_min[g] * total[:, g : g + 1]
        second = sums[g + 1] * w_scale[g + 1] * scale[:, g + 1 : g + 2] + w_min[g + 1] * total[:, g + 1 : g + 2]
        acc += first + second
    return torch.from_numpy(acc).to(torch.bfloat16)[:, : layer.out_features]


def checks(gen: torch.Generator) -> dict:
    """Bit-equality with the numpy reference, and row i of a k-row call == a one-row call."""
    weight = torch.randn(200, 256, generator=gen) * 0.05
    layer, x = W4A8Linear.from_float(weight), torch.randn(21, 256, generator=gen)
    y = layer(x)
    exact = torch.equal(y, reference(layer, x))
    invariant = all(torch.equal(layer(x[i : i + 1])[0], y[i]) for i in range(x.shape[0])) and torch.equal(layer(x[:5]), y[:5])
    return {"equals_reference": exact, "batch_invariant": invariant}


def timed_ms(fn, rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    if not available():
        raise SystemExit("this CPU or kernel offers no AMX tiles (amx_int8, amx_tile)")
    gen = torch.Generator().manual_seed(0)
    report = {"threads": torch.get_num_threads(), "checks": checks(gen), "hot_us": {}, "chain_ms": {}}
    print(f"threads {report['threads']}; checks: {report['checks']}")
    layers = [{name: torch.randn(n, k, generator=gen) * 0.05 for name, (k, n) in SHAPES.items()} for _ in range(LAYERS)]
    built = {"w4a8": [{n: W4A8Linear.from_float(w) for n, w in layer.items()} for layer in layers],
             "int4": [{n: Int4Linear.from_float(w) for n, w in layer.items()} for layer in layers]}
    for rows in ROWS:
        xs = {name: torch.randn(rows, k, generator=gen).to(torch.bfloat16) for name, (k, _) in SHAPES.items()}
        hot, chain = {}, {}
        for kind, per_layer in built.items():  # in turns, so a busy machine slows both alike
            hot[kind] = {n: round(1000 * timed_ms(lambda f=per_layer[0][n], x=xs[n]: f(x), args.rounds * 10), 1) for n in SHAPES}
            chain[kind] = round(timed_ms(lambda pl=per_layer, xs=xs: [f(xs[n]) for layer in pl for n, f in layer.items()],
                                         args.rounds), 2)  # fmt: skip
        report["hot_us"][rows], report["chain_ms"][rows] = hot, chain
        cells = "  ".join(f"{n} {hot['w4a8'][n]}/{hot['int4'][n]} us" for n in SHAPES)
        print(f"{rows:2d} rows: 120 linears, 30 layers' weights: w4a8 {chain['w4a8']} ms, int4 {chain['int4']} ms | hot, w4a8/int4: {cells}")
    print(json.dumps(report))


if __name__ == "__main__":
    with torch.no_grad():
        main()
