"""The episode index's writes as compiled CPU loops: the episode append (``gpubuf.ops.episode_append``:
one pass over the rows written, then one pass per list of eligible trajectories over the
trajectories that retired or began; the twin's tables, its scratch slot ``T`` aside) and the start
exclusions (``gpubuf.ops.start_exclusions``: one pass over the steps decided; the twin's results)."""

from __future__ import annotations

import numpy as np
import torch
from numba import njit


@njit(cache=True, nogil=True)
def append_rows(breaks, head, tail, start, stop, row_traj, written, capacity, fresh, new, tail1):  # pragma: no cover
    """Records the rows of ``breaks`` (bool ``[n, C]``) in ``start``, ``stop`` and ``row_traj``
    (int64 ``[C, T + 1]``) from the trajectory numbers ``head`` and ``tail`` (int64 ``[C]``, only
    read); fills ``new[c]`` with the trajectories begun in column ``c`` and ``tail1[c]`` with its
    new tail (the trajectory of the oldest live row)."""
    n, columns = breaks.shape
    lower = max(written + n - capacity, 0)
    for c in range(columns):
        # The oldest live row was not written by this write: read before the rows are.
        if lower > 0 and not fresh:
            tail1[c] = row_traj[c, lower % capacity]
        else:
            tail1[c] = tail[c]
        g = head[c]
        for j in range(n):
            time = written + j
            if breaks[j, c]:
                g += 1
                start[c, g % capacity] = time
            row_traj[c, time % capacity] = g
            if (j == n - 1 or breaks[j + 1, c]) and g >= 0:
                stop[c, g % capacity] = time
        new[c] = g - head[c]


@njit(cache=True, nogil=True)
def append_list(breaks, head, tail, new, tail1, start, stop, slots, front, back, n, capacity, lower,
                length):  # pragma: no cover
    """Pops the retired and trimmed trajectories at the front of one list (``slots`` int64
    ``[C, T + 1]``, ``front`` and ``back`` int64 ``[C]``, mutated) and appends the old head and the
    new trajectories at least ``length`` long at its back; ``head``, ``tail`` as before the write,
    ``new`` and ``tail1`` as :func:`append_rows` left them."""
    for c in range(breaks.shape[1]):
        t1 = tail1[c]
        f, b = front[c], back[c]
        tail_slot = t1 % capacity
        tail_short = stop[c, tail_slot] - max(start[c, tail_slot], lower) + 1 < length
        # The pops are a prefix of the list (its numbers increase), at most n + 1 long.
        limit = min(b - f, n + 1)
        pops = 0
        while pops < limit:
            g = slots[c, (f + pops) % capacity]
            if g < t1 or (g == t1 and tail_short):
                pops += 1
            else:
                break
        f += pops
        h0 = head[c]
        listed = b > f and slots[c, (b - 1) % capacity] == h0
        head_slot = max(h0, 0) % capacity
        head_long = stop[c, head_slot] - max(start[c, head_slot], lower) + 1 >= length
        if not breaks[0, c] and h0 >= tail[c] and not listed and head_long:
            slots[c, b % capacity] = h0
            b += 1
        for g in range(h0 + 1, h0 + new[c] + 1):
            slot = g % capacity
            if stop[c, slot] - max(start[c, slot], lower) + 1 >= length:
                slots[c, b % capacity] = g
                b += 1
        front[c] = f
        back[c] = b


def episode_append(breaks, start, stop, row_traj, head, tail, deques, written, capacity, fresh):
    """The op on CPU tensors' NumPy views (arguments as the twin's); no copies."""
    columns = breaks.shape[1]
    head_np, tail_np = head.numpy(), tail.numpy()
    new = np.empty(columns, np.int64)
    tail1 = np.empty(columns, np.int64)
    start_np, stop_np = start.numpy(), stop.numpy()
    breaks_np = breaks.numpy()
    append_rows(breaks_np, head_np, tail_np, start_np, stop_np, row_traj.numpy(), written, capacity, fresh, new, tail1)
    lower = max(written + breaks.shape[0] - capacity, 0)
    for slots, front, back, length in deques:
        append_list(breaks_np, head_np, tail_np, new, tail1, start_np, stop_np, slots.numpy(), front.numpy(),
                    back.numpy(), breaks.shape[0], capacity, lower, length)
    head_np += new
    tail_np[:] = tail1


@njit(cache=True, nogil=True)
def start_exclusions(row_traj, start, stop, excluded, tree, held, first, written, capacity, kept, strict_length, flat,
                     to_held, to_tree):  # pragma: no cover - compiled
    """The twin of ``gpubuf.ops.start_exclusions``: decides each step at the times ``first ..
    written - 1`` (then the oldest live one, when outside that range) of every column, records the
    decision in ``excluded`` and fills ``flat``, ``to_held``, ``to_tree`` (one entry a step)."""
    columns = row_traj.shape[0]
    lower = max(written - capacity, 0)
    count = flat.shape[0] // columns
    for which in range(count):
        tau = first + which if which < written - first else lower
        row = tau % capacity
        for c in range(columns):
            k = which * columns + c
            slot = row_traj[c, row] % capacity
            want = stop[c, slot] - tau < kept
            if not strict_length:
                want = want and tau != max(start[c, slot], lower)
            f = row * columns + c
            move = want != excluded[f]
            flat[k] = f if move else -1
            to_held[k] = np.float64(tree[f]) if move and want else 0.0
            to_tree[k] = np.float64(held[f]) if move and not want else 0.0
            excluded[f] = want


def start_exclusions_cpu(row_traj, start, stop, excluded, tree, held, first, written, capacity, kept, strict_length):
    """The op on CPU tensors' NumPy views (arguments and results as the twin's)."""
    columns = row_traj.shape[0]
    lower = max(written - capacity, 0)
    size = (written - first + (1 if lower < first else 0)) * columns
    flat = np.empty(size, np.int64)
    to_held = np.empty(size, np.float64)
    to_tree = np.empty(size, np.float64)
    start_exclusions(row_traj.numpy(), start.numpy(), stop.numpy(), excluded.numpy(), tree.numpy(), held.numpy(), first,
                     written, capacity, kept, strict_length, flat, to_held, to_tree)
    return torch.from_numpy(flat), torch.from_numpy(to_held), torch.from_numpy(to_tree)
