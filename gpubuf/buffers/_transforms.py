"""The transforms of a buffer: applied to samples on read, inverted on write.

A transform is either a TorchRL ``Transform`` (called forward on read, ``inv`` on write) or any
callable (called on read; nothing on write). ``invert=True`` swaps the two directions, as in
TorchRL's ``append_transform(..., invert=True)``.
"""

from __future__ import annotations

from typing import Any, Callable

from gpubuf.errors import InvalidArgumentError


class TransformChain:
    """An ordered list of transforms; empty by default."""

    def __init__(self) -> None:
        self._items: list[tuple[Callable, bool]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return (transform for transform, _ in self._items)

    def append(self, transform: Callable, invert: bool = False) -> None:
        self._items.append((_checked(transform), invert))

    def insert(self, index: int, transform: Callable, invert: bool = False) -> None:
        """Inserts ``transform`` before position ``index`` (``-len`` to ``len``, as TorchRL's ``Compose``).

        Raises:
            InvalidArgumentError: ``index`` outside that range (``list.insert`` would clamp it).
        """
        size = len(self._items)
        if isinstance(index, bool) or not isinstance(index, int) or not -size <= index <= size:
            raise InvalidArgumentError(
                f"Index expected to be between [-{size}, {size}] got index={index!r}: the position to insert the "
                f"transform at, among the {size} there are"
            )
        self._items.insert(index, (_checked(transform), invert))

    def __call__(self, data: Any) -> Any:
        """Applies the read direction of every transform, first to last."""
        for transform, invert in self._items:
            data = _inverse(transform, data) if invert else transform(data)
        return data

    def inv(self, data: Any) -> Any:
        """Applies the write direction of every transform, last to first."""
        for transform, invert in reversed(self._items):
            data = transform(data) if invert else _inverse(transform, data)
        return data

    def state_dict(self) -> dict[str, Any]:
        states = {}
        for i, (transform, _) in enumerate(self._items):
            state_dict = getattr(transform, "state_dict", None)
            if callable(state_dict):
                states[str(i)] = state_dict()
        return states

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for i, (transform, _) in enumerate(self._items):
            if str(i) in state and callable(getattr(transform, "load_state_dict", None)):
                transform.load_state_dict(state[str(i)])


def _checked(transform: Any) -> Callable:
    if not callable(transform):
        raise TypeError(f"a transform must be callable, got {type(transform).__name__}")
    # TorchRL transforms act differently in train mode; a buffer uses them in eval mode.
    if callable(getattr(transform, "eval", None)):
        transform.eval()
    return transform


def _inverse(transform: Callable, data: Any) -> Any:
    inv = getattr(transform, "inv", None)
    if inv is None:
        return data
    return inv(data)
