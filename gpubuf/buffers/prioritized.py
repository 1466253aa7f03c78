"""Prioritized replay buffers (TorchRL's ``PrioritizedReplayBuffer`` and ``TensorDictPrioritizedReplayBuffer``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDictBase
from tensordict.utils import unravel_key

from gpubuf.buffers.base import ReplayBuffer
from gpubuf.buffers.tensordict import TensorDictReplayBuffer
from gpubuf.errors import PriorityError
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.storages.base import Storage
from gpubuf.storages.list import ListStorage

__all__ = ["PrioritizedReplayBuffer", "TensorDictPrioritizedReplayBuffer"]


def _make_storage(storage: Storage | Callable[[], Storage] | None) -> Storage:
    # The sampler's capacity is the storage's, so the storage is built before the sampler.
    if storage is None:
        return ListStorage(max_size=1_000)
    if not isinstance(storage, Storage) and callable(storage):
        storage = storage()
    if not isinstance(storage, Storage):
        raise TypeError(f"storage must be a Storage or a callable returning one, got {type(storage).__name__}")
    return storage


def _check_sync(sync: bool) -> None:
    if not sync:
        raise NotImplementedError(
            "sync=False (writer processes with a uniform sampler, a learner-side priority tree) is not supported; "
            "expected sync=True. For writer processes, give a buffer a SharedPrioritizedSampler (one priority tree in "
            "shared memory that every process updates): PrioritizedReplayBuffer(sampler=...) or "
            "TensorDictReplayBuffer(sampler=..., priority_key=...), and hand the workers that buffer"
        )


class _PrioritizedMixin:
    """What both prioritized buffers share: the sampler owns the tree and knows the storage."""

    _sampler: Sampler
    _storage: Storage

    @property
    def prioritized_sampler(self) -> Sampler:
        """The sampler that owns the priority tree."""
        return self._sampler


class PrioritizedReplayBuffer(_PrioritizedMixin, ReplayBuffer):
    """Prioritized replay buffer (Schaul et al., 2015), ``torchrl.data.PrioritizedReplayBuffer``'s API.

    A :class:`ReplayBuffer` whose default sampler is a
    :class:`~gpubuf.samplers.PrioritizedSampler`: new items get the current max priority (1.0
    at first), :meth:`update_priority` sets priorities, and ``sample(..., return_info=True)``
    returns ``info["index"]`` and ``info["priority_weight"]``.

    Keyword Args:
        alpha: priority exponent, ``>= 0``.
        beta: importance-sampling exponent, ``>= 0``.
        eps: added to priorities before the exponent (default ``1e-8``).
        dtype: dtype of the tree's leaves and of the weights (``torch.float`` or ``torch.double``).
        storage: defaults to ``ListStorage(max_size=1000)``.
        sampler: a sampler to use instead of the default prioritized one.
        sampler_device: where the priority tree lives. Defaults to None: the storage's device.
            Every pairing works: CPU storage + CUDA tree (priorities are updated and drawn on
            the GPU, indices copied to the host for the gather), CUDA storage + CPU tree.
            ``info["index"]``, ``info["priority_weight"]`` and the batch come back on the
            storage's device (or the ``batch_device``, for the batch, when one is given).
            Cannot be combined with ``sampler``.
        sync: only True is supported (TorchRL's default).
        delayed_init: build the components at the first use (default False, TorchRL's default here).
        **kwargs: every other :class:`ReplayBuffer` argument (``collate_fn``, ``pin_memory``,
            ``prefetch``, ``transform``, ``batch_size``, ``dim_extend``, ``generator``, ...).

    Raises:
        TypeError: ``sampler_device`` together with ``sampler``.
        ValueError, CapacityError: invalid ``alpha``, ``beta``, ``eps`` or capacity.
        NotImplementedError: ``sync=False``, or an unsupported ``dtype``.

    Examples:
        >>> rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=LazyTensorStorage(10))
        >>> rb.extend(torch.arange(10))
        >>> sample, info = rb.sample(5, return_info=True)
        >>> rb.update_priority(info["index"], torch.ones(5) * 5)
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        storage: Storage | Callable[[], Storage] | None = None,
        sampler: Sampler | None = None,
        sampler_device: torch.device | str | None = None,
        sync: bool = True,
        delayed_init: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_sync(sync)
        storage = _make_storage(storage)
        if sampler is None:
            sampler = PrioritizedSampler(storage.max_size, alpha, beta, eps, dtype, device=sampler_device)
        elif sampler_device is not None:
            raise TypeError("sampler_device cannot be passed when sampler is provided")
        super().__init__(storage=storage, sampler=sampler, delayed_init=delayed_init, **kwargs)


class TensorDictPrioritizedReplayBuffer(_PrioritizedMixin, TensorDictReplayBuffer):
    """Prioritized replay buffer of TensorDicts, ``torchrl.data.TensorDictPrioritizedReplayBuffer``'s API.

    Extending with TensorDicts that hold ``priority_key`` sets those priorities (reduced per
    item with ``reduction`` when they have trailing dims); items without it get the current max
    priority. Sampled TensorDicts carry ``"index"`` and ``"priority_weight"``; after computing
    new priorities into ``priority_key`` of a sample, :meth:`update_tensordict_priority` writes
    them back.

    Keyword Args:
        alpha: priority exponent, ``>= 0``.
        beta: importance-sampling exponent, ``>= 0``.
        priority_key: the key of the priorities (default ``"td_error"``).
        eps: added to priorities before the exponent (default ``1e-8``).
        storage: defaults to ``ListStorage(max_size=1000)``, as in TorchRL.
        sampler_device: where the priority tree lives; see :class:`PrioritizedReplayBuffer`.
        sync: only True is supported.
        reduction: ``"max"`` (default), ``"min"``, ``"median"`` or ``"mean"``.
        dtype: dtype of the tree's leaves and weights (a gpubuf extension; TorchRL uses float).
        compilable: accepted for TorchRL compatibility (default False, TorchRL's default here).
        **kwargs: every other :class:`TensorDictReplayBuffer` argument.

    Examples:
        >>> rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=1.1, priority_key="td_error",
        ...                                        storage=LazyTensorStorage(100), batch_size=8)
        >>> rb.extend(TensorDict({"obs": torch.randn(10, 3)}, batch_size=[10]))
        >>> sample = rb.sample()
        >>> sample["td_error"] = torch.rand(8)
        >>> rb.update_tensordict_priority(sample)
    """

    def __init__(
        self,
        *,
        alpha: float,
        beta: float,
        priority_key: str = "td_error",
        eps: float = 1e-8,
        storage: Storage | Callable[[], Storage] | None = None,
        sampler_device: torch.device | str | None = None,
        sync: bool = True,
        reduction: str = "max",
        dtype: torch.dtype = torch.float,
        compilable: bool = False,
        **kwargs: Any,
    ) -> None:
        _check_sync(sync)
        if "sampler" in kwargs:
            raise TypeError("TensorDictPrioritizedReplayBuffer builds its own sampler; use TensorDictReplayBuffer")
        storage = _make_storage(storage)
        sampler = PrioritizedSampler(
            storage.max_size, alpha, beta, eps, dtype, reduction=reduction, device=sampler_device
        )
        super().__init__(priority_key=priority_key, storage=storage, sampler=sampler, compilable=compilable, **kwargs)

    def _check_priorities(self, data: Any, batched: bool) -> None:
        """Refuses bad priorities before anything is written, so a failed write changes nothing."""
        if not isinstance(data, TensorDictBase):
            return
        priority = data.get(self.priority_key, None)
        if priority is None:
            return
        priority = torch.as_tensor(priority)
        if batched and data.batch_dims and priority.numel() and priority.shape[0] != data.batch_size[0]:
            raise PriorityError(
                f"{self.priority_key!r} has shape {list(priority.shape)}, not one priority (row) per item of a batch "
                f"of {data.batch_size[0]}"
            )
        if priority.numel() == 0 and (not batched or data.batch_size[0] != 0):
            raise PriorityError(f"{self.priority_key!r} holds no priority")
        p = priority.detach().to(torch.float64) if not priority.dtype.is_floating_point else priority.detach()
        if not bool(torch.isfinite(p).all()):
            raise PriorityError(f"{self.priority_key!r} holds NaN or infinite priorities")
        if bool((p < 0).any()):
            raise PriorityError(f"{self.priority_key!r} holds negative priorities")

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """See :meth:`TensorDictReplayBuffer.extend`; priorities are validated before any write.

        Raises:
            PriorityError: ``priority_key`` holds NaN, infinite or negative values or has no
                priority per item; nothing is written.
        """
        if update_priority is None or update_priority:
            self._check_priorities(tensordicts, batched=True)
        stripped = self._align_priority_column(tensordicts)
        if stripped is None:
            return super().extend(tensordicts, update_priority=update_priority)
        # The batch carries priorities the storage has no column for: they set the priorities and
        # are not stored (the storage's keys were fixed by its first batch).
        index = super().extend(stripped, update_priority=False)
        if update_priority is None or update_priority:
            priority = tensordicts.get(self.priority_key)
            self.update_priority(index, self._reduce_priority(priority, tensordicts))
        return index

    def _align_priority_column(self, data: Any) -> Any:
        """Lets ``priority_key`` come and go between batches, as in TorchRL.

        Returns the batch without its priorities when the storage has no column for them (the
        caller sets the priorities from them), else None. A batch without priorities written to
        a storage that has the column gets it filled in place (in a shallow copy) with the
        priority new items get, the current maximum.
        """
        layout = self._storage.layout
        if layout is None or not isinstance(data, TensorDictBase) or len(self._transform):
            return None
        key = unravel_key(self.priority_key)
        key = key if isinstance(key, tuple) else (key,)
        position = layout.index_of(key)
        present = data.get(self.priority_key, None) is not None
        if present and position is None:
            return data.exclude(self.priority_key)
        if not present and position is not None and data.batch_dims:
            spec = layout.leaves[position]
            fill = torch.as_tensor(self._sampler.default_priority, dtype=spec.dtype, device=data.device)
            data.set(self.priority_key, fill.expand(*data.batch_size, *spec.shape).clone())
        return None

    def add(self, data: TensorDictBase) -> int:
        """See :meth:`TensorDictReplayBuffer.add`; the priority is validated before the write."""
        self._check_priorities(data, batched=False)
        return super().add(data)
