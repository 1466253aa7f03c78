"""``RemoteComponent``: a remote buffer's sampler, storage, writer or transform, used through its actor.

A component of a buffer living in a Ray actor cannot be handed to the caller as a live object (a
copy of a storage is the whole buffer, and changes to a copy never reach the actor). The proxy
forwards every use to the actor instead: reading a public attribute returns a copy of its
value, calling a method runs it on the actor's component, and ``len``, ``[]`` and ``()`` work as
on the component.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["RemoteComponent"]


class RemoteComponent:
    """The buffer attribute ``name`` (``"sampler"``, ``"storage"``, ``"writer"``, ``"transform"``)
    of a remote buffer, used through the actor.

    Args:
        call: runs ``host.<method>(*args)`` on the actor and returns the result (the client's
            plumbing: tensors moved to the CPU for an actor without GPU, remote errors re-raised).
        name: the buffer's attribute.
    """

    def __init__(self, call: Callable[..., Any], name: str) -> None:
        object.__setattr__(self, "_call", call)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        kind, value = self._call("component_attr", self._name, attr)
        if kind == "value":
            return value

        def remote_method(*args: Any, **kwargs: Any) -> Any:
            return self._call("component_call", self._name, attr, args, kwargs)

        remote_method.__name__ = attr
        return remote_method

    def __setattr__(self, attr: str, value: Any) -> None:
        self._call("component_call", self._name, "__setattr__", (attr, value), {})

    def __len__(self) -> int:
        return self._call("component_call", self._name, "__len__", (), {})

    def __getitem__(self, index: Any) -> Any:
        return self._call("component_call", self._name, "__getitem__", (index,), {})

    def __setitem__(self, index: Any, value: Any) -> None:
        self._call("component_call", self._name, "__setitem__", (index, value), {})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("component_call", self._name, "__call__", args, kwargs)

    def __repr__(self) -> str:
        return f"RemoteComponent({self._call('component_call', self._name, '__repr__', (), {})})"
