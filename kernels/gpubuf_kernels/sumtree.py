"""Triton kernels of the sum tree: leaf writes, per-level refresh, prefix-sum descent.

The specification, layout and duplicate policy are in ``gpubuf.ops.sumtree`` (the torch twins).
The launchers take a ``SumTree``-like object (attributes ``leaves``, ``sums``, ``mins``,
``fanout``, ``depth``, ``level_offsets``, ``offsets_tensor()``) and mutate or read its tensors.

Update, in ``depth + 1`` launches after a torch pre-pass:

1. torch: a stable sort of the indices; every entry but the last of a run of equal indices, and
   every negative index, becomes ``-1`` (skipped). No host synchronisation, and the surviving
   indices are unique, so the leaf writes never race.
2. ``_sumtree_set_leaves_kernel``: ``leaves[index[b]] = value[b]``.
3. ``_sumtree_refresh_kernel`` once per level, bottom-up: entry ``b`` recomputes the sum and min
   of its leaf's ancestor on that level from the children. Several entries may share an
   ancestor; they read the same children (written by the previous launch) and store the same
   bits, so the result does not depend on the order programs run in.

Sampling is one launch: each program descends ``BLOCK`` masses through all levels, with a
``tl.cumsum`` over each node's children and a prefix search ``tl.sum(cumsum <= mass)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import SUMTREE
from gpubuf_kernels._launch import launch

__all__ = ["sumtree_sample_triton", "sumtree_update_triton", "SPECIALIZATIONS"]



@triton.jit
def _sumtree_set_leaves_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]
    index_ptr,  # int64 [n]: unique leaf indices, or -1 to skip
    value_ptr,  # leaf dtype [n]
    n,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    idx = tl.load(index_ptr + offs, mask=inb, other=-1)
    ok = inb & (idx >= 0)
    val = tl.load(value_ptr + offs, mask=ok, other=0.0)
    tl.store(leaves_ptr + tl.where(ok, idx, 0), val, mask=ok)


@triton.jit
def _sumtree_refresh_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]
    sums_ptr,  # float64 [n_internal]
    mins_ptr,  # float64 [n_internal]
    index_ptr,  # int64 [n]: leaf indices, or -1 to skip
    n,
    divisor,  # fanout ** (depth - level): leaf index // divisor = ancestor on this level
    parent_off,  # offset of this level in sums/mins
    child_off,  # offset of the child level in sums/mins (unused when CHILD_IS_LEAF)
    FANOUT: tl.constexpr,
    CHILD_IS_LEAF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    idx = tl.load(index_ptr + offs, mask=inb, other=-1)
    ok = inb & (idx >= 0)
    node = tl.where(ok, idx, 0) // divisor
    cols = tl.arange(0, FANOUT)
    child = node[:, None] * FANOUT + cols[None, :]
    mask2 = ok[:, None]
    if CHILD_IS_LEAF:
        vals = tl.load(leaves_ptr + child, mask=mask2, other=0.0).to(tl.float64)
        total = tl.sum(vals, axis=1)
        # Zero leaves (unwritten slots) do not count toward the minimum.
        low = tl.min(tl.where(vals > 0, vals, float("inf")), axis=1)
    else:
        vals = tl.load(sums_ptr + child_off + child, mask=mask2, other=0.0)
        mins = tl.load(mins_ptr + child_off + child, mask=mask2, other=float("inf"))
        total = tl.sum(vals, axis=1)
        low = tl.min(mins, axis=1)
    tl.store(sums_ptr + parent_off + node, total, mask=ok)
    tl.store(mins_ptr + parent_off + node, low, mask=ok)


@triton.jit
def _sumtree_sample_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]
    sums_ptr,  # float64 [n_internal]
    offsets_ptr,  # int64 [depth + 1]: level offsets in sums
    uniform_ptr,  # float64 [n]: draws in [0, 1)
    index_out_ptr,  # int64 [n]
    value_out_ptr,  # leaf dtype [n]
    n,
    DEPTH: tl.constexpr,
    FANOUT: tl.constexpr,
    STRATIFIED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    u = tl.load(uniform_ptr + offs, mask=inb, other=0.0)
    total = tl.load(sums_ptr)
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
            off = tl.load(offsets_ptr + lvl)
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
    value = tl.load(leaves_ptr + node, mask=inb, other=0.0)
    tl.store(index_out_ptr + offs, node, mask=inb)
    tl.store(value_out_ptr + offs, value, mask=inb)


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


def _last_wins_keys(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted indices with every duplicate but the last, and every negative, set to -1; and the sort order."""
    sorted_index, perm = torch.sort(index, stable=True)
    keys = sorted_index.clone()
    if keys.numel() > 1:
        # A stable sort keeps equal indices in call order: the last of each run is the last write.
        keys[:-1].masked_fill_(sorted_index[1:] == sorted_index[:-1], -1)
    keys.masked_fill_(keys < 0, -1)
    return keys, perm


def sumtree_update_triton(tree, index: torch.Tensor, values: torch.Tensor, *, block: int | None = None) -> None:
    """Writes ``values`` to leaves ``index`` (last occurrence wins, negatives skipped) and refreshes ancestors.

    Args:
        tree: a ``SumTree``; ``leaves``, ``sums`` and ``mins`` are mutated in place.
        index: ``int64 [B]`` leaf indices in ``[0, capacity)`` or negative, on the tree's device.
        values: leaf-dtype ``[B]`` transformed priorities ``(p + eps) ** alpha``, same device.
        block: entries per program (default: ``LEAF_BLOCK`` and ``REFRESH_BLOCK`` of
            ``_config.SUMTREE``).

    Raises:
        TypeError, ValueError: wrong dtypes, devices, shapes or layouts.
    """
    _check_tree(tree)
    device = tree.leaves.device
    if index.dtype != torch.int64 or index.ndim != 1:
        raise TypeError(f"index must be a 1-D int64 tensor, got {index.dtype} of shape {list(index.shape)}")
    if values.dtype != tree.leaves.dtype or values.shape != index.shape:
        raise TypeError(
            f"values must be {tree.leaves.dtype} of shape {list(index.shape)}, got {values.dtype} {list(values.shape)}"
        )
    if index.device != device or values.device != device:
        raise ValueError(f"index and values must be on the tree's device {device}")
    n = index.numel()
    if n == 0:
        return
    keys, perm = _last_wins_keys(index)
    vals = values.index_select(0, perm)
    leaf_block = block or SUMTREE["LEAF_BLOCK"]
    launch(
        _sumtree_set_leaves_kernel, (triton.cdiv(n, leaf_block),),
        tree.leaves, keys, vals, n, BLOCK=leaf_block, num_warps=SUMTREE["num_warps"]
    )
    refresh_block = block or SUMTREE["REFRESH_BLOCK"]
    grid = (triton.cdiv(n, refresh_block),)
    divisor = 1
    for level in range(tree.depth - 1, -1, -1):
        divisor *= tree.fanout
        child_is_leaf = level == tree.depth - 1
        launch(
            _sumtree_refresh_kernel, grid,
            tree.leaves,
            tree.sums,
            tree.mins,
            keys,
            n,
            divisor,
            tree.level_offsets[level],
            0 if child_is_leaf else tree.level_offsets[level + 1],
            FANOUT=tree.fanout,
            CHILD_IS_LEAF=child_is_leaf,
            BLOCK=refresh_block,
            num_warps=SUMTREE["num_warps"],
        )


def sumtree_sample_triton(
    tree, uniforms: torch.Tensor, *, stratified: bool = False, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Descends ``B`` masses from ``uniforms``; returns ``(int64 index [B], leaf-dtype value [B])``.

    Args:
        tree: a ``SumTree``; only read.
        uniforms: ``float64 [B]`` draws in ``[0, 1)`` on the tree's device, contiguous.
        stratified: masses ``(u_b + b) * total / B`` instead of ``u_b * total``.
        block: masses per program (default: ``SAMPLE_BLOCK`` of ``_config.SUMTREE``).

    Raises:
        TypeError, ValueError: wrong dtypes, devices, shapes or layouts.
    """
    _check_tree(tree)
    device = tree.leaves.device
    if uniforms.dtype != torch.float64 or uniforms.ndim != 1:
        raise TypeError(f"uniforms must be a 1-D float64 tensor, got {uniforms.dtype} of shape {list(uniforms.shape)}")
    if uniforms.device != device:
        raise ValueError(f"uniforms are on {uniforms.device}, the tree on {device}")
    uniforms = uniforms.contiguous()
    n = uniforms.numel()
    index = torch.empty(n, dtype=torch.int64, device=device)
    value = torch.empty(n, dtype=tree.leaves.dtype, device=device)
    if n == 0:
        return index, value
    blk = block or SUMTREE["SAMPLE_BLOCK"]
    launch(
        _sumtree_sample_kernel, (triton.cdiv(n, blk),),
        tree.leaves,
        tree.sums,
        tree.offsets_tensor(),
        uniforms,
        index,
        value,
        n,
        DEPTH=tree.depth,
        FANOUT=tree.fanout,
        STRATIFIED=stratified,
        BLOCK=blk,
        num_warps=SUMTREE["num_warps"],
    )
    return index, value


def _leaf_type(dtype: str) -> str:
    return "*fp32" if dtype == "fp32" else "*fp64"


#: What the launchers compile (the AOT compile check reads this): fp32 and fp64 leaves, both
#: refresh kinds, and the draw at depth 4 (up to 1M leaves at fan-out 32) and 5, i.i.d. and
#: stratified.
SPECIALIZATIONS = [
    {
        "kernel": "_sumtree_set_leaves_kernel",
        "label": leaves,
        "signature": {"leaves_ptr": _leaf_type(leaves), "index_ptr": "*i64", "value_ptr": _leaf_type(leaves), "n": "i32"},
        "constexprs": {"BLOCK": SUMTREE["LEAF_BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
] + [
    {
        "kernel": "_sumtree_refresh_kernel",
        "label": f"{leaves},child_is_leaf={child_is_leaf}",
        "signature": {"leaves_ptr": _leaf_type(leaves), "sums_ptr": "*fp64", "mins_ptr": "*fp64", "index_ptr": "*i64",
                      "n": "i32", "divisor": "i64", "parent_off": "i64", "child_off": "i64"},
        "constexprs": {"FANOUT": 32, "CHILD_IS_LEAF": child_is_leaf, "BLOCK": SUMTREE["REFRESH_BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for child_is_leaf in (False, True)
] + [
    {
        "kernel": "_sumtree_sample_kernel",
        "label": f"{leaves},depth={depth},stratified={stratified}",
        "signature": {"leaves_ptr": _leaf_type(leaves), "sums_ptr": "*fp64", "offsets_ptr": "*i64",
                      "uniform_ptr": "*fp64", "index_out_ptr": "*i64", "value_out_ptr": _leaf_type(leaves), "n": "i32"},
        "constexprs": {"DEPTH": depth, "FANOUT": 32, "STRATIFIED": stratified, "BLOCK": SUMTREE["SAMPLE_BLOCK"]},
        "num_warps": SUMTREE["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for depth in (4, 5)
    for stratified in (False, True)
]
