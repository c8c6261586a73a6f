"""Attention's weighted sums with the accumulators held in vector registers over the keys.

`kernels/jit/attention_sums.py`'s `weighted_sum4` adds four lanes' weighted values key after key,
vectorised by LLVM over the columns: every pass over four keys loads and stores the lanes'
accumulators. Here an intrinsic keeps them in `<8 x float>` registers across all the keys of a
block of columns (4 lanes x `--blocks` vectors of 8 columns): the same products and sums in the
same order, so the same bits, as the script checks. It times both on one thread over a bf16 cache
of `--keys` keys (the normaliser's 65th column left out of the register form).

    python scripts/bench/experiments/register_sums.py --keys 4480 --blocks 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from specdec.backends.native.kernels.jit import attention_sums as attention
from specdec.backends.native.kernels.jit.ir import data_pointer, splat_value, vec

i16, i32, i64, f32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
LANES = 4


def register_block(blocks: int):
    """An intrinsic adding, for lanes r .. r + 3 and columns cb .. cb + 8 blocks - 1, every key's
    w[lane, i] * values[i, column] to acc[lane, column], key after key (bf16 values)."""

    @intrinsic
    def block(typingctx, values, w, acc, r, lo, count, cb):
        def codegen(context, b, sig, args):
            vp, wp, ap = (data_pointer(context, b, sig, args, k) for k in (0, 1, 2))
            vcols, wcols, acols = (b.extract_value(context.make_array(sig.args[k])(context, b, args[k]).shape, 1)
                                   for k in (0, 1, 2))
            r_, lo_, count_, cb_ = args[3:7]
            v8f = vec(f32, 8)

            def slot_ptr(x, k):
                row = b.gep(ap, [b.add(b.mul(b.add(r_, ir.Constant(i64, x)), acols), cb_)])
                return b.bitcast(b.gep(row, [ir.Constant(i64, 8 * k)]), v8f.as_pointer())

            accs = [cgutils.alloca_once_value(b, b.load(slot_ptr(x, k), align=4))
                    for x in range(LANES) for k in range(blocks)]
            with cgutils.for_range_slice(b, lo_, count_, ir.Constant(i64, 1), inc=True) as (i, _):
                row = b.gep(vp, [b.add(b.mul(i, vcols), cb_)])
                ps = []
                for k in range(blocks):
                    raw = b.load(b.bitcast(b.gep(row, [ir.Constant(i64, 8 * k)]), vec(i16, 8).as_pointer()), align=2)
                    bits = b.shl(b.zext(raw, vec(i32, 8)), ir.Constant(vec(i32, 8), [16] * 8))
                    ps.append(b.bitcast(bits, v8f))
                for x in range(LANES):
                    weight = b.load(b.gep(wp, [b.add(b.mul(b.add(r_, ir.Constant(i64, x)), wcols), i)]))
                    spread = splat_value(b, weight, 8)
                    for k in range(blocks):
                        slot = accs[x * blocks + k]
                        b.store(b.fadd(b.load(slot), b.fmul(spread, ps[k])), slot)
            for x in range(LANES):
                for k in range(blocks):
                    b.store(b.load(accs[x * blocks + k]), slot_ptr(x, k), align=4)
            return context.get_dummy_value()

        return types.void(values, w, acc, r, lo, count, cb), codegen

    @njit(nogil=True)
    def sums(values, w, acc, lo, count):  # pragma: no cover - compiled
        for cb in range(0, values.shape[1] - 8 * blocks + 1, 8 * blocks):
            block(values, w, acc, 0, lo, count, cb)

    return sums


def median_us(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return round(1e6 * statistics.median(times), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=4480)
    parser.add_argument("--blocks", type=int, default=2, help="vectors of 8 columns per pass (64 must divide)")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    dim = 64
    values = (rng.standard_normal((args.keys, dim + 1)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    w = np.abs(rng.standard_normal((LANES, args.keys))).astype(np.float32)
    today, registers = np.zeros((LANES, dim + 1), np.float32), np.zeros((LANES, dim + 1), np.float32)
    sums = register_block(args.blocks)
    now_us = median_us(lambda: (today.fill(0), attention.weighted_sum4(values, w, today, 0, 0, args.keys)),
                       args.repeats)
    reg_us = median_us(lambda: (registers.fill(0), sums(values, w, registers, 0, args.keys)), args.repeats)
    same = bool((today[:, :dim].view(np.int32) == registers[:, :dim].view(np.int32)).all())
    print(json.dumps({"keys": args.keys, "blocks": args.blocks, "weighted_sum4_us": now_us,
                      "registers_us_64_columns": reg_us, "same_bits": same}))


if __name__ == "__main__":
    main()
