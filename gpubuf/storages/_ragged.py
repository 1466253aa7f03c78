"""The structure of variable-length items: which leaves are ragged tensors, which are Python objects.

A :class:`RaggedSchema` is fixed by the first item a packed storage receives. It turns every
later write into *columns* (per tensor leaf: the rows' tokens end to end plus the rows' lengths;
per non-tensor leaf: a list of objects), checking keys, dtypes and trailing shapes before
anything is written, and builds sampled columns back into the container the items came in.

An item is a ``torch.Tensor``, a ``TensorDict`` or a ``@tensorclass`` instance with an empty batch
size. Each of its tensor leaves is ragged along its first dim (the token dim); a 0-d leaf is a
row of one token. Non-tensor leaves (strings, any object in a ``NonTensorData``) are carried
through as objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, TensorDictBase, is_tensorclass
from tensordict.base import _is_leaf_nontensor
from tensordict.utils import is_non_tensor

from gpubuf.errors import DTypeMismatchError, SchemaMismatchError, UnsupportedDataError
from gpubuf.storages._layout import Layout, class_path, tensorclass_from_path
from gpubuf.storages._layout import _fmt_key as _fmt

try:  # the direct constructor of jagged tensors, see jagged()
    from torch.nested._internal.nested_tensor import NestedTensor as _NestedTensor
    from torch.nested._internal.nested_tensor import _store_val_in_tensor
except ImportError:  # pragma: no cover - depends on the torch version
    _NestedTensor = None

__all__ = ["RaggedLeaf", "RaggedSchema", "Columns", "item_count", "jagged", "jagged_many"]


@dataclass(frozen=True)
class RaggedLeaf:
    """One tensor leaf of a ragged item.

    Attributes:
        key: its nested key; ``()`` for a plain tensor item.
        dtype: its dtype.
        trail: its shape after the first (ragged) dim.
        scalar: True when the leaf is 0-d in an item: stored as one token, read back as ``[B]``.
    """

    key: tuple
    dtype: torch.dtype
    trail: torch.Size
    scalar: bool


@dataclass
class Columns:
    """A batch of ``n`` items in columns.

    Attributes:
        n: number of items.
        tensors: per schema leaf, ``(values [sum(lengths), *trail], lengths int64 [n])``.
        objects: per schema object key, a list of ``n`` Python objects.
    """

    n: int
    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    objects: list[list]


def _kind(data: Any) -> tuple[str, type | None]:
    if isinstance(data, torch.Tensor):
        return "tensor", None
    if is_tensorclass(data):
        return "tensorclass", type(data)
    if isinstance(data, TensorDictBase):
        return "tensordict", None
    raise UnsupportedDataError(
        f"a packed storage holds tensors, TensorDicts or tensorclasses, got {type(data).__name__}; "
        "use ListStorage for arbitrary Python objects"
    )


def _collection_td(data: Any) -> TensorDictBase:
    """The TensorDict behind a collection; a tensorclass with non-tensor fields kept aside is refused."""
    if not is_tensorclass(data):
        return data
    extra = {k: v for k, v in getattr(data, "_non_tensordict", {}).items() if v is not None}
    if extra:
        raise UnsupportedDataError(
            f"{type(data).__name__} keeps field(s) {sorted(extra)} outside its TensorDict; a packed storage "
            "stores tensor and NonTensorData fields only"
        )
    return data._tensordict


def _entries(td: TensorDictBase) -> tuple[dict, dict]:
    """``({key: tensor}, {key: non-tensor leaf})`` of a TensorDict, nested keys as tuples."""
    tensors: dict = {}
    objects: dict = {}
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        key = key if isinstance(key, tuple) else (key,)
        if is_non_tensor(value):
            objects[key] = value
        else:
            tensors[key] = value
    return tensors, objects


def item_count(data: Any) -> int:
    """The number of items in a batch: a list's length or the first batch dim."""
    if isinstance(data, (list, tuple)):
        return len(data)
    if not isinstance(data, (torch.Tensor, TensorDictBase)) and not is_tensorclass(data):
        raise UnsupportedDataError(
            f"a packed storage holds TensorDicts, tensorclasses or tensors, got {type(data).__name__}: expected a batch "
            "of them (a leading dim, or a list of items)"
        )
    shape = data.shape if isinstance(data, torch.Tensor) else data.batch_size
    if len(shape) == 0:
        raise SchemaMismatchError("expected a batch with a leading dimension, got a single item; use add() for one item")
    return int(shape[0])


class RaggedSchema:
    """The keys, dtypes and trailing shapes shared by every item of a packed storage.

    Args:
        kind: ``"tensor"``, ``"tensordict"`` or ``"tensorclass"``.
        leaves: the tensor leaves, in storage order.
        object_keys: the keys of non-tensor leaves.
        container_cls: the tensorclass type, for ``kind == "tensorclass"``.
    """

    def __init__(self, kind: str, leaves: Sequence[RaggedLeaf], object_keys: Sequence[tuple], container_cls: type | None):
        self.kind = kind
        self.leaves = tuple(leaves)
        self.object_keys = tuple(object_keys)
        self.container_cls = container_cls
        self._tensor_keys = frozenset(leaf.key for leaf in self.leaves)
        self._object_keys = frozenset(self.object_keys)

    # ------------------------------------------------------------------ construction
    @classmethod
    def infer(cls, data: Any, batched: bool) -> "RaggedSchema":
        """The schema of the items of ``data`` (a batch when ``batched``, else one item)."""
        if batched and isinstance(data, (list, tuple)):
            if not data:
                raise SchemaMismatchError("cannot write an empty list")
            return cls.infer(data[0], batched=False)
        if batched and _lazy_items(data) is not None:
            items = _lazy_items(data)
            if not items:
                raise SchemaMismatchError("cannot write an empty batch")
            return cls.infer(items[0], batched=False)
        kind, container_cls = _kind(data)
        lead = 1 if batched else 0
        if kind == "tensor":
            if data.ndim < lead:
                raise SchemaMismatchError("expected a batch with a leading dimension, got a 0-d tensor")
            shape = _item_shape(data, lead)
            return cls(kind, [RaggedLeaf((), data.dtype, torch.Size(shape[1:]), len(shape) == 0)], [], None)
        td = _collection_td(data)
        _check_batch(td, lead, type(data).__name__)
        tensors, objects = _entries(td)
        leaves = []
        for key, tensor in tensors.items():
            shape = _item_shape(tensor, lead)
            leaves.append(RaggedLeaf(key, tensor.dtype, torch.Size(shape[1:]), len(shape) == 0))
        if not leaves and not objects:
            raise UnsupportedDataError(f"the {type(data).__name__} has no entry to store")
        return cls(kind, leaves, list(objects), container_cls)

    # ------------------------------------------------------------------ writing
    def columns(self, data: Any, batched: bool) -> Columns:
        """Checks ``data`` against the schema and returns it as columns; reads, never mutates, ``data``.

        Args:
            data: a batch (list or tuple of items; tensor, TensorDict or tensorclass with a
                leading batch dim, dense or nested along its second dim) when ``batched``, else
                one item.

        Raises:
            UnsupportedDataError: another container kind or tensorclass type, a batch size
                that is not ``[n]`` (items must have an empty batch size), a non-tensor value.
            SchemaMismatchError: a missing or extra key, a tensor where an object was stored (or
                the reverse), a wrong number of dims or trailing shape.
            DTypeMismatchError: a leaf of another dtype.
        """
        if not batched:
            return self._from_items([data])
        if isinstance(data, (list, tuple)):
            if not data:
                raise SchemaMismatchError("cannot write an empty list")
            return self._from_items(list(data))
        items = _lazy_items(data)
        if items is not None:
            return self._from_items(items)
        return self._from_batch(data)

    def _from_items(self, items: list) -> Columns:
        per_leaf: list[list[torch.Tensor]] = [[] for _ in self.leaves]
        per_object: list[list] = [[] for _ in self.object_keys]
        for i, item in enumerate(items):
            tensors, objects = self._split(item, lead=0, where=f"item #{i}")
            for j, leaf in enumerate(self.leaves):
                t = tensors[leaf.key]
                per_leaf[j].append(t.reshape(1) if leaf.scalar else t)
            for j, key in enumerate(self.object_keys):
                per_object[j].append(_object_value(objects[key]))
        cols = []
        for rows in per_leaf:
            lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.int64)
            values = rows[0] if len(rows) == 1 else torch.cat(rows)
            cols.append((values, lengths))
        return Columns(len(items), cols, per_object)

    def _from_batch(self, data: Any) -> Columns:
        tensors, objects = self._split(data, lead=1, where="the batch")
        n = item_count(data)
        cols = []
        for leaf in self.leaves:
            t = tensors[leaf.key]
            if t.is_nested:
                # A jagged [n, j, *trail] leaf already is values + offsets.
                values = t.values()
                lengths = t.offsets().diff().to(torch.int64)
            elif leaf.scalar:
                values, lengths = t.reshape(n), torch.ones(n, dtype=torch.int64)
            else:
                length = t.shape[1]
                values = t.reshape(n * length, *leaf.trail)
                lengths = torch.full((n,), length, dtype=torch.int64)
            cols.append((values, lengths))
        obj_cols = [_object_list(objects[key], n) for key in self.object_keys]
        return Columns(n, cols, obj_cols)

    def _split(self, data: Any, lead: int, where: str) -> tuple[dict, dict]:
        kind, container_cls = _kind(data)
        if kind != self.kind or container_cls is not self.container_cls:
            raise UnsupportedDataError(f"this storage holds {self.describe_kind()}, got {type(data).__name__} ({where})")
        if kind == "tensor":
            tensors, objects = {(): data}, {}
            if data.ndim < lead:
                raise SchemaMismatchError(f"{where} is a 0-d tensor; expected a leading batch dimension")
        else:
            td = _collection_td(data)
            _check_batch(td, lead, type(data).__name__)
            tensors, objects = _entries(td)
        if tensors.keys() != self._tensor_keys or objects.keys() != self._object_keys:
            self._raise_keys(tensors, objects, where)
        for leaf in self.leaves:
            t = tensors[leaf.key]
            shape = _item_shape(t, lead)
            if (len(shape) == 0) != leaf.scalar or (not leaf.scalar and torch.Size(shape[1:]) != leaf.trail):
                expected = "[]" if leaf.scalar else f"[L, {', '.join(map(str, leaf.trail))}]".replace(", ]", "]")
                raise SchemaMismatchError(
                    f"leaf {_fmt(leaf.key)} of {where} has item shape {list(shape)}, expected {expected}: items may "
                    "differ in the length of their first dim only"
                )
            if t.dtype != leaf.dtype:
                raise DTypeMismatchError(
                    f"leaf {_fmt(leaf.key)} of {where} has dtype {t.dtype}, expected {leaf.dtype} as in the first item"
                )
        return tensors, objects

    def _raise_keys(self, tensors: dict, objects: dict, where: str) -> None:
        known = self._tensor_keys | self._object_keys
        given = set(tensors) | set(objects)
        parts = []
        missing = [k for k in known if k not in given]
        extra = [k for k in given if k not in known]
        if missing:
            parts.append("missing key(s) " + ", ".join(sorted(map(_fmt, missing))))
        if extra:
            parts.append("unexpected key(s) " + ", ".join(sorted(map(_fmt, extra))))
        swapped = [k for k in given & known if (k in tensors) != (k in self._tensor_keys)]
        if swapped:
            parts.append("tensor/non-tensor mismatch at " + ", ".join(sorted(map(_fmt, swapped))))
        raise SchemaMismatchError(
            f"{where} does not have the structure of the stored items: " + "; ".join(parts)
            + ". A packed storage needs one structure; use LazyStackStorage(densify=False) for heterogeneous items"
        )

    # ------------------------------------------------------------------ reading
    def build(self, tensors: Sequence[torch.Tensor], objects: Sequence[list], batch_size: Sequence[int], device: Any) -> Any:
        """Wraps read leaves (schema order) and object lists into the items' container kind.

        Args:
            tensors: per leaf, a dense or jagged tensor whose first dims are ``batch_size``.
            objects: per object key, the objects (a list of ``batch_size[0]`` for a batch, one
                object for an item).
            batch_size: ``[B]`` for a batch, ``[]`` for one item.
            device: recorded on a returned TensorDict (None: not recorded).
        """
        if self.kind == "tensor":
            return tensors[0]
        source: dict = {}
        for leaf, tensor in zip(self.leaves, tensors):
            _put(source, leaf.key, tensor)
        # The leaves are fresh tensors on ``device`` already: skip the constructor's checks and moves.
        td = TensorDict._new_unsafe(source=source, batch_size=torch.Size(batch_size), device=device)
        for key, values in zip(self.object_keys, objects):
            if len(batch_size):
                td.set(key, NonTensorStack(*[NonTensorData(v) for v in values]))
            else:
                td.set_non_tensor(key, values)
        if self.kind == "tensorclass":
            return self.container_cls._from_tensordict(td)
        return td

    def describe(self) -> dict:
        """The schema as JSON-like values (for checkpoints): keys as lists, dtypes as names."""
        cls = self.container_cls
        return {
            "kind": self.kind,
            "container": None if cls is None else class_path(cls),
            "leaves": [
                {"key": list(leaf.key), "dtype": str(leaf.dtype).replace("torch.", ""), "trail": list(leaf.trail),
                 "scalar": leaf.scalar}
                for leaf in self.leaves
            ],
            "objects": [list(key) for key in self.object_keys],
        }

    @classmethod
    def from_description(cls, described: dict) -> "RaggedSchema":
        """Inverse of :meth:`describe`; the tensorclass type is imported by its module and name
        (:func:`~gpubuf.storages._layout.tensorclass_from_path`: nothing but a tensorclass type).

        Raises:
            SchemaMismatchError: an unknown dtype or a tensorclass type that cannot be imported.
        """
        container = None
        if described.get("container"):
            try:
                container = tensorclass_from_path(described["container"])
            except LookupError as err:
                raise SchemaMismatchError(
                    f"the stored items' class cannot be used: {err}"
                ) from err
        leaves = []
        for leaf in described["leaves"]:
            dtype = getattr(torch, leaf["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise SchemaMismatchError(f"unknown dtype {leaf['dtype']!r} in a stored schema")
            leaves.append(RaggedLeaf(tuple(leaf["key"]), dtype, torch.Size(leaf["trail"]), bool(leaf["scalar"])))
        return cls(described["kind"], leaves, [tuple(key) for key in described["objects"]], container)

    # The same words as a tensor storage's layout: it reads only ``kind`` and ``container_cls``.
    describe_kind = Layout.describe_kind

    def __repr__(self) -> str:
        fields = [
            f"{_fmt(leaf.key)}: {str(leaf.dtype).replace('torch.', '')}"
            + ("[]" if leaf.scalar else "[" + ", ".join(["L", *map(str, leaf.trail)]) + "]")
            for leaf in self.leaves
        ]
        fields += [f"{_fmt(k)}: object" for k in self.object_keys]
        return f"RaggedSchema({self.kind}, {{{', '.join(fields)}}})"


def _lazy_items(data: Any) -> list | None:
    """The items of a batch lazily stacked along dim 0 (their leaves may be ragged), else None."""
    if isinstance(data, LazyStackedTensorDict) and data.stack_dim == 0:
        return list(data.tensordicts)
    if is_tensorclass(data) and isinstance(data._tensordict, LazyStackedTensorDict) and data._tensordict.stack_dim == 0:
        return [type(data)._from_tensordict(td) for td in data._tensordict.tensordicts]
    return None


def _put(source: dict, key: tuple, value: Any) -> None:
    node = source
    for part in key[:-1]:
        node = node.setdefault(part, {})
    node[key[-1]] = value


def _item_shape(tensor: torch.Tensor, lead: int) -> tuple:
    """A leaf's per-item shape, its first dim shown as -1 when it is ragged (nested)."""
    if tensor.is_nested:
        # Jagged [n, j, *trail]: the item shape is [j, *trail].
        return (-1, *tensor.shape[2:])
    return tuple(tensor.shape[lead:])


def _check_batch(td: TensorDictBase, lead: int, what: str) -> None:
    if td.batch_dims != lead:
        expected = "[n]" if lead else "[]"
        raise UnsupportedDataError(
            f"{what} has batch_size {list(td.batch_size)}, expected {expected}: a packed storage holds items with an "
            "empty batch size (ragged along each leaf's first dim); use TensorStorage or densify=False otherwise"
        )


def _object_value(leaf: Any) -> Any:
    return leaf.data if isinstance(leaf, NonTensorData) else leaf.tolist()


def _object_list(leaf: Any, n: int) -> list:
    if isinstance(leaf, NonTensorData):
        # One NonTensorData over a batch holds a value shared by every item.
        return [leaf.data] * n
    values = leaf.tolist()
    if len(values) != n:
        raise SchemaMismatchError(f"a non-tensor entry holds {len(values)} values for {n} items")
    return values


def jagged(values: torch.Tensor, offsets: torch.Tensor, min_length: int, max_length: int) -> torch.Tensor:
    """A jagged nested tensor ``[B, j, *trail]`` over ``values`` (no copy), rows cut at ``offsets``.

    Leaves built on the same ``offsets`` tensor share their ragged dim (``j``), so they combine
    (``input_ids * attention_mask``). ``min_length``/``max_length`` are recorded for kernels such
    as scaled-dot-product attention, which would otherwise synchronise to compute them.
    """
    return jagged_many([values], offsets, min_length, max_length)[0]


def jagged_many(
    values: Sequence[torch.Tensor], offsets: torch.Tensor, min_length: int, max_length: int
) -> list[torch.Tensor]:
    """:func:`jagged` for several leaves that share ``offsets``: one nested tensor per leaf.

    The recorded sequence lengths are built once and shared (each tensor keeps its own cache
    dict), since they describe the shared offsets.
    """
    if _NestedTensor is not None:
        try:
            # The public constructor goes through torch-function dispatch to build a view, three
            # times the cost of the tensor itself; the values here are fresh gather outputs with no
            # autograd history, so constructing the tensor directly is equivalent.
            lo, hi = _store_val_in_tensor(min_length), _store_val_in_tensor(max_length)
            return [
                _NestedTensor(v, offsets, _ragged_idx=1, _metadata_cache={"min_seqlen": lo, "max_seqlen": hi})
                for v in values
            ]
        except Exception:  # a torch whose private constructor changed: use the public one
            pass
    return [
        torch.nested.nested_tensor_from_jagged(v, offsets, min_seqlen=min_length, max_seqlen=max_length)
        for v in values
    ]
