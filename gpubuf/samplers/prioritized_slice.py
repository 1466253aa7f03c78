"""``PrioritizedSliceSampler``: slices whose starts are drawn by priority (TorchRL's).

Every step has a priority in the sum tree of :class:`PrioritizedSampler`; a slice starts at a
step drawn in proportion to it, among the steps a slice may start at. TorchRL zeroes the other
steps' leaves (the last ``L - 1`` of each trajectory) before every draw and restores them after,
``O(N)`` work per sample. Here the steps that cannot start a slice are kept out of the tree as
writes arrive: their transformed priorities wait in a second tree (which also keeps their
minimum, so the importance weights use the minimum over every step, as TorchRL's), and move back
when a write makes them valid starts (the newest trajectory growing). Each write moves
``O(rows written + L)`` leaves; a draw is one descent of ``B`` masses.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from gpubuf.errors import TrajectoryLengthError
from gpubuf.ops._dispatch import device_path
from gpubuf.ops.start_exclusions import start_exclusions_trusted
from gpubuf.ops.sumtree_windows import sumtree_windows
from gpubuf.ops.sumtree import SumTree, importance_weights, sumtree_sample, sumtree_update
from gpubuf.samplers._episodes import EpisodeIndex
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.samplers.slice import SliceSampler

__all__ = ["PrioritizedSliceSampler"]


class PrioritizedSliceSampler(SliceSampler, PrioritizedSampler):
    r"""Trajectory slices with prioritized starts (TorchRL's ``PrioritizedSliceSampler``).

    A slice starts at step ``i`` with probability :math:`P_i / \sum_j P_j` over the steps that
    can start one, :math:`P = (p + \epsilon)^\alpha`, and every step of the slice carries the
    start's weight :math:`(P_i / P_{min})^{-\beta}` in ``info["priority_weight"]``
    (:math:`P_{min}` over every written step). Steps that cannot start a slice are the last
    ``L - 1`` of each trajectory (``L - 1 - span_right`` with an int right span, the last one
    with ``span_right=True``); with ``strict_length=False`` a trajectory's first step always
    can, and slices stop at the trajectory's end.

    Args:
        max_capacity, alpha, beta, eps, dtype, reduction: as :class:`PrioritizedSampler`.

    Keyword Args:
        num_slices, slice_len, end_key, end_keys, traj_key, ends, trajectories, cache_values,
        truncated_key, strict_length, compile, span: as :class:`SliceSampler` (a left span
        is turned off with a warning, as in TorchRL).
        max_priority_within_buffer: as :class:`PrioritizedSampler`.

    Update priorities with the ``info["index"]`` a sample returned (one priority per step; the
    start's priority is what drives the draw, as in TorchRL).
    """

    def __init__(
        self,
        max_capacity: int,
        alpha: float,
        beta: float,
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float,
        reduction: str = "max",
        *,
        num_slices: int | None = None,
        slice_len: int | None = None,
        end_key: Any = None,
        end_keys: Sequence[Any] | None = None,
        traj_key: Any = None,
        ends: torch.Tensor | None = None,
        trajectories: torch.Tensor | None = None,
        cache_values: bool = False,
        truncated_key: Any = ("next", "truncated"),
        init_key: Any = "is_init",
        strict_length: bool = True,
        compile: bool | dict = False,
        span: bool | int | tuple = False,
        max_priority_within_buffer: bool = False,
    ) -> None:
        SliceSampler.__init__(
            self,
            num_slices=num_slices,
            slice_len=slice_len,
            end_key=end_key,
            end_keys=end_keys,
            traj_key=traj_key,
            cache_values=cache_values,
            truncated_key=truncated_key,
            init_key=init_key,
            strict_length=strict_length,
            ends=ends,
            trajectories=trajectories,
            compile=compile,
            span=span,
        )
        PrioritizedSampler.__init__(
            self,
            max_capacity=max_capacity,
            alpha=alpha,
            beta=beta,
            eps=eps,
            dtype=dtype,
            reduction=reduction,
            max_priority_within_buffer=max_priority_within_buffer,
        )
        if self.span[0]:
            warnings.warn(
                f"Left spanning is disabled for {type(self).__name__} and will be automatically turned off.",
                stacklevel=2,
            )
            self.span = (0, self.span[1])
        self._reset_held()

    def __getstate__(self) -> dict[str, Any]:
        """Refused for a spawned process, as a :class:`PrioritizedSampler`; else the slice sampler's state."""
        PrioritizedSampler.__getstate__(self)
        return SliceSampler.__getstate__(self)

    def _reset_held(self) -> None:
        """An empty held tree, no exclusion, and the device constants, on the tree's device."""
        device = self._tree.device
        self._held = SumTree(self._max_capacity, dtype=self.dtype, device=device, fanout=self._tree.fanout)
        self._set_exclusions(torch.zeros(self._max_capacity + 1, dtype=torch.bool, device=device))
        self._excluded_for: int | None = None  # the slice length the exclusions were set for
        self._make_constants(device)

    def _set_exclusions(self, flags: torch.Tensor) -> None:
        """Keeps ``flags`` (bool ``[capacity + 1]``) as the exclusions, ``_excluded`` its first
        ``capacity`` entries (True: the step cannot start a slice). The last entry stays False:
        an update looks every index up at ``clamp(index, -1, capacity)``, and one out of the
        tree's range lands on it (see :meth:`_update_targets`)."""
        self._exclusions = flags
        self._excluded = flags[: self._max_capacity]

    def _make_constants(self, device: torch.device) -> None:
        # Operands kept on the device: a Python number given to torch.where, or a priority
        # tensor made per call, would each cost a launch at every write and update.
        self._no_index = torch.tensor(-1, dtype=torch.int64, device=device)
        self._zero_priority = torch.zeros(1, dtype=torch.float64, device=device)

    # ------------------------------------------------------------------ writes
    def add(self, index: Any) -> None:
        PrioritizedSampler.add(self, index)
        SliceSampler.add(self, index)

    def extend(self, index: Any) -> None:
        PrioritizedSampler.extend(self, index)
        # The written steps hold the default priority in the tree; what was held aside for the
        # steps they overwrote is dropped now, so an update before the next draw lands right.
        # Every written step's held leaf is zeroed, not only the held ones': the others are zero
        # already (a leaf is in one tree, zero in the other), and picking the held ones would
        # cost a gather and a select on the device for a write of the same size.
        flat = self._flat_index(index, self._storage)
        if flat.numel():
            sumtree_update(self._held, flat, self._zero_priority, alpha=1.0, eps=0.0, validate=False,
                           backend=self._backend)
            self._excluded[flat] = False
        SliceSampler.extend(self, index)

    def mark_update(self, index: Any, *, storage: Any = None) -> None:
        PrioritizedSampler.mark_update(self, index, storage=storage)

    def check_errors(self) -> None:
        """Raises what the tree's kernels recorded (see :meth:`PrioritizedSampler.check_errors`)."""
        PrioritizedSampler.check_errors(self)

    def _empty(self) -> None:
        PrioritizedSampler._empty(self)
        SliceSampler._empty(self)
        self._held.clear_()
        self._excluded.zero_()
        self._excluded_for = None

    def _bind(self, storage: Any) -> None:
        PrioritizedSampler._bind(self, storage)
        if self._held.device != self._tree.device:
            self._held = self._held.to(self._tree.device)
            self._set_exclusions(self._exclusions.to(self._tree.device))
            self._make_constants(self._tree.device)
        self._held = self._held.with_fanout(self._tree.fanout)

    def update_priority(self, index: Any, priority: Any, *, storage: Any = None) -> None:
        """As :meth:`PrioritizedSampler.update_priority`; a step that cannot start a slice keeps
        its new priority aside until it can. Also takes the per-dim tuple a sample returns."""
        if isinstance(index, tuple) and len(index) == 1:
            index = index[0]
        if isinstance(index, torch.Tensor) and index.ndim == 2 and index.shape[-1] == 1:
            index = index[:, 0]
        PrioritizedSampler.update_priority(self, index, priority, storage=storage)

    def _update_targets(self, flat: torch.Tensor, new_items: bool) -> tuple[tuple[SumTree, torch.Tensor], ...]:
        """The held steps' priorities go to the held tree, every other index to the tree; the
        default priority of steps just written goes to the tree (their exclusions are cleared
        by :meth:`extend` and set again at the next draw).

        An index is held where it is excluded and in the tree's range: a negative one (ignored
        by the update) and one past the tree (the tree's update checks it, on the device path
        recording an error) go to the tree. The exclusions are read at ``clamp(index, -1,
        capacity)``, never out of bounds: both ends land on the entry past the last step,
        which is always False. Marked, not selected (a selection's size is a host read on CUDA).
        """
        if new_items or self._excluded_for is None:
            return ((self._tree, flat),)
        held = self._exclusions[flat.clamp(-1, self._max_capacity)]
        no_index = self._no_index
        return ((self._tree, torch.where(held, no_index, flat)), (self._held, torch.where(held, flat, no_index)))

    # ------------------------------------------------------------------ exclusions
    def _apply_moves(self, flat: torch.Tensor, to_held: torch.Tensor, to_tree: torch.Tensor) -> None:
        """Sets the leaves at ``flat`` (-1: none) of the held tree to ``to_held`` and of the tree to ``to_tree``."""
        sumtree_update(self._held, flat, to_held, alpha=1.0, eps=0.0, validate=False, backend=self._backend)
        sumtree_update(self._tree, flat, to_tree, alpha=1.0, eps=0.0, validate=False, backend=self._backend)

    def _tail_kept(self, seq_length: int) -> int:
        """How many last steps of a trajectory cannot start a slice."""
        right = self.span[1]
        if right is True:
            return 1
        return max(seq_length - 1 - int(right), 0)

    def _flat(self, index: EpisodeIndex, col: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return row * index.columns + col

    def _refresh(self, index: EpisodeIndex, first: int, seq_length: int) -> None:
        """Decides again whether the live steps at the times ``first .. written - 1`` and the
        oldest live one can start a slice of ``seq_length``, and moves their leaves to match."""
        moves = start_exclusions_trusted(
            index.row_traj, index.start, index.stop, self._excluded, self._tree.values(), self._held.values(), first,
            index.written, index.capacity, self._tail_kept(seq_length), self.strict_length, self._backend,
        )
        self._apply_moves(*moves)

    def _refresh_all(self, index: EpisodeIndex, seq_length: int) -> None:
        """Sets every exclusion for slices of ``seq_length`` (a new length or a rebuild).

        The excluded steps are found trajectory by trajectory (``O(trajectories * L)``); the two
        trees are then rebuilt from their leaves (``O(N)`` vectorised passes, no per-step work).
        """
        merged = self._tree.values() + self._held.values()  # each leaf is in one of the two, 0 in the other
        excluded = self._excluded_steps(index, seq_length)
        zero = torch.zeros_like(merged)
        self._tree.fill_(torch.where(excluded, zero, merged), validate=False)
        self._held.fill_(torch.where(excluded, merged, zero), validate=False)
        self._excluded.copy_(excluded)
        self._excluded_for = seq_length

    def _excluded_steps(self, index: EpisodeIndex, seq_length: int) -> torch.Tensor:
        """``bool [capacity]`` on the tree's device, True at the flat positions of the live steps
        that cannot start a slice of ``seq_length``: the last :meth:`_tail_kept` steps of every
        live trajectory, its first step excepted without ``strict_length`` (a start may then be
        followed by fewer steps)."""
        excluded = torch.zeros_like(self._excluded)
        kept = self._tail_kept(seq_length)
        if kept == 0 or index.size == 0:
            return excluded
        dev = index.device
        # The live trajectory numbers of every column (one host read of the ring's two ends).
        cols, numbers = [], []
        for col, (head, tail) in enumerate(zip(index.head.tolist(), index.tail.tolist())):
            if head >= tail:
                cols.append(torch.full((head - tail + 1,), col, dtype=torch.int64, device=dev))
                numbers.append(torch.arange(tail, head + 1, device=dev))
        if not cols:
            return excluded
        col, start, length = torch.cat(cols), *index.lengths(torch.cat(cols), torch.cat(numbers))
        stop = start + length - 1
        first = start if self.strict_length else start + 1
        steps = stop.unsqueeze(1) - torch.arange(kept, device=dev)  # the last `kept` steps, absolute times
        hit = steps >= first.unsqueeze(1)
        rows = steps[hit] % index.capacity
        excluded[self._flat(index, col.unsqueeze(1).expand(-1, kept)[hit], rows).to(excluded.device)] = True
        return excluded

    def _feed(self, storage: Any, index: EpisodeIndex, rows: torch.Tensor, columns: int, shape: tuple) -> None:
        length = self._excluded_for
        written = index.written
        SliceSampler._feed(self, storage, index, rows, columns, shape)
        if length is not None:
            # The rows written, the newest trajectory's last steps before them (they may become
            # valid starts as it grows), and the oldest live row (a trimmed trajectory's new
            # first step, a valid start without strict_length). Rows overwritten since are
            # among the rows written.
            self._refresh(index, max(written - self._tail_kept(length), index.lower), length)

    def _rebuild(
        self,
        storage: Any,
        capacity: int,
        columns: int,
        shape: tuple,
        device: torch.device,
        newest: int | None = None,
    ) -> EpisodeIndex:
        self._excluded_for = None  # every exclusion is set anew at the next draw
        return SliceSampler._rebuild(self, storage, capacity, columns, shape, device, newest)

    # ------------------------------------------------------------------ sampling
    def sample(self, storage: Any, batch_size: int) -> tuple[tuple[torch.Tensor, ...], dict]:
        """Draws ``num_slices`` starts by priority and returns their slices.

        Returns:
            ``(index, info)`` as :meth:`SliceSampler.sample`, with ``info["priority_weight"]``
            holding the start's weight for every step.

        Raises:
            As :meth:`SliceSampler.sample`; :class:`~gpubuf.errors.TrajectoryLengthError` when
            no step can start a slice.
        """
        self._bind(storage)
        index, seq_length, num_slices = self._prepare(storage, batch_size)
        if self._excluded_for != seq_length:
            self._refresh_all(index, seq_length)
        tree = self._tree
        # On the device path an empty tree is the draw kernel's error (no host read here).
        if not device_path(tree.leaves, self._backend) and not tree.host_total() > 0:
            raise self._no_trajectory(seq_length)
        uniforms = self._draw_uniforms(num_slices, tree.device)
        fixed = self.strict_length and not self.span[1]
        if fixed and index.columns == 1 and tree.device == index.device:
            flags = self._flag_columns(storage, index)
            if flags is not None:
                # One launch (or compiled call): the tree draw, the windows' rows, their steps'
                # marks and weights.
                rows, marks, weights = sumtree_windows(
                    tree, uniforms, self._held.min(), self._beta, index.capacity, seq_length, *flags[:2],
                    stratified=self.stratified, backend=self._backend, validate=False,
                )
                out, info = self._finish_marked(rows, marks, init=False)
                info["priority_weight"] = weights
                return out, info
        flat, value = sumtree_sample(tree, uniforms, stratified=self.stratified, backend=self._backend)
        p_min = torch.minimum(tree.min(), self._held.min())
        weight = importance_weights(value, p_min, self._beta).to(index.device)
        flat = flat.to(index.device)
        if fixed:
            # A window's rows follow its start's physical row around the ring (an absolute time and
            # its row agree modulo the capacity).
            if index.columns == 1:
                rows = ((flat.unsqueeze(1) + self._offsets(seq_length, flat.device)) % index.capacity).reshape(-1)
                cols = None
            else:
                row, col = flat // index.columns, flat % index.columns
                rows = ((row.unsqueeze(1) + self._offsets(seq_length, flat.device)) % index.capacity).reshape(-1)
                cols = col.unsqueeze(1).expand(-1, seq_length).reshape(-1)
            out, info = self._finish(storage, index, rows, cols, num_slices, seq_length, None, None, init=False)
            info["priority_weight"] = weight.unsqueeze(1).expand(-1, seq_length).reshape(-1)
            return out, info
        row, col = flat // index.columns, flat % index.columns
        tau = index.absolute(row)
        _, stop = index.trajectory_of(col, row)
        seq = (stop - tau + 1).clamp_max(seq_length)
        slice_of = torch.repeat_interleave(torch.arange(num_slices, device=seq.device), seq)
        offsets = torch.arange(slice_of.shape[0], device=seq.device) - (seq.cumsum(0) - seq)[slice_of]
        rows = (tau[slice_of] + offsets) % index.capacity
        out, info = self._finish(storage, index, rows, col[slice_of], num_slices, seq, None, None, init=False)
        info["priority_weight"] = weight[slice_of]
        return out, info

    def _no_trajectory(self, seq_length: int) -> TrajectoryLengthError:
        return SliceSampler._no_trajectory(seq_length)

    # ------------------------------------------------------------------ state
    def _prefetch_state(self) -> None:
        return None

    def _prefetch_restore(self, state: None) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        """The prioritized sampler's state (every step's priority, held-aside ones included) and the boundaries."""
        merged = self._tree.values().to(torch.float64) + self._held.values().to(torch.float64)
        state = PrioritizedSampler.state_dict(self)
        tree_state = dict(state["_tree"])
        tree_state["leaves"] = merged.to("cpu", self.dtype)
        state["_tree"] = tree_state
        state["_slices"] = SliceSampler.state_dict(self)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`, checked whole first; which steps are held aside is worked out
        at the next draw."""
        # A prioritized sampler's state alone (TorchRL's has no boundaries): read them at the next draw.
        slices = self._parse_slice_state(state_dict.get("_slices", {}) if isinstance(state_dict, dict) else state_dict)
        PrioritizedSampler.load_state_dict(self, state_dict)
        self._install_slice_state(slices)
        self._reset_held()

    def _check_state_dict(self, state_dict: Any) -> None:
        PrioritizedSampler._check_state_dict(self, state_dict)
        self._parse_slice_state(state_dict.get("_slices", {}))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_slices={self.num_slices}, slice_len={self.slice_len}, end_key={self.end_key}, "
            f"traj_key={self.traj_key}, truncated_key={self.truncated_key}, strict_length={self.strict_length}, "
            f"alpha={self._alpha}, beta={self._beta}, eps={self._eps})"
        )
