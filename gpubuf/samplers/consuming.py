"""``ConsumingSampler``: uniform sampling where an item is consumed after ``max_sample_count`` draws.

Follows TorchRL's ``ConsumingSampler`` (MIT licence): the same state, the same draws for the same
generator (``torch.randperm`` over the live indices), the same free list of consumed slots.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpubuf.errors import EmptyBufferError
from gpubuf.samplers.base import Sampler
from gpubuf.storages.items import is_int

_EMPTY = "Cannot sample from an empty storage."


class ConsumingSampler(Sampler):
    """Draws live items uniformly, without replacement within a batch; consumes them after
    ``max_sample_count`` draws.

    A consumed item is not drawn again until its slot is written anew; a buffer writes new items
    into consumed slots first (before advancing its cursor), and ``len(buffer)`` counts the live
    items.

    Args:
        max_sample_count: draws after which an item is consumed (default 1).

    Raises:
        TypeError, ValueError: ``max_sample_count`` is not a positive integer.

    Examples:
        >>> rb = ReplayBuffer(storage=ListStorage(10), sampler=ConsumingSampler(), batch_size=3)
        >>> rb.extend([torch.tensor(i) for i in range(4)])
        >>> len(rb.sample()), len(rb)
        (3, 1)
    """

    def __init__(self, max_sample_count: int = 1):
        if isinstance(max_sample_count, bool) or not isinstance(max_sample_count, (int, np.integer)):
            raise TypeError("max_sample_count must be a positive integer.")
        if max_sample_count < 1:
            raise ValueError("max_sample_count must be a positive integer.")
        self.max_sample_count = int(max_sample_count)
        self._empty()

    # ------------------------------------------------------------------ bookkeeping
    def _ensure_state(self, storage: Any = None, *, min_capacity: int = 0) -> None:
        """Sizes the per-slot counters for ``storage`` (and ``min_capacity``) and syncs its length."""
        if storage is not None:
            if storage.ndim != 1:
                raise ValueError(f"{type(self).__name__} only supports 1-dimensional storages, got storage.ndim={storage.ndim}.")
            storage_len = len(storage)
            min_capacity = max(min_capacity, storage_len)
            device = storage.data_device
        else:
            storage_len = self._known_storage_len
            device = self._sample_count.device if self._sample_count is not None else None
        current = 0 if self._sample_count is None else self._sample_count.numel()
        capacity = max(current, int(min_capacity))
        if self._sample_count is None or current < capacity or (
            device is not None and self._sample_count.device != device
        ):
            old_count, old_live = self._sample_count, self._live_mask
            self._sample_count = torch.zeros(capacity, dtype=torch.long, device=device)
            self._live_mask = torch.zeros(capacity, dtype=torch.bool, device=device)
            if old_count is not None:
                n = min(old_count.numel(), capacity)
                self._sample_count[:n] = old_count[:n].to(self._sample_count.device)
                self._live_mask[:n] = old_live[:n].to(self._live_mask.device)
            if self._free_indices is not None:
                self._free_indices = self._free_indices.to(self._sample_count.device)
        if storage is not None:
            known = self._known_storage_len
            if storage_len > known:
                self._sample_count[known:storage_len] = 0
                self._live_mask[known:storage_len] = True
            elif storage_len < known:
                self._sample_count[storage_len:known] = 0
                self._live_mask[storage_len:known] = False
            self._known_storage_len = storage_len
        self._live_mask &= self._sample_count < self.max_sample_count

    def _append_free_indices(self, index: torch.Tensor) -> None:
        if not index.numel():
            return
        index = index.to(self._sample_count.device, dtype=torch.long).reshape(-1)
        if self._free_indices is not None:
            rest = self._free_indices[self._free_head :]
            index = torch.cat([rest, index]) if rest.numel() else index.clone()
        else:
            index = index.clone()
        self._free_indices, self._free_head = index, 0

    def _mark_indices_live(self, index: Any) -> None:
        if isinstance(index, tuple):
            raise ValueError(f"{type(self).__name__} only supports flat 1-dimensional indices.")
        if is_int(index):
            index = torch.as_tensor([int(index)], dtype=torch.long)
        else:
            index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
        if not index.numel():
            return
        self._ensure_state(min_capacity=int(index.max()) + 1)
        index = index.to(self._sample_count.device)
        self._sample_count[index] = 0
        self._live_mask[index] = True
        self._known_storage_len = max(self._known_storage_len, int(index.max()) + 1)
        self._ran_out = False

    def add(self, index: int) -> None:
        self._mark_indices_live(index)

    def extend(self, index: torch.Tensor) -> None:
        self._mark_indices_live(index)

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        if storage is not None:
            self._ensure_state(storage)
        self._mark_indices_live(index)

    def _num_sampleable(self, storage: Any = None) -> int:
        self._ensure_state(storage)
        return int(self._live_mask[: self._known_storage_len].sum())

    def _visible_len(self, storage: Any) -> int:
        return self._num_sampleable(storage)

    def _sampleable_count(self, storage: Any, batch_size: int) -> int:
        return self._num_sampleable(storage)

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        return self._num_sampleable(storage) > 0

    def _pop_consumed_indices(self, storage: Any = None, max_count: int | None = None) -> torch.Tensor:
        """Up to ``max_count`` consumed slots to write into, oldest consumed first."""
        self._ensure_state(storage)
        popped = []
        if self._free_indices is not None:
            while self._free_head < self._free_indices.numel():
                if max_count is not None and len(popped) >= max_count:
                    break
                candidate = int(self._free_indices[self._free_head])
                self._free_head += 1
                if (
                    candidate < self._known_storage_len
                    and not bool(self._live_mask[candidate])
                    and int(self._sample_count[candidate]) >= self.max_sample_count
                ):
                    popped.append(candidate)
            if self._free_head >= self._free_indices.numel():
                self._free_indices, self._free_head = None, 0
        return torch.tensor(popped, dtype=torch.long)

    # ------------------------------------------------------------------ sampling
    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict]:
        """Returns ``(index, {})``: up to ``batch_size`` distinct live indices; counts them drawn.

        Raises:
            EmptyBufferError: no live item (TorchRL's RuntimeError and message).
        """
        self._ensure_state(storage)
        if len(storage) == 0 or self._num_sampleable(storage) == 0:
            self._ran_out = True
            self._remaining = 0
            raise EmptyBufferError(_EMPTY)
        live = torch.nonzero(self._live_mask[: self._known_storage_len], as_tuple=False).flatten()
        size = min(batch_size, live.numel())
        index = live[torch.randperm(live.numel(), generator=self._rng, device=live.device)[:size]]
        self._sample_count[index] += 1
        self._live_mask[index] = self._sample_count[index] < self.max_sample_count
        self._append_free_indices(index[~self._live_mask[index]])
        left = self._num_sampleable(storage)
        self._remaining = -(left // -batch_size)
        self._ran_out = left == 0
        return index, {}

    @property
    def ran_out(self) -> bool:
        return self._ran_out

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        self._ran_out = value

    @property
    def _remaining_batches(self) -> int:
        return self._remaining

    def _empty(self) -> None:
        self._sample_count: torch.Tensor | None = None
        self._live_mask: torch.Tensor | None = None
        self._known_storage_len = 0
        self._free_indices: torch.Tensor | None = None
        self._free_head = 0
        self._ran_out = False
        self._remaining = 0

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        free = None if self._free_indices is None else self._free_indices[self._free_head :].clone()
        return {
            "max_sample_count": self.max_sample_count,
            "_sample_count": self._sample_count,
            "_live_mask": self._live_mask,
            "_known_storage_len": self._known_storage_len,
            "_free_indices": free,
            "_free_head": 0,
            "_ran_out": self._ran_out,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        def clone(value: Any) -> Any:
            return value.clone() if isinstance(value, torch.Tensor) else value

        self.max_sample_count = int(state_dict["max_sample_count"])
        self._sample_count = clone(state_dict["_sample_count"])
        self._live_mask = clone(state_dict["_live_mask"])
        self._known_storage_len = int(state_dict["_known_storage_len"])
        self._free_indices = clone(state_dict.get("_free_indices"))
        self._free_head = int(state_dict.get("_free_head", 0))
        self._ran_out = bool(state_dict["_ran_out"])
        self._remaining = 0 if self._live_mask is None else int(self._live_mask[: self._known_storage_len].sum())

    def __repr__(self) -> str:
        live = 0 if self._live_mask is None else int(self._live_mask[: self._known_storage_len].sum())
        return f"{type(self).__name__}(max_sample_count={self.max_sample_count}, sampleable={live})"
