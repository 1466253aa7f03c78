"""Trajectory slices: ``SliceSampler`` and ``SliceSamplerWithoutReplacement`` (TorchRL's).

A slice is ``L`` consecutive steps of one stored trajectory. TorchRL finds the trajectories by
scanning the whole done (or trajectory id) column at every sample, or once per write with
``cache_values=True``. Here an :class:`~gpubuf.samplers._episodes.EpisodeIndex` is kept up to
date instead: the buffer tells the sampler which rows each write filled (:meth:`extend`), and
before the next draw only those rows' boundary entries are read (work proportional to the rows
written, on the storage's device). A draw of ``B`` slices is then ``O(B)``: a trajectory picked
uniformly among those long enough, a start uniform within it, the window's rows, all
vectorized, without a host synchronisation on CUDA for the fixed-length case.
"""

from __future__ import annotations

import numbers
from operator import is_
from typing import Any, Sequence

import torch

from gpubuf.errors import (
    BatchSizeError,
    EmptyBufferError,
    SchemaMismatchError,
    SliceArgumentError,
    StateDictError,
    TrajectoryKeyError,
    TrajectoryLengthError,
    UnsupportedOptionError,
)
from gpubuf.ops._dispatch import device_path
from gpubuf.samplers._columns import as_key, flag_column, flags_per_column, has_key, read_key
from gpubuf.samplers._episodes import EpisodeIndex
from gpubuf.samplers._fragments import FragmentIndex
from gpubuf.samplers.base import Sampler
from gpubuf.samplers.random import SamplerWithoutReplacement, _check_batch_size

__all__ = ["SliceSampler", "SliceSamplerWithoutReplacement"]

_EMPTY = "cannot sample from an empty storage: extend the buffer first"
_AUTO_TRAJ_KEYS = (("collector", "traj_ids"), ("episode",))
_DEFAULT_END_KEY = ("next", "done")


def _positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise SliceArgumentError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _span(span: Any) -> tuple[bool | int, bool | int]:
    if isinstance(span, (bool, int)):
        span = (span, span)
    if not isinstance(span, (tuple, list)) or len(span) != 2:
        raise SliceArgumentError(f"span must be a bool, an int or a pair of them, got {span!r}")
    out = []
    for side in span:
        if isinstance(side, bool):
            out.append(side)
        elif isinstance(side, numbers.Integral) and side >= 0:
            out.append(int(side))
        else:
            raise SliceArgumentError(f"span must hold bools or non-negative ints, got {span!r}")
    return out[0], out[1]


def _replace_last(key: tuple, name: str) -> tuple:
    return key[:-1] + (name,)


def _out_key(key: tuple) -> Any:
    """The form TorchRL uses in info dicts: a string for a top-level key, else the tuple."""
    return key[0] if len(key) == 1 else key


class SliceSampler(Sampler):
    """Samples slices of consecutive steps of stored trajectories, with replacement (TorchRL's ``SliceSampler``).

    Each of the ``num_slices`` slices picks a trajectory uniformly among the stored ones long
    enough (all of them with ``strict_length=False``), then a start uniformly among its
    positions; the batch is the slices' steps, slice after slice (``[num_slices * L]``).

    Keyword Args:
        num_slices: the number of slices per batch (the slice length is then
            ``batch_size // num_slices``). Exclusive with ``slice_len``.
        slice_len: the length of each slice (``batch_size // slice_len`` slices). Exclusive
            with ``num_slices``.
        end_key: the entry flagging the last step of a trajectory. Defaults to
            ``("next", "done")``. Exclusive with ``end_keys``.
        end_keys: entries OR-ed into the end flag (those absent from the storage are skipped).
        traj_key: the entry holding trajectory ids; a change of id starts a trajectory. When
            neither it nor an end key is given, ``("collector", "traj_ids")`` then
            ``"episode"`` are looked for, then the end key. A ``traj_key`` absent from the
            storage falls back to the end key, as in TorchRL.
        ends: a static 1-D bool tensor of end flags, one per row of a full storage
            (needs ``cache_values=True``); writes then leave the boundaries alone.
        trajectories: a static 1-D tensor of trajectory ids, as ``ends``.
        cache_values: accepted for TorchRL compatibility: boundaries are always kept up to
            date by writes, never rescanned.
        truncated_key: where the info dict marks the last step of every slice as truncated
            (with the matching ``done`` and ``terminated`` entries). None: no such entries.
        init_key: the info dict's entry marking the first step of every slice, OR-ed with the
            stored one; only when the storage has that entry. None: not written.
        strict_length: when True (default), only trajectories at least ``L`` long are used;
            when False, shorter ones give shorter slices.
        pad_output: with ``strict_length=False``, pad short slices to ``L`` by repeating
            their last step, with the mask under ``("collector", "mask")``.
        compile: accepted for TorchRL compatibility (the draw is a handful of vectorized ops).
        span: let slices run past the start (left) and/or the end (right) of a trajectory,
            giving shorter slices there: a bool (at least one step per slice), an int ``i`` (at
            least ``L - i`` steps), or a pair ``(left, right)``.
        use_gpu: accepted for TorchRL compatibility: the boundaries live on the storage's
            device.
        step_key: the entry holding each step's number within its trajectory (a
            non-negative int), read with ``fragmented=True`` only. Defaults to ``"step_count"``.
        fragmented: rebuild trajectories from ``traj_key`` and ``step_key`` wherever their steps
            are stored (interleaved writers): a run is the steps of one trajectory with
            consecutive numbers, a missing step splitting it. One-dimensional storages, with
            replacement; not with ``span``, ``compile``, ``ends`` or ``trajectories``. The
            records are set by writes; the runs are packed once per write, not per draw.

    Storages:
        Any storage written round robin (the default writer). Tensor and memmap storages are
        read one boundary entry at a time; others (list storages) through ``storage.get``. For ``ndim >= 2`` the trajectories run along dim 0 within each column of the
        other dims (TorchRL's layout), and indices are returned per dim. The newest row ends a
        trajectory (the write cursor truncates it), and once the storage is full a trajectory
        continues from the last row to row 0.

    Returns from :meth:`sample`:
        ``(index, info)``: ``index`` a tuple of int64 tensors, one per storage dim, of
        ``num_slices * L`` elements (fewer with ``strict_length=False`` or ``span``);
        ``info`` TorchRL's entries (``truncated_key``, ``done``, ``terminated``, the
        ``init_key`` and the padding mask when they apply), each with a leading dim of one per
        step.

    Raises:
        SliceArgumentError: both or neither of ``num_slices`` and ``slice_len``, a
            non-positive one, exclusive arguments together, ``pad_output`` with
            ``strict_length``, ``ends``/``trajectories`` without ``cache_values``.
        UnsupportedOptionError: ``fragmented=True`` with ``span`` or ``compile``, or in a
            subclass (a ``NotImplementedError``, as in TorchRL).
    """

    #: TorchRL's class-level defaults.
    fragmented: bool = False
    step_key: Any = "step_count"

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: Any = None,
        end_keys: Sequence[Any] | None = None,
        traj_key: Any = None,
        step_key: Any = "step_count",
        fragmented: bool = False,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        cache_values: bool = False,
        truncated_key: Any = ("next", "truncated"),
        init_key: Any = "is_init",
        strict_length: bool = True,
        pad_output: bool = False,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        use_gpu: torch.device | bool = False,
    ) -> None:
        if (num_slices is None) == (slice_len is None):
            raise SliceArgumentError(
                "Either num_slices or slice_len must be not None, and not both. "
                f"Got num_slices={num_slices} and slice_len={slice_len}."
            )
        num_slices = _positive_int("num_slices", num_slices)
        slice_len = _positive_int("slice_len", slice_len)
        if fragmented:
            self._check_fragmented(step_key, ends, trajectories, span, compile)
        if end_key is not None and end_keys is not None:
            raise SliceArgumentError("`end_key` and `end_keys` are exclusive arguments: pass one of them")
        if pad_output and strict_length:
            raise SliceArgumentError(
                "pad_output=True is incompatible with strict_length=True: padding only happens when short "
                "trajectories are kept, which requires strict_length=False."
            )
        static = trajectories if trajectories is not None else ends
        if static is not None:
            if trajectories is not None and ends is not None:
                raise SliceArgumentError("trajectories and ends are exclusive arguments.")
            if traj_key is not None or end_key is not None or end_keys is not None:
                raise SliceArgumentError("`ends`/`trajectories` and `end_key`, `end_keys` or `traj_key` are exclusive arguments.")
            if not cache_values:
                raise SliceArgumentError("To be used, `ends` or `trajectories` requires `cache_values` to be set to `True`.")
            if not isinstance(static, torch.Tensor) or static.ndim != 1 or static.numel() == 0:
                raise SliceArgumentError("`ends` and `trajectories` must be non-empty 1-D tensors")
            if static.dtype.is_floating_point or static.dtype.is_complex or (static is ends and static.dtype != torch.bool):
                raise SliceArgumentError(
                    f"`ends` must be a bool tensor and `trajectories` an integer one, got {static.dtype}"
                )
        for name, key in (("end_key", end_key), ("traj_key", traj_key), ("step_key", step_key),
                          ("truncated_key", truncated_key), ("init_key", init_key)):
            if key is not None:
                try:
                    as_key(key)
                except SchemaMismatchError:
                    raise SliceArgumentError(f"{name} must be a string or a tuple of strings, got {key!r}") from None
        self.span = _span(span)
        self.num_slices = num_slices
        self.slice_len = slice_len
        self.end_key = _DEFAULT_END_KEY if end_key is None and end_keys is None else end_key
        self.end_keys = None if end_keys is None else tuple(as_key(k) for k in end_keys)
        self.traj_key = traj_key
        self.step_key = step_key
        self.fragmented = bool(fragmented)
        self._fragments: FragmentIndex | None = None
        self.cache_values = bool(cache_values)
        self.truncated_key = truncated_key
        self.init_key = init_key
        self.strict_length = bool(strict_length)
        self.pad_output = bool(pad_output)
        self.compile = bool(compile)
        self.use_gpu = bool(use_gpu)
        self._explicit_end = end_key is not None or end_keys is not None
        self._index: EpisodeIndex | None = None
        self._pending: list[torch.Tensor] = []
        self._source: tuple | None = None  # ("traj", key) or ("end", keys), fixed at first read
        self._last: torch.Tensor | None = None  # the newest row's id or end flag, per column
        # What the index holds, read on the host once per change of the index: per slice length
        # L whether some trajectory is L long (key L) and whether none is shorter (key -L), and
        # the number of trajectories (key "trajectories").
        self._nonempty: dict[int | str, bool | int] = {}
        # The device path's window draw: the (index, slice length) pairs whose trajectories were
        # seen on the host to hold a slice, and the error word a later empty draw sets.
        self._verified: tuple[Any, set] | None = None
        self._errors: torch.Tensor | None = None
        self._error_length = 0
        self._static = None
        self._templates: dict = {}  # constant tensors of a draw's shape (offsets, marks)
        self._flags_cache: tuple | None = None  # what _flag_columns found, and for what
        self._mark_names: tuple | None = None  # the info keys of the marks, and for which keys
        if static is not None:
            self._static = self._static_index(trajectories=trajectories, ends=ends)

    def _check_fragmented(self, step_key: Any, ends: Any, trajectories: Any, span: Any, compile: Any) -> None:
        if type(self).sample is not SliceSampler.sample:
            raise UnsupportedOptionError("fragmented=True currently supports SliceSampler with replacement only.")
        if step_key is None:
            raise SliceArgumentError("step_key must be provided when fragmented=True.")
        if ends is not None or trajectories is not None:
            raise SliceArgumentError(
                "fragmented=True reads trajectory ids and step numbers from the storage: the static ends and "
                "trajectories arguments cannot be used with it; pass traj_key and step_key."
            )
        if any(_span(span)):
            raise UnsupportedOptionError("span is not supported with fragmented=True.")
        if compile:
            raise UnsupportedOptionError("compile is not supported with fragmented=True.")

    def __getstate__(self) -> dict[str, Any]:
        # The flag columns found are views of the storage's leaves: never pickled with the sampler.
        state = dict(self.__dict__)
        state["_flags_cache"] = None
        return state

    # ------------------------------------------------------------------ writes
    def add(self, index: Any) -> None:
        """Notes the row written at ``index``; its boundary entry is read before the next draw."""
        self._note(torch.as_tensor(index).reshape(1, -1))

    def extend(self, index: Any) -> None:
        """Notes the rows written at ``index`` (as the writer returned it); read before the next draw."""
        if isinstance(index, tuple):
            index = torch.stack(index, -1)
        self._note(torch.as_tensor(index))

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """Rows written behind the buffer's back: the boundaries are rebuilt at the next draw."""
        self._flags_cache = None
        self._index = None
        self._pending = []
        self._fragments = None

    def _note(self, index: torch.Tensor) -> None:
        if self._static is not None:
            return
        self._pending.append(index)
        self._nonempty = {}

    def _empty(self) -> None:
        self._flags_cache = None
        self._index = None
        self._fragments = None
        self._pending = []
        self._last = None
        self._nonempty = {}

    # ------------------------------------------------------------------ boundaries
    def _geometry(self, storage: Any) -> tuple[int, int, tuple[int, ...]]:
        """``(T, C, column_shape)`` of a storage: time rows, columns, and the column dims."""
        ndim = storage.ndim
        if ndim == 1:
            return int(storage.max_size), 1, ()
        shape = tuple(storage._total_shape)  # capacity along dim 0 (``shape`` is the written part)
        columns = 1
        for size in shape[1:]:
            columns *= int(size)
        return int(shape[0]), columns, shape[1:]

    @staticmethod
    def _storage_device_of(storage: Any) -> torch.device:
        """Where the boundaries live: the storage's rows' device (the host until it has one)."""
        return storage.data_device or _HOST

    def _resolve_source(self, storage: Any) -> tuple:
        traj = [as_key(self.traj_key)] if self.traj_key is not None else ([] if self._explicit_end else list(_AUTO_TRAJ_KEYS))
        for key in traj:
            if has_key(storage, key):
                return ("traj", key)
        ends = self.end_keys if self.end_keys is not None else (as_key(self.end_key),)
        present = tuple(key for key in ends if has_key(storage, key))
        if present:
            return ("end", present)
        if self._explicit_end:
            for key in _AUTO_TRAJ_KEYS:
                if has_key(storage, key):
                    return ("traj", key)
        looked = [*traj, *ends]
        raise TrajectoryKeyError(
            f"the storage holds none of the entries trajectory boundaries are read from (looked for "
            f"{', '.join(map(repr, looked))}): write them with the data, or pass traj_key / end_key naming an entry "
            "it holds"
        )

    def _signal(self, storage: Any, rows: torch.Tensor, columns: int, shape: tuple) -> torch.Tensor:
        """The boundary signal of time ``rows``: ``[n, C]`` trajectory ids or end flags."""
        kind, keys = self._source
        n = rows.shape[0]
        if shape:
            grids = torch.meshgrid(
                rows, *[torch.arange(s, device=rows.device) for s in shape], indexing="ij"
            )
            index = tuple(grid.reshape(-1) for grid in grids)
        else:
            index = (rows,)
        if kind == "traj":
            values = read_key(storage, keys, index)
            if values is None:
                raise TrajectoryKeyError(f"the storage lost its trajectory entry {keys!r}")
            return flags_per_column(values, n, columns, keys)
        done = None
        for key in keys:
            values = read_key(storage, key, index)
            if values is None:
                continue
            values = flags_per_column(values, n, columns, key).to(torch.bool)
            done = values if done is None else done | values
        if done is None:
            raise TrajectoryKeyError(f"the storage lost its end entries {keys!r}")
        return done

    def _end_stream(self, storage: Any) -> None:
        """The stream written so far ended at its last row, whose end flag was just set in place
        (:meth:`~gpubuf.ReplayBufferEnsemble.end_streams`): the next write starts a trajectory.

        The boundaries are first brought up to date with the writes before (read as written).
        The ended trajectory keeps its steps; only whether the next row continues it changes.
        """
        if self.fragmented or self._static is not None:
            return  # trajectories come from ids and steps, or were given: no end flag to follow
        self._sync(storage)
        if self._source is not None and self._source[0] != "traj" and self._last is not None:
            self._last = torch.ones_like(self._last)

    def _breaks(self, signal: torch.Tensor) -> torch.Tensor:
        """Where each new row starts a trajectory, from the rows' signal and the previous row's."""
        kind = self._source[0]
        last = self._last
        if last is None:
            last = signal[:1].clone() if kind == "traj" else torch.ones_like(signal[:1])
        else:
            last = last.unsqueeze(0).to(signal.device)
        if kind == "traj":
            prev = torch.cat([last.to(signal.dtype), signal[:-1]], 0)
            return signal != prev
        prev = torch.cat([last, signal[:-1]], 0)
        return prev

    def _sync(self, storage: Any) -> EpisodeIndex:
        """Brings the boundaries up to date with the writes noted since the last draw."""
        if self._static is not None:
            device = self._storage_device_of(storage)
            if self._static.device != device:
                self._static = EpisodeIndex.from_state_dict(self._static.state_dict(), device)
                self._nonempty = {}
            return self._static
        capacity, columns, shape = self._geometry(storage)
        device = self._storage_device_of(storage)
        index = self._index
        if index is None or index.capacity != capacity or index.columns != columns or index.device != device:
            # A fresh index takes the writes noted so far, from the first row on.
            index = self._index = EpisodeIndex(capacity, columns, device)
            self._last = None
            self._nonempty = {}
        if self._pending:
            parts = [self._time_rows(p, columns) for p in self._pending]
            rows = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
            if not device_path(rows, self._backend):
                # (On the device path that check is a host read: the writers' rows are trusted.)
                n = rows.shape[0]
                if int(rows[0]) != index.written % capacity or int(rows[-1]) != (index.written + n - 1) % capacity:
                    # Not a round-robin continuation (another writer, a direct write): read everything,
                    # the last row written being the newest.
                    return self._rebuild(storage, capacity, columns, shape, device, newest=int(rows[-1]))
            self._feed(storage, index, rows, columns, shape)  # raises before changing anything
            self._pending = []
            self._nonempty = {}
        if index.size * columns != len(storage):
            return self._rebuild(storage, capacity, columns, shape, device)
        return index

    @staticmethod
    def _time_rows(index: torch.Tensor, columns: int) -> torch.Tensor:
        if index.ndim <= 1:
            return index.reshape(-1).to(torch.int64)
        # [n * C, ndim] coordinates, time-major: one time row per C entries.
        return index[::columns, 0].to(torch.int64)

    def _feed(self, storage: Any, index: EpisodeIndex, rows: torch.Tensor, columns: int, shape: tuple) -> None:
        if self._source is None:
            self._source = self._resolve_source(storage)
        cut = rows.shape[0] - index.capacity
        if cut > 0:
            # Rows overwritten within the writes noted: only the last T are still stored.
            rows = rows[cut:]
            index.written += cut
        signal = self._signal(storage, rows, columns, shape)
        breaks = self._breaks(signal)
        index.append(breaks, self._backend)
        # A view, no copy (a launch per write on CUDA): the signal is read for these rows alone,
        # by a gather, so it never shares the storage's memory and nothing writes to it again.
        self._last = signal[-1]

    def _rebuild(
        self,
        storage: Any,
        capacity: int,
        columns: int,
        shape: tuple,
        device: torch.device,
        newest: int | None = None,
    ) -> EpisodeIndex:
        """Reads the boundaries of every stored row (a new storage, or writes the sampler did not
        follow). In a full storage the row after ``newest`` is the oldest (row 0 when unknown)."""
        self._pending = []
        self._last = None
        self._nonempty = {}
        index = self._index = EpisodeIndex(capacity, columns, device)
        size = len(storage) // columns
        if size == 0:
            return index
        if size < capacity:
            rows = torch.arange(size, device=device)
        else:
            oldest = 0 if newest is None else (newest + 1) % capacity
            index.written = oldest  # so that absolute times land on their physical rows
            rows = (oldest + torch.arange(capacity, device=device)) % capacity
        self._feed(storage, index, rows, columns, shape)
        self._last = self._last.clone()  # not a view keeping the whole storage's read alive
        return index

    @staticmethod
    def _static_index(*, trajectories: torch.Tensor | None, ends: torch.Tensor | None) -> EpisodeIndex:
        """The boundaries of a full storage given up front, trajectories continuing from the last row to row 0."""
        if trajectories is not None:
            signal = trajectories.reshape(-1)
            end = signal != torch.roll(signal, -1)
        else:
            end = ends.reshape(-1).to(torch.bool).clone()
        n = end.shape[0]
        if not bool(end.any()):
            end[-1] = True
        # Start right after an end, so that the trajectory across the last row and row 0 is one.
        first = int(end.nonzero()[0, 0])
        order = (first + 1 + torch.arange(n)) % n
        index = EpisodeIndex(n, 1, "cpu")
        index.written = (first + 1) % n
        flags = end[order]
        breaks = torch.cat([torch.ones(1, dtype=torch.bool), flags[:-1]]).unsqueeze(1)
        index._append(breaks)
        return index

    # ------------------------------------------------------------------ sampling
    def _adjusted_batch_size(self, batch_size: int) -> tuple[int, int]:
        if self.num_slices is not None:
            if batch_size % self.num_slices != 0:
                raise BatchSizeError(
                    f"The batch-size must be divisible by the number of slices, got batch_size={batch_size} and "
                    f"num_slices={self.num_slices}."
                )
            return batch_size // self.num_slices, self.num_slices
        if batch_size % self.slice_len != 0:
            raise BatchSizeError(
                f"The batch-size must be divisible by the slice length, got batch_size={batch_size} and "
                f"slice_len={self.slice_len}."
            )
        return self.slice_len, batch_size // self.slice_len

    def _check_span(self, seq_length: int) -> None:
        for side in self.span:
            if side is not True and side and side >= seq_length:
                raise SliceArgumentError("The right and left span must be strictly lower than the sequence length")

    def _draw_uniforms(self, n: int, device: torch.device) -> torch.Tensor:
        rng = self._rng
        if rng is None:
            return torch.rand(n, dtype=torch.float64, device=device)
        return torch.rand(n, dtype=torch.float64, generator=rng, device=rng.device).to(device)

    def _draw_uniforms_into(self, out: torch.Tensor) -> None:
        """Fills ``out`` (float64, contiguous) with the draws :meth:`_draw_uniforms` would return."""
        rng = self._rng
        if rng is None or rng.device == out.device:
            out.uniform_(generator=rng)  # what torch.rand does to the tensor it makes
        else:
            out.copy_(torch.rand(out.shape, dtype=torch.float64, generator=rng, device=rng.device))

    def _trajectory_count(self, index: EpisodeIndex) -> int:
        """The number of live trajectories, read on the host once per change of the index."""
        known = self._nonempty.get("trajectories")
        if known is None:
            known = self._nonempty["trajectories"] = int(index.count(1))
        return known

    def _verified_once(self, index: EpisodeIndex, length: int) -> bool:
        """:meth:`_has_eligible`, read on the host only the first time for this index and length."""
        verified = self._verified
        if verified is not None and verified[0] is index and length in verified[1]:
            return True
        if not self._has_eligible(index, length):
            return False
        if verified is None or verified[0] is not index:
            verified = self._verified = (index, set())
        verified[1].add(length)
        return True

    def _error_word(self, device: torch.device, length: int) -> torch.Tensor:
        """The ``int32 [1]`` word a device draw of slices of ``length`` sets when no trajectory holds one."""
        if self._errors is None or self._errors.device != device:
            self._errors = torch.zeros(1, dtype=torch.int32, device=device)
        self._error_length = length
        return self._errors

    def check_errors(self) -> None:
        """Raises what a draw on the device path recorded since the last check (one host read).

        On CUDA (or ``backend="triton"``) with ``strict_length=True``, whether some trajectory
        holds a slice is read on the host once per slice length; a write after which none does
        makes the next draws return rows of ``-1`` (nothing gathered) and sets an error word on
        the device instead of stalling every sample on a host read. Call this where the host
        waits for the device anyway (a logging step, a checkpoint). A CPU draw raises at the call.

        Raises:
            TrajectoryLengthError: a draw found no trajectory ``L`` long; reported once.
        """
        word = self._errors
        if word is not None and int(word.item()):
            word.zero_()
            raise self._no_trajectory(self._error_length)

    def _has_eligible(self, index: EpisodeIndex, length: int) -> bool:
        known = self._nonempty.get(length)
        if known is None:
            known = self._nonempty[length] = bool(index.count(length) > 0)
        return known

    def _prepare(self, storage: Any, batch_size: int) -> tuple[EpisodeIndex, int, int]:
        batch_size = _check_batch_size(batch_size)
        seq_length, num_slices = self._adjusted_batch_size(batch_size)
        self._check_span(seq_length)
        if len(storage) == 0 and self._static is None:
            raise EmptyBufferError(_EMPTY)
        return self._sync(storage), seq_length, num_slices

    @staticmethod
    def _no_trajectory(seq_length: int) -> TrajectoryLengthError:
        return TrajectoryLengthError(
            f"Did not find a single trajectory with sufficient length (required={seq_length}): ask for shorter "
            "slices (slice_len, or a larger num_slices), or use strict_length=False"
        )

    def sample(self, storage: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Draws the slices of one batch; see the class docstring for what is returned.

        Raises:
            BatchSizeError: ``batch_size`` is not a positive int, or not divisible by
                ``num_slices`` (``slice_len``).
            EmptyBufferError: the storage holds nothing.
            TrajectoryKeyError: the storage holds no boundary entry.
            TrajectoryLengthError: ``strict_length=True`` and no trajectory is ``L`` long.
            TrajectoryStepError: with ``fragmented=True``, stored ids or step numbers that are
                not one integer per step, a negative step, or a repeated trajectory-step pair.
        """
        if self.fragmented:
            return self._sample_fragmented(storage, batch_size)
        index, seq_length, num_slices = self._prepare(storage, batch_size)
        u = self._draw_uniforms(2 * num_slices, index.device)
        return self._slices(storage, index, seq_length, num_slices, u, None)

    # ------------------------------------------------------------------ fragmented trajectories
    def _fragment_keys(self, storage: Any) -> tuple[tuple, tuple]:
        """``(traj_key, step_key)`` of a fragmented sampler, the trajectory key resolved as usual."""
        if self._source is None:
            self._source = self._resolve_source(storage)
        kind, key = self._source
        if kind != "traj":
            raise TrajectoryKeyError(
                "fragmented=True requires a trajectory identifier under traj_key; end-of-trajectory flags alone "
                f"cannot reconstruct interleaved data (the storage has no {self.traj_key or _AUTO_TRAJ_KEYS!r})"
            )
        return key, as_key(self.step_key)

    def _sync_fragments(self, storage: Any) -> FragmentIndex:
        """The per-row records, brought up to date with the rows written since the last draw
        (every stored row after a write the sampler did not follow, or a load)."""
        if storage.ndim != 1:
            raise UnsupportedOptionError(
                f"fragmented=True supports one-dimensional storages only, got a storage with ndim={storage.ndim}"
            )
        keys = self._fragment_keys(storage)
        size = len(storage)
        fragments = self._fragments
        if fragments is None:
            fragments, rows = FragmentIndex(), torch.arange(size)
        else:
            parts = [p.reshape(-1).to("cpu", torch.int64) for p in self._pending]
            rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
            rows = rows[(rows >= 0) & (rows < size)]
        if rows.numel():
            traj, step = read_key(storage, keys[0], (rows,)), read_key(storage, keys[1], (rows,))
            if traj is None or step is None:
                missing = keys[0] if traj is None else keys[1]
                raise TrajectoryKeyError(
                    f"fragmented=True reads {missing!r} of every stored step, and the storage does not hold it: "
                    "write it with the data, or pass traj_key / step_key naming entries it holds"
                )
            fragments.set(rows, traj, step, keys)  # raises before changing anything
        fragments.truncate(size)
        self._fragments, self._pending = fragments, []
        return fragments

    def _sample_fragmented(self, storage: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """TorchRL's fragmented draw: a run uniformly among those long enough, a start uniform in it
        (``randint`` then ``rand`` from the sampler's generator, as TorchRL draws them)."""
        batch_size = _check_batch_size(batch_size)
        seq_length, num_slices = self._adjusted_batch_size(batch_size)
        if len(storage) == 0:
            raise EmptyBufferError(_EMPTY)
        fragments = self._sync_fragments(storage)
        ordered, offsets, lengths = fragments.runs(self._fragment_keys(storage))
        if lengths.numel() == 0:
            raise EmptyBufferError("no stored step carries a trajectory record to sample from")
        rng = self._rng
        draw = {"device": "cpu"} if rng is None else {"generator": rng, "device": rng.device}
        target = None
        if self.strict_length:
            eligible = lengths >= seq_length
            if not bool(eligible.any()):
                raise self._no_trajectory(seq_length)
            offsets, lengths = offsets[eligible], lengths[eligible]
            run = torch.randint(lengths.shape[0], (num_slices,), **draw).cpu()
            seq: int | torch.Tensor = seq_length
        else:
            run = torch.randint(lengths.shape[0], (num_slices,), **draw).cpu()
            seq = lengths[run].clamp_max(seq_length)
            target = seq_length if self.pad_output else None
        available = lengths[run] - seq + 1
        first = offsets[run] + (torch.rand(num_slices, **draw).cpu() * available).floor().to(torch.int64)
        device = self._storage_device_of(storage)
        mask = None
        if target is not None:
            steps = torch.arange(target)
            mask = (steps.unsqueeze(0) < seq.unsqueeze(1)).reshape(-1).to(device)
            rows = ordered[first.unsqueeze(1) + torch.minimum(steps.unsqueeze(0), (seq - 1).unsqueeze(1))]
        elif isinstance(seq, int):
            rows = ordered[first.unsqueeze(1) + torch.arange(seq)]
        else:
            slice_of = torch.repeat_interleave(torch.arange(num_slices), seq)
            within = torch.arange(slice_of.shape[0]) - (seq.cumsum(0) - seq)[slice_of]
            rows = ordered[first[slice_of] + within]
        rows = rows.reshape(-1).to(device)
        if isinstance(seq, torch.Tensor):
            seq = seq.to(device)
        return self._finish(storage, None, rows, None, num_slices, seq, target, mask)

    def _slices(
        self,
        storage: Any,
        index: EpisodeIndex,
        seq_length: int,
        num_slices: int,
        u: torch.Tensor,
        picked: tuple | None,
    ) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Windows of ``seq_length`` in trajectories drawn with the first half of ``u`` (or given
        as ``picked``), starting where the second half says."""
        window_path = not any(self.span) and picked is None and index.columns == 1
        on_device = window_path and self.strict_length and device_path(u, self._backend)
        if on_device:
            # Read on the host once per index and length; a later write that leaves no
            # trajectory L long is the window draw's recorded error (see check_errors).
            short = not self._verified_once(index, seq_length)
        else:
            short = not self._has_eligible(index, seq_length)
        if self.strict_length and short:
            raise self._no_trajectory(seq_length)
        # Only without strict_length does a short trajectory change the output's shape.
        any_short = not self.strict_length and (short or not self._nonempty_equal(index, seq_length))
        pool = seq_length if self.strict_length else 1
        ragged = any_short or any(self.span)
        if not ragged and window_path:
            # The common case: one launch (or compiled loop) draws and lists every window and,
            # where the flags are plain columns of the storage, marks its steps for the info.
            flags = self._flag_columns(storage, index)
            error = self._error_word(index.device, seq_length) if on_device else None
            rows, marks = index.windows(pool, seq_length, u, flags or (None, None, None), self._backend, error)
            if flags is not None:
                return self._finish_marked(rows, marks, init=flags[2] is not None)
            return self._finish(storage, index, rows, None, num_slices, seq_length, None, None)
        u_traj, u_start = u[:num_slices], u[num_slices:]
        if picked is None:
            col, start, length = index.draw(pool, u_traj)
        else:
            col, start, length = picked
        if not ragged:
            # A start uniform among the length - L + 1 positions (the cast floors: u >= 0).
            rel = (u_start * (length - (seq_length - 1))).to(torch.int64)
            steps = (start + rel).unsqueeze(1) + self._offsets(seq_length, start.device)
            rows = (steps % index.capacity).reshape(-1)
            cols = None if col is None else col.unsqueeze(1).expand(-1, seq_length).reshape(-1)
            return self._finish(storage, index, rows, cols, num_slices, seq_length, None, None)
        if col is None:
            col = torch.zeros_like(start)
        seq = length.clamp_max(seq_length) if not self.strict_length else torch.full_like(length, seq_length)
        left, right = self.span
        if not right:
            end_point = length - seq + 1
        elif right is True:
            # TorchRL's code allows a start one past the last step, an empty slice; its
            # documentation promises at least one step per slice, which this keeps.
            end_point = length
        else:
            end_point = length - right
        if not left:
            start_point = torch.zeros_like(length)
        elif left is True:
            start_point = torch.full_like(length, -seq_length + 1)
        else:
            start_point = torch.full_like(length, -left)
        rel = (u_start * (end_point - start_point)).floor().to(torch.int64) + start_point
        if left:
            seq = torch.where(rel < 0, seq + rel, seq)
            rel = rel.clamp_min(0)
        if right:
            seq = torch.minimum(seq, length - rel)
        first = start + rel
        target = seq_length if (self.pad_output and not self.strict_length and any_short) else None
        if target is not None:
            offsets = torch.arange(target, device=first.device)
            mask = offsets.unsqueeze(0) < seq.unsqueeze(1)
            steps = first.unsqueeze(1) + torch.minimum(offsets.unsqueeze(0), (seq - 1).clamp_min(0).unsqueeze(1))
            rows = (steps % index.capacity).reshape(-1)
            cols = col.unsqueeze(1).expand(-1, target).reshape(-1)
            return self._finish(storage, index, rows, cols, num_slices, seq, target, mask.reshape(-1))
        slice_of = torch.repeat_interleave(torch.arange(seq.shape[0], device=seq.device), seq)
        offsets = torch.arange(slice_of.shape[0], device=seq.device) - (seq.cumsum(0) - seq)[slice_of]
        rows = ((first[slice_of] + offsets) % index.capacity).reshape(-1)
        return self._finish(storage, index, rows, col[slice_of], seq.shape[0], seq, None, None)

    def _flag_columns(self, storage: Any, index: EpisodeIndex) -> tuple | None:
        """The stored ``(done, terminated, init)`` flags the info entries read, as ``bool [T]``
        columns (None for one not stored, or not asked for), or None when one is stored in
        another form (then :meth:`_finish` reads them)."""
        # Kept while the storage's leaves, the index's rows and device, and the keys are the same
        # (the leaves list is replaced whenever the storage allocates anew).
        cache_key = (id(storage), storage._row_sources, index.capacity, index.device,
                     self.truncated_key, self.init_key)
        cached = self._flags_cache
        if cached is not None and cached[0][0] == cache_key[0] and all(map(is_, cached[0][1:], cache_key[1:])):
            return cached[1]
        flags = self._read_flag_columns(storage, index)
        self._flags_cache = (cache_key, flags)
        return flags

    def _read_flag_columns(self, storage: Any, index: EpisodeIndex) -> tuple | None:
        if storage.ndim != 1:
            return None
        keys = [None, None, None]
        if self.truncated_key is not None:
            truncated_key = as_key(self.truncated_key)
            keys[0], keys[1] = _replace_last(truncated_key, "done"), _replace_last(truncated_key, "terminated")
        if self.init_key is not None:
            keys[2] = as_key(self.init_key)
        columns = []
        for key in keys:
            usable, column = (True, None) if key is None else flag_column(storage, key, index.capacity, index.device)
            if not usable:
                return None
            columns.append(column)
        return tuple(columns)

    def _finish_marked(self, rows: torch.Tensor, marks: torch.Tensor, *, init: bool) -> tuple[tuple[torch.Tensor], dict]:
        """:meth:`_finish`'s index and info for a one-dimensional storage, from the marks the
        window draw wrote (``init``: the storage holds the init flag)."""
        names = self._mark_names
        if names is None or names[0] != (self.truncated_key, self.init_key):
            names = self._mark_names = ((self.truncated_key, self.init_key), self._info_names())
        marked = names[1]
        # Each entry an [n, 1] view of one row of the marks.
        columns = marks.unsqueeze(-1).unbind(0)
        info = {} if marked[0] is None else dict(zip(marked[:3], columns))
        if init and marked[3] is not None:
            info[marked[3]] = columns[3]
        return (rows,), info

    def _info_names(self) -> tuple:
        """The info keys of the marks, in the order of :data:`~gpubuf.ops.slice_windows.MARKS`
        (the first three absent without ``truncated_key``, the last None without ``init_key``)."""
        names: list = []
        if self.truncated_key is not None:
            truncated_key = as_key(self.truncated_key)
            names = [_out_key(truncated_key), _out_key(_replace_last(truncated_key, "done")),
                     _out_key(_replace_last(truncated_key, "terminated"))]
        init_name = None if self.init_key is None else _out_key(as_key(self.init_key))
        return (*names, *([None] * (3 - len(names))), init_name)

    def _nonempty_equal(self, index: EpisodeIndex, seq_length: int) -> bool:
        """Whether every trajectory is at least ``seq_length`` long (no short one)."""
        key = -seq_length  # cached beside the per-length emptiness flags
        known = self._nonempty.get(key)
        if known is None:
            known = self._nonempty[key] = bool(index.count(seq_length) == index.count(1))
        return known

    def _finish(
        self,
        storage: Any,
        index: EpisodeIndex,
        rows: torch.Tensor,
        cols: torch.Tensor,
        num_slices: int,
        seq: int | torch.Tensor,
        target: int | None,
        mask: torch.Tensor | None,
        init: bool = True,
    ) -> tuple[tuple[torch.Tensor, ...], dict]:
        """The per-dim index of the steps and TorchRL's info entries (``init``: mark slice starts)."""
        ndim = storage.ndim
        if ndim == 1:
            out: tuple = (rows,)
        else:
            if cols is None:
                cols = torch.zeros_like(rows)
            _, _, shape = self._geometry(storage)
            coords = []
            rest = cols
            for size in reversed(shape):
                coords.append(rest % size)
                rest = rest // size
            out = (rows, *reversed(coords))
        n = rows.shape[0]
        device = rows.device
        info: dict = {}
        fixed = None
        if target is not None:
            starts = torch.arange(num_slices, device=device) * target
            lasts = starts + (seq - 1).clamp_min(0)
        elif isinstance(seq, int):
            fixed = self._marks(num_slices, seq, device)
            starts = fixed[1]
        else:
            ends = seq.cumsum(0)
            starts, lasts = ends - seq, ends - 1
        if self.truncated_key is not None:
            truncated_key = as_key(self.truncated_key)
            done_key = _replace_last(truncated_key, "done")
            terminated_key = _replace_last(truncated_key, "terminated")
            if fixed is not None:
                truncated = fixed[0].clone()
            else:
                truncated = torch.zeros((n, 1), dtype=torch.bool, device=device)
                truncated[lasts] = True
            done = read_key(storage, done_key, out)
            if done is None:
                done = truncated.clone()
            else:
                done = done.to(device)
                # Stored flags of another dtype (a float done) read as set where nonzero; a
                # bool one, the usual, takes no extra op.
                done = (done if done.dtype == torch.bool else done != 0) | truncated
            terminated = read_key(storage, terminated_key, out)
            terminated = torch.zeros_like(truncated) if terminated is None else terminated.to(device)
            info[_out_key(truncated_key)] = truncated
            info[_out_key(done_key)] = done
            info[_out_key(terminated_key)] = terminated
        if mask is not None:
            info[("collector", "mask")] = mask
        if init and self.init_key is not None:
            init_key = as_key(self.init_key)
            stored = read_key(storage, init_key, out)
            if stored is not None:
                marker = torch.zeros_like(stored, device=device)
                marker[starts] = True
                info[_out_key(init_key)] = marker | stored.to(device)
        return out, info

    def _offsets(self, seq_length: int, device: torch.device) -> torch.Tensor:
        """``arange(seq_length)`` on ``device``, kept between draws."""
        key = ("offsets", seq_length, device)
        found = self._templates.get(key)
        if found is None:
            found = self._templates[key] = torch.arange(seq_length, device=device)
        return found

    def _marks(self, num_slices: int, seq_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """For slices of one length: the truncation column (``[N, 1]``, True at each slice's last
        step; copy before handing out) and each slice's first position, kept between draws."""
        key = ("marks", num_slices, seq_length, device)
        found = self._templates.get(key)
        if found is None:
            truncated = torch.zeros((num_slices, seq_length), dtype=torch.bool, device=device)
            truncated[:, -1] = True
            starts = torch.arange(num_slices, device=device) * seq_length
            found = self._templates[key] = (truncated.reshape(-1, 1), starts)
        return found

    # ------------------------------------------------------------------ state
    def _prefetch_state(self) -> None:
        # A draw with replacement only consumes random numbers (the buffer's to restore); the
        # boundaries it brought up to date stay valid.
        return None

    def _prefetch_restore(self, state: None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """The boundaries (plain values and CPU tensors), so a loaded buffer samples without rescanning."""
        index = self._static if self._static is not None else self._index
        state: dict[str, Any] = {"index": None if index is None else index.state_dict()}
        pending = [p.cpu() for p in self._pending]
        state["pending"] = pending
        state["source_kind"] = None if self._source is None else self._source[0]
        state["source_keys"] = None if self._source is None else [list(k) for k in self._keys_list()]
        state["last"] = None if self._last is None else self._last.to("cpu", copy=True)
        return state

    def _keys_list(self) -> list[tuple]:
        kind, keys = self._source
        return [keys] if kind == "traj" else list(keys)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s boundaries (validated first; nothing changes on error).

        Raises:
            StateDictError: a state whose fields do not fit together (a ``ValueError``).
        """
        self._install_slice_state(self._parse_slice_state(state_dict))

    def _check_state_dict(self, state_dict: Any) -> None:
        self._parse_slice_state(state_dict)

    def _parse_slice_state(self, state_dict: Any) -> tuple:
        """The boundaries of a :meth:`state_dict`, checked; changes nothing.

        Raises:
            StateDictError: anything that does not describe boundaries.
        """
        if not isinstance(state_dict, dict):
            raise StateDictError(f"slice sampler state: expected a dict, got {type(state_dict).__name__}")
        try:
            index_state = state_dict.get("index")
            if index_state is not None:
                _check_index_state(index_state)
            index = None if index_state is None else EpisodeIndex.from_state_dict(index_state, "cpu")
            kind = state_dict.get("source_kind")
            source = None
            if kind is not None:
                keys = [tuple(k) for k in state_dict["source_keys"]]
                if kind not in ("traj", "end") or not keys:
                    raise StateDictError(f"unknown trajectory boundary source {kind!r} in the sampler's state")
                source = (kind, keys[0]) if kind == "traj" else (kind, tuple(keys))
            pending = [torch.as_tensor(p) for p in state_dict.get("pending", [])]
            if any(p.dtype.is_floating_point or p.ndim != 1 or p.device.type == "meta" for p in pending):
                raise StateDictError("pending rows must be 1-D integer tensors")
            last = state_dict.get("last")
            last = None if last is None else torch.as_tensor(last).clone()
            if last is not None and (last.device.type == "meta" or last.dtype.is_floating_point or last.dtype.is_complex):
                raise StateDictError("the newest rows' marks (last) must be an integer or bool tensor with values")
        except StateDictError as err:
            raise StateDictError(f"slice sampler state: {err}") from None
        except Exception as err:  # noqa: BLE001 - an edited state fails in many ways
            raise StateDictError(f"slice sampler state does not describe boundaries: {type(err).__name__}: {err}") from None
        return index, source, pending, last

    def _install_slice_state(self, parsed: tuple) -> None:
        index, source, pending, last = parsed
        if self._static is not None:
            if index is not None:
                self._static = index
        else:
            self._index = index
        self._source = source
        self._pending = pending
        self._fragments = None  # fragmented records are read again in full at the next draw
        self._last = None if last is None else torch.as_tensor(last).clone()
        self._nonempty = {}

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}, "
            f"end_key={self.end_key}, end_keys={self.end_keys}, traj_key={self.traj_key}, "
            f"truncated_key={self.truncated_key}, strict_length={self.strict_length}, pad_output={self.pad_output})"
        )


def _check_index_state(state: Any) -> None:
    """Refuses an episode index state whose sizes do not match its tensors (sizes that are
    checked against the tensors given, so an edited size never allocates what it says)."""
    if not isinstance(state, dict):
        raise StateDictError(f"the episode index state must be a dict, got {type(state).__name__}")
    sizes = [state.get(name) for name in ("capacity", "columns", "written")]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in sizes):
        raise StateDictError(f"episode index capacity, columns and written must be ints >= 0, got {sizes}")
    capacity, columns, _ = sizes
    for name, shape in (("start", (columns, capacity + 1)), ("stop", (columns, capacity + 1)),
                        ("row_traj", (columns, capacity + 1)), ("head", (columns,)), ("tail", (columns,))):
        value = state.get(name)
        if (
            not isinstance(value, torch.Tensor)
            or tuple(value.shape) != shape
            or value.device.type == "meta"
            or value.dtype.is_floating_point
            or value.dtype.is_complex
        ):
            raise StateDictError(f"episode index field {name!r} must be an integer tensor of shape {list(shape)}")


class _TrajectoryCount:
    """What :class:`SamplerWithoutReplacement` reads of a storage, for an epoch over trajectories."""

    ndim = 1

    def __init__(self, count: int, device: torch.device) -> None:
        self._count = count
        self._row_sources = [torch.empty(0, device=device)]

    def __len__(self) -> int:
        return self._count


class SliceSamplerWithoutReplacement(SliceSampler, SamplerWithoutReplacement):
    """Slices of trajectories, each trajectory at most once per epoch (TorchRL's ``SliceSamplerWithoutReplacement``).

    An epoch is a permutation of the stored trajectories (in storage order with
    ``shuffle=False``); each batch takes the next ``num_slices`` of them and one slice, at a
    uniform start, of each. With ``strict_length=True`` the trajectories shorter than ``L`` are
    dropped from their batch, which then holds fewer slices (as in TorchRL). A new epoch starts
    when the number of trajectories changes.

    Keyword Args:
        drop_last: end the epoch before a batch of fewer than ``num_slices`` trajectories.
        shuffle: draw the trajectories in a random order (default) or in storage order.
        Others: as :class:`SliceSampler` (``cache_values`` is always on; ``span`` and
            ``pad_output`` are not taken, as in TorchRL).
    """

    def __init__(
        self,
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        drop_last: bool = False,
        end_key: Any = None,
        end_keys: Sequence[Any] | None = None,
        traj_key: Any = None,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        truncated_key: Any = ("next", "truncated"),
        init_key: Any = "is_init",
        strict_length: bool = True,
        shuffle: bool = True,
        compile: bool | dict = False,
        use_gpu: torch.device | bool = False,
    ) -> None:
        SliceSampler.__init__(
            self,
            num_slices=num_slices,
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            cache_values=True,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            ends=ends,
            trajectories=trajectories,
            compile=compile,
            use_gpu=use_gpu,
        )
        SamplerWithoutReplacement.__init__(self, drop_last=drop_last, shuffle=shuffle)
        # (positions, draws table, count, width, the positions' memory) of the last epochs laid out
        self._epochs: list[tuple] = []
        self._lay_out = False  # whether the current draw takes the window path (see sample)

    def can_sample(self, storage: Any, batch_size: int) -> bool:
        return len(storage) > 0

    def sample(self, storage: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """The next ``num_slices`` trajectories of the epoch, one slice of each.

        Where every trajectory is at least ``L`` long (no slice is dropped or cut short) on a
        one-dimensional storage, the epoch's picks go to the window draw as uniforms (see
        :meth:`_plan_epoch`): the start draws, the windows and the gather, three launches on the
        device path, and no host synchronisation while no write changes the trajectories.

        Raises:
            As :meth:`SliceSampler.sample`; ``BatchSizeError`` with ``drop_last=True`` and fewer
            trajectories than ``num_slices``.
        """
        index, seq_length, num_slices = self._prepare(storage, batch_size)
        count = self._trajectory_count(index)
        if count == 0:
            raise EmptyBufferError(_EMPTY)
        if self.strict_length and not self._has_eligible(index, seq_length):
            raise self._no_trajectory(seq_length)
        whole = index.columns == 1 and self._nonempty_equal(index, seq_length)
        self._lay_out = whole  # a new epoch started by the draw below is laid out only if it is used
        remaining = self._sample_list
        positions, _ = SamplerWithoutReplacement.sample(self, _TrajectoryCount(count, index.device), num_slices)
        positions = positions.to(index.device)
        if whole and remaining is not None and self._planned(positions) is None and (
            _memory_of(remaining) == _memory_of(positions)
        ):
            # Drawn from an epoch not laid out yet (restored from a checkpoint, or begun on the
            # general path): lay out what was left of it.
            self._plan_epoch(remaining, count, num_slices)
        if whole:
            u = self._epoch_uniforms(positions, count)
            flags = self._flag_columns(storage, index)
            rows, marks = index.windows(1, seq_length, u, flags or (None, None, None), self._backend)
            if flags is not None:
                return self._finish_marked(rows, marks, init=flags[2] is not None)
            return self._finish(storage, index, rows, None, positions.shape[0], seq_length, None, None)
        everything = index.eligible(1)
        col, start, length = index.pick(everything, positions)
        if self.strict_length:
            keep = length >= seq_length
            col, start, length = col[keep], start[keep], length[keep]
        picked = (col, start, length)
        u = self._draw_uniforms(col.shape[0], index.device)
        return self._slices_without_replacement(storage, index, seq_length, picked, u)

    # ------------------------------------------------------------------ the epoch as window draws
    # The window draw (EpisodeIndex.windows) picks trajectory k = floor(u * n) of the n eligible
    # ones. With every trajectory L long or more the eligible ones are all of them, in the order
    # the epoch's positions count them, so position k is the draw u = (k + 1/2) / n, exactly (in
    # float64, for n below 2^50). An epoch's draws are laid out once, a batch a row, each row
    # followed by room for the batch's start draws: a batch then takes its row as it is.
    def _new_epoch(self, len_storage: int, batch_size: int, device: Any) -> None:
        SamplerWithoutReplacement._new_epoch(self, len_storage, batch_size, device)
        if self._lay_out:
            self._plan_epoch(self._sample_list, len_storage, batch_size)

    def _plan_epoch(self, order: torch.Tensor, count: int, width: int) -> None:
        """Lays out the draws of the positions ``order`` (the epoch's, or what is left of it) as
        rows ``[k_0 .. k_{S-1} draws | S free]`` of ``S = width`` positions each (the full batches).
        The last two layouts are kept (an epoch starts while its predecessor's last batch is
        handed out)."""
        full = order.numel() // width
        table = torch.empty(full, 2 * width, dtype=torch.float64, device=order.device)
        table[:, :width] = ((order[: full * width].to(torch.float64) + 0.5) / count).view(full, width)
        self._epochs = [*self._epochs[-1:], (order, table, count, width, _memory_of(order))]

    def _planned(self, positions: torch.Tensor) -> tuple | None:
        """The layout whose positions ``positions`` was sliced from, or None (the layouts hold
        their positions, so no other tensor's memory starts where theirs does)."""
        memory = _memory_of(positions)
        for plan in reversed(self._epochs):
            if plan[4] == memory:
                return plan
        return None

    def _epoch_uniforms(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        """``float64 [2 S]``: the draws of ``positions`` then ``S`` new start draws (one launch
        for a full batch of a laid-out epoch; a short last batch builds its own)."""
        s = positions.numel()
        plan = self._planned(positions)
        if plan is not None:
            order, table, planned_count, width, _ = plan
            offset = positions.storage_offset() - order.storage_offset()
            if planned_count == count and width == s and offset % s == 0 and offset // s < table.shape[0]:
                u = table[offset // s]
                self._draw_uniforms_into(u[s:])
                return u
        picks = (positions.to(torch.float64) + 0.5) / count
        return torch.cat([picks, self._draw_uniforms(s, positions.device)])

    def _slices_without_replacement(
        self, storage: Any, index: EpisodeIndex, seq_length: int, picked: tuple, u: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, ...], dict]:
        col, start, length = picked
        if self.strict_length or bool((length >= seq_length).all()):
            rel = (u * (length - seq_length + 1)).floor().to(torch.int64)
            first = start + rel
            steps = first.unsqueeze(1) + torch.arange(seq_length, device=first.device)
            rows = (steps % index.capacity).reshape(-1)
            cols = col.unsqueeze(1).expand(-1, seq_length).reshape(-1)
            return self._finish(storage, index, rows, cols, col.shape[0], seq_length, None, None)
        seq = length.clamp_max(seq_length)
        rel = (u * (length - seq + 1)).floor().to(torch.int64)
        first = start + rel
        slice_of = torch.repeat_interleave(torch.arange(seq.shape[0], device=seq.device), seq)
        offsets = torch.arange(slice_of.shape[0], device=seq.device) - (seq.cumsum(0) - seq)[slice_of]
        rows = (first[slice_of] + offsets) % index.capacity
        return self._finish(storage, index, rows, col[slice_of], seq.shape[0], seq, None, None)

    def _prefetch_state(self) -> tuple:
        return (self._sample_list, self.len_storage, self._ran_out, self._remaining)

    def _prefetch_restore(self, state: tuple) -> None:
        self._sample_list, self.len_storage, self._ran_out, self._remaining = state

    def _empty(self) -> None:
        SliceSampler._empty(self)
        SamplerWithoutReplacement._empty(self)
        self._epochs = []

    def state_dict(self) -> dict[str, Any]:
        state = SliceSampler.state_dict(self)
        state.update(SamplerWithoutReplacement.state_dict(self))
        return state

    def _check_state_dict(self, state_dict: Any) -> None:
        self._parse_slice_state(state_dict)
        SamplerWithoutReplacement._check_state_dict(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        parsed = self._parse_slice_state(state_dict)
        SamplerWithoutReplacement._check_state_dict(self, state_dict)
        SamplerWithoutReplacement.load_state_dict(self, state_dict)
        self._install_slice_state(parsed)
        self._epochs = []  # laid out again from the loaded positions at the next draw

    def __repr__(self) -> str:
        return SliceSampler.__repr__(self)


_HOST = torch.device("cpu")


def _memory_of(positions: torch.Tensor) -> int:
    """The address of the int64 memory a view of positions was sliced from (its storage's start:
    cheaper than ``untyped_storage()``, which makes an object)."""
    return positions.data_ptr() - positions.storage_offset() * 8
