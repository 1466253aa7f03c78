"""Prioritized slice windows: starts drawn from a sum tree, and the rows, marks and importance
weights of the ``L``-step windows that begin there.

:class:`~gpubuf.samplers.PrioritizedSliceSampler`'s whole draw, for a storage of one column and
slices of one length: the tree holds one leaf per physical row (a step that cannot start a slice
holds 0, or sits in the held-aside tree), each drawn leaf is a window's first row, the window
follows the ring, its steps are marked as TorchRL's info entries mark them (truncated at a
slice's last step, done and terminated from the stored flags), and every step carries its slice's
importance weight ``(value / p_min) ** (-beta)``, with ``p_min`` the smaller of two minima (the
tree's and the held-aside steps').

One launch on CUDA (the descent, the windows and the weights; the minima are read on the device,
and an empty tree sets the tree's error bit: no host synchronisation), one compiled call on a CPU
with Numba, else the twin.
"""

from __future__ import annotations

import numpy as np
import torch

from gpubuf.errors import DeviceMismatchError
from gpubuf.ops._dispatch import implementation, resolve
from gpubuf.ops.sumtree import SumTree, importance_weights, sumtree_sample_ref

__all__ = ["sumtree_windows", "sumtree_windows_ref", "MARKS_AT"]

#: The rows of the marks :func:`sumtree_windows` returns, in order.
MARKS_AT = ("truncated", "done", "terminated")


def sumtree_windows_ref(
    tree: SumTree,
    uniforms: torch.Tensor,
    held_min: torch.Tensor,
    beta: float,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    *,
    stratified: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch twin of the prioritized window draw; the op's specification.

    The starts are :func:`~gpubuf.ops.sumtree.sumtree_sample_ref`'s draws: ``starts, values =
    sumtree_sample_ref(tree, uniforms, stratified=stratified)``. For slice ``s`` of ``S =
    uniforms.numel()``, ``j < L`` and ``i = s * L + j``: ``rows[i] = (starts[s] + j) % T``;
    ``marks[0, i] = j == L - 1`` (truncated); ``marks[1, i] = done[rows[i]] | marks[0, i]``;
    ``marks[2, i] = terminated[rows[i]]`` (an absent flag column reads False); ``weights[i] =
    importance_weights(values, p_min, beta)[s]`` with ``p_min = min(tree.min(), held_min)``
    (TorchRL's ``(value / p_min) ** (-beta)``, in float64, rounded to the leaf dtype).

    Args:
        tree: the sum tree of the steps that may start a slice (leaf ``r``: physical row ``r``);
            only read.
        uniforms: ``float64 [S]`` draws in ``[0, 1)`` on the tree's device.
        held_min: ``float64`` 0-d tensor on the tree's device: the held-aside steps' minimum
            (:meth:`SumTree.min` of that tree).
        beta: the importance exponent.
        capacity: ``T``, the storage's rows.
        seq_length: ``L``.
        done, terminated: ``bool [>= T]`` stored flags per physical row on the tree's device, or
            None.
        stratified: the tree draw's mass scheme (see :func:`~gpubuf.ops.sumtree.sumtree_sample_ref`).

    Returns:
        ``(rows, marks, weights)``: ``int64 [S * L]``, ``bool [3, S * L]`` (rows in the order of
        :data:`MARKS_AT`) and ``[S * L]`` in the leaf dtype, on the tree's device. Nothing is
        mutated.
    """
    starts, values = sumtree_sample_ref(tree, uniforms, stratified=stratified)
    s = starts.numel()
    j = torch.arange(seq_length, device=starts.device)
    rows = ((starts.unsqueeze(1) + j) % capacity).reshape(-1)
    last = (j == seq_length - 1).expand(s, seq_length).reshape(-1)
    marks = torch.stack([
        last,
        last if done is None else done[rows] | last,
        torch.zeros_like(last) if terminated is None else terminated[rows],
    ])
    weight = importance_weights(values, torch.minimum(tree.min(), held_min), beta)
    return rows, marks, weight.unsqueeze(1).expand(s, seq_length).reshape(-1)


def _check(tree: SumTree, uniforms: torch.Tensor, held_min: torch.Tensor, capacity: int, seq_length: int,
           flags: tuple) -> None:
    if not isinstance(tree, SumTree):
        raise TypeError(f"tree must be a SumTree, got {type(tree).__name__}")
    if not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float64 or uniforms.ndim != 1:
        raise TypeError("uniforms must be a 1-D float64 tensor of draws in [0, 1)")
    if not isinstance(held_min, torch.Tensor) or held_min.dtype != torch.float64 or held_min.numel() != 1:
        raise TypeError("held_min must be a float64 tensor of one element")
    for name, tensor in (("uniforms", uniforms), ("held_min", held_min)):
        if tensor.device != tree.device:
            raise DeviceMismatchError(f"{name} is on {tensor.device}, the tree on {tree.device}")
    if capacity <= 0 or seq_length <= 0:
        raise ValueError(f"capacity and seq_length must be positive, got {capacity} and {seq_length}")
    for name, flag in zip(MARKS_AT[1:], flags):
        if flag is None:
            continue
        if not isinstance(flag, torch.Tensor) or flag.dtype != torch.bool or flag.ndim != 1:
            raise TypeError(f"{name} must be a 1-D bool tensor or None")
        if flag.device != tree.device or flag.numel() < capacity:
            raise ValueError(f"{name} must hold at least capacity ({capacity}) flags on {tree.device}")


def sumtree_windows(
    tree: SumTree,
    uniforms: torch.Tensor,
    held_min: torch.Tensor,
    beta: float,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    *,
    stratified: bool = False,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prioritized window draw of :func:`sumtree_windows_ref`, dispatched through the backend table.

    The starts are the tree draw's (the GPU's parallel prefix sums may round differently, as in
    :func:`~gpubuf.ops.sumtree.sumtree_sample`). The Triton kernel computes the weights' power as
    the sum-tree draw does (CUDA's ``pow`` compiled, ``exp(y * log(x))`` under the interpreter),
    the Numba loop with the C library's ``pow``: within a few ulps of the twin's ``float64``
    before rounding to the leaf dtype. A tree whose total is not positive gives index 0 on every
    backend; on CUDA it also sets the tree's ``empty`` error bit (callers on a host check first).

    Args:
        As :func:`sumtree_windows_ref`; ``backend`` is ``"auto"``, ``"torch"``, ``"triton"`` or
        ``"numba"``. ``validate=False`` skips the argument checks, for a caller that built the
        arguments itself (a sampler's own tree, tables and flag columns): on a CPU they cost
        about as much as the draw of a few dozen slices.

    Raises:
        TypeError, ValueError: inputs of the wrong type, dtype, shape or size.
        DeviceMismatchError: inputs not on the tree's device.
        BackendUnavailableError: an explicit backend that cannot run here.
    """
    flags = (done, terminated)
    if validate:
        _check(tree, uniforms, held_min, capacity, seq_length, flags)
    which = resolve("sumtree_windows", tree.leaves, backend)
    if which == "torch":
        return sumtree_windows_ref(tree, uniforms, held_min, beta, capacity, seq_length, *flags, stratified=stratified)
    kernel = implementation("sumtree_windows", which)
    if which == "triton":
        return kernel(tree, uniforms, held_min, beta, capacity, seq_length, *flags, stratified=stratified)
    n = uniforms.numel() * seq_length
    # NumPy outputs handed out as tensors sharing their memory (cheaper than torch.empty and
    # Tensor.numpy()).
    rows = np.empty(n, dtype=np.int64)
    marks = np.empty((len(MARKS_AT), n), dtype=np.bool_)
    arrays = tree._numpy_arrays()
    weights = np.empty(n, dtype=arrays.leaves.dtype)
    kernel(
        arrays.leaves, arrays.sums, arrays.mins, arrays.offsets, arrays.sizes, arrays.shift, uniforms.numpy(),
        bool(stratified), float(held_min), float(beta), capacity, seq_length,
        *(_NO_FLAGS if f is None else f.numpy() for f in flags), *(f is not None for f in flags),
        rows, marks, weights,
    )
    return torch.from_numpy(rows), torch.from_numpy(marks), torch.from_numpy(weights)


#: Stands for an absent flag column (the compiled loop reads it only where told it is present).
_NO_FLAGS = np.zeros(1, dtype=np.bool_)
