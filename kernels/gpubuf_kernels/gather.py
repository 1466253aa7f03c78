"""Fused row gather: one Triton launch copies rows ``index`` of every field.

The torch twin and specification is :func:`gpubuf.ops.gather_rows.gather_rows_ref`; the public
entry point that validates, bounds-checks and dispatches is :func:`gpubuf.ops.gather_rows.gather_rows`.

How one launch serves fields of different dtypes and shapes: the kernel never sees a dtype. The
launcher describes every source by a row of an int64 *pointer table* on the device::

    table[s] = [src_addr, out_off, out_per_batch, row_units, src_stride_units, kind, 0, 0]

``src_addr`` is the address of the source's row 0; the output of source ``s`` starts at
``out_base + out_off + batch * out_per_batch`` bytes, where ``out_base`` and ``batch`` are kernel
arguments. When the launcher allocates the outputs, they are views of one buffer laid out field
after field (``out_off = 0``, ``out_per_batch`` = the bytes of the fields before, each padded to
16): the table then depends on the sources only, so a storage's table is built once and reused
for every batch size (see :mod:`gpubuf_kernels._tables`: no copy of it ever blocks the host).
Given outputs go in by address (``out_base = 0``, ``out_per_batch = 0``).

``row_units`` and ``src_stride_units`` count *units*: the widest of 16, 8, 4, 2 or 1 bytes that
divides the row's size, the row stride and both addresses, so every access is aligned to it.
``kind`` picks the copy of the row's width class, each with a tile shaped for it:

====  ==============================  ==========================================
kind  rows of                         tile per program (rows x units)
====  ==============================  ==========================================
0     16-byte units (int64 pairs)     BLOCK_ROWS x 8 (128 B a row per step)
1-4   8, 4, 2, 1-byte units           BLOCK_ROWS x 8 (8 to 64 B a row per step)
5-8   one 8, 4, 2 or 1-byte unit      BLOCK_ROWS (one access a row: ``done``, ``reward``)
====  ==============================  ==========================================

A one-byte ``done`` flag thus costs one masked load and store per row, not a wide tile of mostly
masked lanes, and with ``BLOCK_ROWS = 32`` and 4 warps no branch holds more than two units (or
two 16-byte vectors) per thread, so the registers that one kernel allocates for all its branches
stay few (72 on sm_90, 80 on sm_80: ``benchmarks/results/aot/``). 16-byte units are int64 pairs
with alignment hints, which give 128-bit loads and stores (``ld.global.v2.b64``).

The grid is ``(row blocks, source groups, column splits)``. A program reads the index of its
``BLOCK_ROWS`` output rows once, then copies those rows of every ``n_groups``-th source; at small
batches the launcher spreads sources (and the columns of wide rows) over more programs so the
device has enough of them, at large ones each program copies its rows of every field.

Sources whose rows are not dense blocks (a transposed view) or that carry a lazy conjugate or
negative bit cannot be described by one address and stride; the launcher gathers those few with
``torch.index_select`` beside the launch, see :func:`gather_rows_triton`.
"""

from __future__ import annotations

import math
import weakref
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import GATHER_ROWS
from gpubuf_kernels._launch import cdiv, check_launch_device, device_guard, launch, unit_bytes
from gpubuf_kernels._tables import device_table

__all__ = ["gather_rows_triton", "SPECIALIZATIONS", "OUT_ALIGN"]

# Columns of one pointer-table row (int64). Globals read inside jitted code must be constexpr.
_SRC_ADDR: tl.constexpr = tl.constexpr(0)
_OUT_OFF: tl.constexpr = tl.constexpr(1)
_OUT_PER_BATCH: tl.constexpr = tl.constexpr(2)
_ROW_UNITS: tl.constexpr = tl.constexpr(3)
_SRC_STRIDE: tl.constexpr = tl.constexpr(4)
_KIND: tl.constexpr = tl.constexpr(5)
_TABLE_COLS: tl.constexpr = tl.constexpr(8)

# Units per row per step of the wide tiles (a power of two); the 16-byte tile takes twice as many
# int64 words, so 8 pairs = 128 bytes.
_WIDE_COLS: tl.constexpr = tl.constexpr(8)

#: Each field of a launcher-allocated output buffer starts at a multiple of this many bytes.
OUT_ALIGN = 16



def _kind(unit: int, row_units: int) -> int:
    """The width class (``kind`` column, see the module docstring) of rows of ``row_units`` units
    of ``unit`` bytes; ``row_units`` counts int64 words for 16-byte units."""
    if unit == 16:
        return 0
    wide = _WIDE_KIND[unit]
    return wide + 4 if row_units == 1 else wide


#: The wide-tile ``kind`` of each unit narrower than 16 bytes.
_WIDE_KIND = {8: 1, 4: 2, 2: 3, 1: 4}


_MAX_GRID_Y = 65535
_MAX_ROW_BLOCKS = 2**31 - 1


@triton.jit
def _out_pointer(entry_ptr, out_base, batch, UNIT: tl.constexpr):
    """The output's first element: ``out_base + out_off + batch * out_per_batch`` bytes."""
    addr = out_base + tl.load(entry_ptr + _OUT_OFF) + batch * tl.load(entry_ptr + _OUT_PER_BATCH)
    return addr.to(tl.pointer_type(UNIT))


@triton.jit
def _copy_wide(
    entry_ptr,  # int64 [_TABLE_COLS]: this source's pointer-table row
    out_base,  # int64: base address of launcher-allocated outputs (0 for given ones)
    batch,  # int64: B
    rows,  # int64 [BLOCK_ROWS]: output row numbers of this program
    src_rows,  # int64 [BLOCK_ROWS]: source row numbers, index[rows]
    row_mask,  # bool [BLOCK_ROWS]: row inside the batch and its index inside [0, N)
    col_split,  # int64: this program's first column step
    n_col_splits,  # int64: column steps are dealt out over this many programs
    UNIT: tl.constexpr,  # element type rows are moved as: tl.uint8, tl.int16, tl.int32 or tl.int64
    VEC: tl.constexpr,  # units per aligned access (2 for the 16-byte unit, else 1)
    ALIGN: tl.constexpr,  # bytes both addresses are multiples of: unit bytes x VEC
    COLS: tl.constexpr,  # elements of UNIT per row per loop step
):
    # The table row is loaded here, inside the branch that knows the unit: an alignment hint
    # attaches to the op that defines the value, so a hint on a value shared by all branches would
    # also claim that alignment for the narrower units. The compiler learns nothing about an
    # address that comes from int_to_ptr: the pointers are hinted ALIGN-byte aligned and the row
    # length and stride multiples of VEC, which is what gives 16-byte accesses. The launcher
    # guarantees all four when it picks the unit.
    row_units = tl.multiple_of(tl.load(entry_ptr + _ROW_UNITS), VEC)
    src_stride = tl.multiple_of(tl.load(entry_ptr + _SRC_STRIDE), VEC)
    src_ptr = tl.multiple_of(tl.load(entry_ptr + _SRC_ADDR).to(tl.pointer_type(UNIT)), ALIGN)
    out_ptr = tl.multiple_of(_out_pointer(entry_ptr, out_base, batch, UNIT), ALIGN)

    # int64 row offsets: N x row bytes passes 2^31 for large storages.
    src_off = src_rows * src_stride
    out_off = rows * row_units
    cols = tl.arange(0, COLS)
    for c0 in range(col_split * COLS, row_units, n_col_splits * COLS):
        c = c0 + cols
        mask = row_mask[:, None] & (c < row_units)[None, :]
        vals = tl.load(src_ptr + (src_off[:, None] + c[None, :]), mask=mask)
        tl.store(out_ptr + (out_off[:, None] + c[None, :]), vals, mask=mask)


@triton.jit
def _copy_scalar(entry_ptr, out_base, batch, rows, src_rows, row_mask, UNIT: tl.constexpr, ALIGN: tl.constexpr):
    """Rows of one unit each: one access per row (arguments as :func:`_copy_wide`)."""
    src_stride = tl.load(entry_ptr + _SRC_STRIDE)
    src_ptr = tl.multiple_of(tl.load(entry_ptr + _SRC_ADDR).to(tl.pointer_type(UNIT)), ALIGN)
    out_ptr = tl.multiple_of(_out_pointer(entry_ptr, out_base, batch, UNIT), ALIGN)
    vals = tl.load(src_ptr + src_rows * src_stride, mask=row_mask)
    tl.store(out_ptr + rows, vals, mask=row_mask)


@triton.jit
def _copy_rows(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits):
    """Copies ``src_rows`` of one source to output ``rows`` with the tile of its width class
    (arguments as :func:`_copy_wide`)."""
    kind = tl.load(entry_ptr + _KIND)
    if kind == 0:
        _copy_wide(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits,
                   tl.int64, 2, 16, 2 * _WIDE_COLS)
    elif kind == 1:
        _copy_wide(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits,
                   tl.int64, 1, 8, _WIDE_COLS)
    elif kind == 2:
        _copy_wide(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits,
                   tl.int32, 1, 4, _WIDE_COLS)
    elif kind == 3:
        _copy_wide(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits,
                   tl.int16, 1, 2, _WIDE_COLS)
    elif kind == 4:
        _copy_wide(entry_ptr, out_base, batch, rows, src_rows, row_mask, col_split, n_col_splits,
                   tl.uint8, 1, 1, _WIDE_COLS)
    elif col_split == 0:  # one unit a row: the first column split copies it
        if kind == 5:
            _copy_scalar(entry_ptr, out_base, batch, rows, src_rows, row_mask, tl.int64, 8)
        elif kind == 6:
            _copy_scalar(entry_ptr, out_base, batch, rows, src_rows, row_mask, tl.int32, 4)
        elif kind == 7:
            _copy_scalar(entry_ptr, out_base, batch, rows, src_rows, row_mask, tl.int16, 2)
        else:
            _copy_scalar(entry_ptr, out_base, batch, rows, src_rows, row_mask, tl.uint8, 1)


@triton.jit
def _program_place(BLOCK_ROWS: tl.constexpr):
    """This program's place in the ``(row blocks, source groups, column splits)`` grid: its
    ``BLOCK_ROWS`` row numbers (int64), its source group and their number, its column split and
    their number."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    return rows, tl.program_id(1), tl.num_programs(1), tl.program_id(2).to(tl.int64), tl.num_programs(2).to(tl.int64)


@triton.jit
def _gather_rows_kernel(
    table_ptr,  # int64 [S, _TABLE_COLS]: pointer table, one row per source (module docstring)
    index_ptr,  # int32 or int64 [B]: source row of every output row
    out_base,  # int64: address of the launcher-allocated output buffer, or 0
    n_rows,  # N, rows of every source
    batch,  # B, rows of every output
    n_sources,  # S, rows of the table
    BLOCK_ROWS: tl.constexpr,  # output rows per program, a power of two
):
    rows, group, n_groups, col_split, n_col_splits = _program_place(BLOCK_ROWS)
    in_batch = rows < batch
    src_rows = tl.load(index_ptr + rows, mask=in_batch, other=0).to(tl.int64)
    # An index outside [0, N) (possible only with check_bounds=False) leaves its output row
    # unwritten instead of reading out of bounds.
    row_mask = in_batch & (src_rows >= 0) & (src_rows < n_rows)
    for source in range(group, n_sources, n_groups):
        # (S x 8 stays far below 2^31)
        _copy_rows(table_ptr + source * _TABLE_COLS, out_base, batch, rows, src_rows, row_mask, col_split,
                   n_col_splits)


#: What the launcher compiles: one kernel specialisation per row (the AOT compile check reads
#: this). Every width class is a branch of each; the index dtype and BLOCK_ROWS vary.
SPECIALIZATIONS = [
    {
        "kernel": "_gather_rows_kernel",
        "label": f"index={index}",
        "signature": {"table_ptr": "*i64", "index_ptr": f"*{index}", "out_base": "i64", "n_rows": "i64",
                      "batch": "i32", "n_sources": "i32"},
        "constexprs": {"BLOCK_ROWS": GATHER_ROWS["BLOCK_ROWS"]},
        "num_warps": GATHER_ROWS["num_warps"],
    }
    for index in ("i64", "i32")
]


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int64, torch.int32)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """True when every row ``t[i]`` is one dense block in memory (strides of dims 1.. are C order)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def _validate_sources(sources: list[torch.Tensor]) -> None:
    if not sources:
        raise ValueError("gather_rows_triton needs at least one source tensor")
    for i, src in enumerate(sources):
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"source #{i} must be a torch.Tensor, got {type(src).__name__}")
        if src.layout != torch.strided:
            raise TypeError(f"source #{i} has layout {src.layout}; only strided (dense) tensors can be gathered")
        if src.ndim == 0:
            raise ValueError(f"source #{i} is a scalar; expected a tensor of shape [N, ...]")
    device = sources[0].device
    check_launch_device(device, "gather_rows_triton")
    rows = sources[0].shape[0]
    for i, src in enumerate(sources):
        if src.device != device:
            raise ValueError(f"source #{i} is on {src.device}, expected {device} like source #0")
        if src.shape[0] != rows:
            raise ValueError(f"source #{i} has {src.shape[0]} rows, expected {rows} like source #0")


def _validate_index(index: torch.Tensor, device: torch.device) -> None:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"index must be a torch.Tensor, got {type(index).__name__}")
    if index.ndim != 1 or index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"index must be a 1-D int64 or int32 tensor, got {index.dtype} of shape {list(index.shape)}")
    if index.device != device:
        raise ValueError(f"index is on {index.device}, expected the sources' device {device}")


def _validate_outs(sources: list[torch.Tensor], index: torch.Tensor, outs: list[torch.Tensor]) -> None:
    device = sources[0].device
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


class _Plan(NamedTuple):
    """What a launch with launcher-allocated outputs needs of its sources, whatever the batch.

    Built once per set of sources (:func:`_plan_for`): a storage hands the same leaves to every
    sample, so the per-call work is the output buffer, its views and the launch.
    """

    #: The pointer table's values, row after row (the device copy is :func:`device_table`'s).
    entries: tuple[int, ...]
    #: ``(source, dtype, start, trail, strides)`` per output in the buffer: it begins ``batch *
    #: start`` bytes in (a multiple of :data:`OUT_ALIGN`, so of every element size), holds
    #: ``[batch, *trail]`` elements of ``dtype``, with contiguous ``strides``.
    fields: tuple[tuple[int, torch.dtype, int, tuple, tuple], ...]
    #: Bytes per batch row of the whole buffer.
    row_bytes: int
    #: The dtypes of the outputs in the buffer, each viewed once per call.
    dtypes: tuple[torch.dtype, ...]
    #: Sources whose rows are not dense: gathered with ``index_select`` into their own outputs.
    others: tuple[int, ...]
    #: Column steps of the widest row (the grid's third dim at most).
    steps: int


def _signature(sources: list[torch.Tensor]) -> tuple:
    return tuple((src.data_ptr(), src.shape, src.stride(), src.dtype) for src in sources)


def _source_entry(
    src: torch.Tensor, n_rows: int, out_off: int, out_per_batch: int, out_addr: int | None
) -> tuple[list[int], int]:
    """``(table row, steps)`` of one dense source; ``out_addr`` is a given output's address (it
    takes part in the unit's alignment), None for an output in the launcher's buffer."""
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    # With one row only index 0 is ever read, so the row stride is free; 0 keeps it from
    # narrowing the unit.
    stride_bytes = src.stride(0) * src.element_size() if n_rows > 1 else 0
    return _entry(src.data_ptr(), row_bytes, stride_bytes, out_off, out_per_batch, out_addr or 0)


def _entry(
    src_addr: int, row_bytes: int, stride_bytes: int, out_off: int, out_per_batch: int, out_addr: int
) -> tuple[list[int], int]:
    """:func:`_source_entry` from the source's numbers: its address, bytes per row and row
    stride in bytes; ``out_addr`` 0 for an output in the launcher's buffer (aligned to
    :data:`OUT_ALIGN`, so it narrows no unit)."""
    unit = unit_bytes(row_bytes, src_addr, out_addr, stride_bytes)
    elem = min(unit, 8)  # 16-byte units are moved as pairs of int64
    row_units = row_bytes // elem
    kind = _kind(unit, row_units)
    steps = cdiv(row_units, 2 * _WIDE_COLS.value if kind == 0 else _WIDE_COLS.value) if kind <= 4 else 1
    return [src_addr, out_off, out_per_batch, row_units, stride_bytes // elem, kind, 0, 0], steps


def _is_dense(src: torch.Tensor) -> bool:
    """Whether the kernel can copy ``src``'s rows as raw bytes (each row one block, no lazy bits)."""
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    return row_bytes > 0 and not (src.is_conj() or src.is_neg()) and _rows_contiguous(src)


def _build_plan(sources: list[torch.Tensor]) -> _Plan:
    n_rows = sources[0].shape[0]
    entries: list[int] = []
    fields, others = [], []
    prefix = 0
    steps = 1
    for i, src in enumerate(sources):
        if not _is_dense(src):
            others.append(i)
            continue
        # Field after field in one buffer, each at a multiple of OUT_ALIGN bytes.
        row, src_steps = _source_entry(src, n_rows, 0, prefix, None)
        entries += row
        steps = max(steps, src_steps)
        trail = tuple(src.shape[1:])
        strides = torch.empty((1, *trail), device="meta").stride()  # contiguous, dim 0's = the row's elements
        fields.append((i, src.dtype, prefix, trail, strides))
        prefix += cdiv(math.prod(trail) * src.element_size(), OUT_ALIGN) * OUT_ALIGN
    dtypes = tuple(dict.fromkeys(dtype for _, dtype, _, _, _ in fields))
    return _Plan(tuple(entries), tuple(fields), prefix, dtypes, tuple(others), steps)


#: ``(weak references to the sources, signature, plan)`` of the last sources planned: checked
#: by identity and by signature (address, shape, strides, dtype), so a tensor changed in place is
#: planned anew. Weak references: a dropped storage's leaves are freed, never kept for the plan.
#: One tuple replaced whole, so a gather in another thread sees the old entry or the new one.
_LAST_PLAN: list = [None]


def _plan_for(sources: list[torch.Tensor]) -> _Plan:
    """The plan of ``sources``, validated; the last one is kept (see :data:`_LAST_PLAN`)."""
    last = _LAST_PLAN[0]
    if last is not None and len(last[0]) == len(sources) and all(r() is s for r, s in zip(last[0], sources)):
        if last[1] == _signature(sources):
            return last[2]
    _validate_sources(sources)
    plan = _build_plan(sources)
    _LAST_PLAN[0] = (tuple(weakref.ref(src) for src in sources), _signature(sources), plan)
    return plan


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
            When ``None``, the outputs are allocated as views of one buffer (one allocation, and
            a pointer table that depends on the sources alone). Outputs must not overlap the
            sources.

    Returns:
        One contiguous tensor of shape ``[B, *trail_i]`` per source, ``outs`` when given. With
        ``B == 0`` they are empty and nothing is launched. No host synchronisation: the pointer
        table of a layout is copied to the device once, without waiting
        (:mod:`gpubuf_kernels._tables`).

    Raises:
        TypeError: a non-tensor argument, a non-strided source, an index that is not a 1-D
            int32/int64 tensor, or an output whose dtype differs from its source's.
        ValueError: no source, a scalar source, sources with different row counts or devices,
            an unsupported device, or an output of the wrong count, shape, device or layout.
    """
    sources = list(sources)
    if outs is None:
        plan = _plan_for(sources)
        device = sources[0].device
        check_launch_device(device, "gather_rows_triton")
        _validate_index(index, device)
        outs, out_base = _allocated_outputs(sources, index, plan)
        entries, steps = plan.entries, plan.steps
    else:
        outs = list(outs)
        _validate_sources(sources)
        device = sources[0].device
        _validate_index(index, device)
        _validate_outs(sources, index, outs)
        entries, steps = _given_outputs(sources, index, outs)
        out_base = 0
    batch = index.shape[0]
    if batch == 0 or not entries:
        return outs

    n_sources = len(entries) // _TABLE_COLS.value
    table = device_table(entries, _TABLE_COLS.value, device)
    with device_guard(device):
        launch(
            _gather_rows_kernel,
            row_grid(batch, n_sources, steps),
            table,
            index.contiguous(),
            out_base,
            sources[0].shape[0],
            batch,
            n_sources,
            BLOCK_ROWS=GATHER_ROWS["BLOCK_ROWS"],
            num_warps=GATHER_ROWS["num_warps"],
        )
    return outs


def row_grid(rows: int, n_sources: int, steps: int) -> tuple[int, int, int]:
    """The ``(row blocks, source groups, column splits)`` grid of a row copy (:func:`_copy_rows`)
    of ``rows`` rows of ``n_sources`` sources whose widest row takes ``steps`` column steps.

    Enough programs to fill the device: small batches spread their sources, then the column
    steps of wide rows, over more programs; large batches give each program every source.

    Raises:
        ValueError: a :data:`GATHER_ROWS` ``BLOCK_ROWS`` that is not a power of two, or more row
            blocks than a grid takes.
    """
    cfg = GATHER_ROWS
    block_rows = cfg["BLOCK_ROWS"]
    if not _is_pow2(block_rows):
        raise ValueError(f"GATHER_ROWS config needs BLOCK_ROWS a power of two, got {cfg}")
    row_blocks = cdiv(rows, block_rows)
    if row_blocks > _MAX_ROW_BLOCKS:
        raise ValueError(f"a copy of {rows} rows needs {row_blocks} programs, above the grid limit {_MAX_ROW_BLOCKS}")
    target = cfg["TARGET_PROGRAMS"]
    groups = max(1, min(n_sources, cdiv(target, row_blocks), _MAX_GRID_Y))
    splits = max(1, min(steps, cdiv(target, row_blocks * groups), _MAX_GRID_Y))
    return row_blocks, groups, splits


def _allocated_outputs(sources: list[torch.Tensor], index: torch.Tensor, plan: _Plan) -> tuple[list, int]:
    """Outputs as views of one new buffer laid out as ``plan`` says, and the sources that are
    not dense gathered into their own; returns ``(outs, the buffer's address)``."""
    batch = index.shape[0]
    device = sources[0].device
    outs: list = [None] * len(sources)
    for i in plan.others:
        src = sources[i]
        outs[i] = torch.empty((batch, *src.shape[1:]), dtype=src.dtype, device=device)
        if math.prod(src.shape[1:]) and batch:
            torch.index_select(src, 0, index, out=outs[i])
    out_base = 0
    if plan.fields:
        buffer = torch.empty(batch * plan.row_bytes, dtype=torch.uint8, device=device)
        # One view of the buffer per dtype, then one strided view per output (as_strided takes
        # the offset, shape and strides at once: fewer calls than slicing and reshaping).
        typed = {dtype: buffer if dtype == torch.uint8 else buffer.view(dtype) for dtype in plan.dtypes}
        for i, dtype, start, trail, strides in plan.fields:
            offset = batch * start // dtype.itemsize
            outs[i] = typed[dtype].as_strided((batch, *trail), strides, offset)
        out_base = buffer.data_ptr()
    return outs, out_base


def _given_outputs(sources: list[torch.Tensor], index: torch.Tensor, outs: list[torch.Tensor]) -> tuple[tuple, int]:
    """Table entries addressing the given outputs (the sources that are not dense are gathered
    into theirs with ``index_select``); returns ``(entries, steps)``."""
    n_rows = sources[0].shape[0]
    batch = index.shape[0]
    entries: list[int] = []
    steps = 1
    for i, src in enumerate(sources):
        if not _is_dense(src):
            if math.prod(src.shape[1:]) and batch:
                torch.index_select(src, 0, index, out=outs[i])
            continue
        address = outs[i].data_ptr()
        row, src_steps = _source_entry(src, n_rows, address, 0, address)
        entries += row
        steps = max(steps, src_steps)
    return tuple(entries), steps
