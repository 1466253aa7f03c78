"""Fused ring write: one Triton launch writes a batch's rows of every field into a storage.

The torch twin and specification is :func:`gpubuf.ops.write_rows.write_rows_ref`; the public
entry point that validates and dispatches is :func:`gpubuf.ops.write_rows.write_rows`.

A round-robin extend writes batch row ``b`` of every field to storage row ``(first + b) % N``.
Done field by field that is one or two copies per field (two where the write wraps), eleven to
twenty-two launches for a transition of eleven fields; here it is one launch. The fields are
described by the row gather's pointer table (:mod:`gpubuf_kernels.gather`): each row's
``src_addr`` is the batch field's row 0, its output is the storage field's row 0 (``out_off``,
``out_per_batch = 0``), and the copies are the gather's, with the batch rows as the sources'
rows and the ring rows as the outputs'. Storage fields must be contiguous (a storage's leaves
are); a batch field need only have dense rows, the others are copied with ``copy_`` beside the
launch.

The table holds the batch's addresses, so it changes from one batch to the next; it reaches the
device as the gather's do (:func:`gpubuf_kernels._tables.device_table`, a non-blocking copy that
is kept while the same addresses come back, which is what a CUDA graph capture of an extend of
a fixed input buffer needs).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from gpubuf_kernels._config import GATHER_ROWS
from gpubuf_kernels._launch import check_launch_device, device_guard, launch
from gpubuf_kernels._tables import device_table
from gpubuf_kernels.gather import _TABLE_COLS, _copy_rows, _entry, _is_dense, _program_place, _source_entry, row_grid

__all__ = ["write_rows_triton", "SPECIALIZATIONS"]


# ``first`` moves with every extend and ``count`` follows the batch: specialised on their values
# (1, multiples of 16) they would compile a variant for each kind the loop meets.
@triton.jit(do_not_specialize=["first", "count"])
def _write_rows_kernel(
    table_ptr,  # int64 [S, _TABLE_COLS]: one row per field (module docstring)
    first,  # int64: the storage row batch row 0 goes to, in [0, N)
    capacity,  # int64: N, rows of every storage field
    count,  # B, batch rows written (B <= N)
    n_sources,  # S, rows of the table
    BLOCK_ROWS: tl.constexpr,  # batch rows per program, a power of two
):
    batch_rows, group, n_groups, col_split, n_col_splits = _program_place(BLOCK_ROWS)
    in_batch = batch_rows < count
    ring_rows = (first + batch_rows) % capacity
    for source in range(group, n_sources, n_groups):
        _copy_rows(table_ptr + source * _TABLE_COLS, 0, 0, ring_rows, batch_rows, in_batch, col_split, n_col_splits)


#: What the launcher compiles (the AOT compile check reads this): one specialisation.
SPECIALIZATIONS = [
    {
        "kernel": "_write_rows_kernel",
        "label": "ring",
        "signature": {"table_ptr": "*i64", "first": "i64", "capacity": "i64", "count": "i32", "n_sources": "i32"},
        "constexprs": {"BLOCK_ROWS": GATHER_ROWS["BLOCK_ROWS"]},
        "num_warps": GATHER_ROWS["num_warps"],
    }
]


def _validate(dests: list[torch.Tensor], sources: list[torch.Tensor], first: int) -> None:
    if not dests:
        raise ValueError("write_rows_triton needs at least one field")
    if len(sources) != len(dests):
        raise ValueError(f"got {len(sources)} batch fields for {len(dests)} storage fields")
    device = dests[0].device
    check_launch_device(device, "write_rows_triton")
    capacity, count = dests[0].shape[0] if dests[0].ndim else 0, sources[0].shape[0] if sources[0].ndim else 0
    for i, (dst, src) in enumerate(zip(dests, sources)):
        for what, t in (("storage field", dst), ("batch field", src)):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.ndim == 0:
                raise TypeError(f"{what} #{i} must be a strided tensor of shape [rows, ...], got {t!r:.80}")
            if t.device != device:
                raise ValueError(f"{what} #{i} is on {t.device}, expected {device} like storage field #0")
        if dst.dtype != src.dtype:
            raise TypeError(f"batch field #{i} has dtype {src.dtype}, expected {dst.dtype} like its storage field")
        if dst.shape[1:] != src.shape[1:]:
            raise ValueError(f"batch field #{i} has rows of shape {list(src.shape[1:])}, expected {list(dst.shape[1:])}")
        if dst.shape[0] != capacity or src.shape[0] != count:
            raise ValueError(f"field #{i}: every storage field needs {capacity} rows and every batch field {count}")
        if not dst.is_contiguous() or dst.is_conj() or dst.is_neg():
            raise ValueError(f"storage field #{i} must be contiguous")
    if count > capacity:
        raise ValueError(f"a batch of {count} rows does not fit a ring of {capacity}: write its last {capacity}")
    if not 0 <= first < max(capacity, 1):
        raise ValueError(f"first must be in [0, {capacity}), got {first}")


def _copy_beside(dst: torch.Tensor, src: torch.Tensor, first: int) -> None:
    """The twin's copies, for a batch field whose rows the kernel cannot address."""
    head = min(src.shape[0], dst.shape[0] - first)
    dst[first : first + head].copy_(src[:head])
    if head < src.shape[0]:
        dst[: src.shape[0] - head].copy_(src[head:])


def write_rows_triton(
    dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], first: int, *, checked: bool = True
) -> None:
    """Writes ``dests[i][(first + b) % N] = sources[i][b]`` for every field in one Triton launch.

    Semantics are those of :func:`gpubuf.ops.write_rows.write_rows_ref`; rows are copied as raw
    bytes, bit-exact for every dtype.

    Args:
        dests: the storage's fields, contiguous tensors ``[N, *trail_i]`` on one device (CUDA, or
            CPU when ``TRITON_INTERPRET=1``). Mutated: ``B`` of their rows are overwritten.
        sources: the batch's fields, ``[B, *trail_i]`` with ``B <= N``, each of its storage
            field's dtype, on the same device; only read. A field whose rows are not dense (a
            transposed view) or that is a lazy conjugate or negative view is copied with
            ``copy_`` beside the launch. They must not overlap ``dests``.
        first: the storage row batch row 0 goes to, in ``[0, N)``.
        checked: validate the arguments first; False for a caller that guarantees them (a
            storage writing a batch it has matched to its leaves: the checks cost more host
            time than the launch).

    Raises:
        TypeError: a non-strided or scalar field, or a batch field of another dtype.
        ValueError: mismatched counts, rows, shapes or devices, an unsupported device, a
            non-contiguous storage field, ``B > N`` or ``first`` out of range.
    """
    if checked:
        _validate(list(dests), list(sources), first)
    count = sources[0].shape[0]
    if count == 0:
        return
    entries: list[int] = []
    steps = 1
    for dst, src in zip(dests, sources):
        if src.is_contiguous() and not (src.is_conj() or src.is_neg()):
            # The common case, read off the tensor in a few calls (this loop is most of an
            # extend's host time): rows of ``numel / B`` elements, back to back (``B > 1``
            # makes dim 0's stride the row's size; with one row the stride is never read).
            row_bytes = src.numel() // count * src.element_size()
            if not row_bytes:
                continue  # rows of no bytes
            address = dst.data_ptr()
            row, src_steps = _entry(src.data_ptr(), row_bytes, row_bytes if count > 1 else 0, address, 0, address)
        elif not math.prod(src.shape[1:]):
            continue
        elif _is_dense(src):
            address = dst.data_ptr()
            row, src_steps = _source_entry(src, count, address, 0, address)
        else:
            _copy_beside(dst, src, first)
            continue
        entries += row
        steps = max(steps, src_steps)
    if not entries:
        return
    n_sources = len(entries) // _TABLE_COLS.value
    device = dests[0].device
    table = device_table(tuple(entries), _TABLE_COLS.value, device)
    with device_guard(device):
        launch(
            _write_rows_kernel,
            row_grid(count, n_sources, steps),
            table,
            first,
            dests[0].shape[0],
            count,
            n_sources,
            BLOCK_ROWS=GATHER_ROWS["BLOCK_ROWS"],
            num_warps=GATHER_ROWS["num_warps"],
        )
