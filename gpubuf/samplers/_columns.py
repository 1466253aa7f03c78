"""Reading single entries (done flags, trajectory ids) of stored rows, for the slice samplers.

A :class:`~gpubuf.storages.TensorStorage` (and its memmap subclass) is read leaf by leaf: only
the entry asked for is touched. Other storages are read through ``storage.get`` and the entry
taken from the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.errors import SchemaMismatchError
from gpubuf.storages.tensor import TensorStorage

__all__ = ["as_key", "has_key", "read_key", "flag_column"]


def as_key(key: Any) -> tuple:
    """A nested key as a tuple of strings (``"a"`` -> ``("a",)``)."""
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        return key
    raise SchemaMismatchError(f"a key must be a string or a tuple of strings, got {key!r}")


def _leaf(storage: Any, key: tuple) -> torch.Tensor | None:
    if isinstance(storage, TensorStorage):
        layout = storage.layout
        if layout is None:
            return None
        position = layout.index_of(key)
        return None if position is None else storage._leaves[position]
    return None


def _batch(items: Any) -> Any:
    """What a list storage returns for several items (a list of TensorDicts), as one batch."""
    if isinstance(items, list):
        try:
            return torch.stack(items)
        except (RuntimeError, TypeError, ValueError):
            return None
    return items


def has_key(storage: Any, key: tuple) -> bool:
    """Whether the rows of ``storage`` (already written to) carry entry ``key``."""
    if isinstance(storage, TensorStorage):
        return _leaf(storage, key) is not None
    try:
        item = _batch(storage.get(torch.zeros(1, dtype=torch.long)))
    except (IndexError, KeyError, RuntimeError, TypeError, ValueError):
        return False
    getter = getattr(item, "get", None)
    if getter is None:
        return False
    try:
        return getter(key, None) is not None
    except (KeyError, TypeError):
        return False


def read_key(storage: Any, key: tuple, index: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """Entry ``key`` of the stored elements at ``index`` (one tensor per storage dim), or None when absent.

    Returns the entry with the index's leading shape and the entry's own trailing shape.
    """
    leaf = _leaf(storage, key)
    if leaf is not None:
        return leaf[tuple(i.to(leaf.device) for i in index)]
    if isinstance(storage, TensorStorage):
        return None
    data = _batch(storage.get(index if len(index) > 1 else index[0]))
    getter = getattr(data, "get", None)
    return None if getter is None else getter(key, None)


def flag_column(storage: Any, key: tuple, rows: int, device: torch.device) -> tuple[bool, torch.Tensor | None]:
    """A stored flag entry as a ``bool [rows]`` view of the leaf, for kernels that read it by row.

    Returns:
        ``(True, column)`` for a tensor storage's ``bool [rows, 1]`` leaf on ``device``;
        ``(True, None)`` when a tensor storage does not hold ``key``; ``(False, None)`` when the
        entry is held in another form (or another storage kind): read it with :func:`read_key`.
    """
    if not isinstance(storage, TensorStorage):
        return False, None
    leaf = _leaf(storage, key)
    if leaf is None:
        return True, None
    if leaf.dtype != torch.bool or tuple(leaf.shape) != (rows, 1) or not leaf.is_contiguous() or leaf.device != device:
        return False, None
    return True, leaf.view(rows)


def flags_per_column(values: torch.Tensor, rows: int, columns: int, key: tuple) -> torch.Tensor:
    """Reshapes an entry read for ``rows`` time rows of ``columns`` columns to ``[rows, columns]``.

    Raises:
        SchemaMismatchError: the entry holds more than one value per element.
    """
    if values.numel() != rows * columns:
        raise SchemaMismatchError(
            f"Expected the end-of-trajectory signal to be 1-dimensional: entry {key!r} holds "
            f"{values.numel() // max(rows * columns, 1)} values per step, a trajectory boundary entry must hold one "
            "(shape [] or [1])"
        )
    return values.reshape(rows, columns)
