"""The base class of storage checkpointers, and how a storage's checkpointer is chosen.

A storage is written by ``storage.checkpointer`` when one is set, else by the checkpointer
registered for its class (:func:`gpubuf.checkpoint.codecs.register_codec`).

Hooks: save hooks registered on the checkpointer or on the storage
(``storage.register_save_hook``) are called, in that order, on the storage's whole content
before it is written: ``hook(data, path=scratch_dir)`` (``path`` only when the hook takes it;
files it writes there are discarded). Load hooks are called on what was read, before it is
installed: ``hook(data, out=None)``. With hooks, the content is written as a value (see
:mod:`gpubuf.checkpoint.values`), so whatever structure the hooks return is kept.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from gpubuf.checkpoint.buffer import dump_storage, load_storage
from gpubuf.checkpoint.codecs import Codec

__all__ = ["StorageCheckpointerBase", "call_hook"]


def call_hook(hook: Callable, data: Any, **kwargs: Any) -> Any:
    """Calls ``hook(data, **kwargs)``, passing only the keyword arguments the hook accepts."""
    try:
        params = inspect.signature(hook).parameters
    except (TypeError, ValueError):
        return hook(data)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return hook(data, **kwargs)
    return hook(data, **{k: v for k, v in kwargs.items() if k in params})


class StorageCheckpointerBase(Codec):
    """Public base class of storage checkpointers (TorchRL's ``StorageCheckpointerBase``).

    Subclasses implement :meth:`to_checkpoint` and :meth:`from_checkpoint` (see
    :mod:`gpubuf.checkpoint.codecs`); :meth:`dumps` and :meth:`loads` then come for free.
    """

    def __init__(self) -> None:
        self._save_hooks: list[Callable] = []
        self._load_hooks: list[Callable] = []

    def register_save_hook(self, hook: Callable) -> None:
        """Adds a hook applied to the storage's content before it is written."""
        self._save_hooks.append(hook)

    def register_load_hook(self, hook: Callable) -> None:
        """Adds a hook applied to the content read, before it is installed in the storage."""
        self._load_hooks.append(hook)

    def save_hooks(self, storage: Any) -> list[Callable]:
        return list(self._save_hooks) + list(storage._save_hooks)

    def load_hooks(self, storage: Any) -> list[Callable]:
        return list(self._load_hooks) + list(storage._load_hooks)

    def dumps(self, storage: Any, path: Any) -> None:
        """Writes ``storage`` alone to the checkpoint directory ``path`` (crash-safe, no pickle)."""
        dump_storage(storage, path, checkpointer=self)

    def loads(self, storage: Any, path: Any) -> None:
        """Restores ``storage`` from a directory written by :meth:`dumps`; validated first.

        Raises:
            CheckpointError: see :func:`gpubuf.checkpoint.load_buffer`; ``storage`` is unchanged.
        """
        load_storage(storage, path, checkpointer=self)
