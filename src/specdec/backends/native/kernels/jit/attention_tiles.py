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

A bf16 cache's scores take `pair_score_tiles`: 16 keys' pair of dims is one 64-byte load, and
vdpbf16ps (AVX-512 BF16) adds a query's two bf16 products to each key's sum, the odd dim's first,
each exact and rounded once, at twice the fp32 rate. Elsewhere the same products go through fp32
multiplies and adds in that order (`BF16_DOT`, jit/ir.py): the same bits, since no input is
subnormal, nor any product (kv_layout.PAIR_FLOOR), which is all vdpbf16ps treats otherwise. Its
weighted sums take `pair_sum_tiles` where vdpbf16ps exists: 16 columns of two value rows
paired, and a lane's bf16 weights of those two keys, the first key's product first.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit.ir import (
    BF16_DOT,
    call_intrinsic,
    data_pointer,
    prefetch,
    splat_value,
    vec,
)

TILE = 16  # keys per score tile and per block of the key cache (kv_layout.KEY_TILE); columns
# per weighted-sum tile: two vectors of 8
WIDTH = 8  # floats per vector
BLOCK_KEYS = 128  # keys a weighted-sum block holds in L1 for all its column tiles
PAIRS_AHEAD = 32  # pairs of value rows the pair tiles fetch ahead: attention_sums.KEY_BLOCK's keys

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


def _row_major(*arrays) -> bool:
    """Whether every argument is a C-contiguous 2-d array: the codegen reads shape[1] as the
    row stride, so any other layout is refused at typing time rather than misread."""
    return all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays)


def _array(context, b, sig, args, k):
    """(data pointer, row stride in elements) of the C-contiguous 2-d array argument k."""
    shape = context.make_array(sig.args[k])(context, b, args[k]).shape
    return data_pointer(context, b, sig, args, k), b.extract_value(shape, 1)


def _operands(context, b, sig, args, lanes: int):
    """An intrinsic's (three arrays, r, lo, end, shift): each array's (data pointer, row
    stride), the key range, the lanes' rows r + x, and two vector accumulators per lane."""
    arrays = [_array(context, b, sig, args, k) for k in range(3)]
    rows = [b.add(args[3], ir.Constant(i64, x)) for x in range(lanes)]
    return arrays, args[4:6], rows, [cgutils.alloca_once(b, V8) for _ in range(2 * lanes)]


def _add_product(b, slot, weight, value):  # slot <- slot + weight * value: one rounding each
    b.store(b.fadd(b.load(slot), b.fmul(weight, value)), slot)


def _score_tiles(lanes: int):
    @intrinsic
    def score_tiles(typingctx, keys_t, qs, s, r, lo, end, shift):
        """s[r + x, i + shift] = sum over d, in order from 0, of qs[r + x, d] * keys_t[d, i]
        for the `lanes` lanes x and lo <= i < end (end - lo a multiple of TILE): keys_t [dim,
        n] is a block of the cache's (n = TILE) or a block widened to fp32."""
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
                    keys = [_widen8(b, kp, b.add(row, b.add(i, ir.Constant(i64, WIDTH * h))), element)
                            for h in range(2)]
                    for x in range(lanes):
                        q = splat_value(b, b.load(b.gep(qp, [b.add(b.mul(rows[x], dim), d)])), WIDTH)
                        for h in range(2):
                            _add_product(b, accs[2 * x + h], q, keys[h])
                for x in range(lanes):
                    for h in range(2):
                        column = b.add(b.add(i, args[6]), ir.Constant(i64, WIDTH * h))
                        at = b.gep(sp, [b.add(b.mul(rows[x], sstride), column)])
                        b.store(b.load(accs[2 * x + h]), b.bitcast(at, V8.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(keys_t, qs, s, r, lo, end, shift), codegen

    return score_tiles


class _BFloat(ir.types.Type):
    """LLVM's bfloat, which llvmlite does not name: only the operand type of vdpbf16ps."""

    null = "0.0"

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash("bfloat")


V16, I16x = vec(f32, 2 * WIDTH), vec(i32, 2 * WIDTH)
HIGH_HALF = ir.Constant(vec(i32, WIDTH), [-65536] * WIDTH)  # 0xFFFF0000: a pair's odd dim as a float


def _pair_products(b, accs, keys, pair):
    """accs (<16 x float> with vdpbf16ps, else two <8 x float>) <- accs + the odd dims'
    products, then + the even dims': keys <16 x i32> (16 keys' bf16 dims 2p and 2p + 1),
    pair i32 (a query's). vdpbf16ps adds the two products one after the other, each exact
    and rounded once (its inputs are never subnormal: kv_layout.PAIR_FLOOR), which
    is what the fp32 multiplies and adds do."""
    if BF16_DOT:
        bf = vec(_BFloat(), 4 * WIDTH)
        spread = b.bitcast(splat_value(b, pair, 2 * WIDTH), bf)
        total = call_intrinsic(b, "llvm.x86.avx512bf16.dpbf16ps.512", V16,
                               [b.load(accs[0]), b.bitcast(keys, bf), spread])
        b.store(total, accs[0])
        return
    q = splat_value(b, pair, WIDTH)
    q_odd, q_even = (b.bitcast(b.and_(q, HIGH_HALF), V8),
                     b.bitcast(b.shl(q, ir.Constant(vec(i32, WIDTH), [16] * WIDTH)), V8))
    for h in range(2):
        picks = ir.Constant(vec(i32, WIDTH), list(range(WIDTH * h, WIDTH * h + WIDTH)))
        half = b.shuffle_vector(keys, keys, picks)
        k_odd = b.bitcast(b.and_(half, HIGH_HALF), V8)
        k_even = b.bitcast(b.shl(half, ir.Constant(vec(i32, WIDTH), [16] * WIDTH)), V8)
        _add_product(b, accs[h], q_odd, k_odd)
        _add_product(b, accs[h], q_even, k_even)


def _nothing(context, b, sig, args):
    return context.get_dummy_value()


def _pair_score_tiles(lanes: int):
    @intrinsic
    def pair_score_tiles(typingctx, block, pairs, s, r, shift):
        """s[r + x, shift + i] for the `lanes` lanes x and the TILE keys i of a bf16 cache's
        block [dim, TILE] (held as dim / 2 rows of TILE keys' pairs of dims: kv_layout.py),
        over the pairs p in order: + q[2p + 1] * k[2p + 1], then + q[2p] * k[2p], from 0. pairs
        [lanes, dim / 2] uint32: each lane's query as bf16 pairs."""
        if not _row_major(block, pairs, s) or pairs.dtype != types.uint32:
            return None
        if block.dtype != types.uint16:  # an fp32 cache's kernels type this call, never make it
            return types.void(block, pairs, s, r, shift), _nothing

        def codegen(context, b, sig, args):
            ((kp, _), (qp, half_dim), (sp, sstride)) = [_array(context, b, sig, args, k) for k in range(3)]
            rows = [b.add(args[3], ir.Constant(i64, x)) for x in range(lanes)]
            kind, width = (V16, 1) if BF16_DOT else (V8, 2)  # a lane's 16 sums: one vector, or two
            accs = [[cgutils.alloca_once(b, kind) for _ in range(width)] for _ in range(lanes)]
            for lane in accs:
                for slot in lane:
                    b.store(ir.Constant(slot.type.pointee, None), slot)
            with cgutils.for_range(b, half_dim) as loop:
                p = loop.index
                at = b.gep(kp, [b.mul(p, ir.Constant(i64, 2 * TILE))])
                keys = b.load(b.bitcast(at, I16x.as_pointer()), align=4)
                for x in range(lanes):
                    pair = b.load(b.gep(qp, [b.add(b.mul(rows[x], half_dim), p)]))
                    _pair_products(b, accs[x], keys, pair)
            for x in range(lanes):
                for h, slot in enumerate(accs[x]):
                    column = b.add(args[4], ir.Constant(i64, WIDTH * h))
                    at = b.gep(sp, [b.add(b.mul(rows[x], sstride), column)])
                    b.store(b.load(slot), b.bitcast(at, slot.type.pointee.as_pointer()), align=4)
            return context.get_dummy_value()

        return types.void(block, pairs, s, r, shift), codegen

    return pair_score_tiles


def _value_pairs(b, vp, vstride, p, c):
    """<16 x i32>: columns c .. c + 15 of a bf16 cache's value rows 2p (the high halves) and
    2p + 1 (the low halves), paired as they load."""
    row = b.mul(b.mul(p, ir.Constant(i64, 2)), vstride)
    halves = []
    for at in (row, b.add(row, vstride)):
        raw = b.load(b.bitcast(b.gep(vp, [b.add(at, c)]), vec(i16, 2 * WIDTH).as_pointer()), align=2)
        halves.append(b.zext(raw, I16x))
    return b.or_(b.shl(halves[0], ir.Constant(I16x, [16] * 2 * WIDTH)), halves[1])


def _pair_sum_tiles(lanes: int):
    @intrinsic
    def pair_sum_tiles(typingctx, values, pairs, acc, r, p0, p1, shift, c0, c1):
        """acc[r + x, c] += over the pairs p0 <= p < p1 in order: the high half's product, then
        the low half's, of pairs[r + x, p - shift] (a lane's weights of keys 2p and 2p + 1, as
        bf16) and those keys' values in column c (rows 2p and 2p + 1 of `values`, a bf16
        cache's [L, dim + 1], paired as they load), for the `lanes` lanes x and the columns
        c0 <= c < c1 (multiples of TILE): a bf16 cache's weighted sums, a key at a time in
        order (attention_sums.paired_sums), with vdpbf16ps or its replica."""
        if not _row_major(values, pairs, acc) or pairs.dtype != types.uint32:
            return None
        if values.dtype != types.uint16:  # an fp32 cache's kernels type this call, never make it
            return types.void(values, pairs, acc, r, p0, p1, shift, c0, c1), _nothing

        def codegen(context, b, sig, args):
            (vp, vstride), (wp, wstride), (ap, astride) = [_array(context, b, sig, args, k) for k in range(3)]
            rows = [b.add(args[3], ir.Constant(i64, x)) for x in range(lanes)]
            kind, width = (V16, 1) if BF16_DOT else (V8, 2)  # a lane's 16 sums: one vector, or two
            accs = [[cgutils.alloca_once(b, kind) for _ in range(width)] for _ in range(lanes)]

            def sums_at(x, c, h):
                at = b.gep(ap, [b.add(b.mul(rows[x], astride), b.add(c, ir.Constant(i64, WIDTH * h)))])
                return b.bitcast(at, kind.as_pointer())

            with cgutils.for_range_slice(b, args[7], args[8], ir.Constant(i64, TILE), inc=True) as (c, _):
                for x in range(lanes):
                    for h, slot in enumerate(accs[x]):
                        b.store(b.load(sums_at(x, c, h), align=4), slot)
                with cgutils.for_range_slice(b, args[4], args[5], ir.Constant(i64, 1), inc=True) as (p, _):
                    row = b.mul(b.add(p, ir.Constant(i64, PAIRS_AHEAD)), ir.Constant(i64, 2))
                    for below in range(2):  # the next block's rows: this pass's columns of them
                        at = b.gep(vp, [b.add(b.mul(b.add(row, ir.Constant(i64, below)), vstride), c)])
                        prefetch(b, b.bitcast(at, ir.IntType(8).as_pointer()))
                    held = _value_pairs(b, vp, vstride, p, c)
                    at = b.sub(p, args[6])
                    for x in range(lanes):
                        pair = b.load(b.gep(wp, [b.add(b.mul(rows[x], wstride), at)]))
                        _pair_products(b, accs[x], held, pair)
                for x in range(lanes):
                    for h, slot in enumerate(accs[x]):
                        b.store(b.load(slot), sums_at(x, c, h), align=4)
            return context.get_dummy_value()

        return types.void(values, pairs, acc, r, p0, p1, shift, c0, c1), codegen

    return pair_sum_tiles


def _sum_tiles(lanes: int):
    @intrinsic
    def sum_tiles(typingctx, values, w, acc, r, lo, count, c0, c1):
        """acc[r + x, c] += sum over lo <= i < count, in order, of w[r + x, i] * values[i, c] for
        the `lanes` lanes x and the columns c0 <= c < c1 (never the cache's last, its ones, which
        the kernel does not read): TILE columns at a time over all the keys. c0 and c1 must be
        multiples of TILE."""
        if not _row_major(values, w, acc):
            return None
        element = values.dtype

        def codegen(context, b, sig, args):
            ((vp, vstride), (wp, wstride), (ap, astride)), (lo_, count_), rows, accs = _operands(
                context, b, sig, args, lanes)
            c0_, c1_ = args[6], args[7]

            def acc_at(x, column):
                return b.gep(ap, [b.add(b.mul(rows[x], astride), column)])

            # keys in blocks that stay in L1 while every tile of columns passes over them
            with cgutils.for_range_slice(b, lo_, count_, ir.Constant(i64, BLOCK_KEYS), inc=True) as (k0, _):
                k1 = b.add(k0, ir.Constant(i64, BLOCK_KEYS))
                k1 = b.select(b.icmp_signed("<", k1, count_), k1, count_)
                with cgutils.for_range_slice(b, c0_, c1_, ir.Constant(i64, TILE), inc=True) as (c, _):
                    keys = _Keys(vp, vstride, element, k0, k1, ir.Constant(i64, 0), True)
                    _column_tile(b, keys, wp, wstride, rows, accs, acc_at, c)
            return context.get_dummy_value()

        return types.void(values, w, acc, r, lo, count, c0, c1), codegen

    return sum_tiles


def _block_sum_tiles(lanes: int):
    @intrinsic
    def block_sum_tiles(typingctx, block, w, acc, r, n, shift):
        """acc[r + x, c] += sum over 0 <= i < n, in order, of w[r + x, shift + i] * block[i, c]
        for the `lanes` lanes x and every column c of an fp32 block of values held in L1 (no
        ones column; the columns a multiple of TILE)."""
        if not _row_major(block, w, acc) or block.dtype != types.float32:
            return None

        def codegen(context, b, sig, args):
            ((vp, vstride), (wp, wstride), (ap, astride)), (n_, shift_), rows, accs = _operands(
                context, b, sig, args, lanes)

            def acc_at(x, column):
                return b.gep(ap, [b.add(b.mul(rows[x], astride), column)])

            keys = _Keys(vp, vstride, types.float32, ir.Constant(i64, 0), n_, shift_, False)
            with cgutils.for_range_slice(b, ir.Constant(i64, 0), vstride, ir.Constant(i64, TILE),
                                         inc=True) as (c, _):
                _column_tile(b, keys, wp, wstride, rows, accs, acc_at, c)
            return context.get_dummy_value()

        return types.void(block, w, acc, r, n, shift), codegen

    return block_sum_tiles


class _Keys:
    """The keys a column tile passes over: values at vp (row stride vstride, `element`), rows
    k0 .. k1 - 1, whose weights sit at column i + shift; `fetch`: prefetch the next block."""

    def __init__(self, vp, vstride, element, k0, k1, shift, fetch: bool):
        self.vp, self.vstride, self.element = vp, vstride, element
        self.k0, self.k1, self.shift, self.fetch = k0, k1, shift, fetch


def _column_tile(b, keys, wp, wstride, rows, accs, acc_at, c):
    """Keys k0 .. k1 - 1 into columns c .. c + TILE - 1 of every lane: the accumulators loaded,
    held in registers over the keys, stored."""
    lanes, vp, vstride, element = len(rows), keys.vp, keys.vstride, keys.element
    slots = [b.bitcast(acc_at(x, b.add(c, ir.Constant(i64, WIDTH * h))), V8.as_pointer())
             for x in range(lanes) for h in range(2)]
    for slot, at in zip(accs, slots, strict=True):
        b.store(b.load(at, align=4), slot)
    ahead = b.mul(ir.Constant(i64, BLOCK_KEYS), vstride)
    with cgutils.for_range_slice(b, keys.k0, keys.k1, ir.Constant(i64, 1), inc=True) as (i, _):
        row = b.mul(i, vstride)
        if keys.fetch:  # the same columns of the next block's row: what this tile's next pass reads
            prefetch(b, b.bitcast(b.gep(vp, [b.add(b.add(row, ahead), c)]), ir.IntType(8).as_pointer()))
        parts = [_widen8(b, vp, b.add(row, b.add(c, ir.Constant(i64, WIDTH * h))), element) for h in range(2)]
        weight_at = b.add(i, keys.shift)
        weights = [b.load(b.gep(wp, [b.add(b.mul(rows[x], wstride), weight_at)])) for x in range(lanes)]
        for x in range(lanes):
            spread = splat_value(b, weights[x], WIDTH)
            for h in range(2):
                _add_product(b, accs[2 * x + h], spread, parts[h])
    for slot, at in zip(accs, slots, strict=True):
        b.store(b.load(slot), at, align=4)


sum_tiles4, sum_tiles3 = _sum_tiles(4), _sum_tiles(3)
# over a block of the cache's keys, or of keys or values widened to fp32 once for every lane
block_score_tiles4, block_score_tiles3, block_score_tiles1 = _score_tiles(4), _score_tiles(3), _score_tiles(1)
block_sum_tiles4, block_sum_tiles3, block_sum_tiles1 = (_block_sum_tiles(4), _block_sum_tiles(3),
                                                       _block_sum_tiles(1))
pair_score_tiles8, pair_score_tiles4 = _pair_score_tiles(8), _pair_score_tiles(4)
pair_score_tiles3, pair_score_tiles1 = _pair_score_tiles(3), _pair_score_tiles(1)
pair_sum_tiles8, pair_sum_tiles4 = _pair_sum_tiles(8), _pair_sum_tiles(4)
pair_sum_tiles3, pair_sum_tiles1 = _pair_sum_tiles(3), _pair_sum_tiles(1)
