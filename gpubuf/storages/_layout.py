"""How a storage sees its data: an ordered list of tensor leaves plus the container that holds them.

A :class:`Layout` is fixed by the first item a storage receives. Afterwards every batch is
*split* into its leaves through the layout, which checks keys, trailing shapes, dtypes and
devices before anything is written, and every read *builds* the container back around gathered
leaves. Keeping the leaves as a flat list is what lets one kernel launch gather every field.

Supported containers: a plain ``torch.Tensor``, a ``TensorDict`` (nested keys), a
``@tensorclass`` instance, and a pytree (tuple, list or dict) of tensors.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict, TensorDictBase, is_tensorclass
from tensordict.base import _is_leaf_nontensor

from gpubuf.errors import (
    DeviceMismatchError,
    DTypeMismatchError,
    SchemaMismatchError,
    UnsupportedDataError,
)

NestedKey = tuple  # a tuple of str: ("next", "obs")


def class_path(cls: type) -> str:
    """``"module:QualName"``, the reference under which descriptions and checkpoints record a class."""
    return f"{cls.__module__}:{cls.__qualname__}"


def imported_class(path: str) -> Any:
    """What ``"module:QualName"`` names in a module already imported, or None.

    Importing a module named by a stored description could execute its code, so it is never
    done: the caller says which module to import first.
    """
    module_name, _, qualname = path.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def tensorclass_from_path(path: str) -> type:
    """The tensorclass type a storage description records as ``"module:QualName"``.

    Raises:
        LookupError: the module is not imported here (it is never imported on a description's
            word), or the name is not a tensorclass type.
    """
    obj = imported_class(path)
    if not (isinstance(obj, type) and is_tensorclass(obj)):
        module_name, _, qualname = path.partition(":")
        raise LookupError(
            f"{qualname!r} of module {module_name!r} is not a tensorclass type imported here: import {module_name} "
            "first (a stored description never imports code)"
        )
    return obj


def is_tensor_collection(data: Any) -> bool:
    """True for TensorDicts and tensorclass instances."""
    return isinstance(data, TensorDictBase) or is_tensorclass(data)


def expand_as_batch(value: torch.Tensor, batch_size: torch.Size) -> torch.Tensor:
    """``value`` (one entry per item, led by the batch's first dims) broadcast to ``batch_size``."""
    if value.ndim < len(batch_size):
        value = value.reshape(value.shape + (1,) * (len(batch_size) - value.ndim)).expand(batch_size)
    return value


@dataclass(frozen=True)
class LeafSpec:
    """One leaf of a layout.

    Attributes:
        key: the leaf's nested key, ``()`` for a plain tensor, an int path for pytrees.
        dtype: its dtype.
        shape: its per-item shape (everything after the storage's leading dimension).
    """

    key: tuple
    dtype: torch.dtype
    shape: torch.Size

    @property
    def row_bytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def _fmt_key(key: tuple) -> str:
    if not key:
        return "<tensor>"
    if len(key) == 1:
        return repr(key[0])
    return repr(key)


class Layout:
    """The structure of the items a storage holds.

    Args:
        kind: ``"tensor"``, ``"tensordict"``, ``"tensorclass"`` or ``"pytree"``.
        leaves: one :class:`LeafSpec` per tensor leaf, in a fixed order.
        item_batch: for tensor collections, the batch size of one item (``torch.Size([])``
            for a TensorDict of rows; ``[T]`` when each item is a trajectory). Empty otherwise.
        container_cls: the TensorDict or tensorclass type, for rebuilding.
        treespec: the pytree spec, for pytrees.
    """

    def __init__(
        self,
        kind: str,
        leaves: Sequence[LeafSpec],
        item_batch: torch.Size = torch.Size(),
        container_cls: type | None = None,
        treespec: Any = None,
    ) -> None:
        self.kind = kind
        self.leaves = tuple(leaves)
        self.item_batch = torch.Size(item_batch)
        self.container_cls = container_cls
        self.treespec = treespec
        self.keys = tuple(leaf.key for leaf in self.leaves)
        self._key_set = frozenset(self.keys)
        self._position = {key: i for i, key in enumerate(self.keys)}
        # For rebuilding TensorDicts fast: each leaf's path split into parent keys and its name.
        self._paths = [(key[:-1], key[-1]) for key in self.keys] if kind in ("tensordict", "tensorclass") else []
        # Without nested keys a TensorDict is rebuilt from one dict(zip(...)): the common case, on
        # the sample path of every call.
        self._flat_names = (
            [name for _, name in self._paths] if self._paths and all(not parents for parents, _ in self._paths) else None
        )
        # ``((leading dims, item offset), the leaves' expected shapes)`` of the last write checked:
        # making the sizes anew was half of the check. One entry: batch sizes may vary without end.
        self._shapes: tuple = ((), ())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_batch(cls, data: Any, leading: int = 1) -> "Layout":
        """Infers the layout of the items of ``data``, dropping its first ``leading`` dims.

        Raises:
            UnsupportedDataError: when ``data`` holds something that is not a tensor.
        """
        kind, keys, tensors, item_batch, container_cls, treespec = _decompose(data)
        if item_batch is not None:
            if len(item_batch) < leading:
                raise SchemaMismatchError(
                    f"expected a batch with at least {leading} batch dimension(s), got batch_size={list(item_batch)}"
                )
            item_batch = item_batch[leading:]
        specs = []
        for key, tensor in zip(keys, tensors):
            if tensor.ndim < leading:
                raise SchemaMismatchError(
                    f"leaf {_fmt_key(key)} has shape {list(tensor.shape)}, expected at least {leading} leading "
                    "batch dimension(s)"
                )
            specs.append(LeafSpec(key, tensor.dtype, tensor.shape[leading:]))
        return cls(kind, specs, item_batch or torch.Size(), container_cls, treespec)

    # ------------------------------------------------------------------ validation
    def split(
        self, data: Any, leading: Sequence[int] | None, device: torch.device | None, item_offset: int = 0
    ) -> list[torch.Tensor]:
        """Checks ``data`` against this layout and returns its leaves in layout order.

        Args:
            data: a batch (or an item) of the same structure as the first one.
            leading: the expected leading (batch) dimensions that precede each leaf's item shape,
                ``[n]`` for a batch of n items and ``[]`` for a single item; ``None`` accepts
                any single leading dimension and takes its size from the data.
            device: when not None, leaves must be on this device (checked, never moved here).
            item_offset: how many leading item dims the ``leading`` dims stand for (writes of single
                elements into an ``ndim > 1`` storage address the first dims of an item).

        Returns:
            The leaves, each of shape ``[*leading, *spec.shape]``, in layout order. They are the
            caller's tensors, not copies.

        Raises:
            SchemaMismatchError: a key is missing or extra, or a shape differs.
            DTypeMismatchError: a leaf's dtype differs.
            DeviceMismatchError: a leaf is not on ``device``.
            UnsupportedDataError: the container kind differs or holds non-tensors.
        """
        kind, keys, tensors, item_batch, container_cls, _ = _decompose(data)
        if _kind_family(kind) != _kind_family(self.kind):
            raise UnsupportedDataError(
                f"this storage holds {self.describe_kind()}, got {type(data).__name__}"
            )
        if kind == "tensorclass" and container_cls is not self.container_cls:
            raise UnsupportedDataError(
                f"this storage holds {self.container_cls.__name__} instances, got {type(data).__name__}"
            )
        if keys != self.keys:
            key_set = set(keys)
            if key_set != self._key_set:
                missing = [k for k in self.keys if k not in key_set]
                extra = [k for k in keys if k not in self._key_set]
                parts = []
                if missing:
                    parts.append("missing key(s) " + ", ".join(_fmt_key(k) for k in missing))
                if extra:
                    parts.append("unexpected key(s) " + ", ".join(_fmt_key(k) for k in extra))
                raise SchemaMismatchError(
                    "; ".join(parts) + "; expected exactly the keys " + ", ".join(_fmt_key(k) for k in self.keys)
                )
            by_key = dict(zip(keys, tensors))
            tensors = [by_key[k] for k in self.keys]
        if leading is None:
            lead = tensors[0].shape[:1] if tensors and tensors[0].ndim else torch.Size()
        else:
            lead = torch.Size(leading)
        if item_batch is not None:
            expected_batch = torch.Size([*lead, *self.item_batch[item_offset:]])
            if item_batch != expected_batch:
                raise SchemaMismatchError(
                    f"batch_size {list(item_batch)} does not match the storage's items: expected "
                    f"{list(expected_batch)} (leading {list(lead)} + item batch size {list(self.item_batch)})"
                )
        key, shapes = self._shapes
        if key != (lead, item_offset):
            shapes = tuple(torch.Size([*lead, *spec.shape[item_offset:]]) for spec in self.leaves)
            self._shapes = ((lead, item_offset), shapes)
        for spec, tensor, expected in zip(self.leaves, tensors, shapes):
            if tensor.shape != expected:
                raise SchemaMismatchError(
                    f"leaf {_fmt_key(spec.key)} has shape {list(tensor.shape)}, expected {list(expected)} "
                    f"(leading {list(lead)} + item shape {list(spec.shape[item_offset:])})"
                )
            if tensor.dtype != spec.dtype:
                raise DTypeMismatchError(
                    f"leaf {_fmt_key(spec.key)} has dtype {tensor.dtype}, expected {spec.dtype} as in the "
                    "storage's first batch"
                )
            if device is not None and tensor.device != device:
                raise DeviceMismatchError(
                    f"leaf {_fmt_key(spec.key)} is on {tensor.device}, expected {device}: this storage's "
                    "device was fixed by its first batch; move the batch with .to() first"
                )
        return list(tensors)

    def describe_kind(self) -> str:
        if self.kind == "tensor":
            return "tensors"
        if self.kind == "tensorclass":
            return f"{self.container_cls.__name__} instances"
        if self.kind == "tensordict":
            return "TensorDicts"
        return "pytrees of tensors"

    # ------------------------------------------------------------------ rebuilding
    def build(
        self,
        leaves: Sequence[torch.Tensor],
        batch_size: torch.Size,
        device: torch.device | None,
    ) -> Any:
        """Wraps gathered leaves (in layout order) back into the container kind.

        Args:
            leaves: tensors of shape ``[*batch_size_prefix, *spec.shape]``.
            batch_size: the batch size of the returned collection (ignored for tensors/pytrees).
            device: the device recorded on a returned TensorDict.
        """
        if self.kind == "tensor":
            return leaves[0]
        if self.kind == "pytree":
            return pytree.tree_unflatten(list(leaves), self.treespec)
        if self._flat_names is not None:
            source = dict(zip(self._flat_names, leaves))
        else:
            source = self._nest(leaves)
        td = TensorDict._new_unsafe(source=source, batch_size=batch_size, device=device)
        if self.kind == "tensorclass":
            return self.container_cls._from_tensordict(td)
        return td

    def _nest(self, leaves: Sequence[torch.Tensor]) -> dict:
        source: dict = {}
        for (parents, name), tensor in zip(self._paths, leaves):
            node = source
            for parent in parents:
                node = node.setdefault(parent, {})
            node[name] = tensor
        return source

    def index_of(self, key: tuple) -> int | None:
        return self._position.get(key)

    def __repr__(self) -> str:
        fields = ", ".join(f"{_fmt_key(s.key)}: {str(s.dtype).replace('torch.', '')}{list(s.shape)}" for s in self.leaves)
        return f"Layout({self.kind}, item_batch={list(self.item_batch)}, {{{fields}}})"


def _kind_family(kind: str) -> str:
    # A TensorDict batch may be written into a storage first filled from a TensorDict of another
    # subclass (e.g. a LazyStackedTensorDict); both are "tensordict".
    return kind


def _decompose(data: Any):
    """Returns ``(kind, keys, tensors, batch_size_or_None, container_cls, treespec)``."""
    if isinstance(data, torch.Tensor):
        return "tensor", ((),), [data], None, None, None
    if is_tensorclass(data):
        td = data._tensordict
        keys, tensors = _td_leaves(td, type(data).__name__)
        non_tensor = {k: v for k, v in getattr(data, "_non_tensordict", {}).items() if v is not None}
        if non_tensor:
            raise UnsupportedDataError(
                f"{type(data).__name__} has non-tensor field(s) {sorted(non_tensor)}: a tensor storage holds "
                "tensors only; use ListStorage for arbitrary objects"
            )
        return "tensorclass", keys, tensors, td.batch_size, type(data), None
    if isinstance(data, TensorDictBase):
        keys, tensors = _td_leaves(data, "TensorDict")
        return "tensordict", keys, tensors, data.batch_size, TensorDict, None
    if isinstance(data, (tuple, list, dict)):
        leaves, spec = pytree.tree_flatten(data)
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise UnsupportedDataError(
                    f"pytree leaf #{i} is a {type(leaf).__name__}, expected a torch.Tensor: a tensor storage holds "
                    "tensors only; use ListStorage for arbitrary objects"
                )
        if not leaves:
            raise UnsupportedDataError("an empty container has no tensor to store")
        keys = tuple((i,) for i in range(len(leaves)))
        return "pytree", keys, leaves, None, None, spec
    raise UnsupportedDataError(
        f"a tensor storage holds tensors, TensorDicts, tensorclasses or pytrees of tensors; got "
        f"{type(data).__name__}. Use ListStorage for arbitrary Python objects"
    )


def _td_leaves(td: TensorDictBase, what: str) -> tuple[tuple, list]:
    keys = []
    tensors = []
    # is_leaf makes non-tensor entries (NonTensorData) visible, so that they are refused rather
    # than silently dropped.
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        if not isinstance(value, torch.Tensor) or is_tensor_collection(value):
            raise UnsupportedDataError(
                f"{what} entry {key!r} is a {type(value).__name__}, expected a torch.Tensor: a tensor storage "
                "holds tensors only; use ListStorage or LazyStackStorage for non-tensor data"
            )
        keys.append(key if isinstance(key, tuple) else (key,))
        tensors.append(value)
    if not keys:
        raise UnsupportedDataError(f"the {what} has no tensor leaf to store")
    return tuple(keys), tensors
