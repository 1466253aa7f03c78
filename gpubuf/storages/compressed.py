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

        Raises:
            RuntimeError: an int cursor more than one item past the end, or past ``max_size``.
            TypeError: a sequence cursor with data that is not a sequence of items.
        """
        if not is_int(cursor):
            if isinstance(cursor, (torch.Tensor, np.ndarray)) and cursor.ndim == 0:
                return self.set(int(cursor), data, set_cursor=set_cursor)
            if isinstance(cursor, slice):
                data = self._to_device(data)
                if not hasattr(data, "__iter__"):
                    data = [data]
                start, stop, step = cursor.indices(len(self._storage))
                for i, value in zip(range(start, stop, step), data):
                    self._set_item(i, value)
                return
            if isinstance(data, (list, tuple, torch.Tensor, TensorDictBase, range, set, np.ndarray)) or is_tensor_collection(data):
                cursor = cursor.tolist() if isinstance(cursor, (torch.Tensor, np.ndarray)) else list(cursor)
                items = list(data) if not (isinstance(data, torch.Tensor) or is_tensor_collection(data)) else list(data.unbind(0))
                if len(items) != len(cursor):
                    raise ValueError(f"got {len(items)} items for {len(cursor)} indices")
                for c, item in zip(cursor, items):
                    self.set(c, item, set_cursor=set_cursor)
                return
            raise TypeError(
                f"Cannot extend a {type(self)} with data of type {type(data)}. Provide a list, tuple, set, range, "
                "np.ndarray, tensor or tensordict subclass instead."
            )
        cursor = int(cursor)
        if cursor > len(self._storage):
            raise RuntimeError(
                "Cannot append data located more than one item away from the storage size: the storage size is "
                f"{len(self._storage)} and the index of the item to be set is {cursor}."
            )
        if cursor >= self.max_size:
            raise RuntimeError(
                f"Cannot append data to the list storage: maximum capacity is {self.max_size} and the index of the "
                f"item to be set is {cursor}."
            )
        self._set_item(cursor, self._to_device(data))

    def _write_rows(self, start: int, data: Any) -> int:
        """Round-robin write of a batch of items from ``start`` (the writers' path)."""
        items = self._as_items(data)
        n = len(items)
        cap = self.max_size
        skip = max(n - cap, 0)
        for k, item in enumerate(items[skip:]):
            self._set_item((start + skip + k) % cap, self._to_device(item))
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
