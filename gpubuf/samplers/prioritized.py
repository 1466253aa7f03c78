"""``PrioritizedSampler``: prioritized experience replay on a sum tree (TorchRL's ``PrioritizedSampler``)."""

from __future__ import annotations

import math
import numbers
import warnings
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch

from gpubuf.errors import (
    CapacityError,
    EmptyBufferError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    NotSharableError,
    PriorityError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
    UnsupportedOptionError,
)
from gpubuf.ops._dispatch import device_path
from gpubuf.ops.sumtree import (
    SumTree,
    fanout_for,
    sumtree_check,
    sumtree_rebuild,
    sumtree_sample_weighted,
    sumtree_update,
)
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.random import _check_batch_size, _unravel
from gpubuf.storages.base import check_device, check_fits_memory

__all__ = ["PrioritizedSampler"]

_EMPTY = "Cannot sample from an empty storage. Extend the buffer first."
_ALL_ZERO = "every priority is 0: nothing can be sampled (use eps > 0)"
_UNBOUND = object()
_REDUCTIONS = ("max", "min", "median", "mean")


def _check_exponent(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        # As TorchRL, a one-element tensor (a schedule's value) is taken as its number: read once, here.
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def _transformed_fits(priority: float, alpha: float, eps: float, dtype: torch.dtype) -> bool:
    """Whether ``(priority + eps) ** alpha`` is finite in the tree's leaf ``dtype`` (on the host)."""
    try:
        value = (float(priority) + eps) ** alpha
    except OverflowError:
        return False
    return math.isfinite(value) and value <= torch.finfo(dtype).max


class PrioritizedSampler(Sampler):
    r"""Prioritized experience replay (Schaul et al., 2015) with TorchRL's API and semantics.

    Item ``i`` with priority :math:`p_i` is drawn with probability
    :math:`(p_i + \epsilon)^\alpha / \sum_j (p_j + \epsilon)^\alpha`, and comes with the
    importance weight :math:`w_i = (P_i / P_{min})^{-\beta}` where :math:`P = (p + \epsilon)^\alpha`
    and :math:`P_{min}` is the smallest over every written item (TorchRL's exact formula: the
    weights are normalised so that the least likely item weighs 1).

    The transformed priorities live in a :class:`~gpubuf.ops.sumtree.SumTree` (fan-out 32,
    ``float64`` internal nodes recomputed from their children, a min kept beside the sums): a
    sample of ``B`` items and an update of ``B`` priorities each cost ``O(B log N)`` at any
    capacity: Triton kernels when the tree is on a GPU (a draw with its weights in one launch,
    an update in two or three), one compiled call each on a CPU (Numba), the torch twins where
    neither runs.

    New items get the current max priority (1.0 at first): the buffer calls :meth:`add` /
    :meth:`extend` after every write, and they set it (TorchRL's writers do the same through
    :meth:`mark_update`).

    Args:
        max_capacity: number of items the tree can hold: the storage's ``max_size``.
        alpha: priority exponent, ``>= 0`` (0 is uniform sampling).
        beta: importance-sampling exponent, ``>= 0``.
        eps: added to every priority before the exponent (default ``1e-8``).
        dtype: dtype of the tree's leaves and of the weights, ``torch.float`` or ``torch.double``.
        reduction: how a buffer of TensorDicts reduces per-item priorities with trailing dims
            (``"max"``, ``"min"``, ``"median"``, ``"mean"``).
        max_priority_within_buffer: when False (default), the priority given to new items is
            the largest ever set since construction (or :meth:`_empty`). When True, it is the
            largest among the items currently in the tree, recomputed from the tree (``O(N)``)
            after an update that lowers the priority of the item holding the maximum. Unlike
            TorchRL, overwriting that item does not reset the maximum to 1.0.
        device: where the tree lives (``sampler_device``). Defaults to None: the storage's
            device, taken the first time the sampler meets a storage whose device is known (the
            tree moves there with its contents).

    Keyword Args:
        stratified: draw one mass in each of ``B`` equal slices of the total instead of ``B``
            i.i.d. masses (TorchRL's scheme, the default). Lower variance, same marginals.
        eager_checks: on a GPU tree, check priorities and indices on the host before each
            update (one synchronisation) and raise at the call, as on a CPU; see "Errors on the
            GPU". The sum-tree ops' backend is the buffer's (``ReplayBuffer(backend=...)``).

    Devices:
        :meth:`sample` returns ``index`` and ``info["priority_weight"]`` on the storage's
        device (where the batch is gathered), or on the tree's device for storages without a
        device (``ListStorage``). :meth:`update_priority` takes indices and priorities on any
        device and copies them to the tree's. With a GPU tree neither synchronises with the
        host (unless the storage is on another device, or ``eager_checks``): the running
        maximum lives in a fixed device tensor, so ``sample`` and ``update_priority`` of a fixed
        batch size can be captured in a CUDA graph.

    Errors on the GPU:
        A CPU update checks every priority and index and raises before writing anything. A
        GPU update checks them in its kernel instead: a bad entry (NaN, infinite or negative
        priority, an index past the written range) is skipped, the others are written, and the
        error is recorded on the device. It is raised as the usual typed error
        (:class:`~gpubuf.errors.PriorityError`, :class:`~gpubuf.errors.IndexOutOfRangeError`)
        by :meth:`check_errors`, which :meth:`state_dict` and every host read of the sampler's
        state call; a draw from a tree with nothing to sample raises
        :class:`~gpubuf.errors.EmptyBufferError` there too. Priorities given on the host are
        checked on the host by the buffers, before anything is written.

    Randomness:
        Draws come from ``self._rng`` (the buffer's ``generator``), on that generator's device,
        or from torch's default generator of the tree's device when None. Unlike TorchRL on a
        CPU, numpy's global generator is never used, so ``torch.manual_seed`` makes samples
        reproducible.

    Raises:
        CapacityError: ``max_capacity`` is not a positive integer, or its tree cannot fit in the
            device's memory.
        InvalidArgumentError: ``alpha``, ``beta`` or ``eps`` negative or not finite; an unknown
            reduction (a ``ValueError``, as TorchRL).
        UnsupportedOptionError: a ``dtype`` other than float32 and float64 (a
            ``NotImplementedError``, as TorchRL).
        InvalidDeviceError: a malformed ``device``, or a CUDA device without CUDA.
    """

    _STATE_SCHEMA_VERSION: int = 1
    #: Whether the tree lives in memory other processes map (a loaded state is then copied into
    #: it rather than replacing it).
    shares_memory = False

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
        *,
        stratified: bool = False,
        eager_checks: bool = False,
    ) -> None:
        if isinstance(max_capacity, bool) or not isinstance(max_capacity, numbers.Integral) or max_capacity <= 0:
            raise CapacityError(f"max_capacity must be a positive integer, got {max_capacity!r}")
        if dtype not in (torch.float32, torch.float64):
            raise UnsupportedOptionError(
                f"dtype {dtype} not supported by PrioritizedSampler: use torch.float or torch.double"
            )
        if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self._max_capacity = int(max_capacity)
        self._alpha = _check_exponent("alpha", alpha)
        self._beta = _check_exponent("beta", beta)
        self._eps = _check_exponent("eps", eps)
        self.dtype = dtype
        self.reduction = reduction
        self._max_priority_within_buffer = bool(max_priority_within_buffer)
        self.stratified = bool(stratified)
        self.eager_checks = bool(eager_checks)
        self._device = None if device is None else check_device(device)
        self._storage: Any = None
        self._bound_device_attr: Any = _UNBOUND
        self._bound_backend: str | None = None
        # The leaves alone take capacity x itemsize bytes: a tree that cannot fit is refused
        # before the allocation (with overcommit, it would succeed and fail when first touched).
        check_fits_memory(
            self._max_capacity * dtype.itemsize,
            self._device or torch.device("cpu"),
            f"a priority tree of max_capacity={self._max_capacity:,}",
            expected="a max_capacity whose tree fits in the device's memory",
        )
        try:
            device_here = self._device or torch.device("cpu")
            self._tree = SumTree(self._max_capacity, dtype=dtype, device=device_here, fanout=fanout_for(device_here))
        except (MemoryError, RuntimeError, OverflowError) as err:
            raise CapacityError(
                f"a priority tree of max_capacity={self._max_capacity:,} cannot be allocated here ({type(err).__name__}): "
                "expected a capacity whose tree fits in the device's memory"
            ) from None
        # The running maximum of the raw priorities (-inf: none yet) and, with
        # max_priority_within_buffer, the item holding it (-1: unknown): fixed tensors on the
        # tree's device that the update kernels raise in place.
        self._max_value = torch.full((1,), -math.inf, dtype=torch.float64, device=self._tree.device)
        self._max_index = torch.full((1,), -1, dtype=torch.long, device=self._tree.device)

    # ------------------------------------------------------------------ properties
    @property
    def max_size(self) -> int:
        return self._max_capacity

    @property
    def device(self) -> torch.device:
        """The device of the priority tree."""
        return self._tree.device

    @property
    def tree(self) -> SumTree:
        """The sum tree (read it, do not write it)."""
        return self._tree

    @property
    def alpha(self) -> float:
        """The priority exponent.

        Setting it rewrites the stored ``(p + eps) ** alpha`` values for the new exponent in
        one ``O(capacity)`` pass, so sampling stays consistent (as TorchRL). From ``alpha == 0``
        the raw priorities cannot be recovered: the stored (uniform) values are kept, with a
        warning, until each item's priority is next updated.
        """
        return self._alpha

    @alpha.setter
    def alpha(self, value: float) -> None:
        value = _check_exponent("alpha", value)
        old = self._alpha
        if value != old:
            on_host = not device_path(self._max_value, self._backend)
            current = self._max_priority[0] if on_host else None
            if on_host and not _transformed_fits(
                1.0 if current is None else float(current), value, self._eps, self.dtype
            ):
                raise PriorityError(
                    f"alpha={value}: the priority given to new items, ({self.default_priority} + eps) ** alpha, "
                    f"overflows {self.dtype}; expected an alpha for which every priority stays finite"
                )
            self._retransform(old, value)
        self._alpha = value

    @property
    def beta(self) -> float:
        """The importance-sampling exponent; takes effect at the next :meth:`sample`."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = _check_exponent("beta", value)

    @property
    def default_priority(self) -> float | torch.Tensor:
        """The raw priority given to new items: the tracked maximum, or 1.0 before any update.

        A Python float with a CPU tree; a 0-d tensor with a GPU tree (no synchronisation).
        """
        value = self._max_value
        if value.device.type == "cpu":
            return 1.0 if value[0] < 0 else float(value[0])
        return torch.where(value < 0, torch.ones_like(value), value)[0]

    @property
    def _max_priority(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(maximum, index holding it)`` as 0-d tensors, None where unknown (reads the device)."""
        value, index = self._max_value[0], self._max_index[0]
        return (None if bool(value < 0) else value, None if bool(index < 0) else index)

    @_max_priority.setter
    def _max_priority(self, state: tuple[Any, Any]) -> None:
        # New tensors (a loaded state may be prepared on a shallow copy of the sampler, which must
        # not write into the live sampler's tensors); capture CUDA graphs after loading.
        value, index = state
        device = self._tree.device
        self._max_value = torch.full((1,), -math.inf if value is None else float(value), dtype=torch.float64, device=device)
        self._max_index = torch.full((1,), -1 if index is None else int(index), dtype=torch.long, device=device)

    def check_errors(self) -> None:
        """Raises the error a GPU kernel recorded since the last check (one synchronisation); see
        "Errors on the GPU". A no-op on a CPU tree, where updates raise at the call."""
        sumtree_check(self._tree)

    # ------------------------------------------------------------------ storage and devices
    def __getstate__(self) -> dict[str, Any]:
        """The sampler's state for pickling; refused for a spawned process, as by TorchRL.

        Raises:
            NotSharableError: sent to a spawned process (a ``multiprocessing`` argument): the
                child would update a copy of the priority tree that this process never sees.
        """
        if get_spawning_popen() is not None:
            raise NotSharableError(
                f"Samplers of type {type(self).__name__} cannot be shared between processes: a spawned process would "
                "update a copy of the priority tree that this one never sees; expected a SharedPrioritizedSampler "
                "(one tree in shared memory for every process), or the sampler kept in one process"
            )
        return dict(self.__dict__)

    def _bind(self, storage: Any) -> None:
        """Remembers ``storage`` and, without an explicit device, moves the tree to the storage's."""
        if storage is None:
            return
        device_attr = storage.device
        if storage is self._storage and device_attr is self._bound_device_attr and self._backend is self._bound_backend:
            return  # nothing changed since the last call (every sample and update calls this)
        self._storage = storage
        self._bound_device_attr = device_attr
        self._bound_backend = self._backend
        if self._device is None:
            device = storage.data_device
            if device is not None and device != self._tree.device:
                self._move_to(device)
        self._fit_fanout()

    def _move_to(self, device: torch.device) -> None:
        self._tree = self._tree.to(device)
        self._max_value = self._max_value.to(device)
        self._max_index = self._max_index.to(device)

    def _fit_fanout(self) -> None:
        """Rebuilds the tree with the fanout of where it is read (:func:`fanout_for`), once the
        buffer's backend and the storage's device are known: a tree made on the host and moved
        to CUDA, or read on the forced device path, takes the device's."""
        fanout = fanout_for(self._tree.device, self._backend)
        if self._tree.fanout != fanout:
            self._tree = self._tree.with_fanout(fanout)

    def _limit(self, storage: Any) -> int:
        """Priorities may only be set for written items."""
        if storage is None:
            return self._max_capacity
        try:
            return min(len(storage), self._max_capacity)
        except TypeError:
            return self._max_capacity

    def _rest_shape(self, storage: Any, coords: torch.Tensor) -> tuple[int, ...]:
        """Sizes of storage dims ``1..ndim-1``, to turn coordinates into flat indices."""
        shape = storage.shape if storage is not None else None
        if shape is not None and len(shape) == coords.shape[-1]:
            return tuple(int(s) for s in shape[1:])
        # Without the storage (a plain buffer tells the sampler about writes without it), the
        # writes cover whole rows of dims 1.., so the largest coordinate + 1 is the size.
        if coords.numel() == 0:
            raise SchemaMismatchError("coordinates given without a storage whose shape would place them")
        return tuple(int(s) + 1 for s in coords[:, 1:].amax(0).tolist())

    # ------------------------------------------------------------------ index and priority conversion
    def _flat_index(self, index: Any, storage: Any) -> torch.Tensor:
        """Any accepted index as a 1-D int64 tensor of flat tree indices on the tree's device."""
        device = self._tree.device
        if isinstance(index, torch.Tensor) and index.dtype == torch.long and index.ndim == 1 and index.device == device:
            # What a draw hands back (a sampled batch's "index"): already flat, nothing to convert.
            return index
        if isinstance(index, tuple):
            index = torch.stack([torch.as_tensor(i, dtype=torch.long, device=device).reshape(-1) for i in index], -1)
        elif isinstance(index, slice):
            index = torch.arange(*index.indices(self._max_capacity), device=device)
        elif not isinstance(index, torch.Tensor):
            array = np.asarray(index)
            index = torch.as_tensor(array.astype(np.int64) if array.size == 0 else array)
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise TypeError(f"index must hold integers, got {index.dtype}")
        index = index.to(device=device, dtype=torch.long)
        if index.ndim <= 1:
            return index.reshape(-1)
        ndim = storage.ndim if storage is not None else None
        if index.ndim != 2 or (ndim is not None and index.shape[-1] != ndim) or index.shape[-1] < 2:
            raise SchemaMismatchError(
                f"an index of shape {list(index.shape)} does not address a storage of ndim {ndim}: expected [B] "
                "flat indices or [B, ndim] coordinates"
            )
        rest = self._rest_shape(storage, index)
        flat = index[:, 0].clone()
        for dim, size in enumerate(rest, start=1):
            coord = index[:, dim]
            if bool((coord >= size).any()):
                raise IndexOutOfRangeError(f"coordinate {int(coord.max())} is out of range for storage dim {dim} of size {size}")
            flat = flat * size + coord
        # A negative coordinate marks an item to skip, like a negative flat index.
        return torch.where((index < 0).any(-1), torch.full_like(flat, -1), flat)

    def _priority_tensor(self, priority: Any, n: int) -> torch.Tensor:
        device = self._tree.device
        if isinstance(priority, torch.Tensor):
            # Attribute reads first: detach(), to() and reshape() each make a tensor even when
            # they change nothing.
            if priority.requires_grad:
                priority = priority.detach()
            if priority.device != device:
                priority = priority.to(device)
        else:
            priority = torch.as_tensor(np.asarray(priority, dtype=np.float64), device=device)
        if priority.numel() > 1 and priority.numel() != n:
            raise PriorityError(
                f"priority of shape {list(priority.shape)} does not match {n} indices: expected one priority per "
                "index or a single one"
            )
        return priority if priority.ndim == 1 else priority.reshape(-1)

    # ------------------------------------------------------------------ writes
    def add(self, index: int | torch.Tensor) -> None:
        """Gives the item written at ``index`` the default priority (the buffer calls this after a write)."""
        self.mark_update(index)

    def extend(self, index: torch.Tensor | tuple) -> None:
        """Gives the items written at ``index`` the default priority (the buffer calls this after a write)."""
        self.mark_update(index)

    def _check_priority(self, priority: torch.Tensor) -> None:
        """Refuses NaN, infinite or negative priorities, or ones whose transformed value overflows
        the tree's dtype. Host tensors only: a device tensor is checked by the update itself."""
        if priority.device.type != "cpu" or priority.numel() == 0:
            return
        values = priority.detach().to(torch.float64)
        if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
            raise PriorityError("priority contains NaN, infinite or negative values: expected finite numbers >= 0")
        if not _transformed_fits(float(values.max()), self._alpha, self._eps, self.dtype):
            raise PriorityError(
                f"priority {float(values.max())}: (p + eps) ** alpha with alpha={self._alpha} overflows {self.dtype}"
            )

    def _check_new_items(self, storage: Any = None, data: Any = None, *, batched: bool = True) -> None:
        """Refuses, before the buffer writes rows, what :meth:`extend` would refuse after.

        The storage's elements must fit the tree: an ``ndim > 1`` storage rounds its capacity up
        to whole rows along dim 0, which may hold more elements than ``max_capacity``. New items
        get :attr:`default_priority`; its transformed value must fit the tree. Read on the host
        only: with a CUDA tree the maximum stays on the device (no synchronisation), and the
        update's own validation applies.

        Raises:
            CapacityError: the storage can hold more elements than the tree.
            PriorityError: the default priority overflows the tree's dtype.
        """
        if storage is not None and storage.ndim > 1:
            elements = storage._element_capacity(data, batched=batched)
            if elements > self._max_capacity:
                raise CapacityError(
                    f"the storage holds up to {elements:,} elements (max_size={storage.max_size:,} rounded up to "
                    f"whole rows along its first dim), more than this sampler's priority tree of "
                    f"max_capacity={self._max_capacity:,}: pass max_capacity={elements:,}"
                )
        if device_path(self._max_value, self._backend):
            return  # reading the maximum would wait for the device
        current = self._max_priority[0]
        priority = 1.0 if current is None else float(current)
        if not _transformed_fits(priority, self._alpha, self._eps, self.dtype):
            raise PriorityError(
                f"new items would get priority {priority}, and ({priority} + eps) ** alpha with alpha={self._alpha} "
                f"overflows {self.dtype}: nothing was written; expected a smaller alpha or maximum priority"
            )

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """Sets the priority of ``index`` to :attr:`default_priority` (TorchRL's hook for written items).

        The maximum is read where it lives (in the update kernel on a GPU): no synchronisation.
        """
        self._update(index, None, storage)

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        """Sets the priorities of the items at ``index``.

        Args:
            index: an int, a sequence, array or tensor of ints (flat indices), a ``[B, ndim]``
                tensor or a tuple of ``ndim`` tensors of coordinates for storages with
                ``ndim > 1``. Negative indices are skipped (``TensorDictMaxValueWriter`` marks
                dropped items with -1). When an index appears more than once, its last
                priority wins.
            priority: one priority per index (any shape with ``B`` elements), or a single one
                for all; raw, before ``(p + eps) ** alpha``. Any device.

        Keyword Args:
            storage: the buffer's storage. It bounds the indices to the written range, places
                coordinates, and fixes the tree's device when none was given.

        Raises:
            PriorityError: a NaN, infinite or negative priority, or a priority count that is
                neither 1 nor ``B``.
            IndexOutOfRangeError: an index past the written range (or the capacity).
            SchemaMismatchError: an index whose shape fits neither flat indices nor coordinates.
            TypeError: a non-integer index.

            On any of these nothing changes: priorities, tree and maximum are as they were.
        """
        self._update(index, priority, storage)

    def _update(self, index: Any, priority: Any, storage: Any) -> None:
        """:meth:`update_priority`; ``priority`` None gives the items the default priority."""
        storage = storage if storage is not None else self._storage
        self._bind(storage)
        # No autograd to switch off: indices are integers and _priority_tensor detaches.
        flat = self._flat_index(index, storage)
        prio = None if priority is None else self._priority_tensor(priority, flat.numel())
        if self._max_priority_within_buffer:
            if prio is None:
                prio = torch.as_tensor(self.default_priority, dtype=torch.float64, device=self._tree.device).reshape(1)
            for tree, at in self._update_targets(flat, priority is None):
                sumtree_update(tree, at, prio, alpha=self._alpha, eps=self._eps, limit=self._limit(storage),
                               eager=True, backend=self._backend)
            self._track_within_buffer(flat, prio)
            return
        for tree, at in self._update_targets(flat, priority is None):
            sumtree_update(
                tree, at, prio, alpha=self._alpha, eps=self._eps, limit=self._limit(storage),
                max_priority=self._max_value, eager=self.eager_checks, backend=self._backend,
            )

    def _update_targets(self, flat: torch.Tensor, new_items: bool) -> tuple[tuple[SumTree, torch.Tensor], ...]:
        """The trees a priority update writes, each with the indices it takes (-1 where another
        tree takes the item): here the one tree, every index. ``new_items``: the default priority
        of items just written (``extend``), else a caller's update. The first tree gets every index
        the update must check (past the written range, on the device path an error recorded
        rather than raised), so that a bad one changes nothing in the later trees either."""
        return ((self._tree, flat),)

    def _track_within_buffer(self, index: torch.Tensor, priority: torch.Tensor) -> None:
        """Updates the maximum and the item holding it after a successful update (host reads)."""
        valid = index >= 0
        if not bool(valid.any()):
            return
        prio = priority.to(torch.float64).expand(index.shape) if priority.numel() == 1 else priority.to(torch.float64)
        masked = torch.where(valid, prio, torch.full_like(prio, -math.inf))
        batch_max, at = masked.max(0)
        batch_index = index[at]
        current, current_index = self._max_priority
        if current is None:
            self._max_value.fill_(float(batch_max))
            self._max_index.fill_(int(batch_index))
        else:
            self._refresh_within_buffer(index, batch_max, batch_index)

    def _refresh_within_buffer(self, index: torch.Tensor, batch_max: torch.Tensor, batch_index: torch.Tensor) -> None:
        current, current_index = self._max_priority
        if self._alpha == 0:
            # The tree holds 1.0 for every item: raw priorities cannot be read back. Keep a
            # running maximum, as TorchRL does.
            self._max_value.fill_(max(float(current), float(batch_max)))
            return
        touched = current_index is None or bool((index == current_index).any())
        if not touched:
            if bool(batch_max > current):
                self._max_value.fill_(float(batch_max))
                self._max_index.fill_(int(batch_index))
            return
        # The item holding the maximum got a new priority: read the maximum back from the tree.
        leaves = self._tree.values()
        value, at = leaves.max(0)
        raw = (value.to(torch.float64) ** (1.0 / self._alpha) - self._eps).clamp_min(0)
        self._max_value.fill_(float(raw))
        self._max_index.fill_(int(at))

    # ------------------------------------------------------------------ sampling
    def _uniforms(self, batch_size: int) -> torch.Tensor:
        device = self._tree.device
        rng = self._rng
        if rng is None:
            return torch.rand(batch_size, dtype=torch.float64, device=device)
        return torch.rand(batch_size, dtype=torch.float64, device=rng.device, generator=rng).to(device)

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """Draws ``batch_size`` items in proportion to their transformed priorities.

        Returns:
            ``(index, info)``: ``index`` is a 1-D int64 tensor (a tuple of them, one per storage
            dim, for ``ndim > 1``); ``info["priority_weight"]`` holds
            ``(P_i / P_min) ** (-beta)`` in the sampler's ``dtype``. Both are on the storage's
            device (the tree's for storages without a device).

        Raises:
            EmptyBufferError: the storage holds nothing, or (CPU tree) every priority is 0.
            BatchSizeError: ``batch_size`` is not a positive int.
        """
        batch_size = _check_batch_size(batch_size)
        self._bind(storage)
        if len(storage) == 0:
            raise EmptyBufferError(_EMPTY)
        tree = self._tree
        if not device_path(tree.leaves, self._backend) and not tree.host_total() > 0:
            # A read of host memory; a GPU tree records this on the device instead (check_errors).
            raise EmptyBufferError(_ALL_ZERO)
        index, weight = sumtree_sample_weighted(
            tree, self._uniforms(batch_size), self._beta, stratified=self.stratified, backend=self._backend
        )
        target = storage.data_device
        if target is not None and target != index.device:
            index, weight = index.to(target), weight.to(target)
        if storage.ndim > 1:
            index = _unravel(index, storage.shape)
        return index, {"priority_weight": weight}

    # ------------------------------------------------------------------ alpha changes
    def _retransform(self, old_alpha: float, new_alpha: float) -> None:
        leaves = self._tree.values()
        written = leaves > 0
        if not bool(written.any()):
            return
        if old_alpha == 0:
            warnings.warn(
                "changing alpha away from 0 cannot recover the raw priorities (alpha == 0 stores 1.0 for every "
                "item): sampling stays uniform for each item until its priority is next updated",
                stacklevel=3,
            )
            return
        raw = (leaves.to(torch.float64) ** (1.0 / old_alpha) - self._eps).clamp_min(0)
        new = torch.where(written, (raw + self._eps) ** new_alpha, torch.zeros_like(raw))
        if not bool((new <= torch.finfo(self.dtype).max).all()):
            # Checked before any leaf changes: the alpha setter then raises with the tree intact.
            raise PriorityError(
                f"alpha={new_alpha}: (p + eps) ** alpha of a stored priority overflows {self.dtype}; expected an alpha "
                "for which every stored priority stays finite"
            )
        leaves.copy_(new.to(self.dtype))
        sumtree_rebuild(self._tree)

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        self._tree.clear_()
        self._max_value.fill_(-math.inf)
        self._max_index.fill_(-1)

    def _prefetch_state(self) -> None:
        # Sampling reads the tree and changes nothing in the sampler (the generator's state is
        # the buffer's to save): there is nothing to undo for a dropped prefetched batch.
        return None

    def _prefetch_restore(self, state: None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain values and CPU tensors: the exponents, the tracked maximum and the tree's leaves.

        Raises a recorded device error first (:meth:`check_errors`).
        """
        self.check_errors()
        value, index = self._max_priority
        return {
            "_schema_version": self._STATE_SCHEMA_VERSION,
            "_alpha": self._alpha,
            "_beta": self._beta,
            "_eps": self._eps,
            "_max_capacity": self._max_capacity,
            "_max_priority": None if value is None else float(value),
            "_max_priority_index": None if index is None else int(index),
            "_tree": self._tree.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`; the tree is rebuilt on this sampler's device.

        The whole state is checked before anything changes.

        Raises:
            StateDictKeyError: a key is missing.
            StateDictError: a value of the wrong type or out of range (an exponent that is
                negative or not finite, a maximum priority that is NaN, negative leaves), a
                capacity or tree dtype that differs from this sampler's, or exponents under which
                the maximum priority overflows the tree's dtype.
        """
        alpha, beta, eps, tree_state, value, index = self._check_state(state_dict)
        try:
            tree = SumTree.from_state_dict(tree_state, device=self._tree.device, fanout=self._tree.fanout)
        except (TypeError, ValueError, RuntimeError) as err:
            raise StateDictError(f"sampler state: the tree's leaves cannot be loaded: {err}") from None
        self._alpha, self._beta, self._eps = alpha, beta, eps
        self._tree = tree
        device = tree.device
        self._max_priority = (
            None if value is None else torch.tensor(value, dtype=torch.float64, device=device),
            None if index is None else torch.tensor(index, dtype=torch.long, device=device),
        )

    def _check_state_dict(self, state_dict: Any) -> None:
        self._check_state(state_dict)

    def _check_state(self, state_dict: Any) -> tuple:
        """Validates a :meth:`state_dict` whole; returns ``(alpha, beta, eps, tree state, max, max index)``."""
        where = "sampler state"
        if not isinstance(state_dict, dict):
            raise StateDictError(f"{where}: expected a dict, got {type(state_dict).__name__}")
        if "_tree" not in state_dict and "_sum_tree" in state_dict:
            state_dict = self._from_torchrl_state(state_dict)
        for key in ("_alpha", "_beta", "_eps", "_max_capacity", "_max_priority", "_tree"):
            if key not in state_dict:
                raise StateDictKeyError(f"{where}: missing key {key!r} (expected the keys of PrioritizedSampler.state_dict())")
        try:
            alpha, beta, eps = (_check_exponent(name, state_dict[f"_{name}"]) for name in ("alpha", "beta", "eps"))
        except InvalidArgumentError as err:
            raise StateDictError(f"{where}: {err}") from None
        capacity = state_dict["_max_capacity"]
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity != self._max_capacity:
            raise StateDictError(
                f"{where}: the state's capacity ({capacity!r}) differs from this sampler's ({self._max_capacity})"
            )
        tree_state = state_dict["_tree"]
        if not isinstance(tree_state, dict) or not {"capacity", "fanout", "dtype", "leaves"} <= set(tree_state):
            raise StateDictError(f"{where}: _tree must be a dict with capacity, fanout, dtype and leaves")
        tree_capacity = tree_state["capacity"]
        if (
            isinstance(tree_capacity, bool)
            or not isinstance(tree_capacity, numbers.Integral)
            or tree_capacity != self._max_capacity
        ):
            raise StateDictError(
                f"{where}: the tree's capacity ({tree_state['capacity']!r}) differs from this sampler's ({self._max_capacity})"
            )
        if not isinstance(tree_state["dtype"], str) or tree_state["dtype"] != str(self.dtype).removeprefix("torch."):
            raise StateDictError(f"{where}: the tree dtype ({tree_state['dtype']!r}) differs from this sampler's ({self.dtype})")
        fanout = tree_state["fanout"]
        if isinstance(fanout, bool) or not isinstance(fanout, numbers.Integral) or fanout < 2:
            raise StateDictError(f"{where}: the tree's fanout must be an int >= 2, got {fanout!r}")
        leaves = tree_state["leaves"]
        if (
            not isinstance(leaves, torch.Tensor)
            or leaves.shape != torch.Size([self._max_capacity])
            or not leaves.dtype.is_floating_point
        ):
            raise StateDictError(f"{where}: expected {self._max_capacity} float leaves in _tree")
        if leaves.device.type == "cpu" and not bool((torch.isfinite(leaves) & (leaves >= 0)).all()):
            # A state dict holds CPU leaves; a device copy is left to the tree's own checks.
            raise StateDictError(f"{where}: the tree's leaves must be finite and >= 0")
        value = state_dict["_max_priority"]
        if value is not None:
            if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
                value = float(value)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
                raise StateDictError(f"{where}: _max_priority must be None or a finite number >= 0, got {value!r}")
            value = float(value)
        if not _transformed_fits(1.0 if value is None else value, alpha, eps, self.dtype):
            raise StateDictError(
                f"{where}: with alpha={alpha}, the maximum priority {value} overflows {self.dtype} once transformed; "
                "expected exponents under which every priority stays finite"
            )
        index = state_dict.get("_max_priority_index")
        if index is not None:
            if isinstance(index, torch.Tensor) and index.numel() == 1 and index.device.type == "cpu":
                index = int(index)
            if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < self._max_capacity:
                raise StateDictError(f"{where}: _max_priority_index must be None or an index below the capacity, got {index!r}")
            index = int(index)
        return alpha, beta, eps, tree_state, value, index

    def _from_torchrl_state(self, state_dict: dict) -> dict:
        """TorchRL's ``PrioritizedSampler.state_dict()`` (its compiled segment trees) in this
        sampler's form, for :meth:`_check_state` to check: the leaves are read from TorchRL's sum
        tree (they hold the same ``(p + eps) ** alpha``), ``_max_priority`` is its
        ``(value, index)`` pair (the raw priority, TorchRL's schema 1)."""
        where = "sampler state"
        tree = state_dict["_sum_tree"]
        size = getattr(tree, "size", None)
        if not callable(getattr(tree, "query", None)) or isinstance(size, bool) or not isinstance(size, int):
            raise StateDictError(f"{where}: _sum_tree is a {type(tree).__name__}, expected TorchRL's sum segment tree")
        try:
            leaves = torch.as_tensor(tree[torch.arange(size)]).reshape(size).to(self.dtype)
        except (TypeError, ValueError, RuntimeError, IndexError) as err:
            raise StateDictError(f"{where}: the leaves of TorchRL's sum tree cannot be read: {err}") from None
        pair = state_dict.get("_max_priority", (None, None))
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise StateDictError(f"{where}: TorchRL's _max_priority must be a (value, index) pair, got {pair!r:.80}")
        return {
            **{key: state_dict.get(key) for key in ("_alpha", "_beta", "_eps")},
            "_max_capacity": size,
            "_max_priority": pair[0],
            "_max_priority_index": pair[1],
            "_tree": {"capacity": size, "fanout": self._tree.fanout, "dtype": str(self.dtype).removeprefix("torch."),
                      "leaves": leaves},
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(alpha={self._alpha}, beta={self._beta}, eps={self._eps}, "
            f"reduction={self.reduction}, device={self.device})"
        )
