"""The compact wire format of a shard's sample: flat byte chunks small enough to travel inline.

A sample (a TensorDict or a tensor, and its info dict of tensors) is sent as one small header
and its tensors' bytes, laid end to end and cut into chunks. A Ray reply of at most
``max_direct_call_object_size`` bytes (100 KiB by default) travels inside the RPC answer; a
larger one goes through the shared-memory object store, whose create, seal, fetch and release
cost several times the copy on one node. So a shard answers with as many returns as it takes
to keep each under that size (the client asks for that many, from the row size the shard last
reported), and the client lays the bytes straight into the batch it assembles: no pickled
TensorDict, no intermediate concatenation. Anything else (lists, tensorclasses, non-tensor
leaves, tensors off the CPU) travels pickled, as a single return.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

from gpubuf.storages._layout import is_tensor_collection

__all__ = ["assemble", "chunk_count", "pack", "unpack_leaves"]

#: Ray's default ``max_direct_call_object_size``: replies up to this size are inlined.
_RAY_INLINE_DEFAULT = 100 * 1024
#: Room for the serialisation header of each chunk.
_HEADER_MARGIN = 4 * 1024
#: Leaves start at multiples of this, so that every dtype can view its bytes in place.
_ALIGN = 16


def chunk_bytes() -> int:
    """The largest chunk that Ray inlines (``RAY_max_direct_call_object_size`` when set)."""
    limit = int(os.environ.get("RAY_max_direct_call_object_size", _RAY_INLINE_DEFAULT))
    return max(limit - _HEADER_MARGIN, 4096)


def chunk_count(rows: int, row_bytes: int | None) -> int:
    """The number of chunks for ``rows`` rows of ``row_bytes`` bytes (1 while the size is unknown)."""
    if not row_bytes or rows <= 0:
        return 1
    return max(1, math.ceil(rows * row_bytes / chunk_bytes()))


def _leaves(data: Any, info: dict) -> list[tuple[str, Any, torch.Tensor]] | None:
    if type(data) is TensorDict:
        items = list(data.items(include_nested=True, leaves_only=True))
        if any(not isinstance(v, torch.Tensor) or type(v) is not torch.Tensor for _, v in items):
            return None
        leaves = [("data", k, v) for k, v in items]
    elif type(data) is torch.Tensor:
        leaves = [("data", None, data)]
    else:
        return None
    for key, value in info.items():
        if type(value) is not torch.Tensor:
            return None
        leaves.append(("info", key, value))
    if any(t.device.type != "cpu" for _, _, t in leaves):
        return None
    return leaves


def pack(data: Any, info: dict, chunks: int) -> tuple[Any, ...]:
    """A sample as ``1 + chunks`` returns: its header, then its bytes in ``chunks`` pieces.

    The header is ``(kind, layout, batch, total, row_bytes)``: ``kind`` ``"td"`` or ``"tensor"``,
    ``layout`` a list of ``(group, key, dtype, shape, offset)`` (``group`` ``"data"`` or
    ``"info"``), ``batch`` the rows, ``total`` the bytes. Data the compact format does not cover
    comes back as ``(("pickled", data, info), None, ...)`` (still ``1 + chunks`` items).
    """
    leaves = _leaves(data, info)
    if leaves is None:
        return (("pickled", data, info),) + (None,) * chunks
    batch = int(data.batch_size[0]) if isinstance(data, TensorDictBase) else int(data.shape[0])
    layout, offset = [], 0
    for group, key, tensor in leaves:
        layout.append((group, key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    flat = torch.empty(offset, dtype=torch.uint8)
    for (_, _, tensor), (_, _, _, _, start) in zip(leaves, layout):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            flat[start : start + nbytes] = tensor.contiguous().reshape(-1).view(torch.uint8)
    row_bytes = math.ceil(offset / batch) if batch else 0
    header = ("td" if isinstance(data, TensorDictBase) else "tensor", layout, batch, offset, row_bytes)
    array = flat.numpy()
    step = -(-offset // chunks) if offset else 0
    return (header,) + tuple(array[i * step : (i + 1) * step] for i in range(chunks))


def unpack_leaves(header: tuple, chunks: list[np.ndarray]) -> dict[tuple[str, Any], torch.Tensor]:
    """The tensors of a packed sample, keyed by ``(group, key)``: views of one buffer owned by
    the caller (the chunks are copied once, end to end)."""
    _, layout, _, total, _ = header
    joined = np.empty(total, dtype=np.uint8)
    at = 0
    for chunk in chunks:
        joined[at : at + len(chunk)] = chunk
        at += len(chunk)
    flat = torch.from_numpy(joined)
    out = {}
    for group, key, dtype, shape, start in layout:
        dtype = getattr(torch, dtype)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        out[(group, key)] = flat[start : start + nbytes].view(dtype).reshape(shape)
    return out


def _rebuild(header: tuple, chunks: list) -> tuple[Any, dict]:
    """A packed sample back as ``(data, info)``."""
    kind, _, batch, _, _ = header
    return _as_batch(kind, unpack_leaves(header, chunks), batch)


def _as_batch(kind: str, leaves: dict, batch: int) -> tuple[Any, dict]:
    """``(data, info)`` of unpacked leaves: a tensor or a TensorDict of ``batch`` rows."""
    info = {key: t for (group, key), t in leaves.items() if group == "info"}
    if kind == "tensor":
        return leaves[("data", None)], info
    data = TensorDict(batch_size=[batch])
    for (group, key), tensor in leaves.items():
        if group == "data":
            data.set(key, tensor)
    return data, info


def _signature(header: tuple) -> tuple:
    kind, layout, _, _, _ = header
    return kind, tuple((group, key, dtype, shape[1:]) for group, key, dtype, shape, _ in layout)


def assemble(replies: list[tuple[Any, list]], positions: list[torch.Tensor], batch_size: int) -> tuple[Any, dict]:
    """One batch from the shards' replies, each shard's rows at its positions of the batch.

    Args:
        replies: per shard, its header (or ``("pickled", data, info)``) and its chunks.
        positions: per shard, the int64 positions of the batch its rows fill (they partition
            ``range(batch_size)``).
        batch_size: the rows of the batch.

    Returns:
        ``(data, info)``: a TensorDict or tensor of ``batch_size`` rows, and the info dict.
    """
    headers = [header for header, _ in replies]
    if all(h[0] != "pickled" for h in headers) and len({_signature(h) for h in headers}) == 1:
        # The common case: the bytes go straight into the batch's tensors, one copy per leaf.
        kind, layout, _, _, _ = headers[0]
        out = {
            (group, key): torch.empty((batch_size, *shape[1:]), dtype=getattr(torch, dtype))
            for group, key, dtype, shape, _ in layout
        }
        for (header, chunks), where in zip(replies, positions):
            for name, tensor in unpack_leaves(header, chunks).items():
                out[name].index_copy_(0, where, tensor)
        return _as_batch(kind, out, batch_size)
    parts = [(h[1], h[2]) if h[0] == "pickled" else _rebuild(h, chunks) for h, chunks in replies]
    order = torch.argsort(torch.cat(positions))
    data = _concat([p[0] for p in parts])
    info: dict[str, Any] = {}
    for key in parts[0][1]:
        values = [p[1][key] for p in parts]
        info[key] = torch.cat(values, 0)[order] if isinstance(values[0], torch.Tensor) else values
    return _take(data, order), info


def _concat(parts: list) -> Any:
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor) or is_tensor_collection(first):
        return torch.cat(parts, 0)
    if isinstance(first, list):
        return [item for part in parts for item in part]
    return torch.utils._pytree.tree_map(lambda *leaves: torch.cat(leaves, 0), *parts)


def _take(data: Any, order: torch.Tensor) -> Any:
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        return data[order]
    if isinstance(data, list):
        return [data[i] for i in order.tolist()]
    return torch.utils._pytree.tree_map(lambda leaf: leaf[order], data)
