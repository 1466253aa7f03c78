"""A storage's layout (container kind, keys, dtypes, item shapes, tensorclass, pytree structure)
as JSON, and back."""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.checkpoint.codecs import _array
from gpubuf.checkpoint.errors import CheckpointCorruptError, UnserializableDataError
from gpubuf.checkpoint.format import dtype_name, parse_dtype, parse_shape, require
from gpubuf.checkpoint.values import Decoder, Encoder, check_resolvable, resolve_class

__all__ = ["encode_layout", "decode_layout"]


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
