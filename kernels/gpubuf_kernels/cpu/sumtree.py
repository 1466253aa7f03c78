"""Sum-tree update, descent and checks as compiled CPU loops.

The tree layout is :class:`gpubuf.ops.sumtree.SumTree`'s: ``leaves`` (float32 or float64),
``sums`` and ``mins`` (float64, internal levels concatenated), ``offsets`` (int64, the start of
each internal level and their total length) and ``sizes`` (int64, ``m_0 .. m_D``). The torch
twins in :mod:`gpubuf.ops.sumtree` are the specification; these kernels follow them step for
step, so the results are equal bit for bit:

* a node's sum is its children added left to right in float64 (what ``torch.cumsum`` does on
  a CPU row), its minimum the smallest positive child (``+inf`` when none);
* the descent applies the twin's full child rule at every level.

Two numbers come from the C library's ``pow`` where the twins use ``torch.pow`` (the two agree
to an ulp of ``float64``, before rounding): the importance weights of :func:`draw` and the
transformed priorities ``(p + eps) ** alpha`` that :func:`update` writes. Rounded to ``float32``
leaves, the transforms are the twins' but for a value within an ulp of ``float64`` of a
rounding boundary (about one in 2**29). Every other result follows the twins' rules bit for bit
from the leaves, and internal nodes are always recomputed from the leaves.

No ``fastmath``: it would let LLVM reorder the additions, and the sums would stop matching.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from gpubuf_kernels.cpu.prefetch import LINE_BYTES, prefetch_line

_INF = np.inf


@njit(cache=True, nogil=True)
def weights(values, p_min, beta, out):  # pragma: no cover - compiled
    """Importance weights ``out[b] = (float64(values[b]) / p_min) ** (-beta)``, rounded to ``out``'s dtype."""
    for b in range(values.shape[0]):
        out[b] = (np.float64(values[b]) / p_min) ** (-beta)


#: Status codes of :func:`update`; nothing is written unless it returns ``UPDATED``.
UPDATED = 0
BAD_PRIORITY = 1
OVERFLOW = 2
BAD_INDEX = 3

#: Leaf indices sorted with one insertion pass below this many, by a radix sort from it on.
RADIX_SORT_FROM = 64
#: The refresh prefetches the rows of the parent this many places ahead of the one it is at.
PREFETCH_AHEAD = 16


@njit(cache=True, nogil=True)
def update(leaves, sums, mins, offsets, sizes, shift, index, priority, alpha, eps, limit, max_priority):  # pragma: no cover
    """A whole priority update in one call: check, write the leaves, refresh the ancestors, track the maximum.

    Every check runs before the first write, so a failed call changes nothing. The work is
    ``O(B * F * depth)`` at any capacity: each distinct ancestor of a written leaf is recomputed
    once from its children, and the only scratch is allocated for the call and sized by ``B``.

    Args:
        leaves, sums, mins: the tree, mutated.
        offsets, sizes: the tree's geometry (int64): level offsets in ``sums``/``mins`` and
            ``m_0 .. m_D``.
        shift: ``log2(fanout)``.
        index: ``[B]`` integer leaf indices; negative ones are skipped.
        priority: ``[B]`` or ``[1]`` raw priorities, any real dtype (checked, and their largest
            tracked).
        alpha, eps: the transform ``(p + eps) ** alpha`` the leaves get, computed in float64 and
            rounded to the leaf dtype (IEEE round to nearest, what torch's cast does).
        limit: every index must be below it.
        max_priority: float64 ``[1]``, the running maximum of the raw priorities given to a
            non-negative index; raised in place to this batch's largest.

    Returns:
        :data:`UPDATED`, or the first failed check: :data:`BAD_PRIORITY` (a NaN, infinite or
        negative priority), :data:`OVERFLOW` (a transform past the leaf dtype),
        :data:`BAD_INDEX` (an index ``>= limit``).
    """
    n = priority.shape[0]
    for b in range(n):
        p = np.float64(priority[b])
        # NaN fails both comparisons.
        if not (p >= 0.0 and p < _INF):
            return BAD_PRIORITY
    rounded = np.empty(n, leaves.dtype)
    for b in range(n):
        rounded[b] = (np.float64(priority[b]) + eps) ** alpha
        if not (rounded[b] < _INF):
            return OVERFLOW
    one_value = n == 1
    batch_max = -_INF
    for b in range(index.shape[0]):
        i = index[b]
        if i >= limit:
            return BAD_INDEX
        if i >= 0:
            p = np.float64(priority[0] if one_value else priority[b])
            if p > batch_max:
                batch_max = p
    if batch_max > max_priority[0]:
        max_priority[0] = batch_max
    # Writing in call order is the last-wins rule.
    keys = np.empty(index.shape[0], np.int64)
    count = 0
    for b in range(index.shape[0]):
        i = index[b]
        if i >= 0:
            leaves[i] = rounded[0] if one_value else rounded[b]
            keys[count] = i
            count += 1
    _refresh_ancestors(leaves, sums, mins, offsets, sizes, shift, _sort_leaves(keys[:count]))
    return UPDATED


@njit(cache=True, nogil=True)
def _sort_leaves(keys):  # pragma: no cover - compiled
    """``keys`` (int64, non-negative) in increasing order: sorted in place, or a new array.

    Keys already in order (contiguous writes) are returned as they are. Otherwise a
    least-significant-digit radix sort over the span of the keys: ``O(B)`` per pass with a digit
    of about ``log2(B)`` bits (a count table the size of the batch), two passes for 65,536
    indices into 2**26 leaves; small batches take one insertion pass.
    """
    count = keys.shape[0]
    # No early exit: without a branch the compiler vectorizes the check.
    unordered = False
    for c in range(1, count):
        unordered |= keys[c] < keys[c - 1]
    if not unordered:
        return keys
    if count < RADIX_SORT_FROM:
        for c in range(1, count):
            key = keys[c]
            d = c
            while d > 0 and keys[d - 1] > key:
                keys[d] = keys[d - 1]
                d -= 1
            keys[d] = key
        return keys
    lo = keys[0]
    hi = keys[0]
    for c in range(count):
        lo = min(lo, keys[c])
        hi = max(hi, keys[c])
    span_bits = 1
    while (hi - lo) >> span_bits:
        span_bits += 1
    digit_bits = 1
    while (1 << (digit_bits + 1)) <= count:
        digit_bits += 1
    passes = (span_bits + digit_bits - 1) // digit_bits
    digit_bits = (span_bits + passes - 1) // passes  # the same passes, digits as even as they come
    mask = (1 << digit_bits) - 1
    counts = np.empty(1 << digit_bits, np.int64)
    other = np.empty(count, np.int64)
    for p in range(passes):
        at = p * digit_bits
        counts[:] = 0
        for c in range(count):
            counts[((keys[c] - lo) >> at) & mask] += 1
        total = 0
        for d in range(mask + 1):
            size = counts[d]
            counts[d] = total
            total += size
        for c in range(count):
            d = ((keys[c] - lo) >> at) & mask
            other[counts[d]] = keys[c]
            counts[d] += 1
        keys, other = other, keys
    return keys


@njit(inline="always")
def _leaf_row(leaves, row, fanout):  # pragma: no cover - compiled
    """Sum (float64, left to right) and positive minimum (``+inf`` if none) of a leaf row.

    The minimum is a select, not a branch: random values mispredict the branch of an ``if``
    (measured side by side: 0.87 times the time of the refresh at 2**20 leaves and 65,536
    indices). Unsigned positions spare every load Numba's test for a negative index. One row at
    a time: the processor overlaps the chains of additions of consecutive rows by itself (four
    rows side by side measured 1.1 times the time).
    """
    total = 0.0
    least = _INF
    for t in range(np.uint64(fanout)):
        x = np.float64(leaves[row + t])
        total += x
        least = min(least, x if x > 0.0 else _INF)
    return total, least


@njit(inline="always")
def _refresh_node(sums, mins, offsets, k, node, fanout):  # pragma: no cover - compiled
    """Recomputes node ``node`` of internal level ``k`` (``k`` below ``depth - 1``) from its children's row."""
    row = np.uint64(offsets[k + 1] + node * fanout)
    total = 0.0
    least = _INF
    for t in range(np.uint64(fanout)):
        total += sums[row + t]
        least = min(least, mins[row + t])
    sums[offsets[k] + node] = total
    mins[offsets[k] + node] = least


@njit(inline="always")
def _prefetch_span(address, nbytes):  # pragma: no cover - compiled
    """Prefetches every cache line of ``nbytes`` bytes from ``address``."""
    line = address - (address & (LINE_BYTES - 1))
    end = address + nbytes
    while line < end:
        prefetch_line(line)
        line += LINE_BYTES


@njit(cache=True, nogil=True)
def _refresh_ancestors(leaves, sums, mins, offsets, sizes, shift, keys):  # pragma: no cover - compiled
    """Recomputes, once each, every ancestor of the leaves ``keys`` (int64, in increasing order;
    overwritten: the scratch of the pass).

    First the distinct parents of the leaves, in order (a contiguous write has one per row).
    Then one pass over them, finishing each node in post-order: a parent of leaves is recomputed
    when it comes up, a higher node once the next parent lies outside its subtree (every child
    it has is final by then). So each row is read once, in increasing order of address, while
    the entries just written to it are still in the cache, and no scratch tracks which nodes are
    done. The rows of the parent :data:`PREFETCH_AHEAD` places on (its leaf row, and the row of
    nodes it is in) are prefetched: their misses overlap with the work on the rows before them.

    Measured side by side for 65,536 random indices, against the former refresh (level by
    level, parents in first-seen order deduplicated by a hash set, a first pass of loads): the
    whole update takes 0.21 times the time on 2**24 leaves, 0.18 on 2**26, 0.86 on 2**20; a
    contiguous write of 16,384 or 2**20 entries 0.87 to 1.0. Without the prefetches this pass
    takes 2.2 (2**24) and 3 (2**26) times as long.
    """
    fanout = 1 << shift
    depth = sizes.shape[0] - 1
    count = 0
    last = np.int64(-1)
    for c in range(keys.shape[0]):
        j = keys[c] >> shift
        if j != last:
            keys[count] = j
            count += 1
            last = j
    # current[k]: the node of level k whose subtree the pass is in (-1: none yet), k < depth - 1.
    current = np.full(depth, -1, np.int64)
    leaf_base = leaves.ctypes.data
    leaf_row_bytes = fanout * leaves.itemsize
    node_row_bytes = fanout * 8
    sums_base = sums.ctypes.data
    mins_base = mins.ctypes.data
    parents = offsets[depth - 1]
    for c in range(count):
        if c + PREFETCH_AHEAD < count:
            ahead = keys[c + PREFETCH_AHEAD]
            _prefetch_span(leaf_base + ahead * leaf_row_bytes, leaf_row_bytes)
            row = (parents + ((ahead >> shift) << shift)) * 8
            _prefetch_span(sums_base + row, node_row_bytes)
            _prefetch_span(mins_base + row, node_row_bytes)
        j = keys[c]
        node = j
        for k in range(depth - 2, -1, -1):
            node >>= shift
            if current[k] == node:
                break
            if current[k] >= 0:
                _refresh_node(sums, mins, offsets, k, current[k], fanout)
            current[k] = node
        total, least = _leaf_row(leaves, np.uint64(j * fanout), fanout)
        sums[parents + j] = total
        mins[parents + j] = least
    for k in range(depth - 2, -1, -1):
        if current[k] >= 0:
            _refresh_node(sums, mins, offsets, k, current[k], fanout)


#: A level's prefix sums are computed once per call, into a table, when the batch has at least
#: this many draws per row of the level: each draw then compares precomputed sums instead of
#: waiting on a chain of dependent additions (the descent's main cost for large batches). From 4
#: (measured side by side against 8: 0.92 times the time of a draw of 65,536 on 2**24 leaves,
#: 0.88 for 4,096 on 2**20, the same elsewhere); with 1 the table of a level of 2**16 rows costs
#: more than the 65,536 scans it spares.
TABLE_DRAWS_PER_ROW = 4


@njit(cache=True, nogil=True)
def _prefix_tables(sums, offsets, sizes, fanout, n):  # pragma: no cover - compiled
    """The inclusive prefix sums of every row of the internal levels worth a table for ``n`` draws.

    Returns ``(tabled, table)``: ``tabled[k]`` says whether level ``k`` (``1 .. depth - 1``) has
    one (:data:`TABLE_DRAWS_PER_ROW`); ``table`` is indexed as ``sums``. Allocated per call, so
    that concurrent samplers of one tree share no scratch.
    """
    depth = sizes.shape[0] - 1
    tabled = np.zeros(depth + 1, np.bool_)
    table = np.empty(offsets[depth] if n else 0, np.float64)
    for k in range(1, depth):
        rows = sizes[k - 1]
        if n >= TABLE_DRAWS_PER_ROW * rows:
            tabled[k] = True
            for r in range(rows):
                row = offsets[k] + r * fanout
                csum = 0.0
                for c in range(fanout):
                    csum += sums[row + c]
                    table[row + c] = csum
    return tabled, table


@njit(inline="always")
def _last_positive(src, row, fanout):  # pragma: no cover - compiled
    """The last positive entry of ``src[row : row + fanout]`` and the prefix sum before it (0, 0.0 if none)."""
    child = 0
    before = 0.0
    csum = 0.0
    for c in range(fanout):
        x = np.float64(src[row + c])
        if x > 0.0:
            child = c
            before = csum
        csum += x
    return child, before


#: Draws whose rows :func:`_scan_rows` scans side by side.
SCAN_LANES = 4
#: A descent's scan prefetches the rows of the draws this many places ahead of it.
DESCENT_PREFETCH_AHEAD = 32


@njit(inline="always")
def _scan_rows(src, rows, masses, fanout, counts, csums):  # pragma: no cover - compiled
    """For each of :data:`SCAN_LANES` rows: ``#{c : csum[c] <= mass}`` over its inclusive float64 prefix sums.

    ``counts[i]`` receives lane ``i``'s count and ``csums[i, :fanout]`` its prefix sums, added
    left to right (the twin's order), so the prefix before the chosen child is
    ``csums[i, counts[i] - 1]``.

    No branch depends on the data. Keeping the last prefix at or below the mass in a register
    (``before = csum if below else before``) compiles to a branch, which mispredicts once per
    row where the prefix passes the mass, and the processor discards the rows it had run ahead
    into; storing every prefix costs one store each. Four rows side by side interleave four
    chains of dependent additions. (Measured side by side on 2**20 float32 leaves, for a whole
    :func:`draw` of 256: 0.6 to 0.7 times the time of one-row scans with the select.) Unsigned
    positions spare every load Numba's test for a negative index.
    """
    r0 = np.uint64(rows[0])
    r1 = np.uint64(rows[1])
    r2 = np.uint64(rows[2])
    r3 = np.uint64(rows[3])
    m0 = masses[0]
    m1 = masses[1]
    m2 = masses[2]
    m3 = masses[3]
    c0 = 0.0
    c1 = 0.0
    c2 = 0.0
    c3 = 0.0
    n0 = 0
    n1 = 0
    n2 = 0
    n3 = 0
    for c in range(np.uint64(fanout)):
        c0 += np.float64(src[r0 + c])
        c1 += np.float64(src[r1 + c])
        c2 += np.float64(src[r2 + c])
        c3 += np.float64(src[r3 + c])
        csums[0, c] = c0
        csums[1, c] = c1
        csums[2, c] = c2
        csums[3, c] = c3
        n0 += c0 <= m0
        n1 += c1 <= m1
        n2 += c2 <= m2
        n3 += c3 <= m3
    counts[0] = n0
    counts[1] = n1
    counts[2] = n2
    counts[3] = n3


@njit(inline="always")
def _descend_level(src, base, fanout, mass, node, rows, masses, counts, csums):  # pragma: no cover - compiled
    """One untabled level of :func:`descend`: every draw's row scanned, its child and mass updated.

    Draws go :data:`SCAN_LANES` at a time; a last, partial group repeats its final draw in the
    spare lanes and keeps only the real ones. Each group first prefetches the rows of the group
    :data:`DESCENT_PREFETCH_AHEAD` draws on. (Measured side by side at B = 65,536 against a
    first pass that loaded one entry per cache line of every row: 0.49 times the time of a whole
    descent on 2**24 leaves, 0.36 on 2**26, the same on 2**20, where the leaves fit the cache.)
    """
    n = mass.shape[0]
    row_bytes = fanout * src.itemsize
    level_start = src.ctypes.data + base * src.itemsize
    for first in range(0, n, SCAN_LANES):
        for b in range(first + DESCENT_PREFETCH_AHEAD, min(first + DESCENT_PREFETCH_AHEAD + SCAN_LANES, n)):
            _prefetch_span(level_start + node[b] * row_bytes, row_bytes)
        lanes = min(SCAN_LANES, n - first)
        for i in range(SCAN_LANES):
            b = first + min(i, lanes - 1)
            rows[i] = base + node[b] * fanout
            masses[i] = mass[b]
        _scan_rows(src, rows, masses, fanout, counts, csums)
        for i in range(lanes):
            count = counts[i]
            if count < fanout:
                child = count
                before = csums[i, count - 1] if count else 0.0
            else:
                child, before = _last_positive(src, rows[i], fanout)
            mass[first + i] = masses[i] - before
            node[first + i] = node[first + i] * fanout + child


@njit(cache=True, nogil=True)
def descend(leaves, sums, offsets, sizes, shift, uniforms, stratified, order, out_index, out_value):  # pragma: no cover
    """Descends ``B`` masses from the root, all draws one level at a time; fills ``out_index`` (int64)
    and ``out_value`` (leaf dtype).

    Masses: ``uniforms[b] * total``, or ``(uniforms[b] + b) * (total / B)`` when stratified.
    At each node, with ``csum`` the inclusive float64 prefix sums of its children (added left
    to right, the twin's order), the child is ``count = #{c : csum[c] <= mass}`` (the first
    prefix sum past the mass belongs to a positive child), or the last positive child when
    ``count`` is the whole row; the mass loses ``csum[count - 1]``. That is the twin's rule.

    Level by level, the rows the draws read next are known before any is scanned, so the scan
    prefetches the rows of the draws :data:`DESCENT_PREFETCH_AHEAD` places on: their misses
    overlap with the scans before them, where a draw-by-draw descent waits for each miss in
    turn. Levels with a prefix table (:data:`TABLE_DRAWS_PER_ROW`) compare precomputed sums
    instead.

    Draws are taken in the order ``order`` gives (int64 ``[B]``, a permutation, or empty for
    ``0 .. B - 1``); results land at each draw's own position, so the order changes no result.
    In (nearly) increasing order of mass, neighbouring draws read the same or nearby rows: the
    cache and the TLB serve most of a level's reads. Measured side by side at B = 65,536
    against a draw-by-draw descent in mass order that resumed each node's scan: 0.5 times the
    time on 2**20 leaves, 0.7 on 2**24, 0.55 on 2**26; at B = 4,096 on 2**24 leaves, 0.07.
    """
    n = uniforms.shape[0]
    in_order = order.shape[0] == 0
    fanout = 1 << shift
    depth = sizes.shape[0] - 1
    total = sums[0]
    step = total / n if n else 0.0
    tabled, table = _prefix_tables(sums, offsets, sizes, fanout, n)
    mass = np.empty(n, np.float64)
    node = np.zeros(n, np.int64)
    # Scratch of the untabled levels' scans (see _scan_rows).
    rows = np.empty(SCAN_LANES, np.int64)
    masses = np.empty(SCAN_LANES, np.float64)
    counts = np.empty(SCAN_LANES, np.int64)
    csums = np.empty((SCAN_LANES, fanout), np.float64)
    for i in range(n):
        b = i if in_order else order[i]
        mass[i] = (uniforms[b] + np.float64(b)) * step if stratified else uniforms[b] * total
    for k in range(1, depth + 1):
        leaf = k == depth
        base = 0 if leaf else offsets[k]
        if tabled[k]:
            for b in range(n):
                m = mass[b]
                row = base + node[b] * fanout
                count = 0
                start = np.uint64(row)
                for c in range(np.uint64(fanout)):
                    count += table[start + c] <= m
                if count < fanout:
                    child = count
                    before = table[row + count - 1] if count else 0.0
                else:
                    child, before = _last_positive(sums, row, fanout)
                mass[b] = m - before
                node[b] = node[b] * fanout + child
            continue
        if leaf:
            _descend_level(leaves, base, fanout, mass, node, rows, masses, counts, csums)
        else:
            _descend_level(sums, base, fanout, mass, node, rows, masses, counts, csums)
    for i in range(n):
        b = i if in_order else order[i]
        out_index[b] = node[i]
        out_value[b] = leaves[node[i]]


@njit(cache=True, nogil=True)
def draw(leaves, sums, mins, offsets, sizes, shift, uniforms, stratified, in_mass_order, order, beta, out_index, out_value, out_weight):  # pragma: no cover
    """A whole draw in one call: the descent, then (when asked) the importance weights.

    Args:
        leaves, sums, mins, offsets, sizes, shift: the tree (only read).
        uniforms: float64 ``[B]`` draws in ``[0, 1)``.
        stratified: masses ``(u_b + b) * total / B`` instead of ``u_b * total``.
        in_mass_order: descend the draws in (nearly) increasing order of mass (large batches:
            neighbouring draws share rows), else in draw order (small batches).
        order: int64 ``[B]``, the order to descend the draws in, or ``[0]``: draw order, or with
            ``in_mass_order`` i.i.d. draws in order of their bucket of ``B`` equal slices of
            ``[0, 1)`` (:func:`_bucket_order`; stratified masses increase already).
        beta: the importance exponent.
        out_index: int64 ``[B]``, receives the leaf indices.
        out_value: ``[B]`` in the leaf dtype, receives the leaf values.
        out_weight: ``[B]`` in the leaf dtype, receives ``(value_b / p_min) ** (-beta)`` with
            ``p_min`` the root's minimum (the C library's ``pow``: within an ulp of
            ``torch.pow``'s float64 result, before rounding); or ``[0]`` for no weights.
    """
    if in_mass_order and order.shape[0] == 0 and not stratified:
        order = _bucket_order(uniforms)
    descend(leaves, sums, offsets, sizes, shift, uniforms, stratified, order, out_index, out_value)
    if out_weight.shape[0]:
        weights(out_value, mins[0], beta, out_weight)


@njit(cache=True, nogil=True)
def _bucket_order(uniforms):  # pragma: no cover - compiled
    """The draws in order of their bucket ``floor(u * B)``, stably: a counting sort, ``O(B)``.

    Nearly increasing masses are all :func:`descend` needs: any order gives the same results,
    and draws of one bucket (about one each) read the same rows as their neighbours. No torch sort:
    on a busy 2-core machine a parallel sort stalls waiting for its second thread.
    """
    n = uniforms.shape[0]
    start = np.zeros(n + 1, np.int64)
    for b in range(n):
        k = min(np.int64(uniforms[b] * n), n - 1)
        start[k + 1] += 1
    for k in range(n):
        start[k + 1] += start[k]
    order = np.empty(n, np.int64)
    for b in range(n):
        k = min(np.int64(uniforms[b] * n), n - 1)
        order[start[k]] = b
        start[k] += 1
    return order
