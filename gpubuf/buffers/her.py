"""Hindsight Experience Replay (Andrychowicz et al., 2017): goals relabelled at sample time.

Follows TorchRL's ``HERReplayBuffer`` (MIT licence): the same episode boundaries, goal strategies
and random draws, so the same seed gives the same relabelled batch.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Literal

import torch
from tensordict import TensorDictBase

from gpubuf.buffers.tensordict import TensorDictReplayBuffer
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.random import RandomSampler


class HindsightStrategy(str, Enum):
    """Where a relabelled transition's goal comes from.

    Attributes:
        FUTURE: a later transition of the same episode (the strongest, empirically).
        FINAL: the episode's last transition.
        EPISODE: any transition of the same episode.
        RANDOM: any transition of the buffer.
    """

    FUTURE = "future"
    FINAL = "final"
    EPISODE = "episode"
    RANDOM = "random"

    def __str__(self) -> str:
        return self.value


class HERReplayBuffer(TensorDictReplayBuffer):
    """A TensorDict replay buffer that relabels goals (HER) in a share of each sample.

    The first ``int(batch_size * her_ratio)`` items of a sample get as desired goal the achieved
    goal of another transition (chosen by ``strategy``) and a reward recomputed by ``reward_fn``;
    the others keep theirs. Episodes end where ``end_key`` (or the ``terminated`` key beside it)
    is set, at the last written row, and, once the buffer wrapped, at the write cursor.

    Args:
        reward_fn: maps the relabelled transitions (a TensorDict with the new goal set) to their
            reward, shaped ``(*batch, 1)`` or ``(*batch,)``.

    Keyword Args:
        her_ratio: the share of each sample relabelled, in ``[0, 1]`` (default 0.8).
        strategy: a :class:`HindsightStrategy` or its value (default ``"future"``).
        goal_key: the desired goal (default ``"desired_goal"``); ``("next", goal_key)`` is
            relabelled too when stored.
        achieved_goal_key: the achieved goal (default ``"achieved_goal"``).
        reward_key: where the new reward goes (default ``("next", "reward")``).
        end_key: the episode-end flag (default ``("next", "done")``).
        sampler: draws the transitions (default :class:`~gpubuf.samplers.RandomSampler`).
        **kwargs: as :class:`~gpubuf.buffers.TensorDictReplayBuffer`.

    Raises:
        ValueError: ``her_ratio`` outside ``[0, 1]``, or an unknown strategy.
        KeyError: (at sample time) a goal key or both episode-end keys missing from the storage.
        NotImplementedError: (at sample time) a storage of ``ndim > 1``.

    Examples:
        >>> def reward_fn(td):
        ...     dist = (td["achieved_goal"] - td["desired_goal"]).norm(dim=-1, keepdim=True)
        ...     return (dist < 0.05).float()
        >>> rb = HERReplayBuffer(reward_fn=reward_fn, storage=LazyMemmapStorage(10_000), batch_size=256)
    """

    def __init__(
        self,
        reward_fn: Callable[[TensorDictBase], torch.Tensor],
        *,
        her_ratio: float = 0.8,
        strategy: HindsightStrategy | Literal["future", "final", "episode", "random"] = "future",
        goal_key: Any = "desired_goal",
        achieved_goal_key: Any = "achieved_goal",
        reward_key: Any = ("next", "reward"),
        end_key: Any = ("next", "done"),
        sampler: Sampler | None = None,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= her_ratio <= 1.0:
            raise ValueError(f"her_ratio must be in [0, 1], got {her_ratio}")
        super().__init__(sampler=RandomSampler() if sampler is None else sampler, **kwargs)
        self.reward_fn = reward_fn
        self.her_ratio = her_ratio
        self.strategy = HindsightStrategy(strategy)
        self.end_key = end_key
        self.goal_key = goal_key
        self.achieved_goal_key = achieved_goal_key
        self.reward_key = reward_key
        self._keys_validated = False
        self._episode_ends_cache: torch.Tensor | None = None
        self._last_cache_key: tuple = (-1, None, False)

    # ------------------------------------------------------------------ episodes
    def _terminated_key(self) -> Any:
        return self.end_key[:-1] + ("terminated",) if isinstance(self.end_key, tuple) else "terminated"

    def _last_written(self) -> int | None:
        cap = self._storage.max_size
        return None if self._writer._write_count == 0 else (self._writer._cursor - 1) % cap

    def _episode_ends(self) -> torch.Tensor:
        storage = self._storage
        key = (len(storage), self._last_written(), bool(storage._is_full))
        if key != self._last_cache_key:
            self._episode_ends_cache = self._build_episode_ends()
            self._last_cache_key = key
        return self._episode_ends_cache

    def _build_episode_ends(self) -> torch.Tensor:
        storage = self._storage
        n = len(storage)
        if n == 0:
            return torch.zeros(0, dtype=torch.long)
        if storage.ndim != 1:
            raise NotImplementedError(f"HERReplayBuffer currently only supports 1D storages (got ndim={storage.ndim}).")
        view = storage.get(slice(None))
        done = view.get(self.end_key, None)
        terminated = view.get(self._terminated_key(), None)
        if done is None and terminated is None:
            raise KeyError(
                f"Neither {self.end_key!r} nor {self._terminated_key()!r} were found in storage. Ensure episode "
                "boundaries are stored under one of these keys."
            )
        if done is not None and terminated is not None:
            boundary = done.bool() | terminated.bool()
        else:
            boundary = (done if done is not None else terminated).bool()
        ends = boundary.cpu().reshape(-1)[:n].nonzero(as_tuple=True)[0]
        if storage._is_full:
            # Past the wrap, the write cursor ends the newest (unfinished) episode.
            cursor = self._last_written()
            if cursor is not None and cursor % n not in ends.tolist():
                ends, _ = torch.sort(torch.cat([ends, torch.tensor([cursor % n], dtype=ends.dtype)]))
        elif not len(ends) or int(ends[-1]) != n - 1:
            ends = torch.cat([ends, torch.tensor([n - 1], dtype=ends.dtype)])
        return ends

    @staticmethod
    def _episode_range(idx: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        position = torch.searchsorted(ends, idx.to(ends.device), right=False).clamp(max=len(ends) - 1)
        end = ends[position]
        start = torch.where(position == 0, torch.zeros_like(end), ends[(position - 1).clamp(min=0)] + 1)
        return start, end

    def _goal_indices(self, idx: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, n_stored: int) -> torch.Tensor:
        n, device = len(idx), idx.device
        if self.strategy is HindsightStrategy.FUTURE:
            span = (ends - idx).clamp(min=0).float()
            return idx + (torch.rand(n, device=device) * (span + 1)).long().clamp(max=span.long())
        if self.strategy is HindsightStrategy.FINAL:
            return ends.clone()
        if self.strategy is HindsightStrategy.EPISODE:
            return starts + (torch.rand(n, device=device) * (ends - starts + 1).float()).long()
        return torch.randint(n_stored, (n,), device=device)

    def _check_keys(self) -> None:
        if self._keys_validated or len(self._storage) == 0:
            return
        first = self._storage.get(torch.tensor([0]))
        missing = [
            f"  {role}={key!r}"
            for key, role in ((self.goal_key, "goal_key"), (self.achieved_goal_key, "achieved_goal_key"))
            if first.get(key, None) is None
        ]
        if missing:
            raise KeyError(
                "The following keys are not present in storage:\n" + "\n".join(missing)
                + "\nEnsure they are stored in every transition before sampling."
            )
        self._keys_validated = True

    # ------------------------------------------------------------------ sampling
    def sample(self, batch_size: int | None = None, return_info: bool = False, include_info: bool | None = None) -> Any:
        """Samples a batch (see :meth:`TensorDictReplayBuffer.sample`) and relabels its first
        ``int(batch_size * her_ratio)`` items."""
        self._check_keys()
        data, info = super().sample(batch_size, return_info=True, include_info=include_info)
        self._relabel(data, info)
        return (data, info) if return_info else data

    def _relabel(self, data: TensorDictBase, info: dict) -> None:
        ends = self._episode_ends()
        if not len(ends):
            return
        idx = info["index"]
        idx = torch.as_tensor(idx[0] if isinstance(idx, tuple) else idx)
        n_her = int(idx.shape[0] * self.her_ratio)
        if n_her == 0:
            return
        her_idx = idx[:n_her].cpu()
        starts, stops = self._episode_range(her_idx, ends)
        sources = self._goal_indices(her_idx, starts, stops, len(self._storage))
        achieved = self._storage.get(sources).get(self.achieved_goal_key).to(data.device)
        part = data[:n_her]
        with data.unlock_():
            part.set_(self.goal_key, achieved)
            next_goal = ("next",) + (self.goal_key if isinstance(self.goal_key, tuple) else (self.goal_key,))
            if part.get(next_goal, None) is not None:
                part.set_(next_goal, achieved)
            part.set_(self.reward_key, self.reward_fn(part))

    # ------------------------------------------------------------------ state
    def empty(self, empty_write_count: bool = True) -> None:
        super().empty(empty_write_count=empty_write_count)
        self._episode_ends_cache = None
        self._last_cache_key = (-1, None, False)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(strategy={self.strategy.value!r}, her_ratio={self.her_ratio}, "
            f"goal_key={self.goal_key!r}, achieved_goal_key={self.achieved_goal_key!r}, "
            f"reward_key={self.reward_key!r}, storage={self._storage})"
        )
