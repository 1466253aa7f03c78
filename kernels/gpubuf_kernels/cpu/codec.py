"""Row decode of the compressed row format as compiled CPU loops.

The format is :mod:`gpubuf.codec.format`'s; the torch twin
:func:`gpubuf.ops.decode_rows.decode_rows_ref` is the specification. The twin expands every
coded line of the needed rows into a pool and resolves each output line to a pool line; here a
row is decoded line by line straight into the output (a run is a fill, an ``UP``, ``REF`` or
``RAW`` line a copy, a residual a fill plus the reference line), which gives the same bytes.

Verification is the twin's, check for check, and reports the twin's status bits
(``BAD_*`` of :mod:`gpubuf.ops.decode_rows`), so the caller raises the twin's error with the
twin's message. Reads during verification are clamped to the arena exactly where the twin
clamps its gathers: a corrupt row may send the parse past its own bytes, and what the twin sees
there decides which reasons it reports (rows whose every possible read lies inside the arena
skip the clamping). Nothing is written to the output unless every needed row passed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._words import add_wide, copy_wide, load_word, store_wide, store_word

# Mirrors of gpubuf.codec.format and gpubuf.ops.decode_rows (this package never imports gpubuf).
_UP = 0
_REF = 1
_RAW = 2
_RUNS = 3
_ADLER_MOD = 65521
_ADLER_BLOCK = 5552  # bytes summed between reductions: zlib's NMAX, the most for which 255 * m * (m + 1) / 2 < 2**32

BAD_BOUNDS = 1
BAD_LENGTH = 2
BAD_CHECKSUM = 4
BAD_MODE = 8
BAD_RUNS = 16
BAD_REFERENCE = 32

#: Return codes of :func:`decode_rows`.
DECODED = 0
CORRUPT = 1
BAD_INDEX = 2

_KEY_CACHE_BYTES = 1 << 22  # decoded reference rows kept per call (a direct-mapped cache)
_KEY_CACHE_ROWS = 16
# The needed rows are found with a mark per table row while the table has at most this many rows
# per candidate (plus 65,536), and at most _DENSE_MARK_ROWS rows in all (5 bytes each); beyond
# that the candidates are sorted.
_DENSE_MARKS_PER_ROW = 256
_DENSE_MARK_ROWS = 1 << 24


@njit(cache=True, nogil=True, inline="always")
def next_line(y, q, height, image_planes):  # pragma: no cover - compiled
    """``(y, q)`` of the line after line ``y`` of image plane ``q``: counted rather than divided
    (two divisions a line cost more than the checks around them)."""
    y += 1
    if y == height:
        y = 0
        q += 1
        if q == image_planes:
            q = 0
    return y, q


@njit(cache=True, nogil=True, inline="always")
def _byte(arena, pos, last):  # pragma: no cover - compiled
    """``arena[pos]`` with ``pos`` clamped to ``[0, last]`` (0 for an empty arena), as the twin gathers."""
    if last < 0:
        return 0
    if pos < 0:
        pos = 0
    elif pos > last:
        pos = last
    return np.int64(arena[pos])


@njit(cache=True, nogil=True, inline="always")
def _mode(arena, off, line, last):  # pragma: no cover - compiled
    return (_byte(arena, off + (line >> 2), last) >> ((line & 3) * 2)) & 3


@njit(cache=True, nogil=True)
def _runs_ok(arena, pos, n, width, last):  # pragma: no cover - compiled
    """Whether the ``n - 1`` stored run starts at ``pos`` increase strictly inside a line of ``width``."""
    prev = 0
    zeros = 0
    for k in range(1, n):
        low = _byte(arena, pos + k - 1, last)
        if width > 256:
            # A zero low byte marks the next block of 256 (runs are split at its multiples).
            if low == 0:
                zeros += 1
            start = zeros * 256 + low
        else:
            start = low  # a zero here fails below, as the twin's "later run at 0"
        if start >= width or start <= prev:
            return False
        prev = start
    return True


@njit(cache=True, nogil=True)
def _adler32(arena, off, nb, suffix):  # pragma: no cover - compiled
    """``zlib.adler32(arena[off:off + nb] + suffix.to_bytes(4, "little", signed=True))``."""
    a = np.int64(1)
    b = np.int64(0)
    i = off
    end = off + nb
    while i < end:
        stop = min(end, i + _ADLER_BLOCK)
        # Over a block of m bytes x_j, a grows by sum(x_j) and b by m * a + sum((m - j) * x_j):
        # two independent sums, which vectorize, instead of the byte-by-byte chain. With blocks
        # of at most 5,552 bytes both fit 32 bits, whose lanes vectorize twice as wide.
        m = np.uint32(stop - i)
        base = np.uint64(i)
        s1 = np.uint32(0)
        s2 = np.uint32(0)
        for j in range(m):
            x = np.uint32(arena[base + np.uint64(j)])
            s1 += x
            s2 += (m - np.uint32(j)) * x
        b += np.int64(m) * a + np.int64(s2)
        a += np.int64(s1)
        a %= _ADLER_MOD
        b %= _ADLER_MOD
        i = stop
    word = np.int64(suffix) & 0xFFFFFFFF
    for k in range(4):
        a = (a + ((word >> (8 * k)) & 0xFF)) % _ADLER_MOD
        b = (b + a) % _ADLER_MOD
    return (b << 16) | a


@njit(cache=True, nogil=True)
def _parse_fast(arena, off, nb, own_ref, as_key, image_planes, height, width, lines):  # pragma: no cover - compiled
    """:func:`_check_row`'s parse of a row whose every possible read lies inside the arena.

    The same checks in the same order, without clamping reads, and with the run starts checked
    in line (branch-free) rather than in a call per line.

    Returns:
        ``(status, bad_runs, payload)``: the status bits before the checksum, whether run starts
        failed, and the payload start.
    """
    status = 0
    mode_bytes = (lines + 3) // 4
    n_runs = 0
    for line in range(lines):
        n_runs += ((np.int64(arena[off + (line >> 2)]) >> ((line & 3) * 2)) & 3) == _RUNS
    count_at = off + mode_bytes
    pos = off + mode_bytes + n_runs
    payload = pos
    wide = width > 256
    runs_ok = True
    y = 0
    q = 0
    for line in range(lines):
        mode = (np.int64(arena[off + (line >> 2)]) >> ((line & 3) * 2)) & 3
        has_plane_ref = not as_key and (own_ref >= 0 or q > 0)
        if mode == _UP:
            if y == 0:
                status |= BAD_MODE
        elif mode == _REF:
            if not has_plane_ref:
                status |= BAD_MODE
        elif mode == _RAW:
            pos += width
        else:
            count = np.int64(arena[count_at])
            count_at += 1
            n = (count & 127) + 1
            if count >= 128 and not has_plane_ref:
                status |= BAD_MODE
            if wide:
                prev = 0
                zeros = 0
                for k in range(1, n):
                    low = np.int64(arena[pos + k - 1])
                    zeros += low == 0
                    start = zeros * 256 + low
                    runs_ok &= (start < width) & (start > prev)
                    prev = start
            elif n > 1:
                # Starts are the stored bytes: increasing pairwise, the first above 0, the last below W.
                bad = np.uint8(arena[pos] == 0) | np.uint8(np.int64(arena[pos + n - 2]) >= width)
                p = np.uint64(pos)
                for k in range(np.uint64(n - 2)):
                    bad |= np.uint8(arena[p + k] >= arena[p + k + np.uint64(1)])
                runs_ok &= bad == 0
            pos += 2 * n - 1
        y, q = next_line(y, q, height, image_planes)
    if pos - off != nb:
        status |= BAD_LENGTH
    return status, not runs_ok, payload


@njit(cache=True, nogil=True)
def _check_row(arena, off, nb, own_ref, as_key, stored, image_planes, height, width, lines, verify):  # pragma: no cover
    """The twin's status bits of one needed row (``BAD_REFERENCE`` for a key row only), and its payload start.

    Args:
        arena: uint8 ``[A]``.
        off, nb: the row's table offset and length.
        own_ref: its reference row (-1 for none).
        as_key: it serves as the reference row of a sampled row (then none of its planes has a
            reference plane).
        stored: its stored checksum (int32 bit pattern).
        image_planes, height, width, lines: ``P0``, ``H``, ``W``, ``L``.
        verify: check the checksum.

    Returns:
        ``(status, payload)``: ``payload`` is the arena position of the first line's payload
        (meaningful only when ``status`` is 0).
    """
    status = 0
    if as_key and own_ref != -1:
        status |= BAD_REFERENCE
    size = arena.shape[0]
    # A parse reads at most the mode bytes, a count byte per line and the longest payload per
    # line (RAW: W bytes, RUNS: at most 255); a row with all of that inside the arena needs no
    # clamping, which is nearly every row.
    reach = (lines + 3) // 4 + lines * (1 + max(width, 255))
    if off >= 0 and nb >= 0 and off + nb <= size and off + reach <= size:
        if nb != lines * width:
            parsed, bad_runs, payload = _parse_fast(arena, off, nb, own_ref, as_key, image_planes, height, width, lines)
            status |= parsed
        else:
            bad_runs, payload = False, off  # stored raw
        if verify and status == 0:
            if _adler32(arena, off, nb, own_ref) != (np.int64(stored) & 0xFFFFFFFF):
                status |= BAD_CHECKSUM
        if bad_runs:
            status |= BAD_RUNS
        return status, payload
    if off < 0 or nb < 0 or off + nb > size:
        # Parsed as an empty row at 0, as the twin does, so its other reasons match.
        status |= BAD_BOUNDS
        off = 0
        nb = 0
    last = size - 1
    mode_bytes = (lines + 3) // 4
    bad_runs = False
    payload = off
    if nb != lines * width:
        n_runs = 0
        for line in range(lines):
            if _mode(arena, off, line, last) == _RUNS:
                n_runs += 1
        count_at = off + mode_bytes
        pos = off + mode_bytes + n_runs
        payload = pos
        # Line y of image plane q, advanced by next_line.
        y = 0
        q = 0
        for line in range(lines):
            mode = _mode(arena, off, line, last)
            has_plane_ref = not as_key and (own_ref >= 0 or q > 0)
            if mode == _UP:
                if y == 0:
                    status |= BAD_MODE
            elif mode == _REF:
                if not has_plane_ref:
                    status |= BAD_MODE
            elif mode == _RAW:
                pos += width
            else:
                count = _byte(arena, count_at, last)
                count_at += 1
                n = (count & 127) + 1
                if count >= 128 and not has_plane_ref:
                    status |= BAD_MODE
                if not bad_runs and not _runs_ok(arena, pos, n, width, last):
                    bad_runs = True
                pos += 2 * n - 1
            y, q = next_line(y, q, height, image_planes)
        if pos - off != nb:
            status |= BAD_LENGTH
    # The twin checks the checksum of the rows that passed everything but the run starts.
    if verify and status == 0:
        if _adler32(arena, off, nb, own_ref) != (np.int64(stored) & 0xFFFFFFFF):
            status |= BAD_CHECKSUM
    if bad_runs:
        status |= BAD_RUNS
    return status, payload


# Byte loops index with unsigned integers: a signed index makes Numba test it for wraparound
# (``a[-1]``), and that test keeps LLVM from vectorizing the loop (ten times slower here). They
# are inlined where called (``inline="always"``): as calls, they run about four times slower.
@njit(cache=True, nogil=True, inline="always")
def _copy(dst, d, src, s, n):  # pragma: no cover - compiled
    """``dst[d : d + n] = src[s : s + n]`` (the ranges do not overlap)."""
    d = np.uint64(d)
    s = np.uint64(s)
    for x in range(np.uint64(n)):
        dst[d + x] = src[s + x]


@njit(cache=True, nogil=True, inline="always")
def _fill(dst, d, value, n):  # pragma: no cover - compiled
    """``dst[d : d + n] = value``."""
    d = np.uint64(d)
    for x in range(np.uint64(n)):
        dst[d + x] = value


@njit(cache=True, nogil=True, inline="always")
def _fill_add(dst, d, value, src, s, n):  # pragma: no cover - compiled
    """``dst[d : d + n] = (value + src[s : s + n]) % 256``: a run of a residual line."""
    d = np.uint64(d)
    s = np.uint64(s)
    for x in range(np.uint64(n)):
        dst[d + x] = (value + src[s + x]) & 0xFF


_BYTES = np.uint64(0x0101010101010101)  # a byte times this: the byte in all eight places of a word
_EIGHT = np.uint64(8)
_THIRTY_TWO = np.uint64(32)


@njit(cache=True, nogil=True, inline="always")
def _copy_line(dst, d, src, s, n):  # pragma: no cover - compiled
    """``dst[d : d + n] = src[s : s + n]`` (no overlap), in 32-byte chunks (8-byte words below 32).

    The last chunk ends at ``n`` and may overlap the one before it: it rewrites the same bytes,
    so nothing outside the range is written.
    """
    d = np.uint64(d)
    s = np.uint64(s)
    n = np.uint64(n)
    if n >= _THIRTY_TWO:
        x = np.uint64(0)
        while x + _THIRTY_TWO < n:
            copy_wide(dst, d + x, src, s + x)
            x += _THIRTY_TWO
        copy_wide(dst, d + n - _THIRTY_TWO, src, s + n - _THIRTY_TWO)
        return
    if n < _EIGHT:
        _copy(dst, d, src, s, n)
        return
    x = np.uint64(0)
    while x + _EIGHT < n:
        store_word(dst, d + x, load_word(src, s + x))
        x += _EIGHT
    store_word(dst, d + n - _EIGHT, load_word(src, s + n - _EIGHT))


@njit(cache=True, nogil=True, inline="always")
def _fill_runs(arena, pos, values, n, dest, d, width, wide, residual, src, s):  # pragma: no cover - compiled
    """Writes a line of ``n`` runs at ``dest[d : d + width]``, and up to 31 bytes past it.

    A run is a fill, or for a residual line (``residual``) its value added to ``src[s ...]``.
    Each run is written in whole 32-byte stores from its start, so it spills up to 31 bytes past
    its end: into the next run, written after it, or past the line into the next lines of the
    row, decoded after it. Most runs are a few bytes, so one store, where a loop of the exact
    length cost a call or a mispredicted branch. The caller guarantees at least 32 bytes of the
    row after the line; then residual reads past the reference line stay inside its row too.
    """
    begin = np.uint64(0)
    zeros = np.uint64(0)
    w = np.uint64(width)
    for k in range(np.uint64(n)):
        if k + np.uint64(1) < np.uint64(n):
            low = np.uint64(arena[pos + k])
            if wide:
                if low == 0:
                    zeros += np.uint64(1)
                stop = zeros * np.uint64(256) + low
            else:
                stop = low
        else:
            stop = w
        value = arena[values + k]
        x = begin
        if residual:
            while True:
                add_wide(dest, d + x, src, s + x, value)
                x += _THIRTY_TWO
                if x >= stop:
                    break
        else:
            word = np.uint64(value) * _BYTES
            while True:
                store_wide(dest, d + x, word)
                x += _THIRTY_TWO
                if x >= stop:
                    break
        begin = stop


@njit(cache=True, nogil=True)
def _decode_row(arena, off, nb, payload, dest, d0, ref, r0, keyed, image_planes, height, width, lines):  # pragma: no cover
    """Decodes one verified row into ``dest[d0 : d0 + L * W]`` (byte planes in order).

    ``ref[r0 + l * W ...]`` is line ``l`` of the decoded reference row when ``keyed``; otherwise
    reference lines are read from ``dest`` itself (plane ``p - p % P0``, decoded before ``p``).
    Nothing outside the row is written: a line of runs may spill into the lines after it (see
    :func:`_fill_runs`), which are decoded later, and the lines within 32 bytes of the row's end
    are written exactly.
    """
    row_bytes = lines * width
    if nb == row_bytes:
        _copy(dest, d0, arena, off, row_bytes)
        return
    count_at = off + (lines + 3) // 4
    pos = payload
    wide = width > 256
    for line in range(lines):
        mode = (np.int64(arena[off + (line >> 2)]) >> ((line & 3) * 2)) & 3
        d = d0 + line * width
        if mode == _UP:
            _copy_line(dest, d, dest, d - width, width)
            continue
        if mode == _RAW:
            _copy_line(dest, d, arena, pos, width)
            pos += width
            continue
        if keyed:
            src = ref
            s = r0 + line * width
        else:
            src = dest
            s = d0 + (line - ((line // height) % image_planes) * height) * width
        if mode == _REF:
            _copy_line(dest, d, src, s, width)
            continue
        count = np.int64(arena[count_at])
        count_at += 1
        n = (count & 127) + 1
        values = pos + n - 1
        if (lines - 1 - line) * width >= 32:
            _fill_runs(
                arena, np.uint64(pos), np.uint64(values), n, dest, np.uint64(d), width, wide, count >= 128, src, np.uint64(s)
            )
            pos += 2 * n - 1
            continue
        begin = 0
        zeros = 0
        for k in range(n):
            if k + 1 < n:
                low = np.int64(arena[pos + k])
                if low == 0:
                    zeros += 1
                stop = zeros * 256 + low
            else:
                stop = width
            if count >= 128:
                # Residual: added, modulo 256, to the reference line.
                _fill_add(dest, d + begin, arena[values + k], src, s + begin, stop - begin)
            else:
                _fill(dest, d + begin, arena[values + k], stop - begin)
            begin = stop
        pos += 2 * n - 1


@njit(cache=True, nogil=True)
def _interleave(planes, out, o0, itemsize, image_planes, plane_bytes):  # pragma: no cover - compiled
    """Byte planes ``[s, P0, H * W]`` -> elements ``[P0, H * W, s]`` at ``out[o0:]`` (inverse of ``to_planes``)."""
    step = np.uint64(itemsize)
    for b in range(itemsize):
        for q in range(image_planes):
            src = np.uint64((b * image_planes + q) * plane_bytes)
            dst = np.uint64(o0 + q * plane_bytes * itemsize + b)
            for i in range(np.uint64(plane_bytes)):
                out[dst + i * step] = planes[src + i]


@njit(cache=True, nogil=True)
def _needed_rows(index, refs, has_refs, n_rows):  # pragma: no cover - compiled
    """The distinct needed rows, sorted, and each position's slots among them.

    Returns:
        ``(tab, row_slot, key, key_slot)``: ``key[b]`` is row ``index[b]``'s reference row (-1
        without a table of references), ``key_slot[b]`` its slot when it is a row (else -1).
    """
    n = index.shape[0]
    key = np.full(n, -1, np.int64)
    cand = np.empty(2 * n, np.int64)
    nc = 0
    for b in range(n):
        cand[nc] = index[b]
        nc += 1
        if has_refs:
            k = np.int64(refs[index[b]])
            key[b] = k
            if k >= 0 and k < n_rows:
                cand[nc] = k
                nc += 1
    if n_rows <= min(_DENSE_MARK_ROWS, _DENSE_MARKS_PER_ROW * nc + 65536):
        # Mark the rows in a byte per table row and read the marks back in order (a word at a
        # time: most are zero): tens of microseconds for a batch of 256 stacks, where sorting the candidates took hundreds.
        marks = np.zeros(n_rows + 8, np.uint8)
        for i in range(nc):
            marks[cand[i]] = 1
        tab = np.empty(nc, np.int64)
        t = 0
        for w in range(0, n_rows, 8):
            if load_word(marks, np.uint64(w)) != 0:
                for r in range(w, w + 8):
                    if marks[r]:
                        tab[t] = r
                        t += 1
        tab = tab[:t]
        slot_of = np.empty(n_rows, np.int32)  # only the marked entries are written, and read
        for i in range(t):
            slot_of[tab[i]] = i
        row_slot = np.empty(n, np.int64)
        key_slot = np.full(n, -1, np.int64)
        for b in range(n):
            row_slot[b] = slot_of[index[b]]
            k = key[b]
            if k >= 0 and k < n_rows:
                key_slot[b] = slot_of[k]
        return tab, row_slot, key, key_slot
    tab = np.unique(cand[:nc])
    row_slot = np.searchsorted(tab, index)
    key_slot = np.full(n, -1, np.int64)
    for b in range(n):
        k = key[b]
        if k >= 0 and k < n_rows:
            key_slot[b] = np.searchsorted(tab, k)
    return tab, row_slot, key, key_slot


@njit(cache=True, nogil=True)
def _positions_by_slot(row_slot, T):  # pragma: no cover - compiled
    """Each slot's positions as a linked list in position order.

    Returns:
        ``(first, dup_next)``: ``first[t]`` is the first position of slot ``t`` (-1 for none),
        ``dup_next[b]`` the next position of ``b``'s slot after ``b`` (-1 after the last).
    """
    n = row_slot.shape[0]
    first = np.full(T, -1, np.int64)
    dup_next = np.empty(n, np.int64)
    for b in range(n - 1, -1, -1):
        t = row_slot[b]
        dup_next[b] = first[t]
        first[t] = b
    return first, dup_next


@njit(cache=True, nogil=True)
def decode_rows(
    arena, offsets, lengths, checksums, refs, has_refs, index, out, image_planes, height, width, itemsize, verify, status
):  # pragma: no cover - compiled
    """Verifies the needed rows of a batch, then decodes rows ``index`` into ``out``.

    Args:
        arena: uint8 ``[A]``.
        offsets, lengths, checksums: the row table (``[R]`` each; int64, int32, int32).
        refs: int32 ``[R]`` reference rows (-1 for none); ignored unless ``has_refs``.
        has_refs: the table has references.
        index: int64 ``[B]`` row numbers.
        out: uint8 ``[B * L * W]``, the output rows' bytes (elements of ``itemsize`` bytes).
        image_planes, height, width, itemsize: the geometry (``P0, H, W, s``; ``L * W > 0``).
        verify: check checksums.
        status: int32 ``[B]``, receives each position's status bits (0 when it passed).

    Returns:
        ``DECODED``; ``CORRUPT`` when a position failed (see ``status``; ``out`` untouched);
        ``BAD_INDEX`` when an index is outside ``[0, R)`` (nothing read or written).
    """
    n = index.shape[0]
    n_rows = offsets.shape[0]
    for b in range(n):
        if index[b] < 0 or index[b] >= n_rows:
            return BAD_INDEX
    lines = itemsize * image_planes * height
    row_bytes = lines * width
    tab, row_slot, key, key_slot = _needed_rows(index, refs, has_refs, n_rows)
    T = tab.shape[0]
    as_key = np.zeros(T, np.bool_)
    for b in range(n):
        if key_slot[b] >= 0:
            as_key[key_slot[b]] = True
    t_status = np.zeros(T, np.int64)
    payload = np.zeros(T, np.int64)
    for t in range(T):
        r = tab[t]
        own = np.int64(refs[r]) if has_refs else np.int64(-1)
        t_status[t], payload[t] = _check_row(
            arena, offsets[r], np.int64(lengths[r]), own, as_key[t], checksums[r], image_planes, height, width, lines, verify
        )
    failed = False
    for b in range(n):
        s = t_status[row_slot[b]]
        if key[b] >= n_rows:
            s |= BAD_REFERENCE
        elif key_slot[b] >= 0:
            s |= t_status[key_slot[b]]
        status[b] = s
        if s != 0:
            failed = True
    if failed:
        return CORRUPT

    # Decode each distinct sampled row once, in row order, into the first position that holds it.
    first, dup_next = _positions_by_slot(row_slot, T)
    cache_rows = max(1, min(_KEY_CACHE_ROWS, _KEY_CACHE_BYTES // row_bytes))
    cache = np.empty(cache_rows * row_bytes if has_refs else 0, np.uint8)
    cache_tag = np.full(cache_rows, -1, np.int64)
    planes = np.empty(row_bytes if itemsize > 1 else 0, np.uint8)
    plane_bytes = height * width
    for t in range(T):
        b = first[t]
        if b < 0:
            continue  # a reference row only
        r = tab[t]
        k = np.int64(refs[r]) if has_refs else np.int64(-1)
        keyed = k >= 0
        src = cache
        c0 = 0
        if keyed:
            ks = key_slot[b]  # (row r's reference row is k: a row of the table, found above)
            if itemsize == 1 and ks < t and first[ks] >= 0:
                # A sampled reference row already decoded (rows go in order): read it there.
                src = out
                c0 = first[ks] * row_bytes
            else:
                c = k % cache_rows
                c0 = c * row_bytes
                if cache_tag[c] != k:
                    _decode_row(
                        arena, offsets[k], np.int64(lengths[k]), payload[ks], cache, c0, cache, c0,
                        False, image_planes, height, width, lines,
                    )
                    cache_tag[c] = k
        if itemsize == 1:
            _decode_row(
                arena, offsets[r], np.int64(lengths[r]), payload[t], out, b * row_bytes, src, c0, keyed,
                image_planes, height, width, lines,
            )
        else:
            _decode_row(
                arena, offsets[r], np.int64(lengths[r]), payload[t], planes, 0, src, c0, keyed,
                image_planes, height, width, lines,
            )
            _interleave(planes, out, b * row_bytes, itemsize, image_planes, plane_bytes)
        # Duplicates copy the row now, while it is still in the cache.
        d = dup_next[b]
        while d >= 0:
            _copy(out, d * row_bytes, out, b * row_bytes, row_bytes)
            d = dup_next[d]
    return DECODED
