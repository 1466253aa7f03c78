"""Software prefetch, as a compiled CPU intrinsic: the hint under the sum tree's compiled loops.

The sum tree's compiled update and draw (:mod:`.sumtree`) call :func:`prefetch_line` on the rows
they will visit next, so that the reads of one level overlap instead of waiting one after the
other; the row gather (:mod:`.rows`) on the rows it copies next.

A prefetch is a hint: it never faults, changes no memory and no result, and the processor may
drop it. A stale or wrong address costs a wasted fetch at worst, never a crash.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: The cache line size of x86-64 and most arm64 processors.
LINE_BYTES = 64

_I32 = ir.IntType(32)
_BYTE_POINTER = ir.IntType(8).as_pointer()


@intrinsic
def prefetch_line(typingctx, address):  # pragma: no cover - compiled
    """A read prefetch, into every cache level, of the line holding byte ``address`` (an integer)."""
    if not isinstance(address, types.Integer):
        return None
    sig = types.void(address)

    def codegen(context, builder, sig, args):
        pointer = builder.inttoptr(args[0], _BYTE_POINTER)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [_BYTE_POINTER, _I32, _I32, _I32]), "llvm.prefetch.p0i8"
        )
        # (rw = 0: a read; locality = 3: keep in every level; cache type = 1: data.)
        builder.call(fn, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return sig, codegen
