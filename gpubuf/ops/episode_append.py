"""Episode append: the trajectory boundaries of a ring storage brought up to date with one write.

The update under every slice sampler's write (see :mod:`gpubuf.samplers._episodes` for the
index's layout): ``n`` new time rows, each of ``C`` columns either continuing the trajectory of
the row before it or starting a new one, change

- the ring of trajectories: a start time at each new trajectory's slot, a stop time where each
  one ends, the trajectory number of every row written, the newest and oldest live numbers;
- each list of the trajectories at least ``L`` long (a ring deque per column): the oldest ones
  retired or trimmed too short pop at the front, the newest that reached ``L`` append at the back.

Every step depends only on ``n``, never on the storage's size. On CUDA it is one ``cumsum`` and
two kernels (one per row, one per column and list) with no host synchronisation; on a CPU one
compiled pass over the rows and one per list (Numba), else the twin, a fixed sequence of
vectorized torch ops.
"""

from __future__ import annotations

from typing import Sequence

import torch

from gpubuf.ops._dispatch import device_path, implementation, numba_enabled, resolve

__all__ = ["episode_append", "episode_append_ref", "episode_append_trusted"]

#: One list of eligible trajectories: ``(slots, front, back, length)`` (see :func:`episode_append_ref`).
Deque = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def _lengths(start: torch.Tensor, stop: torch.Tensor, g: torch.Tensor, capacity: int, lower: int) -> torch.Tensor:
    """Live length of trajectories ``g`` (``[*, C]`` numbers of each column): stop - max(start, lower) + 1."""
    slot = (g % capacity).T
    first = start.gather(1, slot).clamp_min(lower)
    return (stop.gather(1, slot) - first + 1).T


def episode_append_ref(
    breaks: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    row_traj: torch.Tensor,
    head: torch.Tensor,
    tail: torch.Tensor,
    deques: Sequence[Deque],
    written: int,
    capacity: int,
    fresh: bool,
) -> None:
    """Pure-torch twin of the episode append; the op's specification.

    With ``T = capacity``, ``w0 = written``, ``w1 = w0 + n`` and ``lower = max(w1 - T, 0)`` (the
    absolute time of the oldest row live after the write), per column ``c``:

    - ``rank[j] = breaks[0..j].sum()`` and row ``j`` (absolute time ``w0 + j``, physical row
      ``(w0 + j) % T``) belongs to trajectory ``g = head[c] + rank[j]``, at slot ``g % T``;
    - ``row_traj[c, (w0 + j) % T] = g``; ``start[c, g % T] = w0 + j`` where row ``j`` breaks;
      ``stop[c, g % T] = w0 + j`` where row ``j + 1`` breaks or ``j = n - 1``;
    - the new head is ``head[c] + rank[n - 1]``; the new tail is the trajectory of the oldest
      live row, ``row_traj[c, lower % T]``, when rows were overwritten (``lower > 0``) and the
      index is not ``fresh``, else the tail is kept;
    - for each deque of length ``L``: the entries from ``front`` that retired (``g < tail``) or
      are the tail trimmed below ``L`` steps pop; then the old head, when it continued into this
      write (``breaks[0]`` False), was live (``head >= tail`` before it), is at least ``L`` long
      now and not yet listed, and after it each new trajectory at least ``L`` long, append at
      ``back`` in increasing order.

    A trajectory's live length is ``stop - max(start, lower) + 1``.

    Args:
        breaks: ``bool [n, C]``: row ``j`` of column ``c`` starts a new trajectory. ``n <= T``,
            and ``n < T`` unless ``fresh``; a ``fresh`` index needs ``breaks[0]`` all True.
        start, stop: ``int64 [C, T + 1]`` absolute start and stop (inclusive) time of the
            trajectory at each slot (slot ``T`` is scratch). Mutated.
        row_traj: ``int64 [C, T + 1]`` trajectory number of each physical row. Mutated.
        head, tail: ``int64 [C]`` newest and oldest live trajectory numbers (``head = tail - 1``
            when nothing is live). Mutated in place.
        deques: ``(slots, front, back, L)`` per list: ``slots`` ``int64 [C, T + 1]`` holds the
            eligible trajectory numbers at positions ``front[c] <= i < back[c]`` (mod ``T``),
            ``front`` and ``back`` ``int64 [C]``. All three mutated in place.
        written: ``w0``, the time rows written before this write.
        capacity: ``T``.
        fresh: nothing is stored before this write (the index was just made or reset).
    """
    n, c = breaks.shape
    t = capacity
    device = breaks.device
    lower = max(written + n - t, 0)
    ranks = breaks.cumsum(0, dtype=torch.int64)  # [n, C]
    head0, tail0 = head.clone(), tail.clone()
    tail1 = row_traj[:, lower % t].clone() if lower > 0 and not fresh else tail0

    # Starts at the breaks, stops before each break and at the last row (masked entries go to
    # the scratch slot T), the rows' trajectory numbers.
    g_row = head0.unsqueeze(0) + ranks
    slot = g_row % t
    scratch = torch.full_like(g_row, t)
    stamps = torch.arange(written, written + n, device=device).unsqueeze(0).expand(c, n)
    start.scatter_(1, torch.where(breaks, slot, scratch).T, stamps)
    ends = torch.cat([breaks[1:], torch.ones_like(breaks[:1])], 0)
    stop.scatter_(1, torch.where(ends & (g_row >= 0), slot, scratch).T, stamps)
    rows = (torch.arange(n, device=device) + written) % t
    row_traj[:, rows] = g_row.T
    head1 = head0 + ranks[-1]

    # (A fresh index has no live head: head0 = -1 < tail0 = 0.)
    continues = ~breaks[0] & (head0 >= tail0)
    cols = torch.arange(c, device=device)
    for slots, front, back, length in deques:
        # Pops at the front: at most n + 1 (each retired trajectory lost a row, and the new tail).
        window = torch.arange(n + 1, device=device).unsqueeze(1)  # [n + 1, 1]
        listed = slots[cols, (front.unsqueeze(0) + window) % t]
        tail_short = _lengths(start, stop, tail1.unsqueeze(0), t, lower)[0] < length
        pop = (window < (back - front).unsqueeze(0)) & ((listed < tail1) | ((listed == tail1) & tail_short))
        front1 = front + pop.sum(0)
        # Appends at the back, in trajectory order: the old head when it grew into the list,
        # then the new trajectories long enough.
        head_listed = (back > front1) & (slots[cols, (back - 1) % t] == head0)
        head_long = _lengths(start, stop, head0.clamp_min(0).unsqueeze(0), t, lower)[0] >= length
        head_ok = continues & ~head_listed & head_long
        new_g = torch.where(breaks, g_row, torch.zeros_like(g_row))
        new_ok = breaks & (_lengths(start, stop, new_g, t, lower) >= length)
        candidates = torch.cat([head0.unsqueeze(0), new_g], 0)  # [n + 1, C]
        ok = torch.cat([head_ok.unsqueeze(0), new_ok], 0)
        rank = ok.cumsum(0, dtype=torch.int64) - 1
        at = torch.where(ok, (back.unsqueeze(0) + rank) % t, torch.full_like(rank, t))
        slots.scatter_(1, at.T, candidates.T.contiguous())
        back.add_(ok.sum(0))
        front.copy_(front1)
    head.copy_(head1)
    tail.copy_(tail1)


def _check(breaks: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, row_traj: torch.Tensor,
           head: torch.Tensor, tail: torch.Tensor, deques: Sequence[Deque], written: int, capacity: int,
           fresh: bool) -> None:
    if not isinstance(breaks, torch.Tensor) or breaks.dtype != torch.bool or breaks.ndim != 2:
        raise TypeError("breaks must be a bool tensor of shape [n, C]")
    n, c = breaks.shape
    if not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive int, got {capacity!r}")
    if not isinstance(written, int) or written < 0:
        raise ValueError(f"written must be a non-negative int, got {written!r}")
    if n == 0 or n > capacity or (n == capacity and not fresh):
        raise ValueError(
            f"a write of {n} rows into a ring of {capacity}: expected 1 to {capacity - 1} rows, or up to {capacity} "
            "into a fresh index (a longer write starts the index over)"
        )
    tables = [("start", start, (c, capacity + 1)), ("stop", stop, (c, capacity + 1)),
              ("row_traj", row_traj, (c, capacity + 1)), ("head", head, (c,)), ("tail", tail, (c,))]
    for i, (slots, front, back, length) in enumerate(deques):
        if not isinstance(length, int) or length <= 0:
            raise ValueError(f"deque #{i} has length {length!r}, expected a positive int")
        tables += [(f"deque #{i} slots", slots, (c, capacity + 1)), (f"deque #{i} front", front, (c,)),
                   (f"deque #{i} back", back, (c,))]
    for name, tensor, shape in tables:
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tuple(tensor.shape) != shape:
            raise TypeError(f"{name} must be an int64 tensor of shape {list(shape)}")
        if tensor.device != breaks.device:
            raise ValueError(f"{name} is on {tensor.device}, breaks on {breaks.device}: expected one device")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def episode_append(
    breaks: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    row_traj: torch.Tensor,
    head: torch.Tensor,
    tail: torch.Tensor,
    deques: Sequence[Deque],
    written: int,
    capacity: int,
    fresh: bool = False,
    *,
    backend: str = "auto",
) -> None:
    """Brings the index up to date with a write; see :func:`episode_append_ref` for the specification.

    Args:
        As :func:`episode_append_ref`; ``backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        TypeError, ValueError: tables of the wrong dtype, shape or device, or a write too long
            for the ring, before anything changes.
        BackendUnavailableError: an explicit backend that cannot run here.
    """
    _check(breaks, start, stop, row_traj, head, tail, deques, written, capacity, fresh)
    resolve("episode_append", breaks, backend)  # raises for an explicit backend that cannot run here
    episode_append_trusted(breaks, start, stop, row_traj, head, tail, list(deques), written, capacity, fresh, backend)


def episode_append_trusted(
    breaks: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    row_traj: torch.Tensor,
    head: torch.Tensor,
    tail: torch.Tensor,
    deques: Sequence[Deque],
    written: int,
    capacity: int,
    fresh: bool,
    backend: str = "auto",
) -> None:
    """The index's entry: :func:`episode_append` without the argument checks, dispatched by device.

    For :class:`~gpubuf.samplers._episodes.EpisodeIndex`, which made the tables itself and keeps
    the contract of :func:`episode_append_ref`.
    """
    if device_path(breaks, backend):
        which = "triton"
    elif not breaks.is_cuda and (backend == "numba" or backend == "auto" and numba_enabled()):
        which = "numba"
    else:
        episode_append_ref(breaks, start, stop, row_traj, head, tail, deques, written, capacity, fresh)
        return
    implementation("episode_append", which)(
        breaks.contiguous(), start, stop, row_traj, head, tail, deques, written, capacity, fresh)
