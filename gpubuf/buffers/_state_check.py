"""Whole-state validation of ``ReplayBuffer.load_state_dict``: everything is checked before
anything of the buffer changes.

A state dict is checked at three levels: its own structure (keys, types, batch size,
generator), each component's part (capacity, length, cursor, exponents and priorities, as far as
the component is known here), and the consistency between components (a cursor inside the
storage's rows, priorities only on written rows, items of the buffer's kind). What a
component of another kind holds is checked by that component's ``load_state_dict``; the
buffer rolls its cheap components back if it refuses (see ``ReplayBuffer.load_state_dict``).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import torch

from gpubuf.errors import StateDictError, StateDictKeyError
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.storages._layout import Layout, is_tensor_collection
from gpubuf.storages.compressed import CompressedListStorage
from gpubuf.storages.items import is_int
from gpubuf.storages.list import ListStorage
from gpubuf.storages.memmap import LazyMemmapStorage
from gpubuf.storages.packed import PackedStorage
from gpubuf.storages.spill import SpillStorage
from gpubuf.storages.stack import LazyStackStorage
from gpubuf.storages.tensor import TensorStorage, rows_of_state
from gpubuf.writers import RoundRobinWriter

#: The keys every buffer state dict holds (``_transforms`` and ``_rng`` may be absent).
REQUIRED_KEYS = ("_storage", "_sampler", "_writer", "_batch_size")


class CheckedState(NamedTuple):
    """What the checks made of a state dict: the generator to install (or None)."""

    generator: torch.Generator | None


def _is_int(value: Any) -> bool:
    # A compilable TorchRL component keeps 0-d tensors; a state read on the host keeps them there.
    return is_int(value) and not (isinstance(value, torch.Tensor) and value.device.type != "cpu")


def _require_dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise StateDictError(f"{where}: expected a dict, got {type(value).__name__}")
    return value


def _require_keys(state: dict, keys: tuple, where: str) -> None:
    for key in keys:
        if key not in state:
            raise StateDictKeyError(f"{where}: missing key {key!r} (expected the keys of state_dict(): {list(keys)})")


def check_buffer_state(buffer: Any, state_dict: Any) -> CheckedState:
    """Validates a buffer state dict whole, against ``buffer``; changes nothing.

    Raises:
        StateDictKeyError: a key is missing (at any level checked here).
        StateDictError: anything else that does not fit (see the module docstring).
    """
    state = _require_dict(state_dict, "state dict")
    _require_keys(state, REQUIRED_KEYS, "state dict")
    batch_size = state["_batch_size"]
    if batch_size is not None and (
        not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool) or batch_size <= 0
    ):
        raise StateDictError(f"state dict: _batch_size must be None or a positive int, got {batch_size!r}")
    transforms = state.get("_transforms")
    if transforms is not None and not isinstance(transforms, dict):
        raise StateDictError(f"state dict: _transforms must be a dict, got {type(transforms).__name__}")
    generator = _check_rng(state.get("_rng"))
    rows = _check_storage(buffer, state["_storage"])
    _check_writer(buffer._writer, state["_writer"], rows)
    _check_sampler(buffer._sampler, state["_sampler"], buffer._storage, rows)
    return CheckedState(generator)


def _check_rng(rng: Any) -> torch.Generator | None:
    if rng is None:
        return None
    if not isinstance(rng, (tuple, list)) or len(rng) != 2:
        raise StateDictError("state dict: _rng must be None or (state tensor, device str)")
    rng_state, device = rng
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.uint8 or rng_state.ndim != 1:
        raise StateDictError("state dict: _rng's state must be a 1-D uint8 tensor")
    try:
        generator = torch.Generator(device=device)
        generator.set_state(rng_state)
    except (RuntimeError, TypeError, ValueError) as err:
        raise StateDictError(f"state dict: _rng cannot be restored here: {err}") from None
    return generator


class _Rows(NamedTuple):
    """The incoming storage's size: its length along dim 0 and its capacity along dim 0 (None if unknown)."""

    length: int | None
    capacity: int | None


def _check_storage(buffer: Any, state: Any) -> _Rows:
    storage = buffer._storage
    where = "state dict _storage"
    state = _require_dict(state, where)
    loader = type(storage).load_state_dict
    if loader in (TensorStorage.load_state_dict, LazyMemmapStorage.load_state_dict, SpillStorage.load_state_dict):
        _require_keys(state, ("_storage", "_len"), where)
        data, length = rows_of_state(state, storage.ndim), state["_len"]
        if not _is_int(length) or int(length) < 0:
            raise StateDictError(f"{where}: _len must be an int >= 0, got {length!r}")
        length = int(length)
        if data is None:
            if length != 0:
                raise StateDictError(f"{where}: _len is {length} but the state holds no data (expected 0)")
            return _Rows(0, None)
        if not (isinstance(data, torch.Tensor) or is_tensor_collection(data)):
            if buffer._tensordict_items or not isinstance(data, (dict, list, tuple)):
                raise StateDictError(
                    f"{where}: expected the stored data ({'a TensorDict' if buffer._tensordict_items else 'tensors'}), "
                    f"got {type(data).__name__}"
                )
        if buffer._tensordict_items and not is_tensor_collection(data):
            raise StateDictError(
                f"{where}: a {type(buffer).__name__} holds TensorDicts, and this state holds "
                f"{type(data).__name__} (the state of a buffer of another kind)"
            )
        shape = _lead_shape(data, storage.ndim)
        if shape is None or len(shape) < storage.ndim:
            raise StateDictError(f"{where}: the data needs {storage.ndim} leading dims")
        cap0 = int(shape[0])
        capacity = int(torch.Size(shape[: storage.ndim]).numel())
        expected = storage._capacity_along_dim0 if isinstance(storage, TensorStorage) and storage.initialized else None
        if storage.ndim == 1 and cap0 != storage.max_size or expected is not None and cap0 != expected:
            raise StateDictError(
                f"{where}: the data has {cap0} rows along dim 0, this storage {expected or storage.max_size} "
                "(the state of a buffer of another capacity)"
            )
        if length > capacity:
            raise StateDictError(f"{where}: _len is {length}, more than the {capacity} items the data holds")
        rest = capacity // max(cap0, 1)
        return _Rows(-(-length // max(rest, 1)), cap0)
    if loader is ListStorage.load_state_dict:
        _require_keys(state, ("_storage",), where)
        items = state["_storage"]
        if not isinstance(items, (list, tuple)):
            raise StateDictError(f"{where}: _storage must be a list of items, got {type(items).__name__}")
        if len(items) > storage.max_size:
            raise StateDictError(f"{where}: {len(items)} items for a capacity of {storage.max_size}")
        _check_list_items(buffer, items, where)
        return _Rows(len(items), storage.max_size)
    if loader in (CompressedListStorage.load_state_dict, LazyStackStorage.load_state_dict):
        items = state.get("_storage")
        if isinstance(items, (list, tuple)):
            if loader is LazyStackStorage.load_state_dict:
                _check_list_items(buffer, items, where)
            metadata = state.get("_metadata")
            if loader is CompressedListStorage.load_state_dict and buffer._tensordict_items and isinstance(metadata, (list, tuple)):
                if any(not isinstance(meta, dict) or meta.get("type") != "tensordict" for meta in metadata):
                    raise StateDictError(
                        f"{where}: a {type(buffer).__name__} holds TensorDicts, and this state holds other items (the state "
                        "of a buffer of another kind)"
                    )
            return _Rows(len(items), storage.max_size)  # the storage checks the rest itself
        packed = state.get("_packed")
        if isinstance(packed, dict) and _is_int(packed.get("_len")):
            return _Rows(int(packed["_len"]), storage.max_size)
    if loader is PackedStorage.load_state_dict and _is_int(state.get("_len")):
        return _Rows(int(state["_len"]), storage.max_size)
    # A storage of another kind (encoded, ensembles) checks its own state; a writer's cursor
    # still lies below its capacity, and a TensorDict buffer's items are TensorDicts.
    layout = state.get("_layout")
    if buffer._tensordict_items and isinstance(layout, Layout) and layout.kind not in ("tensordict", "tensorclass"):
        raise StateDictError(
            f"{where}: a {type(buffer).__name__} holds TensorDicts, and this state holds {layout.kind} items (the state "
            "of a buffer of another kind)"
        )
    return _Rows(None, storage.max_size if storage.ndim == 1 else None)


def _check_list_items(buffer: Any, items: Any, where: str) -> None:
    """The items of a list state are the buffer's kind: a TensorDict buffer samples TensorDicts only."""
    if buffer._tensordict_items:
        for i, item in enumerate(items):
            if not is_tensor_collection(item):
                raise StateDictError(
                    f"{where}: item #{i} is a {type(item).__name__}, and a {type(buffer).__name__} holds TensorDicts (the "
                    "state of a buffer of another kind)"
                )


def _lead_shape(data: Any, ndim: int) -> torch.Size | None:
    if isinstance(data, torch.Tensor):
        return data.shape
    if is_tensor_collection(data):
        return data.batch_size
    leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]
    return leaves[0].shape if leaves else None


def _check_writer(writer: Any, state: Any, rows: _Rows) -> None:
    where = "state dict _writer"
    state = _require_dict(state, where)
    if not isinstance(writer, RoundRobinWriter):
        return
    _require_keys(state, ("_cursor",), where)
    cursor = state["_cursor"]
    if not _is_int(cursor) or int(cursor) < 0:
        raise StateDictError(f"{where}: _cursor must be an int >= 0, got {cursor!r}")
    count = state.get("_write_count", 0)
    if not _is_int(count) or int(count) < 0:
        raise StateDictError(f"{where}: _write_count must be an int >= 0, got {count!r}")
    cursor = int(cursor)
    if rows.capacity is not None and cursor >= rows.capacity:
        raise StateDictError(f"{where}: _cursor {cursor} is past the storage's {rows.capacity} rows")
    if rows.length is not None and rows.capacity is not None and rows.length < rows.capacity and cursor != rows.length:
        # While the storage fills, rows are written in order: the next one goes right after them.
        raise StateDictError(
            f"{where}: _cursor {cursor} with {rows.length} rows written (expected {rows.length} while the storage is "
            "not full)"
        )


def _check_sampler(sampler: Any, state: Any, storage: Any, rows: _Rows) -> None:
    where = "state dict _sampler"
    state = _require_dict(state, where)
    sampler._check_state_dict(state)
    if not isinstance(sampler, PrioritizedSampler):
        return
    tree = state["_tree"] if "_tree" in state else sampler._from_torchrl_state(state)["_tree"]
    leaves = tree["leaves"]
    if rows.length is not None and storage.ndim == 1 and leaves.device.type == "cpu":
        if bool((leaves[rows.length :] > 0).any()):
            raise StateDictError(
                f"{where}: the tree holds priorities past the {rows.length} rows the storage state holds (the states "
                "of two different buffers)"
            )
