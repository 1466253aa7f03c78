"""Slice windows: draw trajectories and starts, list the rows of each ``L``-step window, and mark them.

The draw of :class:`~gpubuf.samplers.SliceSampler` for a storage of one column and slices of
one length: a trajectory uniform among the eligible ones (kept as a ring of trajectory numbers
by :class:`~gpubuf.samplers._episodes.EpisodeIndex`), a start uniform among its ``len - L + 1``
positions, the window's physical rows, and the marks TorchRL's info entries hold for each step
(truncated at a slice's last step, done and terminated from the stored flags, ``is_init`` at a
slice's first step). One launch on CUDA (no host synchronisation: the eligible count is read on
the device), one compiled loop on a CPU with Numba, else the twin.
"""

from __future__ import annotations

import numpy as np
import torch

from gpubuf.ops._dispatch import device_path, implementation, numba_enabled, resolve
from gpubuf.ops._memo import LastByIdentity

__all__ = ["slice_windows", "slice_windows_ref", "slice_windows_trusted", "MARKS"]

#: The rows of the marks :func:`slice_windows` returns, in order.
MARKS = ("truncated", "done", "terminated", "init")


def slice_windows_ref(
    slots: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    front: torch.Tensor,
    back: torch.Tensor,
    uniforms: torch.Tensor,
    lower: int,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    init: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of the slice-window draw; the op's specification.

    For slice ``s`` of ``S = uniforms.numel() // 2``, with ``T = capacity`` and
    ``count = back - front``: ``k = floor(uniforms[s] * count)``, trajectory
    ``g = slots[(front + k) % T]``, its effective start ``a = max(start[g % T], lower)`` and
    length ``n = stop[g % T] - a + 1``, the window's first step
    ``f = a + floor(uniforms[S + s] * (n - L + 1))``, and for ``j < L`` and ``i = s * L + j``:
    ``rows[i] = (f + j) % T``; ``marks[0, i] = j == L - 1`` (truncated);
    ``marks[1, i] = done[rows[i]] | marks[0, i]``; ``marks[2, i] = terminated[rows[i]]``;
    ``marks[3, i] = init[rows[i]] | (j == 0)`` (an absent flag column reads False).

    Args:
        slots: ``int64 [>= T]``, the ring of eligible trajectory numbers.
        start, stop: ``int64 [>= T]``, absolute start and stop (inclusive) time per slot.
        front, back: ``int64 [1]``, the ring's first position and one past its last. With
            none eligible (``back <= front``) every row is ``-1`` and every mark False: a
            gather leaves such rows unread, and the device path reports the draw (see
            :func:`slice_windows_trusted`'s ``error``).
        uniforms: ``float64 [2 * S]`` in ``[0, 1)``.
        lower: the absolute time of the oldest live row.
        capacity: ``T``.
        seq_length: ``L``; every eligible trajectory is at least ``L`` long.
        done, terminated, init: ``bool [>= T]`` stored flags per physical row, or None.

    Returns:
        ``(rows, marks)``: ``int64 [S * L]`` physical rows and ``bool [4, S * L]`` marks (rows
        in the order of :data:`MARKS`), on the inputs' device. Nothing is mutated.
    """
    s = uniforms.numel() // 2
    count = back - front
    k = (uniforms[:s] * count).to(torch.int64)
    slot = slots[(k + front) % capacity] % capacity
    first = start[slot].clamp_min(lower)
    length = stop[slot] - first + 1
    first = first + (uniforms[s:] * (length - (seq_length - 1))).to(torch.int64)
    j = torch.arange(seq_length, device=first.device)
    rows = ((first.unsqueeze(1) + j) % capacity).reshape(-1)
    last = (j == seq_length - 1).expand(s, seq_length).reshape(-1)
    head = (j == 0).expand(s, seq_length).reshape(-1)
    marks = torch.stack([
        last,
        last if done is None else done[rows] | last,
        torch.zeros_like(last) if terminated is None else terminated[rows],
        head if init is None else init[rows] | head,
    ])
    # An empty ring: no window (a mask, not a branch, so that no count is read on the host).
    drawn = count > 0
    return torch.where(drawn, rows, -1), marks & drawn


def _check(slots: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, front: torch.Tensor, back: torch.Tensor,
           uniforms: torch.Tensor, capacity: int, seq_length: int, flags: tuple) -> None:
    if not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64 or uniforms.ndim != 1:
        raise TypeError("uniforms must be a 1-D float64 tensor")
    for name, tensor in (("slots", slots), ("start", start), ("stop", stop), ("front", front), ("back", back)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64 or tensor.ndim != 1:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
        if tensor.device != uniforms.device:
            raise ValueError(f"{name} is on {tensor.device}, uniforms on {uniforms.device}")
    if uniforms.numel() % 2:
        raise ValueError(f"uniforms must hold two draws per slice, got {uniforms.numel()}")
    if capacity <= 0 or seq_length <= 0 or min(slots.numel(), start.numel(), stop.numel()) < capacity:
        raise ValueError("capacity and seq_length must be positive and the tables at least capacity long")
    for name, flag in zip(MARKS[1:], flags):
        if flag is None:
            continue
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.ndim != 1:
            raise TypeError(f"{name} must be a 1-D bool tensor or None")
        if flag.device != uniforms.device or flag.numel() < capacity:
            raise ValueError(f"{name} must hold at least capacity flags on {uniforms.device}")


def slice_windows(
    slots: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    front: torch.Tensor,
    back: torch.Tensor,
    uniforms: torch.Tensor,
    lower: int,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    init: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The slice-window draw of :func:`slice_windows_ref`, dispatched through the backend table.

    Args:
        As :func:`slice_windows_ref`; ``backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or
        ``"numba"``.

    Raises:
        TypeError, ValueError: inputs of the wrong dtype, shape or device.
        BackendUnavailableError: an explicit backend that cannot run here.
    """
    flags = (done, terminated, init)
    _check(slots, start, stop, front, back, uniforms, capacity, seq_length, flags)
    which = resolve("slice_windows", uniforms, backend)
    if which == "torch":
        return slice_windows_ref(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, *flags)
    return _run(which, slots, start, stop, front, back, uniforms, lower, capacity, seq_length, flags)


def slice_windows_trusted(
    slots: torch.Tensor,
    start: torch.Tensor,
    stop: torch.Tensor,
    front: torch.Tensor,
    back: torch.Tensor,
    uniforms: torch.Tensor,
    lower: int,
    capacity: int,
    seq_length: int,
    flags: tuple,
    backend: str = "auto",
    error: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sample path's entry: :func:`slice_windows` without the argument checks.

    For callers that built the tables themselves (:class:`~gpubuf.samplers._episodes.EpisodeIndex`)
    and guarantee :func:`slice_windows_ref`'s contract (contiguous 1-D tables of the dtypes
    given there, on one device); ``flags`` is the ``(done, terminated, init)`` triple. The
    checks cost more than the draw itself for a batch of a few dozen slices on a CPU.

    ``error``: an ``int32 [1]`` word on the device path, set to 1 by a draw from an empty ring
    (without a host read); ignored elsewhere, where callers read the count on the host first.
    """
    if device_path(uniforms, backend):
        kernel = implementation("slice_windows", "triton")
        return kernel(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, *flags, error=error)
    if backend in ("auto", "numba") and not uniforms.is_cuda and numba_enabled():
        return _run("numba", slots, start, stop, front, back, uniforms, lower, capacity, seq_length, flags)
    return slice_windows(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, *flags, backend=backend)


def _host_arrays(
    slots: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, front: torch.Tensor, back: torch.Tensor, flags: tuple
) -> tuple:
    """The compiled CPU loop's view of CPU tables and flags: their NumPy arrays (no copies; an
    absent flag as a one-element placeholder) and whether each flag is present.

    Kept for the next call while it is given the same tensor objects: a sampler passes the same
    tables from one draw to the next until a write replaces one (see
    :meth:`~gpubuf.samplers._episodes.EpisodeIndex.windows`), and the arrays share the tensors'
    memory, so a change in place shows. Making them costs eight ``Tensor.numpy()`` calls, each a
    ``detach`` through the dispatcher.
    """

    def make() -> tuple:
        none = _NO_FLAGS.numpy()
        return (
            slots.numpy(), start.numpy(), stop.numpy(), front.numpy(), back.numpy(),
            *(none if f is None else f.numpy() for f in flags), *(f is not None for f in flags),
        )

    return _HOST_VIEWS.get((slots, start, stop, front, back, *flags), make)


def _run(which: str, slots: torch.Tensor, start: torch.Tensor, stop: torch.Tensor, front: torch.Tensor,
         back: torch.Tensor, uniforms: torch.Tensor, lower: int, capacity: int, seq_length: int,
         flags: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = implementation("slice_windows", which)
    if which == "triton":
        return kernel(slots, start, stop, front, back, uniforms, lower, capacity, seq_length, *flags)
    n = uniforms.shape[0] // 2 * seq_length
    # NumPy outputs handed out as tensors sharing their memory (cheaper than torch.empty and
    # Tensor.numpy()).
    rows = np.empty(n, dtype=np.int64)
    marks = np.empty((len(MARKS), n), dtype=np.bool_)
    a = _host_arrays(slots, start, stop, front, back, flags)
    kernel(
        a[0], a[1], a[2], a[3], a[4], uniforms.numpy(), lower, capacity, seq_length, a[5], a[6], a[7], a[8], a[9],
        a[10], rows, marks,
    )
    return torch.from_numpy(rows), torch.from_numpy(marks)


#: The NumPy views of the last tables :func:`_host_arrays` was given.
_HOST_VIEWS = LastByIdentity()
_NO_FLAGS = torch.zeros(1, dtype=torch.bool)
