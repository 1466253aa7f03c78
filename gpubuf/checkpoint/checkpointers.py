"""Storage checkpointers, with TorchRL's class names: the codecs of storages.

A storage is written by ``storage.checkpointer`` when one is set, else by the checkpointer
registered for its class (:class:`TensorStorageCheckpointer` for tensor storages,
:class:`ListStorageCheckpointer` for list storages). Each can also write or read a storage on its
own with :meth:`StorageCheckpointerBase.dumps` / :meth:`~StorageCheckpointerBase.loads`.

Hooks: save hooks registered on the checkpointer or on the storage
(``storage.register_save_hook``) are called, in that order, on the storage's whole content
before it is written: ``hook(data, path=scratch_dir)`` (``path`` only when the hook takes it;
files it writes there are discarded). Load hooks are called on what was read, before it is
installed: ``hook(data, out=None)``. With hooks, the content is written as a value (see
:mod:`gpubuf.checkpoint.values`), so whatever structure the hooks return is kept.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from gpubuf.checkpoint.arrays import LiveArray
from gpubuf.checkpoint.codecs import (
    Apply,
    Codec,
    Context,
    LiveFile,
    StateDictCodec,
    _array,
    check_kind,
    register_codec,
    shadow_of,
)
from gpubuf.checkpoint.errors import CheckpointCorruptError, CheckpointMismatchError, UnserializableDataError
from gpubuf.checkpoint.format import dtype_name, parse_dtype, parse_shape, require, require_int
from gpubuf.checkpoint.values import Decoder, Encoder, check_resolvable, device_here, resolve_class

__all__ = [
    "StorageCheckpointerBase",
    "TensorStorageCheckpointer",
    "ListStorageCheckpointer",
    "CompressedListStorageCheckpointer",
    "StorageEnsembleCheckpointer",
]


def call_hook(hook: Callable, data: Any, **kwargs: Any) -> Any:
    """Calls ``hook(data, **kwargs)``, passing only the keyword arguments the hook accepts."""
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return hook(data)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hook(data, **kwargs)
    return hook(data, **{k: v for k, v in kwargs.items() if k in params})


class StorageCheckpointerBase(Codec):
    """Public base class of storage checkpointers (TorchRL's ``StorageCheckpointerBase``).

    Subclasses implement :meth:`to_checkpoint` and :meth:`from_checkpoint` (see
    :mod:`gpubuf.checkpoint.codecs`); :meth:`dumps` and :meth:`loads` then come for free.
    """

    def __init__(self) -> None:
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []

    def register_save_hook(self, hook: Callable) -> None:
        """Adds a hook applied to the storage's content before it is written."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable) -> None:
        """Adds a hook applied to the content read, before it is installed in the storage."""
        self._load_hooks.append(hook)

    def save_hooks(self, storage: Any) -> list[Callable]:
        return list(self._save_hooks) + list(getattr(storage, "_save_hooks", []))

    def load_hooks(self, storage: Any) -> list[Callable]:
        return list(self._load_hooks) + list(getattr(storage, "_load_hooks", []))

    def dumps(self, storage: Any, path: Any) -> None:
        """Writes ``storage`` alone to the checkpoint directory ``path`` (crash-safe, no pickle)."""
        from gpubuf.checkpoint.buffer import dump_storage

        dump_storage(storage, path, checkpointer=self)

    def loads(self, storage: Any, path: Any) -> None:
        """Restores ``storage`` from a directory written by :meth:`dumps`; validated first.

        Raises:
            CheckpointError: see :func:`gpubuf.checkpoint.load_buffer`; ``storage`` is unchanged.
        """
        from gpubuf.checkpoint.buffer import load_storage

        load_storage(storage, path, checkpointer=self)


# ---------------------------------------------------------------------- layouts
def encode_layout(layout: Any) -> dict:
    """The JSON form of a storage :class:`~gpubuf.storages._layout.Layout`."""
    out: dict[str, Any] = {
        "kind": layout.kind,
        "item_batch": list(layout.item_batch),
        "leaves": [{"key": list(s.key), "dtype": dtype_name(s.dtype), "shape": list(s.shape)} for s in layout.leaves],
    }
    if layout.kind == "tensorclass":
        out["container"] = check_resolvable(layout.container_cls, "tensorclass")
    if layout.kind == "pytree":
        import torch.utils._pytree as pytree

        # The tree with its leaves numbered: plain tuples, lists and dicts, which JSON holds;
        # other pytree node types cannot be written without pickle and are refused here.
        skeleton = pytree.tree_unflatten(list(range(len(layout.leaves))), layout.treespec)
        out["tree"] = Encoder(_no_arrays).encode(skeleton, "pytree structure")
    return out


def _no_arrays(tensor: torch.Tensor) -> str:
    raise UnserializableDataError("a pytree structure holds no tensor")


def decode_layout(state: Any, where: str) -> Any:
    """Rebuilds a :class:`~gpubuf.storages._layout.Layout` from :func:`encode_layout`'s output."""
    from tensordict import TensorDict, is_tensorclass

    from gpubuf.storages._layout import Layout, LeafSpec

    kind = require(state, "kind", str, where)
    if kind not in ("tensor", "tensordict", "tensorclass", "pytree"):
        raise CheckpointCorruptError(f"{where}: unknown layout kind {kind!r}")
    item_batch = parse_shape(require(state, "item_batch", list, where), f"{where}.item_batch")
    specs = []
    for i, leaf in enumerate(require(state, "leaves", list, where)):
        w = f"{where}.leaves[{i}]"
        key = require(leaf, "key", list, w)
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in key):
            raise CheckpointCorruptError(f"{w}: a key is a list of strings or ints")
        specs.append(LeafSpec(tuple(key), parse_dtype(require(leaf, "dtype", str, w), w),
                              parse_shape(require(leaf, "shape", list, w), w)))
    if not specs:
        raise CheckpointCorruptError(f"{where}: a layout has at least one leaf")
    container, treespec = None, None
    if kind == "tensordict":
        container = TensorDict
    elif kind == "tensorclass":
        container = resolve_class(require(state, "container", str, where), is_tensorclass, "the tensorclass")
    elif kind == "pytree":
        import torch.utils._pytree as pytree

        skeleton = Decoder(lambda name: _array({}, name)).decode(state.get("tree"), f"{where}.tree")
        numbers, treespec = pytree.tree_flatten(skeleton)
        if numbers != list(range(len(specs))):
            raise CheckpointCorruptError(f"{where}: the pytree structure does not number its {len(specs)} leaves in order")
    return Layout(kind, specs, item_batch, container, treespec)


# ---------------------------------------------------------------------- tensor storages
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
        for hook in hooks:
            data = call_hook(hook, data, path=context.scratch)
        arrays: dict[str, torch.Tensor] = {}

        def add(tensor: torch.Tensor) -> str:
            name = f"h{len(arrays)}"
            arrays[name] = tensor
            return name

        state["hooked"] = Encoder(add).encode(data, "storage content (after save hooks)")
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
            shadow._len = 0
            return apply
        layout, leaves = self.decode_content(storage, state, arrays, context)
        if is_memmap(storage):
            return self._memmap_from_checkpoint(storage, state, layout, leaves)
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
        shadow._len = length
        if storage._auto_device:
            shadow.device = device
        return apply

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

    def _memmap_from_checkpoint(self, storage: Any, state: dict, layout: Any, leaves: list) -> Apply:
        """Loads into a ``LazyMemmapStorage``: in place when the checkpoint's live files are the
        storage's own (nothing is copied), else by writing the rows into its files."""
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
        host = [leaf.read() if isinstance(leaf, LiveArray) else leaf for leaf in leaves]
        batch = torch.Size([cap0, *layout.item_batch]) if layout.kind in ("tensordict", "tensorclass") else None
        content = layout.build(host, batch if batch is not None else torch.Size([cap0]), None)

        def apply_copy() -> None:
            storage.load_state_dict({"_storage": content, "initialized": True, "_len": length})

        return apply_copy

    def decode_content(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> tuple[Any, list]:
        """The checkpoint's layout and its full-capacity leaves (host tensors), validated."""
        from gpubuf.storages._layout import Layout

        if "hooked" in state:
            data = Decoder(lambda name: _array(arrays, name)).decode(state["hooked"], "storage content")
            for hook in self.load_hooks(storage):
                data = call_hook(hook, data, out=None)
            try:
                layout = Layout.from_batch(data, leading=1)
                leaves = layout.split(data, leading=None, device=None)
            except Exception as err:
                raise CheckpointMismatchError(f"the storage content after load hooks is not storable: {err}") from err
            return layout, [leaf.cpu() for leaf in leaves]
        if self.load_hooks(storage):
            # TorchRL refuses load hooks on pytree checkpoints; here the data written without save
            # hooks goes through the load hooks as the container the storage holds.
            data = self._container(state, arrays)
            for hook in self.load_hooks(storage):
                data = call_hook(hook, data, out=None)
            try:
                layout = Layout.from_batch(data, leading=1)
                leaves = layout.split(data, leading=None, device=None)
            except Exception as err:
                raise CheckpointMismatchError(f"the storage content after load hooks is not storable: {err}") from err
            return layout, [leaf.cpu() for leaf in leaves]
        layout = decode_layout(require(state, "layout", dict, "storage state"), "storage state.layout")
        return layout, [_array(arrays, f"leaf_{i}") for i in range(len(layout.leaves))]

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


def is_memmap(storage: Any) -> bool:
    """A memory-mapped storage (``LazyMemmapStorage``): its leaves are files in ``scratch_dir``."""
    try:
        from gpubuf.storages.memmap import LazyMemmapStorage
    except ImportError:
        return False
    return isinstance(storage, LazyMemmapStorage)


def _files_below(directory: str) -> list[str]:
    out = []
    for dirpath, _, filenames in os.walk(directory):
        out.extend(os.path.join(dirpath, name) for name in filenames)
    return out


def _same_layout(a: Any, b: Any) -> bool:
    return a.kind == b.kind and a.leaves == b.leaves and a.item_batch == b.item_batch


# ---------------------------------------------------------------------- list storages
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
        arrays: dict[str, torch.Tensor] = {}

        def add(tensor: torch.Tensor) -> str:
            name = f"t{len(arrays)}"
            arrays[name] = tensor
            return name

        encoder = Encoder(add)
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
        if storage.device is not None:
            items = [storage._to_device(item) for item in items]
        shadow, apply = shadow_of(storage)
        shadow._storage = items
        return apply


class CompressedListStorageCheckpointer(StorageCheckpointerBase):
    """Writes a ``CompressedListStorage`` from its ``state_dict()`` (compressed byte tensors and
    their metadata), through :mod:`gpubuf.checkpoint.values`: no pickle, unlike ``torch.save``."""

    name = "compressed_list_storage"

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        state, arrays = StateDictCodec().to_checkpoint(storage, context)
        return state, arrays

    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        return StateDictCodec().from_checkpoint(storage, state, arrays, context)


class StorageEnsembleCheckpointer(StorageCheckpointerBase):
    """Writes a ``StorageEnsemble``: each member through its own checkpointer, under ``m<i>/``.

    Transforms of the ensemble with a ``state_dict`` are written as values (TorchRL uses
    ``torch.save`` for them; here they carry no pickle either).
    """

    name = "storage_ensemble"

    @staticmethod
    def _members(storage: Any) -> list:
        members = getattr(storage, "_storages", None)
        if members is None:
            raise CheckpointMismatchError(f"{type(storage).__name__} is not a storage ensemble")
        return list(members)

    def to_checkpoint(self, storage: Any, context: Context) -> tuple[dict, dict]:
        members_state, arrays = [], {}
        for i, member in enumerate(self._members(storage)):
            codec = storage_codec(member)
            state, member_arrays = codec.to_checkpoint(member, context)
            members_state.append({"codec": codec.name, "codec_version": codec.version, "class": type(member).__qualname__,
                                  "state": state})
            arrays.update({f"m{i}/{name}": value for name, value in member_arrays.items()})
        transforms = []
        tarrays: dict[str, torch.Tensor] = {}

        def add(tensor: torch.Tensor) -> str:
            name = f"x{len(tarrays)}"
            tarrays[name] = tensor
            return name

        for i, transform in enumerate(getattr(storage, "_transforms", None) or []):
            sd = getattr(transform, "state_dict", None)
            transforms.append(None if transform is None or not callable(sd) else Encoder(add).encode(sd(), f"transform {i}"))
        arrays.update({f"transforms/{k}": v for k, v in tarrays.items()})
        return {"members": members_state, "transforms": transforms}, arrays

    def from_checkpoint(self, storage: Any, state: dict, arrays: Mapping[str, Any], context: Context) -> Apply:
        members = self._members(storage)
        recorded = require(state, "members", list, "storage state")
        if len(recorded) != len(members):
            raise CheckpointMismatchError(f"the checkpoint's ensemble has {len(recorded)} storages, the buffer's {len(members)}")
        applies = []
        for i, (member, entry) in enumerate(zip(members, recorded)):
            codec = storage_codec(member)
            name = require(entry, "codec", str, f"members[{i}]")
            if not codec.can_load(name):
                raise CheckpointMismatchError(f"ensemble member {i}: the checkpoint holds a {name!r}, the buffer a {codec.name!r}")
            prefix = f"m{i}/"
            local = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
            applies.append(codec.from_checkpoint(member, require(entry, "state", dict, f"members[{i}]"), local, context))
        transforms = getattr(storage, "_transforms", None) or []
        decoder = Decoder(lambda name: _array(arrays, f"transforms/{name}"))
        for i, (transform, value) in enumerate(zip(transforms, state.get("transforms") or [])):
            if transform is not None and value is not None and callable(getattr(transform, "load_state_dict", None)):
                decoded = decoder.decode(value, f"transform {i}")
                applies.append(lambda t=transform, v=decoded: t.load_state_dict(v))

        def apply() -> None:
            for fn in applies:
                fn()

        return apply


def storage_codec(storage: Any) -> Codec:
    """The checkpointer of ``storage``: ``storage.checkpointer`` when set, else the registered one.

    Raises:
        CheckpointMismatchError: ``storage.checkpointer`` is set to something that is not a gpubuf
            checkpointer (e.g. one of TorchRL's, which writes pickles).
    """
    from gpubuf.checkpoint.codecs import codec_for

    checkpointer = getattr(storage, "checkpointer", None)
    if checkpointer is None:
        return codec_for(storage)
    if not isinstance(checkpointer, StorageCheckpointerBase):
        raise CheckpointMismatchError(
            f"storage.checkpointer is a {type(checkpointer).__module__}.{type(checkpointer).__qualname__}; gpubuf "
            "storages take gpubuf.checkpoint checkpointers"
        )
    return checkpointer


register_codec("gpubuf.storages.tensor.TensorStorage", TensorStorageCheckpointer)
register_codec("gpubuf.storages.tensor.LazyTensorStorage", TensorStorageCheckpointer)
register_codec("gpubuf.storages.list.ListStorage", ListStorageCheckpointer)
# TorchRL writes memory-mapped storages with TensorStorageCheckpointer too; it lists their files
# in place when the dump goes where they live.
register_codec("gpubuf.storages.memmap.LazyMemmapStorage", TensorStorageCheckpointer)
