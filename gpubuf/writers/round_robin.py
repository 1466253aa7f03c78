"""Round-robin writers (TorchRL's ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``)."""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.errors import SchemaMismatchError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.writers.base import Writer, batch_length


def _appends(storage: Any) -> bool:
    """Whether ``storage`` keeps the write cursor itself and reserves rows atomically.

    Such storages (``LazyMemmapStorage``) are extended from several processes at once: the
    cursor lives with the storage, every writer reserves its rows through
    ``storage._append_rows``, and concurrent writers never get the same rows.
    """
    return hasattr(storage, "_append_rows")


class RoundRobinWriter(Writer):
    """Writes items in order, wrapping round to the start of the storage when it is full.

    The cursor and write count move only after the storage accepted the data, so a rejected
    batch leaves them unchanged.

    With a storage that shares its write state between processes (``LazyMemmapStorage``), the
    cursor and the write count are the storage's: ``_cursor`` and ``_write_count`` read and set
    them there, and every writer of the storage, in any process, reserves its rows atomically.
    A writer's own cursor is then ignored when it is given such a storage.
    """

    # ------------------------------------------------------------------ cursor: own or the storage's
    def _shared_state(self) -> Any:
        storage = self.__dict__.get("_storage")
        return getattr(storage, "_write_state", None) if storage is not None else None

    @property
    def _cursor(self) -> int:
        state = self._shared_state()
        return state.cursor if state is not None else self.__dict__.get("_own_cursor", 0)

    @_cursor.setter
    def _cursor(self, value: int) -> None:
        state = self._shared_state()
        if state is not None:
            state.cursor = int(value)
        else:
            self.__dict__["_own_cursor"] = value

    @property
    def _write_count(self) -> int:
        state = self._shared_state()
        return state.write_count if state is not None else self.__dict__.get("_own_write_count", 0)

    @_write_count.setter
    def _write_count(self, value: int) -> None:
        state = self._shared_state()
        if state is not None:
            state.write_count = int(value)
        else:
            self.__dict__["_own_write_count"] = value

    # ------------------------------------------------------------------ writing
    def add(self, data: Any) -> int:
        """Writes one item at the cursor and returns its index (int; a coordinate tensor for ``ndim > 1``)."""
        if _appends(self._storage):
            return self._replicate_index(self._storage._append_rows(data, single=True))
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
        if _appends(self._storage):
            start = self._storage._append_rows(data)
            cap0 = self._storage._max_size_along_dim0(batched_data=data)
            return self._replicate_index(self._index(start, n, cap0, data))
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
        if start + n <= cap0:
            # No wrap: a plain arange, without the modulo pass over the whole index.
            return torch.arange(start, start + n, dtype=torch.long, device=device)
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
        if _appends(self._storage):
            # The row is known only once reserved: the storage writes it into "index" itself.
            with _index_entry(data, torch.zeros(data.batch_size, dtype=torch.long, device=data.device)) as entry:
                index = self._storage._append_rows(data, single=True, index_key=entry.key)
            entry.keep(torch.full(data.batch_size, index, dtype=torch.long, device=data.device))
            return self._replicate_index(index)
        index = self._cursor
        cap0 = self._storage._max_size_along_dim0(single_data=data)
        value = torch.full(data.batch_size, index, dtype=torch.long, device=data.device)
        with _index_entry(data, value):
            self._storage.set(index, data)
        self._cursor = (index + 1) % cap0
        self._write_count += 1
        return self._replicate_index(index)

    def extend(self, data: Any) -> torch.Tensor:
        if not _appends(self._storage):
            return super().extend(data)
        n = batch_length(data)
        if n == 0:
            raise SchemaMismatchError("cannot extend with an empty batch: expected at least one item")
        # The storage writes each row's own index in place of the placeholder's values, which
        # are never read: uninitialised memory, so its pages are never touched.
        placeholder = torch.empty(data.batch_size, dtype=torch.long, device=data.device)
        with _index_entry(data, placeholder) as entry:
            start = self._storage._append_rows(data, index_key=entry.key)
        cap0 = self._storage._max_size_along_dim0(batched_data=data)
        index = self._index(start, n, cap0, data)
        entry.keep(_index_value(index, data))
        return self._replicate_index(index)

    def _write(self, start: int, index: torch.Tensor, data: Any) -> None:
        with _index_entry(data, _index_value(index, data)):
            super()._write(start, index, data)


def _index_value(index: torch.Tensor, data: Any) -> torch.Tensor:
    """Each item's dim-0 index, broadcast over the data's batch dims."""
    return index.reshape(index.shape + (1,) * (len(data.batch_size) - 1)).expand(data.batch_size)


class _index_entry:
    """Sets ``data["index"]`` for the duration of a write; undoes it if the write raises."""

    def __init__(self, data: Any, value: torch.Tensor) -> None:
        self.data = data
        self.value = value
        self.active = is_tensor_collection(data) and not _is_tensorclass(data)

    @property
    def key(self) -> tuple | None:
        """The storage key of the entry, or None when the data gets no entry (tensorclasses)."""
        return ("index",) if self.active else None

    def keep(self, value: torch.Tensor) -> None:
        """After a successful write: leaves ``value`` as the data's ``"index"``."""
        if self.active:
            self.data.set("index", value)

    def __enter__(self) -> "_index_entry":
        if self.active:
            self.previous = self.data.get("index", None)
            self.data.set("index", self.value)
        return self

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


__all__ = ["RoundRobinWriter", "TensorDictRoundRobinWriter"]
