"""``ImmutableDatasetWriter``: a writer that refuses every write (TorchRL's ``ImmutableDatasetWriter``)."""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.errors import ImmutableStorageError
from gpubuf.writers.base import Writer

__all__ = ["ImmutableDatasetWriter", "ImmutableStorageError"]


class ImmutableDatasetWriter(Writer):
    """The writer of a read-only dataset: ``add``, ``extend`` and ``empty`` raise.

    Give a buffer its data through its storage (``TensorStorage(data)``, a loaded checkpoint)
    and this writer: sampling and reading work, every write raises
    :class:`ImmutableStorageError` and leaves the buffer unchanged (nothing written, cursor,
    write count and sampler state as they were). ``buffer[index] = value`` is refused as well.

    Keyword Args:
        compilable: accepted for TorchRL compatibility.
    """

    WRITING_ERR = "This dataset doesn't allow writing."

    def add(self, data: Any) -> int:
        raise ImmutableStorageError(self.WRITING_ERR + " (add)")

    def extend(self, data: Any) -> torch.Tensor:
        raise ImmutableStorageError(self.WRITING_ERR + " (extend)")

    def _empty(self, empty_write_count: bool = True) -> None:
        raise ImmutableStorageError(self.WRITING_ERR + " (empty)")

    def _check_writable(self) -> None:
        """Called by the buffer before ``buffer[index] = value``."""
        raise ImmutableStorageError(self.WRITING_ERR + " (item assignment)")

    def dumps(self, path: Any) -> None:
        """Nothing to save: the writer has no state."""

    def loads(self, path: Any) -> None:
        """Nothing to load: the writer has no state."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
