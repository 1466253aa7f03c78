"""Sample units: what each index a sampler draws expands into (``torchrl.data``'s ``SampleUnit``).

A buffer built with ``sample_unit=...`` calls :meth:`SampleUnit.expand` right after its sampler's
draw and before the rows are read, so the expanded indices are the ones the batch is read from
and the ones reported in ``info["index"]``.
"""

from __future__ import annotations

import abc
from typing import Any, Literal

import torch

from gpubuf.storages.tensor import TensorStorage
from gpubuf.utils import boundary_distances, find_start_stop_traj

__all__ = ["SampleUnit", "Transition", "Sequence"]


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


def _last_written(storage: Any) -> int | None:
    """The dim-0 index of the newest row of ``storage``, from the writer of a buffer over it."""
    for entity in storage._attached_entities:
        # Buffers attach themselves; ``Storage.attach`` also takes any entity that wants to hear
        # about writes, which has no writer.
        writer = getattr(entity, "_writer", None)
        if writer is not None and writer._storage is storage and writer._write_count:
            return (writer._cursor - 1) % storage._max_size_along_dim0()
    return None


class Sequence(SampleUnit):
    """Expands each anchor into a window of ``burn_in + length + bootstrap`` records around it.

    The window starts ``burn_in`` records before the anchor, holds the learning region of ``length``
    records from the anchor on, then ``bootstrap`` records; ``dilation`` spaces its records. A batch
    of ``B`` anchors reads ``B * (burn_in + length + bootstrap)`` records. ``info`` gets
    ``"sequence_id"``, ``"step_in_sequence"``, ``"learning_mask"``, ``"validity_mask"`` and
    ``"anchor_index"`` (one per record), and ``info["index"]`` holds the records' indices.

    Args:
        length: the learning region's length (> 0).
        episode_boundary: at an episode end, ``"pad"`` repeats the last valid record (marked
            invalid), ``"stop"`` shifts the window back to end there (padding when the episode is
            shorter), ``"include_reset"`` crosses episodes but never the write seam nor unwritten rows.
        done_key: the end-of-episode flag (default ``("next", "done")``); None: one trajectory,
            bounded by the write seam.
        burn_in: records before the anchor (not learned on; clamped at the episode start).
        bootstrap: records after the learning region.
        dilation: storage distance between consecutive records of a window.

    Raises:
        ValueError: a non-positive ``length`` or ``dilation``, negative ``burn_in`` / ``bootstrap``,
            or an unknown ``episode_boundary``.
        TypeError: (at sample time) a storage that is not a TensorDict :class:`TensorStorage`.

    Examples:
        >>> rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2, sample_unit=Sequence(length=3))
        >>> done = torch.zeros(10, 1, dtype=torch.bool); done[4] = done[9] = True
        >>> rb.extend(TensorDict({"obs": torch.arange(10.0), ("next", "done"): done}, [10]))
        >>> rb.sample()["obs"].shape
        torch.Size([6])
    """

    def __init__(
        self,
        length: int,
        episode_boundary: Literal["pad", "stop", "include_reset"] = "pad",
        done_key: Any = ("next", "done"),
        burn_in: int = 0,
        bootstrap: int = 0,
        dilation: int = 1,
    ):
        if length <= 0:
            raise ValueError(f"length must be strictly positive, got {length}.")
        if episode_boundary not in ("pad", "stop", "include_reset"):
            raise ValueError(f"Unknown episode_boundary {episode_boundary}")
        if burn_in < 0:
            raise ValueError(f"burn_in must be non-negative, got {burn_in}.")
        if bootstrap < 0:
            raise ValueError(f"bootstrap must be non-negative, got {bootstrap}.")
        if dilation < 1:
            raise ValueError(f"dilation must be strictly positive, got {dilation}.")
        if done_key is not None and not isinstance(done_key, str):
            done_key = tuple(done_key)
        self.length = length
        self.episode_boundary = episode_boundary
        self.done_key = done_key
        self.burn_in = burn_in
        self.bootstrap = bootstrap
        self.dilation = dilation

    def _check(self, storage: Any) -> None:
        if not isinstance(storage, TensorStorage) or storage.layout is None or storage.layout.kind != "tensordict":
            raise TypeError(
                f"{type(self).__name__} requires a TensorDict-backed TensorStorage (e.g. LazyTensorStorage or "
                f"LazyMemmapStorage written with TensorDict data) to recover episode boundaries and the write cursor; "
                f"got {type(storage).__name__}."
            )

    def _done(self, storage: Any, device: torch.device) -> torch.Tensor:
        self._check(storage)
        shape = storage.shape
        if self.done_key is None:
            return torch.zeros(shape, dtype=torch.bool, device=device)
        done = storage.get((slice(None),) * storage.ndim).get(self.done_key)[: shape[0]]
        while done.ndim > storage.ndim and done.shape[-1] == 1:
            done = done.squeeze(-1)
        return done.to(device)

    def expand(self, index: torch.Tensor | tuple, info: dict[str, Any], storage: Any) -> tuple[Any, dict[str, Any]]:
        anchor = torch.stack(index, -1) if isinstance(index, tuple) else index.clone()
        multi = storage.ndim > 1
        if multi and (anchor.ndim != 2 or anchor.shape[-1] != storage.ndim):
            raise RuntimeError(f"Sequence expected multidimensional anchors with shape [batch, {storage.ndim}].")
        anchor_time = anchor[:, 0] if multi else anchor
        batch, device = anchor.shape[0], anchor.device
        total = self.burn_in + self.length + self.bootstrap
        out: dict[str, Any] = {}
        for key, value in info.items():
            value = torch.as_tensor(value)
            out[key] = info[key] if value.ndim == 0 else value.repeat_interleave(total, dim=0)
        steps = torch.arange(total, device=device)
        learning = (steps >= self.burn_in) & (steps < self.burn_in + self.length)
        out["sequence_id"] = torch.arange(batch, device=device).repeat_interleave(total)
        out["step_in_sequence"] = steps.repeat(batch)
        out["learning_mask"] = learning.repeat(batch)
        out["anchor_index"] = anchor.repeat_interleave(total, dim=0)
        offset = ((steps - self.burn_in) * self.dilation).unsqueeze(0).expand(batch, total)
        written = storage.shape[0]
        if self.episode_boundary in ("pad", "stop"):
            done = self._done(storage, device)
            start, stop, _ = find_start_stop_traj(
                end=done, at_capacity=bool(storage._is_full), cursor=_last_written(storage)
            )
            from_start, to_stop = boundary_distances(anchor, start, stop, written, tuple(storage.shape))
            anchor_eff = anchor_time
            if self.episode_boundary == "stop":
                shortfall = self.dilation * (self.length + self.bootstrap - 1) - to_stop
                shift = torch.clamp(shortfall, min=torch.zeros_like(shortfall), max=from_start)
                anchor_eff = anchor_time - shift
                to_stop, from_start = to_stop + shift, from_start - shift
            validity = (offset <= to_stop.unsqueeze(1)) & (offset >= -from_start.unsqueeze(1))
            clamped = torch.maximum(torch.minimum(offset, to_stop.unsqueeze(1)), -from_start.unsqueeze(1))
            indices = (anchor_eff.unsqueeze(1) + clamped) % written
        else:
            self._check(storage)
            newest = _last_written(storage)
            newest = written - 1 if newest is None else newest % written
            oldest = (newest + 1) % written if storage._is_full else 0
            forward = torch.remainder(newest - anchor_time, written)
            backward = torch.remainder(anchor_time - oldest, written)
            validity = (offset <= forward.unsqueeze(1)) & (offset >= -backward.unsqueeze(1))
            clamped = torch.maximum(torch.minimum(offset, forward.unsqueeze(1)), -backward.unsqueeze(1))
            indices = torch.remainder(anchor_time.unsqueeze(1) + clamped, written)
        out["validity_mask"] = validity.flatten()
        if multi:
            lane = anchor[:, 1:].unsqueeze(1).expand(batch, total, storage.ndim - 1)
            coordinates = torch.cat([indices.unsqueeze(-1), lane], -1).flatten(0, 1)
            return tuple(coordinates.unbind(-1)), out
        return indices.flatten(), out
