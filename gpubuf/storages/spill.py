"""``SpillStorage``: rows on the device up to a memory budget, the rest in a memory-mapped tier.

A buffer larger than the GPU's memory (or than the share of it that training leaves) keeps its
first ``device_rows`` rows in device tensors and the others in a :class:`LazyMemmapStorage`
created on disk the first time a row past the budget is written. Global row ``r`` lives at
device row ``r`` when ``r < device_rows`` and at memmap row ``r - device_rows`` otherwise, so
round-robin writes simply run from the device tier into the memmap tier and wrap back.

Everything above the storage sees one buffer: writers, samplers (prioritized ones too: they
only produce indices), reads, ``state_dict`` and checkpoints. A sample gathers the device rows
on the device and the memmap rows on the host, and scatters both into one batch on the device.
:attr:`SpillStorage.tiers` reports the split.

On a machine without a GPU the same code runs with the device tier on the CPU, where
``device_budget`` is simply a number of bytes of ordinary memory.
"""

from __future__ import annotations

import os
from typing import Any, Collection, Sequence

import numpy as np
import torch

from gpubuf.errors import EmptyBufferError, IndexOutOfRangeError, InvalidArgumentError, StateDictError
from gpubuf.ops.gather_rows import gather_rows_trusted
from gpubuf.storages._layout import Layout
from gpubuf.storages._memmap_files import ram_available
from gpubuf.storages.base import Storage, check_device, check_max_size
from gpubuf.storages.memmap import LazyMemmapStorage
from gpubuf.storages.tensor import _check_state
from gpubuf.storages.items import is_int, leading_size, stack_items

__all__ = ["SpillStorage"]


def _default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _free_bytes(device: torch.device) -> int:
    """Free memory of ``device``: CUDA's free memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = ram_available()
    if available is not None:
        return available
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


class SpillStorage(Storage):
    """A storage of tensors, TensorDicts, tensorclasses or pytrees of tensors in two tiers.

    Rows ``[0, device_rows)`` live on :attr:`device`; rows ``[device_rows, max_size)`` in a
    :class:`~gpubuf.storages.memmap.LazyMemmapStorage` created, lazily, on the first write
    past the budget. ``device_rows = min(max_size, device_budget // row_bytes)`` is fixed by the
    first batch (which fixes the layout and so the bytes of a row).

    Args:
        max_size: the capacity in items (``ndim=1``: one item per row).

    Keyword Args:
        device: the device tier, and where read and sampled batches are returned. Default:
            the current CUDA device when there is one, else the CPU.
        device_budget: bytes of device memory the device tier may take. Default: half of the
            device's free memory when the first batch arrives (on the CPU: half of the available
            memory). ``0`` puts every row in the memmap tier.
        scratch_dir: where the memmap tier's files go (a temporary directory by default); see
            :class:`~gpubuf.storages.memmap.LazyMemmapStorage`.
        existsok: passed to the memmap tier.
        auto_cleanup: passed to the memmap tier (default: remove a temporary directory at exit).
        compilable: accepted for TorchRL compatibility.

    Raises:
        CapacityError: ``max_size`` is not a positive int.
        InvalidArgumentError: a ``device_budget`` that is not an int >= 0 (a ``ValueError``).
        InvalidDeviceError: a malformed device, or a CUDA device on a machine without CUDA.

    Examples:
        >>> storage = SpillStorage(1_000, device="cpu", device_budget=100 * 16)
        >>> rb = ReplayBuffer(storage=storage, batch_size=32)
        >>> rb.extend(torch.randn(1_000, 4))  # 16 bytes a row: 100 rows in the device tier
        >>> storage.tiers["device_rows"], storage.tiers["spill_rows"]
        (100, 900)
    """

    ndim = 1

    def __init__(
        self,
        max_size: int,
        *,
        device: torch.device | str | None = None,
        device_budget: int | None = None,
        scratch_dir: str | os.PathLike | None = None,
        existsok: bool = False,
        auto_cleanup: bool | None = None,
        compilable: bool = False,
    ) -> None:
        super().__init__(check_max_size(max_size), compilable=compilable)
        if device_budget is not None:
            if isinstance(device_budget, bool) or not isinstance(device_budget, (int, np.integer)) or device_budget < 0:
                raise InvalidArgumentError(f"device_budget must be a number of bytes >= 0 (an int), got {device_budget!r}")
            device_budget = int(device_budget)
        device = _default_device() if device in (None, "auto") else check_device(device, "SpillStorage's device")
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.device_budget = device_budget
        self.scratch_dir = None if scratch_dir is None else os.path.abspath(os.fspath(scratch_dir))
        if self.scratch_dir is not None:
            # The directory is made at the first spill; refuse now one that can never be made.
            existing = self.scratch_dir
            while not os.path.exists(existing):
                existing = os.path.dirname(existing)
            if not os.path.isdir(existing):
                raise InvalidArgumentError(
                    f"scratch_dir={self.scratch_dir!r} lies under {existing!r}, which is not a directory: "
                    "expected a directory, or a path where one can be made"
                )
        self.existsok = existsok
        self.auto_cleanup = auto_cleanup
        self._layout: Layout | None = None
        self._hot: list[torch.Tensor] | None = None
        self._cold: LazyMemmapStorage | None = None
        self._device_rows = 0
        self._len = 0

    # ------------------------------------------------------------------ structure
    @property
    def initialized(self) -> bool:
        return self._layout is not None

    @property
    def device_rows(self) -> int:
        """Rows held by the device tier (0 before the first write)."""
        return self._device_rows

    @property
    def tiers(self) -> dict[str, Any]:
        """How the rows are split between the tiers.

        Keys: ``device`` (str), ``device_budget`` and ``device_bytes`` (bytes allowed and taken),
        ``row_bytes``, ``device_rows`` and ``spill_rows`` (capacity of each tier),
        ``rows_on_device`` and ``rows_spilled`` (items stored in each), ``spill_dir`` (the
        memmap tier's directory, None until created) and ``spill_created``.
        """
        row_bytes = sum(spec.row_bytes for spec in self._layout.leaves) if self._layout is not None else None
        held = self._len
        d = self._device_rows
        return {
            "device": str(self.device),
            "device_budget": self.device_budget,
            "row_bytes": row_bytes,
            "device_rows": d if self.initialized else None,
            "device_bytes": d * row_bytes if row_bytes is not None else 0,
            "spill_rows": self.max_size - d if self.initialized else None,
            "rows_on_device": min(held, d),
            "rows_spilled": max(held - d, 0),
            "spill_dir": self._cold.scratch_dir if self._cold is not None else None,
            "spill_created": self._cold is not None and self._cold.initialized,
        }

    def __len__(self) -> int:
        return self._len

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self._len])

    @property
    def _total_shape(self) -> torch.Size | None:
        return torch.Size([self.max_size]) if self.initialized else None

    # ------------------------------------------------------------------ tiers
    def _init_from(self, layout: Layout) -> None:
        row_bytes = sum(spec.row_bytes for spec in layout.leaves)
        budget = self.device_budget if self.device_budget is not None else _free_bytes(self.device) // 2
        rows = self.max_size if row_bytes == 0 else min(self.max_size, budget // row_bytes)
        hot = [torch.empty((rows, *spec.shape), dtype=spec.dtype, device=self.device) for spec in layout.leaves]
        if self.device_budget is None:
            self.device_budget = budget
        self._hot = hot
        self._device_rows = rows
        self._layout = layout

    def _cold_tier(self) -> LazyMemmapStorage:
        """The memmap tier, created (files and all) on first use."""
        if self._cold is None:
            self._cold = LazyMemmapStorage(
                self.max_size - self._device_rows,
                scratch_dir=self.scratch_dir,
                existsok=self.existsok,
                auto_cleanup=self.auto_cleanup,
            )
        cold = self._cold
        if not cold.initialized:
            # Files are created from the layout alone: an empty batch of one row on the host.
            probe = self._layout.build(
                [torch.zeros((1, *s.shape), dtype=s.dtype) for s in self._layout.leaves],
                torch.Size([1, *self._layout.item_batch]),
                torch.device("cpu"),
            )
            layout, leaves, _ = cold._prepare(probe, [1])
            cold._init_from(layout, leaves)
        return cold

    def _segments(self, first: int, count: int) -> list[tuple[int, int, int]]:
        """``(row_lo, row_hi, source_offset)`` pieces of a wrapped write, split at the tier boundary."""
        head = min(count, self.max_size - first)
        pieces = [(first, first + head, 0)]
        if head < count:
            pieces.append((0, count - head, head))
        out = []
        d = self._device_rows
        for lo, hi, src in pieces:
            if lo < d:
                out.append((lo, min(hi, d), src))
            if hi > d:
                cut = max(lo, d)
                out.append((cut, hi, src + cut - lo))
        return out

    # ------------------------------------------------------------------ writing
    def _prepare(self, data: Any, leading: Sequence[int]) -> tuple[Layout, list[torch.Tensor], bool]:
        """Validates ``data``; returns ``(layout, leaves on the device, needs_init)``. Changes nothing."""
        if isinstance(data, list) and leading:
            data = stack_items(data)
        needs_init = self._layout is None
        layout = Layout.from_batch(data, leading=len(leading)) if needs_init else self._layout
        leaves = layout.split(data, leading=leading, device=None)
        return layout, [leaf if leaf.device == self.device else leaf.to(self.device) for leaf in leaves], needs_init

    def _write_rows(self, start: int, data: Any) -> int:
        """Writes a batch at rows ``start, start+1, ...`` (wrapping): the round-robin writers' path.

        Raises:
            SchemaMismatchError, DTypeMismatchError, UnsupportedDataError: the batch does not
                fit; nothing is written.
            DiskFullError: no disk space for the memmap tier's rows; nothing is written.
        """
        n = leading_size(data)
        layout, leaves, needs_init = self._prepare(data, [n])
        if needs_init:
            self._init_from(layout)
        skip = max(n - self.max_size, 0)
        count = n - skip
        first = (start + skip) % self.max_size
        pieces = self._segments(first, count)
        d = self._device_rows
        cold = None
        if any(hi > d for _, hi, _ in pieces):
            cold = self._cold_tier()
            with cold._state.lock:
                cold._ensure_allocated([(lo - d, hi - d) for lo, hi, _ in pieces if lo >= d])
        for lo, hi, src in pieces:
            stores = self._hot if lo < d else cold._leaves
            base = 0 if lo < d else d
            for store, leaf in zip(stores, leaves):
                store[lo - base : hi - base].copy_(leaf[skip + src : skip + src + hi - lo])
        self._len = min(self._len + n, self.max_size)
        return n

    def _cursor_rows(self, cursor: Any) -> tuple[torch.Tensor, list[int]]:
        """``(rows, leading)`` of a ``set`` cursor: rows normalised into ``[0, max_size)``."""
        cap = self.max_size
        if is_int(cursor):
            if not -cap <= int(cursor) < cap:
                raise IndexOutOfRangeError(f"cursor {int(cursor)} is out of range for a storage of {cap} rows")
            rows, lead = torch.tensor([int(cursor)]), []
        elif isinstance(cursor, slice):
            rows = torch.arange(cap)[cursor]
            lead = [rows.numel()]
        else:
            tensor = torch.as_tensor(np.asarray(cursor) if not isinstance(cursor, torch.Tensor) else cursor)
            if tensor.dtype == torch.bool:
                tensor = tensor.nonzero().squeeze(-1)
            rows, lead = tensor.reshape(-1).long().cpu(), list(tensor.shape)
        if rows.numel() and (int(rows.min()) < -cap or int(rows.max()) >= cap):
            bad = int(rows.min()) if int(rows.min()) < -cap else int(rows.max())
            raise IndexOutOfRangeError(f"cursor {bad} is out of range for a storage of {cap} rows")
        return torch.where(rows < 0, rows + cap, rows), lead

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Writes ``data`` at ``cursor`` (an int, a slice, or a sequence / tensor of rows).

        Raises:
            IndexOutOfRangeError: a row outside the capacity; nothing is written.
            SchemaMismatchError, DTypeMismatchError, UnsupportedDataError: the data does not
                fit; nothing is written.
            DiskFullError: no disk space for the memmap tier's rows; nothing is written.
        """
        if isinstance(data, list):
            data = stack_items(data)
        rows, lead = self._cursor_rows(cursor)
        layout, leaves, needs_init = self._prepare(data, lead)
        if needs_init:
            self._init_from(layout)
        if not lead:
            leaves = [leaf.unsqueeze(0) for leaf in leaves]
        else:
            leaves = [leaf.reshape(-1, *spec.shape) for leaf, spec in zip(leaves, layout.leaves)]
        d = self._device_rows
        on_device = rows < d
        cold = None
        if not bool(on_device.all()):
            cold = self._cold_tier()
            spilled = torch.unique(rows[~on_device] - d)
            with cold._state.lock:
                cold._ensure_allocated(cold._runs(spilled))
        if bool(on_device.any()):
            pos = on_device.nonzero().squeeze(-1)
            target = rows[pos].to(self.device)
            pos = pos.to(self.device)
            for store, leaf in zip(self._hot, leaves):
                store.index_copy_(0, target, leaf.index_select(0, pos))
        if cold is not None:
            pos = (~on_device).nonzero().squeeze(-1)
            target = rows[pos] - d
            for store, leaf in zip(cold._leaves, leaves):
                store.index_copy_(0, target, leaf.index_select(0, pos.to(leaf.device)).cpu())
        if set_cursor:
            self._len = min(self._len + max(rows.numel(), 1), self.max_size)

    # ------------------------------------------------------------------ reading
    def _gather(self, index: torch.Tensor, skip: Collection[int] = ()) -> list:
        """Gathers rows ``index`` (int64, in range) of every leaf into batches on the device."""
        layout = self._layout
        keep = [i for i in range(len(layout.leaves)) if i not in skip]
        index = index.to(self.device)
        d = self._device_rows
        cold = self._cold
        if cold is None or not cold.initialized or self._len <= d:
            gathered = gather_rows_trusted([self._hot[i] for i in keep], index, backend=self._backend)
        else:
            outs = [
                torch.empty((index.numel(), *layout.leaves[i].shape), dtype=layout.leaves[i].dtype, device=self.device)
                for i in keep
            ]
            spilled = index >= d
            hot_pos = (~spilled).nonzero().squeeze(-1)
            cold_pos = spilled.nonzero().squeeze(-1)
            if hot_pos.numel():
                hot = gather_rows_trusted([self._hot[i] for i in keep], index[hot_pos], backend=self._backend)
                for out, rows in zip(outs, hot):
                    out.index_copy_(0, hot_pos, rows)
            if cold_pos.numel():
                cold_rows = (index[cold_pos] - d).cpu()
                for out, rows in zip(outs, gather_rows_trusted([cold._leaves[i] for i in keep], cold_rows)):
                    out.index_copy_(0, cold_pos, rows.to(self.device, non_blocking=True))
            gathered = outs
        gathered = iter(gathered)
        return [None if i in skip else next(gathered) for i in range(len(layout.leaves))]

    def _rows_of(self, index: Any) -> tuple[torch.Tensor, bool]:
        """``(rows, single)`` for a read index, negative values counting from the end of the written range."""
        n = self._len
        if is_int(index):
            rows, single = torch.tensor([int(index)]), True
        elif isinstance(index, slice):
            rows, single = torch.arange(n)[index], False
        else:
            tensor = torch.as_tensor(np.asarray(index) if not isinstance(index, torch.Tensor) else index)
            if tensor.dtype == torch.bool:
                tensor = tensor.nonzero().squeeze(-1)
            if tensor.dtype.is_floating_point or tensor.ndim != 1:
                raise IndexOutOfRangeError(f"index must be an int, a slice or a 1-D sequence of ints, got {index!r}")
            rows, single = tensor.long(), False
        if rows.numel():
            lo, hi = int(rows.min()), int(rows.max())
            if lo < -n or hi >= n:
                raise IndexOutOfRangeError(f"index {lo if lo < -n else hi} is out of range for a storage of length {n}")
        return torch.where(rows < 0, rows + n, rows), single

    def get(self, index: Any) -> Any:
        """Reads items from either tier.

        Args:
            index: an int, a slice, or a 1-D sequence / tensor of ints or bools; negative values
                count from the end of the written range.

        Returns:
            The items in the stored container kind, on :attr:`device`; one item for an int.

        Raises:
            EmptyBufferError: nothing was written yet.
            IndexOutOfRangeError: an index outside the written range.
        """
        if not self.initialized or self._len == 0:
            raise EmptyBufferError("cannot read from an empty storage: write data to it first")
        rows, single = self._rows_of(index)
        leaves = self._gather(rows)
        if single:
            return self._build([leaf[0] for leaf in leaves], [])
        return self._build(leaves, [rows.numel()])

    def _rand_given_ndim(self, batch_size: int) -> torch.Tensor:
        device = self._rng.device if self._rng is not None else self.device
        return torch.randint(0, self._len, (batch_size,), generator=self._rng, device=device)

    # ------------------------------------------------------------------ misc
    def _empty(self) -> None:
        self._len = 0

    def _leaf_chunks(self) -> list[tuple[int, list[torch.Tensor]]]:
        """``[(first_row, leaves), ...]`` of each tier in row order: for writers of whole storages
        (checkpoints), which write each leaf as its chunks one after another."""
        if not self.initialized:
            return []
        chunks = [(0, list(self._hot))]
        if self._cold is not None and self._cold.initialized:
            chunks.append((self._device_rows, list(self._cold._leaves)))
        return chunks

    @property
    def _storage(self) -> Any:
        """The whole capacity as one container on the host (a copy: it spans both tiers)."""
        if not self.initialized:
            return None
        chunks = self._leaf_chunks()
        leaves = []
        for i, spec in enumerate(self._layout.leaves):
            parts = [leaves_[i].cpu() for _, leaves_ in chunks]
            missing = self.max_size - sum(p.shape[0] for p in parts)
            if missing:
                parts.append(torch.zeros((missing, *spec.shape), dtype=spec.dtype))
            leaves.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        layout = self._layout
        if layout.kind in ("tensordict", "tensorclass"):
            return layout.build(leaves, torch.Size([self.max_size, *layout.item_batch]), torch.device("cpu"))
        return layout.build(leaves, torch.Size([self.max_size]), torch.device("cpu"))

    def state_dict(self) -> dict[str, Any]:
        """``{"_storage": every row on the host (a copy), "initialized": bool, "_len": int}``."""
        return {"_storage": self._storage, "initialized": self.initialized, "_len": self._len}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Writes a state dict's rows into the tiers (created as needed) and sets the length.

        Raises:
            StateDictKeyError: ``_storage`` or ``_len`` missing.
            StateDictError: a length that is not an int in ``[0, rows held]``, data that is not
                tensors, or another number of rows than the capacity. Nothing changes then.
            SchemaMismatchError, DTypeMismatchError: rows of another layout than the stored ones.
        """
        data, length = _check_state(state_dict, self.ndim)
        if data is None:
            self._len = 0
            return
        if leading_size(data) != self.max_size:
            raise StateDictError(
                f"the state dict holds {leading_size(data)} rows, this storage's capacity is {self.max_size} (expected "
                "the state of a storage of the same capacity)"
            )
        self._write_rows(0, data)
        self._len = length

    def cleanup(self) -> bool:
        """Removes the memmap tier's files; True if something was removed."""
        return self._cold.cleanup() if self._cold is not None else False

    def __repr__(self) -> str:
        t = self.tiers
        return (
            f"{type(self).__name__}(max_size={self.max_size}, len={len(self)}, device={self.device}, "
            f"device_rows={t['device_rows']}, spill_rows={t['spill_rows']}, rows_spilled={t['rows_spilled']}, "
            f"layout={self._layout})"
        )
