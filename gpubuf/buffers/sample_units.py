"""Sample units: what each index a sampler draws expands into (``torchrl.data``'s ``SampleUnit``).

A buffer built with ``sample_unit=...`` calls :meth:`SampleUnit.expand` right after its sampler's
draw and before the rows are read, so the expanded indices are the ones the batch is read from
and the ones reported in ``info["index"]``.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = ["SampleUnit", "Transition"]


class SampleUnit(abc.ABC):
    """Expands a sampler's anchor indices into the records a batch is made of.

    ``expand`` gets the anchors (a tensor, or a tuple of coordinate tensors for ``ndim > 1``
    storages), the sampler's info and the storage, and returns ``(index, info)``. It must not
    mutate the storage. Info entries aligned with the anchors (priority weights) must stay
    aligned with the returned index.
    """

    @abc.abstractmethod
    def expand(self, index: torch.Tensor | tuple, info: dict[str, Any], storage: Any) -> tuple[Any, dict[str, Any]]:
        """Returns the expanded ``(index, info)`` of the anchors ``index``."""


class Transition(SampleUnit):
    """The identity unit: every anchor is one record (the behaviour without a ``sample_unit``).

    Examples:
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4, sample_unit=Transition())
        >>> rb.extend(torch.arange(10)); rb.sample().shape
        torch.Size([4])
    """

    def expand(self, index: torch.Tensor | tuple, info: dict[str, Any], storage: Any) -> tuple[Any, dict[str, Any]]:
        return index, info
