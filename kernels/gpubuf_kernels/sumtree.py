"""Triton kernels of the sum tree: a fused, sync-free update and a fused weighted draw.

The specification, layout and duplicate policy are in ``gpubuf.ops.sumtree`` (the torch twins).
The launchers take a ``SumTree``-like object (attributes ``leaves``, ``sums``, ``mins``,
``flags``, ``fanout``, ``depth``, ``level_offsets``, ``level_sizes``, ``offsets_tensor()``) and
mutate or read its tensors. Nothing here reads a device value on the host.

Update, in ``2 + (levels above the leaves' parents with more than TOP_WHOLE nodes)`` launches:
2 at 2**20 leaves, 3 from 2**21 to 2**26 (``_config.SUMTREE``), with no sort and no scratch kept
between calls:

1. ``_sumtree_claim_kernel``, one entry per lane: loads the raw priority (or the running maximum,
   1.0 while there is none, for new items), checks it, computes ``(p + eps) ** alpha`` in
   float64, and checks the index against ``limit``. A bad entry is skipped and its kind OR-ed
   into the tree's error word (``flags[0]``). A good entry stores its value in a per-call array
   and claims its leaf: ``atomic_min`` of the mark ``-1 - b`` on the leaf's bits. Marks are
   negative integers and leaf values are non-negative floats (non-negative as integers), so the
   leaf ends up holding the mark of the last entry that names it (the smallest mark): last wins,
   whatever order the programs run in. The running maximum (float64 bits, monotonic for
   non-negative values) is raised with ``atomic_max``.
2. ``_sumtree_write_kernel``: the entry whose mark a leaf holds (its winner) writes its value
   there and recomputes the leaves' parent node from the row of children. A marked child is
   read as the value its mark points to, so the row is the final one whether or not its winner
   has written yet; of the winners of one row, only the one in the lowest marked column
   recomputes the parent (any lower marked column is visible until its own winner writes, and
   that one then recomputes it), so each parent is written once.
3. ``_sumtree_refresh_kernel`` for each further level with more than ``TOP_WHOLE`` nodes: one
   row per entry whose parent launch 2 recomputed (ancestors shared by several entries are
   recomputed by each, from the same children: the same bits).

The last of these launches rebuilds the small top levels whole: every program counts itself
out on ``flags[1]`` (``atomic_add``, acquire-release), and the last one to arrive, which then
sees every other program's writes, recomputes the levels of at most ``TOP_WHOLE`` nodes from
their children, top-down reads ordered by a barrier, and resets the counter.

Sampling is one launch, ``_sumtree_sample_kernel``: each program descends ``BLOCK`` masses
through all levels (a ``tl.cumsum`` over each node's children, then the twin's child rule),
reads the leaf values and, when asked, writes the importance weights
``(value / p_min) ** (-beta)`` with ``p_min`` the root's minimum. A tree whose total is not
positive sets the ``empty`` bit of the error word.

Powers are CUDA's ``pow`` (libdevice), the function ``torch.pow`` runs on the GPU, so the twin's
results come out bit for bit; through the interpreter, which has no libdevice, they are
``exp(y * log(x))`` in float64, within a few ulps of it before rounding to the leaf dtype
(``alpha`` of 0 and 1 are exact either way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from gpubuf_kernels._config import SUMTREE
from gpubuf_kernels._launch import cdiv, check_launch_device, compiled, device_guard, launch

__all__ = ["ERROR_BITS", "SPECIALIZATIONS", "sumtree_sample_triton", "sumtree_update_triton"]

#: Bits of the error word ``flags[0]``.
BAD_PRIORITY = 1
OVERFLOW = 2
BAD_INDEX = 4
EMPTY = 8
ERROR_BITS = {"bad_priority": BAD_PRIORITY, "overflow": OVERFLOW, "bad_index": BAD_INDEX, "empty": EMPTY}


@triton.jit
def _pow(x, y, Y_IS_ZERO: tl.constexpr, Y_IS_ONE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """``x ** y`` in float64 for ``x >= 0`` (``0 ** y = 0`` for ``y > 0``; ``x ** 0 = 1``)."""
    if Y_IS_ZERO:
        return tl.full(x.shape, 1.0, tl.float64)
    elif Y_IS_ONE:
        return x
    elif LIBDEVICE:
        # CUDA's pow, the one torch.pow calls on the GPU: the twin's result bit for bit.
        return libdevice.pow(x, y)
    else:
        # log(0) = -inf would give 0 too; the where keeps the interpreter from warning about it.
        positive = x > 0.0
        return tl.where(positive, tl.exp(tl.log(tl.where(positive, x, 1.0)) * y), 0.0)


# ``limit`` (the items written) grows with every write while the buffer fills: specialised on its
# value it would compile a variant for each kind it takes (1, multiples of 16, others).
@triton.jit(do_not_specialize=["limit"])
def _sumtree_claim_kernel(
    leaf_bits_ptr,  # int32 (float32 leaves) or int64 (float64 leaves) [n_leaves_padded]: the leaves' bits
    index_ptr,  # any int [n]: leaf indices, negative to skip
    priority_ptr,  # any real [n], or [1] when ONE_PRIORITY
    value_ptr,  # leaf dtype [n], out: the transformed priorities
    max_bits_ptr,  # int64 [1]: bits of the float64 running maximum (-inf: none yet)
    flags_ptr,  # int32 [2]: error word, counter
    n,
    limit,
    # Annotated: a Python float would otherwise be passed as float32 (Triton's default), and the
    # transform must use the exponent the host was given, as the twin does.
    alpha: tl.float64,
    eps: tl.float64,
    ONE_PRIORITY: tl.constexpr,
    FROM_MAX: tl.constexpr,
    TRACK_MAX: tl.constexpr,
    ALPHA_ZERO: tl.constexpr,
    ALPHA_ONE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    idx = tl.load(index_ptr + offs, mask=inb, other=-1).to(tl.int64)
    if FROM_MAX:
        # New items: the running maximum, or 1.0 while it holds none.
        current = tl.load(max_bits_ptr).to(tl.float64, bitcast=True)
        p = tl.full([BLOCK], 1.0, tl.float64)
        p = tl.where(current >= 0.0, current, p)
    elif ONE_PRIORITY:
        p = tl.full([BLOCK], 1.0, tl.float64) * tl.load(priority_ptr).to(tl.float64)
    else:
        p = tl.load(priority_ptr + offs, mask=inb, other=0.0).to(tl.float64)
    # NaN fails both comparisons.
    good_p = (p >= 0.0) & (p < float("inf"))
    value = _pow(tl.where(good_p, p, 0.0) + eps, alpha, ALPHA_ZERO, ALPHA_ONE, LIBDEVICE).to(value_ptr.dtype.element_ty)
    good_v = value < float("inf")
    good_i = idx < limit
    bad_p = inb & ~good_p
    bad_v = inb & good_p & ~good_v
    bad_i = inb & ~good_i
    word = (
        tl.max(bad_p.to(tl.int32), axis=0) * 1
        | tl.max(bad_v.to(tl.int32), axis=0) * 2
        | tl.max(bad_i.to(tl.int32), axis=0) * 4
    )
    if word != 0:
        tl.atomic_or(flags_ptr, word)
    ok = inb & (idx >= 0) & good_p & good_v & good_i
    tl.store(value_ptr + offs, value, mask=ok)
    mark = (-1 - offs).to(leaf_bits_ptr.dtype.element_ty)
    tl.atomic_min(leaf_bits_ptr + tl.where(ok, idx, 0), mark, mask=ok)
    if TRACK_MAX:
        top = tl.max(tl.where(ok, p, -1.0), axis=0)
        if top >= 0.0:
            tl.atomic_max(max_bits_ptr, top.to(tl.int64, bitcast=True))


@triton.jit
def _rebuild_top(
    sums_ptr,
    mins_ptr,
    offsets_ptr,  # int64 [depth + 1]
    sizes_ptr,  # int64 [depth + 1]
    TOP_FROM: tl.constexpr,  # levels 0 .. TOP_FROM - 1 are rebuilt whole, bottom-up
    FANOUT: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
):
    cols = tl.arange(0, FANOUT)
    for step in tl.static_range(TOP_FROM):
        k = TOP_FROM - 1 - step
        parent_off = tl.multiple_of(tl.load(offsets_ptr + k), FANOUT)
        child_off = tl.multiple_of(tl.load(offsets_ptr + k + 1), FANOUT)
        m = tl.load(sizes_ptr + k)
        for start in range(0, m, NODE_BLOCK):
            node = start + tl.arange(0, NODE_BLOCK)
            live = node < m
            child = child_off + node[:, None] * FANOUT + cols[None, :]
            # .cg: read through L2, where the other programs' writes are.
            s = tl.load(sums_ptr + child, mask=live[:, None], other=0.0, cache_modifier=".cg")
            low = tl.load(mins_ptr + child, mask=live[:, None], other=float("inf"), cache_modifier=".cg")
            tl.store(sums_ptr + parent_off + node, tl.sum(s, axis=1), mask=live)
            tl.store(mins_ptr + parent_off + node, tl.min(low, axis=1), mask=live)
        tl.debug_barrier()  # this level's writes, by every thread, before the next level reads them


@triton.jit
def _last_program_rebuilds_top(
    sums_ptr, mins_ptr, offsets_ptr, sizes_ptr, flags_ptr,
    TOP_FROM: tl.constexpr, FANOUT: tl.constexpr, NODE_BLOCK: tl.constexpr,
):
    """Counts this program out; the last one rebuilds the top levels and resets the counter."""
    ticket = tl.atomic_add(flags_ptr + 1, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        _rebuild_top(sums_ptr, mins_ptr, offsets_ptr, sizes_ptr, TOP_FROM, FANOUT, NODE_BLOCK)
        tl.atomic_xchg(flags_ptr + 1, 0)


@triton.jit(do_not_specialize=["limit"])  # as the claim kernel's
def _sumtree_write_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]
    leaf_bits_ptr,  # the same memory as int32 or int64
    index_ptr,  # any int [n]
    value_ptr,  # leaf dtype [n]: the claim kernel's values
    sums_ptr,  # float64 [n_internal]
    mins_ptr,  # float64 [n_internal]
    rows_out_ptr,  # int64 [n], out: the parent this entry recomputed, else -1
    offsets_ptr,  # int64 [depth + 1]
    sizes_ptr,  # int64 [depth + 1]
    flags_ptr,  # int32 [2]
    n,
    limit,
    parent_off,  # offset of the leaves' parents in sums/mins (a multiple of FANOUT)
    FANOUT: tl.constexpr,
    SHIFT: tl.constexpr,  # log2(FANOUT)
    TOP_FROM: tl.constexpr,  # > 0: this launch is the update's last; rebuild levels below it whole
    NODE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    idx = tl.load(index_ptr + offs, mask=inb, other=-1).to(tl.int64)
    named = inb & (idx >= 0) & (idx < limit)
    safe = tl.where(named, idx, 0)
    mark = (-1 - offs).to(leaf_bits_ptr.dtype.element_ty)
    winner = named & (tl.load(leaf_bits_ptr + safe, mask=named, other=0) == mark)
    cols = tl.arange(0, FANOUT)
    row = safe >> SHIFT
    child = row[:, None] * FANOUT + cols[None, :]
    bits = tl.load(leaf_bits_ptr + child, mask=winner[:, None], other=0)
    marked = bits < 0
    claimed = tl.load(value_ptr + tl.where(marked, -1 - bits.to(tl.int64), 0), mask=winner[:, None] & marked, other=0.0)
    vals = tl.where(marked, claimed, bits.to(leaves_ptr.dtype.element_ty, bitcast=True)).to(tl.float64)
    first_marked = tl.min(tl.where(marked, cols[None, :], FANOUT), axis=1)
    leader = winner & (first_marked == (safe & (FANOUT - 1)))
    total = tl.sum(vals, axis=1)
    # Zero leaves (unwritten slots) do not count toward the minimum.
    low = tl.min(tl.where(vals > 0.0, vals, float("inf")), axis=1)
    tl.store(sums_ptr + parent_off + row, total, mask=leader)
    tl.store(mins_ptr + parent_off + row, low, mask=leader)
    tl.store(leaves_ptr + safe, tl.load(value_ptr + offs, mask=winner, other=0.0), mask=winner)
    tl.store(rows_out_ptr + offs, tl.where(leader, row, -1), mask=inb)
    if TOP_FROM > 0:
        _last_program_rebuilds_top(sums_ptr, mins_ptr, offsets_ptr, sizes_ptr, flags_ptr, TOP_FROM, FANOUT, NODE_BLOCK)


@triton.jit
def _sumtree_refresh_kernel(
    sums_ptr,  # float64 [n_internal]
    mins_ptr,  # float64 [n_internal]
    rows_ptr,  # int64 [n]: the leaves' parents recomputed by the write kernel, or -1
    offsets_ptr,  # int64 [depth + 1]
    sizes_ptr,  # int64 [depth + 1]
    flags_ptr,  # int32 [2]
    n,
    parent_off,  # offset of this level in sums/mins (a multiple of FANOUT)
    child_off,  # offset of the level below (a multiple of FANOUT)
    UP: tl.constexpr,  # SHIFT * (levels from the leaves' parents up to this level)
    FANOUT: tl.constexpr,
    TOP_FROM: tl.constexpr,
    NODE_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    below = tl.load(rows_ptr + offs, mask=inb, other=-1)
    ok = below >= 0
    node = tl.where(ok, below, 0) >> UP
    cols = tl.arange(0, FANOUT)
    child = child_off + node[:, None] * FANOUT + cols[None, :]
    s = tl.load(sums_ptr + child, mask=ok[:, None], other=0.0)
    low = tl.load(mins_ptr + child, mask=ok[:, None], other=float("inf"))
    tl.store(sums_ptr + parent_off + node, tl.sum(s, axis=1), mask=ok)
    tl.store(mins_ptr + parent_off + node, tl.min(low, axis=1), mask=ok)
    if TOP_FROM > 0:
        _last_program_rebuilds_top(sums_ptr, mins_ptr, offsets_ptr, sizes_ptr, flags_ptr, TOP_FROM, FANOUT, NODE_BLOCK)


@triton.jit
def _draw_leaves(
    leaves_ptr, sums_ptr, offsets_ptr, uniform_ptr, flags_ptr, offs, inb, n,
    DEPTH: tl.constexpr, FANOUT: tl.constexpr, STRATIFIED: tl.constexpr, BLOCK: tl.constexpr,
):
    """The leaves the draws ``offs`` (masked by ``inb``) of ``n`` descend to, as int64 ``[BLOCK]``;
    the first program sets the ``empty`` bit (8) of ``flags`` when the total is not positive.
    Shared by the plain draw and the prioritized slice windows (``gpubuf_kernels.slice``)."""
    u = tl.load(uniform_ptr + offs, mask=inb, other=0.0)
    total = tl.load(sums_ptr)
    if tl.program_id(0) == 0:
        if not (total > 0.0):
            tl.atomic_or(flags_ptr, 8)
    if STRATIFIED:
        mass = (u + offs.to(tl.float64)) * (total / n)
    else:
        mass = u * total
    cols = tl.arange(0, FANOUT)
    node = tl.zeros([BLOCK], dtype=tl.int64)
    mask2 = inb[:, None]
    for lvl in tl.static_range(1, DEPTH + 1):
        child = node[:, None] * FANOUT + cols[None, :]
        if lvl == DEPTH:
            vals = tl.load(leaves_ptr + child, mask=mask2, other=0.0).to(tl.float64)
        else:
            off = tl.multiple_of(tl.load(offsets_ptr + lvl), FANOUT)
            vals = tl.load(sums_ptr + off + child, mask=mask2, other=0.0)
        csum = tl.cumsum(vals, axis=1)
        first = tl.sum((csum <= mass[:, None]).to(tl.int32), axis=1)
        # The twin's rule, written so that it also holds for a parallel scan whose prefixes may
        # round differently: the first positive child at or after `first`, else the last
        # positive child, else 0. A zero child is never taken while the node's sum is positive.
        positive = vals > 0
        after = tl.min(tl.where(positive & (cols[None, :] >= first[:, None]), cols[None, :], FANOUT), axis=1)
        last = tl.max(tl.where(positive, cols[None, :], 0), axis=1)
        pick = tl.where(after < FANOUT, after, last)
        # The exclusive prefix is read from the same cumsum the comparison used.
        prev = tl.max(tl.where(cols[None, :] < pick[:, None], csum, 0.0), axis=1)
        mass = mass - prev
        node = node * FANOUT + pick
    return node


@triton.jit
def _importance_weight(value, p_min, beta, LIBDEVICE: tl.constexpr):
    """TorchRL's ``(value / p_min) ** (-beta)`` in float64: CUDA's ``pow`` compiled, ``exp(-beta *
    log(ratio))`` under the interpreter (which has no libdevice)."""
    ratio = value.to(tl.float64) / p_min
    if LIBDEVICE:
        weight = libdevice.pow(ratio, -beta)
    else:
        positive = ratio > 0.0
        weight = tl.where(positive, tl.exp(tl.log(tl.where(positive, ratio, 1.0)) * -beta), float("inf"))
    return weight


@triton.jit
def _sumtree_sample_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]
    sums_ptr,  # float64 [n_internal]
    mins_ptr,  # float64 [n_internal]
    offsets_ptr,  # int64 [depth + 1]: level offsets in sums
    uniform_ptr,  # float64 [n]: draws in [0, 1)
    index_out_ptr,  # int64 [n]
    value_out_ptr,  # leaf dtype [n]
    weight_out_ptr,  # leaf dtype [n] (unused without HAS_WEIGHTS)
    flags_ptr,  # int32 [2]
    n,
    beta: tl.float64,  # float64, not Triton's default float32 for a Python float
    DEPTH: tl.constexpr,
    FANOUT: tl.constexpr,
    STRATIFIED: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    node = _draw_leaves(leaves_ptr, sums_ptr, offsets_ptr, uniform_ptr, flags_ptr, offs, inb, n,
                        DEPTH, FANOUT, STRATIFIED, BLOCK)
    value = tl.load(leaves_ptr + node, mask=inb, other=0.0)
    tl.store(index_out_ptr + offs, node, mask=inb)
    tl.store(value_out_ptr + offs, value, mask=inb)
    if HAS_WEIGHTS:
        weight = _importance_weight(value, tl.load(mins_ptr), beta, LIBDEVICE)
        tl.store(weight_out_ptr + offs, weight.to(weight_out_ptr.dtype.element_ty), mask=inb)


def _check_tree(tree) -> None:
    if tree.leaves.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"leaves must be float32 or float64, got {tree.leaves.dtype}")
    for name in ("sums", "mins"):
        t = getattr(tree, name)
        if t.dtype != torch.float64:
            raise TypeError(f"tree.{name} must be float64, got {t.dtype}")
        if t.device != tree.leaves.device:
            raise ValueError(f"tree.{name} is on {t.device}, the leaves on {tree.leaves.device}")
        if not t.is_contiguous():
            raise ValueError(f"tree.{name} must be contiguous")
    if not tree.leaves.is_contiguous():
        raise ValueError("tree.leaves must be contiguous")
    if tree.flags.dtype != torch.int32 or tree.flags.shape != (2,) or tree.flags.device != tree.leaves.device:
        raise TypeError("tree.flags must be an int32 tensor of shape [2] on the tree's device")


def _geometry(tree):
    """``(sizes tensor, first level rebuilt whole)`` of a tree, cached on it."""
    cached = getattr(tree, "_triton_geometry", None)
    if cached is not None and cached[0].device == tree.leaves.device:
        return cached
    top = SUMTREE["TOP_WHOLE"]
    top_from = 0
    while top_from < tree.depth - 1 and tree.level_sizes[top_from] <= top:
        top_from += 1
    sizes = torch.tensor(tree.level_sizes, dtype=torch.int64, device=tree.leaves.device)
    tree._triton_geometry = (sizes, top_from)
    return tree._triton_geometry


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}




#: Compiled kernels take CUDA's ``pow`` (torch's on the GPU); the interpreter, which has no
#: libdevice, ``exp(y * log(x))``, within a few ulps of it.
_LIBDEVICE = compiled(_sumtree_claim_kernel)


def sumtree_update_triton(
    tree,
    index: torch.Tensor,
    priority: torch.Tensor | None,
    *,
    alpha: float = 1.0,
    eps: float = 0.0,
    limit: int | None = None,
    max_priority: torch.Tensor | None = None,
    block: int | None = None,
) -> None:
    """Writes ``(priority + eps) ** alpha`` at ``index`` (last occurrence wins, negatives skipped),
    refreshes the ancestors and raises the running maximum, without a host synchronisation.

    Args:
        tree: a ``SumTree``; ``leaves``, ``sums``, ``mins`` and ``flags`` are mutated in place.
        index: 1-D integer ``[B]`` leaf indices, negative to skip, on the tree's device.
        priority: ``[B]`` or ``[1]`` raw priorities (any real dtype), same device; or None for
            new items: ``max_priority``, or 1.0 while it holds none.
        alpha, eps: the transform, finite and ``>= 0``.
        limit: entries with an index ``>= limit`` are skipped and reported (default capacity).
        max_priority: float64 ``[1]`` running maximum (``-inf``: none), raised in place; or None.
        block: entries per program (default ``BLOCK`` of ``_config.SUMTREE``).

    Raises:
        TypeError, ValueError: wrong dtypes, devices, shapes or layouts (checked on the host,
        from metadata only). Bad values are recorded in ``tree.flags[0]``, never raised here.
    """
    _check_tree(tree)
    device = tree.leaves.device
    check_launch_device(device, "sumtree_update_triton")
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool or index.ndim != 1:
        raise TypeError(f"index must be a 1-D integer tensor, got {index.dtype} of shape {list(index.shape)}")
    n = index.numel()
    if priority is not None:
        if priority.dtype.is_complex or priority.dtype == torch.bool or priority.ndim != 1:
            raise TypeError(f"priority must be a 1-D real tensor, got {priority.dtype} of shape {list(priority.shape)}")
        if priority.numel() not in (1, n):
            raise TypeError(f"priority must hold 1 or {n} values, got {priority.numel()}")
        if priority.device != device:
            raise ValueError(f"priority is on {priority.device}, the tree on {device}")
    if max_priority is not None and (
        max_priority.dtype != torch.float64 or max_priority.shape != (1,) or max_priority.device != device
    ):
        raise TypeError(f"max_priority must be a float64 tensor of shape [1] on {device}")
    if index.device != device:
        raise ValueError(f"index is on {index.device}, the tree on {device}")
    if n == 0:
        return
    limit = tree.capacity if limit is None else limit
    index = index.contiguous()
    sizes, top_from = _geometry(tree)
    offsets = tree.offsets_tensor()
    bits = tree.leaves.view(_BITS[tree.leaves.dtype])
    values = torch.empty(n, dtype=tree.leaves.dtype, device=device)
    rows = torch.empty(n, dtype=torch.int64, device=device)
    if max_priority is not None:
        max_bits = max_priority.view(torch.int64)
    elif priority is None:
        max_bits = torch.full((1,), -float("inf"), dtype=torch.float64, device=device).view(torch.int64)  # "none yet"
    else:
        # Read only with FROM_MAX or TRACK_MAX, neither of which this launch has: any int64
        # tensor of the device stands in, where a new -inf one would cost a launch.
        max_bits = rows
    blk = block or SUMTREE["BLOCK"]
    grid = (cdiv(n, blk),)
    warps = SUMTREE["num_warps"]
    with device_guard(device):
        launch(
            _sumtree_claim_kernel, grid,
            bits, index, tree.leaves if priority is None else priority.contiguous(), values, max_bits, tree.flags,
            n, limit, float(alpha), float(eps),
            ONE_PRIORITY=priority is not None and priority.numel() == 1 and n != 1,
            FROM_MAX=priority is None,
            TRACK_MAX=max_priority is not None,
            ALPHA_ZERO=alpha == 0,
            ALPHA_ONE=alpha == 1,
            LIBDEVICE=_LIBDEVICE,
            BLOCK=blk,
            num_warps=warps,
        )
    shift = tree.fanout.bit_length() - 1
    leaf_parents = tree.depth - 1
    mid = [k for k in range(leaf_parents - 1, top_from - 1, -1)]  # levels refreshed per entry above the leaves' parents
    node_block = SUMTREE["NODE_BLOCK"]
    with device_guard(device):
        launch(
            _sumtree_write_kernel, grid,
            tree.leaves, bits, index, values, tree.sums, tree.mins, rows, offsets, sizes, tree.flags,
            n, limit, tree.level_offsets[leaf_parents],
            FANOUT=tree.fanout, SHIFT=shift, TOP_FROM=0 if mid else top_from, NODE_BLOCK=node_block, BLOCK=blk,
            num_warps=warps,
        )
        for step, k in enumerate(mid, start=1):
            launch(
                _sumtree_refresh_kernel, grid,
                tree.sums, tree.mins, rows, offsets, sizes, tree.flags,
                n, tree.level_offsets[k], tree.level_offsets[k + 1],
                UP=shift * step, FANOUT=tree.fanout, TOP_FROM=top_from if k == mid[-1] else 0,
                NODE_BLOCK=node_block, BLOCK=blk, num_warps=warps,
            )


def sumtree_sample_triton(
    tree, uniforms: torch.Tensor, *, stratified: bool = False, beta: float | None = None, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Descends ``B`` masses from ``uniforms`` in one launch.

    Args:
        tree: a ``SumTree``; only read (but for the ``empty`` bit of ``flags[0]``).
        uniforms: ``float64 [B]`` draws in ``[0, 1)`` on the tree's device.
        stratified: masses ``(u_b + b) * total / B`` instead of ``u_b * total``.
        beta: when given, also the importance weights ``(value / p_min) ** (-beta)``.
        block: masses per program (default: ``SAMPLE_BLOCK`` of ``_config.SUMTREE``).

    Returns:
        ``(int64 index [B], leaf-dtype value [B], leaf-dtype weight [B] or None)``.

    Raises:
        TypeError, ValueError: wrong dtypes, devices, shapes or layouts.
    """
    _check_tree(tree)
    device = tree.leaves.device
    check_launch_device(device, "sumtree_sample_triton")
    if uniforms.dtype != torch.float64 or uniforms.ndim != 1:
        raise TypeError(f"uniforms must be a 1-D float64 tensor, got {uniforms.dtype} of shape {list(uniforms.shape)}")
    if uniforms.device != device:
        raise ValueError(f"uniforms are on {uniforms.device}, the tree on {device}")
    uniforms = uniforms.contiguous()
    n = uniforms.numel()
    index = torch.empty(n, dtype=torch.int64, device=device)
    value = torch.empty(n, dtype=tree.leaves.dtype, device=device)
    weight = torch.empty(n, dtype=tree.leaves.dtype, device=device) if beta is not None else None
    if n == 0:
        return index, value, weight
    blk = block or SUMTREE["SAMPLE_BLOCK"]
    with device_guard(device):
        launch(
            _sumtree_sample_kernel, (cdiv(n, blk),),
            tree.leaves, tree.sums, tree.mins, tree.offsets_tensor(), uniforms, index, value,
            value if weight is None else weight, tree.flags, n, 0.0 if beta is None else float(beta),
            DEPTH=tree.depth, FANOUT=tree.fanout, STRATIFIED=stratified, HAS_WEIGHTS=beta is not None,
            LIBDEVICE=_LIBDEVICE, BLOCK=blk, num_warps=SUMTREE["num_warps"],
        )
    return index, value, weight


def _leaf_types(leaves: str) -> tuple[str, str]:
    """Pointer types of the leaves and of their bits."""
    return ("*fp32", "*i32") if leaves == "fp32" else ("*fp64", "*i64")


#: What the launchers compile (the AOT compile check reads this): fp32 and fp64 leaves; the claim
#: with one priority per entry, one for all and new items' (the running maximum); the write as the
#: update's last launch (rebuilding the top, 3 levels at 1M leaves) or not; the refresh of a further
#: level; the draw at depth 3 (up to 32K leaves at fan-out 32), 4 (1M) and 5, i.i.d. and
#: stratified, with and without weights. Indices int64, priorities float32 or float64. The types
#: are the ones Triton's JIT gives the launchers' arguments (``tests/kernels/test_launched_kernels.py``
#: records the launches of the device path and checks them against this table).
SPECIALIZATIONS = [
    {
        "kernel": "_sumtree_claim_kernel",
        "label": f"{leaves},{kind},priorities={priorities}",
        "signature": {"leaf_bits_ptr": _leaf_types(leaves)[1], "index_ptr": "*i64", "priority_ptr": f"*{priorities}",
                      "value_ptr": _leaf_types(leaves)[0], "max_bits_ptr": "*i64", "flags_ptr": "*i32", "n": "i32",
                      "limit": "i64", "alpha": "fp64", "eps": "fp64"},
        "constexprs": {"ONE_PRIORITY": kind == "one", "FROM_MAX": kind == "new", "TRACK_MAX": True, "ALPHA_ZERO": False,
                       "ALPHA_ONE": False, "LIBDEVICE": True, "BLOCK": SUMTREE["BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for kind in ("each", "one", "new")
    for priorities in ("fp32", "fp64")
] + [
    {
        "kernel": "_sumtree_write_kernel",
        "label": f"{leaves},top_from={top_from}",
        "signature": {"leaves_ptr": _leaf_types(leaves)[0], "leaf_bits_ptr": _leaf_types(leaves)[1], "index_ptr": "*i64",
                      "value_ptr": _leaf_types(leaves)[0], "sums_ptr": "*fp64", "mins_ptr": "*fp64", "rows_out_ptr": "*i64",
                      "offsets_ptr": "*i64", "sizes_ptr": "*i64", "flags_ptr": "*i32", "n": "i32", "limit": "i64",
                      "parent_off": "i64"},
        "constexprs": {"FANOUT": 32, "SHIFT": 5, "TOP_FROM": top_from, "NODE_BLOCK": SUMTREE["NODE_BLOCK"],
                       "BLOCK": SUMTREE["BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for top_from in (0, 3)
] + [
    {
        "kernel": "_sumtree_refresh_kernel",
        "label": "top_from=3",
        "signature": {"sums_ptr": "*fp64", "mins_ptr": "*fp64", "rows_ptr": "*i64", "offsets_ptr": "*i64",
                      "sizes_ptr": "*i64", "flags_ptr": "*i32", "n": "i32", "parent_off": "i64", "child_off": "i64"},
        "constexprs": {"UP": 5, "FANOUT": 32, "TOP_FROM": 3, "NODE_BLOCK": SUMTREE["NODE_BLOCK"], "BLOCK": SUMTREE["BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
] + [
    {
        "kernel": "_sumtree_sample_kernel",
        "label": f"{leaves},depth={depth},stratified={stratified},weights={weights}",
        "signature": {"leaves_ptr": _leaf_types(leaves)[0], "sums_ptr": "*fp64", "mins_ptr": "*fp64",
                      "offsets_ptr": "*i64", "uniform_ptr": "*fp64", "index_out_ptr": "*i64",
                      "value_out_ptr": _leaf_types(leaves)[0], "weight_out_ptr": _leaf_types(leaves)[0],
                      "flags_ptr": "*i32", "n": "i32", "beta": "fp64"},
        "constexprs": {"DEPTH": depth, "FANOUT": 32, "STRATIFIED": stratified, "HAS_WEIGHTS": weights, "LIBDEVICE": True,
                       "BLOCK": SUMTREE["SAMPLE_BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for depth in (3, 4, 5)
    for stratified in (False, True)
    for weights in (False, True)
]
