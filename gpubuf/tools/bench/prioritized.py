"""The prioritized replay cycle: its providers and its raw-torch floor.

One *cycle* of batch size ``B`` is what a prioritized-replay training step does to its buffer:
sample ``B`` items in proportion to their priorities (draw, gather the rows, compute the
importance weights), then write ``B`` new priorities for them. The data is the uniform
workload's (:func:`~gpubuf.tools.bench.workloads.make_transitions`); before timing, every item
gets a random priority, the same for every provider.

Providers:

- ``gpubuf`` and ``torchrl``: ``TensorDictPrioritizedReplayBuffer`` (``sample(B)``, new
  priorities into the batch's ``"td_error"``, ``update_tensordict_priority``) and
  ``PrioritizedReplayBuffer`` (``sample(B, return_info=True)``, ``update_priority(info["index"],
  ...)``), each over ``LazyTensorStorage(N)`` with ``alpha = 0.7``, ``beta = 0.9``;
- ``raw``: the floor (see :func:`raw_cycle`), run by the uniform workload's raw provider.

The sampler's two steps are also timed alone, on ``TensorDictPrioritizedReplayBuffer``'s sampler
of either library (:func:`sampler_draw`, :func:`sampler_update`): the *draw* of ``B`` indices
and weights, and the *update* of ``B`` priorities. No rows are gathered in either.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from tensordict import TensorDict

#: Priority exponent and importance exponent of every provider.
ALPHA = 0.7
BETA = 0.9
EPS = 1e-8
#: The key the TensorDict buffers read new priorities from.
PRIORITY_KEY = "td_error"
TDPRB = "TensorDictPrioritizedReplayBuffer"
PRB = "PrioritizedReplayBuffer"

# Distinct priority vectors cycled through by the timed calls, made before timing.
_POOL = 4


def initial_priorities(rows: int, device: torch.device, seed: int = 1) -> torch.Tensor:
    """The priority every provider gives the ``rows`` items before timing: uniform in ``[0.01, 1.01)``."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(rows, generator=gen) + 0.01).to(device)


def priority_pool(size: int, device: torch.device, seed: int = 2) -> Callable[[], torch.Tensor]:
    """A callable returning, in turn, one of a few fixed random vectors of ``size`` new priorities."""
    gen = torch.Generator().manual_seed(seed + size)
    pool = [(torch.rand(size, generator=gen) + 0.01).to(device) for _ in range(_POOL)]
    return itertools.cycle(pool).__next__


def build_prioritized(ns: Any, buffer: str, storage: Any) -> Any:
    """``buffer`` (a class name of ``ns``, gpubuf or ``torchrl.data``) over ``storage``."""
    kwargs: dict[str, Any] = {"alpha": ALPHA, "beta": BETA, "eps": EPS, "storage": storage}
    if buffer == TDPRB:
        kwargs["priority_key"] = PRIORITY_KEY
    return getattr(ns, buffer)(**kwargs)


def buffer_cycle(rb: Any, buffer: str, size: int, device: torch.device) -> Callable[[], Any]:
    """One cycle of ``size`` on a prioritized buffer of either library, as a no-argument callable."""
    new_priority = priority_pool(size, device)
    if buffer == TDPRB:

        def cycle() -> Any:
            batch = rb.sample(size)
            batch.set(PRIORITY_KEY, new_priority())
            rb.update_tensordict_priority(batch)
            return batch

        return cycle

    def cycle() -> Any:
        batch, info = rb.sample(size, return_info=True)
        rb.update_priority(info["index"], new_priority())
        return batch

    return cycle


class RawCycleState:
    """The raw floor's priorities: transformed leaves and a flat float64 prefix sum of them.

    Args:
        rows: ``N``.
        device: where the tensors live.
    """

    def __init__(self, rows: int, device: torch.device) -> None:
        self.leaves = torch.pow(initial_priorities(rows, device).double() + EPS, ALPHA).float()
        self.cumsum = self.leaves.double().cumsum(0)
        self.total = self.cumsum[-1]
        self.p_min = self.leaves.min().double()


def raw_cycle(stores: list[torch.Tensor], state: RawCycleState, size: int) -> Callable[[], Any]:
    """The floor of a cycle of ``size``: the same steps in plain torch, with no tree to maintain.

    Draw ``size`` masses, ``searchsorted`` them in the flat prefix sum, ``index_select`` every
    field, weights ``(P / P_min) ** -beta``, transform the new priorities and ``index_copy_``
    them into the leaves. The prefix sum is never refreshed (that is ``O(N)`` per cycle), so
    this is a lower bound on the work of a cycle, not a working prioritized buffer; and a
    binary search over ``N`` entries misses the cache at every step, so for large batches a
    tree descent can beat it.
    """
    capacity = stores[0].shape[0]
    device = stores[0].device
    new_priority = priority_pool(size, device)

    def cycle() -> tuple[list[torch.Tensor], torch.Tensor]:
        mass = torch.rand(size, dtype=torch.float64, device=device) * state.total
        index = torch.searchsorted(state.cumsum, mass, right=True).clamp_max_(capacity - 1)
        batch = [torch.index_select(store, 0, index) for store in stores]
        weight = torch.pow(state.leaves.index_select(0, index).double() / state.p_min, -BETA).float()
        values = torch.pow(new_priority().double() + EPS, ALPHA).float()
        state.leaves.index_copy_(0, index, values)
        return batch, weight

    return cycle


def sampler_draw(rb: Any, size: int) -> Callable[[], Any]:
    """The draw alone: ``rb.sampler.sample(rb.storage, size)``, ``size`` indices and their weights."""
    sampler, storage = rb.sampler, rb.storage

    def draw() -> Any:
        return sampler.sample(storage, size)

    return draw


def index_pool(size: int, rows: int, device: torch.device, seed: int = 3) -> Callable[[], torch.Tensor]:
    """A callable returning, in turn, one of a few fixed vectors of ``size`` random indices below ``rows``.

    Several vectors, so that a CPU update does not find the same tree rows in its cache every call.
    """
    gen = torch.Generator().manual_seed(seed + size)
    pool = [torch.randint(0, rows, (size,), generator=gen).to(device) for _ in range(_POOL)]
    return itertools.cycle(pool).__next__


def sampler_update(rb: Any, size: int, device: torch.device) -> Callable[[], Any]:
    """The update alone: ``rb.sampler.update_priority`` of ``size`` new priorities at random indices."""
    sampler, storage = rb.sampler, rb.storage
    new_index = index_pool(size, len(rb), device)
    new_priority = priority_pool(size, device)

    def update() -> Any:
        return sampler.update_priority(new_index(), new_priority(), storage=storage)

    return update


def fill_priorities(rb: Any, data: TensorDict) -> None:
    """Gives every item of a filled prioritized buffer its :func:`initial_priorities`."""
    rows = data.batch_size[0]
    rb.update_priority(torch.arange(rows, device=data.device), initial_priorities(rows, data.device))


__all__ = [
    "ALPHA",
    "BETA",
    "EPS",
    "PRB",
    "PRIORITY_KEY",
    "TDPRB",
    "RawCycleState",
    "build_prioritized",
    "buffer_cycle",
    "fill_priorities",
    "index_pool",
    "initial_priorities",
    "priority_pool",
    "raw_cycle",
    "sampler_draw",
    "sampler_update",
]
