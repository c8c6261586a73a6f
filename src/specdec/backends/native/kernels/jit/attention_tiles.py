"""Attention's two reductions over a kv head's keys with the accumulators held in vector
registers: `score_tiles` (queries x keys) and `sum_tiles` (weights x values).

The loops in jit/attention.py keep a lane's running sums in memory: LLVM vectorises them across
keys or columns, so every pass over a few dims or keys loads and stores each lane's partial
sums, and the loads, not the multiplies, bound them. These intrinsics (LLVM vector IR inlined
into numba's loops, as jit/ir.py does for the integer kernels) hold a tile of up to four lanes'
sums in `<8 x float>` registers across the whole reduction: for scores, 16 keys of each lane
over every dim; for the weighted sums, 16 columns of each lane over every key (in blocks of keys
that stay in L1 while each tile of columns passes, each pass fetching its columns of the next
block: from memory the first pass over a block otherwise waits on every row). Each sum is
still the same separately rounded products added one after another in the same order, from 0
or from what the accumulator held, so a lane's bits are those of the loops they replace, on
any CPU (the vectors only say how many sums run side by side).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.ir import data_pointer, prefetch, splat_value, vec

TILE = 16  # keys per score tile, columns per weighted-sum tile: two vectors of 8
WIDTH = 8  # floats per vector
PREFETCH_KEYS = 64  # a score tile fetches the keys this far ahead: 64 rows of keys are 64 streams
BLOCK_KEYS = 128  # keys a weighted-sum block holds in L1 for all its column tiles

i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
V8 = vec(f32, WIDTH)


def _widen8(b, ptr, offset, element):
    """WIDTH cache elements at ptr[offset] as <8 x float>: fp32 as they are, bf16 bits shifted
    into the high half of a float (exact, as kv.load)."""
    at = b.gep(ptr, [offset])
    if element == types.float32:
        return b.load(b.bitcast(at, V8.as_pointer()), align=4)
    raw = b.load(b.bitcast(at, vec(i16, WIDTH).as_pointer()), align=2)
    return b.bitcast(b.shl(b.zext(raw, vec(i32, WIDTH)), ir.Constant(vec(i32, WIDTH), [16] * WIDTH)), V8)


def _widen1(b, ptr, offset, element):
    value = b.load(b.gep(ptr, [offset]))
    if element == types.float32:
        return value
    return b.bitcast(b.shl(b.zext(value, i32), ir.Constant(i32, 16)), f32)


def _row_major(*arrays) -> bool:
    """Whether every argument is a C-contiguous 2-d array: the codegen reads shape[1] as the
    row stride, so any other layout is refused at typing time rather than misread."""
    return all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)


def _array(context, b, sig, args, k):
    """(data pointer, row stride in elements) of the C-contiguous 2-d array argument k."""
    shape = context.make_array(sig.args[k])(context, b, args[k]).shape
    return data_pointer(context, b, sig, args, k), b.extract_value(shape, 1)


def _operands(context, b, sig, args, lanes: int):
    """An intrinsic's (three arrays, r, lo, end): each array's (data pointer, row stride), the
    key range, the lanes' rows r + x, and two vector accumulators per lane."""
    arrays = [_array(context, b, sig, args, k) for k in range(3)]
    rows = [b.add(args[3], ir.Constant(i64, x)) for x in range(lanes)]
    return arrays, args[4:6], rows, [cgutils.alloca_once(b, V8) for _ in range(2 * lanes)]


def _add_product(b, slot, weight, value):  # slot <- slot + weight * value: one rounding each
    b.store(b.fadd(b.load(slot), b.fmul(weight, value)), slot)


def _score_tiles(lanes: int):
    @intrinsic
    def score_tiles(typingctx, keys_t, qs, s, r, lo, end):
        """s[r + x, i] = sum over d, in order from 0, of qs[r + x, d] * keys_t[d, i] for the
        `lanes` lanes x and lo <= i < end (end - lo a multiple of TILE)."""
        if not _row_major(keys_t, qs, s):
            return None
        element = keys_t.dtype

        def codegen(context, b, sig, args):
            ((kp, kstride), (qp, dim), (sp, sstride)), (lo_, end_), rows, accs = _operands(
                context, b, sig, args, lanes)
            with cgutils.for_range_slice(b, lo_, end_, ir.Constant(i64, TILE), inc=True) as (i, _):
                for slot in accs:
                    b.store(ir.Constant(V8, None), slot)
                with cgutils.for_range(b, dim) as loop:
                    d = loop.index
                    row = b.mul(d, kstride)
                    ahead = b.gep(kp, [b.add(row, b.add(i, ir.Constant(i64, PREFETCH_KEYS)))])
                    prefetch(b, b.bitcast(ahead, ir.IntType(8).as_pointer()))
                    keys = [_widen8(b, kp, b.add(row, b.add(i, ir.Constant(i64, WIDTH * h))), element)
                            for h in range(2)]
                    for x in range(lanes):
                        q = splat_value(b, b.load(b.gep(qp, [b.add(b.mul(rows[x], dim), d)])), WIDTH)
                        for h in range(2):
                            _add_product(b, accs[2 * x + h], q, keys[h])
                for x in range(lanes):
                    for h in range(2):
                        column = b.add(i, ir.Constant(i64, WIDTH * h))
                        at = b.gep(sp, [b.add(b.mul(rows[x], sstride), column)])
                        b.store(b.load(accs[2 * x + h]), b.bitcast(at, V8.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(keys_t, qs, s, r, lo, end), codegen

    return score_tiles


def _sum_tiles(lanes: int):
    @intrinsic
    def sum_tiles(typingctx, values, w, acc, r, lo, count):
        """acc[r + x, c] += sum over lo <= i < count, in order, of w[r + x, i] * values[i, c] for
        the `lanes` lanes x and every column c: TILE columns at a time over all the keys, the
        last column (the normaliser's ones) as a scalar beside the first tile. The columns
        before the last must be a multiple of TILE."""
        if not _row_major(values, w, acc):
            return None
        element = values.dtype

        def codegen(context, b, sig, args):
            ((vp, vstride), (wp, wstride), (ap, astride)), (lo_, count_), rows, accs = _operands(
                context, b, sig, args, lanes)
            last = b.sub(vstride, ir.Constant(i64, 1))  # the normaliser's column
            norms = [cgutils.alloca_once(b, f32) for _ in range(lanes)]

            def acc_at(x, column):
                return b.gep(ap, [b.add(b.mul(rows[x], astride), column)])

            for x in range(lanes):
                b.store(b.load(acc_at(x, last)), norms[x])
            # keys in blocks that stay in L1 while every tile of columns passes over them
            with cgutils.for_range_slice(b, lo_, count_, ir.Constant(i64, BLOCK_KEYS), inc=True) as (k0, _):
                k1 = b.add(k0, ir.Constant(i64, BLOCK_KEYS))
                k1 = b.select(b.icmp_signed("<", k1, count_), k1, count_)
                with cgutils.for_range_slice(b, ir.Constant(i64, 0), last, ir.Constant(i64, TILE),
                                             inc=True) as (c, _):
                    _column_tile(b, vp, vstride, wp, wstride, rows, accs, norms, acc_at, last, element, c,
                                 k0, k1)
            for x in range(lanes):
                b.store(b.load(norms[x]), acc_at(x, last))
            return context.get_dummy_value()

        return types.void(values, w, acc, r, lo, count), codegen

    return sum_tiles


def _column_tile(b, vp, vstride, wp, wstride, rows, accs, norms, acc_at, last, element, c, k0, k1):
    """Keys k0 .. k1 - 1 into columns c .. c + TILE - 1 of every lane (and, with c = 0, into
    their normalisers): the accumulators loaded, held in registers over the keys, stored."""
    lanes = len(rows)
    first = b.icmp_signed("==", c, ir.Constant(i64, 0))
    slots = [b.bitcast(acc_at(x, b.add(c, ir.Constant(i64, WIDTH * h))), V8.as_pointer())
             for x in range(lanes) for h in range(2)]
    for slot, at in zip(accs, slots, strict=True):
        b.store(b.load(at, align=4), slot)
    ahead = b.mul(ir.Constant(i64, BLOCK_KEYS), vstride)
    with cgutils.for_range_slice(b, k0, k1, ir.Constant(i64, 1), inc=True) as (i, _):
        row = b.mul(i, vstride)
        # the same columns of the next block's row: each tile's pass fetches what its next pass reads
        prefetch(b, b.bitcast(b.gep(vp, [b.add(b.add(row, ahead), c)]), ir.IntType(8).as_pointer()))
        parts = [_widen8(b, vp, b.add(row, b.add(c, ir.Constant(i64, WIDTH * h))), element) for h in range(2)]
        weights = [b.load(b.gep(wp, [b.add(b.mul(rows[x], wstride), i)])) for x in range(lanes)]
        for x in range(lanes):
            spread = splat_value(b, weights[x], WIDTH)
            for h in range(2):
                _add_product(b, accs[2 * x + h], spread, parts[h])
        with b.if_then(first, likely=False):
            one = _widen1(b, vp, b.add(row, last), element)
            for x in range(lanes):
                _add_product(b, norms[x], weights[x], one)
    for slot, at in zip(accs, slots, strict=True):
        b.store(b.load(slot), at, align=4)


score_tiles4, score_tiles3, score_tiles1 = _score_tiles(4), _score_tiles(3), _score_tiles(1)
sum_tiles4, sum_tiles3 = _sum_tiles(4), _sum_tiles(3)
