"""``StalenessAwareSampler``: draws favour fresh items and skip stale ones (asynchronous training).

Follows TorchRL's sampler of the same name (MIT licence): the same weights and the same draws for
the same generator state.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpubuf.errors import EmptyBufferError
from gpubuf.samplers.base import Sampler

_EMPTY = "Cannot sample from an empty storage."


def _default_staleness_weight(staleness: torch.Tensor) -> torch.Tensor:
    """Freshness weight ``1 / (staleness + 1)``."""
    return 1.0 / (staleness.float() + 1.0)


class StalenessAwareSampler(Sampler):
    """Weights items by freshness and excludes those staler than ``max_staleness``.

    Each item's staleness is ``consumer_version - item[version_key]``; the training loop moves
    :attr:`consumer_version` (after each update). Items are drawn with probability proportional to
    ``staleness_weight_fn(staleness)`` (with replacement only when the batch is larger than the
    fresh items); ``info["staleness"]`` holds the drawn items' staleness.

    Args:
        max_staleness: items with a staleness above it are never drawn; ``-1`` (default): no limit.
        staleness_weight_fn: maps an int staleness tensor to float weights (default ``1 / (s + 1)``).
        version_key: the stored key of each item's policy version (default ``"policy_version"``).

    Examples:
        >>> sampler = StalenessAwareSampler(max_staleness=5)
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1000), sampler=sampler, batch_size=32)
        >>> sampler.consumer_version = step  # in the training loop
    """

    def __init__(
        self,
        max_staleness: int = -1,
        staleness_weight_fn: Callable | None = None,
        version_key: Any = "policy_version",
    ):
        self._consumer_version = 0
        self._max_staleness = max_staleness
        self._version_key = version_key
        self._weight_fn = _default_staleness_weight if staleness_weight_fn is None else staleness_weight_fn

    @property
    def consumer_version(self) -> int:
        """The current training iteration (consumer version)."""
        return self._consumer_version

    @consumer_version.setter
    def consumer_version(self, value: int) -> None:
        self._consumer_version = value

    def increment_consumer_version(self) -> None:
        """Adds one to :attr:`consumer_version`."""
        self._consumer_version += 1

    @property
    def max_staleness(self) -> int:
        """The largest staleness drawn; ``-1``: no limit."""
        return self._max_staleness

    @max_staleness.setter
    def max_staleness(self, value: int) -> None:
        self._max_staleness = value

    def _versions(self, storage: Any, n: int) -> torch.Tensor | None:
        layout = storage.layout
        leaves = storage._row_sources
        key = (self._version_key,) if isinstance(self._version_key, str) else tuple(self._version_key)
        if layout is not None and leaves and storage.ndim == 1:
            position = layout.index_of(key)
            if position is not None:
                # The stored column itself: no gather of the other fields.
                return leaves[position][:n]
        data = storage[:n]
        return data.get(self._version_key, None) if hasattr(data, "get") else None

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict]:
        """Returns ``(index, {"staleness": ...})``.

        Raises:
            EmptyBufferError: the storage is empty (TorchRL's RuntimeError and message).
            KeyError: the items have no ``version_key``.
            RuntimeError: every item is staler than ``max_staleness``.
        """
        n = len(storage)
        if n == 0:
            raise EmptyBufferError(_EMPTY)
        versions = self._versions(storage, n)
        if versions is None:
            raise KeyError(
                f"Could not find key {self._version_key!r} in the replay buffer storage. Make sure data written to "
                "the buffer contains this key (e.g., by adding the PolicyVersion transform to the environment or "
                "enabling policy-version tracking on the collector)."
            )
        staleness = self._consumer_version - versions.reshape(-1).float()
        if self._max_staleness >= 0:
            valid = (staleness <= self._max_staleness).nonzero(as_tuple=True)[0]
            if not len(valid):
                raise RuntimeError(
                    f"All {n} entries in the buffer exceed max_staleness={self._max_staleness} (consumer_version="
                    f"{self._consumer_version}). Increase max_staleness or update collector policy weights more "
                    "frequently."
                )
        else:
            valid = torch.arange(n, device=versions.device)
        weights = self._weight_fn(staleness[valid])
        weights = weights / weights.sum()
        drawn = torch.multinomial(weights, batch_size, replacement=batch_size > len(valid), generator=self._rng)
        index = valid[drawn]
        return index, {"staleness": staleness[index]}

    def _empty(self) -> None:
        self._consumer_version = 0

    def state_dict(self) -> dict[str, Any]:
        return {"consumer_version": self._consumer_version, "max_staleness": self._max_staleness}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._consumer_version = int(state_dict["consumer_version"])
        self._max_staleness = int(state_dict["max_staleness"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(consumer_version={self._consumer_version}, max_staleness={self._max_staleness})"
