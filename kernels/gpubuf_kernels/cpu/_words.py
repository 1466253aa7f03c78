"""Unaligned 8- and 32-byte loads and stores on byte arrays, for the compiled CPU loops.

A decoded line is a handful of short runs and copies. Written a byte at a time (or as loops
that LLVM turns into ``memset``/``memcpy`` calls), each piece pays a loop or a call for a few
bytes; as one wide store it costs an instruction or two. Numba has no unaligned word or vector
access on a ``uint8`` array, so these intrinsics emit it (``align=1``: x86 and AArch64 load and
store unaligned words at full speed; LLVM splits a 32-byte vector where registers are narrower).

No bounds are checked: callers guarantee that every byte touched lies inside the array.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_WORD = ir.IntType(64)


def _word_pointer(context, builder, array_type, array, pos):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [pos]), _WORD.as_pointer())


@intrinsic
def load_word(typingctx, arr, pos):  # pragma: no cover - compiled
    """``uint64`` from the 8 bytes ``arr[pos : pos + 8]`` (little-endian on the machines we run on)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(pos, types.Integer)):
        return None
    sig = types.uint64(arr, pos)

    def codegen(context, builder, sig, args):
        return builder.load(_word_pointer(context, builder, sig.args[0], args[0], args[1]), align=1)

    return sig, codegen


@intrinsic
def store_word(typingctx, arr, pos, value):  # pragma: no cover - compiled
    """``arr[pos : pos + 8] = value`` as one unaligned 8-byte store."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(pos, types.Integer)):
        return None
    sig = types.void(arr, pos, types.uint64)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store(word, _word_pointer(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen


_WIDE = ir.VectorType(_WORD, 4)


def _wide_pointer(context, builder, array_type, array, pos):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [pos]), _WIDE.as_pointer())


@intrinsic
def store_wide(typingctx, arr, pos, value):  # pragma: no cover - compiled
    """``arr[pos : pos + 32] = value`` repeated four times, as one unaligned 32-byte store."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8 and isinstance(pos, types.Integer)):
        return None
    sig = types.void(arr, pos, types.uint64)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        wide = ir.Constant(_WIDE, ir.Undefined)
        for i in range(4):
            wide = builder.insert_element(wide, word, ir.Constant(ir.IntType(32), i))
        builder.store(wide, _wide_pointer(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def copy_wide(typingctx, dst, d, src, s):  # pragma: no cover - compiled
    """``dst[d : d + 32] = src[s : s + 32]`` as one unaligned 32-byte load and store."""
    ok = all(isinstance(a, types.Array) and a.dtype == types.uint8 for a in (dst, src))
    if not (ok and isinstance(d, types.Integer) and isinstance(s, types.Integer)):
        return None
    sig = types.void(dst, d, src, s)

    def codegen(context, builder, sig, args):
        chunk = builder.load(_wide_pointer(context, builder, sig.args[2], args[2], args[3]), align=1)
        builder.store(chunk, _wide_pointer(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen


_BYTE_VECTOR = ir.VectorType(ir.IntType(8), 32)


@intrinsic
def add_wide(typingctx, dst, d, src, s, value):  # pragma: no cover - compiled
    """``dst[d : d + 32] = (src[s : s + 32] + value) % 256``, one unaligned 32-byte load and store."""
    ok = all(isinstance(a, types.Array) and a.dtype == types.uint8 for a in (dst, src))
    if not (ok and isinstance(d, types.Integer) and isinstance(s, types.Integer) and isinstance(value, types.Integer)):
        return None
    sig = types.void(dst, d, src, s, types.uint8)

    def codegen(context, builder, sig, args):
        def pointer(array_type, array, pos):
            data = context.make_array(array_type)(context, builder, array).data
            return builder.bitcast(builder.gep(data, [pos]), _BYTE_VECTOR.as_pointer())

        byte = context.cast(builder, args[4], sig.args[4], types.uint8)
        splat = ir.Constant(_BYTE_VECTOR, ir.Undefined)
        for i in range(32):
            splat = builder.insert_element(splat, byte, ir.Constant(ir.IntType(32), i))
        chunk = builder.load(pointer(sig.args[2], args[2], args[3]), align=1)
        builder.store(builder.add(chunk, splat), pointer(sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return sig, codegen
