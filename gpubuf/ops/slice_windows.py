"""Slice windows: draw trajectories and starts, and list the rows of each ``L``-step window.

The draw of :class:`~gpubuf.samplers.SliceSampler` for a storage of one column and slices of
one length: a trajectory uniform among the eligible ones (kept as a ring of trajectory numbers
by :class:`~gpubuf.samplers._episodes.EpisodeIndex`), a start uniform among its ``len - L + 1``
positions, and the window's physical rows. One launch on CUDA (no host synchronisation: the
eligible count is read on the device), one compiled loop on a CPU with Numba, else the twin.
"""

from __future__ import annotations

import torch

from gpubuf.ops._dispatch import kernel_module, resolve_backend

__all__ = ["slice_windows", "slice_windows_ref"]


def slice_windows_ref(
    slots: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    front: torch.Tensor,
    count: torch.Tensor,
    uniforms: torch.Tensor,
    lower: int,
    capacity: int,
    seq_length: int,
) -> torch.Tensor:
    """Pure-torch twin of the slice-window draw; the op's specification.

    For slice ``s`` of ``S = uniforms.numel() // 2``, with ``T = capacity``:
    ``k = floor(uniforms[s] * count)``, trajectory ``g = slots[(front + k) % T]``, its effective
    start ``a = max(start[g % T], lower)`` and length ``n = stop[g % T] - a + 1``, the window's
    first step ``f = a + floor(uniforms[S + s] * (n - L + 1))``, and
    ``result[s * L + j] = (f + j) % T`` for ``j < L``.

    Args:
        slots: ``int64 [>= T]``, the ring of eligible trajectory numbers.
        start, stop: ``int64 [>= T]``, absolute start and stop (inclusive) time per slot.
        front, count: ``int64 [1]``, the ring's first position and its number of entries
            (``count >= 1``; with 0 the result is in range but meaningless).
        uniforms: ``float64 [2 * S]`` in ``[0, 1)``.
        lower: the absolute time of the oldest live row.
        capacity: ``T``.
        seq_length: ``L``; every eligible trajectory is at least ``L`` long.

    Returns:
        ``int64 [S * L]`` physical rows, on the inputs' device. Nothing is mutated.
    """
    s = uniforms.numel() // 2
    k = (uniforms[:s] * count).to(torch.int64)
    slot = slots[(k + front) % capacity] % capacity
    first = start[slot].clamp_min(lower)
    length = stop[slot] - first + 1
    first = first + (uniforms[s:] * (length - (seq_length - 1))).to(torch.int64)
    steps = first.unsqueeze(1) + torch.arange(seq_length, device=first.device)
    return (steps % capacity).reshape(-1)


def _check(slots: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, front: torch.Tensor, count: torch.Tensor,
           uniforms: torch.Tensor, capacity: int, seq_length: int) -> None:
    for name, tensor in (("slots", slots), ("start", start), ("stop", stop), ("front", front), ("count", count)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.ndim != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
        if tensor.device != uniforms.device:
            raise ValueError(f"{name} is on {tensor.device}, uniforms on {uniforms.device}")
    if not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64 or uniforms.ndim != 1:
        raise TypeError("uniforms must be a 1-D float64 tensor")
    if uniforms.numel() % 2:
        raise ValueError(f"uniforms must hold two draws per slice, got {uniforms.numel()}")
    if capacity <= 0 or seq_length <= 0 or min(slots.numel(), start.numel(), stop.numel()) < capacity:
        raise ValueError("capacity and seq_length must be positive and the tables at least capacity long")


def slice_windows(
    slots: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    front: torch.Tensor,
    count: torch.Tensor,
    uniforms: torch.Tensor,
    lower: int,
    capacity: int,
    seq_length: int,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The slice-window draw of :func:`slice_windows_ref`, dispatched by device.

    Args:
        As :func:`slice_windows_ref`; ``backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or
        ``"numba"``.

    Raises:
        TypeError, ValueError: inputs of the wrong dtype, shape or device.
        BackendUnavailableError: an explicit backend that cannot run here.
    """
    _check(slots, start, stop, front, count, uniforms, capacity, seq_length)
    which = resolve_backend(uniforms, backend, has_cpu_kernel=True)
    if which == "triton":
        return kernel_module("slice").slice_windows_triton(
            slots, start, stop, front, count, uniforms, lower, capacity, seq_length
        )
    if which == "numba":
        out = torch.empty(uniforms.numel() // 2 * seq_length, dtype=torch.int64)
        kernel_module("cpu.slice").slice_windows(
            slots.numpy(), start.numpy(), stop.numpy(), int(front[0]), int(count[0]), uniforms.contiguous().numpy(),
            lower, capacity, seq_length, out.numpy(),
        )
        return out
    return slice_windows_ref(slots, start, stop, front, count, uniforms, lower, capacity, seq_length)
