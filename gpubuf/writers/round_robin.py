"""Round-robin writers (TorchRL's ``RoundRobinWriter`` and ``TensorDictRoundRobinWriter``)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import is_tensorclass

from gpubuf.errors import SchemaMismatchError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.base import WriteCursor
from gpubuf.storages.items import batch_length
from gpubuf.storages.list import ListStorage
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

    #: Whether slot generations are counted (see :attr:`tracks_generations`), and the counts.
    _track_generations = False
    _generation: torch.Tensor | None = None

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
        index = self._storage._append_rows(self._state, data, single=True).start
        self._bump_generation(index)
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
        n = self._check_length(data)
        start = self._storage._append_rows(self._state, data).start
        index = self._index(start, n, data)
        self._bump_generation(index)
        return self._replicate_index(index)

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


    # ------------------------------------------------------------------ slot generations, explicit writes
    def __init__(self, compilable: bool = False, *, track_generations: bool = False) -> None:
        super().__init__(compilable=compilable)
        self._track_generations = bool(track_generations)
        self._generation: torch.Tensor | None = None

    @property
    def tracks_generations(self) -> bool:
        """Whether each slot's generation (the number of writes into it) is counted."""
        return self._track_generations

    def _bump_generation(self, index: Any) -> None:
        if not self.tracks_generations:
            return
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        if self._generation is None or self._generation.numel() < self._storage.max_size:
            # -1: never written; each write of a slot adds one (the first gives 0).
            grown = torch.full((self._storage.max_size,), -1, dtype=torch.long)
            if self._generation is not None:
                grown[: self._generation.numel()] = self._generation
            self._generation = grown
        self._generation.index_put_((index,), torch.ones_like(index), accumulate=True)

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count=empty_write_count)
        generation = self._generation
        if generation is not None:
            # Emptying invalidates every handle: written slots move on (a reset would make old
            # handles look live again); never-written ones stay -1.
            generation[generation >= 0] += 1

    def generations_of(self, index: int | torch.Tensor) -> torch.Tensor:
        """The current generation of the slots at ``index`` (int64, ``index``'s shape and device):
        ``-1`` for a slot never written (or out of range), or when generations are not tracked."""
        if isinstance(index, tuple):
            index = index[0]
        tensor = torch.as_tensor(index, dtype=torch.long, device=getattr(index, "device", "cpu"))
        if not self.tracks_generations or self._generation is None or not self._generation.numel():
            return torch.full_like(tensor, -1)
        n = self._generation.numel()
        cpu = tensor.cpu()
        found = self._generation[cpu.clamp(0, n - 1)]
        found = torch.where((cpu >= 0) & (cpu < n), found, torch.full_like(found, -1))
        return found.to(tensor.device)

    def write_at(self, index: int | torch.Tensor, data: Any) -> int | torch.Tensor:
        """Writes ``data`` at explicit storage indices, without moving the cursor.

        Counts the items written and bumps the generation of every slot written, so handles taken
        before on those slots are stale afterwards.

        Returns:
            The indices written (as :meth:`add` / :meth:`extend` return them).
        """
        single = _is_int_index(index)
        if not single:
            index = torch.as_tensor(index, dtype=torch.long)
            if getattr(data, "device", None) is not None:
                index = index.to(data.device)
        self._write_at(index, data)
        self._write_count += 1 if single else index.numel()
        self._bump_generation(index)
        self._storage._cover_rows(int(index) if single else index)
        return self._replicate_index(index)

    def _write_at(self, index: Any, data: Any) -> None:
        # A list grows by appending at its end (set_cursor=True allows exactly that); a tensor
        # storage's length is kept by write_at itself.
        self._storage.set(index, data, set_cursor=isinstance(self._storage, ListStorage))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.tracks_generations and self._generation is not None:
            state["_generation"] = self._generation.clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self.tracks_generations:
            generation = state_dict.get("_generation")
            self._generation = None if generation is None else torch.as_tensor(generation).clone()


class TensorDictRoundRobinWriter(RoundRobinWriter):
    """A :class:`RoundRobinWriter` that also records each item's index under ``"index"``.

    As in TorchRL, the written TensorDict gains an ``"index"`` entry (so that
    ``update_tensordict_priority`` can be called on it) and the storage keeps it. When the
    storage rejects the batch, the TensorDict's ``"index"`` entry is restored to what it was.
    """

    def add(self, data: Any) -> int:
        # The row is known only once reserved: the storage writes it into "index" itself.
        with _index_entry(data, torch.zeros(data.batch_size, dtype=torch.long, device=data.device)) as entry:
            index = self._storage._append_rows(self._state, data, single=True, index_key=entry.key).start
        entry.keep(torch.full(data.batch_size, index, dtype=torch.long, device=data.device))
        self._bump_generation(index)
        return self._replicate_index(index)

    def extend(self, data: Any) -> torch.Tensor:
        n = self._check_length(data)
        # Only its key and dtype matter: the storage writes each row's index into it.
        placeholder = torch.empty(data.batch_size, dtype=torch.long, device=data.device)
        with _index_entry(data, placeholder) as entry:
            start, rows = self._storage._append_rows(self._state, data, index_key=entry.key)
        if rows is not None:
            index = rows  # what the storage wrote into the index column; the data holds them already
        else:
            index = self._index(start, n, data)
            entry.keep(_index_value(index, data))
        self._bump_generation(index)
        return self._replicate_index(index)

    def _write_at(self, index: Any, data: Any) -> None:
        value = torch.as_tensor(index, dtype=torch.long, device=getattr(data, "device", None))
        value = value.expand(data.batch_size) if value.ndim == 0 else _index_value(value, data)
        with _index_entry(data, value) as entry:
            super()._write_at(index, data)
        entry.keep(value)


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


def _is_int_index(index: Any) -> bool:
    if isinstance(index, torch.Tensor):
        return index.ndim == 0
    return isinstance(index, int) or hasattr(index, "__index__") and not isinstance(index, (list, tuple))


__all__ = ["RoundRobinWriter", "TensorDictRoundRobinWriter"]
