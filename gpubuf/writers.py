"""Writers: where new items go (TorchRL's ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from gpubuf.errors import SchemaMismatchError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.tensor import _is_int


def batch_length(data: Any) -> int:
    """The number of items along the first dim of a batch (tensor, collection, list or pytree)."""
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        if len(data.shape) == 0:
            raise SchemaMismatchError("expected a batch with a leading dimension, got a scalar; use add() for one item")
        return data.shape[0]
    if isinstance(data, (list, range)):
        return len(data)
    leaves = [leaf for leaf in pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        return len(data)
    return leaves[0].shape[0]


class Writer:
    """Base writer: keeps the write cursor and the count of items written.

    Args:
        compilable: accepted for TorchRL compatibility.
    """

    def __init__(self, compilable: bool = False) -> None:
        self._compilable = compilable
        self._storage = None
        self._cursor = 0
        self._write_count = 0
        self._rng: torch.Generator | None = None

    def register_storage(self, storage: Any) -> None:
        self._storage = storage

    def add(self, data: Any) -> Any:
        raise NotImplementedError

    def extend(self, data: Any) -> torch.Tensor:
        raise NotImplementedError

    def _empty(self, empty_write_count: bool = True) -> None:
        self._cursor = 0
        if empty_write_count:
            self._write_count = 0

    def _replicate_index(self, index: Any) -> Any:
        """For ``ndim > 1`` storages, one row per element written: ``[dim0, dim1, ...]`` coordinates."""
        storage = self._storage
        if storage.ndim == 1:
            return index
        rest = storage.shape[1:]
        device = index.device if isinstance(index, torch.Tensor) else torch.device("cpu")
        mesh = torch.stack(
            torch.meshgrid(*(torch.arange(d, device=device) for d in rest), indexing="ij"), -1
        ).flatten(0, -2)
        if _is_int(index):
            head = torch.full((mesh.shape[0], 1), int(index), dtype=torch.long, device=device)
            return torch.cat([head, mesh], 1)
        return torch.cat([index.repeat_interleave(mesh.shape[0]).unsqueeze(1), mesh.repeat(index.numel(), 1)], 1)

    def state_dict(self) -> dict[str, Any]:
        return {"_cursor": self._cursor, "_write_count": self._write_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._cursor = int(state_dict["_cursor"])
        self._write_count = int(state_dict.get("_write_count", self._write_count))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cursor={self._cursor}, write_count={self._write_count})"


class RoundRobinWriter(Writer):
    """Writes items in order, wrapping round to the start of the storage when it is full.

    The cursor and write count move only after the storage accepted the data, so a rejected
    batch leaves them unchanged.
    """

    def add(self, data: Any) -> int:
        """Writes one item at the cursor and returns its index (int; a coordinate tensor for ``ndim > 1``)."""
        index = self._cursor
        cap0 = self._storage._max_size_along_dim0(single_data=data)
        self._storage.set(index, data)
        self._cursor = (index + 1) % cap0
        self._write_count += 1
        return self._replicate_index(index)

    def extend(self, data: Any) -> torch.Tensor:
        """Writes a batch from the cursor on and returns the int64 indices written.

        Returns:
            ``arange(cursor, cursor + n) % capacity`` on the data's device (``[n * prod(rest), ndim]``
            coordinates for ``ndim > 1``).

        Raises:
            SchemaMismatchError: an empty batch, or data that does not fit the storage (nothing is
                written then).
        """
        n = batch_length(data)
        if n == 0:
            raise SchemaMismatchError("cannot extend with an empty batch: expected at least one item")
        start = self._cursor
        cap0 = self._storage._max_size_along_dim0(batched_data=data)
        index = self._index(start, n, cap0, data)
        self._write(start, index, data)
        self._cursor = (start + n) % cap0
        self._write_count += n
        return self._replicate_index(index)

    @staticmethod
    def _index(start: int, n: int, cap0: int, data: Any) -> torch.Tensor:
        device = getattr(data, "device", None) or "cpu"
        return torch.arange(start, start + n, dtype=torch.long, device=device) % cap0

    def _write(self, start: int, index: torch.Tensor, data: Any) -> None:
        write_rows = getattr(self._storage, "_write_rows", None)
        if write_rows is not None:
            write_rows(start, data)
        else:
            self._storage.set(index, data)


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """A :class:`RoundRobinWriter` that also records each item's index under ``"index"``.

    As in TorchRL, the written TensorDict gains an ``"index"`` entry (so that
    ``update_tensordict_priority`` can be called on it) and the storage keeps it. When the
    storage rejects the batch, the TensorDict's ``"index"`` entry is restored to what it was.
    """

    def add(self, data: Any) -> int:
        index = self._cursor
        cap0 = self._storage._max_size_along_dim0(single_data=data)
        value = torch.full(data.batch_size, index, dtype=torch.long, device=data.device)
        with _index_entry(data, value):
            self._storage.set(index, data)
        self._cursor = (index + 1) % cap0
        self._write_count += 1
        return self._replicate_index(index)

    def _write(self, start: int, index: torch.Tensor, data: Any) -> None:
        value = index.reshape(index.shape + (1,) * (len(data.batch_size) - 1)).expand(data.batch_size)
        with _index_entry(data, value):
            super()._write(start, index, data)


class _index_entry:
    """Sets ``data["index"]`` for the duration of a write; undoes it if the write raises."""

    def __init__(self, data: Any, value: torch.Tensor) -> None:
        self.data = data
        self.value = value
        self.active = is_tensor_collection(data) and not _is_tensorclass(data)

    def __enter__(self) -> None:
        if self.active:
            self.previous = self.data.get("index", None)
            self.data.set("index", self.value)

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.active and exc_type is not None:
            if self.previous is None:
                self.data.del_("index")
            else:
                self.data.set("index", self.previous)
        return False


def _is_tensorclass(data: Any) -> bool:
    from tensordict import is_tensorclass

    return is_tensorclass(data)


__all__ = ["Writer", "RoundRobinWriter", "TensorDictRoundRobinWriter"]
