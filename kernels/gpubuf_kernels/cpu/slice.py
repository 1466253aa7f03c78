"""The slice-window draw as one compiled CPU loop (see ``gpubuf.ops.slice_windows``)."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def slice_windows(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, done, terminated, init,
                  has_done, has_terminated, has_init, rows, marks):  # pragma: no cover - compiled
    """Fills ``rows[s * L + j]`` with the rows of slice ``s``'s window and ``marks[:, s * L + j]``
    with its marks (truncated, done, terminated, init); the twin's results.

    ``done``, ``terminated``, ``init`` are bool arrays of the stored flags per physical row, read
    only where the matching ``has_*`` is True.
    """
    s_total = uniforms.shape[0] // 2
    count = back - front
    for s in range(s_total):
        # A float64 product cast to int64: the twin's floor for non-negative values.
        k = int(uniforms[s] * count)
        slot = slots[(k + front) % capacity] % capacity
        first = start[slot]
        if first < lower:
            first = lower
        length = stop[slot] - first + 1
        first += int(uniforms[s_total + s] * (length - (seq_length - 1)))
        base = s * seq_length
        for j in range(seq_length):
            i = base + j
            row = (first + j) % capacity
            rows[i] = row
            last = j == seq_length - 1
            marks[0, i] = last
            marks[1, i] = last or (has_done and done[row])
            marks[2, i] = has_terminated and terminated[row]
            marks[3, i] = j == 0 or (has_init and init[row])
