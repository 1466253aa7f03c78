"""What storages, writers and buffers need to know of the items and arguments they are given.

Small helpers over the data a user passes in (a tensor, a TensorDict or tensorclass, a pytree
of tensors, or a list of items): whether an index is one integer, how many items a batch
holds, how a list of items becomes one batch, and which device a ``device=`` argument names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from gpubuf.errors import SchemaMismatchError, UnsupportedDataError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.checks import check_device
from gpubuf.utils import is_int

__all__ = [
    "AUTO_DEVICE", "as_device", "batch_length", "element_coordinates", "is_int", "leading_shape", "leading_size",
    "stack_items",
]

#: The ``device=`` values that mean "the device of the first batch written".
AUTO_DEVICE = ("auto", None)


def as_device(device: Any) -> torch.device | None:
    """A storage's ``device=`` argument as a device (None for :data:`AUTO_DEVICE`); ``"cuda"`` gets its ordinal.

    Raises:
        InvalidDeviceError: a malformed device, or a CUDA device where CUDA is not available.
    """
    if device is None or (isinstance(device, str) and device in AUTO_DEVICE):
        return None
    device = check_device(device)
    if device.type == "cuda" and device.index is None:
        # Make "cuda" comparable with tensors' devices, which always carry an ordinal.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def leading_shape(data: Any, count: int) -> torch.Size:
    """The first ``count`` dims of a batch (of a collection's batch size, or of a pytree's first tensor)."""
    if is_tensor_collection(data):
        return torch.Size(data.batch_size[:count])
    if isinstance(data, torch.Tensor):
        return data.shape[:count]
    leaves = [leaf for leaf in pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        raise UnsupportedDataError(f"cannot find a tensor in {type(data).__name__}")
    return leaves[0].shape[:count]


def leading_size(data: Any) -> int:
    """The number of items along the first dim of a batch of tensors.

    Raises:
        SchemaMismatchError: ``data`` is a scalar item, without a leading dim.
    """
    shape = leading_shape(data, 1)
    if len(shape) == 0:
        raise SchemaMismatchError("expected a batch with a leading dimension, got a scalar item")
    return int(shape[0])


def batch_length(data: Any) -> int:
    """The number of items along the first dim of a batch (tensor, collection, list or pytree)."""
    if isinstance(data, torch.Tensor) or is_tensor_collection(data):
        if len(data.shape) == 0:
            raise SchemaMismatchError("expected a batch with a leading dimension, got a scalar; use add() for one item")
        return data.shape[0]
    if isinstance(data, (list, range)):
        return len(data)
    leaves = [leaf for leaf in pytree.tree_leaves(data) if isinstance(leaf, torch.Tensor)]
    if not leaves:
        try:
            return len(data)
        except TypeError:
            raise UnsupportedDataError(
                f"cannot extend with a {type(data).__name__}: expected a batch (a tensor, TensorDict, pytree of "
                "tensors or a list of items)"
            ) from None
    if leaves[0].ndim == 0:
        raise SchemaMismatchError("expected a batch with a leading dimension, got scalar leaves; use add() for one item")
    return leaves[0].shape[0]


def stack_items(items: list) -> Any:
    """A list of items given to ``extend`` becomes one batch (TorchRL: a list is a stack of items).

    Raises:
        SchemaMismatchError: an empty list, or items that do not stack into one batch.
        UnsupportedDataError: items that are not tensors, collections or pytrees of tensors.
    """
    if not items:
        raise SchemaMismatchError("cannot extend with an empty list")
    first = items[0]
    if isinstance(first, torch.Tensor) or is_tensor_collection(first):
        try:
            return torch.stack(items)
        except (RuntimeError, TypeError, ValueError) as err:
            raise SchemaMismatchError("Stacking the elements of the list resulted in an error: the items do not stack into one batch "
                f"({err})") from err
    if isinstance(first, (tuple, dict)):
        flat = [pytree.tree_flatten(item) for item in items]
        spec = flat[0][1]
        if any(s != spec for _, s in flat):
            raise SchemaMismatchError("the items of the list do not share one pytree structure")
        if not all(isinstance(leaf, torch.Tensor) for leaves, _ in flat for leaf in leaves):
            raise UnsupportedDataError(
                "a tensor storage holds tensors, TensorDicts, tensorclasses or pytrees of tensors; got a list of "
                f"{type(first).__name__} holding other values. Use ListStorage for arbitrary Python objects"
            )
        try:
            leaves = [torch.stack([f[0][i] for f in flat]) for i in range(len(flat[0][0]))]
        except (RuntimeError, TypeError) as err:
            raise SchemaMismatchError("Stacking the elements of the list resulted in an error: the items do not stack into one batch "
                f"({err})") from err
        return pytree.tree_unflatten(leaves, spec)
    raise UnsupportedDataError(
        f"a tensor storage holds tensors, TensorDicts, tensorclasses or pytrees of tensors; got a list of "
        f"{type(first).__name__}. Use ListStorage for arbitrary Python objects"
    )


def element_coordinates(
    shape: torch.Size, index: Any, swap: int = 0
) -> tuple[tuple[torch.Tensor, ...], torch.Size]:
    """The coordinates, in a storage of ``shape``, of the elements ``index`` picks, and the shape
    of the picked block.

    ``index`` is any torch index (ints, slices, index tensors, masks) over the storage's dims, or,
    with ``swap > 0``, over its view with dims 0 and ``swap`` exchanged (a buffer extended along
    ``dim_extend = swap`` shows its storage so). It picks from a grid of the positions (8 bytes an
    element, made per call).

    Raises:
        IndexError, TypeError, ValueError, RuntimeError: what torch raises for the index.
    """
    view = torch.arange(shape.numel()).reshape(shape)
    if swap:
        view = view.transpose(0, swap)
    picked = view[index]
    return torch.unravel_index(picked.reshape(-1), shape), picked.shape
