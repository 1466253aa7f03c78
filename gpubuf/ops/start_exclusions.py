"""Start exclusions: which steps can start a slice, refreshed over the rows a write touched.

The write path of :class:`~gpubuf.samplers.PrioritizedSliceSampler`. Its sum tree holds the
priorities of the steps a slice may start at; the others (the last ``kept`` steps of each
trajectory, and without ``strict_length`` never a trajectory's first step) wait in a second
tree. A write changes that for the rows it wrote, for the last ``kept`` steps of the
trajectory it continued, and for the oldest live row (a trimmed trajectory's new first step);
this op decides each of those steps again from the episode index (see
:mod:`gpubuf.samplers._episodes`), records the decision, and lists the leaves to move between
the two trees, for two sum-tree updates to apply. One launch on CUDA, no host read; one compiled
loop on a CPU.
"""

from __future__ import annotations

import torch

from gpubuf.ops._dispatch import device_path, implementation, numba_enabled

__all__ = ["start_exclusions_ref", "start_exclusions_trusted"]


def start_exclusions_ref(
    row_traj: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    excluded: torch.Tensor,
    tree: torch.Tensor,
    held: torch.Tensor,
    first: int,
    written: int,
    capacity: int,
    kept: int,
    strict_length: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch twin of the start exclusions; the op's specification.

    With ``T = capacity``, ``C = row_traj.shape[0]`` and ``lower = max(written - T, 0)``, the
    steps decided are every column's steps at the absolute times ``first .. written - 1`` and,
    when ``lower < first``, at ``lower``: ``m`` times, ``M = m * C`` steps, step ``k`` at time
    ``tau`` of the ``k // C``-th of them and column ``c = k % C``, physical row
    ``row = tau % T``, flat position ``f = row * C + c``. Its trajectory ``g = row_traj[c, row]``
    spans ``a = max(start[c, g % T], lower)`` to ``b = stop[c, g % T]``; the step is excluded
    when ``b - tau < kept`` and, without ``strict_length``, ``tau != a``.

    Args:
        row_traj, start, stop: ``int64 [C, T + 1]``, the episode index's tables (after the write).
        excluded: ``bool [C * T]``, True at the flat positions held aside. Mutated: each step
            decided gets its decision.
        tree, held: ``[C * T]`` leaves (float32 or float64) of the sum tree and of the tree of
            the steps held aside; only read.
        first: the oldest time decided, ``lower <= first <= written``.
        written: the time rows written, this write's included.
        capacity: ``T``.
        kept: how many last steps of a trajectory cannot start a slice.
        strict_length: whether a trajectory's first step is excluded like any other.

    Returns:
        ``(flat, to_held, to_tree)`` of ``M`` entries: ``flat[k] = f`` where step ``k``'s
        decision changed, else -1 (a sum-tree update ignores it); ``to_held[k]`` the leaf the
        held tree takes there (the tree's leaf for a step newly excluded, else 0) and
        ``to_tree[k]`` the leaf the tree takes (the held leaf for a step newly allowed, else 0),
        float64. On ``excluded``'s device (the episode tables may be elsewhere).
    """
    t, columns = capacity, row_traj.shape[0]
    lower = max(written - t, 0)
    device = row_traj.device
    times = torch.arange(first, written, device=device)
    if lower < first:
        times = torch.cat([times, torch.tensor([lower], device=device)])
    tau = times.repeat_interleave(columns)
    col = torch.arange(columns, device=device).repeat(times.shape[0])
    row = tau % t
    slot = row_traj[col, row] % t
    a = start[col, slot].clamp_min(lower)
    want = stop[col, slot] - tau < kept
    if not strict_length:
        want = want & (tau != a)
    flat = (row * columns + col).to(excluded.device)
    want = want.to(excluded.device)
    move = want != excluded[flat]
    to_held = torch.where(move & want, tree[flat].to(torch.float64), 0.0)
    to_tree = torch.where(move & ~want, held[flat].to(torch.float64), 0.0)
    excluded[flat] = want
    return torch.where(move, flat, -1), to_held, to_tree


def start_exclusions_trusted(
    row_traj: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    excluded: torch.Tensor,
    tree: torch.Tensor,
    held: torch.Tensor,
    first: int,
    written: int,
    capacity: int,
    kept: int,
    strict_length: bool,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler's entry, without argument checks: see :func:`start_exclusions_ref`.

    Where the episode tables and the trees share a device, the Triton kernel runs on the device
    path and the compiled CPU loop (Numba) on a CPU; the twin runs otherwise (a tree kept on
    another device than the storage's rows moves only the ``M`` decisions across).
    """
    args = (row_traj, start, stop, excluded, tree, held, first, written, capacity, kept, strict_length)
    if row_traj.device == excluded.device:
        if device_path(excluded, backend):
            return implementation("start_exclusions", "triton")(*args)
        if excluded.device.type == "cpu" and (backend == "numba" or backend == "auto" and numba_enabled()):
            return implementation("start_exclusions", "numba")(*args)
    return start_exclusions_ref(*args)
