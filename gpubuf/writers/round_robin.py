"""Round-robin writers (TorchRL's ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import is_tensorclass

from gpubuf.errors import SchemaMismatchError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.base import WriteCursor
from gpubuf.storages.items import batch_length
from gpubuf.writers.base import Writer


class RoundRobinWriter(Writer):
    """Writes items in order, wrapping round to the start of the storage when it is full.

    The cursor and write count move only after the storage accepted the data, so a rejected
    batch leaves them unchanged.

    With a storage that shares its write cursor between processes (``LazyMemmapStorage``), the
    cursor and the write count are the storage's: ``_cursor`` and ``_write_count`` read and set
    them there, and every writer of the storage, in any process, reserves its rows atomically.
    A writer's own cursor is then ignored when it is given such a storage.
    """

    # ------------------------------------------------------------------ cursor: own or the storage's
    @property
    def _state(self) -> WriteCursor:
        """The cursor writes go through: the storage's shared one, else this writer's own."""
        storage = self.__dict__.get("_storage")
        shared = None if storage is None else storage._write_state
        if shared is not None:
            return shared
        own = self.__dict__.get("_own")
        if own is None:
            own = self.__dict__["_own"] = WriteCursor()
        return own

    @property
    def _cursor(self) -> int:
        return self._state.cursor

    @_cursor.setter
    def _cursor(self, value: int) -> None:
        self._state.cursor = int(value)

    @property
    def _write_count(self) -> int:
        return self._state.write_count

    @_write_count.setter
    def _write_count(self, value: int) -> None:
        self._state.write_count = int(value)

    # ------------------------------------------------------------------ writing
    def add(self, data: Any) -> int:
        """Writes one item at the cursor and returns its index (int; a coordinate tensor for ``ndim > 1``)."""
        return self._replicate_index(self._storage._append_rows(self._state, data, single=True))

    def extend(self, data: Any) -> torch.Tensor:
        """Writes a batch from the cursor on and returns the int64 indices written.

        Returns:
            ``arange(cursor, cursor + n) % capacity`` on the data's device (``[n * prod(rest), ndim]``
            coordinates for ``ndim > 1``).

        Raises:
            SchemaMismatchError: an empty batch, or data that does not fit the storage (nothing is
                written then).
        """
        n = self._check_length(data)
        start = self._storage._append_rows(self._state, data)
        return self._replicate_index(self._index(start, n, data))

    @staticmethod
    def _check_length(data: Any) -> int:
        n = batch_length(data)
        if n == 0:
            raise SchemaMismatchError("cannot extend with an empty batch: expected at least one item")
        return n

    def _index(self, start: int, n: int, data: Any) -> torch.Tensor:
        """The dim-0 rows of a batch of ``n`` written from ``start`` on, on the data's device."""
        cap0 = self._storage._max_size_along_dim0(batched_data=data)
        device = data.device if isinstance(data, torch.Tensor) or is_tensor_collection(data) else None
        index = torch.arange(start, start + n, dtype=torch.long, device=device or "cpu")
        # No wrap: a plain arange, without the modulo pass over the whole index.
        return index if start + n <= cap0 else index % cap0


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """A :class:`RoundRobinWriter` that also records each item's index under ``"index"``.

    As in TorchRL, the written TensorDict gains an ``"index"`` entry (so that
    ``update_tensordict_priority`` can be called on it) and the storage keeps it. When the
    storage rejects the batch, the TensorDict's ``"index"`` entry is restored to what it was.
    """

    def add(self, data: Any) -> int:
        # The row is known only once reserved: the storage writes it into "index" itself.
        with _index_entry(data, torch.zeros(data.batch_size, dtype=torch.long, device=data.device)) as entry:
            index = self._storage._append_rows(self._state, data, single=True, index_key=entry.key)
        entry.keep(torch.full(data.batch_size, index, dtype=torch.long, device=data.device))
        return self._replicate_index(index)

    def extend(self, data: Any) -> torch.Tensor:
        n = self._check_length(data)
        # Only its key and dtype matter: the storage writes each row's index into it.
        placeholder = torch.empty(data.batch_size, dtype=torch.long, device=data.device)
        with _index_entry(data, placeholder) as entry:
            start = self._storage._append_rows(self._state, data, index_key=entry.key)
        index = self._index(start, n, data)
        entry.keep(_index_value(index, data))
        return self._replicate_index(index)


def _index_value(index: torch.Tensor, data: Any) -> torch.Tensor:
    """Each item's dim-0 index, broadcast over the data's batch dims."""
    return index.reshape(index.shape + (1,) * (len(data.batch_size) - 1)).expand(data.batch_size)


class _index_entry:
    """Sets ``data["index"]`` for the duration of a write; undoes it if the write raises."""

    def __init__(self, data: Any, value: torch.Tensor) -> None:
        self.data = data
        self.value = value
        self.active = is_tensor_collection(data) and not is_tensorclass(data)

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


__all__ = ["RoundRobinWriter", "TensorDictRoundRobinWriter"]
