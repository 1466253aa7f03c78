"""Sum-tree update, descent and checks as compiled CPU loops.

The tree layout is :class:`gpubuf.ops.sumtree.SumTree`'s: ``leaves`` (float32 or float64),
``sums`` and ``mins`` (float64, internal levels concatenated), ``offsets`` (int64, the start of
each internal level and their total length) and ``sizes`` (int64, ``m_0 .. m_D``). The torch
twins in :mod:`gpubuf.ops.sumtree` are the specification; these kernels follow them step for
step, so the results are equal bit for bit:

* a node's sum is its children added left to right in float64 (what ``torch.cumsum`` does on
  a CPU row), its minimum the smallest positive child (``+inf`` when none);
* the descent applies the twin's full child rule at every level.

No ``fastmath``: it would let LLVM reorder the additions, and the sums would stop matching.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_INF = np.inf


@njit(cache=True, nogil=True)
def scan_update(index, priority, values, limit):  # pragma: no cover - compiled
    """One pass over an update's input before anything is written.

    Args:
        index: int64 ``[B]``.
        priority: float64 ``[B]`` or ``[1]``, raw priorities.
        values: leaf dtype, their transforms.
        limit: indices must be below it.

    Returns:
        False when a priority is NaN, infinite or negative, a transform is not finite, or an
        index is ``>= limit`` (the caller then finds out which); True otherwise.
    """
    for b in range(priority.shape[0]):
        p = priority[b]
        # NaN fails both comparisons.
        if not (p >= 0.0 and p < _INF):
            return False
    for b in range(values.shape[0]):
        if not (values[b] < _INF):
            return False
    for b in range(index.shape[0]):
        if index[b] >= limit:
            return False
    return True


@njit(cache=True, nogil=True)
def update(leaves, sums, mins, offsets, sizes, shift, index, values, marks):  # pragma: no cover - compiled
    """Writes ``values`` at ``index`` in call order, then recomputes every ancestor once.

    Writing in call order is the last-wins rule. Negative indices are skipped. ``marks``
    (uint8, one per internal entry, all zero) flags the nodes already queued at a level; every
    flag set is cleared again before returning.

    Args:
        leaves, sums, mins: the tree, mutated.
        offsets, sizes: the tree's geometry (int64).
        shift: ``log2(fanout)``.
        index: int64 ``[B]`` in ``[0, capacity)`` or negative.
        values: ``[B]`` or ``[1]`` (one for all), the leaf dtype.
        marks: uint8 scratch ``[len(sums)]``, zero on entry and on return.
    """
    n = index.shape[0]
    fanout = 1 << shift
    depth = sizes.shape[0] - 1
    one_value = values.shape[0] == 1
    for b in range(n):
        i = index[b]
        if i >= 0:
            leaves[i] = values[0] if one_value else values[b]
    # Level by level from the leaves' parents up: queue each distinct parent once.
    nodes = np.empty(n, np.int64)
    k = depth - 1
    base = offsets[k]
    count = 0
    for b in range(n):
        i = index[b]
        if i >= 0:
            j = i >> shift
            if marks[base + j] == 0:
                marks[base + j] = 1
                nodes[count] = j
                count += 1
    while True:
        for c in range(count):
            j = nodes[c]
            marks[base + j] = 0
            total = 0.0
            smallest = _INF
            if k == depth - 1:
                row = j * fanout
                for t in range(fanout):
                    x = np.float64(leaves[row + t])
                    total += x
                    if x > 0.0 and x < smallest:
                        smallest = x
            else:
                row = offsets[k + 1] + j * fanout
                for t in range(fanout):
                    total += sums[row + t]
                    if mins[row + t] < smallest:
                        smallest = mins[row + t]
            sums[base + j] = total
            mins[base + j] = smallest
        if k == 0:
            return
        k -= 1
        base = offsets[k]
        queued = 0
        for c in range(count):
            j = nodes[c] >> shift
            if marks[base + j] == 0:
                marks[base + j] = 1
                nodes[queued] = j  # queued <= c: overwrites an entry already read
                queued += 1
        count = queued


#: A level's prefix sums are computed once per call, into a table, when the batch has at least
#: this many draws per row of the level: each draw then compares precomputed sums instead of
#: waiting on a chain of dependent additions (the descent's main cost for large batches).
TABLE_DRAWS_PER_ROW = 8


@njit(cache=True, nogil=True)
def sample(leaves, sums, offsets, sizes, shift, uniforms, stratified, order, out_index, out_value):  # pragma: no cover
    """Descends ``B`` masses from the root; fills ``out_index`` (int64) and ``out_value`` (leaf dtype).

    Masses: ``uniforms[b] * total``, or ``(uniforms[b] + b) * (total / B)`` when stratified.
    Draws are taken in the order ``order`` gives (int64 ``[B]``, a permutation, or empty for
    ``0 .. B - 1``); results land at each draw's own position. In increasing order of mass,
    consecutive descents read the same rows, which keeps a large batch in cache.
    At each node, with ``csum`` the inclusive float64 prefix sums of its children, the child is
    the first positive one whose ``csum`` exceeds the mass, else the last positive one, else 0;
    the mass loses the children before it. (``csum`` is non-decreasing, so "exceeds the mass"
    is "at or after ``#{c : csum[c] <= mass}``", the twin's wording.) Prefix sums come from a
    per-call table (:data:`TABLE_DRAWS_PER_ROW`) or are added up on the way; both add left to
    right, so they are the same numbers.

    A draw whose node at a level is the previous draw's, with a residual mass at least as large,
    resumes that node's scan at the previous draw's child (the prefix sum before it is kept):
    every positive child before it has a prefix sum at most the previous mass, so it fails this
    draw too, and the scan reaches the child a full scan would, through the same additions. A
    mass past the row's total still gets the row's last positive child: the resumed scan starts
    at a positive child, so it sees that one. In increasing order of mass (large batches) most
    draws resume at every level.
    """
    n = uniforms.shape[0]
    fanout = 1 << shift
    depth = sizes.shape[0] - 1
    total = sums[0]
    step = total / n if n else 0.0
    in_order = order.shape[0] == 0
    # Tables of the internal levels worth one (indexed as ``sums``); allocated per call, so
    # that concurrent samplers of one tree share no scratch.
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
    # Per level, the last draw that found its child there: node, child, prefix before it, mass.
    seen_node = np.full(depth + 1, -1, np.int64)
    seen_child = np.zeros(depth + 1, np.int64)
    seen_before = np.zeros(depth + 1, np.float64)
    seen_mass = np.zeros(depth + 1, np.float64)
    for i in range(n):
        b = i if in_order else order[i]
        if stratified:
            mass = (uniforms[b] + np.float64(b)) * step
        else:
            mass = uniforms[b] * total
        node = 0
        for k in range(1, depth + 1):
            resume = node == seen_node[k] and mass >= seen_mass[k]
            start = seen_child[k] if resume else 0
            child = 0
            before = 0.0
            last = -1
            last_before = 0.0
            if tabled[k]:
                row = offsets[k] + node * fanout
                for c in range(start, fanout):
                    if sums[row + c] > 0.0:
                        if table[row + c] > mass:
                            child = c
                            before = table[row + c - 1] if c else 0.0
                            last = -2  # found
                            break
                        last = c
                        last_before = table[row + c - 1] if c else 0.0
            else:
                csum = seen_before[k] if resume else 0.0
                for c in range(start, fanout):
                    if k == depth:
                        x = np.float64(leaves[node * fanout + c])
                    else:
                        x = sums[offsets[k] + node * fanout + c]
                    prev = csum
                    csum += x
                    if x > 0.0:
                        if csum > mass:
                            child = c
                            before = prev
                            last = -2  # found
                            break
                        last = c
                        last_before = prev
            if last >= 0:
                child = last
                before = last_before
            elif last == -2:
                seen_node[k] = node
                seen_child[k] = child
                seen_before[k] = before
                seen_mass[k] = mass
            mass -= before
            node = node * fanout + child
        out_index[b] = node
        out_value[b] = leaves[node]
