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
  ``leaves`` for ``k = D - 1``). Level ``0`` holds ``F`` entries (the root, then padding) and
  level ``k >= 1`` holds ``(m_{k-1} + 1) * F``: every row of ``F`` children exists (loads need
  no bounds but the batch's), one more row of zeros (``sums``) / ``+inf`` (``mins``) ends each
  level (where a descent that overshoots a padded row lands), and every level starts at a
  multiple of ``F``, so a row of children is one aligned, vectorisable load.
* ``sums`` and ``mins``: all internal levels of ``float64`` concatenated, level ``k`` at
  ``level_offsets[k]``. ``sums`` holds the sum of a node's children (``0`` for padding),
  ``mins`` the minimum over the positive leaves below the node (``+inf`` where there is none).
  The root's ``sums`` entry is the total mass, its ``mins`` entry the smallest positive leaf.
* ``flags``: ``int32 [2]`` on the tree's device: the error word of the device kernels
  (:data:`ERROR_BITS`; see "Errors on the GPU" below) and a counter the update kernel uses to
  find its last program. Allocated once, never rebound.

Memory: ``itemsize`` bytes per leaf plus about ``16 / (F - 1)`` bytes of internal nodes (4.5 B
per row for ``float32`` leaves at ``F = 32``), and nothing else between calls: no scratch of
the capacity's size. TorchRL's sum and min segment trees take 16 to 32 B per row.

Why this shape: a wide fan-out keeps the depth at 4 for a million leaves, and one program (or
one vectorized torch step) handles a whole row of children with a prefix-sum. Every parent is
recomputed from its children (never updated by a delta), and internal nodes are ``float64``:
no error accumulates across updates, the root always equals the sum of the leaves up to one
``float64`` reduction's rounding. On the CPU a node's sum is its children added left to right
(:func:`_row_sums`), the order of the descent's prefix sums, so the twin, the compiled kernel and
a rebuild write the same bits. The minimum skips zero leaves, so unwritten slots do not count
and ``p_min`` is the minimum over the items that can be sampled.

Ops
---
* :func:`sumtree_update` (twin :func:`sumtree_update_ref`): set ``B`` leaves, bring their
  ancestors up to date, and raise a running maximum of the priorities; ``O(B * F * D)`` work at
  any capacity (each distinct ancestor once; the compiled CPU update sorts the leaves it wrote
  and refreshes their ancestors in one pass in that order, so each row is read once, in order
  of address).
* :func:`sumtree_sample` (twin :func:`sumtree_sample_ref`): ``B`` uniforms to leaf indices and
  leaf values by descending the tree; :func:`sumtree_sample_weighted`: the same with the
  importance weights instead of the values, one kernel call on every backend.
* :meth:`SumTree.total`, :meth:`SumTree.min`: the root's sum and minimum, as 0-d tensors (no
  host synchronisation).
* :func:`sumtree_rebuild`: recompute every internal node from the leaves, ``O(capacity)``.
* :func:`importance_weights`: ``(value / p_min) ** (-beta)``.
* :func:`sumtree_check`: raise the error a device kernel recorded.

Backends (one table, :data:`~gpubuf.ops._dispatch.KERNELS`): CUDA trees run the Triton
kernels of ``gpubuf_kernels.sumtree``; CPU trees the compiled loops of
``gpubuf_kernels.cpu.sumtree`` (Numba, a dependency), else the twins. The compiled CPU kernels
give the twins' results bit for bit, but for the importance weights (the C library's ``pow``,
within an ulp of ``torch.pow``'s ``float64`` result before rounding).

Errors on the GPU
-----------------
A CPU update checks every priority and index on the host, for free, and raises before writing
anything. On a CUDA tree (or with ``backend="triton"``) the kernels check them instead, so that
nothing waits for the device: an entry with a NaN, infinite or negative priority, a transform
that overflows the leaf dtype, or an index ``>= limit`` is skipped (never written: the tree
stays valid) and its kind is OR-ed into the device error word; a draw from a tree whose total is
not positive sets a bit too. :func:`sumtree_check` reads the word (one synchronisation), clears
it and raises the typed error; the sampler calls it wherever it reads the device anyway and on
request. ``eager=True`` checks on the host first (one synchronisation) and raises at the call,
with nothing written, as on the CPU.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from gpubuf.errors import DeviceMismatchError, EmptyBufferError, IndexOutOfRangeError, PriorityError
from gpubuf.host_memory import HUGE_PAGE_BYTES, empty_host
from gpubuf.ops._dispatch import kernel_module, resolve

__all__ = [
    "ERROR_BITS",
    "SumTree",
    "importance_weights",
    "sumtree_check",
    "sumtree_rebuild",
    "sumtree_sample",
    "sumtree_sample_ref",
    "sumtree_sample_weighted",
    "sumtree_update",
    "sumtree_update_ref",
    "transform_priority",
    "fanout_for",
]

#: Children per node of a tree read on the device: a row is one warp's 32 lanes, scanned at once.
DEFAULT_FANOUT = 32
#: Children per node of a tree read on the host. There a row's prefix sum is a chain of dependent
#: float64 additions (left to right, the twin's order, so the compiled kernels match it bit for
#: bit): 16 children and one more level cost less per draw and per update than 32. (Measured side
#: by side on 1M leaves, prioritized cycles of 256: update 0.8 times the time, draw 0.95, the
#: cycle 0.93; at 65,536, update 0.87 and draw 0.93.)
HOST_FANOUT = 16
_LEAF_DTYPES = (torch.float32, torch.float64)
_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

#: Bits of the device error word (``SumTree.flags[0]``), as the Triton kernels set them.
ERROR_BITS = {"bad_priority": 1, "overflow": 2, "bad_index": 4, "empty": 8}

#: From this many draws on, a CPU draw descends in (nearly) increasing order of mass (see
#: ``gpubuf_kernels.cpu.sumtree.descend``); below, ordering them costs about what it saves.
_SORTED_DRAWS = 1024


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
        flags: ``int32 [2]``: the device error word and the update kernel's program counter.
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
        # Level 0 is padded to a whole row, so that every level starts at a multiple of F.
        padded = [fanout] + [(self.level_sizes[k - 1] + 1) * fanout for k in range(1, self.depth)]
        offsets = [0]
        for size in padded:
            offsets.append(offsets[-1] + size)
        self.level_offsets = tuple(offsets)
        n_internal = offsets[-1]
        self.leaves = _zeros((self.level_sizes[-2] + 1) * fanout, dtype, device)
        self.sums = _zeros(n_internal, torch.float64, device)
        self.mins = _zeros(n_internal, torch.float64, device).fill_(math.inf)
        self.flags = torch.zeros(2, dtype=torch.int32, device=device)
        self._reset_views()

    def _reset_views(self) -> None:
        self._offsets_tensor: torch.Tensor | None = None
        self._views: dict[str, list[torch.Tensor]] | None = None
        self._arrays: _Arrays | None = None
        self._triton_geometry: Any = None  # the Triton launcher's cached geometry tensors

    def __getstate__(self) -> dict[str, Any]:
        # Cached views are rebuilt on first use: pickling them would copy (or, between
        # processes, share) tensors that belong to this process only.
        state = dict(self.__dict__)
        state["_offsets_tensor"] = state["_views"] = state["_arrays"] = state["_triton_geometry"] = None
        return state

    def _numpy_arrays(self) -> _Arrays:
        """Cached NumPy views of a CPU tree for the compiled kernels (remade if a tensor was replaced)."""
        key = (self.leaves.data_ptr(), self.sums.data_ptr(), self.mins.data_ptr())
        if self._arrays is None or self._arrays.key != key:
            self._views = None  # the twins' cached views are as stale
            self._arrays = _Arrays(self, key)
        return self._arrays

    def _rows(self) -> dict[str, list[torch.Tensor]]:
        """Cached ``[rows, F]`` views: ``"sums"[k]``/``"mins"[k]`` are level ``k``'s entries as the
        children rows of level ``k - 1`` (``k = 1 .. depth - 1``; index 0 unused), ``"leaves"`` the
        leaves' rows, ``"sum_levels"``/``"min_levels"`` each internal level as a flat view."""
        key = (self.leaves.data_ptr(), self.sums.data_ptr(), self.mins.data_ptr())
        if self._views is None or self._views["key"] != key:
            f = self.fanout
            views: dict[str, list[torch.Tensor]] = {"sums": [None], "mins": [None]}  # type: ignore[list-item]
            views["sum_levels"] = [self.level(k, "sums") for k in range(self.depth)]
            views["min_levels"] = [self.level(k, "mins") for k in range(self.depth)]
            for k in range(1, self.depth):
                views["sums"].append(views["sum_levels"][k].view(-1, f))
                views["mins"].append(views["min_levels"][k].view(-1, f))
            views["leaves"] = [self.leaves.view(-1, f)]
            views["key"] = key  # type: ignore[assignment]
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

    def host_total(self) -> float:
        """The sum of all leaves as a host number: one synchronisation on a device tree.

        A CPU tree's root is read through the NumPy view the compiled kernels use (a quarter of
        the cost of ``total().item()``, which makes a 0-d tensor first).
        """
        if self.leaves.is_cpu:
            return self._numpy_arrays().sums[0]  # a numpy.float64, which is a float
        return self.total().item()

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
        out.flags = self.flags.to(device, copy=True)
        out._reset_views()
        return out

    def fill_(self, values: torch.Tensor, *, validate: bool = True) -> SumTree:
        """Sets all ``capacity`` leaves to ``values`` (already transformed) and rebuilds; in place.

        Args:
            values: ``[capacity]`` non-negative finite floats, any device (copied over).
            validate: check that the values are finite and non-negative (two passes and two
                host reads); False for values taken from valid trees.

        Raises:
            PriorityError: ``values`` of another shape, or (with ``validate``) a negative or
                non-finite value; the tree is unchanged.
        """
        values = torch.as_tensor(values)
        if values.shape != (self.capacity,):
            raise PriorityError(f"expected {self.capacity} leaf values, got shape {list(values.shape)}")
        if validate and (not bool(torch.isfinite(values).all()) or bool((values < 0).any())):
            raise PriorityError("leaf values must be finite and non-negative")
        # + 0.0 turns a -0.0 into +0.0: the device update reads a leaf's sign bit as its mark.
        self.leaves[: self.capacity] = values.to(device=self.device, dtype=self.dtype) + 0.0
        return sumtree_rebuild(self)

    def clear_(self) -> SumTree:
        """Sets every leaf to 0 (nothing can be sampled); in place."""
        self.leaves.zero_()
        self.sums.zero_()
        self.mins.fill_(math.inf)
        self.flags.zero_()
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
    def from_state_dict(
        cls, state: dict[str, Any], device: torch.device | str | None = None, fanout: int | None = None
    ) -> SumTree:
        """Rebuilds a tree saved by :meth:`state_dict` on ``device``, with the saved fanout or
        ``fanout`` (the leaves are all a state holds: any fanout rebuilds the same values)."""
        tree = cls(
            int(state["capacity"]),
            dtype=getattr(torch, state["dtype"]),
            device=device,
            fanout=int(state["fanout"]) if fanout is None else fanout,
        )
        return tree.fill_(state["leaves"])

    def with_fanout(self, fanout: int) -> SumTree:
        """The same leaves in a tree of ``fanout`` children per node (``self`` when it has that
        fanout already); ``O(capacity)``, on the tree's device."""
        if fanout == self.fanout:
            return self
        tree = SumTree(self.capacity, dtype=self.dtype, device=self.device, fanout=fanout)
        return tree.fill_(self.values(), validate=False)

    def __repr__(self) -> str:
        return (
            f"SumTree(capacity={self.capacity}, fanout={self.fanout}, depth={self.depth}, "
            f"dtype={self.dtype}, device={self.device})"
        )




class _Arrays:
    """NumPy views of a CPU tree's tensors (shared memory, no copy) and its geometry, for the compiled kernels."""

    def __init__(self, tree: SumTree, key: tuple[int, int, int]) -> None:
        self.key = key
        self.leaves = tree.leaves.numpy()
        self.sums = tree.sums.numpy()
        self.mins = tree.mins.numpy()
        self.offsets = np.asarray(tree.level_offsets, dtype=np.int64)
        self.sizes = np.asarray(tree.level_sizes, dtype=np.int64)
        self.shift = tree.fanout.bit_length() - 1


# -------------------------------------------------------------------- shared torch helpers
def fanout_for(device: torch.device, backend: str = "auto") -> int:
    """The fanout of a tree read where ``device`` is, under the ops' ``backend``: the device
    path's (:data:`DEFAULT_FANOUT`; CUDA, or the forced path of ``"triton"``) or the host's
    (:data:`HOST_FANOUT`)."""
    return DEFAULT_FANOUT if device.type == "cuda" or backend == "triton" else HOST_FANOUT


def transform_priority(priority: torch.Tensor, alpha: float, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """``(priority + eps) ** alpha`` computed in ``float64`` and cast to the leaf ``dtype``."""
    return torch.pow(priority.to(torch.float64) + eps, alpha).to(dtype)


_NUMPY_LEAF_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


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
    priority: torch.Tensor | None,
    *,
    alpha: float = 1.0,
    eps: float = 0.0,
    max_priority: torch.Tensor | None = None,
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
            one for all, finite and ``>= 0``, on the tree's device; or None: the priority of new
            items, ``max_priority`` or 1.0 while it holds none.
        alpha, eps: the transform's exponent and offset.
        max_priority: float64 ``[1]`` or None: the running maximum of the raw priorities given
            to non-negative indices (``-inf``: none yet), raised in place.

    Returns:
        ``tree``.

    This twin trusts its input; :func:`sumtree_update` validates first.
    """
    index = index.reshape(-1)
    if priority is None:
        priority = _default_priority(max_priority, tree.device)
    priority = priority.reshape(-1)
    _apply_ref(tree, index, transform_priority(priority, alpha, eps, tree.dtype))
    if max_priority is not None:
        _track_max_ref(max_priority, index, priority)
    return tree


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
    # is_cpu first: comparing devices makes a torch.device per tensor.
    if not (index.is_cpu and priority.is_cpu and tree.leaves.is_cpu) and (
        index.device != tree.device or priority.device != tree.device
    ):
        raise DeviceMismatchError(
            f"index ({index.device}) and priority ({priority.device}) must be on the tree's device {tree.device}"
        )
    if not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    # reshape() makes a tensor even when it changes nothing: 1-D operands (a sampler's) pass as they are.
    if index.ndim != 1:
        index = index.reshape(-1)
    if priority.numel() != 1 and priority.numel() != index.numel():
        raise PriorityError(
            f"priority of shape {list(priority.shape)} does not match index of shape {list(index.shape)}: "
            "expected one priority per index or a single one"
        )
    return index, priority if priority.ndim == 1 else priority.reshape(-1)


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


def _default_priority(max_priority: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The priority of new items: the running maximum, or 1.0 while it holds none (``-inf``)."""
    if max_priority is None:
        return torch.ones(1, dtype=torch.float64, device=device)
    return torch.where(max_priority < 0, torch.ones_like(max_priority), max_priority).reshape(1)


def _track_max_ref(max_priority: torch.Tensor, index: torch.Tensor, priority: torch.Tensor) -> None:
    """Raises ``max_priority`` (float64 ``[1]``) to the largest priority given to a non-negative index."""
    if index.numel() == 0:
        return
    p = priority.to(torch.float64).expand(index.shape) if priority.numel() == 1 else priority.to(torch.float64)
    batch_max = torch.where(index >= 0, p, torch.full_like(p, -math.inf)).amax()
    torch.maximum(max_priority, batch_max, out=max_priority)


def sumtree_update(
    tree: SumTree,
    index: torch.Tensor,
    priority: torch.Tensor | None,
    *,
    alpha: float = 1.0,
    eps: float = 0.0,
    limit: int | None = None,
    max_priority: torch.Tensor | None = None,
    validate: bool = True,
    eager: bool = False,
    backend: str = "auto",
) -> SumTree:
    """Batched update; see :func:`sumtree_update_ref` for the specification.

    One kernel call on a CPU tree (Numba: checks, leaf writes in call order, each distinct
    ancestor recomputed once, the maximum raised), at most three launches on a CUDA tree and no
    host synchronisation (see "Errors on the GPU" in the module docstring), the twin otherwise.
    Work is ``O(B * F * depth)`` at any capacity and nothing of the capacity's size is allocated.

    Args:
        tree, index, alpha, eps: as in :func:`sumtree_update_ref`.
        priority: as in :func:`sumtree_update_ref`; or None, for the priority of new items:
            ``max_priority``, or 1.0 while it holds none (``-inf``) or is not given.
        limit: indices must be below it (default and at most ``capacity``); a sampler passes the
            number of items written, so that no priority lands past the written range.
        max_priority: float64 ``[1]`` on the tree's device, or None: the running maximum of the
            raw priorities given to non-negative indices, raised in place (never rebound, so a
            captured CUDA graph keeps using it). ``-inf`` means none yet.
        validate: check priorities and indices (on the host for a CPU tree or with ``eager``,
            in the kernel on the GPU). With ``False`` the caller guarantees valid input.
        eager: on the GPU path, check on the host first (one synchronisation) and raise at the
            call, as on a CPU tree, instead of recording the error on the device.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        TypeError: ``index`` or ``priority`` is not a tensor of a suitable dtype.
        DeviceMismatchError: a tensor is not on the tree's device.
        PriorityError: a NaN, infinite or negative priority, one whose transform overflows the
            leaf dtype, or a priority count that is neither 1 nor ``B`` (device path without
            ``eager``: the count only; see "Errors on the GPU").
        IndexOutOfRangeError: an index ``>= limit`` (likewise).
        ValueError: ``alpha`` or ``eps`` negative or not finite, or ``limit`` not in
            ``[0, capacity]``.

        Raised at the call, the tree and ``max_priority`` are unchanged.
    """
    default = priority is None
    if default:
        priority = tree.leaves[:1] if max_priority is None else max_priority  # checked for shape and device only
    index, priority = _validate_update(tree, index, priority, alpha, eps)
    if max_priority is not None and (
        max_priority.dtype != torch.float64
        or max_priority.ndim != 1
        or max_priority.shape[0] != 1
        or (not (max_priority.is_cpu and tree.leaves.is_cpu) and max_priority.device != tree.device)
    ):
        raise TypeError(f"max_priority must be a float64 tensor of shape [1] on {tree.device}")
    if limit is None:
        limit = tree.capacity
    elif not 0 <= limit <= tree.capacity:
        raise ValueError(f"limit must lie in [0, {tree.capacity}], got {limit}")
    which = resolve("sumtree_update", tree.leaves, backend)
    if which == "triton":
        if validate and eager:
            prio = _default_priority(max_priority, tree.device) if default else priority
            _check_values(tree, index, prio, transform_priority(prio, alpha, eps, tree.dtype), limit)
        kernel_module("sumtree").sumtree_update_triton(
            tree, index, None if default else priority, alpha=alpha, eps=eps, limit=limit if validate else tree.capacity,
            max_priority=max_priority,
        )
        return tree
    if default:
        priority = _default_priority(max_priority, tree.device)
    if which == "numba":
        _update_numba(tree, index, priority, alpha, eps, limit, max_priority)
        return tree
    values = transform_priority(priority, alpha, eps, tree.dtype)
    if validate:
        _check_values(tree, index, priority, values, limit)
    _apply_ref(tree, index, values)
    if max_priority is not None:
        _track_max_ref(max_priority, index, priority)
    return tree


#: Priority dtypes the compiled update reads as they are; others are converted to float64 first.
_KERNEL_PRIORITY_DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32)
_NO_MAX = np.full(1, -np.inf)


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
    max_priority: torch.Tensor | None,
) -> None:
    """The compiled update: checks, leaves, ancestors and maximum in one call.

    The checks run whatever ``validate`` says: the kernel writes through raw indices, so an
    index past the tree must never reach it. On a failed check :func:`_check_values` raises its
    precise error; nothing was written.
    """
    if priority.dtype not in _KERNEL_PRIORITY_DTYPES:
        priority = priority.to(torch.float64)
    if index.numel() == 0:
        if priority.numel():
            _check_values(tree, index, priority, transform_priority(priority, alpha, eps, tree.dtype), limit)
        return
    kernels = kernel_module("cpu.sumtree")
    arrays = tree._numpy_arrays()
    status = kernels.update(
        arrays.leaves, arrays.sums, arrays.mins, arrays.offsets, arrays.sizes, arrays.shift, _numpy(index),
        _numpy(priority), float(alpha), float(eps), limit, _NO_MAX.copy() if max_priority is None else max_priority.numpy(),
    )
    if status != kernels.UPDATED:
        _check_values(tree, index, priority, transform_priority(priority, alpha, eps, tree.dtype), limit)
        # The C library's pow overflowed where torch's, a last bit lower, did not (a value at the
        # leaf dtype's bound): the kernel's verdict stands, with the twin's message.
        raise PriorityError(f"(priority + eps) ** alpha overflows {tree.dtype}")


def sumtree_check(tree: SumTree) -> None:
    """Raises the error a device kernel recorded in ``tree.flags`` since the last check, and clears it.

    One host synchronisation on a CUDA tree; on a CPU tree a read of memory (the CPU kernels
    raise at the call and never set the word).

    Raises:
        PriorityError: an update skipped a NaN, infinite or negative priority, or one whose
            transform overflows the leaf dtype.
        IndexOutOfRangeError: an update skipped an index ``>= limit``.
        EmptyBufferError: a draw from a tree whose total was not positive.
    """
    word = int(tree.flags[0])
    if not word:
        return
    tree.flags[0] = 0
    bits = ERROR_BITS
    if word & bits["bad_priority"]:
        raise PriorityError("an update on the device got NaN, infinite or negative priorities; those entries were skipped")
    if word & bits["overflow"]:
        raise PriorityError(f"an update on the device got priorities whose (p + eps) ** alpha overflows {tree.dtype}; those entries were skipped")
    if word & bits["bad_index"]:
        raise IndexOutOfRangeError(
            "an update on the device got indices past the written range (expected 0 <= index < limit, or negative to "
            "skip); those entries were skipped"
        )
    raise EmptyBufferError("a draw found every priority 0: nothing can be sampled (use eps > 0)")


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


def _draw_numba(
    tree: SumTree, uniforms: torch.Tensor, stratified: bool, beta: float | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The compiled draw in one call: ``(index, value, None)``, or with ``beta``, ``(index, None, weight)``.

    All draws descend level by level; batches from :data:`_SORTED_DRAWS` on in (nearly)
    increasing order of mass, which the kernel finds itself (a counting sort), smaller ones in
    draw order.
    """
    arrays = tree._numpy_arrays()
    u = uniforms if uniforms.dtype == torch.float64 else uniforms.to(torch.float64)
    n = u.shape[0]
    leaf_dtype = _NUMPY_LEAF_DTYPES[tree.dtype]
    # The outputs are NumPy arrays, handed out as tensors sharing their memory: np.empty and
    # torch.from_numpy cost 0.5 us together, torch.empty and Tensor.numpy() 1.2 us. The leaf
    # values are the kernel's scratch when only the weights are returned.
    out_index = np.empty(n, dtype=np.int64)
    out_value = np.empty(n, dtype=leaf_dtype)
    weighted = beta is not None
    out_weight = np.empty(n, dtype=leaf_dtype) if weighted else _NO_WEIGHTS[tree.dtype]
    kernel_module("cpu.sumtree").draw(
        arrays.leaves, arrays.sums, arrays.mins, arrays.offsets, arrays.sizes, arrays.shift, _numpy(u), bool(stratified),
        n >= _SORTED_DRAWS, _NO_ORDER_ARRAY, float(beta) if weighted else 0.0, out_index, out_value, out_weight,
    )
    if weighted:
        return torch.from_numpy(out_index), None, torch.from_numpy(out_weight)
    return torch.from_numpy(out_index), torch.from_numpy(out_value), None


_NO_ORDER_ARRAY = np.zeros(0, dtype=np.int64)
#: The draw kernel's "no weights" output (it only reads the length), per leaf dtype.
_NO_WEIGHTS = {dtype: np.zeros(0, dtype=array) for dtype, array in _NUMPY_LEAF_DTYPES.items()}


def _check_uniforms(tree: SumTree, uniforms: Any) -> None:
    if not isinstance(uniforms, torch.Tensor) or not uniforms.dtype.is_floating_point or uniforms.ndim != 1:
        raise TypeError("uniforms must be a 1-D floating tensor of draws in [0, 1)")
    if uniforms.device != tree.device:
        raise DeviceMismatchError(f"uniforms are on {uniforms.device}, the tree on {tree.device}")


def sumtree_sample(
    tree: SumTree,
    uniforms: torch.Tensor,
    *,
    stratified: bool = False,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefix-sum sampling; see :func:`sumtree_sample_ref` for the specification.

    One Triton launch on a CUDA tree (no synchronisation), one compiled call on a CPU tree, the
    twin otherwise; all give the twin's draws (the GPU's parallel sums may round differently).

    Args:
        tree, uniforms, stratified: as in :func:`sumtree_sample_ref`.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.

    Raises:
        TypeError: ``uniforms`` is not a 1-D floating tensor.
        DeviceMismatchError: ``uniforms`` is not on the tree's device.
    """
    _check_uniforms(tree, uniforms)
    which = resolve("sumtree_sample", tree.leaves, backend)
    if which == "triton":
        index, value, _ = kernel_module("sumtree").sumtree_sample_triton(
            tree, uniforms.to(torch.float64), stratified=stratified
        )
        return index, value
    if which == "numba":
        return _draw_numba(tree, uniforms, stratified, None)[:2]
    return sumtree_sample_ref(tree, uniforms, stratified=stratified)


def sumtree_sample_weighted(
    tree: SumTree, uniforms: torch.Tensor, beta: float, *, stratified: bool = False, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draws and their importance weights: the twin is :func:`sumtree_sample_ref`, then
    :func:`importance_weights` with ``p_min = tree.min()``.

    One Triton launch on a CUDA tree (draw, leaf values and weights; a tree whose total is not
    positive sets the ``empty`` error bit), one compiled call on a CPU tree. Both compute the
    weights' power differently from ``torch.pow`` (the GPU as ``exp(-beta * log(ratio))``, the
    CPU with the C library's ``pow``): within a few ulps of ``float64`` before rounding.

    Args:
        tree: the tree; only read.
        uniforms: 1-D ``float64`` draws in ``[0, 1)`` on the tree's device.
        beta: the importance exponent.
        stratified: as in :func:`sumtree_sample_ref`.
        backend: as in :func:`sumtree_sample`.

    Returns:
        ``(index, weight)``: ``int64 [B]`` and ``[B]`` in the leaf dtype, on the tree's device.

    Raises:
        As :func:`sumtree_sample`.
    """
    _check_uniforms(tree, uniforms)
    which = resolve("sumtree_sample", tree.leaves, backend)
    if which == "triton":
        index, _, weight = kernel_module("sumtree").sumtree_sample_triton(
            tree, uniforms.to(torch.float64), stratified=stratified, beta=float(beta)
        )
        return index, weight
    if which == "numba":
        index, _, weight = _draw_numba(tree, uniforms, stratified, beta)
        return index, weight
    index, value = sumtree_sample_ref(tree, uniforms, stratified=stratified)
    return index, importance_weights(value, tree.min(), beta)


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
