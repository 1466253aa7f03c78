"""The slice-window draw as one compiled CPU loop (see ``gpubuf.ops.slice_windows``)."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def slice_windows(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, done, terminated, init,
                  has_done, has_terminated, has_init, rows, marks):  # pragma: no cover - compiled
    """Fills ``rows[s * L + j]`` with the rows of slice ``s``'s window and ``marks[:, s * L + j]``
    with its marks (truncated, done, terminated, init); the twin's results.

    ``front`` and ``back`` are int64 arrays of one element (the eligible ring's ends); ``done``,
    ``terminated``, ``init`` are bool arrays of the stored flags per physical row, read only where
    the matching ``has_*`` is True.
    """
    s_total = uniforms.shape[0] // 2
    front = front[0]
    count = back[0] - front
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


@njit(cache=True, nogil=True)
def slice_windows_at(starts, values, p_min, beta, capacity, seq_length, done, terminated, has_done, has_terminated,
                     rows, marks, weights):  # pragma: no cover - compiled
    """Fills ``rows``, ``marks`` (truncated, done, terminated) and ``weights`` of the windows of
    ``seq_length`` steps starting at ``starts``; the twin's results (``gpubuf.ops.slice_windows_at``),
    the weights ``(values[s] / p_min) ** (-beta)`` in float64 rounded to ``weights``' dtype."""
    for s in range(starts.shape[0]):
        first = starts[s]
        weight = (values[s] / p_min) ** (-beta)
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
