"""``TensorStorageCheckpointer``: tensor storages, in memory or memory-mapped (zero copy in place)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from gpubuf.checkpoint.arrays import LiveArray
from gpubuf.checkpoint.base import StorageCheckpointerBase, call_hook
from gpubuf.checkpoint.codecs import Apply, Context, LiveFile, _array, check_kind, is_memmap, register_codec, shadow_of
from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError
from gpubuf.checkpoint.format import require, require_int
from gpubuf.checkpoint.values import Decoder, Encoder, decode_layout, device_here, encode_layout

__all__ = ["TensorStorageCheckpointer"]


class TensorStorageCheckpointer(StorageCheckpointerBase):
    """Writes a ``TensorStorage`` / ``LazyTensorStorage``: one raw array per leaf, whole capacity.

    State: ``max_size``, ``ndim``, ``len``, ``device``, ``auto_device``, ``initialized`` and the
    layout (container kind, keys, dtypes, item shapes, tensorclass, pytree structure). Arrays:
    ``leaf_<i>`` of shape ``[capacity_along_dim0, *item_shape]``, in layout order.

    Loading into a storage of another capacity or ``ndim`` raises
    :class:`~gpubuf.checkpoint.CheckpointMismatchError`. The data goes to the target storage's
    device (for ``device="auto"``, to the recorded one when this machine has it).
    """

    name = "tensor_storage"

    # ------------------------------------------------------------------ dump
    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        from gpubuf.storages.tensor import TensorStorage

        check_kind(storage, TensorStorage, type(self).__name__ + " (a tensor storage)")
        state = self._base_state(storage)
        if not storage.initialized:
            return state, {}
        hooks = self.save_hooks(storage)
        if hooks:
            return self._hooked_state(storage, state, hooks, context)
        return self._plain_state(storage, state)

    @staticmethod
    def _base_state(storage: Any) -> dict:
        device = storage._leaves[0].device if storage.initialized else storage.device
        return {
            "max_size": int(storage.max_size),
            "ndim": int(storage.ndim),
            "len": int(storage._len),
            "initialized": bool(storage.initialized),
            "auto_device": bool(storage._auto_device),
            "device": None if device in (None, "auto") else str(device),
        }

    def _plain_state(self, storage: Any, state: dict) -> tuple[dict, dict]:
        state["layout"] = encode_layout(storage._layout)
        if not is_memmap(storage):
            return state, {f"leaf_{i}": leaf for i, leaf in enumerate(storage._leaves)}
        # A memory-mapped storage: its leaves are files, listed in place when the dump goes to
        # the directory holding them (zero copy), copied otherwise.
        paths = list(storage.files.values())
        arrays: dict[str, Any] = {f"leaf_{i}": LiveFile(leaf, path) for i, (leaf, path) in enumerate(zip(storage._leaves, paths))}
        service = os.path.join(storage.scratch_dir, ".gpubuf")
        for i, path in enumerate(sorted(_files_below(service))):
            arrays[f"service_{i}"] = LiveFile(None, path)
        return state, arrays

    def _hooked_state(self, storage: Any, state: dict, hooks: list, context: Context) -> tuple[dict, dict]:
        data = storage._storage
        _tell_hooks_the_ring(storage, hooks, context)
        for hook in hooks:
            data = call_hook(hook, data, path=context.scratch)
        encoder, arrays = Encoder.collecting("h")
        state["hooked"] = encoder.encode(data, "storage content (after save hooks)")
        return state, arrays

    # ------------------------------------------------------------------ load
    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        from gpubuf.storages.tensor import LazyTensorStorage, TensorStorage

        check_kind(storage, TensorStorage, "tensor storage")
        where = "storage state"
        ndim = require_int(state, "ndim", where, minimum=1)
        length = require_int(state, "len", where)
        initialized = require(state, "initialized", bool, where)
        if ndim != storage.ndim:
            raise CheckpointMismatchError(f"the checkpoint's storage has ndim={ndim}, the buffer's storage ndim={storage.ndim}")
        if not initialized and is_memmap(storage):
            if length:
                raise CheckpointCorruptError(f"{where}: an uninitialized storage of length {length}")
            self._check_capacity(storage, require_int(state, "max_size", where, minimum=1), None)
            # Its files (if any) stay; it is emptied, as TorchRL's empty().
            return storage._empty
        shadow, apply = shadow_of(storage)
        if not initialized:
            if length:
                raise CheckpointCorruptError(f"{where}: an uninitialized storage of length {length}")
            self._check_capacity(storage, require_int(state, "max_size", where, minimum=1), None)
            if isinstance(storage, LazyTensorStorage):
                shadow._layout = shadow._leaves = shadow._flat_leaves = None
                shadow._rest_shape = torch.Size()
            return _committing_length(apply, storage, 0)
        layout, leaves = self.decode_content(storage, state, arrays, context)
        if is_memmap(storage):
            return self._memmap_from_checkpoint(storage, state, layout, leaves, context)
        leaves = [leaf.read() if isinstance(leaf, LiveArray) else leaf for leaf in leaves]
        cap0 = leaves[0].shape[0]
        for spec, leaf in zip(layout.leaves, leaves):
            if leaf.shape != torch.Size([cap0, *spec.shape]) or leaf.dtype != spec.dtype:
                raise CheckpointCorruptError(
                    f"{where}: leaf {spec.key!r} is {list(leaf.shape)} x {leaf.dtype}, expected "
                    f"[{cap0}, *{list(spec.shape)}] x {spec.dtype}"
                )
        rest = leaves[0].shape[1:ndim]
        if len(rest) != ndim - 1:
            raise CheckpointCorruptError(f"{where}: leaves have fewer than ndim={ndim} dims")
        capacity = cap0 * rest.numel()
        if length > capacity:
            raise CheckpointCorruptError(f"{where}: length {length} exceeds the capacity {capacity}")
        self._check_capacity(storage, require_int(state, "max_size", where, minimum=1), (cap0, rest))
        device = self._device(storage, state)
        leaves = [leaf.to(device) for leaf in leaves]
        try:
            shadow._install(layout, leaves)
        except Exception as err:  # the storage's own checks: a layout it does not accept
            raise CheckpointMismatchError(f"the storage refused the checkpoint's layout: {err}") from err
        if storage._auto_device:
            shadow.device = device
        return _committing_length(apply, storage, length)

    def _validated(self, storage: Any, state: dict, layout: Any, leaves: list) -> tuple[int, int]:
        """Checks leaves against the layout and the target's ndim and capacity; returns ``(cap0, len)``."""
        where = "storage state"
        ndim = storage.ndim
        length = require_int(state, "len", where)
        shapes = [leaf.spec.shape if isinstance(leaf, LiveArray) else leaf.shape for leaf in leaves]
        dtypes = [leaf.spec.dtype if isinstance(leaf, LiveArray) else leaf.dtype for leaf in leaves]
        cap0 = shapes[0][0] if len(shapes[0]) else 0
        for spec, shape, dtype in zip(layout.leaves, shapes, dtypes):
            if shape != torch.Size([cap0, *spec.shape]) or dtype != spec.dtype:
                raise CheckpointCorruptError(
                    f"{where}: leaf {spec.key!r} is {list(shape)} x {dtype}, expected [{cap0}, *{list(spec.shape)}] x {spec.dtype}"
                )
        rest = shapes[0][1:ndim]
        if len(rest) != ndim - 1:
            raise CheckpointCorruptError(f"{where}: leaves have fewer than ndim={ndim} dims")
        if length > cap0 * rest.numel():
            raise CheckpointCorruptError(f"{where}: length {length} exceeds the capacity {cap0 * rest.numel()}")
        self._check_capacity(storage, require_int(state, "max_size", where, minimum=1), (cap0, rest))
        return cap0, length

    def _memmap_from_checkpoint(self, storage: Any, state: dict, layout: Any, leaves: list, context: Context) -> Apply:
        """Loads into a ``LazyMemmapStorage``: in place when the checkpoint's live files are the
        storage's own (nothing is copied); into an empty storage by taking the verified copies
        of its files that the load made (:mod:`~gpubuf.checkpoint.staging`); else by writing the
        rows into its files."""
        cap0, length = self._validated(storage, state, layout, leaves)
        if storage.initialized and not _same_layout(storage._layout, layout):
            raise CheckpointMismatchError(
                f"the buffer's memory-mapped storage holds {storage._layout}, the checkpoint {layout}"
            )
        live = [Path(os.path.realpath(leaf.path)) if isinstance(leaf, LiveArray) else None for leaf in leaves]
        if all(p is not None for p in live) and storage.scratch_dir is not None:
            if storage.initialized:
                own = [Path(os.path.realpath(p)) for p in storage.files.values()]
                if own == live:
                    def apply_same() -> None:
                        storage._len = length

                    return apply_same
            else:
                from gpubuf.storages import _memmap_files

                root = Path(os.path.realpath(storage.scratch_dir))
                expected = [root / _memmap_files.leaf_relpath(layout.kind, spec.key) for spec in layout.leaves]
                if expected == live:
                    def apply_attach() -> None:
                        # The files are where this storage keeps its own: map them, copy nothing.
                        storage._attach(layout)
                        storage._len = length

                    return apply_attach
        stage = context.staging
        if stage is not None and "hooked" not in state and not storage.initialized:
            staged = [stage.arrays.get(f"{stage.prefix}leaf_{i}") for i in range(len(leaves))]
            if any(path is not None for path in staged) and not any(isinstance(leaf, LiveArray) for leaf in leaves):
                # The copies are the files the storage would hold: they become its own. Leaves too
                # small for a file of their own in the checkpoint are written into new files.
                sources = [str(path) if path is not None else leaf for path, leaf in zip(staged, leaves)]

                def apply_adopt() -> None:
                    storage._adopt_files(layout, sources, scratch_dir=stage.root())
                    stage.adopted = True
                    storage._len = length

                return apply_adopt
        host = [leaf.read() if isinstance(leaf, LiveArray) else leaf for leaf in leaves]
        batch = torch.Size([cap0, *layout.item_batch]) if layout.kind in ("tensordict", "tensorclass") else None
        content = layout.build(host, batch if batch is not None else torch.Size([cap0]), None)

        def apply_copy() -> None:
            storage.load_state_dict({"_storage": content, "initialized": True, "_len": length})

        return apply_copy

    def decode_content(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> tuple[Any, list]:
        """The checkpoint's layout and its full-capacity leaves (host tensors), validated."""
        if "hooked" in state:
            data = Decoder(lambda name: _array(arrays, name)).decode(state["hooked"], "storage content")
            return self._through_load_hooks(storage, data)
        if self.load_hooks(storage):
            # TorchRL refuses load hooks on pytree checkpoints; here the data written without save
            # hooks goes through the load hooks as the container the storage holds.
            return self._through_load_hooks(storage, self._container(state, arrays))
        layout = decode_layout(require(state, "layout", dict, "storage state"), "storage state.layout")
        return layout, [_array(arrays, f"leaf_{i}") for i in range(len(layout.leaves))]

    def _through_load_hooks(self, storage: Any, data: Any) -> tuple[Any, list]:
        """The layout and host leaves of ``data`` after the storage's load hooks."""
        from gpubuf.storages._layout import Layout

        for hook in self.load_hooks(storage):
            data = call_hook(hook, data, out=None)
        try:
            layout = Layout.from_batch(data, leading=1)
            leaves = layout.split(data, leading=None, device=None)
        except Exception as err:
            raise CheckpointMismatchError(f"the storage content after load hooks is not storable: {err}") from err
        return layout, [leaf.cpu() for leaf in leaves]

    def _container(self, state: dict, arrays: Mapping[str, Any]) -> Any:
        layout = decode_layout(require(state, "layout", dict, "storage state"), "storage state.layout")
        leaves = [_array(arrays, f"leaf_{i}") for i in range(len(layout.leaves))]
        return layout.build(leaves, torch.Size([leaves[0].shape[0], *layout.item_batch]), None)

    @staticmethod
    def _check_capacity(storage: Any, recorded: int, shape: tuple | None) -> None:
        if shape is None:
            if storage.initialized or storage.max_size == recorded:
                return
            raise CheckpointMismatchError(
                f"the checkpoint's storage has max_size={recorded}, the buffer's storage max_size={storage.max_size}"
            )
        cap0, rest = shape
        if storage.initialized:
            ok = storage._capacity_along_dim0 == cap0 and storage._rest_shape == rest
            have = f"{storage._capacity_along_dim0} rows of {list(storage._rest_shape)}"
        else:
            ok = -(-storage.max_size // max(rest.numel(), 1)) == cap0
            have = f"max_size={storage.max_size}"
        if not ok:
            raise CheckpointMismatchError(
                f"the checkpoint's storage holds {cap0} rows of {list(rest)} (max_size={recorded}), the buffer's storage "
                f"has {have}: build the buffer with the same capacity"
            )

    @staticmethod
    def _device(storage: Any, state: dict) -> torch.device:
        if not storage._auto_device:
            device = torch.device(storage.device)
            if device.type == "cuda" and not torch.cuda.is_available():
                raise CheckpointMismatchError(f"the buffer's storage lives on {device}, but CUDA is not available here")
            return device
        recorded = state.get("device")
        return device_here(recorded) if isinstance(recorded, str) else torch.device("cpu")


def _files_below(directory: str) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(directory):
        out.extend(os.path.join(dirpath, name) for name in filenames)
    return out


def _same_layout(a: Any, b: Any) -> bool:
    return a.kind == b.kind and a.leaves == b.leaves and a.item_batch == b.item_batch


register_codec("gpubuf.storages.tensor.TensorStorage", TensorStorageCheckpointer)
register_codec("gpubuf.storages.tensor.LazyTensorStorage", TensorStorageCheckpointer)
# TorchRL writes memory-mapped storages with TensorStorageCheckpointer too; it lists their files
# in place when the dump goes where they live.
register_codec("gpubuf.storages.memmap.LazyMemmapStorage", TensorStorageCheckpointer)


def _tell_hooks_the_ring(storage: Any, hooks: list, context: Context) -> None:
    """Sets ``is_full`` and ``shift`` (one past the last row written) on the save hooks that have
    them (TorchRL's TED hooks), as TorchRL's checkpointers do."""
    buffer = context.buffer
    writer = None if buffer is None else buffer._writer
    if writer is not None and writer._write_count:
        shift = (writer._cursor - 1) % storage._max_size_along_dim0() + 1
    else:
        shift = len(storage)
    for hook in hooks:
        if hasattr(hook, "is_full"):
            hook.is_full = bool(storage._is_full)
        if hasattr(hook, "shift"):
            hook.shift = shift


def _committing_length(apply: Apply, storage: Any, length: int) -> Apply:
    """``apply``, then the storage's length set to ``length``. The length lives in the storage's
    write state, an object a shallow shadow shares with the storage: set on the shadow, it would
    change the storage before the checkpoint is known to load."""

    def commit() -> None:
        apply()
        storage._len = length

    return commit
