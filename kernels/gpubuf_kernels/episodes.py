"""Triton kernels of the episode index's writes: the episode append (trajectory boundaries
brought up to date with one write) and the start exclusions of a prioritized slice sampler.

The torch twins and specifications are :func:`gpubuf.ops.episode_append.episode_append_ref`
and :func:`gpubuf.ops.start_exclusions.start_exclusions_ref`; the entry points that dispatch are
:func:`gpubuf.ops.episode_append.episode_append` and
:func:`gpubuf.ops.start_exclusions.start_exclusions_trusted`.

A write of ``n`` rows of ``C`` columns is one ``cumsum`` of the breaks (each row's trajectory
rank within the write) and two kernels, with no host synchronisation:

- ``_episode_rows_kernel``, a program per ``BLOCK`` rows of a column: each row records its
  trajectory number, a row that breaks writes its trajectory's start time and a row followed by
  a break (or the last row) its stop time. Rows of one write hold distinct trajectories at
  distinct slots (fewer than ``T`` of them), so no two programs write one entry.
- ``_episode_lists_kernel``, a program per column: the new tail (the trajectory of the oldest
  live row), then for one list of eligible trajectories the pops at its front (a prefix, scanned
  ``BLOCK`` entries at a time until one stays) and the appends at its back (the old head, then
  the new trajectories ``BLOCK`` at a time, placed by a running count). Launched once per list;
  the last launch writes the new head and tail, which the earlier ones read as they were.

The lists' work is sequential per column but proportional to the trajectories that retired or
began in this write, not to the storage's size.

``_start_exclusions_kernel``, a program per ``BLOCK`` steps, decides again whether each step a
write touched can start a slice, records it, and lists the leaves to move between the sum tree
and the tree of the steps held aside (for the two sum-tree updates that follow). Each step is
decided once: the oldest live row is added only when the write's range does not hold it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import EPISODES
from gpubuf_kernels._launch import cdiv, check_launch_device, launch

__all__ = ["episode_append_triton", "start_exclusions_triton", "SPECIALIZATIONS"]


# ``written`` moves with every write: specialised on its value it would compile a variant for
# each kind it takes (1, multiples of 16, others); ``n`` too.
@triton.jit(do_not_specialize=["n", "written"])
def _episode_rows_kernel(
    breaks_ptr,  # bool [n, C]: row j of column c starts a trajectory
    ranks_ptr,  # int64 [n, C]: breaks summed over rows 0..j
    head_ptr,  # int64 [C]: the newest trajectory number before the write
    start_ptr,  # int64 [C, T + 1]: out, absolute start time per slot
    stop_ptr,  # int64 [C, T + 1]: out, absolute stop time per slot
    row_traj_ptr,  # int64 [C, T + 1]: out, trajectory number per physical row
    n,
    columns,
    capacity,
    written,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1).to(tl.int64)
    j = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = j < n
    breaks = tl.load(breaks_ptr + j * columns + col, mask=inside, other=0) != 0
    # The row after the last one written counts as a break: the newest row ends a trajectory.
    follows = j + 1 < n
    next_breaks = (tl.load(breaks_ptr + (j + 1) * columns + col, mask=follows, other=0) != 0) | ~follows
    g = tl.load(head_ptr + col) + tl.load(ranks_ptr + j * columns + col, mask=inside, other=0)
    base = col * (capacity + 1)
    slot = g % capacity
    time = written + j
    tl.store(row_traj_ptr + base + time % capacity, g, mask=inside)
    tl.store(start_ptr + base + slot, time, mask=inside & breaks)
    tl.store(stop_ptr + base + slot, time, mask=inside & next_breaks & (g >= 0))


@triton.jit
def _live_length(start_ptr, stop_ptr, base, g, capacity, lower):
    """``stop - max(start, lower) + 1`` of trajectories ``g >= 0`` of the column at ``base`` (every
    slot ``g % capacity`` is in the table, so the loads need no mask)."""
    slot = g % capacity
    first = tl.maximum(tl.load(start_ptr + base + slot), lower)
    return tl.load(stop_ptr + base + slot) - first + 1


@triton.jit(do_not_specialize=["n", "lower", "length"])
def _episode_lists_kernel(
    breaks_ptr,  # bool [n, C]
    ranks_ptr,  # int64 [n, C]
    head_ptr,  # int64 [C]: the newest trajectory number before the write (written when WRITE_ENDS)
    tail_ptr,  # int64 [C]: the oldest live one before the write (written when WRITE_ENDS)
    start_ptr,  # int64 [C, T + 1]: start times, the write's included
    stop_ptr,  # int64 [C, T + 1]: stop times, the write's included
    row_traj_ptr,  # int64 [C, T + 1]: trajectory number per physical row
    slots_ptr,  # int64 [C, T + 1]: the list's ring of trajectory numbers (read and written when HAS_LIST)
    front_ptr,  # int64 [C]: the list's first position (read and written when HAS_LIST)
    back_ptr,  # int64 [C]: one past its last (read and written when HAS_LIST)
    n,
    columns,
    capacity,
    lower,
    length,
    FRESH: tl.constexpr,
    HAS_LIST: tl.constexpr,
    WRITE_ENDS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    col = tl.program_id(0).to(tl.int64)
    base = col * (capacity + 1)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    head0 = tl.load(head_ptr + col)
    tail0 = tl.load(tail_ptr + col)
    new = tl.load(ranks_ptr + (n - 1) * columns + col)
    if FRESH:
        tail1 = tail0
    else:
        # The oldest live row (absolute time lower) was not written by this write: its number
        # is the new tail, every trajectory before it ended before it.
        oldest = tl.load(row_traj_ptr + base + lower % capacity)
        tail1 = tl.where(lower > 0, oldest, tail0)
    if HAS_LIST:
        front = tl.load(front_ptr + col)
        back = tl.load(back_ptr + col)
        limit = tl.minimum(back - front, n + 1)
        tail_short = _live_length(start_ptr, stop_ptr, base, tail1, capacity, lower) < length
        # The pops are a prefix of the list (its numbers increase): scan until an entry stays.
        pops = back * 0
        at = back * 0
        scanning = limit > 0
        while scanning:
            i = at + offs
            listed_mask = i < limit
            g = tl.load(slots_ptr + base + (front + i) % capacity, mask=listed_mask, other=0)
            pop = listed_mask & ((g < tail1) | ((g == tail1) & tail_short))
            popped = tl.sum(pop.to(tl.int64), axis=0)
            pops += popped
            at += BLOCK
            scanning = (at < limit) & (popped == BLOCK)
        front1 = front + pops
        # The old head, when it grew into this write, is live, long enough and not yet listed.
        last = tl.load(slots_ptr + base + (back - 1 + capacity) % capacity)
        head_listed = (back > front1) & (last == head0)
        head_long = _live_length(start_ptr, stop_ptr, base, tl.maximum(head0, 0), capacity, lower) >= length
        # (A fresh index has no live head: head0 = -1 < tail0 = 0.)
        continues = (tl.load(breaks_ptr + col) == 0) & (head0 >= tail0)
        head_ok = continues & ~head_listed & head_long
        tl.store(slots_ptr + base + back % capacity, head0, mask=head_ok)
        end = back + head_ok.to(tl.int64)
        # Then the new trajectories head0 + 1 .. head0 + new that are long enough, in order.
        for first in range(0, new, BLOCK):
            k = first + offs
            is_new = k < new
            g = head0 + 1 + k
            ok = is_new & (_live_length(start_ptr, stop_ptr, base, g, capacity, lower) >= length)
            ok64 = ok.to(tl.int64)
            at_end = end + tl.cumsum(ok64, axis=0) - 1
            tl.store(slots_ptr + base + at_end % capacity, g, mask=ok)
            end += tl.sum(ok64, axis=0)
        tl.store(front_ptr + col, front1)
        tl.store(back_ptr + col, end)
    if WRITE_ENDS:
        tl.store(head_ptr + col, head0 + new)
        tl.store(tail_ptr + col, tail1)


# ``first`` and ``written`` move with every write, ``count`` with its size (see the rows kernel).
@triton.jit(do_not_specialize=["first", "written", "lower", "count"])
def _start_exclusions_kernel(
    row_traj_ptr,  # int64 [C, T + 1]: trajectory number per physical row
    start_ptr,  # int64 [C, T + 1]: absolute start time per slot
    stop_ptr,  # int64 [C, T + 1]: absolute stop time per slot
    excluded_ptr,  # bool [C * T]: in and out, True at the flat positions held aside
    tree_ptr,  # float32/float64 [C * T]: the sum tree's leaves
    held_ptr,  # float32/float64 [C * T]: the held tree's leaves
    flat_ptr,  # int64 [count * C]: out, the flat position of each step whose decision changed, else -1
    to_held_ptr,  # float64 [count * C]: out, the leaf the held tree takes there
    to_tree_ptr,  # float64 [count * C]: out, the leaf the tree takes there
    first,
    written,
    lower,
    count,
    columns,
    capacity,
    kept,
    STRICT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    k = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = k < count * columns
    which = k // columns
    col = k % columns
    # Times first .. written - 1, then (when the count says so) the oldest live one.
    tau = tl.where(which < written - first, first + which, lower)
    row = tau % capacity
    base = col * (capacity + 1)
    slot = tl.load(row_traj_ptr + base + row, mask=inside, other=0) % capacity
    begin = tl.maximum(tl.load(start_ptr + base + slot, mask=inside, other=0), lower)
    want = tl.load(stop_ptr + base + slot, mask=inside, other=0) - tau < kept
    if not STRICT:
        want = want & (tau != begin)
    flat = row * columns + col
    now = tl.load(excluded_ptr + flat, mask=inside, other=0) != 0
    move = inside & (want != now)
    into_held = tl.load(tree_ptr + flat, mask=move & want, other=0).to(tl.float64)
    into_tree = tl.load(held_ptr + flat, mask=move & ~want, other=0).to(tl.float64)
    tl.store(flat_ptr + k, tl.where(move, flat, -1), mask=inside)
    tl.store(to_held_ptr + k, into_held, mask=inside)
    tl.store(to_tree_ptr + k, into_tree, mask=inside)
    tl.store(excluded_ptr + flat, want, mask=inside)


def episode_append_triton(
    breaks: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    row_traj: torch.Tensor,
    head: torch.Tensor,
    tail: torch.Tensor,
    deques: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    written: int,
    capacity: int,
    fresh: bool,
    *,
    block: int | None = None,
    list_block: int | None = None,
) -> None:
    """A ``cumsum`` and ``1 + max(1, len(deques))`` launches; arguments and effects as
    :func:`gpubuf.ops.episode_append.episode_append_ref` (``breaks`` contiguous).

    Raises:
        ValueError: inputs not on a CUDA device (or CPU under the interpreter).
    """
    check_launch_device(breaks.device, "episode_append_triton")
    n, columns = breaks.shape
    lower = max(written + n - capacity, 0)
    ranks = torch.cumsum(breaks, 0, dtype=torch.int64)
    block = block or EPISODES["BLOCK"]
    list_block = list_block or EPISODES["LIST_BLOCK"]
    launch(_episode_rows_kernel, (cdiv(n, block), columns), breaks, ranks, head, start, stop, row_traj, n, columns,
           capacity, written, BLOCK=block, num_warps=EPISODES["num_warps"])
    lists = list(deques) or [(head, head, head, 1)]  # no list: one launch for the head and tail alone
    for i, (slots, front, back, length) in enumerate(lists):
        launch(_episode_lists_kernel, (columns,), breaks, ranks, head, tail, start, stop, row_traj, slots, front, back,
               n, columns, capacity, lower, length, FRESH=bool(fresh), HAS_LIST=bool(deques),
               WRITE_ENDS=i == len(lists) - 1, BLOCK=list_block, num_warps=EPISODES["num_warps"])


def start_exclusions_triton(
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
    *,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch; arguments and results as :func:`gpubuf.ops.start_exclusions.start_exclusions_ref`
    (every tensor on one device, contiguous).

    Raises:
        ValueError: inputs not on a CUDA device (or CPU under the interpreter).
    """
    check_launch_device(excluded.device, "start_exclusions_triton")
    columns = row_traj.shape[0]
    lower = max(written - capacity, 0)
    count = written - first + (1 if lower < first else 0)
    size = count * columns
    device = excluded.device
    flat = torch.empty(size, dtype=torch.int64, device=device)
    to_held = torch.empty(size, dtype=torch.float64, device=device)
    to_tree = torch.empty(size, dtype=torch.float64, device=device)
    if size == 0:
        return flat, to_held, to_tree
    block = block or EPISODES["BLOCK"]
    launch(_start_exclusions_kernel, (cdiv(size, block),), row_traj, start, stop, excluded, tree, held, flat, to_held,
           to_tree, first, written, lower, count, columns, capacity, kept, STRICT=bool(strict_length), BLOCK=block,
           num_warps=EPISODES["num_warps"])
    return flat, to_held, to_tree


#: What the launcher compiles, for the ahead-of-time check (``gpubuf.tools.aot``): the rows
#: kernel, and the lists kernel for a fresh index and a later write, with and without a list,
#: writing the ends or not.
SPECIALIZATIONS = [
    {
        "kernel": "_episode_rows_kernel",
        "label": "rows",
        "signature": {"breaks_ptr": "*u1", "ranks_ptr": "*i64", "head_ptr": "*i64", "start_ptr": "*i64",
                      "stop_ptr": "*i64", "row_traj_ptr": "*i64", "n": "i64", "columns": "i64", "capacity": "i64",
                      "written": "i64"},
        "constexprs": {"BLOCK": EPISODES["BLOCK"]},
        "num_warps": EPISODES["num_warps"],
    }
] + [
    {
        "kernel": "_episode_lists_kernel",
        "label": f"FRESH={int(fresh)},HAS_LIST={int(has_list)},WRITE_ENDS={int(write_ends)}",
        "signature": {"breaks_ptr": "*u1", "ranks_ptr": "*i64", "head_ptr": "*i64", "tail_ptr": "*i64",
                      "start_ptr": "*i64", "stop_ptr": "*i64", "row_traj_ptr": "*i64", "slots_ptr": "*i64",
                      "front_ptr": "*i64", "back_ptr": "*i64", "n": "i64", "columns": "i64", "capacity": "i64",
                      "lower": "i64", "length": "i64"},
        "constexprs": {"FRESH": fresh, "HAS_LIST": has_list, "WRITE_ENDS": write_ends, "BLOCK": EPISODES["LIST_BLOCK"]},
        "num_warps": EPISODES["num_warps"],
    }
    for fresh in (False, True)
    for has_list, write_ends in ((True, False), (True, True), (False, True))
] + [
    {
        "kernel": "_start_exclusions_kernel",
        "label": f"{leaves},STRICT={int(strict)}",
        "signature": {"row_traj_ptr": "*i64", "start_ptr": "*i64", "stop_ptr": "*i64", "excluded_ptr": "*u1",
                      "tree_ptr": f"*{leaves}", "held_ptr": f"*{leaves}", "flat_ptr": "*i64", "to_held_ptr": "*fp64",
                      "to_tree_ptr": "*fp64", "first": "i64", "written": "i64", "lower": "i64", "count": "i64",
                      "columns": "i64", "capacity": "i64", "kept": "i64"},
        "constexprs": {"STRICT": strict, "BLOCK": EPISODES["BLOCK"]},
        "num_warps": EPISODES["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for strict in (False, True)
]
