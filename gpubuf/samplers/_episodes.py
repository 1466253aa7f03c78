"""Trajectory boundaries of a ring storage, kept up to date as rows are written.

A storage of time capacity ``T`` and ``C`` columns (``C = 1`` for a storage of ``ndim == 1``,
the size of dim 1 for ``ndim == 2``) is written one time row at a time, round robin: the row
written at absolute time ``tau`` (the number of time rows written before it) lives at physical
row ``tau % T``, and the live rows are the last ``min(W, T)`` written (``W`` written in all).

In each column the live rows split into trajectories, contiguous in time. A new trajectory
starts at a row whose predecessor in time ended one (a ``done`` flag, or a change of trajectory
id) and at the oldest live row; the newest row always ends one (TorchRL's rule: the write
cursor truncates). Trajectories are numbered ``g = 0, 1, ...`` per column in the order they
start, so the live ones are ``g`` in ``[tail, head]`` and a ring of ``T`` slots (slot ``g % T``)
holds their absolute start and stop times. A write of ``n`` rows touches ``O(n)`` slots: it
extends the newest trajectory or starts new ones at the head, and retires or trims the oldest
at the tail.

For a slice length ``L``, the trajectories at least ``L`` long (the eligible ones) form, per
column, a subsequence of the live ones that also only grows at the head and shrinks at the tail
(a trajectory's length changes only while it is the newest, growing, or the oldest, trimmed).
:class:`_Eligible` keeps it as a ring deque of trajectory numbers, so the ``k``-th eligible
trajectory is one lookup and a draw of ``B`` slices is ``O(B)`` work, whatever the storage size.

A write is one :func:`~gpubuf.ops.episode_append.episode_append`, work proportional to the rows
written: on the device path a ``cumsum`` and two kernels (one more per extra slice length
listed), with no host read; on a CPU one compiled pass over the rows and one per list (Numba),
else the op's torch twin. Only the host path reads values back: the live trajectory count when
it builds the list of a new slice length (the device path builds it over as many numbers as live
rows instead). :meth:`EpisodeIndex.windows` draws a batch of windows through
:func:`~gpubuf.ops.slice_windows.slice_windows` (one launch on CUDA).
"""

from __future__ import annotations


import torch

from gpubuf.ops._dispatch import device_path
from gpubuf.ops.episode_append import episode_append_trusted
from gpubuf.ops.slice_windows import slice_windows_trusted

__all__ = ["EpisodeIndex"]


class _Eligible:
    """The trajectories at least ``length`` long, per column, as ring deques of trajectory numbers.

    ``slots[c, i % T]`` for ``i`` in ``[front[c], back[c])`` holds the numbers in increasing
    order; column ``T`` of ``slots`` is scratch space for masked scatters.
    """

    def __init__(self, length: int, columns: int, capacity: int, device: torch.device) -> None:
        self.length = length
        self.slots = torch.zeros(columns, capacity + 1, dtype=torch.int64, device=device)
        self.front = torch.zeros(columns, dtype=torch.int64, device=device)
        self.back = torch.zeros(columns, dtype=torch.int64, device=device)
        #: Column 0's draw tables (see :meth:`EpisodeIndex.windows`), with what they were taken from.
        self.tables: tuple | None = None

    def counts(self) -> torch.Tensor:
        return self.back - self.front


class EpisodeIndex:
    """Trajectory boundaries of a ring storage of ``capacity`` time rows and ``columns`` columns.

    Args:
        capacity: ``T``, the number of time rows (dim 0 of the storage).
        columns: ``C``, the number of columns (1 for ``ndim == 1``).
        device: where the index lives (the storage's device).

    State (all int64, on ``device``):
        ``start``, ``stop``: ``[C, T + 1]``, absolute start and stop (inclusive) time of
        trajectory ``g`` at slot ``g % T``; slot ``T`` is scratch. ``head``, ``tail``: ``[C]``,
        the newest and oldest live trajectory numbers (``head = tail - 1`` when empty).
        ``row_traj``: ``[C, T + 1]``, the trajectory number of the trajectory holding each
        physical row. ``written``: ``W``, a Python int.
    """

    def __init__(self, capacity: int, columns: int, device: torch.device | str) -> None:
        self.capacity = int(capacity)
        self.columns = int(columns)
        self.device = torch.device(device)
        self.written = 0
        self._eligible: dict[int, _Eligible] = {}
        self._reset()

    def _reset(self) -> None:
        c, t, dev = self.columns, self.capacity, self.device
        self.start = torch.zeros(c, t + 1, dtype=torch.int64, device=dev)
        self.stop = torch.zeros(c, t + 1, dtype=torch.int64, device=dev)
        self.row_traj = torch.zeros(c, t + 1, dtype=torch.int64, device=dev)
        self.head = torch.full((c,), -1, dtype=torch.int64, device=dev)
        self.tail = torch.zeros(c, dtype=torch.int64, device=dev)
        self.written = 0
        self._eligible = {}
        self._fresh = True  # nothing written since the arrays were made

    # ------------------------------------------------------------------ queries
    @property
    def size(self) -> int:
        """Live time rows: ``min(W, T)``."""
        return min(self.written, self.capacity)

    @property
    def lower(self) -> int:
        """The absolute time of the oldest live row."""
        return max(self.written - self.capacity, 0)

    def lengths(self, col: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective ``(start, length)`` of live trajectories ``g`` of columns ``col`` (absolute times)."""
        slot = g % self.capacity
        start = self.start[col, slot].clamp_min(self.lower)
        return start, self.stop[col, slot] - start + 1

    def eligible(self, length: int, backend: str = "auto") -> _Eligible:
        """The deque of trajectories at least ``length`` long, built on first use (see
        :meth:`_build_eligible`; ``backend`` as the sampler's)."""
        found = self._eligible.get(length)
        if found is None:
            found = self._eligible[length] = self._build_eligible(length, backend)
        return found

    def count(self, length: int) -> torch.Tensor:
        """The number of trajectories at least ``length`` long (a 0-d tensor)."""
        return self.eligible(length).counts().sum()

    def draw(self, length: int, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Picks one eligible trajectory per uniform, each with probability 1 / (their number).

        Args:
            length: the minimum trajectory length.
            uniforms: ``float64 [B]`` in ``[0, 1)`` on the index's device.

        Returns:
            ``(col, start, length)``: int64 ``[B]`` column (None for a single column),
            absolute effective start time and length of each pick. Undefined (but in range)
            when nothing is eligible: check :meth:`count` first.
        """
        elig = self.eligible(length)
        if self.columns == 1:
            # u < 1 in float64, so u * total < total and the cast (a floor for u >= 0) is a
            # valid position: no clamp needed.
            k = (uniforms * (elig.back - elig.front)).to(torch.int64)
            t = self.capacity
            slot = elig.slots[0][(k + elig.front) % t] % t
            start = self.start[0][slot].clamp_min(self.lower)
            return None, start, self.stop[0][slot] - start + 1
        total = elig.counts().sum()
        k = (uniforms * total).to(torch.int64)
        return self.pick(elig, k)

    def windows(
        self, pool: int, length: int, uniforms: torch.Tensor, flags: tuple = (None, None, None), backend: str = "auto",
        error: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows and marks of ``S = uniforms.numel() // 2`` windows of ``length`` steps in
        trajectories drawn among those at least ``pool`` long (one column only), with the stored
        ``(done, terminated, init)`` flag columns ``flags``: see :func:`slice_windows` (and
        :func:`~gpubuf.ops.slice_windows.slice_windows_trusted` for ``error``)."""
        elig = self.eligible(pool, backend)
        return slice_windows_trusted(*self._column_tables(elig), uniforms, self.lower, self.capacity, length, flags,
                                     backend, error)

    def _column_tables(self, elig: _Eligible) -> tuple:
        """``(slots, start, stop, front, back)`` of column 0 as 1-D tensors: the same objects
        from one draw to the next until a write or a reset replaces one of the tables, so that
        the compiled loop's NumPy views of them are kept too (see
        :func:`~gpubuf.ops.slice_windows._host_arrays`)."""
        kept = elig.tables
        if kept is None or not (kept[0] is self.start and kept[1] is self.stop and kept[2] is elig.front
                                and kept[3] is elig.back):
            views = (elig.slots[0], self.start[0], self.stop[0], elig.front, elig.back)
            kept = elig.tables = (self.start, self.stop, elig.front, elig.back, views)
        return kept[4]

    def pick(self, elig: _Eligible, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ``k``-th eligible trajectories (column by column, oldest first within a column)."""
        t = self.capacity
        if self.columns == 1:
            col = torch.zeros_like(k)
            local = k
        else:
            counts = elig.counts()
            ends = counts.cumsum(0)
            col = torch.searchsorted(ends, k, right=True).clamp_max(self.columns - 1)
            local = k - (ends - counts)[col]
        g = elig.slots[col, (elig.front[col] + local) % t]
        start, length = self.lengths(col, g)
        return col, start, length

    def trajectory_of(self, col: torch.Tensor, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Effective ``(start, stop)`` absolute times of the trajectory holding physical ``row`` of ``col``."""
        g = self.row_traj[col, row]
        start, length = self.lengths(col, g)
        return start, start + length - 1

    def absolute(self, row: torch.Tensor) -> torch.Tensor:
        """The absolute time of live physical rows ``row``."""
        t, w = self.capacity, self.written
        return w - 1 - (w - 1 - row) % t

    # ------------------------------------------------------------------ updates
    def append(self, breaks: torch.Tensor, backend: str = "auto") -> None:
        """Records ``n`` new time rows.

        Args:
            breaks: bool ``[n, C]`` on the index's device: ``breaks[j, c]`` is True where row
                ``j`` of column ``c`` starts a new trajectory (its predecessor ended one).
                Ignored for the first row ever written, which always starts one. When ``n`` is
                more than ``T``, only the last ``T`` rows are kept, the first of them starting
                a trajectory.
            backend: the sampler's backend (see :func:`~gpubuf.ops._dispatch.device_path`).
        """
        n = breaks.shape[0]
        if n == 0:
            return
        t = self.capacity
        breaks = breaks.to(self.device, torch.bool)
        if n >= t or self.written == 0:
            # Nothing stored survives: start over, past the rows overwritten within this write.
            skipped = max(n - t, 0)
            written = self.written + skipped
            if not self._fresh:
                self._reset()
            self._eligible = {}  # rebuilt over the live trajectories when next asked for
            self.written = written
            breaks = breaks[skipped:].clone()
            breaks[0] = True  # (set, not tested: a test would read the device)
        self._append(breaks, backend)

    def _append(self, breaks: torch.Tensor, backend: str = "auto") -> None:
        fresh = self._fresh
        self._fresh = False
        deques = [(elig.slots, elig.front, elig.back, elig.length) for elig in self._eligible.values()]
        episode_append_trusted(breaks, self.start, self.stop, self.row_traj, self.head, self.tail, deques,
                               self.written, self.capacity, fresh, backend)
        self.written += breaks.shape[0]

    def _build_eligible(self, length: int, backend: str = "auto") -> _Eligible:
        """The deque of ``length``, over the live trajectories: on the host path their count per
        column is read (``O(trajectories)`` work); on the device path the pass covers as many
        numbers as there are live rows (``O(T)`` work, no host read), the ones past a column's
        head masked."""
        c, t, dev = self.columns, self.capacity, self.device
        elig = _Eligible(length, c, t, dev)
        if self.written == 0:
            return elig
        if device_path(self.head, backend):
            span = self.size
        else:
            span = int((self.head - self.tail + 1).max()) if c > 1 else int(self.head[0] - self.tail[0] + 1)
        i = torch.arange(max(span, 0), device=dev).unsqueeze(0)  # [1, m]
        g = self.tail.unsqueeze(1) + i  # [C, m]
        live = g <= self.head.unsqueeze(1)
        cols = torch.arange(c, device=dev).unsqueeze(1).expand_as(g)
        _, lens = self.lengths(cols, g)
        ok = live & (lens >= length)
        rank = ok.to(torch.int64).cumsum(1) - 1
        slot = torch.where(ok, rank, torch.full_like(rank, t))
        elig.slots.scatter_(1, slot, g.contiguous())
        elig.back = ok.sum(1)
        return elig

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """Plain values and CPU copies of the tables (writes update them in place; the eligible
        deques are rebuilt on demand)."""
        return {
            "capacity": self.capacity,
            "columns": self.columns,
            "written": self.written,
            **{name: getattr(self, name).to("cpu", copy=True) for name in ("start", "stop", "row_traj", "head", "tail")},
        }

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device | str) -> "EpisodeIndex":
        index = cls(int(state["capacity"]), int(state["columns"]), device)
        shape = (index.columns, index.capacity + 1)
        for name in ("start", "stop", "row_traj"):
            value = state[name]
            if tuple(value.shape) != shape:
                raise ValueError(f"episode index field {name!r} has shape {list(value.shape)}, expected {list(shape)}")
            setattr(index, name, value.to(index.device, torch.int64).clone())
        for name in ("head", "tail"):
            value = state[name]
            if tuple(value.shape) != (index.columns,):
                raise ValueError(f"episode index field {name!r} has shape {list(value.shape)}, expected [{index.columns}]")
            setattr(index, name, value.to(index.device, torch.int64).clone())
        index.written = int(state["written"])
        index._fresh = index.written == 0
        return index
