"""Frame stacks: how stacked observations are built from frames, and how to find their shared frames.

A frame-stacking environment wrapper returns ``obs[t] = frames[t-3 .. t]`` (for stacks of 4),
repeating an episode's first frame while fewer than 4 frames exist, and ``next_obs[t] =
obs[t + 1]``. :func:`stack_indices` builds those index tables from an episode-start mask (the
reference that tests and benchmarks stack real frames with). :func:`match_frames` finds, in a
batch of stacked rows, which frame slots repeat an earlier one, by comparing their bytes, so
frame deduplication is exact whatever the episode structure: two slots share a stored frame only
when their bytes are equal.

CPU batches are matched by the compiled kernel ``gpubuf_kernels.cpu.framestack`` where Numba
imports (the same roots, slot by slot, reading the frames in place; ``backend="torch"`` or
``GPUBUF_NUMBA=0`` keeps the torch steps).
"""

from __future__ import annotations

import numpy as np
import torch

from gpubuf.ops.encode_rows import wide_view
from gpubuf.ops._dispatch import kernel_module, resolve

__all__ = ["stack_indices", "transition_indices", "match_frames", "frames_equal"]


def stack_indices(episode_start: np.ndarray | torch.Tensor, num_stack: int = 4) -> np.ndarray:
    """Frame numbers of the stacked observation ending at each frame.

    Args:
        episode_start: bool ``[N]``, True on the first frame of each episode (frames in order).
        num_stack: frames per stack.

    Returns:
        int64 ``[N, num_stack]``: row ``t`` is ``[max(t-3, s), ..., t]`` for stacks of 4, where
        ``s`` is the first frame of ``t``'s episode (the first frame repeats at an episode start).
    """
    starts = np.asarray(episode_start, dtype=bool).copy()
    n = starts.shape[0]
    if n:
        starts[0] = True
    t = np.arange(n)
    first = np.maximum.accumulate(np.where(starts, t, 0))
    back = np.arange(num_stack - 1, -1, -1)
    return np.maximum(t[:, None] - back[None, :], first[:, None])


def transition_indices(episode_start: np.ndarray | torch.Tensor, num_stack: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Stack tables of the transitions ``(obs[t], next_obs[t])`` of an episode-ordered frame sequence.

    A transition exists for every frame that is not the last of its episode.

    Returns:
        ``(obs, next_obs)``, int64 ``[T, num_stack]`` frame numbers each.
    """
    starts = np.asarray(episode_start, dtype=bool)
    idx = stack_indices(starts, num_stack)
    n = starts.shape[0]
    has_next = np.ones(n, dtype=bool)
    if n:
        has_next[:-1] = ~starts[1:]
        has_next[-1] = False
    t = np.nonzero(has_next)[0]
    return idx[t], idx[t + 1]


_CHUNK = 128  # frames compared per step: bounds the XOR scratch (a fresh large CPU tensor page-faults)


def frames_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Frames ``[..., F]`` (flattened, in any integer unit; views allowed) -> bool ``[...]``: equal.

    XOR then max and min (the units are signed), in chunks through one reused buffer.
    """
    lead = a.shape[:-1]
    if a.shape[-1] == 0 or a.numel() == 0:
        return torch.ones(lead, dtype=torch.bool, device=a.device)
    a2 = a.reshape(-1, a.shape[-1])
    b2 = b.reshape(-1, b.shape[-1])
    m = a2.shape[0]
    out = torch.empty(m, dtype=torch.bool, device=a.device)
    scratch = torch.empty(min(m, _CHUNK), a2.shape[1], dtype=a2.dtype, device=a.device)
    for first in range(0, m, _CHUNK):
        last = min(first + _CHUNK, m)
        x = torch.bitwise_xor(a2[first:last], b2[first:last], out=scratch[: last - first])
        out[first:last] = (x.amax(-1) == 0) & (x.amin(-1) == 0)
    return out.view(lead)


def match_frames(
    stacks: list[torch.Tensor],
    pairs: list[int | None],
    tail: list[torch.Tensor] | None = None,
    buffers: list[torch.Tensor] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """For every frame slot of a batch, the earlier slot holding the same bytes (or itself).

    Slots are ``(row i, leaf j, position k)`` of ``stacks[j][i, k]``; an extra leading row, the
    *tail* (the last row written before this batch), may be given. Candidates, first match wins:

    1. ``next[i-1][k]`` for a base leaf (``obs[i] == next_obs[i-1]`` along an episode);
    2. ``base[i][k+1]`` for a next leaf (``next_obs[i][:-1] == obs[i][1:]``);
    3. ``leaf[i-1][k+1]`` (a stack shifted by one step);
    4. ``leaf[i][k+1]`` (a repeated frame, as at an episode start).

    Every candidate comes earlier in the order (row, base leaves before next leaves, position
    from the last down), so following matches always ends at a slot without one (a *root*).
    A leaf's first candidate is compared for every slot; later ones only for the slots still
    unmatched (few: episode starts and new frames).

    Args:
        stacks: uint8 ``[n, S, F]`` per stacked leaf (frames flattened to bytes).
        pairs: for each leaf, the position of its base leaf if it is a next leaf, else None.
        tail: uint8 ``[S, F]`` per leaf for the previous row, or None.
        buffers: optional uint8 scratch tensors, one per leaf, of at least ``(n + 1) * S * F``
            bytes, reused for the copy of tail and batch (a fresh large CPU tensor page-faults).
            The compiled kernel copies nothing and ignores them.
        backend: ``"auto"`` (the compiled kernel for CPU stacks where Numba imports, else the
            torch steps), ``"torch"`` or ``"numba"``.

    Returns:
        int64 ``[(n + 1) * J * S]``: the root of every slot, slot ``((i + 1) * J + j) * S + k``
        (row ``-1`` is the tail; its slots are their own roots).
    """
    if resolve("match_frames", stacks[0], backend) == "numba":
        return _match_frames_numba(stacks, pairs, tail)
    J = len(stacks)
    n, S = stacks[0].shape[:2]
    device = stacks[0].device
    has_tail = tail is not None
    # Rows -1..n-1 (a missing tail matches nothing), compared in the widest integer unit.
    full = []
    for j, x in enumerate(stacks):
        if buffers is not None:
            dst = buffers[j][: (n + 1) * x[0].numel()].view(n + 1, *x.shape[1:])
        else:
            dst = torch.empty((n + 1, *x.shape[1:]), dtype=x.dtype, device=device)
        if has_tail:
            dst[0].copy_(tail[j])
        else:
            dst[0].zero_()
        dst[1:].copy_(x)
        full.append(wide_view(dst))
    width = full[0].shape[-1]
    slots = (n + 1) * J * S
    ids = torch.arange(slots, device=device).view(n + 1, J, S)
    parent = ids.clone()
    open_ = torch.ones(n + 1, J, S, dtype=torch.bool, device=device)
    open_[0] = False
    first_row = 0 if has_tail else 1  # the first batch row that has a previous row
    _whole_stack_matches(full, pairs, parent, open_, ids, first_row)
    for j in [j for j, p in enumerate(pairs) if p is None] + [j for j, p in enumerate(pairs) if p is not None]:
        cands = [("prev", jj, 0) for jj, p in enumerate(pairs) if p == j and pairs[j] is None]
        if pairs[j] is not None:
            cands.append(("same", pairs[j], 1))
        cands += [("prev", j, 1), ("same", j, 1)]
        for kind, jj, shift in cands:
            if shift >= S:
                continue
            lo = 1 + (first_row if kind == "prev" else 0)
            src_off = -1 if kind == "prev" else 0
            window = open_[lo:, j, : S - shift]
            todo = window.nonzero()
            if todo.numel() == 0:
                continue
            if todo.shape[0] * 2 > window.numel():
                # Most slots still open: compare the whole window, strided, without gathering.
                eq = frames_equal(full[j][lo:, : S - shift], full[jj][lo + src_off : n + 1 + src_off, shift:]) & window
                take = eq.nonzero()
            else:
                rows, ks = todo[:, 0] + lo, todo[:, 1]
                # (Sizes spelled out: with zero-byte frames a -1 would be ambiguous.)
                a = full[j].view((n + 1) * S, width).index_select(0, rows * S + ks)
                b = full[jj].view((n + 1) * S, width).index_select(0, (rows + src_off) * S + ks + shift)
                hit = frames_equal(a, b)
                take = todo[hit]
                take = torch.stack([take[:, 0], take[:, 1]], 1)
            if take.numel() == 0:
                continue
            r = take[:, 0] + lo
            k = take[:, 1]
            parent[r, j, k] = ids[r + src_off, jj, k + shift]
            open_[r, j, k] = False
    parent = parent.view(-1)
    # Pointer jumping: every chain ends at a root in O(log slots) steps.
    while True:
        nxt = parent.index_select(0, parent)
        if torch.equal(nxt, parent):
            return parent
        parent = nxt


def _candidates(pairs: list[int | None], S: int) -> tuple[np.ndarray, np.ndarray]:
    """Each leaf's candidates as the kernel reads them: int64 ``[J, C, 3]`` ``(previous row?, leaf, shift)`` and counts ``[J]``.

    The same lists, in the same order, as :func:`match_frames` builds, without those whose
    shift leaves the stack.
    """
    J = len(pairs)
    table = np.zeros((J, max(J, 1) + 3, 3), dtype=np.int64)
    counts = np.zeros(J, dtype=np.int64)
    for j, p in enumerate(pairs):
        cands = [(1, jj, 0) for jj, q in enumerate(pairs) if q == j and p is None]
        if p is not None:
            cands.append((0, p, 1))
        cands += [(1, j, 1), (0, j, 1)]
        cands = [c for c in cands if c[2] < S]
        for c, cand in enumerate(cands):
            table[j, c] = cand
        counts[j] = len(cands)
    return table, counts


def _flat_units(frames: list[torch.Tensor], F: int) -> tuple:
    """Flat numpy views of frames of ``F`` bytes, in the widest unsigned unit that divides ``F``.

    Fewer, wider units make the compare loop shorter; every array must start on a multiple of
    the unit for the view (all of them share one unit, so the kernel compiles once per unit).
    """
    arrays = [x.detach().contiguous().view(-1).numpy() for x in frames]
    for dtype, size in ((np.uint64, 8), (np.uint32, 4), (np.uint16, 2)):
        if F % size == 0 and all(a.ctypes.data % size == 0 for a in arrays):
            return tuple(a.view(dtype) for a in arrays), F // size
    return tuple(arrays), F


def _match_frames_numba(stacks, pairs, tail) -> torch.Tensor:
    """:func:`match_frames` by the compiled kernel: the frames are read where they lie, nothing is copied."""
    J = len(stacks)
    n, S, F = stacks[0].shape
    has_tail = tail is not None
    if not has_tail:
        # Never read; the kernel only needs arrays of the batch's type.
        tail = [torch.zeros(S, F, dtype=torch.uint8) for _ in range(J)]
    table, counts = _candidates(pairs, S)
    arrays, width = _flat_units(list(stacks) + list(tail), F)
    roots = kernel_module("cpu.framestack").match_roots(
        arrays[:J], arrays[J:], has_tail, n, S, width, table, counts
    )
    return torch.from_numpy(roots)


def _whole_stack_matches(full, pairs, parent, open_, ids, first_row) -> None:
    """Matches whole stacks along an episode at once: ``obs[i] == next[i-1]``, ``next[i][:-1] == obs[i][1:]``.

    These two hold for every row inside an episode, so checking them per row settles almost all
    slots; the slot-by-slot candidates then only look at the rest. On the CPU the per-row check
    is ``torch.equal`` on the two stacks (a memory compare with an early exit, far cheaper than
    any vectorised compare of whole frames); on other devices it is one vectorised compare.
    """
    n = full[0].shape[0] - 1
    S = full[0].shape[1]
    device = full[0].device
    checks = []
    for j, p in enumerate(pairs):
        if p is None:
            nxt = [jj for jj, q in enumerate(pairs) if q == j]
            if nxt:  # obs[i] == next_obs[i-1], all S frames
                checks.append((j, nxt[0], -1, 0, S))
        else:  # next_obs[i][:S-1] == obs[i][1:]
            checks.append((j, p, 0, 1, S - 1))
    for j, jj, row_shift, shift, count in checks:
        lo = 1 + (first_row if row_shift else 0)
        if count <= 0 or lo > n:
            continue
        a = full[j][lo:, :count]
        b = full[jj][lo + row_shift : n + 1 + row_shift, shift : shift + count]
        if device.type == "cpu":
            rows_a, rows_b = a.unbind(0), b.unbind(0)
            same = torch.tensor([torch.equal(x, y) for x, y in zip(rows_a, rows_b)], dtype=torch.bool)
        else:
            same = frames_equal(a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1))
        rows = same.nonzero().squeeze(1) + lo
        if rows.numel() == 0:
            continue
        k = torch.arange(count, device=device)
        parent[rows[:, None], j, k] = ids[rows[:, None] + row_shift, jj, k + shift]
        open_[rows[:, None], j, k] = False
