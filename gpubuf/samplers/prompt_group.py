"""``PromptGroupSampler``: batches of whole groups of items sharing a key (LLM post-training).

Follows TorchRL's sampler of the same name (MIT licence): the same groups, the same strategies,
the same draws for the same generator.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Any, Literal

import numpy as np
import torch
from tensordict import is_tensor_collection

from gpubuf.errors import EmptyBufferError
from gpubuf.samplers.base import Sampler

_EMPTY = "Cannot sample from an empty storage."


class PromptGroupSampler(Sampler):
    """Draws ``samples_per_group`` items from each of ``num_groups`` groups of items that share
    ``group_key`` (a prompt id or text), the batch layout of group-relative objectives (GRPO).

    Keyword Args:
        num_groups: groups per batch; exactly one of it and ``samples_per_group`` is given, the
            other follows from the batch size.
        samples_per_group: items per group.
        group_key: the key naming each item's group (ints or strings); default ``"query"``.
        strategy: ``"random"`` (default), ``"recency"`` (newest items of each group),
            ``"reward"`` (highest reward) or ``"variance"`` (the subset of largest reward variance,
            ties by total reward).
        reward_key: the reward of ``"reward"`` and ``"variance"`` (averaged over trailing dims);
            default ``("next", "reward")``.
        cache_groups: keep the group index until items are written (default True).

    Raises:
        TypeError, ValueError: both or neither of ``num_groups`` and ``samples_per_group``, a
            non-positive one, or an unknown strategy.

    A group smaller than ``samples_per_group`` (or fewer groups than ``num_groups``) is completed
    with replacement, with one warning.

    Examples:
        >>> rb = ReplayBuffer(storage=LazyStackStorage(100), batch_size=8,
        ...                   sampler=PromptGroupSampler(num_groups=2, group_key="prompt"))
        >>> rb.extend(TensorDict({"prompt": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]),
        ...                       "reward": torch.arange(12.0)}, [12]))
        >>> int(rb.sample()["prompt"].unique().numel())
        2
    """

    def __init__(
        self,
        *,
        num_groups: int | None = None,
        samples_per_group: int | None = None,
        group_key: Any = "query",
        strategy: Literal["random", "recency", "reward", "variance"] = "random",
        reward_key: Any = ("next", "reward"),
        cache_groups: bool = True,
    ) -> None:
        if (num_groups is None) == (samples_per_group is None):
            raise TypeError(
                "Exactly one of num_groups or samples_per_group must be provided, "
                f"got num_groups={num_groups} and samples_per_group={samples_per_group}."
            )
        name = "num_groups" if num_groups is not None else "samples_per_group"
        value = num_groups if num_groups is not None else samples_per_group
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be a positive integer, got {value!r}.")
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if strategy not in ("random", "recency", "reward", "variance"):
            raise ValueError(
                f"Unknown strategy={strategy!r}. Expected one of 'random', 'recency', 'reward', 'variance'."
            )
        self.num_groups = int(num_groups) if num_groups is not None else None
        self.samples_per_group = int(samples_per_group) if samples_per_group is not None else None
        self.group_key = group_key
        self.strategy = strategy
        self.reward_key = reward_key
        self.cache_groups = cache_groups
        self._position_recency: torch.Tensor | None = None
        self._recency_clock = 0
        self._warned_small_group = False
        self._invalidate_cache()

    # ------------------------------------------------------------------ groups
    def _shape(self, batch_size: int) -> tuple[int, int]:
        per = self.num_groups if self.num_groups is not None else self.samples_per_group
        name = "num_groups" if self.num_groups is not None else "samples_per_group"
        if batch_size % per:
            raise ValueError(f"batch_size={batch_size} is not divisible by {name}={per}.")
        if self.num_groups is not None:
            return per, batch_size // per
        return batch_size // per, per

    def _randperm(self, n: int) -> torch.Tensor:
        device = self._rng.device if self._rng is not None else None
        return torch.randperm(n, generator=self._rng, device=device).cpu()

    def _randint(self, n: int, k: int) -> torch.Tensor:
        device = self._rng.device if self._rng is not None else None
        return torch.randint(n, (k,), generator=self._rng, device=device).cpu()

    def _build_index(self, storage: Any) -> None:
        length = len(storage)
        if (
            self.cache_groups
            and self._group_index is not None
            and length == self._index_len
            and self._cache_storage_id == id(storage)
        ):
            return
        data = storage[:]
        if not is_tensor_collection(data):
            raise TypeError(
                f"{type(self).__name__} requires a single-dimensional storage whose slices return a tensor "
                "collection, such as LazyTensorStorage or LazyStackStorage. Plain ListStorage is not supported."
            )
        values = data.get(self.group_key)
        values = values.tolist() if hasattr(values, "tolist") else list(values)
        keys = [tuple(v) if isinstance(v, list) else v for v in values]
        if len(keys) != length:
            raise RuntimeError(
                f"Expected group_key={self.group_key!r} to contain one value per storage item, got {len(keys)} "
                f"values for {length} items."
            )
        groups: dict[Any, list[int]] = defaultdict(list)
        for position, key in enumerate(keys):
            groups[key].append(position)
        self._group_index = {key: torch.tensor(p, dtype=torch.long) for key, p in groups.items()}
        if self.strategy in ("reward", "variance"):
            reward = data.get(self.reward_key)
            if not isinstance(reward, torch.Tensor):
                raise TypeError(
                    f"The {self.strategy!r} strategy requires reward_key={self.reward_key} to hold a tensor, got "
                    f"{type(reward)}."
                )
            self._row_rewards = reward.reshape(reward.shape[0], -1).float().mean(-1).cpu()
        self._index_len = length
        self._cache_storage_id = id(storage)
        if self.strategy == "recency":
            self._ensure_recency(length)

    def _select_groups(self, num_groups: int) -> list:
        keys = list(self._group_index)
        n = len(keys)
        if n >= num_groups:
            return [keys[i] for i in self._randperm(n)[:num_groups].tolist()]
        self._warn_small()
        selected = [keys[i] for i in self._randperm(n).tolist()]
        selected.extend(keys[i] for i in self._randint(n, num_groups - n).tolist())
        return selected

    def _select_max_variance(self, positions: torch.Tensor, k: int) -> torch.Tensor:
        # A largest-variance subset of size k is some of the lowest rewards plus some of the highest.
        rewards = self._row_rewards[positions].double()
        order = torch.argsort(rewards)
        values = rewards[order]
        n = values.numel()
        prefix = torch.cat([values.new_zeros(1), values.cumsum(0)])
        prefix_sq = torch.cat([values.new_zeros(1), values.square().cumsum(0)])
        low = torch.arange(k + 1)
        high = k - low
        totals = prefix[low] + prefix[n] - prefix[n - high]
        totals_sq = prefix_sq[low] + prefix_sq[n] - prefix_sq[n - high]
        variances = totals_sq / k - (totals / k).square()
        best = torch.where(
            torch.isclose(variances, variances.max(), rtol=1e-12, atol=1e-12), totals, totals.new_full((), -torch.inf)
        ).argmax()
        rank = torch.arange(n)
        return positions[order[(rank < best) | (rank >= n - (k - best))]]

    def _select_within(self, positions: torch.Tensor, k: int) -> torch.Tensor:
        n = positions.numel()
        if n < k:
            self._warn_small()
            return torch.cat([self._select_within(positions, n), positions[self._randint(n, k - n)]])
        if self.strategy == "recency":
            return positions[torch.argsort(self._position_recency[positions])[-k:]]
        if self.strategy == "reward":
            return positions[torch.topk(self._row_rewards[positions], k).indices]
        if self.strategy == "variance":
            return self._select_max_variance(positions, k)
        return positions[self._randperm(n)[:k]]

    def _warn_small(self) -> None:
        if not self._warned_small_group:
            warnings.warn(
                "A group (or the set of groups) was smaller than the requested sample size; completing the draw with "
                "replacement. Add more data or lower num_groups/samples_per_group to avoid this.",
                stacklevel=3,
            )
            self._warned_small_group = True

    def sample(self, storage: Any, batch_size: int) -> tuple[torch.Tensor, dict]:
        """Returns ``(index, {})``: the groups' items one group after the other.

        Raises:
            EmptyBufferError: the storage is empty (TorchRL's RuntimeError and message).
            NotImplementedError: a multi-dimensional storage.
            ValueError: a batch size not divisible by the group shape.
        """
        if len(storage) == 0:
            raise EmptyBufferError(_EMPTY)
        if storage.ndim > 1:
            raise NotImplementedError(
                f"{type(self).__name__} only supports single-dimensional storages, got storage.ndim={storage.ndim}."
            )
        num_groups, per_group = self._shape(batch_size)
        self._build_index(storage)
        selected = self._select_groups(num_groups)
        return torch.cat([self._select_within(self._group_index[key], per_group) for key in selected], 0), {}

    # ------------------------------------------------------------------ writes
    def _invalidate_cache(self) -> None:
        self._group_index: dict | None = None
        self._row_rewards: torch.Tensor | None = None
        self._index_len = 0
        self._cache_storage_id: int | None = None

    def _record_update(self, index: Any) -> None:
        if self.strategy != "recency":
            return
        index = torch.as_tensor(index, dtype=torch.long).reshape(-1).cpu()
        if not index.numel():
            return
        size = int(index.max()) + 1
        if self._position_recency is None:
            self._position_recency = torch.full((size,), -1, dtype=torch.long)
        elif self._position_recency.numel() < size:
            pad = torch.full((size - self._position_recency.numel(),), -1, dtype=torch.long)
            self._position_recency = torch.cat([self._position_recency, pad])
        for position in index.tolist():
            self._recency_clock += 1
            self._position_recency[position] = self._recency_clock

    def _ensure_recency(self, length: int) -> None:
        if self._position_recency is None:
            self._position_recency = torch.arange(length, dtype=torch.long)
            self._recency_clock = max(self._recency_clock, length)
            return
        if self._position_recency.numel() < length:
            pad = torch.full((length - self._position_recency.numel(),), -1, dtype=torch.long)
            self._position_recency = torch.cat([self._position_recency, pad])
        recency = self._position_recency[:length]
        missing = (recency < 0).nonzero(as_tuple=True)[0]
        if not missing.numel():
            return
        known = recency[recency >= 0]
        if known.numel():
            stop = int(known.min())
            recency[missing] = torch.arange(stop - missing.numel(), stop, dtype=torch.long)
        else:
            recency[missing] = torch.arange(missing.numel(), dtype=torch.long)
            self._recency_clock = max(self._recency_clock, missing.numel())

    def extend(self, index: torch.Tensor) -> None:
        self._record_update(index)
        self._invalidate_cache()

    def add(self, index: int) -> None:
        self._record_update(index)
        self._invalidate_cache()

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        self._record_update(index)
        self._invalidate_cache()

    def _empty(self) -> None:
        self._invalidate_cache()
        self._position_recency = None
        self._recency_clock = 0
        self._warned_small_group = False

    def state_dict(self) -> dict[str, Any]:
        if self._position_recency is None:
            return {}
        return {"position_recency": self._position_recency.clone(), "recency_clock": self._recency_clock}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        recency = state_dict.get("position_recency")
        self._position_recency = recency.clone().cpu() if recency is not None else None
        self._recency_clock = int(state_dict.get("recency_clock", 0))
        self._invalidate_cache()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_group_index=None, _row_rewards=None, _index_len=0, _cache_storage_id=None)
        return state

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_groups={self.num_groups}, samples_per_group={self.samples_per_group}, "
            f"group_key={self.group_key}, strategy={self.strategy!r})"
        )
