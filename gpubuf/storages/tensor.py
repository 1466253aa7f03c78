"""Contiguous tensor storages: ``TensorStorage`` and ``LazyTensorStorage``.

Each leaf of the stored data (a tensor, or every tensor of a TensorDict / tensorclass / pytree)
is one preallocated tensor of shape ``[capacity_along_dim0, *item_shape]`` on the storage's
device. Reads gather rows of all leaves at once (one Triton launch on CUDA, ``index_select`` per
leaf on CPU) and wrap them back into the container the data came in.

Every write is validated in full before the first byte is copied, so a bad batch leaves the
storage exactly as it was.
"""

from __future__ import annotations

import bisect
import math
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from multiprocessing.context import get_spawning_popen
from typing import Any, Collection, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase, is_tensor_collection, is_tensorclass

from gpubuf.errors import (
    DeviceMismatchError,
    GpubufError,
    StateDictError,
    EmptyBufferError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidIndexError,
    SchemaMismatchError,
    StorageNotSharableError,
)
from gpubuf.ops.gather_rows import gather_rows_trusted
from gpubuf.ops.write_rows import write_rows_trusted
from gpubuf.host_memory import HUGE_PAGE_BYTES, empty_host, huge_pages_enabled
from gpubuf.storages._layout import Layout
from gpubuf.storages._shared import FileState, LocalState
from gpubuf.storages.base import Storage
from gpubuf.storages.checks import check_fits_memory, check_max_size, check_state_keys
from gpubuf.storages.items import (
    AUTO_DEVICE,
    as_device,
    element_coordinates,
    is_int,
    leading_shape,
    leading_size,
    stack_items,
)



def _empty_leaf(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised leaf tensor from torch's allocator, as TorchRL's storages have; with
    :func:`~gpubuf.host_memory.use_huge_pages`, a CPU leaf of at least 2 MiB goes on transparent
    huge pages instead.

    By default pages are faulted in as rows are first written, 4 KiB at a time: a first extend
    pays for the rows it writes, not for the capacity (huge pages made each first touch fault in
    and zero 2 MiB; on a 2-core VM a first extend of 100,000 rows into a 1M-row storage ran at
    0.5x TorchRL's speed). Huge pages pay off for samples of a buffer filled once: rows read
    scattered over a leaf then cost no TLB walk each (1M rows of 292 B, B = 256: the five-field
    gather in 0.86 times the time). Rounding up to whole huge pages wastes under 2 MiB per leaf.
    """
    if device.type == "cpu" and math.prod(shape) * dtype.itemsize >= HUGE_PAGE_BYTES and huge_pages_enabled():
        return empty_host(shape, dtype, huge_from=HUGE_PAGE_BYTES, reuse=False)
    return torch.empty(shape, dtype=dtype, device=device)


class TensorStorage(Storage):
    """A storage of tensors, TensorDicts, tensorclasses or pytrees of tensors, over given tensors.

    Args:
        storage: the data to use as storage (its first dimension is the capacity), or ``None``
            for a lazily initialised subclass.
        max_size: the capacity; inferred from ``storage`` when omitted.

    Keyword Args:
        device: where the data lives and where sampled batches are returned. ``"cpu"`` (the
            default, as in TorchRL), ``"cuda"``, any ``torch.device``, or ``"auto"``/``None`` to
            take it from the data. With an explicit device, batches on another device are
            copied there on write. With ``"auto"``, the first batch fixes the device and a later
            batch on another device raises :class:`~gpubuf.errors.DeviceMismatchError`.
        ndim: how many leading dimensions count towards the length: a storage of shape
            ``[3, 4]`` has capacity 3 with ``ndim=1`` and 12 with ``ndim=2``.
        compilable: accepted for TorchRL compatibility.
    """

    #: The leaves' byte ranges for the alias check of a write (see :meth:`_store_spans`).
    _spans: "_StoreSpans | None" = None

    # A buffer's update_if_present patches records in place here.
    supports_conditional_update = True

    def __init__(
        self,
        storage: Any,
        max_size: int | None = None,
        *,
        device: torch.device | str | None = "cpu",
        ndim: int = 1,
        compilable: bool = False,
    ) -> None:
        if storage is None and max_size is None:
            raise InvalidArgumentError(
                "Expected storage to be non-null: TensorStorage got neither storage nor max_size (expected a tensor or "
                "TensorDict as storage, or a max_size)"
            )
        if isinstance(ndim, bool) or not isinstance(ndim, int) or ndim < 1:
            raise InvalidArgumentError(f"ndim must be a positive int, got {ndim!r}")
        self._state: LocalState | FileState = LocalState()
        self.ndim = ndim
        self._layout: Layout | None = None
        self._leaves: list[torch.Tensor] | None = None
        self._flat_leaves: list[torch.Tensor] | None = None
        self._rest_shape = torch.Size()  # dims 1..ndim-1 of the storage
        self._len = 0
        self._auto_device = device in AUTO_DEVICE
        self.device = "auto" if self._auto_device else as_device(device)
        if storage is not None:
            leading = leading_size(storage)
            if max_size is not None and check_max_size(max_size) != leading:
                raise InvalidArgumentError(
                    f"The max-size and the storage shape mismatch: got max_size={max_size} for a storage whose first "
                    f"dimension is {leading}"
                )
            super().__init__(leading, compilable=compilable)
            if isinstance(storage, TensorDictBase) and storage.is_empty():
                # TorchRL's TensorStorage(TensorDict(batch_size=[n])): n rows whose entries come
                # with the first write, then all counted as held, as any given storage's are;
                # rows not written read as zeros, as the entries TorchRL adds to the TensorDict.
                self._zero_rows = True
                if self._auto_device and storage.device is not None:
                    self.device = storage.device
                return
            layout = Layout.from_batch(storage, leading=1)
            leaves = layout.split(storage, leading=[leading], device=None)
            if self._auto_device:
                self.device = leaves[0].device
            self._install(layout, [leaf.to(self.device).contiguous() for leaf in leaves])
            self._len = self.max_size
        else:
            super().__init__(max_size, compilable=compilable)

    # ------------------------------------------------------------------ size bookkeeping
    #: A storage given as an empty TensorDict: its leaves are allocated zeroed, and every row is
    #: counted as held from the first write on.
    _zero_rows = False

    @property
    def initialized(self) -> bool:
        return self._leaves is not None

    # ------------------------------------------------------------------ write state
    @property
    def _write_state(self) -> LocalState | FileState:
        """The length, cursor and write count that every writer of this storage shares: in this
        process (:class:`~gpubuf.storages._shared.LocalState`) until the storage is sent to a
        spawned process, then in a state file that both sides map (see :meth:`__getstate__`)."""
        return self._state

    @property
    def _len(self) -> int:
        return self._state.length

    @_len.setter
    def _len(self, value: int) -> None:
        self._state.length = int(value)

    def __getstate__(self) -> dict[str, Any]:
        """The storage's state for pickling. Sent to a spawned process (a ``multiprocessing``
        argument), the rows travel as shared memory (torch's reductions) and the counters move to
        a state file in a temporary directory that both processes map, so that every process's
        writes reserve distinct rows and all of them see one length (TorchRL shares the same
        through ``multiprocessing.Value``s). A plain ``pickle`` makes an independent copy.

        Raises:
            StorageNotSharableError: sent to a spawned process before the first write (the child
                would allocate rows of its own that this process never sees).
        """
        if get_spawning_popen() is not None and not self._state.shared:
            self._share_state()
        return dict(self.__dict__)

    def _share_state(self) -> None:
        if not self.initialized:
            raise StorageNotSharableError(
                f"Cowardly refusing to share a storage of type {type(self).__name__} between processes if it has not "
                "been initialized yet: expected some data written first, in the main process (or a "
                "LazyTensorStorage(shared_init=True), which the processes initialise together)"
            )
        local = self._state
        directory = tempfile.mkdtemp(prefix="gpubuf-state-")
        shared = FileState.open(directory, max_size=self.max_size, ndim=self.ndim, reset=True)
        shared.length, shared.cursor, shared.write_count = local.length, local.cursor, local.write_count
        self._state = shared
        # The directory is this process's: removed with the storage (mapped files stay valid).
        weakref.finalize(self, shutil.rmtree, directory, True)

    def __len__(self) -> int:
        return self._len

    @property
    def _rest_numel(self) -> int:
        return self._rest_shape.numel()

    @property
    def _len_along_dim0(self) -> int:
        return -(-self._len // self._rest_numel)

    @property
    def _capacity_along_dim0(self) -> int:
        return self.max_size // self._rest_numel

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        if self.initialized or self.ndim == 1:
            return self._capacity_along_dim0
        data = single_data if single_data is not None else batched_data
        if data is None:
            raise ValueError("single_data or batched_data must be passed")
        shape = leading_shape(data, self.ndim if batched_data is not None else self.ndim - 1)
        rest = shape[1:] if batched_data is not None else shape
        return -(-self.max_size // max(torch.Size(rest).numel(), 1))

    def _element_capacity(self, data: Any = None, *, batched: bool = True) -> int:
        if self.ndim == 1:
            return self.max_size
        if self.initialized:
            return self._total_shape.numel()
        if batched:
            rows = self._max_size_along_dim0(batched_data=data)
        else:
            rows = self._max_size_along_dim0(single_data=data)
        shape = leading_shape(data, self.ndim if batched else self.ndim - 1)
        return rows * torch.Size(shape[1:] if batched else shape).numel()

    @property
    def shape(self) -> torch.Size | None:
        if not self.initialized:
            return None
        return torch.Size([self._len_along_dim0, *self._rest_shape])

    @property
    def _total_shape(self) -> torch.Size | None:
        if not self.initialized:
            return None
        return torch.Size([self._capacity_along_dim0, *self._rest_shape])

    # ------------------------------------------------------------------ initialisation
    def _install(self, layout: Layout, leaves: list[torch.Tensor]) -> None:
        self._layout = layout
        self._leaves = leaves
        if self.ndim > 1:
            self._rest_shape = leaves[0].shape[1 : self.ndim]
            if len(self._rest_shape) != self.ndim - 1:
                raise SchemaMismatchError(
                    f"ndim={self.ndim} needs items with at least {self.ndim - 1} leading dims, got leaf shape "
                    f"{list(leaves[0].shape[1:])}"
                )
            self.max_size = leaves[0].shape[: self.ndim].numel()
            # Row views over all ndim batch dims, used by gathers with an index over elements.
            self._flat_leaves = [leaf.view(-1, *leaf.shape[self.ndim :]) for leaf in leaves]
        else:
            self._flat_leaves = leaves

    def _allocate(self, layout: Layout, device: torch.device) -> list[torch.Tensor]:
        """Allocates one uninitialised tensor per leaf; rounds max_size up to whole dim-0 rows for ndim > 1."""
        if self.ndim > 1:
            rest = layout.leaves[0].shape[: self.ndim - 1]
            if len(rest) != self.ndim - 1:
                raise SchemaMismatchError(
                    f"ndim={self.ndim} needs items with at least {self.ndim - 1} batch dims; got item shape "
                    f"{list(layout.leaves[0].shape)}"
                )
            cap0 = -(-self.max_size // max(rest.numel(), 1))
        else:
            cap0 = self.max_size
        row_bytes = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in layout.leaves)
        check_fits_memory(cap0 * row_bytes, device, f"a {type(self).__name__} of {cap0:,} rows of {row_bytes:,} bytes")
        if self._zero_rows:
            return [torch.zeros((cap0, *spec.shape), dtype=spec.dtype, device=device) for spec in layout.leaves]
        return [_empty_leaf((cap0, *spec.shape), spec.dtype, device) for spec in layout.leaves]

    def _target_device(self, leaves: Sequence[torch.Tensor]) -> torch.device:
        if self.initialized or not self._auto_device:
            return self.device
        return leaves[0].device

    # ------------------------------------------------------------------ writing
    def _prepare(
        self, data: Any, leading: Sequence[int] | None, item_offset: int = 0
    ) -> tuple[Layout, list[torch.Tensor], bool]:
        """Validates ``data`` and returns ``(layout, leaves on the storage device, needs_init)``.

        Nothing is modified; every error is raised here, before any write.
        """
        if isinstance(data, list) and leading is not None and len(leading) >= 1:
            data = stack_items(data)
        needs_init = not self.initialized
        if needs_init:
            layout = Layout.from_batch(data, leading=0 if leading is None else len(leading))
        else:
            layout = self._layout
        fixed_device = self.device if (self.initialized and self._auto_device) else None
        leaves = layout.split(data, leading=leading, device=fixed_device, item_offset=item_offset)
        device = self._target_device(leaves)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceMismatchError(f"this storage's device is {device} but CUDA is not available here")
        # Moved where needed (new tensors: nothing of the caller's or the storage's changes).
        moved = []
        for spec, leaf in zip(layout.leaves, leaves):
            leaf_device = leaf.device
            if leaf_device != device:
                if leaf_device.type == "meta":
                    raise DeviceMismatchError(
                        f"leaf {spec.key!r} is on the meta device and holds no data; expected data movable to {device}"
                    )
                leaf = leaf.to(device)
            moved.append(leaf)
        return layout, moved, needs_init

    def _init_from(self, layout: Layout, leaves: list[torch.Tensor]) -> None:
        device = leaves[0].device
        storage = self._allocate(layout, device)
        if self._auto_device:
            self.device = device
        self._install(layout, storage)
        if self._zero_rows:
            self._len = self.max_size

    def _write_rows(self, start: int, data: Any) -> int:
        """Writes a batch along dim 0 at rows ``start, start+1, ...`` wrapping round the capacity.

        This is the round-robin writers' fast path: one or two slice copies per leaf instead of a
        scatter. When the batch is longer than the capacity, only its last ``capacity`` rows are
        kept (they are the ones a sequential writer would leave behind).

        Returns:
            The number of rows (along dim 0) of the batch.
        """
        n, leaves, first, skip, count = self._batch_rows(start, data)
        self._copy_rows(first, skip, count, leaves)
        self._len = min(self._len + n * self._rest_numel, self.max_size)
        return n

    def _check_rows(self, data: Any) -> None:
        if isinstance(data, list):
            data = stack_items(data)
        self._prepare(data, [leading_size(data)])

    def _batch_rows(self, start: int, data: Any) -> tuple[int, list[torch.Tensor], int, int, int]:
        """Prepares a batch for :meth:`_write_rows` at dim-0 rows ``start, start+1, ...``.

        The first batch initialises the storage. Only the last ``capacity`` rows of a longer
        batch are kept.

        Returns:
            ``(n, leaves, first, skip, count)``: the batch's rows along dim 0, its leaves, the
            storage row the kept rows start at, the batch rows skipped and the rows kept.
        """
        if isinstance(data, list):
            data = stack_items(data)  # a list of items (README: extend([item, ...])) is their stack
        n = leading_size(data)
        layout, leaves, needs_init = self._prepare(data, [n])
        if needs_init:
            self._init_from(layout, leaves)
        cap0 = self._capacity_along_dim0
        skip = max(n - cap0, 0)
        return n, leaves, (start + skip) % cap0, skip, n - skip

    def _store_spans(self) -> _StoreSpans:
        """The byte ranges of the leaves, kept until the leaves list is replaced (an allocation)."""
        spans = self._spans
        if spans is None or spans.stores is not self._leaves:
            spans = self._spans = _StoreSpans(self._leaves)
        return spans

    def _copy_rows(self, first: int, skip: int, count: int, leaves: list[torch.Tensor]) -> None:
        """Copies ``count`` batch rows from ``skip`` on into storage rows ``first, ...``, wrapping once."""
        leaves = _unaliased(leaves, self._store_spans())
        if skip:  # the batch is longer than the ring: its first rows are never stored
            leaves = [leaf[skip:] for leaf in leaves]
        write_rows_trusted(self._leaves, leaves, first, backend=self._backend)

    def _element_cursor(self, cursor: tuple, data: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Per-dim coordinates of the elements a tuple cursor of an ``ndim > 1`` storage writes, and
        the data with one leading dim over them.

        Ints and index sequences broadcast together (one element per position); a tuple of ints and
        slices addresses every element of their grid (``storage[0, 3:5]``; trailing dims left out
        are whole, as in torch), and data whose leading dims are that grid's shape is flattened to
        match.

        Raises:
            EmptyBufferError: the storage holds nothing yet (its dims are not known).
            InvalidIndexError: slices mixed with index sequences, or more entries than dims.
            IndexOutOfRangeError: an int or slice bound past a dim of a grid cursor.
        """
        if len(cursor) > self.ndim:
            raise InvalidIndexError(f"a cursor of {len(cursor)} entries for a storage of ndim={self.ndim}")
        if not any(isinstance(c, slice) for c in cursor):
            parts = [torch.as_tensor(c, dtype=torch.long).reshape(-1) for c in cursor]
            if self.initialized:
                # Dim 0 is checked with the rows written; the others here, before anything is.
                for dim, (part, size) in enumerate(zip(parts[1:], self._total_shape[1:]), 1):
                    if part.numel() and not (-size <= int(part.min()) and int(part.max()) < size):
                        raise IndexOutOfRangeError(f"cursor {cursor!r}: dim {dim} holds {size} elements")
            return tuple(t.contiguous() for t in torch.broadcast_tensors(*parts)), data
        if not all(isinstance(c, slice) or is_int(c) for c in cursor):
            raise InvalidIndexError(
                f"a cursor mixing slices with index sequences ({cursor!r}): expected ints and slices, or ints and "
                "index sequences"
            )
        if not self.initialized:
            raise EmptyBufferError("element-wise writes need an initialised storage: extend it first")
        try:
            coords, shape = element_coordinates(self._total_shape, cursor)
        except IndexError as err:
            raise IndexOutOfRangeError(f"cursor {cursor!r} is out of range for a storage of shape "
                                       f"{list(self._total_shape)}: {err}") from None
        batch = getattr(data, "shape", None)
        if len(shape) > 1 and batch is not None and tuple(batch[: len(shape)]) == tuple(shape):
            data = data.reshape(-1, *batch[len(shape) :])
        return coords, data

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes ``data`` at ``cursor``.

        Args:
            cursor: an int (one item), a slice, a sequence / array / 1-D tensor of ints (one item
                each), or for ``ndim > 1`` a tuple of index tensors.
            data: one item for an int cursor, else a batch whose leading dim matches the cursor.
            set_cursor: when True (writers), the length grows by the number of items written.

        Raises:
            SchemaMismatchError, DTypeMismatchError, DeviceMismatchError, UnsupportedDataError:
                the data does not fit; nothing is written.
            IndexOutOfRangeError: the cursor points outside the capacity; nothing is written.
        """
        if isinstance(data, list):
            data = stack_items(data)
        if is_int(cursor):
            cursor = int(cursor)
            lead: list[int] = []
            rows = [cursor]
        elif isinstance(cursor, slice):
            cap0 = self._max_size_along_dim0(batched_data=data)
            rows = list(range(cap0))[cursor]
            lead = [len(rows)]
        elif isinstance(cursor, tuple):
            cursor, data = self._element_cursor(cursor, data)
            index = torch.stack(cursor, -1)
            rows = index[:, 0].tolist()
            lead = [index.shape[0]]
        else:
            tensor = torch.as_tensor(np.asarray(cursor) if not isinstance(cursor, torch.Tensor) else cursor)
            if tensor.dtype == torch.bool:
                # A mask writes one item per True entry, at that entry's position.
                tensor = cursor = tensor.reshape(-1).nonzero().squeeze(-1)
            rows = tensor.reshape(-1).tolist()
            lead = list(tensor.shape)
        # A tuple cursor addresses single elements of an ndim > 1 storage: the data then holds
        # per-element leaves, without the storage's dims 1..ndim-1.
        item_offset = self.ndim - 1 if isinstance(cursor, tuple) else 0
        if item_offset and not self.initialized:
            raise EmptyBufferError("element-wise writes need an initialised storage: extend it first")
        cap0 = self._max_size_along_dim0(batched_data=data) if lead else self._max_size_along_dim0(single_data=data)
        for row in rows:
            if not -cap0 <= row < cap0:
                raise IndexOutOfRangeError(f"cursor {row} is out of range for a storage of {cap0} rows along dim 0")
        layout, leaves, needs_init = self._prepare(data, lead, item_offset)
        if needs_init:
            self._init_from(layout, leaves)
        if isinstance(cursor, torch.Tensor):
            cursor = cursor.to(self._leaves[0].device, torch.long)
        elif isinstance(cursor, tuple):
            cursor = tuple(torch.as_tensor(c, dtype=torch.long, device=self._leaves[0].device) for c in cursor)
        elif not isinstance(cursor, (int, slice)):
            cursor = torch.as_tensor(np.asarray(cursor), dtype=torch.long, device=self._leaves[0].device)
        for store, leaf in zip(self._leaves, _unaliased(leaves, self._store_spans())):
            store[cursor] = leaf
        if set_cursor:
            written = len(rows) if item_offset else len(rows) * self._rest_numel
            self._len = min(self._len + written, self.max_size)

    # ------------------------------------------------------------------ reading
    def _check_readable(self) -> None:
        if not self.initialized or self._len == 0:
            raise EmptyBufferError("cannot read from an empty storage: write data to it first")

    @property
    def _row_sources(self) -> list[torch.Tensor] | None:
        """The leaves as rows over all ``ndim`` batch dims (see :attr:`Storage._row_sources`)."""
        return self._flat_leaves

    def _gather(self, index: torch.Tensor, skip: Collection[int] = ()) -> list:
        """The sample path: ``index`` is a 1-D int64 tensor of in-range rows on the storage's device.

        Args:
            index: element indices, already valid (produced by a sampler).
            skip: the positions of leaves not to gather (the buffer fills them itself).
        """
        sources = self._flat_leaves
        if not skip:
            return gather_rows_trusted(sources, index, backend=self._backend)
        gathered = iter(gather_rows_trusted([s for i, s in enumerate(sources) if i not in skip], index,
                                            backend=self._backend))
        return [None if i in skip else next(gathered) for i in range(len(sources))]

    def _build(
        self, leaves: list, lead: Sequence[int], *, device: torch.device | None = None, consumed: int | None = None
    ) -> Any:
        """Wraps leaves of shape ``[*lead, *item_shape[consumed:]]`` into the stored container.

        ``device`` is where the leaves are (default: the storage's device). ``consumed`` is how
        many item dims the leading dims replace: ``ndim - 1`` for a gather over elements (the
        default), 0 for whole dim-0 rows.
        """
        layout = self._layout
        device = self.device if device is None else device
        if layout.kind in ("tensordict", "tensorclass"):
            consumed = self.ndim - 1 if consumed is None else consumed
            return layout.build(leaves, torch.Size([*lead, *layout.item_batch[consumed:]]), device)
        return layout.build(leaves, torch.Size(lead), device)

    def _flat_index(self, index: Any) -> torch.Tensor:
        """Turns a sampler's index (1-D tensor, or a tuple of per-dim tensors) into element rows."""
        if not isinstance(index, (torch.Tensor, tuple)):
            return torch.as_tensor(np.asarray(index), dtype=torch.long)
        if isinstance(index, tuple):
            if len(index) == 1:
                return index[0]
            flat = torch.zeros_like(index[0])
            for dim, idx in enumerate(index):
                size = self._leaves[0].shape[dim]
                flat = flat * size + idx
            return flat
        return index

    def get(self, index: Any) -> Any:
        """Reads items.

        Args:
            index: an int, a slice, a sequence / array / tensor of ints, or a tuple of index
                tensors (one per storage dim, ``ndim > 1``). Negative values count from the end of
                the written range, as in Python.

        Returns:
            The items in the container kind of the stored data, on the storage's device. A single
            int returns one item; anything else returns a batch.

        Raises:
            EmptyBufferError: nothing was written yet.
            IndexOutOfRangeError: an index outside the written range.
        """
        self._check_readable()
        if isinstance(index, torch.Tensor) and index.ndim == 1 and not index.dtype.is_floating_point and self.ndim == 1:
            if index.dtype == torch.bool:
                index = index.nonzero().squeeze(-1)
            index = index.to(self._leaves[0].device, torch.long)
            n = self._len
            if index.numel():
                lo, hi = torch.aminmax(index)
                if int(lo) < -n or int(hi) >= n:
                    bad = int(lo) if int(lo) < -n else int(hi)
                    raise IndexOutOfRangeError(f"index {bad} is out of range for a storage of length {n}")
                if int(lo) < 0:
                    index = torch.where(index < 0, index + n, index)
            return self._build(self._gather(index), [index.shape[0]])
        return self._get_generic(index)

    def _get_generic(self, index: Any) -> Any:
        len0 = self._len_along_dim0
        if is_int(index):
            index = int(index)
            if not -len0 <= index < len0:
                raise IndexOutOfRangeError(f"index {index} is out of range for a storage of length {len0}")
        elif isinstance(index, (list, np.ndarray)):
            index = torch.as_tensor(np.asarray(index))
        if isinstance(index, torch.Tensor):
            # uint8 values are positions, as on the one-dimensional path and in NumPy (torch would
            # read them as a mask, a use it has deprecated).
            index = index.to(self._leaves[0].device, torch.long if index.dtype == torch.uint8 else None)
            if not index.dtype.is_floating_point and index.dtype != torch.bool and index.numel():
                if int(index.max()) >= len0 or int(index.min()) < -len0:
                    raise IndexOutOfRangeError(
                        f"index values must lie in [{-len0}, {len0}) for a storage of length {len0}, got "
                        f"[{int(index.min())}, {int(index.max())}]"
                    )
        elif isinstance(index, tuple):
            index = tuple(
                i.to(self._leaves[0].device, torch.long if i.dtype == torch.uint8 else None) if isinstance(i, torch.Tensor)
                else i
                for i in index
            )
        leaves = [leaf[:len0][index] for leaf in self._leaves]
        spec = self._layout.leaves[0]
        feature_ndim = len(spec.shape) - len(self._layout.item_batch)
        out_shape = leaves[0].shape
        batch = out_shape[: len(out_shape) - feature_ndim]
        return self._layout.build(leaves, batch, self.device)

    def _rand_given_ndim(self, batch_size: int) -> Any:
        if torch.compiler.is_compiling():
            # Run eagerly (a graph break), as TorchRL does: traced, the draw would be guarded on
            # the stored length and recompiled after every write.
            return _eager_draw(self, batch_size)
        return self._draw_indices(batch_size)

    def _draw_indices(self, batch_size: int) -> Any:
        device = self._leaves[0].device if self.initialized else None
        if self.ndim == 1:
            return torch.randint(0, self._len, (batch_size,), generator=self._rng, device=device)
        shape = self.shape
        return tuple(torch.randint(0, size, (batch_size,), generator=self._rng, device=device) for size in shape)

    # ------------------------------------------------------------------ misc
    def _empty(self) -> None:
        # The allocation and layout stay: a buffer emptied and refilled with the same structure
        # reuses them, as in TorchRL.
        self._len = 0

    @property
    def _storage(self) -> Any:
        """The whole preallocated storage as one container (a view, no copy), or None before the first write."""
        if not self.initialized:
            return None
        return self._build(list(self._leaves), [self._capacity_along_dim0], consumed=0)

    def state_dict(self) -> dict[str, Any]:
        """``{"_storage": the rows (views, no copy), "initialized": bool, "_len": int}``, in
        TorchRL's form (see :func:`state_of_rows`): TorchRL's storages load it, and these load
        TorchRL's."""
        return state_of_rows(self._storage, self.initialized, self._len)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replaces the rows with a :meth:`state_dict`'s (the layout comes with them).

        Raises:
            StateDictKeyError: ``_storage`` or ``_len`` missing.
            StateDictError: a length that is not an int in ``[0, items held]``, or data that is not
                tensors; nothing changes.
        """
        data, length = _check_state(state_dict, self.ndim)
        if data is None:
            self._layout = self._leaves = self._flat_leaves = None
            self._len = 0
            return
        layout = Layout.from_batch(data, leading=1)
        leaves = layout.split(data, leading=None, device=None)
        device = leaves[0].device if self._auto_device else self.device
        if self._auto_device:
            self.device = device
        self._install(layout, [leaf.to(device).clone() for leaf in leaves])
        self._len = length

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, device={self.device}, "
            f"ndim={self.ndim}, layout={self._layout})"
        )


class LazyTensorStorage(TensorStorage):
    """A :class:`TensorStorage` whose tensors are allocated on the first write.

    The first batch fixes the structure (keys, dtypes, item shapes) of everything stored after.

    Args:
        max_size: the capacity in items (elements over the first ``ndim`` dims); must be a
            positive int.

    Keyword Args:
        device: ``"cpu"`` (default), ``"cuda"``, a ``torch.device``, or ``"auto"``/``None`` for the
            device of the first batch. See :class:`TensorStorage`.
        ndim: number of leading dims that count towards the length (default 1).
        compilable: accepted for TorchRL compatibility.
        consolidated: accepted for TorchRL compatibility; gpubuf always keeps one contiguous
            tensor per leaf, which is what consolidation buys in TorchRL.
        shared_init: rows that several processes initialise and write together: as TorchRL
            keeps them in a memory-mapped TensorDict in a temporary directory, the constructor
            then returns a :class:`~gpubuf.storages.memmap.SharedInitTensorStorage` (a
            ``LazyTensorStorage`` whose rows are a shared :class:`~gpubuf.LazyMemmapStorage`'s),
            which the workers receive with the buffer.
        cleanup_memmap: with ``shared_init``, remove the temporary files when the process
            that created them exits (default True).

    Raises:
        CapacityError: ``max_size`` is not a positive int below ``2**63``, or exceeds the bytes of
            ``device``'s memory (every item takes at least one byte). At the first write, when
            the item size is known, a capacity whose rows cannot fit in the device's memory is
            refused the same way, before anything is allocated or written.
        InvalidDeviceError: a malformed device, or a CUDA device without CUDA.
        InvalidArgumentError: ``ndim < 1``.

    Examples:
        >>> storage = LazyTensorStorage(100)
        >>> storage.set(range(10), TensorDict({"a": torch.randn(10, 3)}, [10]))
        >>> len(storage)
        10
    """

    #: Whether the rows live in the device's memory (not in files): its capacity must fit there.
    _rows_in_memory = True
    #: What ``LazyTensorStorage(..., shared_init=True)`` builds: installed by :mod:`gpubuf.storages`
    #: (the memory-mapped storages import this module).
    _shared_init_class: type | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> "LazyTensorStorage":
        if cls is LazyTensorStorage and kwargs.get("shared_init"):
            # Python then runs that class's __init__ with these arguments.
            return super().__new__(cls._shared_init_class)
        return super().__new__(cls)

    def __init__(
        self,
        max_size: int,
        *,
        device: torch.device | str | None = "cpu",
        ndim: int = 1,
        compilable: bool = False,
        consolidated: bool = False,
        shared_init: bool = False,
        cleanup_memmap: bool = True,
    ) -> None:
        check_max_size(max_size)
        super().__init__(None, max_size, device=device, ndim=ndim, compilable=compilable)
        self.consolidated = consolidated
        self.shared_init = False  # (a shared storage is another class: see __new__)
        self.cleanup_memmap = cleanup_memmap
        if self._rows_in_memory and isinstance(self.device, torch.device):
            # Rows held in memory: a capacity beyond the device's bytes cannot work for any item.
            check_fits_memory(self.max_size, self.device, f"{type(self).__name__}({self.max_size:,})")

    def get(self, indices: Any) -> Any:
        """Reads the items at ``indices`` (TorchRL's parameter name; see :meth:`TensorStorage.get`)."""
        return super().get(indices)


def state_of_rows(data: Any, initialized: bool, length: int) -> dict[str, Any]:
    """A tensor storage's state dict, TorchRL's: ``_storage`` is a plain TensorDict's
    ``state_dict()`` (flat keys, tensors sharing the rows' memory), a tensor as it is, or ``{}``
    before the first write. Rows TorchRL cannot hold in a state dict keep their container: a
    tensorclass as it is, a pytree as it is, marked ``"_pytree": True`` (a dict of tensors would
    otherwise read as a TensorDict's state).
    """
    state: dict[str, Any] = {"_storage": data, "initialized": initialized, "_len": length}
    if data is None:
        state["_storage"] = {}
    elif isinstance(data, TensorDictBase) and not is_tensorclass(data):
        state["_storage"] = data.state_dict()
    elif not isinstance(data, torch.Tensor) and not is_tensorclass(data):
        state["_pytree"] = True
    return state


def rows_of_state(state_dict: dict[str, Any], ndim: int) -> Any:
    """The rows a tensor storage's state dict holds (the inverse of :func:`state_of_rows`), or
    None for none: TorchRL's form of TensorDict rows is made a TensorDict again (with ``ndim``
    batch dims at least, where the state's own batch size was lost); a TensorDict, tensorclass,
    tensor or marked pytree is returned as it is."""
    data = state_dict["_storage"]
    if not isinstance(data, Mapping) or is_tensor_collection(data) or state_dict.get("_pytree"):
        return data
    if not data:
        return None
    if any(isinstance(value, Mapping) for value in data.values()):
        return data  # nested dicts: a pytree (a TensorDict's state has flat keys)
    for key, value in data.items():
        if not isinstance(value, torch.Tensor):
            raise StateDictError(
                f"storage state: _storage[{key!r}] is a {type(value).__name__}, expected a tensor (the state of "
                "TensorDict rows)"
            )
    try:
        rows = TensorDict().load_state_dict(data, strict=False)
        if rows.batch_dims < ndim:
            rows.auto_batch_size_(batch_dims=ndim)
    except (RuntimeError, ValueError, TypeError, KeyError) as err:
        raise StateDictError(f"storage state: _storage is not the state of TensorDict rows ({err})") from None
    return rows


def _check_state(state_dict: Any, ndim: int) -> tuple[Any, int]:
    """``(data, length)`` of a tensor storage's state dict, checked; raises the typed errors of
    :meth:`TensorStorage.load_state_dict`."""
    check_state_keys(state_dict, ("_storage", "_len"), "storage state")
    data, length = rows_of_state(state_dict, ndim), state_dict["_len"]
    if isinstance(length, torch.Tensor) and length.ndim == 0 and not length.dtype.is_floating_point:
        length = int(length)
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
        raise StateDictError(f"storage state: _len must be an int >= 0, got {length!r}")
    if data is None:
        if length:
            raise StateDictError(f"storage state: _len is {length} but the state holds no data (expected 0)")
        return None, 0
    try:
        held = leading_shape(data, ndim).numel()
    except GpubufError as err:
        raise StateDictError(f"storage state: _storage holds no tensors ({err})") from None
    if length > held:
        raise StateDictError(f"storage state: _len is {length}, more than the {held} items the data holds")
    return data, int(length)


class _StoreSpans:
    """The byte ranges a storage's leaves occupy, merged and sorted, for :meth:`overlapping`."""

    __slots__ = ("stores", "starts", "ends")

    def __init__(self, stores: list[torch.Tensor]) -> None:
        self.stores = stores  # the list they were made from: the storage's own, same lifetime
        merged: list[list[int]] = []
        for lo, hi in sorted(_span(store) for store in stores):
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.starts = [lo for lo, _ in merged]
        self.ends = [hi for _, hi in merged]

    def overlapping(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory overlaps any of the ranges (an empty tensor's never does)."""
        lo, hi = _span(tensor)
        i = bisect.bisect_left(self.starts, hi) - 1  # the last range starting before hi
        return hi > lo and i >= 0 and self.ends[i] > lo


def _unaliased(leaves: list[torch.Tensor], spans: _StoreSpans) -> list[torch.Tensor]:
    """``leaves``, with a copy of each one whose memory overlaps one of the storage's leaves.

    A batch read from the buffer itself (``rb.extend(rb[0:10])``) may be a view of the rows it is
    about to overwrite: copied first, a write that wraps never reads a row it already changed.
    Compares address ranges only (metadata: no data is read, no device synchronisation).
    """
    return [leaf.clone() if spans.overlapping(leaf) else leaf for leaf in leaves]


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The byte range ``[lo, hi)`` of the memory a tensor's storage occupies."""
    storage = tensor.untyped_storage()
    lo = storage.data_ptr()
    return lo, lo + storage.nbytes()


__all__ = ["TensorStorage", "LazyTensorStorage"]


@torch.compiler.disable
def _eager_draw(storage: TensorStorage, batch_size: int) -> Any:
    """:meth:`TensorStorage._draw_indices`, never traced by ``torch.compile``."""
    return storage._draw_indices(batch_size)
