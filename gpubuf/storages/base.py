"""The storage interface shared by every gpubuf storage (TorchRL's ``Storage``)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Collection, NamedTuple, Sequence

import torch

from gpubuf.storages.checks import MAX_CAPACITY, check_device, check_fits_memory, check_max_size  # noqa: F401 (re-exported)
from gpubuf.storages._layout import expand_as_batch
from gpubuf.storages.items import batch_length


class WriteCursor:
    """Where a writer writes next (a dim-0 row) and how many items it has written.

    A writer keeps its own; a storage that several processes extend at once shares one between
    all its writers (see :attr:`Storage._write_state`). ``lock`` serialises a reservation of
    rows against other writers of the same cursor.
    """

    def __init__(self) -> None:
        self.cursor = 0
        self.write_count = 0
        self.lock = threading.RLock()

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.RLock()


class Appended(NamedTuple):
    """Where :meth:`Storage._append_rows` wrote a batch, and the index column it filled."""

    #: The dim-0 row the batch starts at.
    start: int
    #: For a batch written with an ``index_key``: its items' dim-0 rows as the index column got
    #: them, ``int64 [n]`` on the data's device, which the data then holds as that entry (the
    #: writer hands them back instead of making and setting them again: one launch less per
    #: extend on CUDA). Otherwise None.
    rows: torch.Tensor | None = None


class Storage:
    """A container of items addressed by integer indices.

    Subclasses implement :meth:`set`, :meth:`get`, :meth:`__len__` and :meth:`_empty`.

    Buffers and writers reach a storage through the protocol below; each of its operations has
    a default built on :meth:`set` and :meth:`get`, which a storage of tensors overrides to
    write and gather whole rows of every leaf at once:

    - :attr:`layout`: the structure of the stored items, or None for storages of arbitrary items;
    - :attr:`_write_state`: a write cursor shared by every writer of the storage, or None;
    - :meth:`_append_rows`: reserve rows at a cursor and write a batch there (the writers' path);
    - :meth:`_write_rows`: write a batch at given consecutive rows;
    - :meth:`_flat_index`: a sampler's index as the rows :meth:`_gather` takes;
    - :meth:`_gather`: the rows of every leaf, as one batch per leaf;
    - :meth:`_build`: those batches wrapped into the container the items came in (:attr:`layout`'s).

    :attr:`_row_sources` names the tensors a cross-device read copies rows of (see
    :class:`~gpubuf.ReplayBuffer`'s ``batch_device``), or is None where the storage gathers
    for itself.

    Args:
        max_size: the capacity, a positive int.
        checkpointer: the checkpointer of :meth:`dumps` / :meth:`loads` (default: the storage
            kind's own).
        compilable: accepted for TorchRL compatibility; gpubuf storages keep plain Python
            counters either way.
    """

    ndim = 1
    device: torch.device | str | None = None
    #: How checkpoints are written and read: ``(dump(storage, path), load(storage, path))``. The
    #: package installs :mod:`gpubuf.checkpoint`'s (a storage exposes its state through
    #: ``state_dict`` and its attributes, and never imports the checkpoint code).
    _checkpoint_io: tuple[Callable[[Any, Any], None], Callable[[Any, Any], None]] | None = None
    #: The ops' backend (``gpubuf.ops._dispatch``): ``"auto"``, or what the buffer was built with.
    _backend = "auto"
    # Whether a buffer's update_if_present can patch stored records in place (TorchRL's flag).
    supports_conditional_update = False

    @property
    def data_device(self) -> torch.device | None:
        """The device the stored rows live on (and samples are read from), as a ``torch.device``;
        None while it is not decided (``device="auto"`` before the first write) or where the
        storage has none of its own (an ensemble, a list storage of arbitrary objects)."""
        device = self.device
        if isinstance(device, torch.device):
            return device
        if isinstance(device, str) and device != "auto":
            return torch.device(device)
        return None

    def __init__(self, max_size: int, checkpointer: Any = None, compilable: bool = False) -> None:
        self.max_size = check_max_size(max_size)
        self._compilable = compilable
        self._rng: torch.Generator | None = None
        self._attached_entities: list = []
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []
        self._checkpointer = checkpointer

    # ------------------------------------------------------------------ the interface
    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        raise NotImplementedError

    def get(self, index: Any) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def _empty(self) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ the protocol of buffers and writers
    _layout: Any = None

    @property
    def layout(self) -> Any:
        """The structure of the stored items (a :class:`~gpubuf.storages._layout.Layout`), or None.

        None (the default) for storages of arbitrary items, and before the first write.
        """
        return self._layout

    @property
    def _write_state(self) -> WriteCursor | None:
        """The write cursor that every writer of this storage shares, or None (the default).

        With None each writer keeps its own :class:`WriteCursor`. A storage extended from
        several processes at once returns the one cursor they share, so that no two writers
        get the same rows.
        """
        return None

    #: The tensors a cross-device read gathers rows from (one per leaf, rows along dim 0, all on
    #: one device), or None: the storage's :meth:`_gather` reads its rows itself.
    _row_sources: list[torch.Tensor] | None = None

    def _append_rows(
        self, cursor: WriteCursor, data: Any, *, single: bool = False, index_key: tuple | None = None
    ) -> Appended:
        """Writes ``data`` at ``cursor``, then moves the cursor past it and counts its items.

        The writers' one path. Nothing changes (cursor, count, contents) when the data is
        rejected.

        Args:
            cursor: the writer's cursor, or the storage's own :attr:`_write_state`.
            data: a batch with a leading dim, or one item when ``single``.
            single: ``data`` is one item (``add``).
            index_key: a top-level key of a TensorDict ``data`` that receives each item's own
                dim-0 index (``TensorDictRoundRobinWriter``'s ``"index"``); the data then holds
                that entry after the write.

        Returns:
            :class:`Appended`: the dim-0 row the data starts at (row ``i`` of a batch goes to
            ``(start + i) % capacity_along_dim0``) and, for a batch with ``index_key``, the rows
            written into that column.
        """
        rows = None
        with cursor.lock:
            start = cursor.cursor
            if single:
                n, cap0 = 1, self._max_size_along_dim0(single_data=data)
                if index_key is not None:
                    data.set(index_key, torch.full(data.batch_size, start, dtype=torch.long, device=data.device))
                self.set(start, data)
            else:
                n, cap0 = batch_length(data), self._max_size_along_dim0(batched_data=data)
                if index_key is not None:
                    rows = torch.arange(start, start + n, device=data.device)
                    if start + n > cap0:  # the modulo only where the batch wraps: one launch less
                        rows = rows % cap0
                    data.set(index_key, expand_as_batch(rows, data.batch_size))
                self._write_rows(start, data)
            cursor.cursor = (start + n) % cap0
            cursor.write_count += n
        return Appended(start, rows)

    def _check_rows(self, data: Any) -> None:
        """Raises what writing the batch ``data`` would raise (schema, dtype, device), writing
        nothing. The default checks nothing: a storage that refuses batches says so here.
        """

    def _write_rows(self, start: int, data: Any) -> int:
        """Writes a batch at dim-0 rows ``start, start+1, ...``, wrapping round the capacity.

        Does not move any write cursor. The default writes through :meth:`set`.

        Returns:
            The number of items (along dim 0) of the batch.
        """
        n = batch_length(data)
        cap0 = self._max_size_along_dim0(batched_data=data)
        self.set(torch.arange(start, start + n) % cap0, data)
        return n

    def _flat_index(self, index: Any) -> Any:
        """A sampler's index as the rows :meth:`_gather` reads (the default: the index itself)."""
        return index

    def _gather(self, index: Any, skip: Collection[int] = ()) -> list:
        """The items at ``index`` (a sampler's index after :meth:`_flat_index`), per leaf.

        Args:
            index: in range, as a sampler produces it.
            skip: the positions in :attr:`layout` of leaves not to read (the caller fills
                them). Only given for storages with a layout.

        Returns:
            One batch per leaf of :attr:`layout` (None at the ``skip`` positions). The default,
            for storages without a layout: a one-element list holding :meth:`get`'s result.
        """
        return [self.get(index)]

    def _build(self, leaves: list, lead: Sequence[int], *, device: torch.device | None = None) -> Any:
        """Wraps :meth:`_gather`'s batches into the stored container.

        Args:
            leaves: one batch per leaf of :attr:`layout`, led by ``lead``; for a storage without
                a layout, the one batch :meth:`get` returned, which is returned as it is.
            lead: the batch's leading dims.
            device: where the leaves are, when a cross-device read put them elsewhere than the
                storage's device; None for the storage's device.
        """
        layout = self.layout
        if layout is None:
            return leaves[0]
        device = self.device if device is None else device
        if layout.kind in ("tensordict", "tensorclass"):
            return layout.build(leaves, torch.Size([*lead, *layout.item_batch]), device)
        return layout.build(leaves, torch.Size(lead), device)

    # ------------------------------------------------------------------ shared behaviour
    def __getitem__(self, item: Any) -> Any:
        return self.get(item)

    def __setitem__(self, index: Any, value: Any) -> None:
        self.set(index, value, set_cursor=False)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def attach(self, buffer: Any) -> None:
        """Registers a buffer (or other entity) that wants to hear about writes."""
        if buffer not in self._attached_entities:
            self._attached_entities.append(buffer)

    @property
    def _is_full(self) -> bool:
        return len(self) == self.max_size

    @property
    def shape(self) -> torch.Size | None:
        return torch.Size([len(self)])

    def _max_size_along_dim0(self, *, single_data: Any = None, batched_data: Any = None) -> int:
        return self.max_size

    def _element_capacity(self, data: Any = None, *, batched: bool = True) -> int:
        """How many elements the storage can hold once ``data`` (a batch, or one item with
        ``batched=False``) is written: ``max_size``, or for ``ndim > 1`` its rows along dim 0
        (``max_size`` rounded up to whole rows) times the elements of a row."""
        return self.max_size

    #: The item count of a storage that keeps one (its length); None where the length follows
    #: the contents (a list's).
    _len: int | None = None

    def _cover_rows(self, index: int | torch.Tensor) -> None:
        """Makes the length cover the dim-0 rows ``index`` (an int, or a 1-D tensor), just written
        at explicit indices (a writer's ``write_at``), without moving any cursor. A storage whose
        length follows its contents (``_len`` None) has nothing to do, and reads nothing: the
        largest row of a device tensor is a host read."""
        if self._len is None:
            return
        top = index if isinstance(index, int) else (int(index.max()) if index.numel() else -1)
        if top >= len(self):
            self._len = min(top + 1, self.max_size)

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        return torch.randint(0, len(self), (batch_size,), generator=self._rng)

    def flatten(self) -> "Storage":
        return self

    def register_save_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied to the data before it is saved by a checkpointer."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable[[Any], Any]) -> None:
        """Adds a hook applied to the data after it is loaded by a checkpointer."""
        self._load_hooks.append(hook)

    def dumps(self, path: Any) -> None:
        """Writes a pickle-free, crash-safe checkpoint of this storage to directory ``path``."""
        self._checkpoint_io[0](self, path)

    def loads(self, path: Any) -> None:
        """Restores this storage from a checkpoint written by :meth:`dumps` (validated first)."""
        self._checkpoint_io[1](self, path)

    def save(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def dump(self, path: Any) -> None:
        """Alias of :meth:`dumps`."""
        self.dumps(path)

    def load(self, path: Any) -> None:
        """Alias of :meth:`loads`."""
        self.loads(path)

    @property
    def checkpointer(self):
        return self._checkpointer

    @checkpointer.setter
    def checkpointer(self, value) -> None:
        self._checkpointer = value

    def contains(self, item: int) -> bool:
        return 0 <= int(item) < len(self)

    def __contains__(self, item: int) -> bool:
        return self.contains(item)

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError
