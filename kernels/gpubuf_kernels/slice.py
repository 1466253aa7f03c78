"""Triton kernel of the slice-window draw (see ``gpubuf.ops.slice_windows`` for the specification)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import SLICE_WINDOWS
from gpubuf_kernels._launch import check_launch_device, launch

__all__ = ["slice_windows_triton", "SPECIALIZATIONS"]


@triton.jit
def _slice_windows_kernel(
    slots_ptr,  # int64 [>= T]: ring of eligible trajectory numbers
    start_ptr,  # int64 [>= T]: absolute start time per slot
    stop_ptr,  # int64 [>= T]: absolute stop time per slot
    front_ptr,  # int64 [1]
    count_ptr,  # int64 [1]
    u_ptr,  # float64 [2 * S]
    out_ptr,  # int64 [S * L]
    num_slices,
    capacity,
    lower,
    seq_length,
    BLOCK: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = offs < num_slices
    front = tl.load(front_ptr)
    count = tl.load(count_ptr)
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
    tl.store(out_ptr + where, rows, mask=mask[:, None] & (j[None, :] < seq_length))


def slice_windows_triton(
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
    block: int | None = None,
) -> torch.Tensor:
    """One launch: the ``int64 [S * L]`` window rows of ``S = uniforms.numel() // 2`` slices.

    Raises:
        ValueError: inputs not on one CUDA device (or CPU under the interpreter), or not contiguous.
    """
    check_launch_device(uniforms.device, "slice_windows_triton")
    for name, tensor in (("slots", slots), ("start", start), ("stop", stop), ("uniforms", uniforms)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    num_slices = uniforms.numel() // 2
    out = torch.empty(num_slices * seq_length, dtype=torch.int64, device=uniforms.device)
    if num_slices == 0:
        return out
    block = block or SLICE_WINDOWS["BLOCK"]
    block_l = triton.next_power_of_2(seq_length)
    grid = (triton.cdiv(num_slices, block),)
    launch(
        _slice_windows_kernel, grid, slots, start, stop, front, count, uniforms, out, num_slices, capacity, lower, seq_length,
        BLOCK=block, BLOCK_L=block_l, num_warps=SLICE_WINDOWS["num_warps"],
    )
    return out


#: What the launcher compiles, for the ahead-of-time check (``gpubuf.tools.aot``): slices of up to
#: 64 steps (``BLOCK_L`` is the next power of two of the slice length).
SPECIALIZATIONS = [
    {
        "kernel": "_slice_windows_kernel",
        "label": f"BLOCK_L={block_l}",
        "signature": {"slots_ptr": "*i64", "start_ptr": "*i64", "stop_ptr": "*i64", "front_ptr": "*i64",
                      "count_ptr": "*i64", "u_ptr": "*fp64", "out_ptr": "*i64", "num_slices": "i32",
                      "capacity": "i64", "lower": "i64", "seq_length": "i32"},
        "constexprs": {"BLOCK": SLICE_WINDOWS["BLOCK"], "BLOCK_L": block_l},
        "num_warps": SLICE_WINDOWS["num_warps"],
    }
    for block_l in (32, 64)
]
