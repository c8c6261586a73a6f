"""KV-cache elements as the attention kernels read and write them: fp32, or bf16 held as its 16
bits (uint16: numba has no bf16 type). `load` widens an element to fp32, which is exact;
`encode` rounds an fp32 value to the cache's element as torch's cast does (to nearest even,
a NaN stays a NaN). Both are the identity for an fp32 cache, so one kernel source serves
both caches and its fp32 build does what it did before. Each is a few IR instructions that
LLVM vectorises inside the kernels' loops (a numba scalar has no bit view)."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I32 = ir.IntType(32)


def _const(value: int) -> ir.Constant:
    return ir.Constant(_I32, value)


@intrinsic
def load(typingctx, x):
    """A cache element -> fp32: itself, or bf16 bits shifted into the high half of a float."""
    if x == types.float32:
        return types.float32(x), lambda context, b, sig, args: args[0]
    if x == types.uint16:
        def widen(context, b, sig, args):
            return b.bitcast(b.shl(b.zext(args[0], _I32), _const(16)), ir.FloatType())

        return types.float32(x), widen
    return None


@intrinsic
def encode(typingctx, x, cache):
    """fp32 x -> the element `cache` (an fp32 or uint16 array) stores for it."""
    if x != types.float32 or not isinstance(cache, types.Array):
        return None
    if cache.dtype == types.float32:
        return types.float32(x, cache), lambda context, b, sig, args: args[0]
    if cache.dtype == types.uint16:
        def round_bits(context, b, sig, args):
            bits = b.bitcast(args[0], _I32)
            odd = b.and_(b.lshr(bits, _const(16)), _const(1))  # ties go to the even neighbour
            rounded = b.lshr(b.add(b.add(bits, _const(0x7FFF)), odd), _const(16))
            quiet = b.or_(b.lshr(bits, _const(16)), _const(0x40))
            nan = b.icmp_unsigned(">", b.and_(bits, _const(0x7FFFFFFF)), _const(0x7F800000))
            return b.trunc(b.select(nan, quiet, rounded), ir.IntType(16))

        return types.uint16(x, cache), round_bits
    return None
