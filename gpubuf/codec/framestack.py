"""Frame stacks: how stacked observations are built from frames, and how to find their shared frames.

A frame-stacking environment wrapper returns ``obs[t] = frames[t-3 .. t]`` (for stacks of 4),
repeating an episode's first frame while fewer than 4 frames exist, and ``next_obs[t] =
obs[t + 1]``. :func:`stack_indices` builds those index tables from an episode-start mask (the
reference that tests and benchmarks stack real frames with). :func:`match_frames` finds, in a
batch of stacked rows, which frame slots repeat an earlier one, by comparing their bytes, so
frame deduplication is exact whatever the episode structure: two slots share a stored frame only
when their bytes are equal.
"""

from __future__ import annotations

import numpy as np
import torch

from gpubuf.codec.encoder import wide_view

__all__ = ["stack_indices", "transition_indices", "match_frames"]


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


def _eq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Frames ``[..., F]`` (flattened, in any integer unit) -> bool ``[...]``: equal."""
    if a.shape[-1] == 0:
        return torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device)
    lo, hi = torch.aminmax(a ^ b, dim=-1)
    return (lo == 0) & (hi == 0)


def match_frames(
    stacks: list[torch.Tensor],
    pairs: list[int | None],
    tail: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """For every frame slot of a batch, the earlier slot holding the same bytes (or itself).

    Slots are ``(row i, leaf j, position k)`` of ``stacks[j][i, k]``; an extra leading row, the
    *tail* (the last row written before this batch), may be given. Candidates, first match wins:

    1. ``next[i-1][k]`` for a base leaf (``obs[i] == next_obs[i-1]`` along an episode);
    2. ``leaf[i-1][k+1]`` (a stack shifted by one step);
    3. ``base[i][k+1]`` for a next leaf (``next_obs[i][:-1] == obs[i][1:]``);
    4. ``leaf[i][k+1]`` (a repeated frame, as at an episode start).

    Every candidate comes earlier in the order (row, base leaves before next leaves, position
    from the last down), so following matches always ends at a slot without one (a *root*).

    Args:
        stacks: uint8 ``[n, S, F]`` per stacked leaf (frames flattened to bytes).
        pairs: for each leaf, the position of its base leaf if it is a next leaf, else None.
        tail: uint8 ``[S, F]`` per leaf for the previous row, or None.

    Returns:
        int64 ``[(n + 1) * J * S]``: the root slot of every slot, slot ``((i + 1) * J + j) * S + k``
        (row ``-1`` is the tail; its slots are their own roots).
    """
    J = len(stacks)
    n, S = stacks[0].shape[:2]
    device = stacks[0].device
    has_tail = tail is not None
    # Rows -1..n-1; a missing tail is a row that matches nothing.
    # Compared in the widest integer unit dividing a frame's size, hence the contiguous copy.
    full = [
        wide_view(torch.cat([(t if has_tail else torch.zeros_like(x[0])).unsqueeze(0), x]))
        for x, t in zip(stacks, tail or [None] * J)
    ]
    slots = (n + 1) * J * S
    parent = torch.arange(slots, device=device).view(n + 1, J, S)
    matched = torch.zeros(n + 1, J, S, dtype=torch.bool, device=device)
    order = _slot_order(pairs)

    base_ids = torch.arange(slots, device=device).view(n + 1, J, S)
    for j in order:
        x = full[j]
        cands = []
        if pairs[j] is None:
            nxt = [jj for jj, p in enumerate(pairs) if p == j]
            for jj in nxt:
                cands.append(("prev", jj, 0))
        cands.append(("prev", j, 1))
        if pairs[j] is not None:
            cands.append(("same", pairs[j], 1))
        cands.append(("same", j, 1))
        for kind, jj, shift in cands:
            y = full[jj]
            if kind == "prev":
                a, b = x[1:, : S - shift], y[:-1, shift:]
                rows = slice(1, None)
                src_rows = slice(0, n)
            else:
                a, b = x[1:, : S - shift], y[1:, shift:]
                rows = slice(1, None)
                src_rows = slice(1, None)
            if a.shape[1] == 0:
                continue
            eq = _eq(a, b)
            if kind == "prev" and not has_tail:
                eq[0] = False
            free = ~matched[rows, j, : S - shift]
            take = eq & free
            parent[rows, j, : S - shift] = torch.where(take, base_ids[src_rows, jj, shift:], parent[rows, j, : S - shift])
            matched[rows, j, : S - shift] |= take
    parent = parent.view(-1)
    # Pointer jumping: every chain ends at a root in O(log slots) steps.
    while True:
        nxt = parent.index_select(0, parent)
        if torch.equal(nxt, parent):
            return parent
        parent = nxt


def _slot_order(pairs: list[int | None]) -> list[int]:
    """Base leaves first, then next leaves (the order candidates refer back in)."""
    return [j for j, p in enumerate(pairs) if p is None] + [j for j, p in enumerate(pairs) if p is not None]
