"""``CompressedListStorage``: TorchRL's list storage of items compressed one by one on the host.

A drop-in for ``torchrl.data.CompressedListStorage`` (same arguments, defaults and behaviour):
each item is compressed when written (zlib at ``compression_level``, or zstd from Python 3.14
on, as TorchRL does; or the given ``compression_fn``) and decompressed when read. It keeps
arbitrary items and any custom codec working; for image observations on a GPU see
:class:`~gpubuf.storages.codec_storage.CompressedTensorStorage` and
:class:`~gpubuf.storages.frame_stack.FrameStackStorage`, which compress on the device and decode
inside the sampling gather.

Behaviour kept from TorchRL, on purpose:

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
from typing import Any, Callable, Mapping

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from gpubuf.errors import (
    InvalidIndexError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
    UnsupportedDataError,
    WritePositionError,
)
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.list import ListStorage
from gpubuf.storages.items import is_int

__all__ = ["CompressedListStorage"]


class CompressedListStorage(ListStorage):
    """A list storage that compresses every item on write and decompresses it on read.

    Args:
        max_size: capacity in items.

    Keyword Args:
        compression_fn: ``tensor -> uint8 tensor``; defaults to zlib (zstd on Python >= 3.14)
            at ``compression_level`` over the tensor's bytes.
        decompression_fn: ``(uint8 tensor, metadata) -> tensor``; ``metadata`` holds the item's
            ``shape``, ``dtype`` and ``device``. Defaults to the inverse of the default.
        compression_level: level of the default compression (default 3).
        device: where written items are moved before compression (default ``"cpu"``).
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
        super().__init__(max_size, compilable=compilable, device=device)
        self.compression_level = compression_level
        self.compression_fn = self._default_compression_fn if compression_fn is None else compression_fn
        self.decompression_fn = self._default_decompression_fn if decompression_fn is None else decompression_fn
        self._storage: list = []
        self._metadata: list = []

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
        """Inverse of the default compression; the tensor comes back on ``metadata["device"]``."""
        _, decompress = self._codec()
        raw = decompress(self.to_bytestream(compressed_tensor.cpu()))
        tensor = torch.frombuffer(bytearray(raw), dtype=metadata["dtype"]).reshape(metadata["shape"])
        return tensor.to(metadata["device"])

    def _compress_item(self, item: Any) -> tuple[Any, dict]:
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
    def _set_item(self, cursor: int, data: Any) -> None:
        while len(self._storage) <= cursor:
            self._storage.append(None)
            self._metadata.append(None)
        compressed, metadata = self._compress_item(data)
        self._storage[cursor] = compressed
        self._metadata[cursor] = metadata

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
        if is_int(cursor) or (isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0):
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
            if position > size:
                raise WritePositionError(
                    "Cannot append data located more than one item away from the storage size: the storage size is "
                    f"{size} and the index of the item to be set is {position}."
                )
            if position >= self.max_size:
                raise WritePositionError(
                    f"Cannot append data to the list storage: maximum capacity is {self.max_size} and the index of the "
                    f"item to be set is {position}."
                )
            size = max(size, position + 1)
        compressed = [self._compress_item(self._to_device(item)) for item in items]
        for position, (value, metadata) in zip(positions, compressed):
            self._place(position % len(self._storage) if position < 0 else position, value, metadata)

    def _place(self, cursor: int, compressed: Any, metadata: Any) -> None:
        if cursor == len(self._storage):
            self._storage.append(compressed)
            self._metadata.append(metadata)
        else:
            self._storage[cursor] = compressed
            self._metadata[cursor] = metadata

    def _write_rows(self, start: int, data: Any) -> int:
        """Round-robin write of a batch of items from ``start`` (the writers' path)."""
        items = self._as_items(data)
        n = len(items)
        cap = self.max_size
        skip = max(n - cap, 0)
        # Every item is compressed before the first one is stored: a refused batch stores nothing.
        compressed = [self._compress_item(self._to_device(item)) for item in items[skip:]]
        for k, (value, metadata) in enumerate(compressed):
            cursor = (start + skip + k) % cap
            while len(self._storage) < cursor:  # the kept items fill every slot: make room for them
                self._storage.append(None)
                self._metadata.append(None)
            self._place(cursor, value, metadata)
        return n

    # ------------------------------------------------------------------ reading
    def _get_item(self, index: int) -> Any:
        if index < 0:
            index += len(self._storage)
        if not 0 <= index < len(self._storage) or self._storage[index] is None:
            raise IndexError(f"Index {index} out of bounds or not set")
        return self._decompress_item(self._storage[index], self._metadata[index])

    def get(self, index: Any) -> Any:
        """Returns one item for an int, a list of items otherwise (the buffer stacks them)."""
        if is_int(index):
            return self._get_item(int(index))
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self._storage))
            return [self._get_item(i) for i in range(start, stop, step) if self._storage[i] is not None]
        if isinstance(index, tuple):
            if len(index) > 1:
                raise RuntimeError(f"{type(self).__name__} can only be indexed with one-length tuples.")
            return self.get(index[0])
        if isinstance(index, (torch.Tensor, np.ndarray)):
            index = index.tolist()
        return [self._get_item(int(i)) for i in index]

    def __len__(self) -> int:
        return sum(item is not None for item in self._storage)

    def contains(self, item: Any) -> Any:
        if isinstance(item, torch.Tensor) and item.ndim:
            return torch.tensor([self.contains(int(i)) for i in item.tolist()], dtype=torch.bool, device=item.device)
        item = int(item)
        if item < 0:
            item += len(self._storage)
        return 0 <= item < len(self._storage) and self._storage[item] is not None

    def _empty(self) -> None:
        self._storage = []
        self._metadata = []

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"_storage": self._storage, "_metadata": self._metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Replaces the items with a :meth:`state_dict`'s, checked first.

        Raises:
            StateDictKeyError: ``_storage`` or ``_metadata`` missing.
            StateDictError: not two lists of one length (at most ``max_size``) with a metadata
                dict per item; nothing changes.
        """
        if not isinstance(state_dict, dict):
            raise StateDictError(f"storage state: expected a dict, got {type(state_dict).__name__}")
        for key in ("_storage", "_metadata"):
            if key not in state_dict:
                raise StateDictKeyError(f"storage state: missing key {key!r} (expected the keys of state_dict())")
        items, metadata = state_dict["_storage"], state_dict["_metadata"]
        if (
            not isinstance(items, (list, tuple))
            or not isinstance(metadata, (list, tuple))
            or len(items) != len(metadata)
            or len(items) > self.max_size
            or not all(isinstance(entry, dict) for entry in metadata)
        ):
            raise StateDictError(
                f"storage state: expected _storage and _metadata lists of one length (at most {self.max_size}), with "
                "a metadata dict per item"
            )
        # Copies, so that the storage never shares memory with the caller's objects.
        self._storage = [e.clone() if isinstance(e, torch.Tensor) else e for e in state_dict["_storage"]]
        self._metadata = deepcopy(state_dict["_metadata"])

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

        Raises:
            RuntimeError: the storage holds items but none of them counts any byte.
        """

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
        return f"{type(self).__name__}(items={len(self)}, max_size={self.max_size}, compression_level={self.compression_level})"


def _unbound(data: Any) -> list:
    """The items of a batch: a sequence's elements, or a tensor's (collection's) rows."""
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        if getattr(data, "ndim", 1) == 0:
            raise UnsupportedDataError("a 0-d tensor holds one item: write it at an int position")
        return list(data.unbind(0))
    if isinstance(data, (list, tuple, range, set, np.ndarray)):
        return list(data)
    return [data]  # one item written at every position of a slice


def _positions(cursor: Any) -> list[int]:
    """A sequence, array or tensor of positions as a list of ints; a boolean mask as the positions it selects."""
    if isinstance(cursor, (torch.Tensor, np.ndarray)):
        tensor = torch.as_tensor(cursor)
        if tensor.dtype == torch.bool:
            tensor = tensor.reshape(-1).nonzero().squeeze(-1)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            raise InvalidIndexError(f"positions of dtype {tensor.dtype}: expected integers")
        return tensor.reshape(-1).tolist()
    values = list(cursor)
    if values and all(isinstance(v, (bool, np.bool_)) for v in values):
        return [i for i, v in enumerate(values) if v]
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
        raise InvalidIndexError("positions holding values other than ints: expected integer positions")
    return [int(v) for v in values]
