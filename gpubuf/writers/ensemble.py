"""``WriterEnsemble``: the writers of a buffer ensemble, which write only through their members."""

from __future__ import annotations

import textwrap
from typing import Any

import torch

from gpubuf._ensemble import rng_to_members
from gpubuf.storages.ensemble import StorageEnsemble
from gpubuf.writers.base import Writer
from gpubuf.errors import ArgumentConflictError, ComponentTypeError, ImmutableStorageError

__all__ = ["WriterEnsemble"]


class WriterEnsemble(Writer):
    """An ensemble of writers, one per storage of a :class:`~gpubuf.storages.StorageEnsemble` (TorchRL's).

    It writes nothing itself: ``add``/``extend`` raise :class:`ImmutableStorageError`; write
    through a member buffer (``ensemble[i].extend(...)``).

    Args:
        *writers: one writer per member storage.
    """

    def __init__(self, *writers: Writer) -> None:
        # Writer.__init__ is not called: its counters are the members'.
        for i, writer in enumerate(writers):
            if not isinstance(writer, Writer):
                raise ComponentTypeError(f"WriterEnsemble member #{i} is a {type(writer).__name__}: expected a Writer")
        self._writers = tuple(writers)
        self._storage = None
        self._cursor = 0
        self._compilable = False
        self._rng_private = None

    _rng = rng_to_members("_writers")

    @property
    def _write_count(self) -> int:
        return sum(writer._write_count for writer in self._writers)

    def register_storage(self, storage: Any) -> None:
        if not isinstance(storage, StorageEnsemble):
            raise ComponentTypeError(f"WriterEnsemble requires a StorageEnsemble, got {type(storage).__name__}.")
        members = storage._storages
        if len(members) != len(self._writers):
            raise ArgumentConflictError("WriterEnsemble and StorageEnsemble must have the same number of members.")
        self._storage = storage
        for writer, member in zip(self._writers, members):
            writer.register_storage(member)

    def add(self, data: Any) -> Any:
        raise ImmutableStorageError("a buffer ensemble is written through its members: ensemble[i].add(...)")

    def extend(self, data: Any) -> torch.Tensor:
        raise ImmutableStorageError("a buffer ensemble is written through its members: ensemble[i].extend(...)")

    def _empty(self, empty_write_count: bool = True) -> None:
        for writer in self._writers:
            writer._empty(empty_write_count=empty_write_count)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            return self._writers[index]
        if isinstance(index, slice):
            return WriterEnsemble(*self._writers[index])
        return WriterEnsemble(*[self._writers[i] for i in torch.as_tensor(index).reshape(-1).tolist()])

    def __len__(self) -> int:
        return len(self._writers)

    def state_dict(self) -> dict[str, Any]:
        return {str(i): writer.state_dict() for i, writer in enumerate(self._writers)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, writer in enumerate(self._writers):
            writer.load_state_dict(state_dict[str(i)])

    def __repr__(self) -> str:
        writers = textwrap.indent(f"writers={list(self._writers)}", " " * 4)
        return f"WriterEnsemble(\n{writers})"
