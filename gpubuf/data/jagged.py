"""Jagged batches as plain tensors: values + offsets, which ``memmap`` and checkpoints can hold.

TensorDict cannot memory-map a jagged nested tensor, and a batch of variable-length sequences
(a :class:`~gpubuf.data.RewardData` sampled from a packed storage) holds jagged leaves. These
helpers rewrite each jagged leaf ``[B, j, *trail]`` as its two dense tensors, ``values
[T, *trail]`` and ``offsets [B + 1]``, which is also the layout of a packed storage, and back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass
from tensordict.base import _is_leaf_nontensor

from gpubuf.errors import SchemaMismatchError, UnsupportedDataError

__all__ = ["pack_jagged", "unpack_jagged", "memmap_packed", "load_memmap_packed"]

_DENSE = "dense"
_JAGGED = "jagged"


def pack_jagged(data: Any) -> TensorDict:
    """Rewrites a batch's jagged leaves as values + offsets.

    Args:
        data: a TensorDict or tensorclass with a batch size ``[B]``; any leaf may be a jagged
            nested tensor ``[B, j, *trail]``. Not mutated.

    Returns:
        A TensorDict of batch size ``[]`` holding ``"dense"`` (batch size ``[B]``: every other
        leaf, non-tensor leaves included) and, for each jagged leaf at ``key``,
        ``("jagged", *key, "values")`` and ``("jagged", *key, "offsets")``. Tensors are shared,
        not copied.

    Raises:
        UnsupportedDataError: ``data`` is not a tensor collection, or a nested leaf is not jagged.
    """
    td = data._tensordict if is_tensorclass(data) else data
    if not isinstance(td, TensorDictBase):
        raise UnsupportedDataError(f"pack_jagged takes a TensorDict or a tensorclass, got {type(data).__name__}")
    dense = TensorDict(batch_size=td.batch_size, device=td.device)
    jagged = TensorDict()
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf_nontensor):
        key = key if isinstance(key, tuple) else (key,)
        if isinstance(value, torch.Tensor) and value.is_nested:
            if value.layout != torch.jagged:
                raise UnsupportedDataError(f"leaf {key!r} is a strided nested tensor; only layout=torch.jagged is packed")
            jagged.set((*key, "values"), value.values())
            jagged.set((*key, "offsets"), value.offsets())
        else:
            dense.set(key, value)
    return TensorDict({_DENSE: dense, _JAGGED: jagged}, batch_size=[])


def unpack_jagged(packed: TensorDictBase, cls: type | None = None) -> Any:
    """Inverse of :func:`pack_jagged`.

    Args:
        packed: what :func:`pack_jagged` returned (or its memory-mapped copy).
        cls: a tensorclass type to wrap the result in (e.g. :class:`~gpubuf.data.RewardData`);
            None returns a TensorDict.

    Returns:
        The batch, jagged leaves rebuilt over the stored values (no copy).

    Raises:
        SchemaMismatchError: ``packed`` lacks the ``"dense"`` entry or a jagged leaf is incomplete.
    """
    if _DENSE not in packed.keys():
        raise SchemaMismatchError("not a packed batch: no 'dense' entry")
    out = packed.get(_DENSE).clone(recurse=False)
    jagged = packed.get(_JAGGED, None)
    if jagged is not None:
        keys = {k[:-1] for k in jagged.keys(include_nested=True, leaves_only=True)}
        for key in sorted(keys):
            try:
                values, offsets = jagged.get((*key, "values")), jagged.get((*key, "offsets"))
            except KeyError as err:
                raise SchemaMismatchError(f"jagged leaf {key!r} lacks its values or offsets") from err
            out.set(key, torch.nested.nested_tensor_from_jagged(torch.as_tensor(values), torch.as_tensor(offsets)))
    return cls._from_tensordict(out) if cls is not None else out


def memmap_packed(data: Any, prefix: str | Path) -> TensorDict:
    """Memory-maps a batch with jagged leaves under directory ``prefix``; see :func:`pack_jagged`.

    Returns:
        The memory-mapped packed TensorDict (locked, read-only on disk semantics of TensorDict).
    """
    return pack_jagged(data).memmap(prefix)


def load_memmap_packed(prefix: str | Path, cls: type | None = None) -> Any:
    """Loads a batch saved by :func:`memmap_packed`; its tensors map the files (no copy)."""
    return unpack_jagged(TensorDict.load_memmap(prefix), cls)
