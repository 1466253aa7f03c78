"""The writer interface (TorchRL's ``Writer``): where new items go."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from gpubuf.errors import SchemaMismatchError, StateDictError, StateDictKeyError, UnsupportedDataError
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
        try:
            return len(data)
        except TypeError:
            raise UnsupportedDataError(
                f"cannot extend with a {type(data).__name__}: expected a batch (a tensor, TensorDict, pytree of "
                "tensors or a list of items)"
            ) from None
    if leaves[0].ndim == 0:
        raise SchemaMismatchError("expected a batch with a leading dimension, got scalar leaves; use add() for one item")
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
        """Restores the cursor and write count; the state is checked before either changes.

        Raises:
            StateDictKeyError: no ``_cursor``.
            StateDictError: a cursor or write count that is not an int >= 0.
        """
        if not isinstance(state_dict, dict):
            raise StateDictError(f"writer state: expected a dict, got {type(state_dict).__name__}")
        if "_cursor" not in state_dict:
            raise StateDictKeyError("writer state: missing key '_cursor' (expected the keys of state_dict())")
        values = {"_cursor": state_dict["_cursor"], "_write_count": state_dict.get("_write_count", self._write_count)}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point:
                value = values[key] = int(value)  # a compilable TorchRL writer keeps 0-d tensors
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise StateDictError(f"writer state: {key} must be an int >= 0, got {value!r}")
        self._cursor = int(values["_cursor"])
        self._write_count = int(values["_write_count"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cursor={self._cursor}, write_count={self._write_count})"
