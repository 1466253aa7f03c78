"""``ListStorageCheckpointer`` and ``CompressedListStorageCheckpointer``: storages of Python items."""

from __future__ import annotations

from typing import Any, Mapping

from gpubuf.checkpoint.base import StorageCheckpointerBase, call_hook
from gpubuf.checkpoint.codecs import Apply, Context, StateDictCodec, _array, check_kind, register_codec, shadow_of
from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, UnserializableDataError
from gpubuf.checkpoint.format import require, require_int
from gpubuf.checkpoint.values import Decoder, Encoder
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.compressed import CompressedListStorage

__all__ = ["ListStorageCheckpointer", "CompressedListStorageCheckpointer"]


class ListStorageCheckpointer(StorageCheckpointerBase):
    """Writes a ``ListStorage``: its items as values (tensors and TensorDicts as raw arrays).

    Unlike TorchRL's, which cannot write a list storage at all, this one writes any item made of
    tensors, TensorDicts, tensorclasses, numpy arrays and JSON-like values, and refuses the rest
    with :class:`~gpubuf.checkpoint.UnserializableDataError` (they would need pickle).
    """

    name = "list_storage"

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        from gpubuf.storages.list import _UNBOUNDED, ListStorage

        check_kind(storage, ListStorage, "list storage")
        items: Any = list(storage._storage)
        for hook in self.save_hooks(storage):
            items = call_hook(hook, items, path=context.scratch)
        encoder, arrays = Encoder.collecting("t")
        if not isinstance(items, list):
            raise UnserializableDataError(f"list storage save hooks must return a list, got {type(items).__name__}")
        encoded = [encoder.encode(item, f"item {i}") for i, item in enumerate(items)]
        device = storage.device
        return {
            "max_size": None if storage.max_size == _UNBOUNDED else int(storage.max_size),
            "device": None if device is None else str(device),
            "items": encoded,
        }, arrays

    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        from gpubuf.storages.list import _UNBOUNDED, ListStorage

        check_kind(storage, ListStorage, "list storage")
        where = "storage state"
        max_size = require_int(state, "max_size", where, minimum=1, nullable=True)
        recorded = _UNBOUNDED if max_size is None else max_size
        if recorded != storage.max_size:
            have = "unbounded" if storage.max_size == _UNBOUNDED else storage.max_size
            raise CheckpointMismatchError(
                f"the checkpoint's list storage has max_size={max_size}, the buffer's storage has {have}"
            )
        decoder = Decoder(lambda name: _array(arrays, name))
        items = [decoder.decode(item, f"item {i}") for i, item in enumerate(require(state, "items", list, where))]
        for hook in self.load_hooks(storage):
            items = call_hook(hook, items, out=None)
        if not isinstance(items, list) or len(items) > storage.max_size:
            raise CheckpointCorruptError(f"{where}: the items do not fit a list storage of max_size {storage.max_size}")
        buffer = context.buffer
        if buffer is not None and buffer._tensordict_items and not all(is_tensor_collection(item) for item in items):
            raise CheckpointMismatchError(
                f"the checkpoint's list holds items that are not TensorDicts, and a {type(buffer).__name__} holds "
                "TensorDicts: load it into a buffer of the kind that wrote it"
            )
        if storage.device is not None:
            items = [storage._to_device(item) for item in items]
        shadow, apply = shadow_of(storage)
        shadow._storage = items
        return apply


class CompressedListStorageCheckpointer(StorageCheckpointerBase):
    """Writes a ``CompressedListStorage`` through :mod:`gpubuf.checkpoint.values` (no pickle,
    unlike ``torch.save``).

    On the item path: its ``state_dict()`` (compressed byte tensors and their metadata). In rows
    mode: its rows as stored (``rows_state()``: encoded frames, references, raw leaves), under
    ``{"mode": "rows", "rows": ...}``; nothing is recompressed either way.
    """

    name = "compressed_list_storage"

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        check_kind(storage, CompressedListStorage, "compressed list storage")
        rows = storage.rows_state()
        if rows is None:
            return StateDictCodec().to_checkpoint(storage, context)
        encoder, arrays = Encoder.collecting("r")
        return {"mode": "rows", "rows": encoder.encode(rows, "rows state")}, arrays

    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        if not (isinstance(state, dict) and state.get("mode") == "rows"):
            return StateDictCodec().from_checkpoint(storage, state, arrays, context)
        check_kind(storage, CompressedListStorage, "compressed list storage's rows")
        value = Decoder(lambda name: _array(arrays, name)).decode(state.get("rows"), "rows state")
        if not isinstance(value, dict) or not {"stack_keys", "key_interval", "len", "rows"} <= value.keys():
            raise CheckpointCorruptError("compressed list storage: the rows state lacks entries")
        shadow, apply = shadow_of(storage)
        try:
            shadow.load_rows_state(value)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError) as err:
            raise CheckpointMismatchError(f"{type(storage).__name__} refused the saved rows: {err}") from err
        return apply


register_codec("gpubuf.storages.list.ListStorage", ListStorageCheckpointer)
register_codec("CompressedListStorage", CompressedListStorageCheckpointer)
