"""``OfflineToOnlineReplayBuffer`` and ``prefill_replay_buffer``: an offline dataset next to a growing
online buffer (TorchRL's offline-to-online API, MIT licence)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from gpubuf.buffers.base import ReplayBuffer
from gpubuf.errors import BatchSizeError
from gpubuf.storages.base import Storage
from gpubuf.storages.tensor import LazyTensorStorage


def _load_dataset(name: str, **kwargs: Any) -> Any:
    """Resolves a dataset id such as ``"minari:..."`` or ``"d4rl:..."`` with TorchRL's loaders."""
    try:
        from torchrl.data.datasets.utils import load_dataset
    except ImportError as err:
        raise ImportError(
            f"the dataset id {name!r} is resolved by TorchRL's dataset loaders (pip install torchrl); or pass a "
            "replay buffer holding the dataset"
        ) from err
    return load_dataset(name, **kwargs)


class OfflineToOnlineReplayBuffer:
    """An immutable offline dataset and a growing online buffer, sampled in a fixed ratio.

    :meth:`extend` writes to the online buffer only. :meth:`sample` draws exactly
    ``round(offline_fraction * batch_size)`` items from the offline dataset and the rest from the
    online buffer, concatenated into one ``[batch_size]`` batch (only the offline dataset while the
    online buffer is empty or the offline share is the whole batch; only the online buffer once the
    offline share rounds to 0).

    Args:
        offline_dataset: a replay buffer (or dataset) holding the offline data, or a dataset id
            such as ``"minari:mujoco/hopper/expert-v0"`` (resolved with TorchRL's loaders).

    Keyword Args:
        online_storage: the online buffer's storage; excludes ``online_capacity``.
        online_capacity: the capacity of an online ``LazyTensorStorage``; excludes ``online_storage``.
        offline_fraction: the share of each batch drawn offline, in ``(0, 1)`` (default 0.5).
        batch_size: the default batch size of :meth:`sample` (required with a dataset id).
        transform: applied to the concatenated batch.
        **dataset_kwargs: passed to the dataset loader (dataset ids only).

    Raises:
        ValueError: both or neither of ``online_storage`` and ``online_capacity``; a fraction out
            of ``(0, 1)``; ``dataset_kwargs`` without a dataset id.

    Examples:
        >>> offline = ReplayBuffer(storage=LazyTensorStorage(1000))
        >>> offline.extend(TensorDict({"observation": torch.randn(1000, 4)}, [1000]))
        >>> rb = OfflineToOnlineReplayBuffer(offline_dataset=offline, online_capacity=500, batch_size=32)
        >>> rb.extend(TensorDict({"observation": torch.randn(10, 4)}, [10]))
        >>> rb.sample(32).batch_size
        torch.Size([32])
    """

    def __init__(
        self,
        offline_dataset: Any,
        *,
        online_storage: Storage | None = None,
        online_capacity: int | None = None,
        offline_fraction: float = 0.5,
        batch_size: int | None = None,
        transform: Callable | None = None,
        **dataset_kwargs: Any,
    ):
        if online_storage is not None and online_capacity is not None:
            raise ValueError("Provide online_storage OR online_capacity, not both.")
        if online_storage is None and online_capacity is None:
            raise ValueError("Provide one of online_storage or online_capacity.")
        if not 0.0 < offline_fraction < 1.0:
            raise ValueError(f"offline_fraction must be in (0, 1), got {offline_fraction}.")
        if isinstance(offline_dataset, str):
            if "batch_size" not in dataset_kwargs:
                if batch_size is None:
                    raise ValueError(
                        "batch_size must be provided when offline_dataset is a string, so the dataset can be "
                        "constructed."
                    )
                dataset_kwargs["batch_size"] = batch_size
            offline_dataset = _load_dataset(offline_dataset, **dataset_kwargs)
        elif dataset_kwargs:
            raise ValueError(
                "dataset_kwargs are only forwarded when offline_dataset is a string. Pass them directly to your "
                "dataset constructor instead."
            )
        if online_capacity is not None:
            online_storage = LazyTensorStorage(online_capacity)
        self._offline_buffer = offline_dataset
        self._online_buffer = ReplayBuffer(storage=online_storage)
        self._offline_fraction = offline_fraction
        self._base_offline_fraction = offline_fraction
        self._batch_size = batch_size
        self._transform = transform

    def extend(self, data: Any) -> torch.Tensor:
        """Writes online experience (to the online buffer); returns its indices there."""
        return self._online_buffer.extend(data)

    def sample(self, batch_size: int | None = None) -> Any:
        """A ``[batch_size]`` batch, ``round(offline_fraction * batch_size)`` of it offline.

        Raises:
            BatchSizeError: no batch size here nor in the constructor (a ValueError too, as TorchRL).
        """
        if batch_size is None:
            batch_size = self._batch_size
        if batch_size is None:
            raise _MissingBatchSize("batch_size must be provided either in __init__ or sample().")
        n_offline = round(self._offline_fraction * batch_size)
        if len(self._online_buffer) == 0 or n_offline >= batch_size:
            out = self._offline_buffer.sample(batch_size)
        elif n_offline == 0:
            out = self._online_buffer.sample(batch_size)
        else:
            out = torch.cat(
                [self._offline_buffer.sample(n_offline), self._online_buffer.sample(batch_size - n_offline)], dim=0
            )
        return self._transform(out) if self._transform is not None else out

    def anneal(self, step: int, total_steps: int) -> None:
        """Moves ``offline_fraction`` linearly from its initial value to 0 at ``total_steps``."""
        self._offline_fraction = self._base_offline_fraction * max(0.0, 1.0 - step / total_steps)

    @property
    def offline_fraction(self) -> float:
        """The current offline share of a batch."""
        return self._offline_fraction

    @property
    def offline_buffer(self) -> Any:
        """The offline dataset (never written)."""
        return self._offline_buffer

    @property
    def online_buffer(self) -> ReplayBuffer:
        """The online replay buffer."""
        return self._online_buffer

    def __len__(self) -> int:
        return len(self._offline_buffer) + len(self._online_buffer)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(offline={type(self._offline_buffer).__name__}, "
            f"offline_fraction={self._offline_fraction:.3f}, online_size={len(self._online_buffer)}, "
            f"batch_size={self._batch_size})"
        )


class _MissingBatchSize(BatchSizeError, ValueError):
    """No batch size for :meth:`OfflineToOnlineReplayBuffer.sample` (TorchRL raises a ValueError)."""


def prefill_replay_buffer(rb: Any, dataset: Any, n_samples: int | None = None, chunk_size: int = 1000) -> Any:
    """Copies up to ``n_samples`` items sampled from ``dataset`` into ``rb``, ``chunk_size`` at a time.

    Args:
        rb: the buffer to fill (mutated, and returned).
        dataset: a replay buffer or dataset, or a dataset id (resolved with TorchRL's loaders).
        n_samples: how many items to copy (default: the dataset's length).
        chunk_size: items per copy (and the loader's batch size for a dataset id).

    Returns:
        ``rb``.
    """
    if isinstance(dataset, str):
        dataset = _load_dataset(dataset, batch_size=chunk_size)
    total = min(n_samples, len(dataset)) if n_samples is not None else len(dataset)
    copied = 0
    while copied < total:
        chunk = min(chunk_size, total - copied)
        rb.extend(dataset.sample(chunk))
        copied += chunk
    return rb
