"""Checks of what the public entry points of a buffer are given, run before anything changes.

Every check reads metadata only (types, dtypes, shapes, devices) or host values: a tensor on a
GPU is never read back (no synchronisation); its values are checked where the op runs.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

from gpubuf.errors import (
    DeviceMismatchError,
    IndexOutOfRangeError,
    InvalidIndexError,
    InvalidSliceError,
    PriorityError,
    SchemaMismatchError,
    UnsupportedDataError,
)
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.items import is_int

_INT64 = torch.iinfo(torch.int64)
_INDEX_HELP = "expected an int, a slice with a positive step, a sequence or tensor of ints, or a boolean mask"


def check_item_data(data: Any, what: str, *, check_meta: bool = True) -> None:
    """Refuses data no storage can hold: ``None``, a bare number (``extend(3.0)``), a tensor on
    the meta device (it has no values to copy; ``check_meta=False`` where the storage checks
    devices itself).

    Raises:
        UnsupportedDataError: ``None`` or a bare number.
        DeviceMismatchError: a tensor on the meta device.
    """
    if data is None:
        raise UnsupportedDataError(f"{what} got None: expected an item (a tensor, TensorDict or other object)")
    if isinstance(data, (numbers.Number, np.number)) and what.endswith("extend"):
        raise UnsupportedDataError(
            f"{what} got a bare {type(data).__name__}: expected a batch (a tensor or TensorDict with a leading dim, or a "
            "list of items)"
        )
    if check_meta and _on_meta(data):
        raise DeviceMismatchError(f"{what} got data on the meta device, which holds no values: expected real tensors")


def _on_meta(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return data.device.type == "meta"
    if is_tensor_collection(data):
        device = data.device
        if device is not None:
            return device.type == "meta"
        stacked = getattr(data, "tensordicts", None)
        if stacked is not None:  # a lazy stack: its parts, without stacking ragged leaves
            return any(_on_meta(part) for part in stacked)
        return any(
            isinstance(leaf, torch.Tensor) and leaf.device.type == "meta" for leaf in data.values(True, True)
        )
    if isinstance(data, (list, tuple)):
        return any(_on_meta(item) for item in data)
    if isinstance(data, dict):
        return any(_on_meta(item) for item in data.values())
    return False


def check_read_index(index: Any, length: int) -> None:
    """Refuses an index that does not address items of a buffer of ``length`` items.

    Accepted: an int, a slice of ints with a positive step, a list / array / tensor of ints, a
    boolean mask of ``length`` entries, and (storages with several dims, as torch indexes) a tuple
    of those, ``None`` and ``...``. Values are range-checked by the storage.

    Raises:
        InvalidSliceError: a slice with a zero or negative step, or non-int bounds.
        InvalidIndexError: anything else: a float or complex, a float tensor, a boolean mask of
            another length than the buffer's, a sequence holding something else than ints, a str
            inside a tuple, an object of another kind.
    """
    if isinstance(index, tuple):
        for part in index:
            if isinstance(part, tuple):
                raise InvalidIndexError(f"a tuple nested in a tuple index: {_INDEX_HELP}")
            if part is not None and part is not Ellipsis:
                _check_one_index(part, length)
        return
    _check_one_index(index, length)


def _check_one_index(index: Any, length: int) -> None:
    if isinstance(index, slice):
        for part, value in (("start", index.start), ("stop", index.stop), ("step", index.step)):
            if value is not None and not is_int(value):
                raise InvalidSliceError(f"slice {part} {value!r} is not an int: {_INDEX_HELP}")
        if index.step is not None and int(index.step) <= 0:
            raise InvalidSliceError(f"slice step {index.step} is not positive: {_INDEX_HELP}")
        return
    if isinstance(index, torch.Tensor):
        if index.is_meta:  # an attribute read; .device makes a torch.device
            raise InvalidIndexError(f"an index on the meta device holds no values: {_INDEX_HELP}")
        _check_index_dtype(index.dtype, tuple(index.shape), length)
        return
    if is_int(index):
        return
    if isinstance(index, np.ndarray):
        _check_index_dtype(_numpy_dtype(index), index.shape, length)
        return
    if isinstance(index, (list, range)):
        array = _as_array(list(index))
        if array is None or array.dtype == object or array.dtype.kind not in "iub":
            kind = "other" if array is None else str(array.dtype)
            raise InvalidIndexError(f"index list holds {kind} values: {_INDEX_HELP}")
        _check_index_dtype(_numpy_dtype(array), array.shape, length)
        return
    raise InvalidIndexError(f"an index of type {type(index).__name__}: {_INDEX_HELP}")


def _as_array(value: Any) -> np.ndarray | None:
    """``value`` as a numpy array (an empty sequence as int64), or None when it is not array-like
    (ragged lists, objects whose conversion fails)."""
    if isinstance(value, (list, tuple)) and not value:
        return np.zeros(0, dtype=np.int64)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return None
    try:
        return np.asarray(value)
    except Exception:  # noqa: BLE001 - numpy raises many kinds for values that are not arrays
        return None


def _numpy_dtype(array: np.ndarray) -> torch.dtype | None:
    kind = array.dtype.kind
    if kind == "b":
        return torch.bool
    if kind in "iu":
        return torch.int64
    return None


def _check_index_dtype(dtype: torch.dtype | None, shape: tuple, length: int) -> None:
    if dtype is None or dtype.is_floating_point or dtype.is_complex:
        raise InvalidIndexError(f"index of dtype {dtype} cannot address items: {_INDEX_HELP}")
    if dtype == torch.bool and len(shape) >= 1 and shape[0] != length:
        raise InvalidIndexError(
            f"a boolean mask of {shape[0]} entries on a buffer of {length} items: expected one entry per item"
        )


def check_priority_index(index: Any) -> None:
    """Refuses a priority-update index that holds no ints (floats, strings, None).

    Raises:
        InvalidIndexError: an index of another kind than ints (also a ``TypeError``).
    """
    if isinstance(index, tuple):
        for part in index:
            check_priority_index(part)
        return
    if isinstance(index, torch.Tensor):
        if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
            raise InvalidIndexError(f"priority index of dtype {index.dtype}: expected integer indices")
        if index.is_meta:  # an attribute read; .device makes a torch.device
            raise InvalidIndexError("a priority index on the meta device holds no values: expected integer indices")
        return
    if isinstance(index, bool) or index is None:
        raise InvalidIndexError(f"priority index {index!r}: expected integer indices")
    if is_int(index):
        if not _INT64.min <= int(index) <= _INT64.max:
            raise IndexOutOfRangeError(f"priority index {index} is out of the int64 range: expected a stored item's index")
        return
    array = _as_array(index)
    if array is None:
        raise InvalidIndexError(f"priority index of type {type(index).__name__} cannot be read as integers")
    if array.size and (array.dtype == object or array.dtype.kind not in "iu"):
        raise InvalidIndexError(f"priority index holds {array.dtype} values: expected integer indices")
    if array.size and array.dtype.kind == "u" and int(array.max()) > _INT64.max:
        raise IndexOutOfRangeError(f"priority index {int(array.max())} is out of the int64 range: expected a stored item's index")


def check_priority_values(priority: Any) -> None:
    """Refuses a priority that is not numbers (None, strings, objects); host values only.

    Raises:
        PriorityError: ``None`` or non-numeric priorities (values are checked by the sampler).
    """
    if isinstance(priority, torch.Tensor):
        if priority.dtype.is_complex or priority.dtype == torch.bool:
            raise PriorityError(f"priority of dtype {priority.dtype}: expected real numbers")
        if priority.is_meta:
            raise PriorityError("priority on the meta device holds no values: expected real numbers")
        return
    if priority is None:
        raise PriorityError("priority None: expected a number or one number per index")
    if isinstance(priority, (numbers.Real, np.number)) and not isinstance(priority, bool):
        try:
            float(priority)
        except OverflowError:
            raise PriorityError(f"priority {priority} is beyond the float64 range: expected a finite number") from None
        return
    array = _as_array(priority)
    if array is not None and array.dtype == object:
        try:  # Python ints past int64 are still numbers
            array = np.asarray(priority, dtype=np.float64)
        except (TypeError, ValueError, OverflowError):
            array = None
    if array is None or array.dtype == object or array.dtype.kind not in "iuf":
        kind = "other" if array is None else str(array.dtype)
        raise PriorityError(f"priority holds {kind} values: expected real numbers")


def check_dim_extend(dim_extend: int, data: Any) -> None:
    """Refuses a batch with fewer dims than ``dim_extend`` needs (checked before the transpose).

    Raises:
        SchemaMismatchError: the data has no dim ``dim_extend``.
    """
    if dim_extend == 0:
        return
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        ndim = data.ndim if isinstance(data, torch.Tensor) else data.batch_dims
        if ndim <= dim_extend:
            raise SchemaMismatchError(
                f"dim_extend={dim_extend} needs data with more than {dim_extend} batch dims, got {ndim}"
            )
