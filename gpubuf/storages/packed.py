"""``PackedStorage``: variable-length items packed as values + offsets on the storage's device.

Why a storage of its own: TorchRL keeps variable-length items (token sequences of RLHF data,
trajectories of different lengths) in a Python list (``LazyStackStorage``) and pays for a
Python-level stack on every sample. Here every ragged tensor leaf lives in one ``values`` tensor
per leaf, rows end to end, and each row is described by ``starts[row]`` and ``lengths[row]``.
Sampling B rows is then one packed gather (:mod:`gpubuf.ops.gather_packed`): one Triton launch
on CUDA for all leaves that share their lengths, vectorised block copies on CPU (no Python loop
over rows); and the result is handed out as jagged nested tensors (``layout=torch.jagged``)
built on the gathered values without a copy.

How TorchRL users reach it: ``LazyStackStorage(..., densify=True)`` uses this storage and
samples what ``LazyStackedTensorDict.densify(layout=torch.jagged)`` would return for the same
items; :class:`PackedStorage` can also be used directly.

Writes append the new rows' tokens at the end of the arena; an overwritten row leaves its old
tokens behind as garbage, reclaimed by a compaction (itself one packed gather of the live rows)
when the arena is full, or dropped with the arena when the storage is emptied. Tokens below
the end of an arena are never written again, so an item read with an int index is a view that
later writes do not change (modifying it in place modifies the storage, as with a list storage).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpubuf.errors import (
    EmptyBufferError,
    GpubufError,
    IndexOutOfRangeError,
    SchemaMismatchError,
    StateDictError,
    WritePositionError,
)
from gpubuf.ops.gather_packed import gather_packed_trusted
from gpubuf.storages._ragged import Columns, RaggedSchema, item_count, jagged_many
from gpubuf.storages.base import Storage, check_device, check_max_size
from gpubuf.storages.items import is_int
from gpubuf.storages.checks import check_state_keys

__all__ = ["PackedStorage"]

_UNBOUNDED = torch.iinfo(torch.int64).max
# The smallest arena and slot table; small enough for tests, large enough to avoid early regrowth.
_MIN_TOKENS = 1024
_MIN_SLOTS = 16


class _Group:
    """Leaves whose rows always had the same lengths: they share ``starts``/``lengths`` and one gather.

    Attributes:
        leaves: positions of the leaves in the schema.
        values: one arena per leaf, ``[capacity, *trail]``.
        starts, lengths: int64 ``[slot_capacity]`` on the storage's device.
        used: tokens of the arena written so far (live rows and garbage).
    """

    def __init__(
        self, leaves: list[int], values: list[torch.Tensor], starts: torch.Tensor, lengths: torch.Tensor, used: int
    ) -> None:
        self.leaves = leaves
        self.values = values
        self.starts = starts
        self.lengths = lengths
        self.used = used

    @property
    def capacity(self) -> int:
        return self.values[0].shape[0]


class PackedStorage(Storage):
    """A storage of variable-length tensors, TensorDicts or tensorclasses, packed on one device.

    Every item has an empty batch size; each tensor leaf may differ from item to item in the
    length of its first dim (tokens) but not in its trailing shape or dtype; non-tensor leaves
    (strings, any object in a ``NonTensorData``) are kept per item. The first write fixes this
    structure (keys, dtypes, trailing shapes).

    Args:
        max_size: capacity in items; unbounded when ``None``.

    Keyword Args:
        device: where the packed values live and sampled batches are returned: ``"cpu"``,
            ``"cuda"``, a ``torch.device``, or ``None``/``"auto"`` (default) for the device of the
            first batch. Later batches are moved there.
        compilable: accepted for TorchRL compatibility.

    Reading ``B`` items returns the container of the items with batch size ``[B]`` whose leaves
    are: a dense ``[B, L, *trail]`` tensor when the ``B`` rows have one length ``L``, else a
    jagged nested tensor ``[B, j, *trail]`` (``layout=torch.jagged``; leaves that share their
    lengths share their offsets); ``[B]`` for 0-d leaves; a ``NonTensorStack`` for objects. An
    int index returns one item whose leaves are views into the storage.

    Raises:
        CapacityError: ``max_size`` is not a positive int.

    Examples:
        >>> storage = PackedStorage(100)
        >>> rb = ReplayBuffer(storage=storage, batch_size=4)
        >>> rb.extend([TensorDict(tokens=torch.arange(n)) for n in (3, 5, 7)])
        >>> rb.sample()["tokens"].is_nested
        True
    """

    def __init__(self, max_size: int | None = None, *, device: Any = None, compilable: bool = False) -> None:
        super().__init__(_UNBOUNDED if max_size is None else check_max_size(max_size), compilable=compilable)
        self.device = None if device in (None, "auto") else check_device(device)
        self._schema: RaggedSchema | None = None
        self._groups: list[_Group] = []
        self._objects: list[list] = []
        self._len = 0

    # ------------------------------------------------------------------ info
    def __len__(self) -> int:
        return self._len

    @property
    def schema(self) -> RaggedSchema | None:
        """The structure fixed by the first write, or None."""
        return self._schema

    @property
    def num_tokens(self) -> int:
        """Tokens of the live rows, summed over the length groups (a synchronising read)."""
        return sum(int(g.lengths[: self._len].sum()) for g in self._groups)

    def _device_of(self, cols: Columns) -> torch.device:
        if self.device is not None:
            return self.device
        return cols.tensors[0][0].device if cols.tensors else torch.device("cpu")

    # ------------------------------------------------------------------ writing
    def _write_rows(self, start: int, data: Any) -> int:
        """Writes a batch at slots ``start, start + 1, ...`` modulo the capacity (the writers' path).

        When the batch holds more items than the capacity only its last ``max_size`` are kept, as
        a sequential writer would leave them.

        Returns:
            The number of items of the batch.
        """
        n = item_count(data)
        if start > self._len:
            raise IndexOutOfRangeError(
                f"cannot write at {start}: the storage grows one item at a time and holds {self._len}"
            )
        skip = max(n - self.max_size, 0)
        if skip:
            data = data[skip:]
        count = n - skip
        first = (start + skip) % self.max_size
        slots = (torch.arange(count, dtype=torch.int64) + first) % self.max_size
        self._write(slots, data, batched=True)
        return n

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes one item at an int cursor, or a batch at a slice / sequence / tensor of slots.

        Slots beyond the current length must extend it contiguously (the storage grows one
        item at a time, as a list). Duplicate slots: the last item wins.

        Raises:
            IndexOutOfRangeError: a slot that skips ahead of the next free one or passes the capacity.
            SchemaMismatchError, DTypeMismatchError, UnsupportedDataError: data that does not fit.
            In every case nothing is written.
        """
        if is_int(cursor):
            slot = int(cursor)
            if not 0 <= slot < min(self.max_size, self._len + 1):
                raise IndexOutOfRangeError(
                    f"cannot write at {slot}: slots lie in [0, {min(self.max_size, self._len + 1)}) (the storage holds "
                    f"{self._len} items and grows one item at a time)"
                )
            if not set_cursor and slot >= self._len:
                raise WritePositionError(
                    f"cannot set item {slot}: the storage holds {self._len} items (expected an index below {self._len}; "
                    "new items are added with add or extend, which move the write cursor)"
                )
            self._write(torch.tensor([slot]), data, batched=False)
            return
        if isinstance(cursor, slice):
            cursor = range(self.max_size if self.max_size != _UNBOUNDED else self._len + item_count(data))[cursor]
        if isinstance(cursor, torch.Tensor):
            slots = cursor.reshape(-1).to("cpu", torch.int64)
        else:
            cursor = list(cursor) if isinstance(cursor, range) else cursor
            slots = torch.as_tensor(np.asarray(cursor), dtype=torch.int64).reshape(-1)
        if slots.numel() != item_count(data):
            raise SchemaMismatchError(f"got {item_count(data)} items for {slots.numel()} slots")
        if not set_cursor and slots.numel() and int(slots.max()) >= self._len:
            raise WritePositionError(
                f"cannot set item {int(slots.max())}: the storage holds {self._len} items (expected indices below "
                f"{self._len}; new items are added with add or extend, which move the write cursor)"
            )
        self._write(slots, data, batched=True)

    def _check_slots(self, slots: torch.Tensor) -> int:
        """Validates slots and returns the length after writing them."""
        if slots.numel() == 0:
            return self._len
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= self.max_size:
            bad = lo if lo < 0 else hi
            raise IndexOutOfRangeError(f"cannot write at {bad}: slots lie in [0, {self.max_size})")
        if hi < self._len:
            return self._len
        fresh = torch.unique(slots[slots >= self._len])
        if int(fresh[0]) != self._len or fresh.numel() != hi - self._len + 1:
            raise IndexOutOfRangeError(
                f"cannot write at {hi}: the storage holds {self._len} items and grows one item at a time"
            )
        return hi + 1

    def _write(self, slots: torch.Tensor, data: Any, batched: bool) -> None:
        schema = self._schema if self._schema is not None else RaggedSchema.infer(data, batched)
        cols = schema.columns(data, batched)
        new_len = self._check_slots(slots)
        # Everything is validated: from here on the storage changes.
        if slots.unique().numel() != slots.numel():
            keep = _last_occurrences(slots)
            slots, cols = slots[keep], _take_rows(cols, keep)
        device = self._device_of(cols)
        if self._schema is None:
            self._init(schema, cols, device)
        self._ensure_slots(new_len, device)
        self._split_groups(cols)
        dev_slots = slots.to(device)
        for group in self._groups:
            self._append(group, cols, dev_slots, device, new_len)
        for objects, values in zip(self._objects, cols.objects):
            _grow(objects, new_len)
            for slot, value in zip(slots.tolist(), values):
                objects[slot] = value
        self._len = new_len

    def _init(self, schema: RaggedSchema, cols: Columns, device: torch.device) -> None:
        self._schema = schema
        if self.device is None:
            self.device = device
        slots = torch.zeros(0, dtype=torch.int64, device=device)
        values = [torch.empty((0, *leaf.trail), dtype=leaf.dtype, device=device) for leaf in schema.leaves]
        self._groups = [_Group(list(range(len(schema.leaves))), values, slots, slots.clone(), 0)] if schema.leaves else []
        self._objects = [[] for _ in schema.object_keys]

    def _ensure_slots(self, needed: int, device: torch.device) -> None:
        for group in self._groups:
            have = group.starts.shape[0]
            if needed <= have:
                continue
            size = min(max(needed, 2 * have, _MIN_SLOTS), self.max_size)
            for name in ("starts", "lengths"):
                old = getattr(group, name)
                new = torch.zeros(size, dtype=torch.int64, device=device)
                new[:have] = old
                setattr(group, name, new)

    def _split_groups(self, cols: Columns) -> None:
        """Splits a group whose leaves get rows of different lengths in this write (permanent)."""
        groups = []
        for group in self._groups:
            parts: list[list[int]] = []
            for leaf in group.leaves:
                for part in parts:
                    if torch.equal(cols.tensors[part[0]][1], cols.tensors[leaf][1]):
                        part.append(leaf)
                        break
                else:
                    parts.append([leaf])
            if len(parts) == 1:
                groups.append(group)
                continue
            position = {leaf: i for i, leaf in enumerate(group.leaves)}
            for part in parts:
                values = [group.values[position[leaf]] for leaf in part]
                groups.append(_Group(part, values, group.starts.clone(), group.lengths.clone(), group.used))
        self._groups = groups

    def _append(self, group: _Group, cols: Columns, slots: torch.Tensor, device: torch.device, new_len: int) -> None:
        lengths = cols.tensors[group.leaves[0]][1].to(device)
        tokens = int(lengths.sum())
        if group.used + tokens > group.capacity:
            self._compact(group, tokens, exclude=slots)
        base = group.used
        starts = torch.zeros_like(lengths)
        if lengths.numel() > 1:
            torch.cumsum(lengths[:-1], 0, out=starts[1:])
        for leaf, arena in zip(group.leaves, group.values):
            arena[base : base + tokens] = cols.tensors[leaf][0].to(device)
        group.starts[slots] = starts + base
        group.lengths[slots] = lengths
        group.used = base + tokens

    def _compact(self, group: _Group, incoming: int, exclude: torch.Tensor) -> None:
        """Moves the live rows to the front of a new arena with room for ``incoming`` more tokens.

        Rows about to be overwritten (``exclude``) are dropped rather than copied.
        """
        n = self._len
        device = group.starts.device
        lengths = group.lengths[:n].clone()
        lengths[exclude[exclude < n]] = 0
        live = int(lengths.sum())
        # Doubling the live size keeps compactions amortised O(1) per written token.
        capacity = max(2 * (live + incoming), _MIN_TOKENS)
        arenas = [torch.empty((capacity, *v.shape[1:]), dtype=v.dtype, device=device) for v in group.values]
        if n and live:
            order = torch.arange(n, device=device)
            gather_packed_trusted(
                group.values, group.starts[:n], lengths, order, total=live, outs=arenas, backend=self._backend
            )
        starts = torch.zeros_like(lengths)
        if n > 1:
            torch.cumsum(lengths[:-1], 0, out=starts[1:])
        group.values = arenas
        group.starts[:n] = starts
        group.lengths[:n] = lengths
        group.used = live

    def compact(self) -> None:
        """Drops the tokens of overwritten rows now (they are otherwise reclaimed when the arena fills)."""
        for group in self._groups:
            self._compact(group, 0, exclude=torch.zeros(0, dtype=torch.int64, device=group.starts.device))

    # ------------------------------------------------------------------ reading
    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        if self._len == 0:
            raise EmptyBufferError("Cannot sample from an empty storage. Extend the buffer first.")
        device = self.device if self._rng is None else self._rng.device
        index = torch.randint(0, self._len, (batch_size,), generator=self._rng, device=device)
        return index.to(self.device)

    def get(self, index: Any) -> Any:
        """Reads items.

        Args:
            index: an int (one item, its leaves views into the storage), a slice, a sequence,
                array or 1-D tensor of ints or bools, or a 1-tuple of one of those. Negative ints
                count from the end.

        Returns:
            One item, or a batch of ``B`` items (see the class docstring) on the storage's device.

        Raises:
            EmptyBufferError: nothing was written yet.
            IndexOutOfRangeError: an index outside the written range.
        """
        if self._len == 0 or self._schema is None:
            raise EmptyBufferError("cannot read from an empty storage: write data to it first")
        n = self._len
        if isinstance(index, tuple):
            if len(index) != 1:
                raise IndexOutOfRangeError("a packed storage is indexed along one dimension only")
            index = index[0]
        if is_int(index):
            index = int(index)
            if not -n <= index < n:
                raise IndexOutOfRangeError(f"index {index} is out of range for a storage of length {n}")
            return self._item(index % n)
        if isinstance(index, slice):
            index = torch.arange(n)[index]
        elif not isinstance(index, torch.Tensor):
            index = torch.as_tensor(np.asarray(index))
        if index.dtype == torch.bool:
            index = index.nonzero().squeeze(-1)
        if index.dtype.is_floating_point:
            raise IndexOutOfRangeError(f"indices must be integers, got {index.dtype}")
        index = index.reshape(-1).to(self.device, torch.int64)
        if index.numel():
            lo, hi = (int(x) for x in torch.aminmax(index))
            if lo < -n or hi >= n:
                raise IndexOutOfRangeError(f"index {lo if lo < -n else hi} is out of range for a storage of length {n}")
            if lo < 0:
                index = torch.where(index < 0, index + n, index)
        return self._read_rows(index)

    def _read_rows(self, index: torch.Tensor) -> Any:
        """The sample path: ``index`` is a 1-D int64 tensor of valid rows on the storage's device."""
        schema = self._schema
        out: list = [None] * len(schema.leaves)
        batch = index.shape[0]
        # On the host the batch's offsets are a few NumPy operations over B rows: a handful of
        # torch ops (and a synchronising read) would cost several times as much.
        host_index = index.numpy() if index.device.type == "cpu" else None
        for group in self._groups:
            if host_index is not None:
                offsets = torch.empty(batch + 1, dtype=torch.int64)
                off = offsets.numpy()
                off[0] = 0
                lengths = group.lengths.numpy()[host_index]
                np.cumsum(lengths, out=off[1:])
                total, lo, hi = (int(off[-1]), int(lengths.min()), int(lengths.max())) if batch else (0, 0, 0)
            else:
                lengths = group.lengths.index_select(0, index)
                offsets = torch.zeros(batch + 1, dtype=torch.int64, device=index.device)
                torch.cumsum(lengths, 0, out=offsets[1:])
                if batch:
                    # One synchronisation per group gives the output size and whether rows are ragged.
                    total, lo, hi = torch.stack([offsets[-1], *torch.aminmax(lengths)]).tolist()
                else:
                    total = lo = hi = 0
            values, _ = gather_packed_trusted(
                group.values, group.starts, group.lengths, index, offsets=offsets, total=total, min_length=lo, max_length=hi,
                backend=self._backend,
            )
            ragged = []
            for leaf_pos, v in zip(group.leaves, values):
                leaf = schema.leaves[leaf_pos]
                if leaf.scalar:
                    out[leaf_pos] = v.view(batch)
                elif lo == hi:
                    out[leaf_pos] = v.view(batch, lo, *leaf.trail)
                else:
                    ragged.append((leaf_pos, v))
            if ragged:
                # One call for the group: its leaves share the offsets and the recorded lengths.
                nested = jagged_many([v for _, v in ragged], offsets, lo, hi)
                for (leaf_pos, _), t in zip(ragged, nested):
                    out[leaf_pos] = t
        objects = []
        if self._objects:
            rows = index.tolist()
            objects = [[column[i] for i in rows] for column in self._objects]
        return schema.build(out, objects, [batch], self._td_device())

    def _item(self, row: int) -> Any:
        schema = self._schema
        out: list = [None] * len(schema.leaves)
        for group in self._groups:
            start, length = int(group.starts[row]), int(group.lengths[row])
            for leaf_pos, v in zip(group.leaves, group.values):
                out[leaf_pos] = v[start] if schema.leaves[leaf_pos].scalar else v[start : start + length]
        objects = [column[row] for column in self._objects]
        return schema.build(out, objects, [], self._td_device())

    def _td_device(self) -> torch.device | None:
        return self.device

    # ------------------------------------------------------------------ misc
    def _empty(self) -> None:
        # The schema stays, as the layout of a TensorStorage does. The arenas go: items read
        # before are views into them, which refilling them in place would change.
        self._len = 0
        for group in self._groups:
            group.values = [torch.empty((0, *v.shape[1:]), dtype=v.dtype, device=v.device) for v in group.values]
            group.used = 0
        self._objects = [[] for _ in self._objects]

    def contains(self, item: int) -> bool:
        return 0 <= int(item) < self._len

    def state_dict(self) -> dict[str, Any]:
        """The live rows, compacted, as tensors and JSON-like values (what checkpoints hold).

        Returns:
            ``{"_len": int, "_schema": dict | None, "_values": [tensor], "_offsets": [tensor],
            "_objects": [list]}``: per schema leaf (in schema order) its rows end to end in slot
            order and int64 ``[_len + 1]`` offsets (leaves that share lengths share the offsets
            tensor); per object key the ``_len`` objects. Tensors are copies on the storage's
            device. The schema is described by :meth:`RaggedSchema.describe
            <gpubuf.storages._ragged.RaggedSchema.describe>`.
        """
        schema = self._schema
        values: list = [None] * (len(schema.leaves) if schema is not None else 0)
        offsets: list = list(values)
        if schema is not None:
            order = torch.arange(self._len, device=self.device)
            for group in self._groups:
                gathered, group_offsets = gather_packed_trusted(group.values, group.starts, group.lengths, order, backend=self._backend)
                for leaf_pos, v in zip(group.leaves, gathered):
                    values[leaf_pos], offsets[leaf_pos] = v, group_offsets
        return {
            "_len": self._len,
            "_schema": None if schema is None else schema.describe(),
            "_values": values,
            "_offsets": offsets,
            "_objects": [list(column[: self._len]) for column in self._objects],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the rows of :meth:`state_dict`, copied to this storage's device.

        Raises:
            StateDictKeyError: a key of :meth:`state_dict` is missing.
            StateDictError: a length that is not an int in ``[0, max_size]``, a schema that cannot
                be read, offsets or values that do not describe the rows (dtypes, shapes, offsets
                not rising from 0), object columns of another length, or rows that do not read
                back. The storage is unchanged then.
        """
        check_state_keys(state_dict, ("_len", "_schema", "_values", "_offsets", "_objects"), "packed storage state")
        described, n = state_dict["_schema"], state_dict["_len"]
        if not is_int(n) or not 0 <= int(n) <= self.max_size:
            raise StateDictError(f"packed storage state: _len must be an int in [0, {self.max_size}], got {n!r}")
        n = int(n)
        if described is None:
            if n:
                raise StateDictError(f"packed storage state: _len is {n} but the state has no schema (expected 0)")
            self._schema, self._groups, self._objects, self._len = None, [], [], 0
            return
        try:
            schema = RaggedSchema.from_description(described)
        except GpubufError:
            raise
        except Exception as err:  # noqa: BLE001 - a description edited in any way
            raise StateDictError(f"packed storage state: the schema cannot be read ({type(err).__name__}: {err})") from None
        values_in, offsets_in, objects_in = state_dict["_values"], state_dict["_offsets"], state_dict["_objects"]
        if not all(isinstance(v, (list, tuple)) for v in (values_in, offsets_in, objects_in)):
            raise StateDictError("packed storage state: _values, _offsets and _objects must be lists")
        entries = list(zip(values_in, offsets_in))
        if not all(isinstance(column, (list, tuple)) and len(column) == n for column in objects_in):
            raise StateDictError(f"packed storage state: each object column must hold {n} objects")
        objects = [list(column) for column in objects_in]
        if len(values_in) != len(schema.leaves) or len(offsets_in) != len(schema.leaves) or len(objects) != len(
            schema.object_keys
        ):
            raise StateDictError("packed storage state: the state's leaves do not match its schema")
        device = self.device or (entries[0][0].device if entries and isinstance(entries[0][0], torch.Tensor) else torch.device("cpu"))
        groups: list[tuple[torch.Tensor, _Group]] = []
        for pos, (leaf_values, leaf_offsets) in enumerate(entries):
            leaf = schema.leaves[pos]
            if not isinstance(leaf_values, torch.Tensor) or not isinstance(leaf_offsets, torch.Tensor):
                raise StateDictError(f"packed storage state: leaf {leaf.key!r}: values and offsets must be tensors")
            if leaf_values.dtype != leaf.dtype or leaf_offsets.dtype.is_floating_point or leaf_offsets.dtype == torch.bool:
                raise StateDictError(
                    f"packed storage state: leaf {leaf.key!r}: values of dtype {leaf_values.dtype} (the schema says "
                    f"{leaf.dtype}) with offsets of dtype {leaf_offsets.dtype} (expected integers)"
                )
            offsets = leaf_offsets.to(device, torch.int64)
            values = leaf_values.to(device).clone()
            if (
                offsets.shape != (n + 1,)
                or int(offsets[0]) != 0
                or bool((offsets.diff() < 0).any())
                or int(offsets[-1]) != values.shape[0]
                or values.shape[1:] != leaf.trail
                or (leaf.scalar and bool((offsets.diff() != 1).any()))
            ):
                raise StateDictError(f"packed storage state: leaf {leaf.key!r}: offsets and values do not describe {n} rows")
            for group_offsets, group in groups:
                if torch.equal(group_offsets, offsets):
                    group.leaves.append(pos)
                    group.values.append(values)
                    break
            else:
                group = _Group([pos], [values], offsets[:-1].clone(), offsets.diff(), values.shape[0])
                groups.append((offsets, group))
        previous = (self._schema, self.device, self._groups, self._objects, self._len)
        self._schema = schema
        self.device = device
        self._groups = [group for _, group in groups]
        self._objects = objects
        self._len = n
        try:  # every row reads back into the schema's container (keys, kinds): else nothing is loaded
            if n:
                self._read_rows(torch.arange(n, device=device))
        except Exception as err:  # noqa: BLE001 - any failure of an edited state
            self._schema, self.device, self._groups, self._objects, self._len = previous
            raise StateDictError(f"packed storage state: its rows do not read back ({type(err).__name__}: {err})") from None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(items={self._len}, max_size={self.max_size}, device={self.device}, "
            f"schema={self._schema})"
        )


def _grow(column: list, size: int) -> None:
    if len(column) < size:
        column.extend([None] * (size - len(column)))


def _last_occurrences(slots: torch.Tensor) -> torch.Tensor:
    """Positions of the last occurrence of each slot, in their original order."""
    last: dict[int, int] = {}
    for i, slot in enumerate(slots.tolist()):
        last[slot] = i
    return torch.tensor(sorted(last.values()), dtype=torch.int64)


def _take_rows(cols: Columns, keep: torch.Tensor) -> Columns:
    """The columns of the items at positions ``keep``."""
    tensors = []
    for values, lengths in cols.tensors:
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths.cpu(), 0, out=offsets[1:])
        dev = values.device
        values = values.contiguous()
        (v,), _ = gather_packed_trusted([values], offsets[:-1].to(dev), lengths.to(dev), keep.to(dev))
        tensors.append((v, lengths[keep.to(lengths.device)]))
    objects = [[column[i] for i in keep.tolist()] for column in cols.objects]
    return Columns(keep.numel(), tensors, objects)
