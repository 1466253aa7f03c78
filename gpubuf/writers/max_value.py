"""``TensorDictMaxValueWriter``: keeps the rows of highest rank (TorchRL's ``TensorDictMaxValueWriter``)."""

from __future__ import annotations

from multiprocessing.context import get_spawning_popen
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass

from gpubuf.errors import (
    ComponentTypeError,
    InvalidArgumentError,
    NotSharableError,
    RankKeyError,
    RankValueError,
    SchemaMismatchError,
    UnsupportedDataError,
)
from gpubuf.storages._layout import is_tensor_collection
from gpubuf.writers.base import Writer

__all__ = ["TensorDictMaxValueWriter", "RankKeyError", "RankValueError"]

_REDUCTIONS = ("max", "min", "mean", "median", "sum")


class TensorDictMaxValueWriter(Writer):
    """A writer that keeps the ``max_size`` rows of highest rank.

    While the storage has room, rows are written in order. Once it is full, a batch is ranked
    together with the stored rows and only the ``max_size`` highest ranks stay: each new row
    that makes the cut takes the slot of a stored row that does not. Ties keep the row already
    stored, then the earlier row of the batch. The whole batch is placed with one storage write
    (no Python loop over rows).

    Args:
        rank_key: the key of the rank of each row (default ``("next", "reward")``).
        reduction: how a rank with more than one element per row (e.g. the rewards of a
            trajectory) becomes one number: ``"max"``, ``"min"``, ``"mean"``, ``"median"`` or
            ``"sum"`` (default, as in TorchRL).

    Keyword Args:
        compilable: accepted for TorchRL compatibility.

    Raises:
        ValueError: an unknown reduction, or a storage with ``ndim > 1`` (registered).

    Examples:
        >>> rb = TensorDictReplayBuffer(storage=LazyTensorStorage(1), batch_size=1,
        ...                             writer=TensorDictMaxValueWriter(rank_key="key"))
        >>> rb.extend(TensorDict({"key": torch.arange(10), "obs": torch.arange(10)}, batch_size=10))
        >>> rb.sample()["obs"].item()
        9
    """

    def __init__(self, rank_key: Any = None, reduction: str = "sum", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        if rank_key is not None and not _is_key(rank_key):
            raise ComponentTypeError(
                f"rank_key must be a str or a tuple of str (a nested key), got {rank_key!r} ({type(rank_key).__name__})"
            )
        self._rank_key = ("next", "reward") if rank_key is None else rank_key
        self._reduction = reduction
        # The rank of the row in each slot, float64 on the CPU: ranking B + max_size numbers is
        # cheap there and keeps sort order exact for integer ranks up to 2**53.
        self._ranks = torch.empty(0, dtype=torch.float64)

    @property
    def rank_key(self) -> Any:
        return self._rank_key

    @property
    def reduction(self) -> str:
        return self._reduction

    def __getstate__(self) -> dict[str, Any]:
        """The writer's state for pickling; refused for a spawned process, as by TorchRL.

        Raises:
            NotSharableError: sent to a spawned process (a ``multiprocessing`` argument): the
                ranks of the kept rows live in this process, so two processes would evict and
                overwrite each other's rows.
        """
        if get_spawning_popen() is not None:
            raise NotSharableError(
                f"Writers of type {type(self).__name__} cannot be shared between processes: the ranks of the kept rows "
                "live in this process, so processes writing at once would overwrite each other's rows; expected a "
                "RoundRobinWriter, or the writer kept in one process"
            )
        return dict(self.__dict__)

    def register_storage(self, storage: Any) -> None:
        if storage.ndim > 1:
            raise InvalidArgumentError(
                "TensorDictMaxValueWriter is not compatible with storages with more than one dimension: store each "
                "trajectory as one row (ndim=1) so that its rank can be reduced"
            )
        super().register_storage(storage)

    # ------------------------------------------------------------------ ranks
    def _rank_of(self, data: Any, batched: bool) -> torch.Tensor:
        """One float64 rank per row of ``data`` (``[n]``, or ``[1]`` for one item), on the CPU."""
        if not is_tensor_collection(data):
            raise NotATensorCollectionError(
                f"{type(self).__name__} expects data to be a tensor collection (a TensorDict or tensorclass, whose "
                f"rank key it ranks), got {type(data).__name__}"
            )
        dims = data.batch_dims
        if dims > (2 if batched else 1) or (batched and dims == 0):
            expected = "[n] or [n, T]" if batched else "[] or [T]"
            raise SchemaMismatchError(f"expected data of batch size {expected}, got {list(data.batch_size)}")
        td = data._tensordict if is_tensorclass(data) else data
        rank = td.get(self._rank_key, None) if isinstance(td, TensorDictBase) else None
        if rank is None:
            raise RankKeyError(
                f"rank key {self._rank_key!r} not found in the data written (keys: {sorted(map(str, td.keys()))})"
            )
        rank = rank.detach().to("cpu", torch.float64)
        rows = rank.reshape(rank.shape[0] if batched and rank.ndim else 1, -1)
        if rows.shape[1] == 1:
            out = rows[:, 0]
        elif self._reduction == "median":
            out = rows.median(1).values
        else:
            out = getattr(rows, {"max": "amax", "min": "amin"}.get(self._reduction, self._reduction))(1)
        if bool(out.isnan().any()):
            raise RankValueError(f"rank {self._rank_key!r} holds NaN: rows cannot be ordered")
        return out

    def get_insert_index(self, data: Any) -> int | None:
        """The slot ``data`` (one item) would be written to, or None if it would be dropped. Reads only."""
        rank = float(self._rank_of(data, batched=False)[0])
        n, cap = self._stored(), self._storage.max_size
        if n < cap:
            return n
        lowest = int(torch.argmin(self._ranks[:n]))
        return lowest if rank > float(self._ranks[lowest]) else None

    def _stored(self) -> int:
        return min(len(self._storage), self._ranks.shape[0])

    # ------------------------------------------------------------------ writing
    def add(self, data: Any) -> int | None:
        """Writes one item if it ranks among the top rows.

        Returns:
            The slot written, or None when the item ranks below every stored row of a full storage.

        Raises:
            RankKeyError: no ``rank_key`` entry; UnsupportedDataError: not a tensor collection;
            RankValueError: a NaN rank. Nothing is written then.
        """
        index = self.get_insert_index(data)
        if index is None:
            return None
        rank = self._rank_of(data, batched=False)
        self._storage.set(index, data)
        self._set_ranks(torch.tensor([index]), rank)
        self._write_count += 1
        return index

    def extend(self, data: Any) -> torch.Tensor:
        """Writes the rows of a batch that rank among the top ``max_size`` (stored rows included).

        Returns:
            int64 ``[n]``: the slot of each row of ``data``, ``-1`` for the rows not kept (as in
            TorchRL; prioritized samplers ignore negative indices).

        Raises:
            RankKeyError, UnsupportedDataError, RankValueError, SchemaMismatchError: see
            :meth:`add`; and every error of the storage. The buffer is unchanged then.
        """
        ranks = self._rank_of(data, batched=True)
        n_new = ranks.shape[0]
        n, cap = self._stored(), self._storage.max_size
        # Stable descending sort: on ties the stored rows (first) and earlier rows win.
        pool = torch.cat([self._ranks[:n], ranks])
        keep = torch.sort(pool, descending=True, stable=True).indices[:cap]
        kept_new = torch.sort(keep[keep >= n]).values - n
        out = torch.full((n_new,), -1, dtype=torch.long)
        if kept_new.numel():
            stored_kept = torch.zeros(n, dtype=torch.bool)
            stored_kept[keep[keep < n]] = True
            free = torch.arange(n, min(cap, n + kept_new.numel()), dtype=torch.long)
            evicted = (~stored_kept).nonzero().squeeze(-1)
            slots = torch.cat([free, evicted])[: kept_new.numel()]
            self._storage.set(slots, _rows(data, kept_new))
            self._set_ranks(slots, ranks[kept_new])
            out[kept_new] = slots
            self._write_count += kept_new.numel()
        self._cursor = self._stored() % cap
        device = getattr(data, "device", None)
        return out.to(device) if device is not None else out

    def _set_ranks(self, slots: torch.Tensor, ranks: torch.Tensor) -> None:
        needed = int(slots.max()) + 1
        have = self._ranks.shape[0]
        if needed > have:
            # Grown geometrically but never past the capacity (which may be unbounded).
            grown = torch.full((min(max(needed, 2 * have, 16), self._storage.max_size),), float("-inf"), dtype=torch.float64)
            grown[:have] = self._ranks
            self._ranks = grown
        self._ranks[slots] = ranks
        self._cursor = self._stored() % self._storage.max_size

    def _empty(self, empty_write_count: bool = True) -> None:
        super()._empty(empty_write_count)
        self._ranks = torch.empty(0, dtype=torch.float64)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        n = self._stored()
        return {
            "_cursor": self._cursor,
            "_write_count": self._write_count,
            "_ranks": self._ranks[:n].clone(),
            # A nested key as a list: checkpoints hold JSON-like values.
            "rank_key": list(self._rank_key) if isinstance(self._rank_key, tuple) else self._rank_key,
            "reduction": self._reduction,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._ranks = torch.as_tensor(state_dict["_ranks"], dtype=torch.float64).clone()
        rank_key = state_dict.get("rank_key", self._rank_key)
        self._rank_key = tuple(rank_key) if isinstance(rank_key, list) else rank_key
        self._reduction = state_dict.get("reduction", self._reduction)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(cursor={self._cursor}, rank_key={self._rank_key}, reduction={self._reduction}, "
            f"rows={self._stored()})"
        )


def _rows(data: Any, positions: torch.Tensor) -> Any:
    """The rows ``positions`` of a batch (a TensorDict or tensorclass, possibly lazily stacked)."""
    if positions.numel() == data.batch_size[0] and bool((positions == torch.arange(positions.numel())).all()):
        return data
    return data[positions.to(data.device) if data.device is not None else positions]


class NotATensorCollectionError(UnsupportedDataError, RuntimeError):
    """Data that is not a TensorDict or tensorclass given to a :class:`TensorDictMaxValueWriter`
    (also a RuntimeError, the class TorchRL raises there)."""


def _is_key(key: Any) -> bool:
    """Whether ``key`` is a TensorDict key: a str, or a non-empty tuple of str."""
    if isinstance(key, str):
        return True
    return isinstance(key, tuple) and len(key) > 0 and all(isinstance(part, str) for part in key)
