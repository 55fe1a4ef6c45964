"""LLVM-level operations that numba does not spell: prefetch hints, unaligned loads and stores, bit casts.

The decoder's fast loop works on raw addresses (:func:`address`, :func:`load64`, ...):
passing arrays into its inlined steps made numba count references on every step (a
runtime call per symbol), while integers are free. Its callers establish the bounds
before such a loop runs; these functions check nothing.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = [
    "prefetch",
    "prefetch_at",
    "address",
    "load64",
    "load16",
    "load8",
    "store8_at",
    "store64_at",
    "store64",
    "as_f32",
    "f32_bits",
]


def _prefetch_call(builder, ptr, write):
    fn = builder.module.declare_intrinsic(
        "llvm.prefetch",
        fnty=ir.FunctionType(
            ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]
        ),
    )
    builder.call(
        fn, [ptr, ir.Constant(ir.IntType(32), write), ir.Constant(ir.IntType(32), 2), ir.Constant(ir.IntType(32), 1)]
    )


@intrinsic
def prefetch(typingctx, arr, i):
    """Ask for the cache line holding arr[i] to be brought into L2 (a hint: never faults,
    so i may lie past the array's end)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        ary, index = args
        data = context.make_array(signature.args[0])(context, builder, ary).data
        _prefetch_call(builder, builder.bitcast(builder.gep(data, [index]), ir.IntType(8).as_pointer()), 0)
        return context.get_dummy_value()

    return types.void(arr, types.int64), codegen


@intrinsic
def prefetch_at(typingctx, addr, write):
    """Ask for the cache line at address addr (write: for writing) to be brought into
    L2; a hint that never faults, so addr may lie outside any buffer."""
    if not isinstance(write, types.IntegerLiteral):
        return None
    rw = write.literal_value

    def codegen(context, builder, signature, args):
        _prefetch_call(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), rw)
        return context.get_dummy_value()

    return types.void(types.int64, write), codegen


@intrinsic
def address(typingctx, arr):
    """The address of arr's first element, as an integer."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.int64(arr), codegen


def _raw_load(bits):
    def typer(typingctx, addr):
        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            return builder.load(ptr, align=1)

        return getattr(types, f"uint{bits}")(types.int64), codegen

    typer.__doc__ = f"The uint{bits} at address addr (any alignment)."
    return intrinsic(typer)


load64 = _raw_load(64)
load16 = _raw_load(16)
load8 = _raw_load(8)


@intrinsic
def store64_at(typingctx, addr, value):
    """Store the 8 bytes of value at address addr (any alignment)."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        builder.store(args[1], ptr, align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def store8_at(typingctx, addr, value):
    """Store the low byte of value at address addr."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        builder.store(builder.trunc(args[1], ir.IntType(8)), ptr, align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def store64(typingctx, arr, i, value):
    """Store the 8 bytes of value at arr[i:i+8] (uint8 array, any alignment); the
    caller guarantees i + 8 <= arr.size. One store instead of eight byte stores."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        ary, index, val = args
        base = context.make_array(signature.args[0])(context, builder, ary).data
        ptr = builder.gep(base, [index])
        word = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        builder.store(val, word, align=1)
        return context.get_dummy_value()

    return types.void(arr, types.int64, types.int64), codegen


@intrinsic
def as_f32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer bits (numba widens
    uint32 arithmetic to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bits of the float32 x, as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen
