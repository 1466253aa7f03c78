"""``StorageEnsemble``: several storages read as one (TorchRL's ``StorageEnsemble``)."""

from __future__ import annotations

import textwrap
from typing import Any, Callable, Sequence

import torch

from gpubuf._ensemble import member_positions, rng_to_members
from gpubuf.errors import ComponentTypeError, ImmutableStorageError
from gpubuf.storages.base import Storage

__all__ = ["StorageEnsemble"]


class StorageEnsemble(Storage):
    """An ensemble of storages, read through a :class:`~gpubuf.buffers.ensemble.ReplayBufferEnsemble`.

    As in TorchRL, :meth:`get` takes the ensemble sampler's index (``"buffer_ids"`` and
    ``"index"``) and returns a list of ``(buffer_id, data)`` pairs, and ``len()`` is the number
    of storages. The ensemble takes no writes: write to a member (``ensemble[0]``).

    Args:
        *storages: the member storages.

    Keyword Args:
        transforms: one transform (or None) per storage, applied to that storage's data on read.

    Raises:
        ComponentTypeError: a member that is not a storage, or ``transforms`` of another length
            than ``storages`` (a ``TypeError``).
    """

    def __init__(self, *storages: Storage, transforms: Sequence[Callable | None] | None = None) -> None:
        # Set before Storage.__init__, whose ``self._rng = None`` goes through the property below.
        for i, storage in enumerate(storages):
            if not isinstance(storage, Storage):
                raise ComponentTypeError(f"StorageEnsemble member #{i} is a {type(storage).__name__}: expected a Storage")
        if transforms is not None and (not hasattr(transforms, "__len__") or len(transforms) != len(storages)):
            raise ComponentTypeError("transforms must have the same length as the storages provided.")
        self._storages = tuple(storages)
        self._rng_private = None
        self._transforms = list(transforms) if transforms is not None else None
        super().__init__(max_size=max(1, sum(storage.max_size for storage in storages)))

    _rng = rng_to_members("_storages")

    @property
    def storages(self) -> tuple[Storage, ...]:
        return self._storages

    # ------------------------------------------------------------------ writing is refused
    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ImmutableStorageError(
            "a StorageEnsemble takes no writes: write to one of its storages (ensemble[i]) or buffers"
        )

    set = _write_rows = _append_rows = _refuse

    def add(self, value: Any) -> None:
        """Refused: write to a member storage (``ImmutableStorageError``, a RuntimeError)."""
        self._refuse(value)

    def extend(self, value: Any) -> None:
        """Refused: write to a member storage (``ImmutableStorageError``, a RuntimeError)."""
        self._refuse(value)

    # ------------------------------------------------------------------ reading
    def get(self, item: Any) -> list[tuple[int, Any]]:
        """Reads the samples an ensemble sampler drew.

        Args:
            item: a mapping (TensorDict or dict) with ``"buffer_ids"`` (``[K]``) and ``"index"``
                (``[K, ...]``: the rows of each storage to read).

        Returns:
            ``[(buffer_id, data), ...]``, one pair per entry of ``buffer_ids``, each storage's
            transform applied to its data.
        """
        buffer_ids = item.get("buffer_ids")
        index = item.get("index")
        results = []
        for buffer_id, sample in zip(buffer_ids.tolist(), index.unbind(0) if isinstance(index, torch.Tensor) else index):
            data = self._storages[buffer_id].get(_member_index(sample, self._storages[buffer_id]))
            transform = self._transforms[buffer_id] if self._transforms is not None else None
            if transform is not None:
                data = transform(data)
            results.append((buffer_id, data))
        return results

    def __getitem__(self, index: Any) -> Any:
        """``ensemble[i]`` is storage ``i``; a slice, list or tensor gives a sub-ensemble;
        ``ensemble[i, rows]`` reads rows of storage ``i``."""
        if isinstance(index, tuple):
            if index[0] is Ellipsis:
                index = (slice(None), *index[1:])
            result = self[index[0]]
            if len(index) > 1:
                if result is self:
                    return [storage[index[1:]] for storage in self._storages]
                if isinstance(result, StorageEnsemble):
                    return result[(slice(None), *index[1:])]
                return result[index[1:] if len(index) > 2 else index[1]]
            return result
        picked = member_positions(index, len(self._storages), type(self).__name__)
        if picked is None:
            return self
        if isinstance(picked, int):
            return self._storages[picked]
        storages = [self._storages[i] for i in picked]
        transforms = [self._transforms[i] for i in picked] if self._transforms is not None else None
        return StorageEnsemble(*storages, transforms=transforms)

    def __len__(self) -> int:
        """The number of storages (TorchRL's meaning); the items held are ``sum(len(s) for s in ensemble.storages)``."""
        return len(self._storages)

    def _empty(self) -> None:
        for storage in self._storages:
            storage._empty()

    def state_dict(self) -> dict[str, Any]:
        return {str(i): storage.state_dict() for i, storage in enumerate(self._storages)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, storage in enumerate(self._storages):
            storage.load_state_dict(state_dict[str(i)])

    def __repr__(self) -> str:
        storages = textwrap.indent(f"storages={list(self._storages)}", " " * 4)
        transforms = textwrap.indent(f"transforms={self._transforms}", " " * 4)
        return f"StorageEnsemble(\n{storages},\n{transforms})"


def _member_index(sample: Any, storage: Storage) -> Any:
    """A member sampler's index back in the form its storage reads: coordinates become a tuple."""
    if isinstance(sample, torch.Tensor) and storage.ndim > 1 and sample.ndim == 2:
        return tuple(sample.unbind(-1))
    return sample
