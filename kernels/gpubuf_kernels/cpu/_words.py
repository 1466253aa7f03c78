"""Unaligned 8- and 32-byte loads and stores on byte arrays, for the compiled CPU loops.

A decoded line is a handful of short runs and copies. Written a byte at a time (or as loops
that LLVM turns into ``memset``/``memcpy`` calls), each piece pays a loop or a call for a few
bytes; as one wide store it costs an instruction or two. Numba has no unaligned word or vector
access on a ``uint8`` array, so these intrinsics emit it (``align=1``: x86 and AArch64 load and
store unaligned words at full speed; LLVM splits a 32-byte vector where registers are narrower).

Against the same functions written as plain Numba loops over bytes
(``benchmarks/words_side_by_side.py``, 2-core CPU, one process): the row encoder 2.7 to 4.5 times and the
row decoder 7 to 10 times faster with these.

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
_WIDE = ir.VectorType(_WORD, 4)  # 32 bytes as four words (a fill of one repeated word)
_BYTE_VECTOR = ir.VectorType(ir.IntType(8), 32)  # 32 bytes as bytes (byte-wise adds and compares)
_MASK = ir.IntType(32)  # one bit per byte of a 32-byte vector


def _is_bytes(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.uint8 for a in arrays)


def _are_positions(*values) -> bool:
    return all(isinstance(v, types.Integer) for v in values)


def _pointer(context, builder, array_type, array, pos, pointee):
    """``&array[pos]`` as a pointer to ``pointee`` (an LLVM type)."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.bitcast(builder.gep(data, [pos]), pointee.as_pointer())


def _splat(builder, vector_type, value):
    vector = ir.Constant(vector_type, ir.Undefined)
    for i in range(vector_type.count):
        vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), i))
    return vector


def _byte_vector(context, builder, array_type, array, pos):
    return builder.load(_pointer(context, builder, array_type, array, pos, _BYTE_VECTOR), align=1)


@intrinsic
def load_word(typingctx, arr, pos):  # pragma: no cover - compiled
    """``uint64`` from the 8 bytes ``arr[pos : pos + 8]`` (little-endian on the machines we run on)."""
    if not (_is_bytes(arr) and _are_positions(pos)):
        return None
    sig = types.uint64(arr, pos)

    def codegen(context, builder, sig, args):
        return builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], _WORD), align=1)

    return sig, codegen


@intrinsic
def store_word(typingctx, arr, pos, value):  # pragma: no cover - compiled
    """``arr[pos : pos + 8] = value`` as one unaligned 8-byte store."""
    if not (_is_bytes(arr) and _are_positions(pos)):
        return None
    sig = types.void(arr, pos, types.uint64)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store(word, _pointer(context, builder, sig.args[0], args[0], args[1], _WORD), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def store_wide(typingctx, arr, pos, value):  # pragma: no cover - compiled
    """``arr[pos : pos + 32] = value`` repeated four times, as one unaligned 32-byte store."""
    if not (_is_bytes(arr) and _are_positions(pos)):
        return None
    sig = types.void(arr, pos, types.uint64)

    def codegen(context, builder, sig, args):
        word = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store(_splat(builder, _WIDE, word), _pointer(context, builder, sig.args[0], args[0], args[1], _WIDE), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def copy_wide(typingctx, dst, d, src, s):  # pragma: no cover - compiled
    """``dst[d : d + 32] = src[s : s + 32]`` as one unaligned 32-byte load and store."""
    if not (_is_bytes(dst, src) and _are_positions(d, s)):
        return None
    sig = types.void(dst, d, src, s)

    def codegen(context, builder, sig, args):
        chunk = builder.load(_pointer(context, builder, sig.args[2], args[2], args[3], _WIDE), align=1)
        builder.store(chunk, _pointer(context, builder, sig.args[0], args[0], args[1], _WIDE), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def add_wide(typingctx, dst, d, src, s, value):  # pragma: no cover - compiled
    """``dst[d : d + 32] = (src[s : s + 32] + value) % 256``, one unaligned 32-byte load and store."""
    if not (_is_bytes(dst, src) and _are_positions(d, s, value)):
        return None
    sig = types.void(dst, d, src, s, types.uint8)

    def codegen(context, builder, sig, args):
        byte = context.cast(builder, args[4], sig.args[4], types.uint8)
        chunk = _byte_vector(context, builder, sig.args[2], args[2], args[3])
        total = builder.add(chunk, _splat(builder, _BYTE_VECTOR, byte))
        builder.store(total, _pointer(context, builder, sig.args[0], args[0], args[1], _BYTE_VECTOR), align=1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def equal_wide(typingctx, a, i, b, j):  # pragma: no cover - compiled
    """``a[i : i + 32] == b[j : j + 32]``: two 32-byte loads and one compare."""
    if not (_is_bytes(a, b) and _are_positions(i, j)):
        return None
    sig = types.boolean(a, i, b, j)

    def codegen(context, builder, sig, args):
        x = _byte_vector(context, builder, sig.args[0], args[0], args[1])
        y = _byte_vector(context, builder, sig.args[2], args[2], args[3])
        differ = builder.bitcast(builder.icmp_unsigned("!=", x, y), _MASK)
        return builder.icmp_unsigned("==", differ, ir.Constant(_MASK, 0))

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
    return builder.bitcast(builder.icmp_unsigned("!=", here, before), _MASK)


@intrinsic
def change_bits(typingctx, a, i):  # pragma: no cover - compiled
    """``uint32`` whose bit ``t`` is set where ``a[i + t] != a[i + t - 1]``, ``t`` in ``[0, 32)``."""
    if not (_is_bytes(a) and _are_positions(i)):
        return None
    sig = types.uint32(a, i)

    def codegen(context, builder, sig, args):
        return _change_bits(context, builder, sig, args, False)

    return sig, codegen


@intrinsic
def residual_change_bits(typingctx, a, i, r, j):  # pragma: no cover - compiled
    """:func:`change_bits` of the residual ``(a[i + t] - r[j + t]) % 256``."""
    if not (_is_bytes(a, r) and _are_positions(i, j)):
        return None
    sig = types.uint32(a, i, r, j)

    def codegen(context, builder, sig, args):
        return _change_bits(context, builder, sig, args, True)

    return sig, codegen


def _mask_to_int64(v, emit):
    """The typing and code of an intrinsic that maps a ``uint32`` mask to an ``int64`` by ``emit``."""
    if not _are_positions(v):
        return None

    def codegen(context, builder, sig, args):
        return builder.zext(emit(builder, args[0]), _WORD)

    return types.int64(types.uint32), codegen


@intrinsic
def popcount(typingctx, v):  # pragma: no cover - compiled
    """Set bits of a ``uint32``."""
    return _mask_to_int64(v, lambda builder, mask: builder.ctpop(mask))


@intrinsic
def lowest_bit(typingctx, v):  # pragma: no cover - compiled
    """Position of the lowest set bit of a non-zero ``uint32``."""
    return _mask_to_int64(v, lambda builder, mask: builder.cttz(mask, ir.Constant(ir.IntType(1), 1)))
