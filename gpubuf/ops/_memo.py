"""A one-entry memo keyed by the identity of the objects it was given.

The sample path hands the compiled CPU kernels the same tensors from one call to the next (a
storage's leaves, a sampler's tables) until a write or an allocation replaces one. What the
kernels need of them (NumPy views, an address table) is made once and kept while the same
objects come back; the views share the tensors' memory, so a change in place shows.
"""

from __future__ import annotations

import weakref
from operator import is_
from typing import Any, Callable

#: ``ref()`` of a weak reference, called without a Python frame (the check runs at every sample).
_referent = weakref.ref.__call__


class LastByIdentity:
    """Keeps what ``make()`` returned for the last tuple of objects given, while they come back.

    The entry holds the objects themselves, so none of them is freed, and no other object can
    take its identity, while it is kept. It is one tuple replaced whole: a reader in another
    thread sees the old entry or the new one.
    """

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[tuple, Any] | None = None

    def get(self, objects: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` for ``objects``, or the kept value when they are the last objects given."""
        entry = self._entry
        if entry is not None and len(entry[0]) == len(objects) and all(map(is_, entry[0], objects)):
            return entry[1]
        value = make()
        self._entry = (objects, value)
        return value


class LastByWeakIdentity:
    """:class:`LastByIdentity` for objects it must not keep alive (a storage's leaves, which may
    take most of the memory): it holds weak references, and an object that died matches nothing,
    so its identity cannot be taken by another."""

    __slots__ = ("_entry",)

    def __init__(self) -> None:
        self._entry: tuple[tuple, Any] | None = None

    def get(self, objects: tuple, make: Callable[[], Any]) -> Any:
        """``make()`` for ``objects``, or the kept value when they are the last objects given."""
        entry = self._entry
        if entry is not None and len(entry[0]) == len(objects) and all(map(is_, map(_referent, entry[0]), objects)):
            return entry[1]
        value = make()
        self.put(objects, value)
        return value

    def put(self, objects: tuple, value: Any) -> None:
        """Keeps ``value`` for ``objects`` (a kept value found stale by its user is replaced)."""
        self._entry = (tuple(map(weakref.ref, objects)), value)
