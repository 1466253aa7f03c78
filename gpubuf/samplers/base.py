"""The sampler interface (TorchRL's ``Sampler``)."""

from __future__ import annotations

from typing import Any

import torch

from gpubuf.errors import StateDictError


class Sampler:
    """Chooses which items a sample reads.

    A sampler is told about writes (:meth:`add`, :meth:`extend`) and priority updates, and
    returns ``(index, info)`` from :meth:`sample`. ``self._rng`` is the ``torch.Generator`` the
    buffer hands to every component (``None``: torch's default generator).
    """

    _rng: torch.Generator | None = None

    def sample(self, storage: Any, batch_size: int) -> tuple[Any, dict]:
        raise NotImplementedError

    def add(self, index: int) -> None:
        return None

    def extend(self, index: torch.Tensor) -> None:
        return None

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> dict | None:
        return None

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        return None

    def _check_priority(self, priority: torch.Tensor) -> None:
        """Raises what :meth:`update_priority` would raise for ``priority``, without changing
        anything (the buffer checks priorities given with new rows before writing them)."""
        return None

    def _check_new_items(self) -> None:
        """Raises, before the buffer writes new rows, what :meth:`add`/:meth:`extend` would raise
        after them (the bookkeeping of new rows). Samplers that can refuse new rows override it."""
        return None

    @property
    def default_priority(self) -> float:
        return 1.0

    @property
    def ran_out(self) -> bool:
        return False

    @ran_out.setter
    def ran_out(self, value: bool) -> None:
        pass

    @property
    def _remaining_batches(self) -> int:
        return 1

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        return len(storage) > 0

    def _empty(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._check_state_dict(state_dict)

    def _check_state_dict(self, state_dict: Any) -> None:
        """Raises :class:`~gpubuf.errors.StateDictError` for a state :meth:`load_state_dict`
        would refuse, or that would leave the sampler broken; changes nothing."""
        if not isinstance(state_dict, dict):
            raise StateDictError(f"sampler state: expected a dict, got {type(state_dict).__name__}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
