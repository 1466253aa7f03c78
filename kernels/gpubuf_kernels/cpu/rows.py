"""Row gather as a compiled CPU loop: every field's rows copied with the next rows prefetched.

The torch twin :func:`gpubuf.ops.gather_rows.gather_rows_ref` is the specification: output row
``b`` of each field is a copy of that field's row ``index[b]``. The twin's ``index_select``
copies one field at a time and waits for each row's cache misses in turn; a sample's rows are
scattered over the whole storage, so nearly every row misses the cache and the TLB. Here, while
row ``b`` is copied, the rows :data:`PREFETCH_AHEAD` places on are already on their way. (Measured
side by side on 1M rows of 277 B in five fields, cold rows: 256 rows in 0.65 times the time of
five ``index_select`` calls, 512 to 4,096 rows in 0.6 to 0.65. Large batches are bound by write
bandwidth, where ``index_select``'s two threads win: the caller sends them there.)

An index made of runs of consecutive rows (trajectory slices) is copied run by run, each run one
block, with the whole extent of the run :data:`PREFETCH_AHEAD` runs on prefetched: a run's first
line alone leaves the rest of it to the processor's stream detector, which starts too late for
runs of a few lines. (Measured against the row-wise loop that listed runs as it copied, 1M rows,
32-row slices, caches flushed between calls: fields of 16, 8 and 1 B, 1,024 rows in 24 against 48
us, 4,096 in 49 against 126 us; five fields of 277 B, 1,024 rows in 73 against 99 us.) Mostly
scattered rows (more runs than half the rows) are copied as runs of one row each, without listing
the runs first, which would cost up to a tenth more there: 0.85 to 0.9 times the earlier loop's time.

The fields differ in dtype and row width, so the kernel takes them as raw addresses, bytes and
widths: one compiled function for any schema, and no per-field array to convert per call. The
caller passes contiguous tensors and keeps them alive for the call; every index is checked
against the row count before the first copy.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from gpubuf_kernels.cpu.prefetch import LINE_BYTES, prefetch_line

#: Rows (runs, for an index of runs) ahead of the copy whose lines are prefetched (16 to 64 measured the same).
PREFETCH_AHEAD = 16


def _pointer_intrinsic(element: types.Integer, bits: int):
    """An intrinsic turning an integer address into a pointer to ``element``s, for :func:`numba.carray`."""

    @intrinsic
    def pointer_at(typingctx, address):  # pragma: no cover - compiled
        if not isinstance(address, types.Integer):
            return None
        sig = types.CPointer(element)(address)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], ir.IntType(bits).as_pointer())

        return sig, codegen

    return pointer_at


_bytes_at = _pointer_intrinsic(types.uint8, 8)
_int64s_at = _pointer_intrinsic(types.int64, 64)


@njit(inline="always")
def _prefetch_row(start, width):  # pragma: no cover - compiled
    """Prefetches every cache line of the ``width`` bytes at address ``start``."""
    line = np.uint64(LINE_BYTES)
    first = start - start % line
    for address in range(first, start + width, line):
        prefetch_line(address)


@njit(cache=True, nogil=True)
def gather_rows(sources, widths, rows, outputs, index_address, batch):  # pragma: no cover - compiled
    """``outputs[j][b] = sources[j][index[b]]`` for every field ``j``, as bytes.

    Args:
        sources: int64 ``[L]``, the address of each field's row 0; rows are ``widths[j]`` bytes,
            back to back (a contiguous tensor), ``rows`` of them. Only read.
        widths: int64 ``[L]``, bytes per row of each field.
        rows: the number of rows of every field.
        outputs: int64 ``[L]``, the address of each field's output: ``B * widths[j]`` bytes,
            written.
        index_address: the address of the ``B`` int64 row numbers (a contiguous tensor's: no
            NumPy view to make per call).
        batch: ``B``.

    Returns:
        True once every row is copied; False, with nothing written, when an index lies outside
        ``[0, rows)``.
    """
    n = batch
    index = carray(_int64s_at(index_address), n)
    runs = 0
    for b in range(n):
        if not (0 <= index[b] < rows):
            return False
        if b == 0 or index[b] != index[b - 1] + 1:
            runs += 1
    if 2 * runs > n:
        _copy(sources, widths, rows, outputs, index, n, n, _EVERY_ROW)
    else:
        _copy(sources, widths, rows, outputs, index, n, runs, _run_starts(index, n, runs))
    return True


@njit(inline="always")
def _run_starts(index, n, runs):  # pragma: no cover - compiled
    """int64 ``[runs + 1]``: where each run of consecutive rows starts in ``index``, then ``n``."""
    starts = np.empty(runs + 1, np.int64)
    r = 0
    for b in range(n):
        if b == 0 or index[b] != index[b - 1] + 1:
            starts[r] = b
            r += 1
    starts[runs] = n
    return starts


@njit(inline="always")
def _copy(sources, widths, rows, outputs, index, n, runs, starts):  # pragma: no cover - compiled
    """Copies ``runs`` runs of consecutive rows, each as one block, the whole run
    :data:`PREFETCH_AHEAD` runs on prefetched. ``starts`` from :func:`_run_starts`, or
    :data:`_EVERY_ROW` for scattered rows (``runs == n``: run ``k`` is row ``k`` alone, and no
    list of runs is made)."""
    every_row = starts.shape[0] == 0
    for j in range(sources.shape[0]):
        width = np.uint64(widths[j])
        base = np.uint64(sources[j])
        src = carray(_bytes_at(sources[j]), np.uint64(rows) * width)
        dst = carray(_bytes_at(outputs[j]), np.uint64(n) * width)
        for k in range(min(PREFETCH_AHEAD, runs)):
            first, end = (k, k + 1) if every_row else (starts[k], starts[k + 1])
            _prefetch_row(base + np.uint64(index[first]) * width, np.uint64(end - first) * width)
        for k in range(runs):
            ahead = k + PREFETCH_AHEAD
            if ahead < runs:
                first, end = (ahead, ahead + 1) if every_row else (starts[ahead], starts[ahead + 1])
                _prefetch_row(base + np.uint64(index[first]) * width, np.uint64(end - first) * width)
            b, end = (k, k + 1) if every_row else (starts[k], starts[k + 1])
            # Unsigned positions: a signed one makes Numba test it for wraparound, and that test
            # keeps LLVM from vectorising the copy.
            s = np.uint64(index[b]) * width
            d = np.uint64(b) * width
            for x in range(np.uint64(end - b) * width):
                dst[d + x] = src[s + x]


#: :func:`_copy`'s ``starts`` for scattered rows: empty, each row its own run.
_EVERY_ROW = np.zeros(0, np.int64)
