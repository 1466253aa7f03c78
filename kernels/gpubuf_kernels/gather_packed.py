"""Fused packed gather: one Triton launch copies B variable-length rows of many packed fields.

The torch twin and specification is :func:`gpubuf.ops.gather_packed.gather_packed_ref`; the public
entry point that validates, bounds-checks and dispatches is :func:`gpubuf.ops.gather_packed.gather_packed`.

In a packed field, the tokens of a row are one contiguous byte range, and so are the tokens of
an output row. Gathering row ``b`` of source ``s`` is therefore a copy of
``lengths[index[b]] * token_bytes_s`` bytes from ``values_s + starts[index[b]] * token_bytes_s``
to ``out_s + offsets[b] * token_bytes_s``: no per-token index is ever materialised.

Sources of different dtypes and trailing shapes share the launch through an int64 pointer table
on the device, one row per source::

    table[s] = [src_addr, out_off, out_per_total, token_units, unit_bytes, 0, 0, 0]

The output of source ``s`` starts at ``out_base + out_off + total * out_per_total`` bytes
(``out_base`` and ``total`` are kernel arguments). Outputs the launcher allocates are views of one
buffer, field after field at 16-byte boundaries, so the table depends on the sources alone and is
copied to the device once per layout (:mod:`gpubuf_kernels._tables`, never blocking the host);
given outputs go in by address (``out_base = 0``, ``out_per_total = 0``).
``token_units`` is the size of one token of the source in units of ``unit_bytes`` (16, 8, 4, 2
or 1 bytes: the widest that divides the token size and both addresses; 16-byte units move as
int64 pairs with alignment hints, which gives 128-bit accesses).

Grid: ``(B, C, S)``. Program ``(b, c, s)`` copies the units ``c*BLOCK, c*BLOCK + C*BLOCK, ...`` of
output row ``b`` of source ``s``: rows longer than ``C * BLOCK`` units loop, programs past the
end of a short row do nothing. ``B`` sits on the first axis because it can pass 65535 (the
storage compacts all of its rows with this kernel); ``C`` is capped at 65535.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from gpubuf_kernels._launch import cdiv, check_launch_device, device_guard, launch, unit_bytes
from gpubuf_kernels._tables import device_table

__all__ = ["gather_packed_triton", "GATHER_PACKED", "SPECIALIZATIONS", "OUT_ALIGN"]

# Default launch configuration. BLOCK_BYTES bytes per program per loop step (a power of two >= 16):
# 4 KiB is 128 threads x 2 accesses of 16 bytes with num_warps=4, and an average token row of
# RLHF data (about 1k int64 tokens, 8 KiB) takes two steps or two programs.
GATHER_PACKED = {"BLOCK_BYTES": 4096, "num_warps": 4}

_SRC_ADDR: tl.constexpr = tl.constexpr(0)
_OUT_OFF: tl.constexpr = tl.constexpr(1)
_OUT_PER_TOTAL: tl.constexpr = tl.constexpr(2)
_TOKEN_UNITS: tl.constexpr = tl.constexpr(3)
_UNIT_BYTES: tl.constexpr = tl.constexpr(4)

#: Each field of a launcher-allocated output buffer starts at a multiple of this many bytes.
OUT_ALIGN = 16
_TABLE_COLS: tl.constexpr = tl.constexpr(8)

_MAX_AXIS = 65535
_MAX_ROWS = 2**31 - 1


@triton.jit
def _copy_range(
    entry_ptr,  # int64 [_TABLE_COLS]: this source's pointer-table row
    out_base,  # int64: base address of launcher-allocated outputs (0 for given ones)
    total,  # int64: tokens of every output
    start,  # int64: first source token of the row
    length,  # int64: tokens of the row
    out_start,  # int64: first output token of the row
    chunk,  # int64: this program's chunk along the row
    n_chunks,  # int64: programs along the row
    UNIT: tl.constexpr,  # element type the bytes move as
    VEC: tl.constexpr,  # units per aligned access (2 for 16-byte units, else 1)
    ALIGN: tl.constexpr,  # bytes both addresses are multiples of
    BLOCK: tl.constexpr,  # units per program per step
):
    # Hints live on the ops that define the values (see gather.py): int_to_ptr tells the compiler
    # nothing, and the launcher guarantees the alignment and the token size's divisibility.
    token_units = tl.multiple_of(tl.load(entry_ptr + _TOKEN_UNITS), VEC)
    src_ptr = tl.multiple_of(tl.load(entry_ptr + _SRC_ADDR).to(tl.pointer_type(UNIT)), ALIGN)
    out_addr = out_base + tl.load(entry_ptr + _OUT_OFF) + total * tl.load(entry_ptr + _OUT_PER_TOTAL)
    out_ptr = tl.multiple_of(out_addr.to(tl.pointer_type(UNIT)), ALIGN)
    # int64 offsets: M tokens x token bytes passes 2^31 for large stores.
    src0 = start * token_units
    dst0 = out_start * token_units
    n = length * token_units
    offs = tl.arange(0, BLOCK)
    for u0 in range(chunk * BLOCK, n, n_chunks * BLOCK):
        u = u0 + offs
        mask = u < n
        vals = tl.load(src_ptr + (src0 + u), mask=mask)
        tl.store(out_ptr + (dst0 + u), vals, mask=mask)


@triton.jit
def _gather_packed_kernel(
    table_ptr,  # int64 [S, _TABLE_COLS]: pointer table, one row per source
    index_ptr,  # int32 or int64 [B]: source row of every output row
    starts_ptr,  # int64 [N]: first token of every source row
    lengths_ptr,  # int64 [N]: tokens of every source row
    offsets_ptr,  # int64 [B + 1]: first token of every output row
    out_base,  # int64: address of the launcher-allocated output buffer, or 0
    total,  # T, tokens of every output
    BLOCK_BYTES: tl.constexpr,  # bytes per program per step, a power of two >= 16
):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    n_chunks = tl.num_programs(1).to(tl.int64)
    source = tl.program_id(2).to(tl.int64)
    row = tl.load(index_ptr + b).to(tl.int64)
    start = tl.load(starts_ptr + row)
    length = tl.load(lengths_ptr + row)
    out_start = tl.load(offsets_ptr + b)
    entry_ptr = table_ptr + source * _TABLE_COLS
    unit_bytes = tl.load(entry_ptr + _UNIT_BYTES)
    if unit_bytes == 16:
        _copy_range(entry_ptr, out_base, total, start, length, out_start, chunk, n_chunks, tl.int64, 2, 16, BLOCK_BYTES // 8)
    elif unit_bytes == 8:
        _copy_range(entry_ptr, out_base, total, start, length, out_start, chunk, n_chunks, tl.int64, 1, 8, BLOCK_BYTES // 8)
    elif unit_bytes == 4:
        _copy_range(entry_ptr, out_base, total, start, length, out_start, chunk, n_chunks, tl.int32, 1, 4, BLOCK_BYTES // 4)
    elif unit_bytes == 2:
        _copy_range(entry_ptr, out_base, total, start, length, out_start, chunk, n_chunks, tl.int16, 1, 2, BLOCK_BYTES // 2)
    else:
        _copy_range(entry_ptr, out_base, total, start, length, out_start, chunk, n_chunks, tl.uint8, 1, 1, BLOCK_BYTES)


#: What the launcher compiles (the AOT compile check reads this): the index dtype varies; every
#: unit width is a branch of each.
SPECIALIZATIONS = [
    {
        "kernel": "_gather_packed_kernel",
        "label": f"index={index}",
        "signature": {"table_ptr": "*i64", "index_ptr": f"*{index}", "starts_ptr": "*i64", "lengths_ptr": "*i64",
                      "offsets_ptr": "*i64", "out_base": "i64", "total": "i64"},
        "constexprs": {"BLOCK_BYTES": GATHER_PACKED["BLOCK_BYTES"]},
        "num_warps": GATHER_PACKED["num_warps"],
    }
    for index in ("i64", "i32")
]


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _validate(values, starts, lengths, index, offsets, outs, total) -> None:
    if not values:
        raise ValueError("gather_packed_triton needs at least one values tensor")
    device = values[0].device
    check_launch_device(device, "gather_packed_triton")
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor) or v.layout != torch.strided or v.ndim == 0:
            raise TypeError(f"values #{i} must be a strided tensor of shape [M, ...]")
        if v.device != device or v.shape[0] != values[0].shape[0]:
            raise ValueError(f"values #{i} must be on {device} with {values[0].shape[0]} tokens like values #0")
        if not v.is_contiguous():
            raise ValueError(f"values #{i} must be contiguous: a row's tokens are copied as one byte range")
    for name, t in (("starts", starts), ("lengths", lengths), ("offsets", offsets)):
        if t.dtype != torch.int64 or t.ndim != 1 or t.device != device:
            raise TypeError(f"{name} must be a 1-D int64 tensor on {device}")
    if index.ndim != 1 or index.dtype not in (torch.int32, torch.int64) or index.device != device:
        raise TypeError(f"index must be a 1-D int32 or int64 tensor on {device}")
    if offsets.shape[0] != index.shape[0] + 1:
        raise ValueError(f"offsets must have B + 1 = {index.shape[0] + 1} entries, got {offsets.shape[0]}")
    if index.shape[0] > _MAX_ROWS:
        raise ValueError(f"at most {_MAX_ROWS} rows per launch, got {index.shape[0]}")
    if outs is not None:
        if len(outs) != len(values):
            raise ValueError(f"got {len(outs)} outputs for {len(values)} values tensors")
        for i, (v, out) in enumerate(zip(values, outs)):
            if out.dtype != v.dtype:
                raise TypeError(f"out #{i} has dtype {out.dtype}, expected {v.dtype}")
            if out.device != device or out.shape[1:] != v.shape[1:] or out.shape[0] < total or not out.is_contiguous():
                raise ValueError(
                    f"out #{i} must be a contiguous tensor on {device} of shape [>= {total}, *{list(v.shape[1:])}]"
                )


def gather_packed_triton(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    offsets: torch.Tensor,
    total: int,
    max_length: int,
    outs: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Copies rows ``index`` of every packed source in one launch; semantics of ``gather_packed_ref``.

    Bytes are copied raw, so the result is bit-exact for every dtype.

    Args:
        values: contiguous ``[M, *trail_i]`` tensors on one device (CUDA, or CPU with
            ``TRITON_INTERPRET=1``), any dtypes. Only read.
        starts, lengths: int64 ``[N]`` on the same device; not bounds-checked here.
        index: int32/int64 ``[B]`` rows.
        offsets: int64 ``[B + 1]``, ``[0, cumsum(lengths[index])]`` (computed by the caller, who
            needed the total on the host anyway).
        total: ``offsets[-1]`` as a Python int (sizes the outputs).
        max_length: the longest selected row in tokens (sizes the grid).
        outs: optional contiguous outputs of shape ``[>= total, *trail_i]``; rows ``[0, total)``
            are overwritten (mutated).

    Returns:
        ``(outs, offsets)``; outputs are ``[total, *trail_i]`` when allocated here.

    Raises:
        TypeError, ValueError: malformed arguments, before anything is launched.
    """
    values = list(values)
    outs = None if outs is None else list(outs)
    _validate(values, starts, lengths, index, offsets, outs, total)
    device = values[0].device
    given = outs is not None
    if not given:
        outs = [None] * len(values)
    batch = index.shape[0]

    cfg = GATHER_PACKED
    block_bytes = cfg["BLOCK_BYTES"]
    entries: list[int] = []
    fields: list[tuple[int, int, int]] = []  # (source, prefix bytes, token bytes) of the output buffer
    prefix = 0
    max_token_bytes = 0
    for i, v in enumerate(values):
        token_bytes = math.prod(v.shape[1:]) * v.element_size()
        if token_bytes == 0:
            if outs[i] is None:
                outs[i] = torch.empty((total, *v.shape[1:]), dtype=v.dtype, device=device)
            continue  # nothing to move for a trailing dim of size 0
        src_addr = v.data_ptr()
        if given:
            out_off, out_per_total = outs[i].data_ptr(), 0
            unit = unit_bytes(token_bytes, src_addr, out_off)
        else:
            out_off, out_per_total = 0, prefix
            unit = unit_bytes(token_bytes, src_addr)
            fields.append((i, prefix, token_bytes))
            prefix += -(-token_bytes // OUT_ALIGN) * OUT_ALIGN
        # The widest unit dividing the token size and both addresses.
        elem = min(unit, 8)  # 16-byte units move as int64 pairs
        entries += [src_addr, out_off, out_per_total, token_bytes // elem, unit, 0, 0, 0]
        max_token_bytes = max(max_token_bytes, token_bytes)
    out_base = 0
    if fields:
        buffer = torch.empty(total * prefix, dtype=torch.uint8, device=device)
        out_base = buffer.data_ptr()
        for i, start, token_bytes in fields:
            view = buffer[total * start : total * (start + token_bytes)]
            outs[i] = view.view(values[i].dtype).view(total, *values[i].shape[1:])
    if batch == 0 or total == 0 or not entries:
        return outs, offsets
    table = device_table(tuple(entries), _TABLE_COLS.value, device)
    chunks = max(1, min(cdiv(max_length * max_token_bytes, block_bytes), _MAX_AXIS))
    index = index.contiguous()
    with device_guard(device):
        for first in range(0, table.shape[0], _MAX_AXIS):
            part = table[first : first + _MAX_AXIS]
            launch(
                _gather_packed_kernel,
                (batch, chunks, part.shape[0]),
                part,
                index,
                starts,
                lengths,
                offsets,
                out_base,
                total,
                BLOCK_BYTES=block_bytes,
                num_warps=cfg["num_warps"],
            )
    return outs, offsets
