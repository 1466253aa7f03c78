"""Windows at drawn starts: the rows, marks and importance weights of ``L``-step windows.

The second half of :class:`~gpubuf.samplers.PrioritizedSliceSampler`'s draw, for a storage of
one column and slices of one length: the sum tree gave each slice's first physical row and its
leaf value; this lists each window's rows (following the ring), marks its steps as TorchRL's
info entries do (truncated at a slice's last step, done and terminated from the stored flags)
and gives every step its slice's importance weight ``(value / p_min) ** (-beta)``, with
``p_min`` the smaller of two minima (the tree's and the held-aside steps'). One launch on CUDA
(the minima are read on the device: no host synchronisation), one compiled loop on a CPU with
Numba, else the twin.
"""

from __future__ import annotations

import torch

from gpubuf.ops._dispatch import implementation, resolve
from gpubuf.ops.sumtree import importance_weights

__all__ = ["slice_windows_at", "slice_windows_at_ref", "MARKS_AT"]

#: The rows of the marks :func:`slice_windows_at` returns, in order.
MARKS_AT = ("truncated", "done", "terminated")


def slice_windows_at_ref(
    starts: torch.Tensor,
    values: torch.Tensor,
    min_a: torch.Tensor,
    min_b: torch.Tensor,
    beta: float,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch twin of the windows at drawn starts; the op's specification.

    For slice ``s`` of ``S = starts.numel()``, ``j < L`` and ``i = s * L + j``:
    ``rows[i] = (starts[s] + j) % T``; ``marks[0, i] = j == L - 1`` (truncated);
    ``marks[1, i] = done[rows[i]] | marks[0, i]``; ``marks[2, i] = terminated[rows[i]]`` (an
    absent flag column reads False); ``weights[i] = importance_weights(values, p_min, beta)[s]``
    with ``p_min = min(min_a, min_b)`` (TorchRL's ``(value / p_min) ** (-beta)``, in float64,
    rounded to ``values``' dtype).

    Args:
        starts: ``int64 [S]``, the windows' first physical rows, in ``[0, T)``.
        values: ``[S]`` float, the starts' leaf values ``(p + eps) ** alpha``.
        min_a, min_b: ``float64`` 0-d tensors (:meth:`SumTree.min` of the two trees).
        beta: the importance exponent.
        capacity: ``T``, the storage's rows.
        seq_length: ``L``.
        done, terminated: ``bool [>= T]`` stored flags per physical row, or None.

    Returns:
        ``(rows, marks, weights)``: ``int64 [S * L]``, ``bool [3, S * L]`` (rows in the order of
        :data:`MARKS_AT`) and ``[S * L]`` in ``values``' dtype, on the inputs' device. Nothing
        is mutated.
    """
    s = starts.numel()
    j = torch.arange(seq_length, device=starts.device)
    rows = ((starts.unsqueeze(1) + j) % capacity).reshape(-1)
    last = (j == seq_length - 1).expand(s, seq_length).reshape(-1)
    marks = torch.stack([
        last,
        last if done is None else done[rows] | last,
        torch.zeros_like(last) if terminated is None else terminated[rows],
    ])
    weight = importance_weights(values, torch.minimum(min_a, min_b), beta)
    return rows, marks, weight.unsqueeze(1).expand(s, seq_length).reshape(-1)


def _check(starts: torch.Tensor, values: torch.Tensor, min_a: torch.Tensor, min_b: torch.Tensor, capacity: int,
           seq_length: int, flags: tuple) -> None:
    if not isinstance(starts, torch.Tensor) or starts.dtype != torch.int64 or starts.ndim != 1:
        raise TypeError("starts must be a 1-D int64 tensor")
    if not isinstance(values, torch.Tensor) or values.dtype not in (torch.float32, torch.float64):
        raise TypeError("values must be a float32 or float64 tensor")
    if values.shape != starts.shape:
        raise ValueError(f"values must hold one value per start: {list(values.shape)} vs {list(starts.shape)}")
    for name, tensor in (("values", values), ("min_a", min_a), ("min_b", min_b)):
        if tensor.device != starts.device:
            raise ValueError(f"{name} is on {tensor.device}, starts on {starts.device}")
    for name, tensor in (("min_a", min_a), ("min_b", min_b)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float64 or tensor.numel() != 1:
            raise TypeError(f"{name} must be a float64 tensor of one element")
    if capacity <= 0 or seq_length <= 0:
        raise ValueError("capacity and seq_length must be positive")
    for name, flag in zip(MARKS_AT[1:], flags):
        if flag is None:
            continue
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.ndim != 1:
            raise TypeError(f"{name} must be a 1-D bool tensor or None")
        if flag.device != starts.device or flag.numel() < capacity:
            raise ValueError(f"{name} must hold at least capacity flags on {starts.device}")


def slice_windows_at(
    starts: torch.Tensor,
    values: torch.Tensor,
    min_a: torch.Tensor,
    min_b: torch.Tensor,
    beta: float,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows at drawn starts of :func:`slice_windows_at_ref`, dispatched through the backend table.

    The Triton kernel computes the weights' power as the sum-tree draw does (CUDA's ``pow``
    compiled, ``exp(y * log(x))`` under the interpreter), the Numba loop with the C library's
    ``pow``: within a few ulps of the twin's ``float64`` before rounding to ``values``' dtype.

    Args:
        As :func:`slice_windows_at_ref`; ``backend`` is ``"auto"``, ``"torch"``, ``"triton"``
        or ``"numba"``.

    Raises:
        TypeError, ValueError: inputs of the wrong dtype, shape or device.
        BackendUnavailableError: an explicit backend that cannot run here.
    """
    flags = (done, terminated)
    _check(starts, values, min_a, min_b, capacity, seq_length, flags)
    which = resolve("slice_windows_at", starts, backend)
    if which == "torch":
        return slice_windows_at_ref(starts, values, min_a, min_b, beta, capacity, seq_length, *flags)
    kernel = implementation("slice_windows_at", which)
    if which == "triton":
        return kernel(starts, values, min_a, min_b, float(beta), capacity, seq_length, *flags)
    n = starts.numel() * seq_length
    rows = torch.empty(n, dtype=torch.int64)
    marks = torch.empty(len(MARKS_AT), n, dtype=torch.bool)
    weights = torch.empty(n, dtype=values.dtype)
    none = torch.zeros(1, dtype=torch.bool)  # stands for an absent flag column
    p_min = min(float(min_a), float(min_b))
    kernel(
        starts.numpy(), values.numpy(), p_min, float(beta), capacity, seq_length,
        *((none if f is None else f).numpy() for f in flags), *(f is not None for f in flags),
        rows.numpy(), marks.numpy(), weights.numpy(),
    )
    return rows, marks, weights
