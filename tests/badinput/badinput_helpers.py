"""Deep snapshots of a buffer, and the check every refused call must pass: a typed error and the
buffer exactly as it was."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch

from gpubuf import LazyStackStorage, ListStorage, TensorStorage
from gpubuf.errors import GpubufError, TrajectoryLengthError


def snapshot(rb: Any) -> dict:
    """Length, cursor, write count, every stored value, the sampler's state (priorities, tree,
    maximum) and the writer's, as clones."""
    storage = rb.storage
    snap: dict[str, Any] = {
        "len": len(rb),
        "cursor": rb.writer._cursor,
        "write_count": rb.write_count,
        "batch_size": rb.batch_size,
    }
    if isinstance(storage, ListStorage) and not (isinstance(storage, LazyStackStorage) and storage.densify) and type(
        storage
    ).state_dict is ListStorage.state_dict:
        snap["items"] = [item.clone() if isinstance(item, torch.Tensor) else copy.deepcopy(item) for item in storage._storage]
    elif not isinstance(storage, TensorStorage):
        # Packed, spill, encoded and compressed storages: their whole state, and every row read back.
        from hostile_probe import _freeze

        snap["state"] = _freeze(storage.state_dict())
        snap["rows"] = _freeze(rb[: len(rb)]) if len(rb) else None
    else:
        snap["initialized"] = storage.initialized
        if storage.initialized:
            rows = storage._len_along_dim0
            snap["leaves"] = [leaf[:rows].clone() for leaf in storage._leaves]
            snap["layout"] = repr(storage.layout)
    snap["sampler"] = copy.deepcopy(rb.sampler.state_dict())
    snap["writer"] = copy.deepcopy(rb.writer.state_dict())
    tree = getattr(rb.sampler, "_tree", None)
    if tree is not None:
        snap["tree"] = [tree.leaves.clone(), tree.sums.clone(), tree.mins.clone()]
        snap["max_priority"] = [None if v is None else v.clone() for v in rb.sampler._max_priority]
    return snap


def assert_same(a: Any, b: Any, where: str = "buffer") -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and (a.is_nested or b.is_nested):
        a, b = list(a.unbind()), list(b.unbind())
    """Exact equality of nested values: tensors bitwise, NaN equal to NaN."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        assert torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all()) if a.dtype.is_floating_point \
            else torch.equal(a, b), f"{where} changed"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {a.keys()} != {b.keys()}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r} != {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), f"{where} changed"
    elif hasattr(a, "batch_size") and hasattr(a, "keys"):
        assert_same(a.to_dict(), b.to_dict(), where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def refused(rb: Any, call: Any, builtin: type = Exception, typed: type = GpubufError) -> BaseException:
    """Runs ``call()``, which must raise ``typed`` (a gpubuf error that is also ``builtin``) and
    leave ``rb`` as it was; returns the error."""
    before = snapshot(rb)
    with pytest.raises(typed) as info:
        call()
    assert isinstance(info.value, GpubufError), f"{type(info.value).__name__} is not a gpubuf error"
    assert isinstance(info.value, builtin), f"{type(info.value).__name__} is not a {builtin.__name__}"
    assert str(info.value), "the error says nothing"
    assert_same(snapshot(rb), before)
    return info.value


def check_consistent(rb: Any) -> None:
    """A buffer that accepted something still works: its length, cursor and rows agree, every
    stored row reads back, and a sample draws written rows only."""
    n = len(rb)
    capacity = rb.storage.max_size
    assert 0 <= n <= capacity
    assert 0 <= rb.writer._cursor < max(capacity, 1) or capacity >= 2**62
    if n < capacity:
        assert rb.writer._cursor == n, (rb.writer._cursor, n)
    assert rb.write_count >= 0  # a storage made over given data holds rows never counted as writes
    if n:
        rows = rb[:]
        assert (len(rows) if isinstance(rows, list) else rows.shape[0]) == n
        try:
            batch, info = rb.sample(4, return_info=True)
        except TrajectoryLengthError:
            return  # a slice sampler over rows whose trajectories are all shorter than a slice
        index = info["index"]
        index = index[0] if isinstance(index, tuple) else index
        assert bool(((index >= 0) & (index < n)).all())
