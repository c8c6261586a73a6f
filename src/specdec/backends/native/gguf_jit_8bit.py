"""numba kernels for GGUF's Q8_0, Q6_K, Q5_K, Q5_0 and Q5_1 matrices on int8 activations (see
gguf_kernels_8bit.py, which wraps them and states the contract). Imported on first use;
compiled once, cached on disk.

The arithmetic every kernel shares, for one output y[m, n] (the torch replica in
gguf_kernels_8bit.py performs the same operations in the same order, bit for bit):
- activations: each block of 32 of x[m] becomes xs = max|x| / 127 and xq = rint(x * (1 / xs)),
  int8 values (held in int16);
- weights: the file's integers (Q8_0 q, Q6_K q - 32, Q5_K q, Q5_0 q - 16, Q5_1 q) and fp32
  scales formed from the file's fields exactly (d, d * sc, dmin * m: an fp16 times a small
  integer; Q5_1's m as the offset -m);
- 16 fp32 lanes c[l]; for each activation block b in order, lane l adds s * p, where p is the
  exact integer w[2l] xq[2l] + w[2l + 1] xq[2l + 1] of that block and s = w_scale * xs[b]
  (Q6_K: lanes 0-7 take the first sub-block of 16's scale, lanes 8-15 the second's);
- y = c[0] + c[1] + ... + c[15], left to right; Q5_K then subtracts its min term, summed in
  block order: sum over b of (dmin * m * xs[b]) * (sum of block b's xq); Q5_1 likewise with
  -m in place of dmin * m.
Integer sums are exact and no float operation is reordered or fused (numba compiles without
fastmath), so y[m, n] depends only on x[m] and row n: not on M, nor on the thread count
(threads share out chunks of rows n; each output's reduction runs whole on one thread).

Layout per call: every type unpacks each row's integers into an int16 row buffer once (shared
by all M activation rows; Q8_0 just widens its int8 q), then runs the same int16 lanes, which
LLVM turns into pair multiplies (vpmaddwd); on int8 weights it took 32-bit multiplies. The lanes and the unpacking are generated source written out as scalars with
constant indices: numba leaves SLP vectorisation off by default, arrays carry no aliasing
facts, and a variable index costs a negative-index check, any of which keeps LLVM from
packing them. SLP is switched on while this module compiles; it packs independent lanes
(vpmaddwd, then fp32 multiply and add per lane) and byte unpacking, which cannot change a
result. The generated helpers are not cached themselves; the cached kernels contain them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types

_f32_2d, _i16_2d = types.float32[:, ::1], types.int16[:, ::1]


def _raw(dtype):
    """The file's blocks: a read-only memory map (accepts writable arrays too)."""
    return types.Array(dtype, 2, "C", readonly=True)


LANES = 16
CHUNK = 16  # output rows per parallel work item (scratch buffers are allocated per chunk)


def _lanes_source(name: str, wbase: int, wstep: int) -> str:
    """The source of `name(w, a, s_lo, s_hi, blocks) -> float32`: the dot product of w's
    blocks (block b's 32 values at wbase + b * wstep, constants so that LLVM sees the layout)
    with a (block b at 32 b) in the shared lane order, lanes 0-7 scaled by s_lo[b] and 8-15
    by s_hi[b]."""
    lines = [f"def {name}(w, a, s_lo, s_hi, blocks):"]
    lines += [f"    c{lane} = np.float32(0)" for lane in range(LANES)]
    lines += ["    for b in range(blocks):", f"        wb = w[{wbase} + b * {wstep} : {wbase + 32} + b * {wstep}]",
              "        ab = a[b * 32 : b * 32 + 32]",
              "        lo = s_lo[b]", "        hi = s_hi[b]"]  # fmt: skip
    for lane in range(LANES):
        e = 2 * lane
        pair = (f"np.int32(np.int32(wb[{e}]) * np.int32(ab[{e}]) + "
                f"np.int32(wb[{e + 1}]) * np.int32(ab[{e + 1}]))")  # fmt: skip
        lines.append(f"        c{lane} += {'lo' if lane < 8 else 'hi'} * np.float32({pair})")
    total = "c0"
    for lane in range(1, LANES):
        total = f"({total} + c{lane})"
    lines.append(f"    return {total}")
    return "\n".join(lines)


def _decode_source(kind: str) -> str:
    """The source of `unpack_<kind>(row, w)`: the integers of the super-block `row` into
    w[0:256]. Constant indices only (a variable one costs a negative-index check, which keeps
    SLP from packing the loads), and all of a group's loads before its stores (arrays carry
    no aliasing facts: interleaved, SLP could not move the loads together)."""
    lines = [f"def unpack_{kind}(row, w):"]
    if kind == "q6_k":  # per half h: ql bytes l, l + 32 (two nibbles each), qh byte l (four pairs)
        for h in range(2):
            lines += [f"    a{i} = np.int16(row[{h * 64 + i}])" for i in range(64)]
            lines += [f"    b{i} = np.int16(row[{128 + h * 32 + i}])" for i in range(32)]
            for t in range(4):
                lines += [f"    w[{h * 128 + t * 32 + i}] = (((a{(t & 1) * 32 + i} >> {(t >> 1) * 4}) & 15) | "
                          f"(((b{i} >> {2 * t}) & 3) << 4)) - 32" for i in range(32)]  # fmt: skip
    else:  # per pair of sub-blocks j: qs bytes (two nibbles), qh byte (bits 2j, 2j + 1)
        lines += [f"    b{i} = np.int16(row[{16 + i}])" for i in range(32)]
        for j in range(4):
            lines += [f"    a{i} = np.int16(row[{48 + j * 32 + i}])" for i in range(32)]
            for half in range(2):
                i0 = 2 * j + half
                lines += [f"    w[{i0 * 32 + i}] = ((a{i} >> {half * 4}) & 15) | (((b{i} >> {i0}) & 1) << 4)"
                          for i in range(32)]  # fmt: skip
    return "\n".join(lines)


def _widen_source() -> str:
    """The source of `widen_q8_0(block, w)`: one Q8_0 block's 32 int8 q into w[0:32] as int16,
    all loads before the stores (see _decode_source)."""
    lines = ["def widen_q8_0(block, w):"]
    lines += [f"    a{i} = np.int16(block[{2 + i}])" for i in range(32)]
    lines += [f"    w[{i}] = a{i}" for i in range(32)]
    return "\n".join(lines)


def _q5_block_source(kind: str, qh_at: int, qs_at: int, zero: int) -> str:
    """The source of `unpack_<kind>(block, w)`: one Q5_0 / Q5_1 block's 32 integers q - zero
    into w[0:32]: element j < 16 is the low nibble of qs[j], element j + 16 its high nibble,
    and the fifth bit of element j is bit j of the little-endian 32-bit qh."""
    lines = [f"def unpack_{kind}(block, w):"]
    lines += [f"    h{i} = np.int16(block[{qh_at + i}])" for i in range(4)]
    lines += [f"    a{i} = np.int16(block[{qs_at + i}])" for i in range(16)]
    for j in range(32):
        nibble = f"(a{j} & 15)" if j < 16 else f"(a{j - 16} >> 4)"
        lines.append(f"    w[{j}] = ({nibble} | (((h{j // 8} >> {j % 8}) & 1) << 4)) - {zero}")
    return "\n".join(lines)


_slp = numba.config.SLP_VECTORIZE
numba.config.SLP_VECTORIZE = 1  # for this module's compilations only; restored at the end
_namespace = {"np": np}
exec(_lanes_source("lanes_int16", 0, 32), _namespace)  # noqa: S102 - generated above, no outside input
exec(_decode_source("q6_k"), _namespace)  # noqa: S102
exec(_decode_source("q5_k"), _namespace)  # noqa: S102
exec(_q5_block_source("q5_0", 2, 6, 16), _namespace)  # noqa: S102
exec(_widen_source(), _namespace)  # noqa: S102
exec(_q5_block_source("q5_1", 4, 8, 0), _namespace)  # noqa: S102
_lanes_int16 = njit(nogil=True, inline="always")(_namespace["lanes_int16"])
_widen_q8_0 = njit(nogil=True)(_namespace["widen_q8_0"])
_unpack_q6_k, _unpack_q5_k, _unpack_q5_0, _unpack_q5_1 = (
    njit(nogil=True)(_namespace[f"unpack_{kind}"]) for kind in ("q6_k", "q5_k", "q5_0", "q5_1"))


@njit("void(float32[:, ::1], int16[:, ::1], float32[:, ::1], int32[:, ::1])", cache=True, nogil=True)
def quantize_rows(x, xq, xs, xsum):  # pragma: no cover - compiled
    """x [M, K] -> xq [M, K] (int8 values), xs [M, K // 32], xsum [M, K // 32] (sum of xq)."""
    rows, blocks = xs.shape
    for m in range(rows):
        for b in range(blocks):
            amax = np.float32(0)
            for i in range(32):
                amax = max(amax, abs(x[m, b * 32 + i]))
            d = amax / np.float32(127)
            inv = np.float32(1) / d if d > 0 else np.float32(0)
            xs[m, b] = d
            total = 0
            for i in range(32):
                q = np.int16(np.rint(x[m, b * 32 + i] * inv))
                xq[m, b * 32 + i] = q
                total += q
            xsum[m, b] = total


@njit(types.void(_raw(types.int8), _f32_2d, _i16_2d, _f32_2d, _f32_2d),
      cache=True, nogil=True, parallel=True)  # fmt: skip
def q8_0_matmul(raw, d, xq, xs, y):  # pragma: no cover - compiled
    """raw [N, K // 32 * 34] (Q8_0 blocks as int8: fp16 d, then 32 q), d [N, K // 32] fp32
    -> y [M, N]."""
    rows, blocks = d.shape
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        s = np.empty(blocks, np.float32)
        w = np.empty(blocks * 32, np.int16)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            # widened to int16 once per row: the int16 lanes multiply pairs (vpmaddwd), where
            # int8 weights against int16 activations took 32-bit multiplies, ~3x the time
            for b in range(blocks):
                _widen_q8_0(raw[n, b * 34 : b * 34 + 34], w[b * 32 : b * 32 + 32])
            for m in range(xq.shape[0]):
                for b in range(blocks):
                    s[b] = d[n, b] * xs[m, b]
                y[m, n] = _lanes_int16(w, xq[m], s, s, blocks)


@njit(cache=True, nogil=True, inline="always")
def _decode_q6_k(block, d, w, scale, k):  # pragma: no cover - compiled
    """One 210-byte block -> w[k : k + 256] = q - 32 and scale[k // 16 : k // 16 + 16] = d * sc."""
    _unpack_q6_k(block, w[k : k + 256])
    for j in range(16):
        scale[k // 16 + j] = d * np.float32(np.int8(block[192 + j]))


@njit(types.void(_raw(types.uint8), _f32_2d, _i16_2d, _f32_2d, _f32_2d),
      cache=True, nogil=True, parallel=True)  # fmt: skip
def q6_k_matmul(raw, d, xq, xs, y):  # pragma: no cover - compiled
    """raw [N, K // 256 * 210] (Q6_K blocks), d [N, K // 256] fp32 (each block's fp16 d) -> y [M, N]."""
    rows, supers = d.shape
    blocks = supers * 8
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        w = np.empty(blocks * 32, np.int16)
        scale = np.empty(blocks * 2, np.float32)
        s_lo, s_hi = np.empty(blocks, np.float32), np.empty(blocks, np.float32)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            for sb in range(supers):
                _decode_q6_k(raw[n, sb * 210 : sb * 210 + 210], d[n, sb], w, scale, sb * 256)
            for m in range(xq.shape[0]):
                for b in range(blocks):
                    s_lo[b] = scale[2 * b] * xs[m, b]
                    s_hi[b] = scale[2 * b + 1] * xs[m, b]
                y[m, n] = _lanes_int16(w, xq[m], s_lo, s_hi, blocks)


@njit(cache=True, nogil=True, inline="always")
def _decode_q5_k(block, d, dmin, w, scale, offset, k):  # pragma: no cover - compiled
    """One 176-byte block -> w[k : k + 256] = q, and per sub-block of 32 scale = d * sc and
    offset = dmin * m (llama.cpp's get_scale_min_k4 unpacking of bytes 4-15)."""
    _unpack_q5_k(block, w[k : k + 256])
    for j in range(8):
        if j < 4:
            sc, mn = block[4 + j] & 63, block[8 + j] & 63
        else:
            sc = (block[8 + j] & 15) | ((block[j] >> 6) << 4)
            mn = (block[8 + j] >> 4) | ((block[4 + j] >> 6) << 4)
        scale[k // 32 + j] = d * np.float32(sc)
        offset[k // 32 + j] = dmin * np.float32(mn)


@njit(types.void(_raw(types.uint8), types.float32[:, :, ::1], _i16_2d, _f32_2d, types.int32[:, ::1], _f32_2d),
      cache=True, nogil=True, parallel=True)  # fmt: skip
def q5_k_matmul(raw, d_dmin, xq, xs, xsum, y):  # pragma: no cover - compiled
    """raw [N, K // 256 * 176] (Q5_K blocks), d_dmin [N, K // 256, 2] fp32 -> y [M, N]."""
    rows, supers = d_dmin.shape[0], d_dmin.shape[1]
    blocks = supers * 8
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        w = np.empty(blocks * 32, np.int16)
        scale, offset = np.empty(blocks, np.float32), np.empty(blocks, np.float32)
        s = np.empty(blocks, np.float32)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            for sb in range(supers):
                _decode_q5_k(raw[n, sb * 176 : sb * 176 + 176], d_dmin[n, sb, 0], d_dmin[n, sb, 1], w, scale,
                             offset, sb * 256)  # fmt: skip
            for m in range(xq.shape[0]):
                mins = np.float32(0)
                for b in range(blocks):
                    s[b] = scale[b] * xs[m, b]
                    mins += (offset[b] * xs[m, b]) * np.float32(xsum[m, b])
                y[m, n] = _lanes_int16(w, xq[m], s, s, blocks) - mins


@njit(types.void(_raw(types.uint8), types.float32[:, :, ::1], _i16_2d, _f32_2d, types.int32[:, ::1], _f32_2d),
      cache=True, nogil=True, parallel=True)  # fmt: skip
def q5_matmul(raw, scales, xq, xs, xsum, y):  # pragma: no cover - compiled
    """raw [N, K // 32 * width] (Q5_0 blocks of 22 bytes, or Q5_1 of 24), scales [N, K // 32, 1]
    (Q5_0: d) or [N, K // 32, 2] (Q5_1: d, m) fp32 -> y [M, N]. Q5_1's m enters as the min
    term with offset -m (exact), as Q5_K's dmin * m."""
    rows, blocks, with_min = scales.shape[0], scales.shape[1], scales.shape[2] == 2
    width = 24 if with_min else 22
    for chunk in prange((rows + CHUNK - 1) // CHUNK):
        w = np.empty(blocks * 32, np.int16)
        s = np.empty(blocks, np.float32)
        for n in range(chunk * CHUNK, min(rows, chunk * CHUNK + CHUNK)):
            for b in range(blocks):
                if with_min:
                    _unpack_q5_1(raw[n, b * width : b * width + width], w[b * 32 : b * 32 + 32])
                else:
                    _unpack_q5_0(raw[n, b * width : b * width + width], w[b * 32 : b * 32 + 32])
            for m in range(xq.shape[0]):
                mins = np.float32(0)
                for b in range(blocks):
                    s[b] = scales[n, b, 0] * xs[m, b]
                    if with_min:
                        mins += (-scales[n, b, 1] * xs[m, b]) * np.float32(xsum[m, b])
                dot = _lanes_int16(w, xq[m], s, s, blocks)
                y[m, n] = dot - mins if with_min else dot


numba.config.SLP_VECTORIZE = _slp
