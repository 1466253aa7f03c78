"""``LazyStackStorage``: a list of items sampled as a lazily stacked TensorDict (TorchRL's ``LazyStackStorage``)."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass, lazy_stack

from gpubuf.errors import InvalidArgumentError, SchemaMismatchError, UnsupportedDataError
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.storages.list import ListStorage
from gpubuf.storages.packed import PackedStorage

__all__ = ["LazyStackStorage"]


def _family(item: Any) -> tuple:
    """What items must share to be stacked together: container kind (tensorclass type) and batch
    dims; for tensors, their dtype and number of dims (tensors of another dtype stack neither
    densely nor as a jagged tensor)."""
    if is_tensorclass(item):
        return ("tensorclass", type(item), item.batch_dims)
    if isinstance(item, TensorDictBase):
        return ("tensordict", None, item.batch_dims)
    if isinstance(item, torch.Tensor):
        return ("tensor", item.dtype, item.ndim)
    return ("object", None, None)


def _describe(family: tuple) -> str:
    kind, cls, ndim = family
    if kind == "object":
        return "Python objects"
    if kind == "tensor":
        return f"{ndim}-d {cls} tensors"
    name = cls.__name__ if cls is not None else "TensorDicts"
    return f"{name} with {ndim} batch dim(s)"


class LazyStackStorage(ListStorage):
    """A list storage whose samples are lazily stacked (``LazyStackedTensorDict``), as in TorchRL.

    Items may differ in the shapes of their tensors and in their keys (TensorDicts): a sample
    stacks them without copying, and non-tensor entries (strings, any object) are carried
    through. ``sample.densify(layout=torch.jagged)`` turns it into nested tensors.

    With ``densify=True`` the items' tensors are packed on the storage's device instead (see
    :class:`~gpubuf.storages.packed.PackedStorage`) and a sample is already densified: leaves of
    one shape are stacked tensors, ragged leaves are jagged nested tensors sharing their offsets,
    non-tensor leaves ``NonTensorStack`` -- what ``densify(layout=torch.jagged)`` of TorchRL's
    sample holds, produced by one fused gather instead of a Python-level stack. This needs every
    item to have one structure (keys, dtypes, trailing shapes) and an empty batch size, and
    ``stack_dim`` to resolve to 0.

    Args:
        max_size: capacity in items; unbounded when ``None`` (TorchRL's default).

    Keyword Args:
        compilable: accepted for TorchRL compatibility.
        stack_dim: the stack dimension in terms of the items' batch sizes (default 0; ``-1``
            stacks after the last batch dim of the items).
        device: items are moved there on write (``None``: not moved).
        densify: pack the items and sample densified batches (gpubuf extension, default False).

    Raises:
        CapacityError: ``max_size`` is not a positive int.
        InvalidArgumentError: ``stack_dim`` not an int, or ``densify=True`` with a ``stack_dim``
            other than 0 or -1 (a ``ValueError``).

    Examples:
        >>> rb = ReplayBuffer(storage=LazyStackStorage(max_size=1000, stack_dim=-1))
        >>> _ = rb.add(TensorDict(a=torch.randn((10,)), b=torch.rand(4), c="a string!"))
        >>> _ = rb.add(TensorDict(a=torch.randn((11,)), b=torch.rand(4), c="another string!"))
        >>> rb.sample(10)  # a LazyStackedTensorDict of batch_size [10]; "a" is [10, -1]
    """

    def __init__(
        self,
        max_size: int | None = None,
        *,
        compilable: bool = False,
        stack_dim: int = 0,
        device: Any = None,
        densify: bool = False,
    ) -> None:
        if isinstance(stack_dim, bool) or not isinstance(stack_dim, int):
            raise InvalidArgumentError(f"stack_dim must be an int, got {stack_dim!r}")
        super().__init__(max_size=max_size, compilable=compilable, device=device)
        self.stack_dim = stack_dim
        self.densify = bool(densify)
        self._packed: PackedStorage | None = None
        if self.densify:
            if stack_dim not in (0, -1):
                raise InvalidArgumentError(
                    f"densify=True stacks items of an empty batch size along dim 0; stack_dim={stack_dim} cannot apply"
                )
            self._packed = PackedStorage(None if max_size is None else self.max_size, device=device, compilable=compilable)

    # ------------------------------------------------------------------ validation
    def _check_items(self, items: list) -> None:
        """Items must stack with what is stored: one container kind, one number of batch dims."""
        reference = self._storage[0] if self._storage else (items[0] if items else None)
        if reference is None:
            return
        family = _family(reference)
        for i, item in enumerate(items):
            other = _family(item)
            if other != family:
                raise SchemaMismatchError(
                    f"item #{i} is one of {_describe(other)}, but this storage holds {_describe(family)}: lazily "
                    "stacked items need one container kind and one number of batch dims"
                )

    def _as_items(self, data: Any) -> list:
        items = super()._as_items(data)
        self._check_items(items)
        return items

    # ------------------------------------------------------------------ the interface
    def _write_rows(self, start: int, data: Any) -> int:
        if self._packed is not None:
            return self._packed._write_rows(start, data)
        return super()._write_rows(start, data)

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        if self._packed is not None:
            self._packed.set(cursor, data, set_cursor=set_cursor)
            return
        if not isinstance(cursor, (slice, list, tuple, range, torch.Tensor)) or (
            isinstance(cursor, torch.Tensor) and cursor.ndim == 0
        ):
            self._check_items([data])
        super().set(cursor, data, set_cursor=set_cursor)

    def get(self, index: Any) -> Any:
        """Reads items: one item for an int, else the items lazily stacked along ``stack_dim``.

        Returns:
            For a sequence of indices: a ``LazyStackedTensorDict`` (a tensorclass over one for
            tensorclass items); for tensors, a stacked tensor, or a jagged nested tensor when
            their first dims differ; a list for other Python objects. With ``densify=True``, the
            densified batch described in the class docstring.
        """
        if self._packed is not None:
            return self._packed.get(index)
        out = super().get(index)
        if not isinstance(out, list) or not out:
            return out
        return self._stack(out)

    def _stack(self, items: list) -> Any:
        first = items[0]
        if is_tensor_collection(first):
            dim = self.stack_dim if self.stack_dim >= 0 else first.batch_dims + 1 + self.stack_dim
            return lazy_stack(items, dim)
        if isinstance(first, torch.Tensor):
            return _stack_tensors(items, self.stack_dim)
        return items

    def __len__(self) -> int:
        if self._packed is not None:
            return len(self._packed)
        return super().__len__()

    def _empty(self) -> None:
        if self._packed is not None:
            self._packed._empty()
        super()._empty()

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        if self._packed is not None:
            return self._packed._rand_given_ndim(batch_size)
        return super()._rand_given_ndim(batch_size)

    def contains(self, item: int) -> bool:
        return 0 <= int(item) < len(self)

    def state_dict(self) -> dict[str, Any]:
        if self._packed is not None:
            return {"_packed": self._packed.state_dict()}
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._packed is not None:
            if "_packed" not in state_dict:
                raise SchemaMismatchError("this LazyStackStorage packs its items (densify=True); the state holds a list")
            self._packed.load_state_dict(state_dict["_packed"])
            return
        if "_packed" in state_dict:
            raise SchemaMismatchError("the state holds packed items (densify=True); this LazyStackStorage keeps a list")
        super().load_state_dict(state_dict)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(items={len(self)}, max_size={self.max_size}, stack_dim={self.stack_dim}, "
            f"densify={self.densify})"
        )


def _stack_tensors(items: list, stack_dim: int) -> torch.Tensor:
    """Stacks tensors; tensors that differ along their first dim only become a jagged nested tensor."""
    ndim = items[0].ndim
    dim = stack_dim if stack_dim >= 0 else ndim + 1 + stack_dim
    if all(t.shape == items[0].shape for t in items):
        return torch.stack(items, dim)
    if dim != 0 or ndim == 0 or any(t.shape[1:] != items[0].shape[1:] for t in items):
        raise SchemaMismatchError(
            "the sampled tensors differ in shapes other than their first dim (or stack_dim is not 0): they cannot "
            f"be stacked, even as a nested tensor; got {sorted({tuple(t.shape) for t in items})[:4]}"
        )
    if any(t.dtype != items[0].dtype for t in items):
        raise UnsupportedDataError("the sampled tensors have different dtypes and cannot be stacked")
    return torch.nested.as_nested_tensor(items, layout=torch.jagged)
