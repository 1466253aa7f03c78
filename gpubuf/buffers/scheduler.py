"""Schedulers of a sampler's parameters (``torchrl.data.replay_buffers.scheduler``'s API).

A scheduler moves one attribute of a sampler (say a :class:`~gpubuf.samplers.PrioritizedSampler`'s
``beta``) a step at a time. It takes a gpubuf :class:`~gpubuf.buffers.ReplayBuffer` (its sampler
is adjusted) or a gpubuf :class:`~gpubuf.samplers.Sampler`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import numpy as np
import torch

from gpubuf.buffers.base import ReplayBuffer
from gpubuf.samplers.base import Sampler

__all__ = ["ParameterScheduler", "LambdaScheduler", "LinearScheduler", "StepScheduler", "SchedulerList"]


class ParameterScheduler(ABC):
    """Adjusts the value of one attribute of a replay buffer's sampler, step by step.

    Args:
        obj: the replay buffer whose sampler to adjust, or the sampler itself.
        param_name: the attribute to adjust, e.g. ``"beta"``.
        min_value: a lower bound of the value (default: none).
        max_value: an upper bound of the value (default: none).

    Raises:
        TypeError: ``obj`` is neither a gpubuf ``ReplayBuffer`` nor a ``Sampler``.
        ValueError: the sampler has no attribute ``param_name``.
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        if not isinstance(obj, (ReplayBuffer, Sampler)):
            raise TypeError(
                "ParameterScheduler only supports Sampler class. Pass either `ReplayBuffer` or `Sampler` object. "
                f"Got {type(obj)} instead."
            )
        self.sampler = obj.sampler if isinstance(obj, ReplayBuffer) else obj
        self.param_name = param_name
        self._min_val = min_value if min_value is not None else float("-inf")
        self._max_val = max_value if max_value is not None else float("inf")
        if not hasattr(self.sampler, param_name):
            raise ValueError(f"Provided class {type(obj).__name__} does not have an attribute {param_name}")
        initial_val = getattr(self.sampler, param_name)
        if isinstance(initial_val, torch.Tensor):
            initial_val = initial_val.clone()
            self.backend = torch
        else:
            self.backend = np
        self.initial_val = initial_val
        self._step_cnt = 0

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state: every attribute but the sampler and the backend module."""
        state = dict(self.__dict__)
        del state["sampler"]
        del state["backend"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a state returned by :meth:`state_dict`."""
        self.__dict__.update(state_dict)

    def step(self) -> None:
        """Advances one step and sets the sampler's attribute to the new, clipped, value."""
        self._step_cnt += 1
        value = self.backend.clip(self._step(), self._min_val, self._max_val)
        setattr(self.sampler, self.param_name, value)

    @abstractmethod
    def _step(self) -> Any: ...


class LambdaScheduler(ParameterScheduler):
    """Sets the parameter to its initial value times ``lambda_fn(step_count)``.

    Args:
        obj: the replay buffer or sampler.
        param_name: the attribute to adjust.
        lambda_fn: maps the step count (an int) to a multiplicative factor.
        min_value: a lower bound (default: none).
        max_value: an upper bound (default: none).
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        lambda_fn: Callable[[int], float],
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        super().__init__(obj, param_name, min_value, max_value)
        self.lambda_fn = lambda_fn

    def _step(self) -> Any:
        return self.initial_val * self.lambda_fn(self._step_cnt)


class LinearScheduler(ParameterScheduler):
    """Moves the parameter linearly from its initial value to ``final_value`` in ``num_steps`` steps.

    Args:
        obj: the replay buffer or sampler.
        param_name: the attribute to adjust.
        final_value: the value reached after ``num_steps`` steps (and kept after).
        num_steps: the number of steps of the interpolation.

    Examples:
        >>> scheduler = LinearScheduler(rb, param_name="beta", final_value=1.0, num_steps=4)
        >>> scheduler.step()  # beta: 0.6 -> 0.7 for an initial beta of 0.6
    """

    def __init__(self, obj: ReplayBuffer | Sampler, param_name: str, final_value: int | float, num_steps: int):
        super().__init__(obj, param_name)
        if isinstance(self.initial_val, torch.Tensor):
            final_value = torch.tensor(final_value).to(self.initial_val)
        self.final_val = final_value
        self.num_steps = num_steps
        self._delta = (self.final_val - self.initial_val) / self.num_steps

    def _step(self) -> Any:
        if self._step_cnt < self.num_steps:
            return self.initial_val + self._delta * self._step_cnt
        return self.final_val


class StepScheduler(ParameterScheduler):
    """Multiplies (or adds) ``gamma`` to the parameter every ``n_steps`` steps.

    Args:
        obj: the replay buffer or sampler.
        param_name: the attribute to adjust.
        gamma: the factor (``"multiplicative"``) or increment (``"additive"``).
        n_steps: the period, in steps.
        mode: ``"multiplicative"`` or ``"additive"``.
        min_value: a lower bound (default: none).
        max_value: an upper bound (default: none).

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(
        self,
        obj: ReplayBuffer | Sampler,
        param_name: str,
        gamma: int | float = 0.9,
        n_steps: int = 1,
        mode: str = "multiplicative",
        min_value: int | float | None = None,
        max_value: int | float | None = None,
    ):
        super().__init__(obj, param_name, min_value, max_value)
        self.gamma = gamma
        self.n_steps = n_steps
        self.mode = mode
        if mode == "additive":
            self.operator = self.backend.add
        elif mode == "multiplicative":
            self.operator = self.backend.multiply
        else:
            raise ValueError(f"Invalid mode: {mode}. Choose 'multiplicative' or 'additive'.")

    def _step(self) -> Any:
        current = getattr(self.sampler, self.param_name)
        if self._step_cnt % self.n_steps == 0:
            return self.operator(current, self.gamma)
        return current


class SchedulerList:
    """Steps several schedulers together.

    Args:
        schedulers: the schedulers (or a single one).
    """

    def __init__(self, schedulers: list[ParameterScheduler]) -> None:
        if isinstance(schedulers, ParameterScheduler):
            schedulers = [schedulers]
        self.schedulers = schedulers

    def append(self, scheduler: ParameterScheduler) -> None:
        self.schedulers.append(scheduler)

    def step(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()
