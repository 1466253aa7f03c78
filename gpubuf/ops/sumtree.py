"""Sum tree for prioritized sampling: batched leaf updates and prefix-sum descent.

Tree shape
----------
A complete ``F``-ary tree (``F = fanout``, a power of two, 32 by default) over ``capacity``
leaves, stored level by level:

* ``leaves``: ``[(m_{D-1} + 1) * F]`` in the tree's ``dtype`` (``float32`` or ``float64``),
  leaf ``i`` at position ``i``. It holds the transformed priority ``(p + eps) ** alpha``; a leaf
  never written, and the padding past ``capacity``, hold ``0``.
* ``D = depth`` internal levels, level ``0`` being the root. Level ``k`` has ``m_k`` nodes with
  ``m_0 = 1`` and ``m_k = ceil(m_{k+1} / F)`` (``m_D = capacity``); ``D`` is the smallest
  ``D >= 1`` with ``F ** D >= capacity`` (4 for ``capacity = 2**20``). The children of node
  ``j`` of level ``k`` are the entries ``[j * F, (j + 1) * F)`` of level ``k + 1`` (of
  ``leaves`` for ``k = D - 1``). Level ``k >= 1`` holds ``(m_{k-1} + 1) * F`` entries: every
  row of ``F`` children exists (loads need no bounds but the batch's), and one more row of
  zeros (``sums``) / ``+inf`` (``mins``) ends each level, so that the torch twin can send any
  out-of-range node of its fast path to a row that leads only to zero leaves.
* ``sums`` and ``mins``: all internal levels of ``float64`` concatenated, level ``k`` at
  ``level_offsets[k]``. ``sums`` holds the sum of a node's children (``0`` for padding),
  ``mins`` the minimum over the positive leaves below the node (``+inf`` where there is none).
  The root's ``sums`` entry is the total mass, its ``mins`` entry the smallest positive leaf.

Why this shape: a wide fan-out keeps the depth at 4 for a million leaves, and one program (or
one vectorized torch step) handles a whole row of children with a prefix-sum. Every parent is
recomputed from its children (never updated by a delta), and internal nodes are ``float64``:
no error accumulates across updates, the root always equals the sum of the leaves up to one
``float64`` reduction's rounding. On the CPU a node's sum is its children added left to right
(:func:`_row_sums`), the order of the descent's prefix sums, so every CPU path (twin, torch fast
path, compiled kernel, rebuild) writes the same bits. The minimum skips zero leaves, so unwritten slots do not count
and ``p_min`` is the minimum over the items that can be sampled.

Ops
---
* :func:`sumtree_update` (twin :func:`sumtree_update_ref`): set ``B`` leaves and bring their
  ancestors up to date, ``O(B * F * D)`` work.
* :func:`sumtree_sample` (twin :func:`sumtree_sample_ref`): ``B`` uniforms to leaf indices and
  leaf values by descending the tree.
* :meth:`SumTree.total`, :meth:`SumTree.min`: the root's sum and minimum, as 0-d tensors (no
  host synchronisation).
* :func:`sumtree_rebuild`: recompute every internal node from the leaves, ``O(capacity)``.
* :func:`importance_weights`: ``(value / p_min) ** (-beta)``.
* :func:`sumtree_sample_weighted`: a draw with its weights. :func:`sumtree_update_compiled` (which
  also reports the batch's largest priority) and
  :func:`sumtree_draw_compiled` are each one compiled call on a CPU tree, for a sampler's hot
  path (their weights and transforms use the C library's ``pow``; see there).

CUDA trees run Triton kernels. CPU trees run the compiled loops of ``gpubuf_kernels.cpu.sumtree``
when Numba is installed (a B = 256 update or descent is then a few microseconds instead of
dozens of torch calls), else a torch path of their own ("CPU fast path" at the end of this
module); both give results equal, bit for bit, to the twins'.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from gpubuf.errors import DeviceMismatchError, IndexOutOfRangeError, PriorityError
from gpubuf.ops._dispatch import kernel_module, numba_enabled, resolve_backend
from gpubuf.host_memory import HUGE_PAGE_BYTES, empty_host

__all__ = [
    "SumTree",
    "importance_weights",
    "sumtree_rebuild",
    "sumtree_sample",
    "sumtree_sample_ref",
    "sumtree_sample_weighted",
    "sumtree_draw_compiled",
    "sumtree_draw_compiled_ready",
    "sumtree_update",
    "sumtree_update_compiled",
    "sumtree_update_compiled_ready",
    "sumtree_update_ref",
    "transform_priority",
]

DEFAULT_FANOUT = 32
_LEAF_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed 1-D tensor; on the CPU, one of 2 MiB or more on transparent huge pages.

    A descent reads a few entries in rows scattered over the leaves, and a training step's gather
    of scattered storage rows between two descents evicts their 4 KiB pages from the TLB; the
    leaves of a tree of 2**20 float32 priorities fit two huge pages.
    """
    if device.type == "cpu" and n * dtype.itemsize >= HUGE_PAGE_BYTES:
        return empty_host((n,), dtype, huge_from=HUGE_PAGE_BYTES, reuse=False).zero_()
    return torch.zeros(n, dtype=dtype, device=device)


class SumTree:
    """Sum and min tree over ``capacity`` leaves; see the module docstring for the layout.

    Args:
        capacity: number of leaves, ``>= 1``.
        dtype: leaf dtype, ``torch.float32`` or ``torch.float64``. Internal nodes are always
            ``float64``.
        device: where every tensor of the tree lives; the ops run there.
        fanout: children per node, a power of two ``>= 2``.

    Attributes:
        leaves, sums, mins: the tensors described in the module docstring. The ops mutate them
            in place; read them, do not write them.
        level_offsets: tuple of ``depth + 1`` ints, the start of each internal level in
            ``sums``/``mins`` and (last) their length.
        level_sizes: tuple of ``depth + 1`` ints ``m_0 .. m_D`` (``m_D = capacity``).
    """

    def __init__(
        self,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        fanout: int = DEFAULT_FANOUT,
    ) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 2 or fanout & (fanout - 1):
            raise ValueError(f"fanout must be a power of two >= 2, got {fanout!r}")
        if dtype not in _LEAF_DTYPES:
            raise TypeError(f"leaf dtype must be torch.float32 or torch.float64, got {dtype}")
        self.capacity = capacity
        self.fanout = fanout
        self.dtype = dtype
        device = torch.device("cpu" if device is None else device)
        sizes = [capacity]
        while len(sizes) == 1 or sizes[-1] > 1:
            sizes.append(-(-sizes[-1] // fanout))
        self.level_sizes = tuple(reversed(sizes))  # m_0 = 1 .. m_D = capacity
        self.depth = len(self.level_sizes) - 1
        padded = [1] + [(self.level_sizes[k - 1] + 1) * fanout for k in range(1, self.depth)]
        offsets = [0]
        for size in padded:
            offsets.append(offsets[-1] + size)
        self.level_offsets = tuple(offsets)
        n_internal = offsets[-1]
        self.leaves = _zeros((self.level_sizes[-2] + 1) * fanout, dtype, device)
        self.sums = _zeros(n_internal, torch.float64, device)
        self.mins = _zeros(n_internal, torch.float64, device).fill_(math.inf)
        self._reset_views()

    def _reset_views(self) -> None:
        self._offsets_tensor: torch.Tensor | None = None
        self._views: dict[str, list[torch.Tensor]] | None = None
        self._plan: _CpuPlan | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Cached views and the CPU path's scratch are rebuilt on first use: pickling them would
        # copy (or, between processes, share) tensors that belong to this process only.
        state = dict(self.__dict__)
        state["_offsets_tensor"] = state["_views"] = state["_plan"] = None
        return state

    def _cpu_plan(self) -> _CpuPlan:
        """Cached views and scratch of the CPU fast path (rebuilt if a tensor was replaced)."""
        key = (self.leaves.data_ptr(), self.sums.data_ptr(), self.mins.data_ptr())
        if self._plan is None or self._plan.key != key:
            self._views = None  # the twins' cached views are as stale as the plan
            self._plan = _CpuPlan(self, key)
        return self._plan

    def _rows(self) -> dict[str, list[torch.Tensor]]:
        """Cached ``[rows, F]`` views: ``"sums"[k]``/``"mins"[k]`` are level ``k``'s entries as the
        children rows of level ``k - 1`` (``k = 1 .. depth - 1``; index 0 unused), ``"leaves"`` the
        leaves' rows, ``"sum_levels"``/``"min_levels"`` each internal level as a flat view."""
        if self._views is None:
            f = self.fanout
            views: dict[str, list[torch.Tensor]] = {"sums": [None], "mins": [None]}  # type: ignore[list-item]
            views["sum_levels"] = [self.level(k, "sums") for k in range(self.depth)]
            views["min_levels"] = [self.level(k, "mins") for k in range(self.depth)]
            for k in range(1, self.depth):
                views["sums"].append(views["sum_levels"][k].view(-1, f))
                views["mins"].append(views["min_levels"][k].view(-1, f))
            views["leaves"] = [self.leaves.view(-1, f)]
            self._views = views
        return self._views

    # ---------------------------------------------------------------- geometry and reads
    @property
    def device(self) -> torch.device:
        return self.leaves.device

    def level(self, k: int, which: str = "sums") -> torch.Tensor:
        """View of internal level ``k`` (``0 <= k < depth``, padding included) of ``sums`` or ``mins``."""
        src = self.sums if which == "sums" else self.mins
        return src[self.level_offsets[k] : self.level_offsets[k + 1]]

    def offsets_tensor(self) -> torch.Tensor:
        """``level_offsets`` as an ``int64`` tensor on the tree's device (cached), for kernels."""
        if self._offsets_tensor is None or self._offsets_tensor.device != self.device:
            self._offsets_tensor = torch.tensor(self.level_offsets, dtype=torch.int64, device=self.device)
        return self._offsets_tensor

    def total(self) -> torch.Tensor:
        """Sum of all leaves: the root, a 0-d ``float64`` tensor view on the tree's device."""
        return self.sums[0]

    def min(self) -> torch.Tensor:
        """Smallest positive leaf (``+inf`` if none): a 0-d ``float64`` tensor view on the tree's device."""
        return self.mins[0]

    def values(self) -> torch.Tensor:
        """The ``capacity`` leaves (a view, leaf dtype): ``(p + eps) ** alpha`` or ``0`` if unwritten."""
        return self.leaves[: self.capacity]

    # ---------------------------------------------------------------- whole-tree helpers
    def clone(self) -> SumTree:
        """A deep copy on the same device."""
        return self.to(self.device, copy=True)

    def to(self, device: torch.device | str, *, copy: bool = False) -> SumTree:
        """The same tree on ``device`` (``self`` when already there and ``copy`` is False)."""
        device = torch.device(device)
        if device == self.device and not copy:
            return self
        out = SumTree.__new__(SumTree)
        out.__dict__.update(self.__dict__)
        out.leaves = self.leaves.to(device, copy=True)
        out.sums = self.sums.to(device, copy=True)
        out.mins = self.mins.to(device, copy=True)
        out._reset_views()
        return out

    def fill_(self, values: torch.Tensor) -> SumTree:
        """Sets all ``capacity`` leaves to ``values`` (already transformed) and rebuilds; in place.

        Args:
            values: ``[capacity]`` non-negative finite floats, any device (copied over).
        """
        values = torch.as_tensor(values)
        if values.shape != (self.capacity,):
            raise PriorityError(f"expected {self.capacity} leaf values, got shape {list(values.shape)}")
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise PriorityError("leaf values must be finite and non-negative")
        self.leaves[: self.capacity] = values.to(device=self.device, dtype=self.dtype)
        return sumtree_rebuild(self)

    def clear_(self) -> SumTree:
        """Sets every leaf to 0 (nothing can be sampled); in place."""
        self.leaves.zero_()
        self.sums.zero_()
        self.mins.fill_(math.inf)
        return self

    def state_dict(self) -> dict[str, Any]:
        """The leaves (a CPU copy) and the shape; internal nodes are rebuilt on load."""
        return {
            "capacity": self.capacity,
            "fanout": self.fanout,
            "dtype": str(self.dtype).removeprefix("torch."),
            "leaves": self.values().detach().to("cpu", copy=True),
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], device: torch.device | str | None = None) -> SumTree:
        """Rebuilds a tree saved by :meth:`state_dict` on ``device``."""
        tree = cls(
            int(state["capacity"]),
            dtype=getattr(torch, state["dtype"]),
            device=device,
            fanout=int(state["fanout"]),
        )
        return tree.fill_(state["leaves"])

    def __repr__(self) -> str:
        return (
            f"SumTree(capacity={self.capacity}, fanout={self.fanout}, depth={self.depth}, "
            f"dtype={self.dtype}, device={self.device})"
        )


# -------------------------------------------------------------------- shared torch helpers
def transform_priority(priority: torch.Tensor, alpha: float, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``(priority + eps) ** alpha`` computed in ``float64`` and cast to the leaf ``dtype``."""
    return torch.pow(priority.to(torch.float64) + eps, alpha).to(dtype)


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """Float64 sums of ``[n, F]`` rows, each row's entries added left to right.

    The canonical node sum on the CPU: ``torch.cumsum`` adds sequentially there, so its last
    column is the same number the descent's prefix sums reach and the compiled kernels compute.
    (``sum(1)`` reduces in vector lanes: a different rounding.)
    """
    return torch.cumsum(rows, 1, dtype=torch.float64)[:, -1]


def importance_weights(value: torch.Tensor, p_min: torch.Tensor | float, beta: float) -> torch.Tensor:
    """Importance-sampling weights ``(value / p_min) ** (-beta)`` (TorchRL's formula).

    Args:
        value: sampled leaf values ``(p_i + eps) ** alpha``, any float dtype; the result has it.
        p_min: the smallest leaf over the buffer (:meth:`SumTree.min`), a number or 0-d tensor.
        beta: the importance exponent.
    """
    ratio = value.to(torch.float64) / p_min
    return torch.pow(ratio, -beta).to(value.dtype)


def _last_wins_ref(index: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops negative indices and all but the last occurrence of each index; sorted output."""
    if index.numel() <= 1:
        keep = index >= 0
        return index[keep], values[keep]
    sorted_index, perm = torch.sort(index, stable=True)
    # Stable sort keeps equal indices in call order, so the last of each run is the last write.
    # Negative indices sort first; marking them "not last" drops them in the same step.
    last = torch.empty_like(sorted_index, dtype=torch.bool)
    torch.ne(sorted_index[1:], sorted_index[:-1], out=last[:-1])
    last[-1] = True
    last &= sorted_index >= 0
    return sorted_index[last], values[perm[last]]


def _refresh_level_ref(tree: SumTree, k: int, nodes: torch.Tensor) -> None:
    """Recomputes ``sums``/``mins`` of ``nodes`` (unique) of internal level ``k`` from their children."""
    views = tree._rows()
    if k == tree.depth - 1:
        rows = views["leaves"][0].index_select(0, nodes).to(torch.float64)
        sums = _row_sums(rows)
        mins = rows.masked_fill_(rows <= 0, math.inf).amin(1)
    else:
        sums = _row_sums(views["sums"][k + 1].index_select(0, nodes))
        mins = views["mins"][k + 1].index_select(0, nodes).amin(1)
    views["sum_levels"][k].index_copy_(0, nodes, sums)
    views["min_levels"][k].index_copy_(0, nodes, mins)


# -------------------------------------------------------------------- update
def sumtree_update_ref(
    tree: SumTree,
    index: torch.Tensor,
    priority: torch.Tensor,
    *,
    alpha: float = 1.0,
    eps: float = 0.0,
) -> SumTree:
    """Pure-torch twin of the batched update; the op's specification.

    Sets leaf ``index[b]`` to ``(priority[b] + eps) ** alpha`` (computed in ``float64``, stored in
    the leaf dtype) and recomputes, from their children, the sum and min of every ancestor of
    the leaves written. Nodes outside those paths are not touched: ``O(B * fanout * depth)`` work.

    Duplicates: when an index appears several times, the last occurrence in ``index`` wins, as if
    the writes were applied one after another. Negative indices are ignored, together with
    their priorities.

    Args:
        tree: the tree, mutated in place (``leaves``, ``sums``, ``mins``).
        index: integer tensor of ``B`` leaf indices (0-d or 1-D) in ``[0, capacity)`` or
            negative, on the tree's device.
        priority: ``B`` raw priorities (any real dtype and shape with ``B`` elements) or a single
            one for all, finite and ``>= 0``, on the tree's device.
        alpha, eps: the transform's exponent and offset.

    Returns:
        ``tree``.

    This twin trusts its input; :func:`sumtree_update` validates first.
    """
    index = index.reshape(-1)
    values = transform_priority(priority.reshape(-1), alpha, eps, tree.dtype)
    return _apply_ref(tree, index, values)


def _apply_ref(tree: SumTree, index: torch.Tensor, values: torch.Tensor) -> SumTree:
    index = index.to(torch.int64)
    if values.numel() == 1 and index.numel() != 1:
        values = values.expand(index.numel())
    index, values = _last_wins_ref(index, values)
    if index.numel() == 0:
        return tree
    tree.leaves.index_copy_(0, index, values)
    nodes = index
    shift = tree.fanout.bit_length() - 1
    for k in range(tree.depth - 1, -1, -1):
        # Sorted leaves keep their ancestors sorted, so unique_consecutive dedupes them.
        nodes = torch.unique_consecutive(nodes >> shift)
        _refresh_level_ref(tree, k, nodes)
    return tree


def _validate_update(
    tree: SumTree, index: Any, priority: Any, alpha: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks types, devices and shapes; returns 1-D ``index`` and ``priority``."""
    if not isinstance(index, torch.Tensor) or index.dtype not in _INDEX_DTYPES or index.ndim > 1:
        desc = (
            f"{index.dtype} of shape {list(index.shape)}" if isinstance(index, torch.Tensor) else type(index).__name__
        )
        raise TypeError(f"index must be a 0-d or 1-D integer tensor, got {desc}")
    if not isinstance(priority, torch.Tensor):
        raise TypeError(f"priority must be a tensor, got {type(priority).__name__}")
    if priority.dtype.is_complex or priority.dtype == torch.bool:
        raise PriorityError(f"priority must be real, got {priority.dtype}")
    if index.device != tree.device or priority.device != tree.device:
        raise DeviceMismatchError(
            f"index ({index.device}) and priority ({priority.device}) must be on the tree's device {tree.device}"
        )
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    index = index.reshape(-1)
    if priority.numel() != 1 and priority.numel() != index.numel():
        raise PriorityError(
            f"priority of shape {list(priority.shape)} does not match index of shape {list(index.shape)}: "
            "expected one priority per index or a single one"
        )
    return index, priority.reshape(-1)


def _check_values(
    tree: SumTree, index: torch.Tensor, priority: torch.Tensor, values: torch.Tensor, limit: int
) -> None:
    """Raises on bad priorities or indices; one host synchronisation for all the checks."""
    if priority.numel() == 0:
        return
    p = priority if priority.dtype.is_floating_point else priority.to(torch.float64)
    # NaN fails both comparisons, so one mask catches NaN, infinities and negatives.
    checks = [((p >= 0) & (p < math.inf)).all(), (values < math.inf).all()]
    if index.numel():
        checks.append(index.max() < limit)
    flags = torch.stack(checks).tolist()
    if not flags[0]:
        if bool(torch.isnan(p).any()) or bool(torch.isinf(p).any()):
            raise PriorityError("priority contains NaN or infinite values")
        raise PriorityError("priority contains negative values")
    if not flags[1]:
        raise PriorityError(f"(priority + eps) ** alpha overflows {tree.dtype}")
    if len(flags) > 2 and not flags[2]:
        what = f"a priority tree of capacity {tree.capacity}" if limit == tree.capacity else f"{limit} written items"
        raise IndexOutOfRangeError(
            f"index {int(index.max())} is out of range for {what} (expected 0 <= index < {limit}, or negative to skip)"
        )


def sumtree_update(
    tree: SumTree,
    index: torch.Tensor,
    priority: torch.Tensor,
    *,
    alpha: float = 1.0,
    eps: float = 0.0,
    limit: int | None = None,
    validate: bool = True,
    backend: str = "auto",
) -> SumTree:
    """Batched update; see :func:`sumtree_update_ref` for the specification.

    CUDA trees go to Triton: the last-wins dedupe is a stable sort in torch (no host
    synchronisation), then one launch writes the leaves and one launch per level refreshes the
    ancestors, so duplicates resolve the same way on every run. CPU trees take a torch path
    with the twin's results (see "CPU fast path" below): it may recompute every node of a level
    that has few nodes per written leaf, which leaves the untouched ones as they were.

    Args:
        tree, index, priority, alpha, eps: as in :func:`sumtree_update_ref`.
        limit: indices must be below it (default and at most ``capacity``); a sampler passes the
            number of items written, so that no priority lands past the written range.
        validate: check priorities and indices first (one host synchronisation on CUDA). With
            ``False`` the caller guarantees valid input.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        TypeError: ``index`` or ``priority`` is not a tensor of a suitable dtype.
        DeviceMismatchError: a tensor is not on the tree's device.
        PriorityError: a NaN, infinite or negative priority, one whose transform overflows the
            leaf dtype, or a priority count that is neither 1 nor ``B``.
        IndexOutOfRangeError: an index ``>= limit``.
        ValueError: ``alpha`` or ``eps`` negative or not finite, or ``limit`` not in
            ``[0, capacity]``.

        On any of these the tree is unchanged.
    """
    index, priority = _validate_update(tree, index, priority, alpha, eps)
    if limit is None:
        limit = tree.capacity
    elif not 0 <= limit <= tree.capacity:
        raise ValueError(f"limit must lie in [0, {tree.capacity}], got {limit}")
    which = resolve_backend(tree.leaves, backend, has_cpu_kernel=True)
    if which == "numba":
        _update_numba(tree, index, priority, alpha, eps, limit)
        return tree
    values = transform_priority(priority, alpha, eps, tree.dtype)
    if which == "torch" and tree.device.type == "cpu":
        has_negative = _check_values_cpu(tree, index, priority, values, limit, validate, alpha, eps)
        return _update_cpu(tree, index, values, has_negative)
    if validate:
        _check_values(tree, index, priority, values, limit)
    if which == "triton":
        if values.numel() == 1 and index.numel() != 1:
            values = values.expand(index.numel())
        kernel_module("sumtree").sumtree_update_triton(tree, index.to(torch.int64), values.contiguous())
        return tree
    return _apply_ref(tree, index, values)


def sumtree_update_compiled_ready(tree: SumTree) -> bool:
    """Whether :func:`sumtree_update_compiled` can run on ``tree``: a CPU tree, with the compiled kernels enabled."""
    return tree.leaves.is_cpu and numba_enabled()


def sumtree_update_compiled(
    tree: SumTree, index: torch.Tensor, priority: torch.Tensor, alpha: float, eps: float, limit: int
) -> float:
    """:func:`sumtree_update` in one compiled call, for a caller that has checked the arguments' types.

    For a sampler's hot path: a CPU tree (:func:`sumtree_update_compiled_ready`), ``index`` a
    1-D ``int64`` CPU tensor, ``priority`` a CPU ``float32`` or ``float64`` tensor of the same
    shape or of one element, ``alpha`` and ``eps`` finite and ``>= 0``, ``0 <= limit <=
    capacity``. The values are still checked (NaN, infinite or negative priorities, overflow,
    indices ``>= limit``), with :func:`sumtree_update`'s typed errors, before anything is
    written.

    Below :data:`_KERNEL_SORT_MIN_DRAWS` indices, the transform ``(p + eps) ** alpha`` is
    computed inside the kernel with the C library's ``pow``: at B = 256, in a prioritized
    cycle, the four torch calls of :func:`transform_priority` cost about as much as the update
    itself. Both powers are within an ulp of the exact ``float64`` one, so a leaf may differ
    from :func:`sumtree_update`'s in its last bit (``float64`` trees; ``float32`` leaves round
    both to the same value but in rare ties). Internal nodes are always recomputed from the
    leaves.

    Returns:
        The largest priority given to a non-negative index (``-inf`` when none was).
    """
    # Large batches keep torch's vectorised pow: the C library's costs more than the calls it saves.
    in_kernel = index.shape[0] < _KERNEL_SORT_MIN_DRAWS
    return _update_numba(tree, index, priority, alpha, eps, limit, transform_in_kernel=in_kernel)


def _check_values_cpu(
    tree: SumTree,
    index: torch.Tensor,
    priority: torch.Tensor,
    values: torch.Tensor,
    limit: int,
    validate: bool,
    alpha: float,
    eps: float,
) -> bool:
    """:func:`_check_values` for a CPU tree, in two reductions; returns whether ``index`` has a negative.

    Reading a CPU tensor's value costs no synchronisation, so the bounds are compared on the
    host. Whenever a quick check fails, :func:`_check_values` runs and raises its precise error
    (or passes, where the overflow bound below was only conservative).
    """
    if index.numel() == 0:
        if validate:
            _check_values(tree, index, priority, values, limit)
        return False
    low, high = (int(v) for v in torch.aminmax(index))
    if validate and priority.numel():
        p = priority if priority.dtype.is_floating_point else priority.to(torch.float64)
        p_low, p_high = (float(v) for v in torch.aminmax(p))
        # NaN fails every comparison, so NaN, infinities and negatives all take the slow path.
        ok = p_low >= 0 and p_high < math.inf and high < limit
        if ok:
            # The transform is non-decreasing in p: its largest value is that of the largest
            # priority. Half the dtype's maximum leaves room for pow's last-bit differences.
            try:
                ok = (p_high + eps) ** alpha <= torch.finfo(tree.dtype).max / 2
            except OverflowError:
                ok = False
        if not ok:
            _check_values(tree, index, priority, values, limit)
    return low < 0


def sumtree_rebuild(tree: SumTree) -> SumTree:
    """Recomputes every internal node from the leaves, level by level; ``O(capacity)``, in place.

    Plain torch reductions, on whatever device the tree lives. Used after rewriting all leaves
    (a new ``alpha``, a loaded checkpoint).
    """
    f = tree.fanout
    rows = tree.leaves.to(torch.float64).view(-1, f)
    sums = _row_sums(rows)
    mins = rows.masked_fill(rows <= 0, math.inf).amin(1)
    for k in range(tree.depth - 1, -1, -1):
        # Level k's real nodes and its padding; the entries past them (the last row) stay as
        # they are: zeros and +inf.
        n = min(sums.numel(), tree.level(k).numel())
        tree.level(k, "sums")[:n] = sums[:n]
        tree.level(k, "mins")[:n] = mins[:n]
        if k:
            sums = _row_sums(tree.level(k, "sums").view(-1, f))
            mins = tree.level(k, "mins").view(-1, f).amin(1)
    return tree


# -------------------------------------------------------------------- sampling
def _descend_ref(tree: SumTree, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = tree.fanout
    b = mass.numel()
    views = tree._rows()
    start = mass
    mass = mass.view(b, 1)
    node = torch.zeros(b, dtype=torch.int64, device=mass.device)
    # Column 0 stays 0, so gathering column `child` reads the exclusive prefix (exactly the
    # value the comparison used) and needs no special case for child 0.
    prefix = torch.zeros(b, f + 1, dtype=torch.float64, device=mass.device)
    inclusive = prefix[:, 1:]
    for k in range(1, tree.depth + 1):
        rows = views["leaves"][0] if k == tree.depth else views["sums"][k]
        # A node past the level's real ones (padding, reached only by a draw redone below)
        # reads the level's last row, which is all zeros.
        rows = rows.index_select(0, node.clamp_max_(tree.level_sizes[k - 1]))
        torch.cumsum(rows, 1, dtype=torch.float64, out=inclusive)
        # #{prefix <= mass} over [0, csum_0 .. csum_{F-1}] is 1 + #{csum <= mass}; the binary
        # search reads log2(F) entries per row instead of materialising a [B, F] comparison.
        child = torch.searchsorted(prefix, mass, right=True).sub_(1).clamp_max_(f - 1)
        mass = mass - prefix.gather(1, child)
        node = torch.add(child.view(b), node, alpha=f)
    value = tree.leaves.index_select(0, node)
    # This fast path takes child min(#{prefix <= mass}, F - 1). With a sequential cumsum (torch
    # on CPU) that child is positive unless rounding left the mass at or past the row's total;
    # the clamp then takes the last child, which is right if positive and otherwise leads to
    # a zero leaf (a zero node has only zero leaves below it). A parallel scan (torch on CUDA)
    # can also send a draw into a zero child, again ending on a zero leaf. So the result is
    # the full rule's wherever the leaf is positive, and the other draws are redone with it.
    redo = value <= 0
    if bool(redo.any()):
        node = node.masked_scatter(redo, _descend_checked_ref(tree, start[redo]))
        value = tree.leaves.index_select(0, node)
    return node, value


def _descend_checked_ref(tree: SumTree, mass: torch.Tensor) -> torch.Tensor:
    """The descent with the full child rule at every level (the rule the Triton kernel applies)."""
    f = tree.fanout
    node = torch.zeros(mass.numel(), dtype=torch.int64, device=mass.device)
    cols = torch.arange(f, device=mass.device)
    views = tree._rows()
    for k in range(1, tree.depth + 1):
        rows = views["leaves"][0] if k == tree.depth else views["sums"][k]
        rows = rows.index_select(0, node).to(torch.float64)
        csum = rows.cumsum(1)
        first = (csum <= mass[:, None]).sum(1)
        # The first positive child at or after `first`, else the last positive child, else 0.
        positive = rows > 0
        after = torch.where(positive & (cols >= first[:, None]), cols, f).amin(1)
        last = torch.where(positive, cols, 0).amax(1)
        child = torch.where(after < f, after, last)
        prev = torch.where(cols < child[:, None], csum, 0.0).amax(1)
        mass = mass - prev
        node = node * f + child
    return node


def _masses(tree: SumTree, uniforms: torch.Tensor, stratified: bool) -> torch.Tensor:
    total = tree.total()
    if stratified:
        b = uniforms.numel()
        return (uniforms + torch.arange(b, dtype=torch.float64, device=uniforms.device)) * (total / b)
    return uniforms * total


def sumtree_sample_ref(
    tree: SumTree,
    uniforms: torch.Tensor,
    *,
    stratified: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of prefix-sum sampling; the op's specification.

    Mass ``b`` is ``uniforms[b] * total`` (i.i.d., TorchRL's scheme) or, with ``stratified``,
    ``(uniforms[b] + b) * (total / B)`` (one draw in each of ``B`` equal slices of the total).
    Each mass descends from the root. At each node, with ``csum`` the inclusive prefix sums
    (``float64``) over the node's children and ``first = #{c : csum[c] <= mass}``, the child
    taken is the first positive child at or after ``first``, else (the mass reached the row's
    total through rounding) the last positive child; its exclusive prefix ``csum[child - 1]``
    is subtracted from the mass. A leaf of value 0 is therefore never returned while the total
    is positive; with a total of 0 (nothing written) index 0 and value 0 come back.

    Args:
        tree: the tree; only read.
        uniforms: 1-D ``float64`` tensor of ``B`` draws in ``[0, 1)`` on the tree's device (from
            ``torch.rand(B, dtype=torch.float64, generator=...)``), so the twin and the kernel
            see the same draws.
        stratified: the mass scheme above.

    Returns:
        ``(index, value)``: ``int64`` leaf indices ``[B]`` in ``[0, capacity)`` and their leaf
        values ``[B]`` in the leaf dtype, on the tree's device.
    """
    mass = _masses(tree, uniforms.reshape(-1).to(torch.float64), stratified)
    return _descend_ref(tree, mass)


def sumtree_sample(
    tree: SumTree,
    uniforms: torch.Tensor,
    *,
    stratified: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-sum sampling; see :func:`sumtree_sample_ref` for the specification.

    CUDA trees go to one Triton launch, CPU trees to the compiled CPU kernel (Numba) or, without
    it, a torch path; both give the twin's results (see "CPU fast path" below). Nothing is
    synchronised on CUDA.

    Args:
        tree, uniforms, stratified: as in :func:`sumtree_sample_ref`.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        TypeError: ``uniforms`` is not a 1-D floating tensor.
        DeviceMismatchError: ``uniforms`` is not on the tree's device.
    """
    if not isinstance(uniforms, torch.Tensor) or not uniforms.dtype.is_floating_point or uniforms.ndim != 1:
        raise TypeError("uniforms must be a 1-D floating tensor of draws in [0, 1)")
    if uniforms.device != tree.device:
        raise DeviceMismatchError(f"uniforms are on {uniforms.device}, the tree on {tree.device}")
    which = resolve_backend(tree.leaves, backend, has_cpu_kernel=True)
    if which == "triton":
        return kernel_module("sumtree").sumtree_sample_triton(tree, uniforms.to(torch.float64), stratified=stratified)
    if which == "numba":
        return _sample_numba(tree, uniforms, stratified)
    if tree.device.type == "cpu":
        return _sample_cpu(tree, uniforms.to(torch.float64), stratified)
    return sumtree_sample_ref(tree, uniforms, stratified=stratified)


def sumtree_sample_weighted(
    tree: SumTree, uniforms: torch.Tensor, beta: float, *, stratified: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws and their importance weights: :func:`sumtree_sample`, then :func:`importance_weights`.

    Returns ``(index, importance_weights(value, tree.min(), beta))``. Where
    :func:`sumtree_draw_compiled` applies, it runs instead: one compiled call for both steps.

    Args:
        tree: the tree; only read.
        uniforms: 1-D ``float64`` draws in ``[0, 1)`` on the tree's device.
        beta: the importance exponent.
        stratified: as in :func:`sumtree_sample_ref`.

    Returns:
        ``(index, weight)``: ``int64 [B]`` and ``[B]`` in the leaf dtype, on the tree's device.

    Raises:
        As :func:`sumtree_sample`.
    """
    if (
        isinstance(uniforms, torch.Tensor)
        and uniforms.dtype == torch.float64
        and uniforms.ndim == 1
        and uniforms.is_cpu
        and sumtree_draw_compiled_ready(tree, uniforms.shape[0])
    ):
        index, weight, _ = sumtree_draw_compiled(tree, uniforms, beta, stratified)
        return index, weight
    index, value = sumtree_sample(tree, uniforms, stratified=stratified)
    return index, importance_weights(value, tree.min(), beta)


def sumtree_draw_compiled_ready(tree: SumTree, batch_size: int) -> bool:
    """Whether :func:`sumtree_draw_compiled` runs ``batch_size`` draws on ``tree``.

    A CPU tree with the compiled kernels enabled, and fewer than :data:`_KERNEL_SORT_MIN_DRAWS`
    draws (larger batches descend in increasing order of mass, see :func:`sumtree_sample`).
    """
    return batch_size < _KERNEL_SORT_MIN_DRAWS and tree.leaves.is_cpu and numba_enabled()


def sumtree_draw_compiled(
    tree: SumTree, uniforms: torch.Tensor, beta: float, stratified: bool
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A small batch's draw and weights in one compiled call, for callers that checked the arguments.

    For a sampler's hot path, where each torch call costs about as much as the descent:
    :func:`sumtree_draw_compiled_ready` holds and ``uniforms`` is a 1-D ``float64`` CPU tensor.
    The indices are :func:`sumtree_sample`'s; the weights are computed with the C library's
    ``pow`` (:func:`importance_weights` uses ``torch.pow``), so they may differ from it in the
    last bit of the ``float64`` power, before rounding to the leaf dtype.

    Returns:
        ``(index, weight, total)``: ``int64 [B]``, ``[B]`` in the leaf dtype, and the tree's
        total as a float (nothing can be drawn when it is not positive; the draws are then
        meaningless).
    """
    plan = _numba_plan(tree)
    index, weight, _ = kernel_module("cpu.sumtree").draw(
        plan.leaves, plan.sums, plan.mins, plan.offsets, plan.sizes, plan.shift, _numpy(uniforms), bool(stratified),
        float(beta),
    )
    return torch.from_numpy(index), torch.from_numpy(weight), float(plan.sums[0])


# -------------------------------------------------------------------- CPU fast path
# The twins above state the ops as plainly as possible; the functions below are what CPU trees
# run. They return the same tensors bit for bit (tests compare them on random and adversarial
# inputs), with fewer torch calls for small batches and less work for large ones:
#
# * update: validation from two min/max reductions read on the host; last-wins by scattering
#   each write's position (no sort); duplicate parents recomputed as often as they appear,
#   harmless since every copy writes the same value; a level with few nodes per written leaf
#   rebuilt whole by one reduction (the leaves' parents: a plain minimum, masked only in rows
#   that hold a zero leaf).
# * sample: exclusive prefix rows with a leading zero column, so `searchsorted - 1` is the
#   child with no clamp; the root's row searched once as a 1-D row; prefix tables built once
#   per call for large batches; draws in chunks whose temporaries stay in cache; large i.i.d.
#   batches descend in increasing order of mass.
#
# Row sums and minima are the twin's expressions (`_row_sums`, `amin(1)` over positive leaves),
# which torch computes row by row independently of the number of rows: a node reads the same
# whichever path refreshed it, so updates and rebuilds never disagree (no drift).

#: Draws processed per chunk by the CPU descent: ``[chunk, F]`` float64 temporaries (2 MiB at
#: F = 32) stay in cache, and per-call overhead is amortised.
_DESCENT_CHUNK = 8192

#: From this many i.i.d. draws on, the CPU descent handles them in increasing order of mass.
_SORT_MIN_DRAWS = 32768
#: The same for the compiled descent, which resumes a node's scan where the previous draw in
#: mass order stopped: on 2**20 leaves, sorting pays from about a thousand draws (measured
#: sorted against unsorted in one process: 0.83x the time at 1,024 draws, 0.31x at 65,536).
_KERNEL_SORT_MIN_DRAWS = 1024

#: The descent builds a level's prefix table once per call (instead of the prefix rows of the
#: draws that reach it) when the batch has this many draws per row of the level.
_TABLE_DRAWS_PER_ROW = 8

#: A level is rebuilt whole once it has at most this many nodes per written leaf: gathering a
#: touched row costs several times more per entry than reducing it in place (measured: the
#: leaves' parents of a 2**20-leaf tree break even near 4,000 written leaves), and takes seven
#: torch calls where a whole level takes two.
_WHOLE_NODES_PER_LEAF = 8


class _CpuPlan:
    """Views of a CPU tree, by level, that the fast path would otherwise rebuild on every call.

    Attributes:
        key: data pointers of ``leaves``, ``sums``, ``mins`` when the plan was made.
        shift: ``log2(fanout)``.
        sizes: ``m_0 .. m_D``.
        sum_out, min_out: per internal level ``k``, its ``m_k`` real nodes (views).
        sum_all, min_all: per internal level ``k``, all its entries (targets of ``index_copy_``).
        sum_rows, min_rows: per internal level ``k``, the ``[m_k, F]`` children rows of its real
            nodes; ``min_rows[D - 1]`` is None (the leaves' minimum skips zeros).
        heads: per level ``k = 1 .. D`` (index 0 unused), the first ``F - 1`` columns of level
            ``k``'s ``[m_{k-1} + 1, F]`` rows, sentinel row included (the leaves for ``k = D``):
            the entries whose prefix sums the descent compares.
        root_head: ``heads[1]``'s first row, the root's children.
        clamp: per level ``k``, the last row index of ``heads[k]`` when the descent can reach a
            node past it (a padding node, through the last real row), else None.
        scratch: ``[capacity]`` int64 positions for the last-wins scatter, made on first use.
        next_position: the first position the next last-wins scatter writes.
        numba: the compiled kernels' views and scratch (:class:`_NumbaPlan`), made on first use.
    """

    def __init__(self, tree: SumTree, key: tuple[int, int, int]) -> None:
        f = tree.fanout
        depth = tree.depth
        self.key = key
        self.shift = f.bit_length() - 1
        self.sizes = tree.level_sizes
        leaf_rows = tree.leaves.view(-1, f)
        self.sum_out, self.min_out, self.sum_all, self.min_all = [], [], [], []
        self.sum_rows: list[torch.Tensor] = []
        self.min_rows: list[torch.Tensor | None] = []
        desc_rows: list[torch.Tensor] = []
        for k in range(depth):
            m = self.sizes[k]
            sums, mins = tree.level(k, "sums"), tree.level(k, "mins")
            self.sum_all.append(sums)
            self.min_all.append(mins)
            self.sum_out.append(sums[:m])
            self.min_out.append(mins[:m])
            if k == depth - 1:
                self.sum_rows.append(leaf_rows[:m])
                self.min_rows.append(None)
            else:
                self.sum_rows.append(tree.level(k + 1, "sums").view(-1, f)[:m])
                self.min_rows.append(tree.level(k + 1, "mins").view(-1, f)[:m])
            if k >= 1:
                desc_rows.append(sums.view(-1, f))
        desc_rows.append(leaf_rows)
        self.heads: list[torch.Tensor | None] = [None] + [rows[:, : f - 1] for rows in desc_rows]
        self.root_head = desc_rows[0][0, : f - 1]
        self.clamp: list[int | None] = [None, None]
        reach = f - 1  # the largest node index a draw can hold at level 1
        for rows in desc_rows[1:]:
            last = rows.shape[0] - 1
            self.clamp.append(last if reach > last else None)
            reach = min(reach, last) * f + f - 1
        self.scratch: torch.Tensor | None = None
        self.next_position = 0
        self.numba: _NumbaPlan | None = None


def _leaf_sums_mins(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 row sums and positive minima (``+inf`` where none) of leaf rows, as the twin has them.

    Args:
        rows: ``[n, F]`` leaves, float32 or float64: a temporary, overwritten here.
    """
    wide = rows.to(torch.float64)
    sums = _row_sums(wide)
    # Zero leaves cannot be drawn, so they do not count towards the minimum.
    return sums, wide.masked_fill_(wide <= 0, math.inf).amin(1)


def _last_wins_values(plan: _CpuPlan, capacity: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``values`` with each entry replaced by that of the last occurrence of its index.

    Every copy of a duplicate then writes the same value, so an ``index_copy_`` gives the
    last-wins result whatever order it writes in. One scatter of positions (``amax``) into a
    ``[capacity]`` scratch and two gathers: ``O(B)``, where a stable sort is ``O(B log B)``.
    Positions continue from one call to the next, so every entry a past call left in the
    scratch is below this call's positions: the maximum needs no reset of the scratch, and
    ``include_self=True`` saves the pass that ``include_self=False`` makes to clear the targets.
    """
    b = index.numel()
    if plan.scratch is None:
        plan.scratch = torch.full((capacity,), -1, dtype=torch.int64, device=index.device)
    base = plan.next_position
    plan.next_position = base + b
    position = torch.arange(base, base + b, device=index.device)
    plan.scratch.scatter_reduce_(0, index, position, "amax")
    return values.index_select(0, plan.scratch.index_select(0, index).sub_(base))


def _update_cpu(tree: SumTree, index: torch.Tensor, values: torch.Tensor, has_negative: bool) -> SumTree:
    """The CPU path of :func:`sumtree_update`: :func:`_apply_ref`'s result, computed faster.

    Args:
        tree: a CPU tree, mutated in place.
        index: 1-D integer indices in ``[0, capacity)``, or negative to skip.
        values: transformed priorities in the leaf dtype, one per index or a single one.
        has_negative: whether ``index`` holds a negative entry (known from the validation).
    """
    index = index.to(torch.int64)
    if has_negative:
        keep = index >= 0
        index = index[keep]
        if values.numel() != 1:
            values = values[keep]
    b = index.numel()
    if b == 0:
        return tree
    plan = tree._cpu_plan()
    if values.numel() == 1:
        values = values.expand(b)  # one value for all: duplicates cannot disagree
    elif b > 1:
        values = _last_wins_values(plan, tree.capacity, index, values)
    tree.leaves.index_copy_(0, index, values)
    _refresh_cpu(tree, plan, index, b)
    return tree


def _rebuild_leaf_parents(plan: _CpuPlan, k: int) -> None:
    """Recomputes every node of level ``k``, the leaves' parents, from the leaves.

    The minimum is first taken over all leaves of a row, one pass with no mask; only rows
    where it is zero (rows with unwritten or zero-priority leaves) are redone without their
    zeros, which in a filled buffer is none of them.
    """
    rows = plan.sum_rows[k]
    plan.sum_out[k].copy_(_row_sums(rows))
    mins = plan.min_out[k]
    mins.copy_(rows.amin(1))
    zero = (mins <= 0).nonzero().view(-1)
    if zero.numel():
        mins.index_copy_(0, zero, _leaf_sums_mins(rows.index_select(0, zero))[1])


def _refresh_cpu(tree: SumTree, plan: _CpuPlan, index: torch.Tensor, b: int) -> None:
    """Recomputes every ancestor of the leaves at ``index`` (``b`` of them, duplicates allowed)."""
    nodes = index
    whole = False
    leaf_parents = tree.depth - 1
    for k in range(leaf_parents, -1, -1):
        whole = whole or plan.sizes[k] <= _WHOLE_NODES_PER_LEAF * b
        if whole:
            if k == leaf_parents:
                _rebuild_leaf_parents(plan, k)
            else:
                plan.sum_out[k].copy_(_row_sums(plan.sum_rows[k]))
                torch.amin(plan.min_rows[k], 1, out=plan.min_out[k])
            continue
        nodes = nodes >> plan.shift
        rows = plan.sum_rows[k].index_select(0, nodes)
        if k == leaf_parents:
            sums, mins = _leaf_sums_mins(rows)
        else:
            sums, mins = _row_sums(rows), plan.min_rows[k].index_select(0, nodes).amin(1)
        plan.sum_all[k].index_copy_(0, nodes, sums)
        plan.min_all[k].index_copy_(0, nodes, mins)


def _prefix_rows(heads: torch.Tensor) -> torch.Tensor:
    """Exclusive float64 prefix sums of rows: ``out[:, 0] = 0``, ``out[:, c] = sum(row[:c])``.

    ``heads`` holds the first ``F - 1`` entries of each row; the sums are the twin's inclusive
    ``cumsum`` (sequential, float64) shifted right by one column.
    """
    out = torch.zeros(heads.shape[0], heads.shape[1] + 1, dtype=torch.float64, device=heads.device)
    torch.cumsum(heads, 1, dtype=torch.float64, out=out[:, 1:])
    return out


def _sample_cpu(tree: SumTree, uniforms: torch.Tensor, stratified: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path of :func:`sumtree_sample`: :func:`sumtree_sample_ref`'s result, computed faster.

    A large batch of i.i.d. draws descends in increasing order of mass, then goes back to the
    draws' order. Sorted masses make consecutive binary searches take the same branches and
    read neighbouring rows, which more than pays for one radix sort of 31-bit integer keys
    (``mass = u * total`` grows with ``u``; keys that tie only cost some of that locality).
    Stratified masses are sorted already.
    """
    b = uniforms.numel()
    if stratified or b < _SORT_MIN_DRAWS:
        return _descend_cpu(tree, _masses(tree, uniforms, stratified))
    order = torch.sort((uniforms * 2.0**31).to(torch.int32)).indices
    node, value = _descend_cpu(tree, _masses(tree, uniforms.index_select(0, order), stratified))
    return torch.empty_like(node).index_copy_(0, order, node), torch.empty_like(value).index_copy_(0, order, value)


def _descend_cpu(tree: SumTree, mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU path of the descent: :func:`_descend_ref`'s ``(index, value)``, computed faster.

    With ``P`` a row's exclusive prefix sums (``P[0] = 0``), ``searchsorted(P, mass, right=True)
    - 1`` is ``min(#{inclusive <= mass}, F - 1)``, the twin's child, and ``P[child]`` the
    exclusive prefix the twin subtracts. A level's prefix rows come from a table built once per
    call when the batch is large next to the level, else from the rows the draws reach.
    """
    b = mass.numel()
    if b == 0:
        return torch.zeros(0, dtype=torch.int64), tree.leaves[:0].clone()
    plan = tree._cpu_plan()
    f = tree.fanout
    root = torch.zeros(f, dtype=torch.float64)
    torch.cumsum(plan.root_head, 0, out=root[1:])
    tables: list[torch.Tensor | None] = [None, None]
    for k in range(2, tree.depth + 1):
        heads = plan.heads[k]
        tables.append(_prefix_rows(heads) if b >= _TABLE_DRAWS_PER_ROW * heads.shape[0] else None)
    # Prefix rows of the levels without a table go to one buffer that every chunk and level
    # reuses; its column 0 stays zero.
    buffer = None
    if any(table is None for table in tables[2:]):
        buffer = torch.zeros(min(b, _DESCENT_CHUNK), f, dtype=torch.float64)
    if b <= _DESCENT_CHUNK:
        node = _descend_chunk(tree, plan, root, tables, buffer, mass)
    else:
        node = torch.empty(b, dtype=torch.int64)
        for start in range(0, b, _DESCENT_CHUNK):
            stop = min(start + _DESCENT_CHUNK, b)
            rows = None if buffer is None else buffer[: stop - start]
            node[start:stop] = _descend_chunk(tree, plan, root, tables, rows, mass[start:stop])
    value = tree.leaves.index_select(0, node)
    # As in the twin: a draw that ended on a zero leaf (rounding, or an empty tree) is redone
    # with the full child rule. One read of the minimum decides whether there is any.
    if value.amin().item() <= 0:
        redo = value <= 0
        node = node.masked_scatter(redo, _descend_checked_ref(tree, mass[redo]))
        value = tree.leaves.index_select(0, node)
    return node, value


def _descend_chunk(
    tree: SumTree,
    plan: _CpuPlan,
    root: torch.Tensor,
    tables: list[torch.Tensor | None],
    buffer: torch.Tensor | None,
    mass: torch.Tensor,
) -> torch.Tensor:
    """Leaf indices of ``n`` draws; each level costs a handful of ``[n]``/``[n, F]`` torch calls.

    ``buffer`` (``[n, F]`` float64, column 0 zero) receives the prefix rows of the levels
    without a table in ``tables``.
    """
    n = mass.numel()
    f = tree.fanout
    depth = tree.depth
    mass = mass.view(n, 1)
    # Level 1 is the root's row, the same for every draw: a 1-D search, no gather.
    node = torch.searchsorted(root, mass, right=True).sub_(1)
    if depth > 1:
        mass = mass - torch.take(root, node)
    inner = None
    for k in range(2, depth + 1):
        at = node.view(n)
        if plan.clamp[k] is not None:
            at.clamp_max_(plan.clamp[k])  # a padding node reads the zero sentinel row
        table = tables[k]
        if table is not None:
            prefix = table.index_select(0, at)
        else:
            if inner is None:
                inner = buffer[:, 1:]
            torch.cumsum(plan.heads[k].index_select(0, at), 1, dtype=torch.float64, out=inner)
            prefix = buffer
        child = torch.searchsorted(prefix, mass, right=True).sub_(1)
        if k < depth:  # the leaf level's remainder is not needed
            mass = mass - prefix.gather(1, child)
        node = torch.add(child, node, alpha=f)
    return node.view(n)


# -------------------------------------------------------------------- compiled CPU kernels
class _NumbaPlan:
    """NumPy views of a CPU tree and the scratch its compiled kernels use.

    Attributes:
        leaves, sums, mins: the tree's tensors as NumPy arrays (shared memory, no copy).
        offsets, sizes: ``level_offsets`` and ``level_sizes`` as int64 arrays.
        shift: ``log2(fanout)``.
        marks: uint8 ``[len(sums)]``, zero between calls (the update's "queued" flags).
    """

    def __init__(self, tree: SumTree) -> None:
        self.leaves = tree.leaves.numpy()
        self.sums = tree.sums.numpy()
        self.mins = tree.mins.numpy()
        self.offsets = np.asarray(tree.level_offsets, dtype=np.int64)
        self.sizes = np.asarray(tree.level_sizes, dtype=np.int64)
        self.shift = tree.fanout.bit_length() - 1
        self.marks = np.zeros(self.sums.shape[0], dtype=np.uint8)


def _numba_plan(tree: SumTree) -> _NumbaPlan:
    plan = tree._cpu_plan()
    if plan.numba is None:
        plan.numba = _NumbaPlan(tree)
    return plan.numba


#: Priority dtypes the compiled update reads as they are; others are converted to float64 first.
_KERNEL_PRIORITY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's data as a NumPy array (no copy when it is contiguous)."""
    # Attribute reads first: detach() and contiguous() each make a tensor even when not needed.
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.numpy()


def _update_numba(
    tree: SumTree, index: torch.Tensor, priority: torch.Tensor, alpha: float, eps: float, limit: int,
    transform_in_kernel: bool = False,
) -> float:
    """The compiled update: checks, leaves and ancestors in one call (the transform too, when asked).

    The checks run whatever ``validate`` says: the kernel writes through raw indices, so an
    index past the tree must never reach it. On a failed check :func:`_check_values` raises its
    precise error; nothing was written.

    ``transform_in_kernel`` has the kernel compute ``(p + eps) ** alpha`` with the C library's
    ``pow`` instead of :func:`transform_priority` (see :func:`sumtree_update_compiled`).

    Returns:
        The largest priority given to a non-negative index (``-inf`` when none was).
    """
    if index.numel() == 0:
        if priority.numel():
            _check_values(tree, index, priority, transform_priority(priority, alpha, eps, tree.dtype), limit)
        return -math.inf
    kernels = kernel_module("cpu.sumtree")
    plan = _numba_plan(tree)
    if priority.dtype not in _KERNEL_PRIORITY_DTYPES:
        priority = priority.to(torch.float64)
    values = _NO_VALUES[tree.dtype] if transform_in_kernel else transform_priority(priority, alpha, eps, tree.dtype)
    status, batch_max, _ = kernels.update_checked(
        plan.leaves, plan.sums, plan.mins, plan.offsets, plan.sizes, plan.shift, _numpy(index), _numpy(priority),
        values.numpy(), float(alpha), float(eps), limit, plan.marks,
    )
    if status != kernels.UPDATED:
        _check_values(tree, index, priority, transform_priority(priority, alpha, eps, tree.dtype), limit)
        raise PriorityError("the update failed its checks")  # pragma: no cover - _check_values raised first
    return batch_max


def _sample_numba(tree: SumTree, uniforms: torch.Tensor, stratified: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled descent: ``B`` draws in one call, the twin's ``(index, value)``.

    Batches below :data:`_KERNEL_SORT_MIN_DRAWS` descend level by level in draw order
    (``descend``); larger ones draw by draw in increasing order of mass (``sample``).
    """
    kernels = kernel_module("cpu.sumtree")
    plan = _numba_plan(tree)
    u = uniforms.detach().to(torch.float64).contiguous()
    n = u.numel()
    index = torch.empty(n, dtype=torch.int64)
    value = torch.empty(n, dtype=tree.dtype)
    if n < _KERNEL_SORT_MIN_DRAWS:
        kernels.descend(
            plan.leaves, plan.sums, plan.offsets, plan.sizes, plan.shift, u.numpy(), bool(stratified), index.numpy(),
            value.numpy(),
        )
        return index, value
    if stratified:
        order = _NO_ORDER  # stratified masses increase already
    else:
        # By increasing mass (as the torch path, one radix sort of 31-bit keys; ties cost only locality).
        order = torch.sort((u * 2.0**31).to(torch.int32)).indices
    kernels.sample(
        plan.leaves, plan.sums, plan.offsets, plan.sizes, plan.shift, u.numpy(), bool(stratified), order.numpy(),
        index.numpy(), value.numpy(),
    )
    return index, value


_NO_ORDER = torch.zeros(0, dtype=torch.int64)
#: Empty ``values`` for ``update_checked``: the kernel then computes the transforms itself.
_NO_VALUES = {dtype: torch.zeros(0, dtype=dtype) for dtype in _LEAF_DTYPES}
