"""What the ensembles (buffer, storage, sampler, writer) share: member indexing and the generator."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpubuf.errors import InvalidIndexError, InvalidSliceError

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
        InvalidIndexError: a tensor index of more than one dimension, a floating-point, boolean or
            complex one, an int or tensor entry out of range, or an index of another type (an
            ``IndexError`` and a ``TypeError``, as TorchRL raises one or the other).
        InvalidSliceError: a slice with a zero or negative step, or bounds that are not ints.
    """
    if isinstance(index, slice) and index == slice(None):
        return None
    if isinstance(index, (list, range, np.ndarray)):
        try:
            index = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError):
            raise InvalidIndexError(INDEX_ERROR.format(type(index))) from None
    if isinstance(index, torch.Tensor):
        if index.ndim > 1:
            raise InvalidIndexError(f"Cannot index a {owner} with tensor indices of more than one dimension.")
        if index.is_floating_point() or index.is_complex() or index.dtype == torch.bool or index.device.type == "meta":
            raise InvalidIndexError(
                f"A {index.dtype} index on {index.device} was received when an integer dtype was expected."
            )
        if index.ndim == 0:
            index = int(index)
        elif index.numel() and not (-count <= int(index.min()) and int(index.max()) < count):
            raise InvalidIndexError(f"member index {index.tolist()} is out of range for {count} members")
    if isinstance(index, (int, np.integer)) and not isinstance(index, bool):
        index = int(index)
        # The bounds of tuple indexing, reported with TorchRL's message rather than the tuple's.
        if not -count <= index < count:
            raise InvalidIndexError(INDEX_ERROR.format(type(index)) + f" (member {index} of {count})")
        return index
    if isinstance(index, torch.Tensor):
        return index.tolist()
    if isinstance(index, slice):
        for value in (index.start, index.stop, index.step):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
                raise InvalidSliceError(f"slice bounds must be ints or None, got {index!r}")
        if index.step is not None and index.step <= 0:
            raise InvalidSliceError(f"slice step {index.step} is not positive: expected a positive step")
        return list(range(count))[index]
    raise InvalidIndexError(INDEX_ERROR.format(type(index)))


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
