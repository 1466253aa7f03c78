"""``TensorDictReplayBuffer``: a replay buffer of TensorDicts whose samples carry their ``"index"``."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_tensorclass

from gpubuf.buffers.base import _INDEX_KEY, ReplayBuffer, _info_entries
from gpubuf.storages._layout import expand_as_batch, is_tensor_collection
from gpubuf.storages.compressed import CompressedListStorage
from gpubuf.errors import MissingKeyError, UnsupportedDataError
from gpubuf.samplers.base import Sampler
from gpubuf.writers import TensorDictRoundRobinWriter


class TensorDictReplayBuffer(ReplayBuffer):
    """A :class:`ReplayBuffer` specialised for TensorDicts (``torchrl.data.TensorDictReplayBuffer``).

    Extending records each item's ``"index"`` in the stored rows (the given TensorDict is left as
    it was, as TorchRL leaves it) and sampled TensorDicts carry ``"index"`` (and
    ``"priority_weight"`` with a prioritized sampler) from the sampler's info, so that their
    priorities can be updated later.

    Keyword Args:
        priority_key: the key holding priorities for :meth:`update_tensordict_priority`
            (default ``"td_error"``).
        **kwargs: as :class:`ReplayBuffer`; the default writer is
            :class:`~gpubuf.writers.TensorDictRoundRobinWriter`.
    """

    _default_writer = TensorDictRoundRobinWriter
    _reports_generations = True
    _tensordict_items = True
    #: ``(layout, info keys, stored)`` of the last draw (see :meth:`_stored_entries`).
    _stored_entries_of: tuple | None = None

    def __init__(self, *, priority_key: str = "td_error", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(self._storage, CompressedListStorage):
            # What this buffer samples is stacked: its items keep one structure.
            self._storage.same_structure = True
        self.priority_key = priority_key

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        """Writes a batch of TensorDicts; sets ``tensordicts["index"]``; updates priorities from
        ``priority_key`` when present (and ``update_priority`` is not False).

        An empty batch (no item along the extend dim) writes nothing and returns an empty
        index, as TorchRL's TensorDict buffers do; :class:`ReplayBuffer` refuses one.

        Raises:
            UnsupportedDataError: the data is not a TensorDict (use :class:`ReplayBuffer` for
                tensorclasses and other data).
            Every error of :meth:`ReplayBuffer.extend`, with the buffer unchanged.
        """
        if not isinstance(tensordicts, TensorDictBase):
            raise UnsupportedDataError(
                f"{type(self).__name__}.extend takes a TensorDict, got {type(tensordicts).__name__}; "
                "use ReplayBuffer for tensorclasses and other data"
            )
        if len(self._transform):
            tensordicts = self._transform.inv(tensordicts)
        else:
            # The writer records "index" in what it writes; like TorchRL, that goes into a shallow
            # copy so the caller's TensorDict is left as it was.
            tensordicts = _top_level_copy(tensordicts)
        if tensordicts is None:
            return torch.zeros((0, self._storage.ndim), dtype=torch.long)
        if tensordicts.batch_dims > self._dim_extend and tensordicts.batch_size[self._dim_extend] == 0:
            # An empty batch writes nothing, as TorchRL's TensorDict buffers take it (a collector
            # step that kept no transition): no index, no cursor move, no priority.
            return torch.zeros((0,) if self._storage.ndim == 1 else (0, self._storage.ndim), dtype=torch.long)
        if update_priority is None or update_priority:
            self._check_item_priority(tensordicts)
        index = self._extend(tensordicts)
        if update_priority is None or update_priority:
            priority = tensordicts.get(self.priority_key, None)
            if priority is not None:
                self.update_priority(index, self._reduce_priority(priority, tensordicts))
        return index

    def _check_extend(self, data: Any) -> None:
        if not isinstance(data, TensorDictBase):
            raise UnsupportedDataError(
                f"{type(self).__name__}.extend takes a TensorDict, got {type(data).__name__}; "
                "use ReplayBuffer for tensorclasses and other data"
            )
        self._check_item_priority(data)
        super()._check_extend(data)

    def add(self, data: TensorDictBase) -> int:
        if len(self._transform):
            data = self._transform.inv(data)
        self._check_item(data, "add")
        if not is_tensor_collection(data):
            raise UnsupportedDataError(
                f"{type(self).__name__}.add takes a TensorDict or tensorclass, got {type(data).__name__}; use "
                "ReplayBuffer for other data"
            )
        if isinstance(data, TensorDictBase):
            self._check_item_priority(data)
        with self._lock:
            self._sampler._check_new_items(self._storage, data, batched=False)
            self._invalidate_prefetch()
            index = self._writer.add(data)
            self._sampler.add(index)
        self._tell_sharers(index)
        if isinstance(data, TensorDictBase):
            if isinstance(index, int) and _entry(data, "index") is None:
                # A writer that records no "index" (a plain RoundRobinWriter): the update reads
                # it from a copy, the caller's TensorDict left as it was (as TorchRL leaves it).
                data = _top_level_copy(data)
                data.set("index", torch.full(data.batch_size, index, dtype=torch.long, device=data.device))
            self.update_tensordict_priority(data)
        return index

    def __setitem__(self, index: Any, value: Any) -> None:
        """``rb[index] = value``: a TensorDict (or tensorclass), as every item of this buffer."""
        if value is not None and not is_tensor_collection(value):
            raise UnsupportedDataError(
                f"{type(self).__name__} holds TensorDicts, got {type(value).__name__}: expected a TensorDict"
            )
        super().__setitem__(index, value)

    def _check_item_priority(self, data: TensorDictBase) -> None:
        """Refuses, before anything is written, a ``priority_key`` entry the sampler would refuse
        after the rows were written (host values only; see ``Sampler._check_priority``)."""
        if type(self._sampler).update_priority is Sampler.update_priority:
            return
        priority = data.get(self.priority_key, None)
        if isinstance(priority, torch.Tensor):
            self._sampler._check_priority(priority)

    def _reduce_priority(self, priority: torch.Tensor, data: TensorDictBase) -> torch.Tensor:
        """One priority per item: reduces any per-item trailing dims with the sampler's reduction."""
        nd = self._storage.ndim
        if priority.ndim <= nd:
            return priority.flatten() if nd > 1 else priority
        flat = priority.reshape(*priority.shape[:nd], -1)
        reduction = self._sampler.reduction
        if reduction == "max":
            out = flat.amax(-1)
        elif reduction == "min":
            out = flat.amin(-1)
        elif reduction == "mean":
            out = flat.mean(-1)
        elif reduction == "median":
            out = flat.median(-1).values
        else:
            raise ValueError(f"unknown reduction {reduction!r}")
        return out.flatten() if nd > 1 else out

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """Reads ``data["index"]`` and ``data[priority_key]`` and updates the sampler's priorities.

        A no-op for samplers without priorities.
        """
        # Samplers without priorities keep the base class's no-op update_priority.
        if type(self._sampler).update_priority is Sampler.update_priority:
            return
        priority = _entry(data, self.priority_key)
        if priority is None:
            priority = torch.full(data.batch_size[:1] or (), self._sampler.default_priority, dtype=torch.float)
        else:
            priority = self._reduce_priority(priority, data) if data.ndim else priority.reshape(-1).amax()
        index = _entry(data, "index")
        if index is None:
            raise MissingKeyError(
                f"update_tensordict_priority needs the items' \"index\" entry, which this TensorDict lacks (keys: "
                f"{sorted(map(str, data.keys()))}): pass a TensorDict that was sampled from or written to the buffer"
            )
        if self._storage.ndim > 1 and index.ndim == 2:
            index = index.unbind(-1)
        else:
            while index.ndim > priority.ndim:
                index = index[..., 0]
        self.update_priority(index, priority)

    def _read_drawn(self, index: Any, info: dict, batch_size: int, route: Any) -> Any:
        # The draw, transforms and pinning are ReplayBuffer's; this adds the info entries.
        layout = self._storage.layout
        position = None if layout is None else layout.index_of(_INDEX_KEY)
        entries = _info_entries(info, position is not None)
        fills = {}
        if position is not None:
            # The stored "index" column is overwritten by the sampler's index: not gathered.
            fills[position] = self._index_value(index, layout, batch_size)
        source = route.source
        if entries and source is not None and layout.kind == "tensordict":
            # So are the stored leaves an info entry replaces (a slice sampler's ("next", "done")).
            stored = self._stored_entries(layout, entries)
            if stored:
                rows = index[0] if isinstance(index, tuple) else index
                shape = torch.Size([rows.shape[0], *layout.item_batch[self._storage.ndim - 1 :]])
                for key, at in stored:
                    value = entries.pop(key)
                    fills[at] = expand_as_batch(value if value.device == source else value.to(source), shape)
        return self._read(index, route, fills, entries)

    def _stored_entries(self, layout: Any, entries: dict) -> tuple:
        """``(key, position)`` of the info entries that are also leaves of ``layout``; kept for
        the next draw while the layout and the info's keys are the same."""
        keys = tuple(entries)
        kept = self._stored_entries_of
        if kept is None or kept[0] is not layout or kept[1] != keys:
            positions = ((key, layout.index_of(key if isinstance(key, tuple) else (key,))) for key in keys)
            kept = self._stored_entries_of = (layout, keys, tuple((k, at) for k, at in positions if at is not None))
        return kept[2]

    def _index_value(self, index: Any, layout: Any, batch_size: int) -> torch.Tensor:
        if isinstance(index, tuple):
            # One dim: a view (no copy) of the sampler's index, as stacking would give.
            return index[0].unsqueeze(-1) if len(index) == 1 else torch.stack(index, -1)
        item_batch = layout.item_batch[self._storage.ndim - 1 :]
        if not item_batch:
            return index  # already one entry per item
        return expand_as_batch(index, torch.Size([index.shape[0], *item_batch]))

    def sample(self, batch_size: int | None = None, return_info: bool = False, include_info: bool | None = None) -> Any:
        """Samples a TensorDict holding ``"index"`` (and the sampler's other info entries).

        See :meth:`ReplayBuffer.sample`. ``include_info`` is accepted for TorchRL compatibility.
        """
        result = super().sample(batch_size, return_info=return_info)
        data = result[0] if return_info else result
        if not isinstance(data, TensorDictBase) and not is_tensorclass(data):
            raise UnsupportedDataError("TensorDictReplayBuffer can only sample TensorDict data")
        return result


def _top_level_copy(data: TensorDictBase) -> TensorDictBase:
    """A copy of ``data`` sharing every tensor and every sub-TensorDict: the writer sets only the
    top-level ``"index"`` entry, so only the top level needs copying. ``data.copy()`` copies each
    sub-TensorDict too (four times the cost for the transitions of the benchmarks); other kinds of
    TensorDict (lazy stacks, subclasses) still take it."""
    if type(data) is not TensorDict:
        return data.copy()
    return TensorDict._new_unsafe(source=dict(data.items()), batch_size=data.batch_size, device=data.device,
                                  names=data._maybe_names())


def _entry(data: TensorDictBase, key: Any) -> Any:
    """``data.get(key, None)``. A plain TensorDict's string key is read from its entries directly:
    ``get`` first unravels the key and checks the compile state, ten times the cost of the read."""
    if type(data) is TensorDict and isinstance(key, str):
        return data._get_str(key, None)
    return data.get(key, None)
