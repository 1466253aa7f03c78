"""Triton kernels of the slice windows: the uniform draw (``gpubuf.ops.slice_windows``) and the
prioritized draw (``gpubuf.ops.sumtree_windows``: the sum-tree descent and the windows at the
drawn starts), each one launch."""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import SLICE_WINDOWS
from gpubuf_kernels._launch import cdiv, check_launch_device, compiled, device_guard, launch, next_power_of_2
from gpubuf_kernels.sumtree import _draw_leaves, _importance_weight

__all__ = ["slice_windows_triton", "sumtree_windows_triton", "SPECIALIZATIONS"]


# ``lower`` (the oldest live time) moves with every write once the ring is full: specialised on its
# value it would compile a variant for each kind it takes (1, multiples of 16, others).
@triton.jit(do_not_specialize=["lower"])
def _slice_windows_kernel(
    slots_ptr,  # int64 [>= T]: ring of eligible trajectory numbers
    start_ptr,  # int64 [>= T]: absolute start time per slot
    stop_ptr,  # int64 [>= T]: absolute stop time per slot
    front_ptr,  # int64 [1]
    back_ptr,  # int64 [1]
    u_ptr,  # float64 [2 * S]
    done_ptr,  # bool [>= T]: stored done flag per row (read when HAS_DONE)
    terminated_ptr,  # bool [>= T] (read when HAS_TERMINATED)
    init_ptr,  # bool [>= T] (read when HAS_INIT)
    rows_ptr,  # int64 [S * L]: out, the windows' rows
    marks_ptr,  # bool [4, S * L]: out, truncated / done / terminated / init per step
    error_ptr,  # int32 [1]: set to 1 by a draw from an empty ring
    num_slices,
    capacity,
    lower,
    seq_length,
    BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HAS_DONE: tl.constexpr,
    HAS_TERMINATED: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    front = tl.load(front_ptr)
    count = tl.load(back_ptr) - front
    # An empty ring draws nothing: rows -1, marks False, and the error word set (the sampler
    # raises it at its check; reading the count on the host would stall the device path).
    if count <= 0:
        tl.store(error_ptr, 1)
    mask = (offs < num_slices) & ((offs * 0 + count) > 0)
    u_traj = tl.load(u_ptr + offs, mask=mask, other=0.0)
    u_start = tl.load(u_ptr + num_slices + offs, mask=mask, other=0.0)
    k = (u_traj * count.to(tl.float64)).to(tl.int64)
    g = tl.load(slots_ptr + (k + front) % capacity, mask=mask, other=0)
    slot = g % capacity
    first = tl.maximum(tl.load(start_ptr + slot, mask=mask, other=0), lower)
    length = tl.load(stop_ptr + slot, mask=mask, other=0) - first + 1
    first += (u_start * (length - (seq_length - 1)).to(tl.float64)).to(tl.int64)
    j = tl.arange(0, BLOCK_L).to(tl.int64)
    rows = (first[:, None] + j[None, :]) % capacity
    where = offs[:, None] * seq_length + j[None, :]
    inside = mask[:, None] & (j[None, :] < seq_length)
    # Every output position of the batch is written, the empty ring's as -1 and False.
    written = (offs < num_slices)[:, None] & (j[None, :] < seq_length)
    tl.store(rows_ptr + where, tl.where(inside, rows, -1), mask=written)
    # The marks: one row of S * L flags each (int1 values stored as torch.bool bytes).
    total = num_slices * seq_length
    last = (j[None, :] == seq_length - 1) & inside
    head = (j[None, :] == 0) & inside
    done = last
    if HAS_DONE:
        done = done | (tl.load(done_ptr + rows, mask=inside, other=0) != 0)
    terminated = tl.zeros([BLOCK, BLOCK_L], dtype=tl.int1)
    if HAS_TERMINATED:
        terminated = tl.load(terminated_ptr + rows, mask=inside, other=0) != 0
    init = head
    if HAS_INIT:
        init = init | (tl.load(init_ptr + rows, mask=inside, other=0) != 0)
    tl.store(marks_ptr + where, last, mask=written)
    tl.store(marks_ptr + total + where, done, mask=written)
    tl.store(marks_ptr + 2 * total + where, terminated, mask=written)
    tl.store(marks_ptr + 3 * total + where, init, mask=written)


def slice_windows_triton(
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
    block: int | None = None,
    error: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: ``int64 [S * L]`` window rows and ``bool [4, S * L]`` marks of ``S = uniforms.numel() // 2`` slices.

    ``error``: an ``int32 [1]`` word on the same device that a draw from an empty ring sets to 1
    (rows ``-1``, marks False); None: such a draw is not reported.

    Raises:
        ValueError: inputs not on one CUDA device (or CPU under the interpreter), or not contiguous.
    """
    check_launch_device(uniforms.device, "slice_windows_triton")
    flags = (done, terminated, init)
    for name, tensor in (("slots", slots), ("start", start), ("stop", stop), ("uniforms", uniforms),
                         *((n, f) for n, f in zip(("done", "terminated", "init"), flags) if f is not None)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    num_slices = uniforms.numel() // 2
    n = num_slices * seq_length
    rows = torch.empty(n, dtype=torch.int64, device=uniforms.device)
    marks = torch.empty(4, n, dtype=torch.bool, device=uniforms.device)
    if num_slices == 0:
        return rows, marks
    block = block or SLICE_WINDOWS["BLOCK"]
    block_l = next_power_of_2(seq_length)
    grid = (cdiv(num_slices, block),)
    if error is None:
        error = torch.empty(1, dtype=torch.int32, device=uniforms.device)  # written to, never read
    launch(
        _slice_windows_kernel, grid, slots, start, stop, front, back, uniforms,
        *(marks if f is None else f for f in flags), rows, marks, error, num_slices, capacity, lower, seq_length,
        BLOCK=block, BLOCK_L=block_l, HAS_DONE=done is not None, HAS_TERMINATED=terminated is not None,
        HAS_INIT=init is not None, num_warps=SLICE_WINDOWS["num_warps"],
    )
    return rows, marks


@triton.jit
def _sumtree_windows_kernel(
    leaves_ptr,  # float32 or float64 [n_leaves_padded]: the tree's leaves
    sums_ptr,  # float64 [n_internal]
    mins_ptr,  # float64 [n_internal]: the root's entry is the tree's minimum
    offsets_ptr,  # int64 [depth + 1]: level offsets in sums
    uniform_ptr,  # float64 [S]: draws in [0, 1)
    flags_ptr,  # int32 [2]: the tree's error bits (8: drawn from an empty tree)
    held_min_ptr,  # float64 [1]: the held-aside steps' minimum
    done_ptr,  # bool [>= T]: stored done flag per row (read when HAS_DONE)
    terminated_ptr,  # bool [>= T] (read when HAS_TERMINATED)
    rows_ptr,  # int64 [S * L]: out, the windows' rows
    marks_ptr,  # bool [3, S * L]: out, truncated / done / terminated per step
    weights_ptr,  # leaf dtype [S * L]: out, each step's slice weight
    num_slices,
    capacity,
    seq_length,
    beta: tl.float64,  # float64, not Triton's default float32 for a Python float
    DEPTH: tl.constexpr,
    FANOUT: tl.constexpr,
    STRATIFIED: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
    HAS_DONE: tl.constexpr,
    HAS_TERMINATED: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < num_slices
    # Each slice's first row is a leaf drawn from the tree (one leaf per physical row).
    first = _draw_leaves(leaves_ptr, sums_ptr, offsets_ptr, uniform_ptr, flags_ptr, offs, mask, num_slices,
                         DEPTH, FANOUT, STRATIFIED, BLOCK)
    value = tl.load(leaves_ptr + first, mask=mask, other=1.0)
    # The weights: TorchRL's (value / p_min) ** (-beta), p_min over both trees.
    p_min = tl.minimum(tl.load(mins_ptr), tl.load(held_min_ptr))
    weight = _importance_weight(value, p_min, beta, LIBDEVICE)
    j = tl.arange(0, BLOCK_L).to(tl.int64)
    rows = (first[:, None] + j[None, :]) % capacity
    where = offs[:, None] * seq_length + j[None, :]
    inside = mask[:, None] & (j[None, :] < seq_length)
    # Every output position of the batch is written, the empty ring's as -1 and False.
    written = (offs < num_slices)[:, None] & (j[None, :] < seq_length)
    tl.store(rows_ptr + where, tl.where(inside, rows, -1), mask=written)
    steps = tl.zeros([BLOCK, BLOCK_L], dtype=tl.float64) + weight[:, None]
    tl.store(weights_ptr + where, steps.to(weights_ptr.dtype.element_ty), mask=inside)
    total = num_slices * seq_length
    last = (j[None, :] == seq_length - 1) & inside
    done = last
    if HAS_DONE:
        done = done | (tl.load(done_ptr + rows, mask=inside, other=0) != 0)
    terminated = tl.zeros([BLOCK, BLOCK_L], dtype=tl.int1)
    if HAS_TERMINATED:
        terminated = tl.load(terminated_ptr + rows, mask=inside, other=0) != 0
    tl.store(marks_ptr + where, last, mask=inside)
    tl.store(marks_ptr + total + where, done, mask=inside)
    tl.store(marks_ptr + 2 * total + where, terminated, mask=inside)


#: CUDA's ``pow`` where the kernel is compiled; the interpreter has no libdevice (see
#: :func:`gpubuf_kernels._launch.compiled`).
_LIBDEVICE = compiled(_sumtree_windows_kernel)


def sumtree_windows_triton(
    tree,
    uniforms: torch.Tensor,
    held_min: torch.Tensor,
    beta: float,
    capacity: int,
    seq_length: int,
    done: torch.Tensor | None = None,
    terminated: torch.Tensor | None = None,
    *,
    stratified: bool = False,
    block: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch: draws ``S = uniforms.numel()`` starts from ``tree`` and lists their windows:
    ``int64 [S * L]`` rows, ``bool [3, S * L]`` marks and ``[S * L]`` weights (leaf dtype).

    A tree whose total is not positive sets the ``empty`` bit of ``tree.flags`` (no host read).

    Raises:
        ValueError: inputs not on the tree's CUDA device (or CPU under the interpreter), or not
            contiguous.
    """
    device = tree.leaves.device
    check_launch_device(device, "sumtree_windows_triton")
    flags = (done, terminated)
    for name, tensor in (("uniforms", uniforms), ("held_min", held_min),
                         *((n, f) for n, f in zip(("done", "terminated"), flags) if f is not None)):
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, the tree on {device}")
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    num_slices = uniforms.numel()
    n = num_slices * seq_length
    rows = torch.empty(n, dtype=torch.int64, device=device)
    marks = torch.empty(3, n, dtype=torch.bool, device=device)
    weights = torch.empty(n, dtype=tree.leaves.dtype, device=device)
    if num_slices == 0:
        return rows, marks, weights
    block_l = next_power_of_2(seq_length)
    block = block or _tree_block(block_l)
    with device_guard(device):
        launch(
            _sumtree_windows_kernel, (cdiv(num_slices, block),),
            tree.leaves, tree.sums, tree.mins, tree.offsets_tensor(), uniforms, tree.flags, held_min,
            *(marks if f is None else f for f in flags), rows, marks, weights, num_slices, capacity, seq_length,
            float(beta), DEPTH=tree.depth, FANOUT=tree.fanout, STRATIFIED=stratified, BLOCK=block,
            BLOCK_L=block_l, HAS_DONE=done is not None,
            HAS_TERMINATED=terminated is not None, LIBDEVICE=_LIBDEVICE,
            num_warps=SLICE_WINDOWS["num_warps"],
        )
    return rows, marks, weights


def _tree_block(block_l: int) -> int:
    """Slices a program of the prioritized draw takes: at most ``TREE_TILE`` steps (see ``_config``)."""
    return max(1, min(SLICE_WINDOWS["BLOCK"], SLICE_WINDOWS["TREE_TILE"] // block_l))


#: What the launchers compile, for the ahead-of-time check (``gpubuf.tools.aot``): slices of up to
#: 64 steps (``BLOCK_L`` is the next power of two of the slice length); the uniform draw with and
#: without each stored flag column, the prioritized draw (fp32 and fp64 leaves, trees of depth 3
#: to 5, i.i.d. and stratified) with both flag columns or neither.
SPECIALIZATIONS = [
    {
        "kernel": "_slice_windows_kernel",
        "label": f"BLOCK_L={block_l},HAS_DONE={int(has_done)},HAS_TERMINATED={int(has_term)},HAS_INIT={int(has_init)}",
        "signature": {"slots_ptr": "*i64", "start_ptr": "*i64", "stop_ptr": "*i64", "front_ptr": "*i64",
                      "back_ptr": "*i64", "u_ptr": "*fp64", "done_ptr": "*u1", "terminated_ptr": "*u1",
                      "init_ptr": "*u1", "rows_ptr": "*i64", "marks_ptr": "*u1", "error_ptr": "*i32", "num_slices": "i32",
                      "capacity": "i64", "lower": "i64", "seq_length": "i32"},
        "constexprs": {"BLOCK": SLICE_WINDOWS["BLOCK"], "BLOCK_L": block_l, "HAS_DONE": has_done,
                       "HAS_TERMINATED": has_term, "HAS_INIT": has_init},
        "num_warps": SLICE_WINDOWS["num_warps"],
    }
    for block_l in (32, 64)
    for has_done, has_term, has_init in itertools.product((False, True), repeat=3)
] + [
    {
        "kernel": "_sumtree_windows_kernel",
        "label": f"{leaves},depth={depth},stratified={int(stratified)},BLOCK_L={block_l},HAS_DONE={int(has_done)},"
                 f"HAS_TERMINATED={int(has_term)}",
        "signature": {"leaves_ptr": f"*{leaves}", "sums_ptr": "*fp64", "mins_ptr": "*fp64", "offsets_ptr": "*i64",
                      "uniform_ptr": "*fp64", "flags_ptr": "*i32", "held_min_ptr": "*fp64", "done_ptr": "*u1",
                      "terminated_ptr": "*u1", "rows_ptr": "*i64", "marks_ptr": "*u1", "weights_ptr": f"*{leaves}",
                      "num_slices": "i32", "capacity": "i64", "seq_length": "i32", "beta": "fp64"},
        "constexprs": {"DEPTH": depth, "FANOUT": 32, "STRATIFIED": stratified, "BLOCK": _tree_block(block_l),
                       "BLOCK_L": block_l, "HAS_DONE": has_done, "HAS_TERMINATED": has_term, "LIBDEVICE": True},
        "num_warps": SLICE_WINDOWS["num_warps"],
    }
    for leaves in ("fp32", "fp64")
    for depth in (3, 4, 5)
    for stratified in (False, True)
    for block_l in (32, 64)
    for has_done, has_term in ((False, False), (True, True))
]
