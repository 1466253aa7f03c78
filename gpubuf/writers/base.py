"""The writer interface (TorchRL's ``Writer``): where new items go."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from gpubuf.storages.items import is_int
from gpubuf.errors import StateDictError
from gpubuf.storages.checks import check_state_keys


class Writer:
    """Base writer: keeps the write cursor and the count of items written.

    Args:
        compilable: accepted for TorchRL compatibility.
    """

    def __init__(self, compilable: bool = False) -> None:
        self._compilable = compilable
        self._storage = None
        self._cursor = 0
        self._write_count = 0
        self._rng: torch.Generator | None = None

    def register_storage(self, storage: Any) -> None:
        self._storage = storage

    def add(self, data: Any) -> Any:
        raise NotImplementedError

    def extend(self, data: Any) -> torch.Tensor:
        raise NotImplementedError

    def _check_writable(self) -> None:
        """Raises when the writer refuses writes that bypass it (``rb[index] = value``); the default accepts them."""

    def _empty(self, empty_write_count: bool = True) -> None:
        self._cursor = 0
        if empty_write_count:
            self._write_count = 0

    def _replicate_index(self, index: Any) -> Any:
        """For ``ndim > 1`` storages, one row per element written: ``[dim0, dim1, ...]`` coordinates."""
        storage = self._storage
        if storage.ndim == 1:
            return index
        rest = storage.shape[1:]
        device = index.device if isinstance(index, torch.Tensor) else torch.device("cpu")
        mesh = torch.stack(
            torch.meshgrid(*(torch.arange(d, device=device) for d in rest), indexing="ij"), -1
        ).flatten(0, -2)
        if is_int(index):
            head = torch.full((mesh.shape[0], 1), int(index), dtype=torch.long, device=device)
            return torch.cat([head, mesh], 1)
        return torch.cat([index.repeat_interleave(mesh.shape[0]).unsqueeze(1), mesh.repeat(index.numel(), 1)], 1)

    def state_dict(self) -> dict[str, Any]:
        return {"_cursor": self._cursor, "_write_count": self._write_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the cursor and write count; the state is checked before either changes.

        Raises:
            StateDictKeyError: no ``_cursor``.
            StateDictError: a cursor or write count that is not an int >= 0.
        """
        check_state_keys(state_dict, ("_cursor",), "writer state")
        values = {"_cursor": state_dict["_cursor"], "_write_count": state_dict.get("_write_count", self._write_count)}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.dtype.is_floating_point:
                value = values[key] = int(value)  # a compilable TorchRL writer keeps 0-d tensors
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise StateDictError(f"writer state: {key} must be an int >= 0, got {value!r}")
        self._cursor = int(values["_cursor"])
        self._write_count = int(values["_write_count"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cursor={self._cursor}, write_count={self._write_count})"

    # ------------------------------------------------------------------ TorchRL's remaining API
    @property
    def tracks_generations(self) -> bool:
        """Whether this writer counts each slot's writes (see ``RoundRobinWriter(track_generations=True)``)."""
        return False

    def generations_of(self, index: int | torch.Tensor) -> torch.Tensor:
        """The generation of the slots at ``index``: ``-1`` for a writer that does not track them."""
        return torch.full_like(torch.as_tensor(index, dtype=torch.long), -1)

    #: ``(dump(component, kind, path), load(component, kind, path))``: installed by the package from
    #: :mod:`gpubuf.checkpoint`, which reads the component's state (components never import it).
    _checkpoint_io: tuple[Callable[[Any, str, Any], None], Callable[[Any, str, Any], None]] | None = None

    def dumps(self, path: Any) -> None:
        """Writes this writer's state as a pickle-free checkpoint directory (see :mod:`gpubuf.checkpoint`)."""
        self._checkpoint_io[0](self, "writer", path)

    def loads(self, path: Any) -> None:
        """Restores this writer's state from :meth:`dumps`' directory (or a buffer checkpoint's writer)."""
        self._checkpoint_io[1](self, "writer", path)
