"""``ListStorage``: a Python list of arbitrary items (TorchRL's ``ListStorage``)."""

from __future__ import annotations

from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch

from gpubuf.errors import (
    EmptyBufferError,
    IndexOutOfRangeError,
    InvalidIndexError,
    StateDictError,
    StorageNotSharableError,
    UnsupportedDataError,
)
from gpubuf.storages.base import Storage, check_device, check_max_size
from gpubuf.storages.items import is_int
from gpubuf.storages.checks import check_state_keys

_UNBOUNDED = torch.iinfo(torch.int64).max


class ListStorage(Storage):
    """A storage of arbitrary Python objects kept in a list.

    Items need no common structure; sampled batches are stacked when the items are tensors or
    tensor collections of one shape, and returned as a list otherwise.

    Args:
        max_size: capacity; unbounded when ``None`` (TorchRL's default).

    Keyword Args:
        compilable: accepted for TorchRL compatibility.
        device: when set, items with a ``.to`` method are moved there on write.
    """

    def __init__(self, max_size: int | None = None, *, compilable: bool = False, device: Any = None) -> None:
        super().__init__(_UNBOUNDED if max_size is None else check_max_size(max_size), compilable=compilable)
        self._storage: list = []
        # A device that does not exist here is refused now, not at the first write.
        self.device = None if device is None else check_device(device)

    def __getstate__(self) -> dict[str, Any]:
        """The storage's state for pickling; refused for a spawned process, as by TorchRL.

        Raises:
            StorageNotSharableError: sent to a spawned process (a ``multiprocessing`` argument):
                the items live in this process's memory, so the child's writes would go to a copy.
        """
        if get_spawning_popen() is not None:
            raise StorageNotSharableError(
                f"Cannot share a storage of type {type(self).__name__} between processes: its items live in this "
                "process's memory, so a spawned process would write to a copy that this one never sees; expected a "
                "tensor storage (LazyTensorStorage, LazyMemmapStorage), whose rows are shared"
            )
        return dict(self.__dict__)

    def _to_device(self, data: Any) -> Any:
        if self.device is not None and hasattr(data, "to"):
            return data.to(self.device)
        return data

    def _write_rows(self, start: int, data: Any) -> int:
        """Round-robin write of a sequence of items starting at ``start`` (the writers' path)."""
        items = self._as_items(data)
        n = len(items)
        cap = self.max_size
        if start > len(self._storage):
            raise IndexOutOfRangeError(
                f"cannot write at {start}: a list storage grows one item at a time and holds {len(self._storage)}"
            )
        items = [self._to_device(item) for item in items[max(n - cap, 0) :]]
        pos = (start + max(n - cap, 0)) % cap
        if n > cap and len(self._storage) < cap:
            # The kept items fill every slot, but not in append order: make room for all of them.
            self._storage.extend([None] * (cap - len(self._storage)))
        for item in items:
            if pos == len(self._storage):
                self._storage.append(item)
            else:
                self._storage[pos] = item
            pos = (pos + 1) % cap
        return n

    @staticmethod
    def _as_items(data: Any) -> list:
        if isinstance(data, (list, tuple, range)):
            return list(data)
        if isinstance(data, torch.Tensor) or hasattr(data, "unbind"):
            if getattr(data, "ndim", 1) == 0:
                raise UnsupportedDataError("cannot extend with a 0-d tensor; use add() for one item")
            return list(data.unbind(0))
        if isinstance(data, np.ndarray):
            return list(data)
        raise UnsupportedDataError(
            f"cannot extend a ListStorage with a {type(data).__name__}: give a list, tuple, tensor or tensordict"
        )

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes one item at an int cursor, or one item per index of a sequence cursor.

        Raises:
            IndexOutOfRangeError: a cursor beyond the next free slot or the capacity.
        """
        if is_int(cursor):
            cursor = int(cursor)
            if not set_cursor and not -len(self._storage) <= cursor < len(self._storage):
                # A write that bypasses the writer (rb[i] = item) would grow the list behind the
                # writer's cursor, and the next extend would overwrite it.
                raise IndexOutOfRangeError(
                    f"cannot set item {cursor}: the list holds {len(self._storage)} items; expected an index of a "
                    "stored item (add() or extend() append new ones)"
                )
            cursor = cursor % len(self._storage) if cursor < 0 else cursor
            if cursor > len(self._storage) or cursor >= self.max_size:
                raise IndexOutOfRangeError(
                    f"cannot write at {cursor}: the list holds {len(self._storage)} items (capacity {self.max_size})"
                    " and grows one item at a time"
                )
            data = self._to_device(data)
            if cursor == len(self._storage):
                self._storage.append(data)
            else:
                self._storage[cursor] = data
            return
        if isinstance(cursor, slice):
            cursor = range(len(self._storage) + len(self._as_items(data)))[cursor]
        cursor = _positions(cursor)
        items = self._as_items(data)
        if len(items) != len(cursor):
            raise UnsupportedDataError(f"got {len(items)} items for {len(cursor)} indices")
        size = len(self._storage)
        for c in cursor:
            if not set_cursor and not -len(self._storage) <= c < len(self._storage):
                raise IndexOutOfRangeError(
                    f"cannot set item {c}: the list holds {len(self._storage)} items; expected indices of stored items"
                )
            if c > size or c >= self.max_size:
                raise IndexOutOfRangeError(f"cannot write at {c}: the list holds {size} items")
            size = max(size, c + 1)
        for c, item in zip(cursor, items):
            self.set(c, item, set_cursor=set_cursor)

    def get(self, index: Any) -> Any:
        """Returns one item for an int, a list of items (collated by the buffer) otherwise."""
        if not self._storage:
            raise EmptyBufferError("cannot read from an empty storage: write data to it first")
        n = len(self._storage)
        if is_int(index):
            index = int(index)
            if not -n <= index < n:
                raise IndexOutOfRangeError(f"index {index} is out of range for a storage of length {n}")
            return self._storage[index]
        if isinstance(index, slice):
            return self._storage[index]
        if isinstance(index, tuple):
            if len(index) != 1:
                raise IndexOutOfRangeError("a ListStorage is indexed along one dimension only")
            return self.get(index[0])
        index = _positions(index)
        for i in index:
            if not -n <= i < n:
                raise IndexOutOfRangeError(f"index {i} is out of range for a storage of length {n}")
        return [self._storage[i] for i in index]

    def __len__(self) -> int:
        return len(self._storage)

    def _empty(self) -> None:
        self._storage = []

    def state_dict(self) -> dict[str, Any]:
        return {"_storage": list(self._storage)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replaces the items with a :meth:`state_dict`'s.

        Raises:
            StateDictKeyError: no ``_storage``.
            StateDictError: ``_storage`` is not a list of at most ``max_size`` items; nothing changes.
        """
        check_state_keys(state_dict, ("_storage",), "storage state")
        items = state_dict["_storage"]
        if not isinstance(items, (list, tuple)) or len(items) > self.max_size:
            raise StateDictError(
                f"storage state: _storage must be a list of at most {self.max_size} items, got {type(items).__name__}"
            )
        self._storage = list(items)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(items={len(self)}, max_size={self.max_size})"


def _positions(index: Any) -> list[int]:
    """A sequence, array or tensor index as a flat list of ints; a boolean mask as the positions it selects."""
    if isinstance(index, (torch.Tensor, np.ndarray)):
        tensor = torch.as_tensor(index)
        if tensor.dtype == torch.bool:
            tensor = tensor.reshape(-1).nonzero().squeeze(-1)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise InvalidIndexError(f"an index of dtype {tensor.dtype}: expected integer positions")
        return tensor.reshape(-1).tolist()
    values = list(index)
    if values and all(isinstance(v, (bool, np.bool_)) for v in values):
        return [i for i, v in enumerate(values) if v]
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise InvalidIndexError("an index sequence holding values other than ints: expected integer positions")
    return [int(v) for v in values]


__all__ = ["ListStorage"]
