"""The slice-window draw as one compiled CPU loop (see ``gpubuf.ops.slice_windows``)."""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True)
def slice_windows(slots, start, stop, front, count, uniforms, lower, capacity, seq_length, out):  # pragma: no cover
    """Fills ``out[s * L + j]`` with the rows of slice ``s``'s window; the twin's results."""
    s_total = uniforms.shape[0] // 2
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
            out[base + j] = (first + j) % capacity
