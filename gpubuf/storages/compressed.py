"""``CompressedListStorage``: TorchRL's compressed list storage, with a fast path for stacked frames.

A drop-in for ``torchrl.data.CompressedListStorage`` (same arguments and defaults). It stores
items in one of two modes, chosen at the first write:

- **rows** (the default functions, and a tensor or TensorDict whose leaves include stacked
  ``uint8`` frames, item shape ``[S, H, W]``): the storage keeps its rows in a
  :class:`~gpubuf.storages.frame_stack.FrameStackStorage`: a batch is encoded at once on
  ``extend``, each distinct frame is stored once, and a sample decodes only its rows (with the
  Triton kernel when ``device`` is CUDA). The other leaves are kept raw: they are a few bytes per
  row. Reads return what the item path returns, bit for bit.
- **items** (a custom ``compression_fn`` / ``decompression_fn``, non-tensor items, lists of
  items): TorchRL's path, each item compressed on its own (zlib at ``compression_level``, or
  zstd from Python 3.14 on).

A write in rows mode that does not fit the rows' layout (another key, dtype or shape, or an
item that is not a tensor collection) moves the storage to the item path first: every stored
row is decoded and compressed as an item, then the write proceeds there. Nothing is lost; later
writes stay on the item path. ``_empty`` forgets the mode.

``state_dict`` has TorchRL's format (``{"_storage": [...], "_metadata": [...]}``) in both modes
(in rows mode the rows are compressed item by item to make it), and ``load_state_dict`` of
that format gives the item path. gpubuf checkpoints of rows mode keep the rows as they are.

A compressed row or item that fails to decode (a zlib error, a wrong decompressed size, a row
failing its checksum) raises :class:`~gpubuf.errors.CorruptRowError` naming the row.

Behaviour kept from TorchRL on the item path, on purpose:

- a tensor item is compressed whole; a TensorDict item has each top-level tensor compressed on
  its own, and any other top-level entry (including a nested TensorDict such as ``"next"``)
  kept as it is; other items are kept as they are;
- ``decompression_fn(compressed, metadata)`` receives the metadata dict (``shape``, ``dtype``,
  ``device``) and the item comes back on the device it was written from;
- writing past the end of the list by more than one item raises ``RuntimeError``, as does
  writing past ``max_size``; ``len()`` counts the items set.
"""

from __future__ import annotations

import sys
from copy import deepcopy
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from gpubuf.errors import (
    ComponentTypeError,
    CorruptRowError,
    DTypeMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
    UnsupportedDataError,
    WritePositionError,
)
from gpubuf.storages._layout import Layout, is_tensor_collection
from gpubuf.storages._row_store import RowStore
from gpubuf.storages.frame_stack import FrameStackStorage
from gpubuf.storages.items import is_int
from gpubuf.storages.list import ListStorage, _positions
from gpubuf.storages.checks import check_state_keys

#: Errors by which the rows' storage refuses a write that does not fit its layout (raised
#: before anything is written).
_MISFIT = (SchemaMismatchError, DTypeMismatchError, UnsupportedDataError)

__all__ = ["CompressedListStorage"]


class _FrameRows(FrameStackStorage):
    """The rows mode's storage: a :class:`FrameStackStorage` sized for its first batch.

    A frame stack storage starts with frame slots for about two frames per row and renumbers
    (compacts) its frames when a batch could overflow them, which a first ``extend`` of many
    rows always does, though nothing is stored yet. Here an empty storage is given the slots
    the batch may need instead, with no compaction.
    """

    def _write_encoded(self, ids: torch.Tensor, leaves: list[torch.Tensor], sequential: bool) -> None:
        slots = ids.numel() * len(leaves) * self._stack
        if self._n_frames == 0 and slots > self._frames.rows:
            device = self._refs.device
            self._frames = RowStore(self._frame_geometry, slots, device, with_refs=True)
            self._age = torch.zeros(slots, dtype=torch.int32, device=device)
            self._tail = None
        super()._write_encoded(ids, leaves, sequential)


class CompressedListStorage(ListStorage):
    """A list storage that compresses every item on write and decompresses it on read.

    With the default functions, batches of stacked ``uint8`` frames take the rows mode (see
    the module docstring): frame dedup, batched encode, decode of the sampled rows only.

    Args:
        max_size: capacity in items.

    Keyword Args:
        compression_fn: ``tensor -> uint8 tensor``; defaults to zlib (zstd on Python >= 3.14)
            at ``compression_level`` over the tensor's bytes.
        decompression_fn: ``(uint8 tensor, metadata) -> tensor``; ``metadata`` holds the item's
            ``shape``, ``dtype`` and ``device``. Defaults to the inverse of the default.
        compression_level: level of the default compression (default 3).
        device: where written items are moved before compression (default ``"cpu"``); in rows
            mode, where rows are encoded, kept and decoded (``"cuda"``: on the GPU).
        compilable: accepted for TorchRL compatibility.

    Examples:
        >>> storage = CompressedListStorage(max_size=1000, compression_level=3)
        >>> rb = ReplayBuffer(storage=storage, batch_size=5)
        >>> rb.extend(TensorDict({"obs": torch.randn(10, 3, 84, 84)}, batch_size=[10]))
        >>> rb.sample(3)["obs"].shape
        torch.Size([3, 3, 84, 84])
    """

    def __init__(
        self,
        max_size: int,
        *,
        compression_fn: Callable | None = None,
        decompression_fn: Callable | None = None,
        compression_level: int = 3,
        device: torch.device | str = "cpu",
        compilable: bool = False,
    ) -> None:
        _check_compression(compression_level, compression_fn, decompression_fn)
        super().__init__(max_size, compilable=compilable, device=device)
        self.compression_level = compression_level
        self.compression_fn = self._default_compression_fn if compression_fn is None else compression_fn
        self.decompression_fn = self._default_decompression_fn if decompression_fn is None else decompression_fn
        self._storage: list = []
        self._metadata: list = []
        # The rows mode's storage, or None on the item path (and before the first write).
        self._rows: _FrameRows | None = None

    # ------------------------------------------------------------------ mode
    @property
    def mode(self) -> str | None:
        """``"rows"`` (stacked frames, batched codec), ``"items"`` (TorchRL's path) or None before the first write."""
        if self._rows is not None:
            return "rows"
        return "items" if self._storage else None

    def _default_functions(self) -> bool:
        return (
            self.compression_fn == self._default_compression_fn
            and self.decompression_fn == self._default_decompression_fn
        )

    def _rows_for(self, data: Any, leading: int) -> _FrameRows | None:
        """The rows-mode storage for a first write of ``data``, or None when it takes the item path."""
        if not self._default_functions() or not (isinstance(data, torch.Tensor) or isinstance(data, TensorDictBase)):
            return None
        try:
            layout = Layout.from_batch(data, leading=leading)
        except (SchemaMismatchError, UnsupportedDataError, TypeError, ValueError):
            return None
        frames = [spec for spec in layout.leaves if spec.dtype == torch.uint8 and len(spec.shape) == 3]
        # Stacked leaves share one shape in the rows' storage; the others stay raw.
        keys = [spec.key for spec in frames if frames and spec.shape == frames[0].shape]
        if not keys or frames[0].shape.numel() == 0:
            return None
        device = "cpu" if self.device is None else self.device
        return _FrameRows(self.max_size, stack_keys=keys, device=device)

    def _start(self, data: Any, leading: int) -> None:
        """Chooses the mode at the first write."""
        if self._rows is None and not self._storage:
            self._rows = self._rows_for(data, leading)

    def _to_items(self) -> None:
        """Leaves rows mode: every stored row is decoded and compressed as an item."""
        rows, self._rows = self._rows, None
        n = len(rows)
        self._storage, self._metadata = [], []
        if n:
            batch = rows.get(torch.arange(n, device=rows.device))
            for item in batch.unbind(0):
                compressed, metadata = self._compress_item(self._to_device(item))
                self._storage.append(compressed)
                self._metadata.append(metadata)

    # ------------------------------------------------------------------ codec
    @staticmethod
    def _codec():
        if sys.version_info >= (3, 14):
            from compression import zstd

            return zstd.compress, zstd.decompress
        import zlib

        return zlib.compress, zlib.decompress

    def _default_compression_fn(self, tensor: torch.Tensor) -> torch.Tensor:
        """Compresses a tensor's bytes (zlib, or zstd on Python >= 3.14) into a uint8 tensor."""
        compress, _ = self._codec()
        packed = compress(self.to_bytestream(tensor), level=self.compression_level)
        return torch.frombuffer(bytearray(packed), dtype=torch.uint8)

    def _default_decompression_fn(self, compressed_tensor: torch.Tensor, metadata: dict) -> torch.Tensor:
        """Inverse of the default compression; the tensor comes back on ``metadata["device"]``.

        Raises:
            CorruptRowError: the bytes do not decompress, or not to the item's size.
        """
        _, decompress = self._codec()
        try:
            raw = decompress(self.to_bytestream(compressed_tensor.cpu()))
        except Exception as err:  # zlib.error, or zstd's ZstdError
            raise CorruptRowError(f"compressed bytes do not decompress ({err})") from err
        dtype, shape = metadata["dtype"], torch.Size(metadata["shape"])
        expected = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if len(raw) != expected:
            raise CorruptRowError(
                f"compressed bytes decompress to {len(raw)} bytes, expected {expected} ({dtype}{list(shape)})"
            )
        tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
        return tensor.to(metadata["device"])

    def _compress_item(self, item: Any) -> tuple[Any, dict]:
        if item is None:  # a None slot is an empty one here: it cannot be an item
            raise UnsupportedDataError("None cannot be stored as an item: expected a tensor, TensorDict or other object")
        if isinstance(item, torch.Tensor):
            metadata = {"type": "tensor", "shape": item.shape, "dtype": item.dtype, "device": item.device}
            return self.compression_fn(item), metadata
        if is_tensor_collection(item):
            fields, metadata = {}, {"type": "tensordict", "fields": {}}
            for key, value in item.items():
                if isinstance(value, torch.Tensor):
                    fields[key] = self.compression_fn(value)
                    metadata["fields"][key] = {
                        "type": "tensor",
                        "shape": value.shape,
                        "dtype": value.dtype,
                        "device": value.device,
                    }
                else:
                    fields[key] = value
                    metadata["fields"][key] = {"type": "non_tensor", "value": value}
            return fields, metadata
        return item, {"type": "other", "value": item}

    def _decompress_item(self, compressed: Any, metadata: dict) -> Any:
        kind = metadata["type"]
        if kind == "tensor":
            return self.decompression_fn(compressed, metadata)
        if kind == "tensordict":
            result = TensorDict({}, batch_size=metadata.get("batch_size", []))
            for key, field in metadata["fields"].items():
                if field["type"] == "non_tensor":
                    result[key] = field["value"]
                else:
                    result[key] = self.decompression_fn(compressed[key], field)
            return result
        return metadata["value"]

    # ------------------------------------------------------------------ writing
    @staticmethod
    def _single(cursor: Any) -> bool:
        return is_int(cursor) or (isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes one item at an int cursor, items at a slice, or one item per index of a sequence.

        Every position and item is checked, and every item compressed, before the first one is
        stored: a refused write stores nothing.

        Raises:
            WritePositionError: a position more than one item past the end or past ``max_size``,
                or (``set_cursor=False``, ``rb[i] = item``) past the items stored; a
                ``RuntimeError`` as in TorchRL.
            UnsupportedDataError: a sequence cursor with data that is not a sequence of items.
            SchemaMismatchError: as many items as positions are expected.
        """
        if self._rows is None and not self._storage:
            self._start(data, 0 if self._single(cursor) else 1)
        if self._rows is not None:
            try:
                return self._set_rows(cursor, data)
            except _MISFIT:
                self._to_items()
        if self._single(cursor):
            positions, items = [int(cursor)], [data]
        elif isinstance(cursor, slice):
            positions = list(range(len(self._storage)))[cursor]
            items = list(data) if isinstance(data, (list, tuple)) else _unbound(data)
        elif isinstance(data, (list, tuple, torch.Tensor, TensorDictBase, range, set, np.ndarray)) or is_tensor_collection(
            data
        ):
            positions = _positions(cursor)
            items = _unbound(data)
        else:
            raise UnsupportedDataError(
                f"cannot write a {type(data).__name__} at a sequence of positions: expected a list, tuple, set, range, "
                "np.ndarray, tensor or tensordict of items"
            )
        if len(items) != len(positions):
            raise SchemaMismatchError(f"got {len(items)} items for {len(positions)} positions: expected one per position")
        size = len(self._storage)
        for position in positions:
            if not set_cursor and not -len(self._storage) <= position < len(self._storage):
                raise WritePositionError(
                    f"cannot set item {position}: the storage holds {len(self._storage)} items; expected the position of "
                    "a stored item (add() or extend() append new ones)"
                )
            self._check_cursor(position, size)
            size = max(size, position + 1)
        compressed = [self._compress_item(self._to_device(item)) for item in items]
        self._check_structure(positions, [metadata for _, metadata in compressed])
        for position, (value, metadata) in zip(positions, compressed):
            self._place(position % len(self._storage) if position < 0 else position, value, metadata)

    #: Whether TensorDict items must keep one structure (a TensorDict buffer, which stacks what it
    #: samples, sets it); a plain buffer takes items of any structure and samples them as a list.
    same_structure = False

    def _check_structure(self, positions: list[int], metadata: list[dict]) -> None:
        """With :attr:`same_structure`, TensorDict items keep one structure (batch size, keys,
        dtypes, shapes), that of the items already stored (or of the batch's first)."""
        if not self.same_structure:
            return
        size = len(self._storage)
        replaced = {p + size if p < 0 else p for p in positions}
        reference = next(
            (m for i, m in enumerate(self._metadata) if m is not None and i not in replaced), metadata[0] if metadata else None
        )
        if reference is None or reference.get("type") != "tensordict":
            return
        expected = _structure(reference)
        for i, meta in enumerate(metadata):
            if _structure(meta) != expected:
                raise SchemaMismatchError(
                    f"item #{i} has another structure than the stored TensorDicts (batch size, keys, dtypes or shapes): "
                    f"expected {expected}, got {_structure(meta)}"
                )

    def _check_items_structure(self, metadata: list) -> None:
        """With :attr:`same_structure`, a state's TensorDict items share one structure, as written ones do."""
        if self.same_structure and metadata and metadata[0].get("type") == "tensordict":
            expected = _structure(metadata[0])
            for i, meta in enumerate(metadata):
                if _structure(meta) != expected:
                    raise StateDictError(f"storage state: item {i} has another structure than item 0 (keys, dtypes, shapes)")

    def _place(self, cursor: int, compressed: Any, metadata: Any) -> None:
        if cursor == len(self._storage):
            self._storage.append(compressed)
            self._metadata.append(metadata)
        else:
            self._storage[cursor] = compressed
            self._metadata[cursor] = metadata

    def _check_cursor(self, cursor: int, size: int) -> None:
        if cursor > size:
            raise WritePositionError(
                "Cannot append data located more than one item away from the storage size: the storage size is "
                f"{size} and the index of the item to be set is {cursor}."
            )
        if cursor >= self.max_size:
            raise WritePositionError(
                f"Cannot append data to the list storage: maximum capacity is {self.max_size} and the index of the "
                f"item to be set is {cursor}."
            )

    def _set_rows(self, cursor: Any, data: Any) -> None:
        """:meth:`set` in rows mode: TorchRL's cursor rules, then one batched write."""
        rows = self._rows
        size = len(rows)
        if self._single(cursor):
            cursor = int(cursor)
            positions = [cursor + size if cursor < 0 else cursor]
        else:
            if isinstance(cursor, slice):
                positions = list(range(*cursor.indices(size)))
                count = data.shape[0] if isinstance(data, torch.Tensor) else data.batch_size[0]
                positions, data = positions[:count], data[: len(positions)]
            else:
                positions = cursor.tolist() if isinstance(cursor, (torch.Tensor, np.ndarray)) else list(cursor)
            if not (isinstance(data, torch.Tensor) or isinstance(data, TensorDictBase)):
                raise UnsupportedDataError(f"a {type(data).__name__} is not a batch of this storage's rows")
            if len(data) != len(positions):
                raise SchemaMismatchError(f"got {len(data)} items for {len(positions)} indices: expected one item per index")
        if not positions:
            return
        grown = size
        for c in positions:
            if c < 0:
                raise IndexOutOfRangeError(f"index {c} is out of range for a storage of length {size}")
            self._check_cursor(c, grown)
            grown = max(grown, c + 1)
        if self._single(cursor):
            rows.set(positions[0], data, set_cursor=False)
        else:
            rows.set(torch.tensor(positions, dtype=torch.int64), data, set_cursor=False)
        rows._len = grown

    def _write_rows(self, start: int, data: Any) -> int:
        """Round-robin write of a batch of items from ``start`` (the writers' path)."""
        if self._rows is None and not self._storage:
            self._start(data, 1)
        if self._rows is not None:
            try:
                return self._rows._write_rows(start, data)
            except _MISFIT:
                self._to_items()
        items = self._as_items(data)
        n = len(items)
        cap = self.max_size
        skip = max(n - cap, 0)
        # Every item is compressed before the first one is stored: a refused batch stores nothing.
        compressed = [self._compress_item(self._to_device(item)) for item in items[skip:]]
        self._check_structure([(start + skip + k) % cap for k in range(len(compressed))], [m for _, m in compressed])
        for k, (value, metadata) in enumerate(compressed):
            cursor = (start + skip + k) % cap
            while len(self._storage) < cursor:  # the kept items fill every slot: make room for them
                self._storage.append(None)
                self._metadata.append(None)
            self._place(cursor, value, metadata)
        return n

    # ------------------------------------------------------------------ the protocol, in rows mode
    @property
    def layout(self) -> Any:
        """The rows' layout in rows mode; None on the item path (reads then go through :meth:`get`)."""
        return None if self._rows is None else self._rows.layout

    def _flat_index(self, index: Any) -> Any:
        return index if self._rows is None else self._rows._flat_index(index)

    def _gather(self, index: Any, skip: Collection[int] = ()) -> list:
        if self._rows is None:
            return super()._gather(index, skip)
        try:
            return self._rows._gather(index, skip)
        except CorruptRowError as err:
            raise self._corrupt(err, index) from err

    def _build(self, leaves: list, lead: Sequence[int], *, device: torch.device | None = None) -> Any:
        if self._rows is None:
            return super()._build(leaves, lead, device=device)
        return self._rows._build(leaves, lead, device=device)

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        if self._rows is None:
            return super()._rand_given_ndim(batch_size)
        return self._rows._rand_given_ndim(batch_size)

    def _corrupt(self, err: CorruptRowError, index: torch.Tensor) -> CorruptRowError:
        """``err`` as the error naming the storage rows of ``index`` whose frames failed.

        The rows' storage decodes the frame slots of ``index`` as one flat ``[J, B, S]`` read
        (stacked leaf, row, stack position), and ``err.rows`` are positions in it.
        """
        J, _, S = self._rows._refs.shape
        rows = index.reshape(-1).cpu()
        B = rows.numel()
        positions = [p for p in err.rows if 0 <= p < J * B * S]
        if positions:
            named = sorted(set(rows[(torch.tensor(positions) // S) % B].tolist()))
        else:
            named = sorted(set(rows.tolist()))
        return CorruptRowError(f"stored row(s) {named} of {type(self).__name__} failed to decode: {err}", rows=named)

    # ------------------------------------------------------------------ reading
    def _get_item(self, index: int) -> Any:
        if index < 0:
            index += len(self._storage)
        if not 0 <= index < len(self._storage) or self._storage[index] is None:
            raise IndexError(f"Index {index} out of bounds or not set")
        try:
            return self._decompress_item(self._storage[index], self._metadata[index])
        except CorruptRowError as err:
            raise CorruptRowError(f"item {index} of {type(self).__name__} is corrupt: {err}", rows=[index]) from err

    def _get_rows(self, index: Any) -> Any:
        """:meth:`get` in rows mode: an item for an int, a list of items otherwise, as TorchRL returns."""
        size = len(self._rows)
        single = self._single(index)
        if single:
            positions = [int(index)]
        elif isinstance(index, slice):
            positions = list(range(size))[index]
        else:
            positions = index.tolist() if isinstance(index, (torch.Tensor, np.ndarray)) else list(index)
        for i in positions:
            if not -size <= i < size:
                raise IndexOutOfRangeError(f"Index {i} out of bounds or not set (the storage holds {size} items)")
        if not positions:
            return []
        rows = torch.tensor([i + size if i < 0 else i for i in positions], dtype=torch.int64, device=self._rows.device)
        batch = self._build(self._gather(rows), [rows.numel()])
        return batch[0] if single else list(batch.unbind(0))

    def get(self, index: Any) -> Any:
        """Returns one item for an int, a list of items otherwise (the buffer stacks them).

        Raises:
            IndexError: an index out of range, or of an item not set.
            CorruptRowError: a stored row or item does not decode; names it.
        """
        if isinstance(index, tuple):
            if len(index) > 1:
                raise RuntimeError(f"{type(self).__name__} can only be indexed with one-length tuples.")
            return self.get(index[0])
        if self._rows is not None:
            return self._get_rows(index)
        if is_int(index):
            return self._get_item(int(index))
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._storage))
            return [self._get_item(i) for i in range(start, stop, step) if self._storage[i] is not None]
        if isinstance(index, (torch.Tensor, np.ndarray)):
            index = index.tolist()
        return [self._get_item(int(i)) for i in index]

    def __len__(self) -> int:
        if self._rows is not None:
            return len(self._rows)
        return sum(item is not None for item in self._storage)

    def contains(self, item: Any) -> Any:
        if isinstance(item, torch.Tensor) and item.ndim:
            return torch.tensor([self.contains(int(i)) for i in item.tolist()], dtype=torch.bool, device=item.device)
        item = int(item)
        if self._rows is not None:
            size = len(self._rows)
            return -size <= item < size
        if item < 0:
            item += len(self._storage)
        return 0 <= item < len(self._storage) and self._storage[item] is not None

    def _empty(self) -> None:
        self._storage = []
        self._metadata = []
        self._rows = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """TorchRL's state: ``{"_storage": compressed items, "_metadata": their metadata}``.

        In rows mode the rows are decoded and compressed item by item to make it (the storage
        does not change); gpubuf checkpoints keep the rows as they are instead.
        """
        if self._rows is None:
            return {"_storage": self._storage, "_metadata": self._metadata}
        storage, metadata = [], []
        n = len(self._rows)
        if n:
            for item in self._get_rows(list(range(n))):
                compressed, meta = self._compress_item(self._to_device(item))
                storage.append(compressed)
                metadata.append(meta)
        return {"_storage": storage, "_metadata": metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replaces the items with a :meth:`state_dict`'s, checked first.

        Raises:
            StateDictKeyError: ``_storage`` or ``_metadata`` missing.
            StateDictError: not two lists of one length (at most ``max_size``) with a metadata
                dict per item (None for an unset slot); nothing changes.
        """
        check_state_keys(state_dict, ("_storage", "_metadata"), "storage state")
        items, metadata = state_dict["_storage"], state_dict["_metadata"]
        if (
            not isinstance(items, (list, tuple))
            or not isinstance(metadata, (list, tuple))
            or len(items) != len(metadata)
            or len(items) > self.max_size
            or not all(isinstance(m, dict) or (m is None and e is None) for e, m in zip(items, metadata))
        ):
            raise StateDictError(
                f"storage state: expected _storage and _metadata lists of one length (at most {self.max_size}), with "
                "a metadata dict per item (None for an unset slot)"
            )
        # Copies, so that the storage never shares memory with the caller's objects.
        storage = [e.clone() if isinstance(e, torch.Tensor) else e for e in items]
        metadata = deepcopy(list(metadata))
        for i, (compressed, meta) in enumerate(zip(storage, metadata)):
            try:  # every item decompresses: an edited state is refused now, not at a later read
                self._decompress_item(compressed, meta)
            except Exception as err:  # noqa: BLE001 - a compression function may raise anything
                raise StateDictError(
                    f"storage state: item {i} does not decompress with its metadata ({type(err).__name__}: {err})"
                ) from None
        self._check_items_structure(metadata)
        self._rows = None
        self._storage, self._metadata = storage, metadata

    def rows_state(self) -> dict[str, Any] | None:
        """Rows mode's own state (for checkpoints), or None on the item path.

        Returns:
            ``{"stack_keys": [...], "key_interval": int, "len": int, "rows": <the rows' state_dict>}``;
            tensors are copies.
        """
        if self._rows is None:
            return None
        return {
            "stack_keys": [list(k) for k in self._rows.stack_keys],
            "key_interval": self._rows.key_interval,
            "len": len(self._rows),
            "rows": self._rows.state_dict(),
        }

    def load_rows_state(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`rows_state` returned (the storage is then in rows mode).

        Raises:
            SchemaMismatchError: the state does not fit this storage (another capacity or layout).
        """
        if not isinstance(state, dict) or not all(k in state for k in ("stack_keys", "key_interval", "len", "rows")):
            raise StateDictKeyError("rows state: expected the keys stack_keys, key_interval, len and rows")
        length, saved = state["len"], state["rows"]
        if not is_int(length) or not 0 <= int(length) <= self.max_size:
            raise StateDictError(f"rows state: len must be an int in [0, {self.max_size}], got {length!r}")
        if not isinstance(saved, dict) or saved.get("_len") != int(length):
            raise StateDictError(f"rows state: the rows hold {saved.get('_len') if isinstance(saved, dict) else None!r} rows, len says {length}")
        device = "cpu" if self.device is None else self.device
        try:
            rows = _FrameRows(
                self.max_size, stack_keys=[tuple(k) for k in state["stack_keys"]], key_interval=state["key_interval"],
                device=device,
            )
        except (TypeError, ValueError) as err:
            raise StateDictError(f"rows state: {err}") from None
        encoded = saved.get("encoded")
        refs = encoded.get("refs") if isinstance(encoded, dict) else None
        if isinstance(refs, torch.Tensor) and (refs.ndim < 2 or refs.shape[1] != self.max_size):
            raise SchemaMismatchError(f"the saved rows are for another max_size than this storage's {self.max_size}")
        rows.load_state_dict(saved)  # checked whole, every row read back
        rows._len = int(length)
        self._rows = rows
        self._storage, self._metadata = [], []

    def to_bytestream(self, data_to_bytestream: Any) -> bytes:
        """A tensor's or array's raw bytes (other objects are pickled, as in TorchRL)."""
        if isinstance(data_to_bytestream, torch.Tensor):
            return data_to_bytestream.cpu().numpy().tobytes()
        if isinstance(data_to_bytestream, np.ndarray):
            return bytes(data_to_bytestream.tobytes())
        import io
        import pickle

        buffer = io.BytesIO()
        pickle.dump(data_to_bytestream, buffer)
        return buffer.getvalue()

    def bytes(self) -> int:
        """Bytes held by the compressed items (tensors, arrays and bytes counted; other objects 0).

        In rows mode: the stored frames, their table and references, and the raw leaves.

        Raises:
            RuntimeError: the storage holds items but none of them counts any byte.
        """

        if self._rows is not None:
            n = len(self._rows)
            plain = sum(t[:n].numel() * t.element_size() for t in self._rows._plain.values())
            return self._rows.bytes() + plain

        def size(data: Any) -> int:
            if data is None:
                return 0
            if isinstance(data, (bytes, bytearray)):
                return len(data)
            if isinstance(data, np.ndarray):
                return data.nbytes
            if isinstance(data, torch.Tensor):
                return data.numel() * data.element_size()
            if isinstance(data, (tuple, list)):
                return sum(size(item) for item in data)
            if isinstance(data, Mapping) or is_tensor_collection(data):
                return sum(size(value) for value in data.values())
            return 0

        total = size(self._storage)
        if total == 0:
            if self._storage:
                raise RuntimeError("Compressed storage is not empty but the compressed size is 0. This is a bug.")
            import warnings

            warnings.warn("Compressed storage is empty, returning 0 bytes.")
        return total

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(items={len(self)}, max_size={self.max_size}, "
            f"compression_level={self.compression_level}, mode={self.mode})"
        )


def _structure(metadata: dict) -> tuple:
    """What stacked items share, read from an item's metadata."""
    if metadata.get("type") != "tensordict":
        return (metadata.get("type"),)
    fields = tuple(
        sorted((str(key), f.get("type"), tuple(f.get("shape", ())), str(f.get("dtype"))) for key, f in metadata["fields"].items())
    )
    return ("tensordict", tuple(metadata.get("batch_size", ())), fields)


def _check_compression(level: Any, compression_fn: Any, decompression_fn: Any) -> None:
    """Refuses at construction what the first write would: a level the default codec does not
    take (zlib's -1 to 9; zstd's -131072 to 22), functions that are not callable.

    Raises:
        InvalidArgumentError: the level (a ``ValueError``).
        ComponentTypeError: a function that is not callable (a ``TypeError``).
    """
    low, high = (-131072, 22) if sys.version_info >= (3, 14) else (-1, 9)
    if not is_int(level) or not low <= int(level) <= high:
        raise InvalidArgumentError(f"compression_level must be an int in [{low}, {high}], got {level!r}")
    for name, fn in (("compression_fn", compression_fn), ("decompression_fn", decompression_fn)):
        if fn is not None and not callable(fn):
            raise ComponentTypeError(f"{name} must be callable or None, got {type(fn).__name__}")


def _unbound(data: Any) -> list:
    """The items of a batch: a sequence's elements, or a tensor's (collection's) rows."""
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        if getattr(data, "ndim", 1) == 0:
            raise UnsupportedDataError("a 0-d tensor holds one item: write it at an int position")
        return list(data.unbind(0))
    if isinstance(data, (list, tuple, range, set, np.ndarray)):
        return list(data)
    return [data]  # one item written at every position of a slice
