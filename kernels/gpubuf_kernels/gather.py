"""Fused row gather: one Triton launch copies rows ``index`` of many tensors.

The torch twin and specification is :func:`gpubuf.ops.gather_rows.gather_rows_ref`; the public
entry point that validates, bounds-checks and dispatches is :func:`gpubuf.ops.gather_rows.gather_rows`.

How one launch serves fields of different dtypes and shapes: the kernel never sees a dtype. The
launcher describes every source by a row of an int64 *pointer table* on the device::

    table[s] = [src_addr, out_addr, row_units, src_stride_units, unit_bytes, 0, 0, 0]

``src_addr``/``out_addr`` are the raw addresses of the source's row 0 and of the output,
``row_units`` is the row length and ``src_stride_units`` the distance between source rows, both
counted in *units*, and ``unit_bytes`` (1, 2, 4, 8 or 16) is the width of the unit the rows are
moved in. The launcher picks, per source, the widest unit that divides the row's byte size, the
source row stride in bytes and both addresses, so an fp32 ``[84, 84]`` observation moves as
16-byte accesses while a 3-byte ``uint8`` field falls back to bytes. Units of 16 bytes are int64
pairs with alignment hints that let the compiler emit 128-bit loads and stores. Rows are padded
to 8 words so that an entry is 64 bytes.

The kernel's grid is ``(cdiv(B, BLOCK_ROWS), S)``: a program owns ``BLOCK_ROWS`` output rows of
one source, loads its table row, casts the addresses to pointers of the unit type with
``.to(tl.pointer_type(...))`` and loops over the row in steps of ``BLOCK_BYTES``. The unit is a
runtime branch on ``unit_bytes``, one specialised copy loop per width, so every source shares the
launch whatever its width. (The PTX of Triton 3.6 and 3.9 for sm_90 holds ``ld/st.global.v2.b64``
in the 16-byte branch; without the pointer hints it holds none.)

Sources whose rows are not dense blocks (a transposed view) or that carry a lazy conjugate or
negative bit cannot be described by one address and stride; the launcher gathers those few with
``torch.index_select`` beside the launch, see :func:`gather_rows_triton`.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from typing import Sequence

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import GATHER_ROWS
from gpubuf_kernels._launch import check_launch_device, device_guard, launch, unit_bytes

__all__ = ["gather_rows_triton"]

# Columns of one pointer-table row (int64). Globals read inside jitted code must be constexpr.
_SRC_ADDR: tl.constexpr = tl.constexpr(0)
_OUT_ADDR: tl.constexpr = tl.constexpr(1)
_ROW_UNITS: tl.constexpr = tl.constexpr(2)
_SRC_STRIDE: tl.constexpr = tl.constexpr(3)
_UNIT_BYTES: tl.constexpr = tl.constexpr(4)
_TABLE_COLS: tl.constexpr = tl.constexpr(8)

# A CUDA grid's second axis holds at most 65535 programs; more sources take more launches.
_MAX_SOURCES_PER_LAUNCH = 65535
_MAX_ROW_BLOCKS = 2**31 - 1


@triton.jit
def _copy_rows(
    entry_ptr,  # int64 [_TABLE_COLS]: this source's pointer-table row
    rows,  # int64 [BLOCK_ROWS]: output row numbers of this program
    src_rows,  # int64 [BLOCK_ROWS]: source row numbers, index[rows]
    row_mask,  # bool [BLOCK_ROWS]: row inside the batch and its index inside [0, N)
    UNIT: tl.constexpr,  # element type rows are moved as: tl.uint8, tl.int16, tl.int32 or tl.int64
    VEC: tl.constexpr,  # units per aligned access (2 for the 16-byte unit, else 1)
    ALIGN: tl.constexpr,  # bytes both addresses are multiples of: unit bytes x VEC
    BLOCK_COLS: tl.constexpr,  # units per row per loop step
):
    # The table row is loaded here, inside the branch that knows the unit, rather than once in
    # the caller: an alignment hint attaches to the op that defines the value, so a hint on a value
    # shared by all branches would also claim that alignment for the narrower units.
    # Hints are what give 16-byte accesses: the compiler learns nothing about an address that
    # comes from int_to_ptr, so the pointers are hinted as ALIGN-byte aligned, and the row length
    # and stride as multiples of VEC units (so row offsets and the column mask keep VEC-unit runs).
    # The launcher guarantees all four when it picks the unit.
    row_units = tl.multiple_of(tl.load(entry_ptr + _ROW_UNITS), VEC)
    src_stride = tl.multiple_of(tl.load(entry_ptr + _SRC_STRIDE), VEC)
    src_ptr = tl.multiple_of(tl.load(entry_ptr + _SRC_ADDR).to(tl.pointer_type(UNIT)), ALIGN)
    out_ptr = tl.multiple_of(tl.load(entry_ptr + _OUT_ADDR).to(tl.pointer_type(UNIT)), ALIGN)

    # int64 row offsets: N x row bytes passes 2^31 for large storages.
    src_off = src_rows * src_stride
    out_off = rows * row_units
    cols = tl.arange(0, BLOCK_COLS)
    for c0 in range(0, row_units, BLOCK_COLS):
        c = c0 + cols
        mask = row_mask[:, None] & (c < row_units)[None, :]
        vals = tl.load(src_ptr + (src_off[:, None] + c[None, :]), mask=mask)
        tl.store(out_ptr + (out_off[:, None] + c[None, :]), vals, mask=mask)


@triton.jit
def _gather_rows_kernel(
    table_ptr,  # int64 [S, _TABLE_COLS]: pointer table, one row per source (module docstring)
    index_ptr,  # int32 or int64 [B]: source row of every output row
    n_rows,  # N, rows of every source
    batch,  # B, rows of every output
    BLOCK_ROWS: tl.constexpr,  # output rows per program, a power of two
    BLOCK_BYTES: tl.constexpr,  # bytes per row per loop step, a power of two >= 16
):
    pid_r = tl.program_id(0).to(tl.int64)
    source = tl.program_id(1).to(tl.int64)
    rows = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_batch = rows < batch
    src_rows = tl.load(index_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    # An index outside [0, N) (possible only with check_bounds=False) leaves its output row
    # unwritten instead of reading out of bounds.
    row_mask = in_batch & (src_rows >= 0) & (src_rows < n_rows)

    entry_ptr = table_ptr + source * _TABLE_COLS
    unit_bytes = tl.load(entry_ptr + _UNIT_BYTES)
    if unit_bytes == 16:
        _copy_rows(entry_ptr, rows, src_rows, row_mask, tl.int64, 2, 16, BLOCK_BYTES // 8)
    elif unit_bytes == 8:
        _copy_rows(entry_ptr, rows, src_rows, row_mask, tl.int64, 1, 8, BLOCK_BYTES // 8)
    elif unit_bytes == 4:
        _copy_rows(entry_ptr, rows, src_rows, row_mask, tl.int32, 1, 4, BLOCK_BYTES // 4)
    elif unit_bytes == 2:
        _copy_rows(entry_ptr, rows, src_rows, row_mask, tl.int16, 1, 2, BLOCK_BYTES // 2)
    else:
        _copy_rows(entry_ptr, rows, src_rows, row_mask, tl.uint8, 1, 1, BLOCK_BYTES)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int64, torch.int32)

# Device copies of recent pointer tables. A sampling loop gathers the same storage into the same
# (preallocated or allocator-recycled) outputs again and again; reusing the table saves a
# host-to-device copy per call. The key holds every value of the table, so a hit is exact. It also
# holds the stream: a table is only used on the stream it was copied and allocated on, so neither
# a pageable copy still in flight nor the allocator's stream-ordered reuse after eviction can race.
_TABLE_CACHE: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLE_CACHE_SIZE = 64
_TABLE_CACHE_LOCK = threading.Lock()


def _rows_contiguous(t: torch.Tensor) -> bool:
    """True when every row ``t[i]`` is one dense block in memory (strides of dims 1.. are C order)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _device_table(entries: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(entries, dtype=torch.int64).view(-1, _TABLE_COLS.value)
    if device.type != "cuda":
        return host
    key = (device, torch.cuda.current_stream(device).cuda_stream, tuple(entries))
    with _TABLE_CACHE_LOCK:
        table = _TABLE_CACHE.get(key)
        if table is not None:
            _TABLE_CACHE.move_to_end(key)
            return table
    table = host.to(device)
    with _TABLE_CACHE_LOCK:
        _TABLE_CACHE[key] = table
        while len(_TABLE_CACHE) > _TABLE_CACHE_SIZE:
            _TABLE_CACHE.popitem(last=False)
    return table


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def _validate(sources: list[torch.Tensor], index: torch.Tensor, outs: list[torch.Tensor] | None) -> None:
    if not sources:
        raise ValueError("gather_rows_triton needs at least one source tensor")
    for i, src in enumerate(sources):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"source #{i} must be a torch.Tensor, got {type(src).__name__}")
        if src.layout != torch.strided:
            raise TypeError(f"source #{i} has layout {src.layout}; only strided (dense) tensors can be gathered")
        if src.ndim == 0:
            raise ValueError(f"source #{i} is a scalar; expected a tensor of shape [N, ...]")
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a torch.Tensor, got {type(index).__name__}")
    if index.ndim != 1 or index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"index must be a 1-D int64 or int32 tensor, got {index.dtype} of shape {list(index.shape)}")

    device = sources[0].device
    check_launch_device(device, "gather_rows_triton")
    rows = sources[0].shape[0]
    for i, src in enumerate(sources):
        if src.device != device:
            raise ValueError(f"source #{i} is on {src.device}, expected {device} like source #0")
        if src.shape[0] != rows:
            raise ValueError(f"source #{i} has {src.shape[0]} rows, expected {rows} like source #0")
    if index.device != device:
        raise ValueError(f"index is on {index.device}, expected the sources' device {device}")

    if outs is None:
        return
    if len(outs) != len(sources):
        raise ValueError(f"got {len(outs)} outputs for {len(sources)} sources")
    for i, (src, out) in enumerate(zip(sources, outs)):
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out #{i} must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != src.dtype:
            raise TypeError(f"out #{i} has dtype {out.dtype}, expected {src.dtype} like source #{i}")
        expected = torch.Size([index.shape[0], *src.shape[1:]])
        if out.shape != expected:
            raise ValueError(f"out #{i} has shape {list(out.shape)}, expected {list(expected)}")
        if out.device != device:
            raise ValueError(f"out #{i} is on {out.device}, expected {device}")
        if out.layout != torch.strided or not out.is_contiguous():
            raise ValueError(f"out #{i} must be a contiguous strided tensor")
        if out.is_conj() or out.is_neg():
            raise ValueError(f"out #{i} is a lazy conjugate/negative view; pass a resolved tensor")


def gather_rows_triton(
    sources: Sequence[torch.Tensor],
    index: torch.Tensor,
    outs: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Gathers ``result[i][b] = sources[i][index[b]]`` for every source in one Triton launch.

    Semantics are those of :func:`gpubuf.ops.gather_rows.gather_rows_ref`; rows are copied as raw
    bytes, so the result is bit-exact for every dtype (NaN payloads and ``-0.0`` included).

    Args:
        sources: tensors of shape ``[N, *trail_i]``, any dtype (tested: bool, uint8, int8, int16,
            int32, int64, float16, bfloat16, float32, float64), any trailing shape, all with the
            same ``N`` and on one device: CUDA, or CPU when ``TRITON_INTERPRET=1``. Only read.
            A source need not be contiguous as long as each of its rows is one dense block
            (e.g. ``x[::2]``, ``x[:, 1:4]`` or an expanded row). A source whose rows are not
            dense (e.g. a transposed view) or that is a lazy conjugate/negative view is gathered
            with ``torch.index_select`` into its output instead, one extra op per such source:
            that copies only the ``B`` gathered rows, where making it contiguous would copy all
            ``N``.
        index: 1-D ``int64`` or ``int32`` tensor of ``B`` row numbers on the sources' device;
            duplicates and any order allowed. It is not bounds-checked here
            (:func:`~gpubuf.ops.gather_rows.gather_rows` does that): an output row whose index
            lies outside ``[0, N)`` is left unwritten rather than read out of bounds.
        outs: optional outputs, one per source, of shape ``[B, *trail_i]``, the source's dtype,
            on the same device and contiguous. They are overwritten (mutated) and returned.
            When ``None``, contiguous outputs are allocated. Outputs must not overlap the sources.

    Returns:
        One contiguous tensor of shape ``[B, *trail_i]`` per source, ``outs`` when given. With
        ``B == 0`` they are empty and nothing is launched.

    Raises:
        TypeError: a non-tensor argument, a non-strided source, an index that is not a 1-D
            int32/int64 tensor, or an output whose dtype differs from its source's.
        ValueError: no source, a scalar source, sources with different row counts or devices,
            an unsupported device, or an output of the wrong count, shape, device or layout.
    """
    sources = list(sources)
    outs = None if outs is None else list(outs)
    _validate(sources, index, outs)

    device = sources[0].device
    batch = index.shape[0]
    n_rows = sources[0].shape[0]
    if outs is None:
        outs = [torch.empty((batch, *src.shape[1:]), dtype=src.dtype, device=device) for src in sources]
    if batch == 0:
        return outs

    index = index.contiguous()
    entries: list[int] = []
    for src, out in zip(sources, outs):
        row_bytes = math.prod(src.shape[1:]) * src.element_size()
        if row_bytes == 0:
            continue  # nothing to move for a trailing dim of size 0
        if src.is_conj() or src.is_neg() or not _rows_contiguous(src):
            torch.index_select(src, 0, index, out=out)
            continue
        src_addr, out_addr = src.data_ptr(), out.data_ptr()
        # With one row only index 0 is ever read, so the row stride is free; 0 keeps it from
        # narrowing the unit.
        stride_bytes = src.stride(0) * src.element_size() if n_rows > 1 else 0
        # The widest unit dividing the row size, the source row stride and both addresses.
        unit = unit_bytes(row_bytes, src_addr, out_addr, stride_bytes)
        elem = min(unit, 8)  # 16-byte units are moved as pairs of int64
        entries += [src_addr, out_addr, row_bytes // elem, stride_bytes // elem, unit, 0, 0, 0]
    if not entries:
        return outs

    cfg = GATHER_ROWS
    block_rows, block_bytes = cfg["BLOCK_ROWS"], cfg["BLOCK_BYTES"]
    if not (_is_pow2(block_rows) and _is_pow2(block_bytes) and block_bytes >= 16):
        raise ValueError(
            f"GATHER_ROWS config needs BLOCK_ROWS and BLOCK_BYTES powers of two and BLOCK_BYTES >= 16, got {cfg}"
        )
    row_blocks = triton.cdiv(batch, block_rows)
    if row_blocks > _MAX_ROW_BLOCKS:
        raise ValueError(f"batch of {batch} rows needs {row_blocks} programs, above the grid limit {_MAX_ROW_BLOCKS}")

    # One launch for all sources; the loop only splits past the grid's 65535 sources on axis 1.
    table = _device_table(entries, device)
    with device_guard(device):
        for first in range(0, table.shape[0], _MAX_SOURCES_PER_LAUNCH):
            part = table[first : first + _MAX_SOURCES_PER_LAUNCH]
            launch(
                _gather_rows_kernel,
                (row_blocks, part.shape[0]),
                part,
                index,
                n_rows,
                batch,
                BLOCK_ROWS=block_rows,
                BLOCK_BYTES=block_bytes,
                num_warps=cfg["num_warps"],
            )
    return outs
