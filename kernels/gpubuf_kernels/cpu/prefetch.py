"""Software prefetch, as compiled CPU loops: the hint under the row gather and the sum tree.

The row gather's twin :func:`gpubuf.ops.gather_rows.gather_rows_ref` (``index_select`` per
source) copies the rows; :func:`prefetch_rows` runs just before it, and is the gather's row of
the backend table. A sample of a few hundred rows out of a large storage misses the cache on
nearly every row of every field. ``index_select`` copies one field at a time, row after row, and
the processor overlaps only the few misses its reorder window reaches. Prefetch instructions for
every cache line of every sampled row, issued first, let the memory system fetch many lines at
once; the copies that follow then read from the cache. The sum tree's compiled update and draw
use :func:`prefetch_line` on the rows they will visit next.

A prefetch is a hint: it never faults, changes no memory and no result, and the processor may
drop it. A stale or wrong address costs a wasted fetch at worst, never a crash.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
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


@njit(cache=True, nogil=True)
def prefetch_rows(targets, index, min_runs):  # pragma: no cover - compiled
    """Prefetches row ``index[b]`` of every target, target by target.

    Args:
        targets: int64 ``[F, 3]``: per source, the address of row 0, the row stride and the
            row's length, in bytes.
        index: int64 ``[B]`` rows (the caller checked them; an address outside a source is
            only a wasted prefetch).

    Target by target, in the order the gathers read them: the first gather waits on the first
    lines fetched.

    Rows that come in fewer than ``min_runs`` runs of consecutive rows are not prefetched at all
    (a slice sampler's windows): each run is one sequential read, which the processor's own
    prefetcher follows, and the hints would only cost their instructions.
    """
    runs = 1
    for b in range(1, index.shape[0]):
        if index[b] != index[b - 1] + 1:
            runs += 1
    if runs < min_runs:
        return
    for f in range(targets.shape[0]):
        base = targets[f, 0]
        stride = targets[f, 1]
        length = targets[f, 2]
        for b in range(index.shape[0]):
            start = base + index[b] * stride
            line = start - (start & (LINE_BYTES - 1))
            end = start + length
            while line < end:
                prefetch_line(line)
                line += LINE_BYTES
