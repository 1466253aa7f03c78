"""What the ensembles (buffer, storage, sampler, writer) share: member indexing and the generator."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

INDEX_ERROR = "Expected an index of type torch.Tensor, range, np.ndarray, int, slice or ellipsis, got {} instead."


def member_positions(index: Any, count: int, owner: str) -> int | list[int] | None:
    """Reads the member part of an ensemble index (TorchRL's rules).

    Args:
        index: an int, a slice, a list, range, array or tensor of ints (one dimension at most).
        count: the number of members of the ensemble.
        owner: the ensemble's class name, for the error messages.

    Returns:
        None for ``[:]`` (the whole ensemble, itself), an int for one member, or the list of
        member positions of a sub-ensemble.

    Raises:
        IndexError: a tensor index of more than one dimension, an int out of range, or an index
            of another type.
        TypeError: a floating-point tensor index.
    """
    if isinstance(index, slice) and index == slice(None):
        return None
    if isinstance(index, (list, range, np.ndarray)):
        index = torch.as_tensor(index)
    if isinstance(index, torch.Tensor):
        if index.ndim > 1:
            raise IndexError(f"Cannot index a {owner} with tensor indices of more than one dimension.")
        if index.is_floating_point():
            raise TypeError("A floating point index was received when an integer dtype was expected.")
        if index.ndim == 0:
            index = int(index)
    if isinstance(index, int):
        # The bounds of tuple indexing, reported with TorchRL's message rather than the tuple's.
        if not -count <= index < count:
            raise IndexError(INDEX_ERROR.format(type(index)))
        return index
    if isinstance(index, torch.Tensor):
        return index.tolist()
    if isinstance(index, slice):
        return list(range(count))[index]
    raise IndexError(INDEX_ERROR.format(type(index)))


def rng_to_members(members: str) -> property:
    """A ``_rng`` property that hands the ensemble's generator on to every member.

    The components' base classes assign ``self._rng`` (the buffer sets its generator that way),
    so an ensemble must forward the assignment for its members to draw from the same generator.

    Args:
        members: the name of the attribute holding the members (a sequence).

    Returns:
        The property. It keeps the generator in ``_rng_private``: the class sets its members
        before anything assigns ``_rng``, and ``_rng_private`` before anything reads it.
    """

    def _get(self: Any) -> torch.Generator | None:
        return self._rng_private

    def _set(self: Any, value: torch.Generator | None) -> None:
        self._rng_private = value
        for member in getattr(self, members):
            member._rng = value

    return property(_get, _set)
