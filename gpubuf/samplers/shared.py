"""``SharedPrioritizedSampler``: a prioritized sampler that several processes use at once.

TorchRL's prioritized sampler is stateful and cannot be shared between processes: each worker
would update a private copy of the priority tree. This one keeps the tree (leaves, sums, mins)
and the tracked maximum priority in shared memory, and serialises every update and every
sample with a process-shared lock, so that writer processes giving new rows their default
priority and a learner sampling and updating priorities all work on one tree.

How to share it: build the buffer's sampler explicitly, then hand the sampler to the workers
through ``multiprocessing`` (``Process`` arguments, with the fork or the spawn start method),
alongside the memmap storage::

    storage = LazyMemmapStorage(1_000_000)
    sampler = SharedPrioritizedSampler(1_000_000, alpha=0.7, beta=0.5)
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, sampler=sampler)
    rb.extend(first_batch)
    workers = [ctx.Process(target=actor, args=(storage, sampler)) for _ in range(8)]
    # in each actor: rb = ReplayBuffer(storage=storage, sampler=sampler); rb.extend(...)

The shared memory travels through process creation (``multiprocessing`` pickles it as a
handle); a plain ``pickle`` elsewhere makes an independent copy. The lock is an ``flock`` on a
small file, which works the same for forked and spawned children. The tree lives on the CPU.
"""

from __future__ import annotations

import math
import os
import tempfile
import weakref
from typing import Any

import torch

from gpubuf.errors import DeviceMismatchError
from gpubuf.file_lock import FileLock
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.storages.checks import check_device

__all__ = ["SharedPrioritizedSampler"]


class SharedPrioritizedSampler(PrioritizedSampler):
    """A :class:`~gpubuf.samplers.PrioritizedSampler` shared between processes.

    Same arguments, semantics and results as :class:`~gpubuf.samplers.PrioritizedSampler`;
    the tree is on the CPU (``device`` other than ``"cpu"`` raises ``DeviceMismatchError``, a
    ``ValueError``; a device that does not exist, ``InvalidDeviceError``).

    Args:
        max_capacity, alpha, beta, eps, dtype, reduction, max_priority_within_buffer: see
            :class:`~gpubuf.samplers.PrioritizedSampler`.
        device: must be ``"cpu"`` or None. Sampled indices and weights are still returned on the
            storage's device.

    Keyword Args:
        stratified: see :class:`~gpubuf.samplers.PrioritizedSampler`.
    """

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        max_priority_within_buffer: bool = False,
        device: torch.device | str | None = None,
        *,
        stratified: bool = False,
    ) -> None:
        if device is not None and check_device(device).type != "cpu":
            raise DeviceMismatchError(f"a SharedPrioritizedSampler keeps its tree on the CPU, got device={device}")
        super().__init__(
            max_capacity,
            alpha,
            beta,
            eps,
            dtype,
            reduction,
            max_priority_within_buffer,
            device="cpu",
            stratified=stratified,
        )
        tree = self._tree
        # The tree and the tracked maximum (value and item) in shared memory: the update
        # kernel raises the maximum in place.
        for tensor in (tree.leaves, tree.sums, tree.mins, self._max_value, self._max_index):
            tensor.share_memory_()
        fd, path = tempfile.mkstemp(prefix="gpubuf_priorities_", suffix=".lock")
        os.close(fd)
        self._lock = FileLock(path)
        # The creating process removes the lock file when it exits.
        weakref.finalize(self._lock, _unlink_if, path, os.getpid())

    #: Its tree lives in memory other processes map: a loaded state is copied into it.
    shares_memory = True

    # ------------------------------------------------------------------ the maximum, in shared memory
    @property
    def _max_priority(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return PrioritizedSampler._max_priority.fget(self)

    @_max_priority.setter
    def _max_priority(self, state: tuple[Any, Any]) -> None:
        # Into the shared tensors, which every process maps (never new ones).
        value, index = state
        self._max_value.fill_(-math.inf if value is None else float(value))
        self._max_index.fill_(-1 if index is None else int(index))

    @property
    def default_priority(self) -> float:
        with self._lock:
            value = self._max_priority[0]
            return 1.0 if value is None else float(value)

    # ------------------------------------------------------------------ serialised operations
    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        """See :meth:`PrioritizedSampler.update_priority`; runs under the shared lock."""
        with self._lock:
            super().update_priority(index, priority, storage=storage)

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        with self._lock:
            super().mark_update(index, storage=storage)

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        """See :meth:`PrioritizedSampler.sample`; runs under the shared lock (a consistent tree)."""
        with self._lock:
            return super().sample(storage, batch_size)

    def _retransform(self, old_alpha: float, new_alpha: float) -> None:
        with self._lock:
            super()._retransform(old_alpha, new_alpha)

    def _empty(self) -> None:
        with self._lock:
            super()._empty()

    def _move_to(self, device: torch.device) -> None:
        # The tree stays in shared host memory (the constructor fixed the device).
        return None

    def _fit_fanout(self) -> None:
        # Other processes map this tree: it keeps the shape the constructor gave it.
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """See :meth:`PrioritizedSampler.load_state_dict`; the values go into the shared tree."""
        with self._lock:
            shared = self._tree
            super().load_state_dict(state_dict)
            loaded, self._tree = self._tree, shared
            shared.leaves.copy_(loaded.leaves)
            shared.sums.copy_(loaded.sums)
            shared.mins.copy_(loaded.mins)

    # ------------------------------------------------------------------ pickling (process creation)
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # The storage travels on its own; the buffer in the other process binds it again.
        state["_storage"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._tree._reset_views()


def _unlink_if(path: str, pid: int) -> None:
    if os.getpid() == pid:
        try:
            os.unlink(path)
        except OSError:
            pass
