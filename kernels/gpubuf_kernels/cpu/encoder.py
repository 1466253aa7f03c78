"""Row encoder of the compressed row format as compiled CPU loops.

:func:`gpubuf.ops.encode_rows.encode_planes` is the specification: the same choice for every line
(``UP`` over ``REF`` over ``RUNS`` of the line or of its residual, whichever has fewer runs and
only when smaller than the line, else ``RAW``), the same raw fallback for rows not strictly
smaller coded, the same bytes and checksums. There the choices are whole-batch tensor steps;
here each row is two passes over its lines, one to size it and one to write it, done one row
after the other so that the second pass finds the row's bytes in cache.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gpubuf_kernels.cpu._words import change_bits, equal_wide, lowest_bit, popcount, residual_change_bits
from gpubuf_kernels.cpu.codec import _adler32, next_line

_UP = 0
_REF = 1
_RAW = 2
_RUNS = 3
_MAX_RUNS = 128
_RUN_BLOCK = 256
_RESIDUAL_BIT = 0x80
_WIDE = 32  # bytes per vector compare
_ALL = 0xFFFFFFFF  # every position of a 32-byte window


@njit(cache=True, nogil=True, inline="always")  # a call costs more than a line
def _equal(a, i, b, j, n):  # pragma: no cover - compiled
    """``a[i : i + n] == b[j : j + n]``, in units of the arrays' dtype.

    An OR of XORs over the whole line, with no early exit: most lines compared are equal anyway
    (an early exit keeps it unit by unit, several times slower). Lines are short, below the
    vectorized loop's minimum trip, so the loop runs scalar: comparing 4-byte units (the
    callers pass views in the widest unit that divides the line and every offset) does a
    quarter of the iterations (timed side by side on 84-byte lines in cache: 2 to 4 times faster
    than byte compares).
    """
    i = np.uint64(i)
    j = np.uint64(j)
    acc = a[i] ^ b[j]
    for x in range(np.uint64(1), np.uint64(n)):
        acc |= a[i + x] ^ b[j + x]
    return acc == 0


@njit(cache=True, nogil=True, inline="always")  # a call costs more than a line
def _count_runs_bytes(a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """Runs of the line ``a[i : i + W]`` (or of its residual ``(a - ref[j:]) % 256``), split every 256 bytes."""
    i = np.uint64(i)
    j = np.uint64(j)
    runs = 0
    # Block by block: a new block always starts a run, so no test of the position per byte.
    for first in range(0, width, _RUN_BLOCK):
        stop = np.uint64(min(width, first + _RUN_BLOCK))
        start = np.uint64(first)
        runs += 1
        if residual:
            prev = (a[i + start] - ref[j + start]) & 0xFF
            for x in range(start + np.uint64(1), stop):
                v = (a[i + x] - ref[j + x]) & 0xFF
                runs += v != prev
                prev = v
        else:
            for x in range(start + np.uint64(1), stop):
                runs += a[i + x] != a[i + x - np.uint64(1)]
    return runs


@njit(cache=True, nogil=True, inline="always")
def _lines_equal(a, i, b, j, width):  # pragma: no cover - compiled
    """``a[i : i + W] == b[j : j + W]`` for ``W >= 32`` bytes, in 32-byte compares.

    The last compare ends at ``W`` (it may overlap the one before). Four times fewer steps than
    the 4-byte units of :func:`_equal` on 84-byte lines.
    """
    i = np.uint64(i)
    j = np.uint64(j)
    w = np.uint64(width)
    x = np.uint64(0)
    while x + np.uint64(_WIDE) < w:
        if not equal_wide(a, i + x, b, j + x):
            return False
        x += np.uint64(_WIDE)
    return equal_wide(a, i + w - np.uint64(_WIDE), b, j + w - np.uint64(_WIDE))


@njit(cache=True, nogil=True, inline="always")
def _changes(a, i, ref, j, x, residual):  # pragma: no cover - compiled
    """Bit ``t`` set where the line's value at ``x + t`` differs from the one before (``t < 32``)."""
    if residual:
        return residual_change_bits(a, i + x, ref, j + x)
    return change_bits(a, i + x)


@njit(cache=True, nogil=True, inline="always")
def _window(a, i, ref, j, x, width, residual):  # pragma: no cover - compiled
    """The changes at positions ``x ...`` below ``W``, and the position of bit 0.

    A window of 32 positions from ``x`` when it fits in the line, else the one that ends at
    ``W``, its positions before ``x`` masked off (the window before counted them).
    """
    if x + _WIDE <= width:
        return _changes(a, i, ref, j, x, residual), x
    s = width - _WIDE
    return _changes(a, i, ref, j, s, residual) & np.uint32((_ALL << (x - s)) & _ALL), s


@njit(cache=True, nogil=True, inline="always")
def _count_runs_wide(a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """:func:`_count_runs_bytes` for ``32 < W <= 256`` (one block): changes counted 32 positions at a time.

    A run starts at 0 and wherever a value differs from the one before.
    """
    runs = 1
    for x in range(1, width, _WIDE):
        bits, _ = _window(a, i, ref, j, x, width, residual)
        runs += popcount(bits)
    return runs


@njit(cache=True, nogil=True, inline="always")
def _write_runs_wide(data, at, n, a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """:func:`_write_runs_bytes` for ``32 < W <= 256``: run starts taken from change masks, bit by bit.

    A loop over the line's bytes mispredicts a branch at every run start; here each start costs
    one bit scan.
    """
    values = at + n - 1
    if residual:
        data[values] = (np.int64(a[i]) - np.int64(ref[j])) & 0xFF
    else:
        data[values] = a[i]
    k = 1
    for x in range(1, width, _WIDE):
        bits, s = _window(a, i, ref, j, x, width, residual)
        while bits != 0:
            t = s + lowest_bit(bits)
            bits &= bits - np.uint32(1)
            data[at + k - 1] = t  # below 256: one block
            if residual:
                data[values + k] = (np.int64(a[i + t]) - np.int64(ref[j + t])) & 0xFF
            else:
                data[values + k] = a[i + t]
            k += 1


@njit(cache=True, nogil=True, inline="always")  # a call costs more than a line
def _write_runs_bytes(data, at, n, a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """Writes a RUNS payload at ``data[at:]``: the low bytes of run starts 1..n-1, then the n values."""
    k = 0
    prev = np.int64(0)
    for x in range(width):
        v = (np.int64(a[i + x]) - np.int64(ref[j + x])) & 0xFF if residual else np.int64(a[i + x])
        if x == 0 or v != prev or x % _RUN_BLOCK == 0:
            if k > 0:
                data[at + k - 1] = x & 0xFF
            data[at + n - 1 + k] = v
            k += 1
        prev = v


@njit(cache=True, nogil=True, inline="always")
def _count_runs(a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """Runs of the line ``a[i : i + W]`` (or of its residual), split every 256 bytes."""
    if _WIDE < width <= _RUN_BLOCK:
        return _count_runs_wide(a, i, ref, j, width, residual)
    return _count_runs_bytes(a, i, ref, j, width, residual)


@njit(cache=True, nogil=True, inline="always")
def _write_runs(data, at, n, a, i, ref, j, width, residual):  # pragma: no cover - compiled
    """Writes a RUNS payload at ``data[at:]``: the low bytes of run starts 1..n-1, then the n values."""
    if _WIDE < width <= _RUN_BLOCK:
        _write_runs_wide(data, at, n, a, i, ref, j, width, residual)
    else:
        _write_runs_bytes(data, at, n, a, i, ref, j, width, residual)


@njit(cache=True, nogil=True)
def encode_rows(x, key, n, has_key, keyed, inrow, intra, ref_rows, image_planes, height, width):  # pragma: no cover
    """Encodes rows given as byte planes.

    Args:
        x: uint8 ``[n * L * W]``, each row's planes in order, rows back to back.
        key: uint8 ``[n * L * W]``, the reference rows' planes (read where ``has_key`` when ``keyed``).
        n: the number of rows.
        has_key: bool ``[n]`` (ignored unless ``keyed``).
        keyed: some row is coded against ``key``.
        inrow: planes ``p % P0 > 0`` of rows without a key may use plane ``p - p % P0``.
        intra: no references at all.
        ref_rows: int32 ``[n]``, the reference numbers the checksums cover.
        image_planes, height, width: ``P0``, ``H``, ``W`` (``L * W > 0``).

    Returns:
        ``(data, starts, lengths, checksums)``: uint8 bytes and int64 ``[n]`` tables.
    """
    row_bytes = x.shape[0] // n
    at = np.arange(n) * row_bytes
    src = np.zeros(n, np.int64)
    # A coded row is never longer than its raw bytes: n raw rows bound the output. Only the
    # pages written are touched.
    data = np.empty(n * row_bytes, np.uint8)
    starts, lengths, checksums, total = encode_rows_at(
        (x, key), (x, key), 1, src, at, src + 1, at, row_bytes, has_key, keyed, inrow, intra, ref_rows,
        image_planes, height, width, data,
    )
    return data[:total], starts, lengths, checksums


@njit(cache=True, nogil=True)
def encode_rows_at(
    srcs, units, unit, x_src, x_off, key_src, key_off, row_bytes, has_key, keyed, inrow, intra, ref_rows,
    image_planes, height, width, data,
):  # pragma: no cover - compiled
    """Encodes rows read where they lie, into ``data``, back to back.

    Row ``r``'s planes are ``srcs[x_src[r]][x_off[r] : x_off[r] + row_bytes]`` and its reference
    row's ``srcs[key_src[r]][key_off[r]:]`` (read only where ``has_key`` when ``keyed``), so rows
    scattered over several buffers (frames inside stacked observations) need no gathering copy.

    Each row is sized and written in one visit, while its bytes are still in cache.

    Args:
        srcs: a tuple of flat uint8 arrays.
        units, unit: the same arrays viewed as unsigned integers of ``unit`` bytes, for the line
            compares; ``unit`` divides ``width``, every offset and every array's size (``srcs``
            itself with ``unit = 1``).
        x_src, x_off, key_src, key_off: int64 ``[n]``, where each row and its reference row lie.
        row_bytes: bytes per row (``L * W > 0``).
        has_key, keyed, inrow, intra, ref_rows, image_planes, height, width: as in
            :func:`encode_rows`.
        data: uint8 output of at least ``n * row_bytes`` bytes (rows are never longer raw).

    Returns:
        ``(starts, lengths, checksums, total)``: int64 ``[n]`` tables and the bytes written.
    """
    # Flat arrays and offsets, not row views: a view per call costs reference counting.
    n = x_src.shape[0]
    lines = row_bytes // width
    mode_bytes = (lines + 3) // 4
    modes = np.empty(lines, np.uint8)
    runs = np.zeros(lines, np.int64)
    resid = np.zeros(lines, np.bool_)
    starts = np.empty(n, np.int64)
    lengths = np.empty(n, np.int64)
    checksums = np.empty(n, np.int64)
    total = 0
    line_units = width // unit
    wide_lines = width >= _WIDE  # lines compared 32 bytes at a time
    for r in range(n):
        x = srcs[x_src[r]]
        xu = units[x_src[r]]
        base = x_off[r]
        own_key = keyed and has_key[r]
        key = srcs[key_src[r]] if own_key else x
        keyu = units[key_src[r]] if own_key else xu
        key_base = key_off[r] if own_key else base
        size = mode_bytes
        y = 0
        q = 0
        for line in range(lines):
            i = base + line * width
            has_ref = not intra and (own_key or (inrow and q > 0))
            if own_key:
                ref = key
                refu = keyu
                j = key_base + line * width
            else:
                ref = x
                refu = xu
                j = base + (line - q * height) * width
            # UP is preferred to REF (it resolves inside the row): REF is tried only when UP fails.
            mode = _RAW
            if wide_lines:
                if y > 0 and _lines_equal(x, i, x, i - width, width):
                    mode = _UP
                elif has_ref and _lines_equal(x, i, ref, j, width):
                    mode = _REF
            elif y > 0 and _equal(xu, i // unit, xu, (i - width) // unit, line_units):
                mode = _UP
            elif has_ref and _equal(xu, i // unit, refu, j // unit, line_units):
                mode = _REF
            if mode == _RAW:
                count = _count_runs(x, i, ref, j, width, False)
                use = False
                if has_ref:
                    res_count = _count_runs(x, i, ref, j, width, True)
                    if res_count < count:
                        count = res_count
                        use = True
                if count <= _MAX_RUNS and 2 * count < width:
                    mode = _RUNS
                    runs[line] = count
                    resid[line] = use
                    size += 2 * count
                else:
                    size += width
            modes[line] = mode
            y, q = next_line(y, q, height, image_planes)
        length = size if size < row_bytes else row_bytes
        at = total
        starts[r] = at
        lengths[r] = length
        total += length
        if length == row_bytes:
            for b in range(row_bytes):
                data[at + b] = x[base + b]
        else:
            _write_row(data, at, x, base, key, key_base, own_key, modes, runs, resid, mode_bytes, image_planes, height, width)
        checksums[r] = _adler32(data, at, length, ref_rows[r])
    return starts, lengths, checksums, total


@njit(cache=True, nogil=True, inline="always")  # once per row, on the hot path
def _write_row(data, at, x, base, key, key_base, own_key, modes, runs, resid, mode_bytes, image_planes, height, width):  # pragma: no cover
    """Writes a coded row at ``data[at:]``: mode table, count bytes, then the line payloads."""
    lines = modes.shape[0]
    for b in range(mode_bytes):
        byte = 0
        for k in range(4):
            line = 4 * b + k
            if line < lines:
                byte |= np.int64(modes[line]) << (2 * k)
        data[at + b] = byte
    count_at = at + mode_bytes
    for line in range(lines):
        if modes[line] == _RUNS:
            data[count_at] = (runs[line] - 1) | (_RESIDUAL_BIT if resid[line] else 0)
            count_at += 1
    pos = count_at
    q = 0
    y = 0
    for line in range(lines):
        i = base + line * width
        mode = modes[line]
        if mode == _RAW:
            for b in range(width):
                data[pos + b] = x[i + b]
            pos += width
        elif mode == _RUNS:
            c = runs[line]
            if own_key:
                ref = key
                j = key_base + line * width
            else:
                ref = x
                j = base + (line - q * height) * width
            _write_runs(data, pos, c, x, i, ref, j, width, resid[line])
            pos += 2 * c - 1
        y, q = next_line(y, q, height, image_planes)
