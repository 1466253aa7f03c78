"""The slice-window draws as compiled CPU loops (see ``gpubuf.ops.slice_windows`` and ``gpubuf.ops.sumtree_windows``)."""

from __future__ import annotations

import numpy as np
from numba import njit

from gpubuf_kernels.cpu.sumtree import descend


@njit(cache=True, nogil=True)
def slice_windows(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, done, terminated, init,
                  has_done, has_terminated, has_init, rows, marks):  # pragma: no cover - compiled
    """Fills ``rows[s * L + j]`` with the rows of slice ``s``'s window and ``marks[:, s * L + j]``
    with its marks (truncated, done, terminated, init); the twin's results.

    ``front`` and ``back`` are int64 arrays of one element (the eligible ring's ends); ``done``,
    ``terminated``, ``init`` are bool arrays of the stored flags per physical row, read only where
    the matching ``has_*`` is True.

    The table reads come in passes over all slices, each pass's loads independent of one another
    (the ring slot, then the trajectory's bounds and each window's first flags): a large storage's
    tables miss the cache at every slice, and a pass overlaps those misses where one loop per
    slice would wait for each in turn.
    """
    s_total = uniforms.shape[0] // 2
    front0 = front[0]
    count = back[0] - front0
    if count <= 0:  # an empty ring: no window (the twin's -1 rows and False marks)
        rows[:] = -1
        marks[:, :] = False
        return
    first = np.empty(s_total, np.int64)
    for s in range(s_total):
        # A float64 product cast to int64: the twin's floor for non-negative values.
        k = int(uniforms[s] * count)
        first[s] = slots[(k + front0) % capacity] % capacity
    # Each window's flags at its first step (the line most of its steps share).
    head = np.zeros((3, s_total), np.bool_)
    for s in range(s_total):
        slot = first[s]
        a = start[slot]
        if a < lower:
            a = lower
        length = stop[slot] - a + 1
        a += int(uniforms[s_total + s] * (length - (seq_length - 1)))
        first[s] = a
        row = a % capacity
        head[0, s] = has_done and done[row]
        head[1, s] = has_terminated and terminated[row]
        head[2, s] = has_init and init[row]
    for s in range(s_total):
        base = s * seq_length
        a = first[s]
        for j in range(seq_length):
            i = base + j
            row = (a + j) % capacity
            rows[i] = row
            last = j == seq_length - 1
            marks[0, i] = last
            if j == 0:
                marks[1, i] = last or head[0, s]
                marks[2, i] = head[1, s]
                marks[3, i] = True
            else:
                marks[1, i] = last or (has_done and done[row])
                marks[2, i] = has_terminated and terminated[row]
                marks[3, i] = has_init and init[row]


@njit(cache=True, nogil=True)
def sumtree_windows(leaves, sums, mins, offsets, sizes, shift, uniforms, stratified, held_min, beta, capacity,
                    seq_length, done, terminated, has_done, has_terminated, rows, marks, weights):  # pragma: no cover
    """Draws ``S = uniforms.shape[0]`` starts from the tree (``leaves`` to ``shift`` as
    :func:`gpubuf_kernels.cpu.sumtree.draw` takes them) and fills ``rows``, ``marks`` (truncated,
    done, terminated) and ``weights`` of their windows of ``seq_length`` steps: the twin's results
    (``gpubuf.ops.sumtree_windows``), the weights ``(value / p_min) ** (-beta)`` in float64, with
    ``p_min`` the smaller of the root's minimum and ``held_min``, rounded to ``weights``' dtype."""
    s_total = uniforms.shape[0]
    starts = np.empty(s_total, np.int64)
    values = np.empty(s_total, leaves.dtype)
    descend(leaves, sums, offsets, sizes, shift, uniforms, stratified, _DRAW_ORDER, starts, values)
    p_min = min(mins[0], held_min)
    for s in range(s_total):
        first = starts[s]
        weight = (np.float64(values[s]) / p_min) ** (-beta)
        base = s * seq_length
        for j in range(seq_length):
            i = base + j
            row = (first + j) % capacity
            rows[i] = row
            last = j == seq_length - 1
            marks[0, i] = last
            marks[1, i] = last or (has_done and done[row])
            marks[2, i] = has_terminated and terminated[row]
            weights[i] = weight


#: ``descend``'s "draw order" (an empty permutation).
_DRAW_ORDER = np.zeros(0, np.int64)
