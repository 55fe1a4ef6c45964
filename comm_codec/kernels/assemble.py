"""Assembly: a chunk's stream bytes joined back into its elements.

After a chunk's coded streams are decoded into byte rows (raw streams are read where they
lie in the frame), one pass joins each element's stream bytes, adds the chunk's
reference to stream 0 and rotates the sign back (:func:`assemble`), or spreads the
present elements out by the zero mask (:func:`assemble_masked`). Writing each stream's
symbols into the elements stream by stream instead would touch the output once per
stream.

**Streaming stores.** A large output is written with non-temporal stores, 64 bytes at a
time (:func:`_store_block`, in LLVM's vector IR): a plain store first reads the line it
writes (read for ownership), so a decode moved the output through memory twice;
streaming stores about halve the time to assemble a large fp32 output from cache-resident
rows (``launch_scripts/bench_decode.py`` measures it). The lines then bypass the caches,
which only pays when the output would not stay there anyway, so the decoder asks for it
only past :data:`STREAM_MIN_BYTES` of output (see :mod:`comm_codec.kernels.decode`), and
only where the chunk's output is 64-byte aligned (the codec's outputs are; a user's
``out`` may not be). A fence after each chunk's streaming stores orders them before
anything the thread writes later.

Kernels call these inline, so numba's cache holds them in decode.py's kernels: a
change here must come with a change to decode.py (as for lanes.py and plane.py).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .intrinsics import address
from .jit import inline, jit
from .symbols import element_layout

__all__ = ["STREAM_MIN_BYTES", "LINE_BYTES", "assemble", "assemble_masked"]

# Outputs from this size on are written with streaming stores: past the L2 of a core
# (1-2 MiB on the machines this was tuned on) and the share of L3 a core can count on,
# a plain store's read for ownership is a second trip through memory.
STREAM_MIN_BYTES = 8 << 20
LINE_BYTES = 64  # one cache line: a streaming store fills whole lines, from an address aligned to it


@inline
def _element(v0, v1, v2, v3, j, add, width, ra):
    """The element whose stream bytes are v0[j], v1[j], ...: stream 0 plus add (mod 256),
    the streams joined most significant first, rotated back (sign from bit 0)."""
    x = (np.int64(v0[j]) + add) & 255
    if width >= 2:
        x = (x << 8) | np.int64(v1[j])
    if width == 4:
        x = (((x << 8) | np.int64(v2[j])) << 8) | np.int64(v3[j])
    if ra:
        x = (x >> 1) | ((x & 1) << (8 * width - 1))
    return x


@intrinsic
def _store_block(typingctx, a0, a1, a2, a3, add, dst, i):
    """Store the 64 bytes of elements dst[i:i + 64 // width] with one streaming store,
    each joined from the bytes at addresses a0, a1, ... (stream 0 plus add, mod 256;
    rotated back for IEEE types, as :func:`_element`). dst + i must be 64-byte aligned;
    64 // width bytes are read from each stream's address."""
    if not (isinstance(dst, types.Array) and isinstance(dst.dtype, types.Integer)):
        return None
    width = dst.dtype.bitwidth // 8
    rotate = not dst.dtype.signed
    n = LINE_BYTES // width
    bits = 8 * width

    def codegen(context, builder, signature, args):
        addrs = args[:4]
        add_value, ary, index = args[4], args[5], args[6]
        lane = ir.IntType(bits)
        vec = ir.VectorType(lane, n)
        raw = ir.VectorType(ir.IntType(8), n)

        def splat(value):
            return ir.Constant(vec, [value] * n)

        def stream(s):
            row = builder.load(builder.inttoptr(addrs[s], raw.as_pointer()), align=1)
            return row if width == 1 else builder.zext(row, vec)

        one = builder.insert_element(
            ir.Constant(vec, None), builder.trunc(add_value, lane), ir.Constant(ir.IntType(32), 0)
        )
        addv = builder.shuffle_vector(
            one, ir.Constant(vec, None), ir.Constant(ir.VectorType(ir.IntType(32), n), [0] * n)
        )
        x = builder.add(stream(0), addv)
        if width > 1:
            x = builder.and_(x, splat(255))
            for s in range(1, width):
                x = builder.or_(builder.shl(x, splat(8)), stream(s))
        if rotate:
            x = builder.or_(builder.lshr(x, splat(1)), builder.shl(x, splat(bits - 1)))
        data = context.make_array(signature.args[5])(context, builder, ary).data
        ptr = builder.bitcast(builder.gep(data, [index]), vec.as_pointer())
        store = builder.store(x, ptr, align=LINE_BYTES)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64, types.int64, types.int64, dst, types.int64), codegen


@intrinsic
def _store_fence(typingctx):
    """Order this thread's streaming stores before its later stores: a full fence (mfence
    on x86, which drains them as sfence does), once a chunk."""

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@jit
def assemble(v0, v1, v2, v3, present, add, dst, streaming):
    """dst[i] = the element of the streams' bytes i, for i < present.

    One vectorizable pass; with ``streaming`` and dst 64-byte aligned, the whole lines of
    dst go out as streaming stores (module docstring) and the rest through the loop.
    A block reads 64 // width bytes of each row, for whole blocks of present elements
    only: nothing past the rows' present bytes is read.

    Args:
        v0, v1, v2, v3: uint8 rows, byte i of each stream (rows past the element's
            width are ignored).
        present: elements to build.
        add: stream 0's reference (``ref << exp_shift``), added back mod 256.
        dst: output, element bits (at least ``present`` of them).
        streaming: allow streaming stores (an output of :data:`STREAM_MIN_BYTES` or more).
    """
    width, ra, _ = element_layout(dst)
    done = 0
    if streaming and address(dst) % LINE_BYTES == 0:
        per = LINE_BYTES // width
        blocks = present // per
        a0 = address(v0)
        a1 = address(v1)
        a2 = address(v2)
        a3 = address(v3)
        for b in range(blocks):
            _store_block(a0 + per * b, a1 + per * b, a2 + per * b, a3 + per * b, add, dst, per * b)
        _store_fence()
        done = per * blocks
    tail = dst[done:present]
    w0 = v0[done:]
    w1 = v1[done:]
    w2 = v2[done:]
    w3 = v3[done:]
    for i in range(tail.size):
        tail[i] = _element(w0, w1, w2, w3, i, add, width, ra)


@jit
def assemble_masked(v0, v1, v2, v3, present, add, frame8, mpos, out):
    """out[i] = the next of the present elements (streams' bytes 0..present-1) where bit
    i of the mask at frame8[mpos] is set, else 0.

    Two passes: the present elements are built densely into a scratch row (the
    vectorized :func:`assemble`), then spread out by the mask a byte at a time,
    branch-free: each element takes the next dense one multiplied by its bit (the
    scratch row holds a zero one past the last, so nothing past the streams' bytes is
    read even where a raw stream ends the frame). An all-zero mask byte (zeros come in
    runs in many gradients) stores 8 zeros. Element by element with a select (``if
    bit``, and even ``& -bit``), LLVM emits a branch that mispredicts on half-zero
    gradients.

    Args:
        v0, v1, v2, v3, present, add: as for :func:`assemble`.
        frame8: the frame's bytes.
        mpos: where the chunk's mask (one bit per element of ``out``) starts in frame8.
        out: output, element bits of the whole chunk.
    """
    dense = np.empty(present + 1, dtype=out.dtype)
    assemble(v0, v1, v2, v3, present, add, dense, False)
    dense[present] = 0
    j = np.int64(0)
    n = out.size
    for q in range(n >> 3):
        m = np.int64(frame8[mpos + q])
        base = 8 * q
        if m == 0:
            for t in range(8):
                out[base + t] = 0
            continue
        for t in range(8):
            bit = (m >> t) & 1
            out[base + t] = dense[j] * bit
            j += bit
    for i in range(n & ~7, n):
        bit = (np.int64(frame8[mpos + (i >> 3)]) >> (i & 7)) & 1
        out[i] = dense[j] * bit
        j += bit
