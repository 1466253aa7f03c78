"""``StreamingSliceSampler``: newly completed windows first, then uniform slices (TorchRL's).

Rows arrive in chronological order (one stream per buffer, as one environment writes). Each
write's rows are cut into non-overlapping windows of ``slice_len`` steps that do not cross a
trajectory boundary (a done flag, a change of trajectory id, a stored ``is_init``); a window is
queued once complete (the steps left over wait for the next write of the same trajectory). A
draw takes queued windows, oldest first, then fills the batch with :class:`SliceSampler`'s
uniform slices. A per-row write count stamps each queued step, so a window whose rows were
overwritten before it was drawn is dropped.

The rows written are noted by :meth:`extend` and read before the next draw (the buffer tells a
sampler which rows a write filled, not what they hold): work proportional to the rows written,
never a scan of the storage. A write whose rows are overwritten by a later write before a draw
reads the later rows' values; its windows are dropped by their stamps anyway.
"""

from __future__ import annotations

import collections
import numbers
from typing import Any, Sequence

import torch

from gpubuf.errors import SliceArgumentError
from gpubuf.samplers._columns import as_key, has_key, read_key
from gpubuf.samplers.random import _check_batch_size
from gpubuf.samplers.slice import SliceSampler

__all__ = ["StreamingSliceSampler"]

_EMPTY = torch.zeros(0, dtype=torch.int64)


def _flags(values: torch.Tensor | None, n: int) -> torch.Tensor:
    """One bool per row (any of the row's values set), False where the entry is absent."""
    if values is None:
        return torch.zeros(n, dtype=torch.bool)
    return values.reshape(n, -1).any(-1).cpu()


class StreamingSliceSampler(SliceSampler):
    """Queued windows of newly written steps first, then uniform slices (TorchRL's ``StreamingSliceSampler``).

    Keyword Args:
        slice_len: the length of every queued and sampled slice (a positive int).
        end_key, end_keys, traj_key, cache_values, truncated_key, init_key, strict_length,
        pad_output, compile, span, use_gpu: as :class:`SliceSampler` (the last ones apply to
            the uniform fill). Boundaries of the stream: the end keys' flags (``("next",
            "done")`` by default), a change of the trajectory id when one is stored, and a
            stored ``"is_init"``.

    Storages:
        One-dimensional storages of TensorDicts, written in chronological order (round robin).

    Returns from :meth:`sample`:
        As :class:`SliceSampler.sample`: the queued windows' steps come first, then the uniform
        slices; the info entries of both are concatenated.

    Raises:
        SliceArgumentError: ``slice_len`` that is not a positive int; a batch whose slice length
            is not ``slice_len``; a storage of ``ndim > 1`` or one that cannot hold a window.
        TrajectoryKeyError: a storage holding none of the boundary entries.
    """

    def __init__(
        self,
        *,
        slice_len: int,
        end_key: Any = None,
        end_keys: Sequence[Any] | None = None,
        traj_key: Any = None,
        cache_values: bool = False,
        truncated_key: Any = ("next", "truncated"),
        init_key: Any = "is_init",
        strict_length: bool = True,
        pad_output: bool = False,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        use_gpu: torch.device | bool = False,
    ) -> None:
        if isinstance(slice_len, bool) or not isinstance(slice_len, numbers.Integral) or slice_len < 1:
            raise SliceArgumentError(f"slice_len must be a positive integer, got {slice_len!r}")
        super().__init__(
            slice_len=int(slice_len),
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            cache_values=cache_values,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            pad_output=pad_output,
            compile=compile,
            span=span,
            use_gpu=use_gpu,
        )
        self._reset_stream()

    def _reset_stream(self) -> None:
        self._queued: collections.deque = collections.deque()  # (rows [L], stamps [L]), oldest first
        self._carry = (_EMPTY, _EMPTY)  # the last trajectory's steps not yet in a window, with stamps
        self._stamps = _EMPTY.clone()  # writes per row so far
        self._writes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, stamps) not read yet
        self._last_traj: torch.Tensor | None = None
        self._last_was_done = False

    # ------------------------------------------------------------------ writes
    def extend(self, index: Any) -> None:
        """Notes the rows written (stamped now, read before the next draw)."""
        super().extend(index)
        if isinstance(index, tuple):
            if len(index) != 1:
                raise SliceArgumentError("StreamingSliceSampler requires one-dimensional write indices.")
            index = index[0]
        self._stamp(torch.as_tensor(index, dtype=torch.int64).reshape(-1).cpu())

    def add(self, index: Any) -> None:
        self.extend(torch.as_tensor(index).reshape(1))

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        """Rows written behind the buffer's back: noted as a write of the stream (TorchRL's hook)."""
        super().mark_update(index, storage=storage)
        self._stamp(torch.as_tensor(index, dtype=torch.int64).reshape(-1).cpu())

    def _stamp(self, rows: torch.Tensor) -> None:
        if rows.numel() == 0:
            return
        size = int(rows.max()) + 1
        if size > self._stamps.shape[0]:
            grown = torch.zeros(max(size, 2 * self._stamps.shape[0]), dtype=torch.int64)
            grown[: self._stamps.shape[0]] = self._stamps
            self._stamps = grown
        if rows.unique().numel() == rows.numel():
            stamps = self._stamps[rows] + 1
            self._stamps[rows] = stamps
        else:  # a row written twice in one write: each occurrence gets its own count
            stamps = torch.empty_like(rows)
            for position, row in enumerate(rows.tolist()):
                self._stamps[row] += 1
                stamps[position] = self._stamps[row]
        self._writes.append((rows, stamps))

    def _read_writes(self, storage: Any) -> None:
        """Cuts the writes noted since the last draw into windows, in write order."""
        if storage.ndim != 1:
            raise SliceArgumentError("StreamingSliceSampler requires a one-dimensional storage.")
        if storage.max_size < self.slice_len:
            raise SliceArgumentError(
                f"Storage capacity {storage.max_size} cannot hold one slice_len={self.slice_len} window."
            )
        if self._source is None:
            self._source = self._resolve_source(storage)  # raises before a write is consumed
        writes, self._writes = self._writes, []
        for rows, stamps in writes:
            if rows.numel() > storage.max_size:
                rows, stamps = rows[-storage.max_size :], stamps[-storage.max_size :]
            self._cut(storage, rows, stamps)
        while len(self._queued) > storage.max_size // self.slice_len:
            self._queued.popleft()  # disjoint windows: older ones than this were overwritten

    def _cut(self, storage: Any, rows: torch.Tensor, stamps: torch.Tensor) -> None:
        n = rows.shape[0]
        if self._source is None:
            self._source = self._resolve_source(storage)
        index = (rows.to(self._storage_device_of(storage)),)
        trajectory = None
        if self._source[0] == "traj":
            values = read_key(storage, self._source[1], index)
            trajectory = None if values is None else values.reshape(n, -1).cpu()
        ends = self.end_keys if self.end_keys is not None else (as_key(self.end_key),)
        done = torch.zeros(n, dtype=torch.bool)
        for key in ends:
            if has_key(storage, key):
                done |= _flags(read_key(storage, key, index), n)
        init = _flags(read_key(storage, ("is_init",), index) if has_key(storage, ("is_init",)) else None, n)
        before = init.clone()  # a boundary before each row
        before[1:] |= done[:-1]
        if trajectory is not None:
            before[1:] |= (trajectory[1:] != trajectory[:-1]).any(-1)
            if self._last_traj is not None:
                before[0] |= bool((trajectory[0] != self._last_traj).any())
        before[0] |= self._last_was_done
        carry_rows, carry_stamps = self._carry
        if carry_rows.numel() and not bool(before[0]):
            rows, stamps = torch.cat([carry_rows, rows]), torch.cat([carry_stamps, stamps])
            done = torch.cat([torch.zeros(carry_rows.numel(), dtype=torch.bool), done])
            before = torch.cat([torch.zeros(carry_rows.numel(), dtype=torch.bool), before])
        self._carry = (_EMPTY, _EMPTY)
        before[0] = True
        starts = before.nonzero().squeeze(1).tolist()
        stops = starts[1:] + [rows.shape[0]]
        length = self.slice_len
        for segment, (start, stop) in enumerate(zip(starts, stops)):
            whole = (stop - start) // length * length
            if whole:
                windows = rows[start : start + whole].reshape(-1, length)
                windows_stamps = stamps[start : start + whole].reshape(-1, length)
                self._queued.extend(zip(windows.unbind(0), windows_stamps.unbind(0)))
            if segment == len(starts) - 1 and whole < stop - start and not bool(done[stop - 1]):
                self._carry = (rows[start + whole : stop].clone(), stamps[start + whole : stop].clone())
        if trajectory is not None:
            self._last_traj = trajectory[-1].clone()
        self._last_was_done = bool(done[-1])

    def _end_stream(self, storage: Any) -> None:
        """As :meth:`SliceSampler._end_stream`; the writes before are cut into windows first, then
        the unfinished window is dropped (its trajectory will not grow) and the next write starts
        a new one."""
        self._read_writes(storage)
        super()._end_stream(storage)
        self._carry = (_EMPTY, _EMPTY)
        self._last_traj = None
        self._last_was_done = True

    # ------------------------------------------------------------------ sampling
    def sample(self, storage: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Queued windows first (at most ``num_slices``), the rest of the batch uniform slices.

        Raises:
            As :meth:`SliceSampler.sample`; ``SliceArgumentError`` for a batch whose slice
            length is not ``slice_len``.
        """
        batch_size = _check_batch_size(batch_size)
        seq_length, num_slices = self._adjusted_batch_size(batch_size)
        if seq_length != self.slice_len:
            raise SliceArgumentError(f"StreamingSliceSampler expected slice length {self.slice_len}, got {seq_length}.")
        self._read_writes(storage)
        fresh = []
        while self._queued and len(fresh) < num_slices:
            rows, stamps = self._queued.popleft()
            if int(rows.max()) < self._stamps.shape[0] and torch.equal(self._stamps[rows], stamps):
                fresh.append(rows)
        if not fresh:
            return super().sample(storage, batch_size)
        device = self._storage_device_of(storage)
        rows = torch.stack(fresh).reshape(-1).to(device)
        mask = None
        if self.pad_output and not self.strict_length:
            mask = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
        index, info = self._finish(storage, None, rows, None, len(fresh), self.slice_len, None, mask)
        if len(fresh) == num_slices:
            return index, info
        more_index, more_info = super().sample(storage, (num_slices - len(fresh)) * self.slice_len)
        index = tuple(torch.cat([a.to(b.device), b]) for a, b in zip(index, more_index))
        info = {key: torch.cat([info[key].to(more_info[key].device), more_info[key]]) for key in info.keys() | more_info.keys()}
        return index, info

    # ------------------------------------------------------------------ state
    def _empty(self) -> None:
        super()._empty()
        self._reset_stream()

    def _prefetch_state(self) -> tuple:
        return (collections.deque(self._queued), list(self._writes), self._carry, self._last_traj, self._last_was_done,
                self._source)

    def _prefetch_restore(self, state: tuple) -> None:
        self._queued, self._writes, self._carry, self._last_traj, self._last_was_done, self._source = state

    def state_dict(self) -> dict[str, Any]:
        """The boundaries (as :class:`SliceSampler`) and the stream: stamps, queue, leftover steps."""
        state = super().state_dict()
        length = self.slice_len
        queued = list(self._queued)
        state["stream"] = {
            "slice_len": length,
            "stamps": self._stamps.clone(),
            "queued_rows": torch.stack([q[0] for q in queued]) if queued else torch.zeros(0, length, dtype=torch.int64),
            "queued_stamps": torch.stack([q[1] for q in queued]) if queued else torch.zeros(0, length, dtype=torch.int64),
            "writes": [torch.stack(w) for w in self._writes],
            "carry": torch.stack(self._carry),
            "last_traj": None if self._last_traj is None else self._last_traj.clone(),
            "last_was_done": self._last_was_done,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (checked first: nothing changes on error).

        Raises:
            SliceArgumentError: a state saved with another ``slice_len``.
            ValueError: stream fields that do not fit together.
        """
        stream = state_dict.get("stream")
        if stream is not None:
            if int(stream["slice_len"]) != self.slice_len:
                raise SliceArgumentError(
                    f"Cannot restore slice_len={int(stream['slice_len'])} into a slice_len={self.slice_len} "
                    "StreamingSliceSampler."
                )
            queued_rows = torch.as_tensor(stream["queued_rows"], dtype=torch.int64)
            queued_stamps = torch.as_tensor(stream["queued_stamps"], dtype=torch.int64)
            carry = torch.as_tensor(stream["carry"], dtype=torch.int64)
            if queued_rows.shape != queued_stamps.shape or queued_rows.ndim != 2 or carry.ndim != 2 or carry.shape[0] != 2:
                raise ValueError("the streaming sampler's queued windows and stamps do not fit together")
        super().load_state_dict(state_dict)
        self._reset_stream()
        if stream is None:
            return
        self._stamps = torch.as_tensor(stream["stamps"], dtype=torch.int64).clone()
        self._queued = collections.deque(zip(queued_rows.clone().unbind(0), queued_stamps.clone().unbind(0)))
        self._writes = [tuple(torch.as_tensor(w, dtype=torch.int64).clone().unbind(0)) for w in stream["writes"]]
        self._carry = (carry[0].clone(), carry[1].clone())
        last = stream.get("last_traj")
        self._last_traj = None if last is None else torch.as_tensor(last).clone()
        self._last_was_done = bool(stream["last_was_done"])
