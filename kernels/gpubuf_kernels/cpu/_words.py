"""Unaligned 8- and 32-byte loads and stores on byte arrays, for the compiled CPU loops.

A decoded line is a handful of short runs and copies. Written a byte at a time (or as loops
that LLVM turns into ``memset``/``memcpy`` calls), each piece pays a loop or a call for a few
bytes; as one wide store it costs an instruction or two. Numba has no unaligned word or vector
access on a ``uint8`` array, so these intrinsics emit it (``align=1``: x86 and AArch64 load and
store unaligned words at full speed; LLVM splits a 32-byte vector where registers are narrower).

No bounds are checked: callers guarantee that every byte touched lies inside the array.

Numba's on-disk cache keys a compiled function on its own file only: after changing an
intrinsic here, touch the modules that use it (``codec.py``, ``encoder.py``) or clear their
``__pycache__``, or their cached machine code keeps the old version.
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


def _byte_vector(context, builder, array_type, array, pos):
    data = context.make_array(array_type)(context, builder, array).data
    return builder.load(builder.bitcast(builder.gep(data, [pos]), _BYTE_VECTOR.as_pointer()), align=1)


def _is_bytes(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.uint8 for a in arrays)


@intrinsic
def equal_wide(typingctx, a, i, b, j):  # pragma: no cover - compiled
    """``a[i : i + 32] == b[j : j + 32]``: two 32-byte loads and one compare."""
    if not (_is_bytes(a, b) and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
        return None
    sig = types.boolean(a, i, b, j)

    def codegen(context, builder, sig, args):
        x = _byte_vector(context, builder, sig.args[0], args[0], args[1])
        y = _byte_vector(context, builder, sig.args[2], args[2], args[3])
        differ = builder.bitcast(builder.icmp_unsigned("!=", x, y), ir.IntType(32))
        return builder.icmp_unsigned("==", differ, ir.Constant(ir.IntType(32), 0))

    return sig, codegen


def _change_bits(context, builder, sig, args, residual):
    """i32 whose bit ``t`` says ``v[i + t] != v[i + t - 1]``, ``v`` the bytes or their residual."""
    at = context.cast(builder, args[1], sig.args[1], types.int64)
    one = ir.Constant(at.type, 1)
    here = _byte_vector(context, builder, sig.args[0], args[0], at)
    before = _byte_vector(context, builder, sig.args[0], args[0], builder.sub(at, one))
    if residual:
        rt = context.cast(builder, args[3], sig.args[3], types.int64)
        here = builder.sub(here, _byte_vector(context, builder, sig.args[2], args[2], rt))
        before = builder.sub(before, _byte_vector(context, builder, sig.args[2], args[2], builder.sub(rt, one)))
    return builder.bitcast(builder.icmp_unsigned("!=", here, before), ir.IntType(32))


@intrinsic
def change_bits(typingctx, a, i):  # pragma: no cover - compiled
    """``uint32`` whose bit ``t`` is set where ``a[i + t] != a[i + t - 1]``, ``t`` in ``[0, 32)``."""
    if not (_is_bytes(a) and isinstance(i, types.Integer)):
        return None
    sig = types.uint32(a, i)

    def codegen(context, builder, sig, args):
        return _change_bits(context, builder, sig, args, False)

    return sig, codegen


@intrinsic
def residual_change_bits(typingctx, a, i, r, j):  # pragma: no cover - compiled
    """:func:`change_bits` of the residual ``(a[i + t] - r[j + t]) % 256``."""
    if not (_is_bytes(a, r) and isinstance(i, types.Integer) and isinstance(j, types.Integer)):
        return None
    sig = types.uint32(a, i, r, j)

    def codegen(context, builder, sig, args):
        return _change_bits(context, builder, sig, args, True)

    return sig, codegen


@intrinsic
def popcount(typingctx, v):  # pragma: no cover - compiled
    """Set bits of a ``uint32``."""
    if not isinstance(v, types.Integer):
        return None
    sig = types.int64(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.zext(builder.ctpop(args[0]), ir.IntType(64))

    return sig, codegen


@intrinsic
def lowest_bit(typingctx, v):  # pragma: no cover - compiled
    """Position of the lowest set bit of a non-zero ``uint32``."""
    if not isinstance(v, types.Integer):
        return None
    sig = types.int64(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.zext(builder.cttz(args[0], ir.Constant(ir.IntType(1), 1)), ir.IntType(64))

    return sig, codegen
