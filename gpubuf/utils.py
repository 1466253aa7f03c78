"""Helpers of ``torchrl.data.replay_buffers``' public API: trajectory boundaries, pinning, stacking.

``find_start_stop_traj`` follows TorchRL's routine of the same name (MIT licence) so that
boundaries agree with TorchRL's, wrap-around and write-cursor truncation included.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

__all__ = ["DEFAULT_DONE_KEYS", "find_start_stop_traj", "is_int", "pin_memory_output", "stack_tensors"]

# The keys whose flags end a trajectory, in TorchRL's order.
DEFAULT_DONE_KEYS: tuple = ("done", "truncated", "terminated")


def is_int(value: Any) -> bool:
    """Whether ``value`` is one integer index: a Python or numpy int, or a 0-d integer tensor (not a bool)."""
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.dtype.is_floating_point and value.dtype != torch.bool
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def find_start_stop_traj(
    *,
    trajectory: torch.Tensor | None = None,
    end: torch.Tensor | None = None,
    at_capacity: bool,
    cursor: int | torch.Tensor | range | None = None,
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recovers trajectory boundaries from trajectory ids or end-of-trajectory flags.

    Keyword Args:
        trajectory: ``[T, *B]`` trajectory ids in storage order (time along dim 0); a boundary
            lies wherever the id changes. Exclusive with ``end``.
        end: ``[T, *B]`` boolean end flags in storage order (``True`` on a trajectory's last step).
        at_capacity: the storage is full and circular: a trajectory without an end flag after the
            last row continues at row 0. Otherwise the last row always ends a trajectory.
        cursor: the index of the last written row (int, 1-D tensor or range: its last entry);
            with ``at_capacity`` that row is forced to be an end (what followed was overwritten).
        device: where to run the computation; results come back on the input's device.

    Returns:
        ``(start, stop, lengths)``: ``start`` and ``stop`` are ``[N, 1 + len(B)]`` int64 tensors
        (time index of the first and last, inclusive, step in column 0, batch coordinates after),
        ``lengths`` is ``[N]``. A trajectory across the wrap point has ``start > stop``.

    Raises:
        TypeError: neither or both of ``trajectory`` and ``end``.
        RuntimeError: a 0-dim or empty signal, or an unusable ``cursor`` (TorchRL's class).

    Examples:
        >>> end = torch.zeros(10, dtype=torch.bool); end[2] = end[7] = True
        >>> start, stop, lengths = find_start_stop_traj(end=end, at_capacity=True, cursor=4)
        >>> start.squeeze(-1), stop.squeeze(-1), lengths
        (tensor([8, 3, 5]), tensor([2, 4, 7]), tensor([5, 2, 3]))
    """
    end, length = _end_flags(trajectory=trajectory, end=end, at_capacity=at_capacity, cursor=cursor)
    return _end_to_start_stop(end, length, device)


def _end_flags(*, trajectory, end, at_capacity, cursor) -> tuple[torch.Tensor, int]:
    if (trajectory is None) == (end is None):
        raise TypeError(
            f"Exactly one of `trajectory` and `end` must be provided, got trajectory={trajectory} and end={end}."
        )
    signal = trajectory if trajectory is not None else end
    if signal.ndim == 0:
        raise RuntimeError("Expected the end-of-trajectory signal to be at least 1-dimensional.")
    if signal.shape[0] == 0:
        raise RuntimeError("Cannot recover trajectory boundaries from an empty (T=0) input.")
    if trajectory is not None:
        end = trajectory[:-1] != trajectory[1:]
        if not at_capacity:
            end = torch.cat([end, torch.ones_like(trajectory[:1], dtype=torch.bool)], 0)
        else:
            end = torch.cat([end, trajectory[-1:] != trajectory[:1]], 0)
        length = trajectory.shape[0]
    else:
        length = end.shape[0]
        if not at_capacity:
            end = end.clone()
            end[length - 1] = True
    if at_capacity:
        if cursor is not None:
            if isinstance(cursor, (torch.Tensor, np.ndarray)):
                cursor = torch.as_tensor(cursor).reshape(-1)
                if not cursor.numel():
                    raise RuntimeError("cursor must not be an empty tensor.")
                cursor = cursor[-1].item()
            elif isinstance(cursor, range):
                if not len(cursor):
                    raise RuntimeError("cursor must not be an empty range.")
                cursor = cursor[-1]
            if not is_int(cursor):
                raise RuntimeError("cursor should be an integer or a 1d tensor or a range.")
            end = torch.index_fill(end, 0, torch.tensor(cursor, device=end.device, dtype=torch.long), 1)
        if not end.any(0).all():
            # Every column needs one end to delimit its trajectories: a column without any ends
            # at its last row.
            mask = torch.cat([torch.zeros_like(end[:-1]), ~end.any(0, True)])
            end = end | mask
    return end, length


def _end_to_start_stop(end: torch.Tensor, length: int, device: torch.device | None):
    home = None
    if device is not None and end.device != torch.device(device):
        home, end = end.device, end.to(device)
    # Transposed so that stops come sorted by batch coordinate, then time.
    stop = end.transpose(0, -1).nonzero()
    stop[:, [0, -1]] = stop[:, [-1, 0]].clone()
    start = stop.clone()
    start[:, 0] = (start[:, 0] + 1) % end.shape[0]
    if start.shape[0] > 1:
        # A trajectory starts one step after the previous stop of the same batch coordinate;
        # the first of each coordinate after that coordinate's last stop (the wrap).
        same = (start[1:, 1:] == start[:-1, 1:]).all(-1)
        m1 = torch.cat([torch.zeros_like(same[:1]), same])
        m2 = torch.cat([same, torch.zeros_like(same[:1])])
        shifted = torch.empty_like(start)
        shifted[m1] = start[m2]
        shifted[~m1] = start[~m2]
        start = shifted
    lengths = stop[:, 0] - start[:, 0] + 1
    lengths[lengths <= 0] += length
    if home is not None:
        return start.to(home), stop.to(home), lengths.to(home)
    return start, stop, lengths


def pin_memory_output(fun: Callable) -> Callable:
    """Decorates a method so that its outputs are pinned when ``self._pin_memory`` is set.

    Outputs (or each element of a tuple output) with a ``pin_memory`` method and on the CPU are
    pinned; others pass through.
    """

    def decorated(self, *args, **kwargs):
        output = fun(self, *args, **kwargs)
        if not self._pin_memory:
            return output
        if isinstance(output, tuple):
            return tuple(_pin(item) for item in output)
        return _pin(output)

    return decorated


def _pin(output: Any) -> Any:
    if hasattr(output, "pin_memory") and getattr(output, "device", None) == torch.device("cpu"):
        return output.pin_memory()
    return output


def stack_tensors(list_of_tensor_iterators: list) -> tuple[torch.Tensor, ...]:
    """Zips iterables of tensors and stacks each group along a new dim 0.

    Args:
        list_of_tensor_iterators: iterables of the same length whose ``i``-th tensors share a shape.

    Returns:
        One stacked tensor per position.
    """
    return tuple(torch.stack(tensors, 0) for tensors in zip(*list_of_tensor_iterators))


# ---------------------------------------------------------------------- distances to trajectory ends
def boundary_distances(
    anchor: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, length: int, storage_shape: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each anchor (``[B]`` time indices, or ``[B, ndim]`` coordinates), its distance to the
    start and to the stop of its trajectory, given ``find_start_stop_traj``'s ``start`` and
    ``stop`` over ``length`` time steps (TorchRL's search, so both agree exactly)."""
    if start.shape[-1] == 1:
        at = torch.searchsorted(stop[:, 0].contiguous(), anchor).remainder(stop.shape[0])
        return (
            torch.remainder(anchor - start[at, 0], length).long(),
            torch.remainder(stop[at, 0] - anchor, length).long(),
        )
    lanes = storage_shape[1:]
    stride = torch.tensor([int(np.prod(lanes[i + 1 :])) for i in range(len(lanes))], dtype=torch.long, device=stop.device)
    lane = (stop[:, 1:] * stride).sum(-1)
    key = lane * (2 * storage_shape[0]) + stop[:, 0]
    order = torch.argsort(key)
    key, ordered_lane = key[order], lane[order]
    first = torch.ones_like(ordered_lane, dtype=torch.bool)
    first[1:] = ordered_lane[1:] != ordered_lane[:-1]
    first_index = torch.arange(order.shape[0], device=order.device)[first]
    # A sentinel past each lane's last stop sends anchors after it to the lane's first trajectory (the wrap).
    stop_key = torch.cat([key, key[first_index] + storage_shape[0]])
    boundary_index = torch.cat([order, order[first_index]])
    sort = torch.argsort(stop_key)
    stop_key, boundary_index = stop_key[sort], boundary_index[sort]
    at = boundary_index[torch.searchsorted(stop_key, (anchor[:, 1:] * stride).sum(-1) * (2 * length) + anchor[:, 0])]
    return (
        torch.remainder(anchor[:, 0] - start[at, 0], length).long(),
        torch.remainder(stop[at, 0] - anchor[:, 0], length).long(),
    )
