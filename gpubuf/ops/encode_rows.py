"""Vectorised encoder of the row format (see :mod:`gpubuf.codec.format`), on any device.

Every step is a whole-batch torch op, so rows written from CUDA tensors are encoded on the GPU;
the only host synchronisation is reading the batch's total encoded size to allocate its bytes.
Each line independently takes the cheapest mode: ``UP`` or ``REF`` when it repeats the line
above or its reference line (free), else ``RUNS`` of its own bytes or of its residual against
the reference line, whichever has fewer runs, when that is smaller than the line, else ``RAW``.
A row whose coded form is not strictly smaller than its raw bytes is stored raw, so the worst
case (noise) costs nothing beyond the raw bytes.

CPU rows are encoded by the compiled kernel ``gpubuf_kernels.cpu.encoder`` where Numba imports
(the same bytes, line by line; ``backend="torch"`` or ``GPUBUF_NUMBA=0`` keeps the torch steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpubuf.codec.checksum import adler32_ranges, adler32_ranges_host
from gpubuf.codec.format import (
    RUN_BLOCK,
    MAX_RUNS,
    MODE_RAW,
    MODE_REF,
    MODE_RUNS,
    MODE_UP,
    RESIDUAL_BIT,
    RowGeometry,
)
from gpubuf.ops._dispatch import kernel_module, resolve

__all__ = ["EncodedBatch", "encode_planes", "encode_planes_at", "lines_equal", "wide_view"]


@dataclass
class EncodedBatch:
    """Encoded rows, back to back.

    Attributes:
        data: ``uint8 [sum(lengths)]``, row k at ``data[starts[k] : starts[k] + lengths[k]]``.
        starts: int64 ``[n]``, exclusive prefix sum of ``lengths``.
        lengths: int64 ``[n]``.
        checksums: int64 ``[n]`` Adler-32 of each row's bytes plus its reference row (``[0, 2**32)``).
    """

    data: torch.Tensor
    starts: torch.Tensor
    lengths: torch.Tensor
    checksums: torch.Tensor


def wide_view(lines: torch.Tensor) -> torch.Tensor:
    """Views the last dim of a uint8 tensor as the widest int dtype dividing it (fewer elements to compare).

    Equality of lines is all this is used for, so byte order does not matter.
    """
    width = lines.shape[-1]
    if width == 0:
        return lines  # nothing to compare, and no wider element to view zero bytes as
    if lines.is_contiguous():
        for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
            if width % size == 0 and lines.storage_offset() % size == 0 and lines.data_ptr() % size == 0:
                return lines.view(dtype)
    return lines


def lines_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``[..., W]`` uint8 lines -> bool ``[...]``: True where the two lines hold the same bytes.

    Compares in the widest integer unit that divides ``W`` and reduces the XORs with a max and
    a min (the units are signed), several times faster on CPU than ``(a == b).all(-1)``.
    """
    aw, bw = (a, b) if a.dtype == b.dtype and a.dtype != torch.uint8 else (wide_view(a), wide_view(b))
    if aw.dtype != bw.dtype:
        aw, bw = a, b
    if aw.shape[-1] == 0:
        return torch.ones(aw.shape[:-1], dtype=torch.bool, device=aw.device)
    x = aw ^ bw
    return (x.amax(-1) == 0) & (x.amin(-1) == 0)


def _run_breaks(signal: torch.Tensor) -> torch.Tensor:
    """``[m, W]`` bool: True where a run starts (first byte, a change of value, every 256th byte)."""
    brk = torch.empty(signal.shape, dtype=torch.bool, device=signal.device)
    brk[:, :1] = True
    torch.ne(signal[:, 1:], signal[:, :-1], out=brk[:, 1:])
    if signal.shape[1] > RUN_BLOCK:
        brk[:, ::RUN_BLOCK] = True
    return brk


def _count_runs(signal: torch.Tensor) -> torch.Tensor:
    """Runs per line of ``[m, W]`` uint8 (int64 ``[m]``), splitting runs every 256 bytes."""
    if signal.shape[1] > RUN_BLOCK:
        return _run_breaks(signal).view(torch.uint8).sum(1, dtype=torch.int64)
    changes = torch.ne(signal[:, 1:], signal[:, :-1])
    return changes.view(torch.uint8).sum(1, dtype=torch.int64) + 1


def encode_planes(
    planes: torch.Tensor,
    geometry: RowGeometry,
    *,
    key_planes: torch.Tensor | None = None,
    has_key: torch.Tensor | None = None,
    ref_rows: torch.Tensor | None = None,
    intra: bool = False,
    inrow: bool = True,
    backend: str = "auto",
) -> EncodedBatch:
    """Encodes rows given as byte planes.

    Args:
        planes: ``uint8 [n, P, H, W]`` (see :meth:`RowGeometry.to_planes`); only read.
        geometry: the rows' geometry.
        key_planes: ``uint8 [n, P, H, W]``, the planes of each row's reference row, used where
            ``has_key`` is True (rows without a key may hold anything there).
        has_key: bool ``[n]``, which rows are coded against ``key_planes``.
        ref_rows: int32 ``[n]``, the reference row number stored with each row (-1 for none); it
            only enters the checksum. Defaults to -1 everywhere.
        intra: code every row without any reference.
        inrow: let planes ``p % P0 > 0`` of rows without a key use the first image plane of the
            same byte as reference. Off for rows that may serve as reference rows of others,
            which must hold no reference at all.
        backend: ``"auto"`` (the compiled kernel for CPU rows where Numba imports, else the
            torch steps), ``"torch"`` or ``"numba"``.

    Returns:
        An :class:`EncodedBatch` on ``planes``' device.
    """
    device = planes.device
    n = planes.shape[0]
    g = geometry
    P, H, W, L = g.planes, g.height, g.width, g.lines
    if ref_rows is None:
        ref_rows = torch.full((n,), -1, dtype=torch.int32, device=device)
    if n == 0 or g.raw_bytes == 0:
        zeros = torch.zeros(n, dtype=torch.int64, device=device)
        return EncodedBatch(
            torch.empty(0, dtype=torch.uint8, device=device), zeros, zeros.clone(),
            adler32_ranges(torch.empty(0, dtype=torch.uint8, device=device), zeros, zeros, ref_rows),
        )
    keyed = not intra and has_key is not None and key_planes is not None and bool(has_key.any())
    if resolve("encode_rows", planes, backend) == "numba":
        return _encode_numba(planes, g, key_planes, has_key, ref_rows, keyed, intra, inrow)
    x = planes.reshape(n, P, H, W)

    # Reference planes: the key row's plane, or the first image plane of the same byte.
    plane_ids = torch.arange(P, device=device)
    first_plane = plane_ids - plane_ids % g.image_planes
    inrow_ok = ((plane_ids % g.image_planes) > 0) & inrow
    inrow_any = not intra and bool(inrow_ok.any())
    has_ref = torch.zeros(n, P, dtype=torch.bool, device=device)
    ref = x  # what planes without a reference compare against does not matter
    if inrow_any:
        has_ref |= inrow_ok
        ref = x[:, first_plane]
    if keyed:
        has_ref |= has_key[:, None]
        if inrow_any:
            sel = has_key.nonzero().squeeze(1)
            ref.index_copy_(0, sel, key_planes.reshape(n, P, H, W).index_select(0, sel))
        else:
            ref = key_planes.reshape(n, P, H, W)

    modes = torch.full((n, P, H), MODE_RAW, dtype=torch.uint8, device=device)
    xw = wide_view(x)  # widened once: slices of it stay wide
    if bool(has_ref.any()):
        modes.masked_fill_(has_ref[:, :, None] & lines_equal(xw, wide_view(ref)), MODE_REF)
    if H > 1:
        # UP is preferred to REF: it resolves inside the row.
        modes[:, :, 1:].masked_fill_(lines_equal(xw[:, :, 1:], xw[:, :, :-1]), MODE_UP)
    modes = modes.view(n, L)

    # Candidates for runs: lines neither UP nor REF.
    cand = (modes == MODE_RAW).view(-1).nonzero().squeeze(1)
    lines = x.reshape(n * L, W).index_select(0, cand)
    runs = _count_runs(lines)
    cand_ref = has_ref.view(n, P, 1).expand(n, P, H).reshape(-1).index_select(0, cand)
    use_res = torch.zeros_like(cand_ref)
    if bool(cand_ref.any()):
        rsel = cand_ref.nonzero().squeeze(1)
        resid = lines.index_select(0, rsel) - ref.reshape(n * L, W).index_select(0, cand.index_select(0, rsel))
        res_runs = _count_runs(resid)
        better = res_runs < runs.index_select(0, rsel)
        use_res[rsel[better]] = True
        runs[rsel[better]] = res_runs[better]
    coded = (runs <= MAX_RUNS) & (2 * runs < W)  # count byte + 2n - 1 payload bytes < W
    flat_modes = modes.view(-1)
    flat_modes[cand[coded]] = MODE_RUNS

    # Sizes: per line payload, per row total; rows not smaller than raw are stored raw.
    is_runs = modes == MODE_RUNS
    line_runs = torch.zeros(n * L, dtype=torch.int64, device=device)
    line_runs[cand] = torch.where(coded, runs, 0)
    line_runs = line_runs.view(n, L)
    size = torch.where(modes == MODE_RAW, W, (2 * line_runs - 1).clamp_min(0))
    n_runs_lines = is_runs.sum(1)
    row_size = g.mode_bytes + n_runs_lines + size.sum(1)
    is_raw = row_size >= g.raw_bytes
    row_size = torch.where(is_raw, g.raw_bytes, row_size)
    starts = torch.cumsum(row_size, 0) - row_size
    total = int(row_size.sum())
    data = torch.empty(total, dtype=torch.uint8, device=device)

    coded_rows = (~is_raw).nonzero().squeeze(1)
    raw_rows = is_raw.nonzero().squeeze(1)
    if raw_rows.numel():
        dst = starts.index_select(0, raw_rows)[:, None] + torch.arange(g.raw_bytes, device=device)
        data[dst.view(-1)] = x.index_select(0, raw_rows).reshape(-1)
    if coded_rows.numel():
        _write_coded(data, x, ref, modes, line_runs, size, use_res, cand, coded, starts, n_runs_lines, coded_rows, g)
    if device.type == "cpu":
        checksums = adler32_ranges_host(data, starts, row_size, ref_rows)
    else:
        checksums = adler32_ranges(data, starts, row_size, ref_rows)
    return EncodedBatch(data, starts, row_size, checksums)


def _write_coded(data, x, ref, modes, line_runs, size, use_res, cand, coded, starts, n_runs_lines, coded_rows, g):
    """Writes the coded rows' mode table, count bytes and line payloads into ``data``."""
    device = data.device
    n = x.shape[0]
    L, W, MB = g.lines, g.width, g.mode_bytes
    rows_c = coded_rows
    m = modes.index_select(0, rows_c)  # [c, L]
    c = m.shape[0]

    # Mode table: four 2-bit modes per byte.
    packed = torch.zeros(c, MB * 4, dtype=torch.uint8, device=device)
    packed[:, :L] = m
    packed = packed.view(c, MB, 4)
    mode_bytes = packed[:, :, 0] | (packed[:, :, 1] << 2) | (packed[:, :, 2] << 4) | (packed[:, :, 3] << 6)
    row_start = starts.index_select(0, rows_c)
    data[(row_start[:, None] + torch.arange(MB, device=device)).view(-1)] = mode_bytes.view(-1)

    # Count bytes, in line order after the mode table.
    is_runs = m == MODE_RUNS
    runs_c = line_runs.index_select(0, rows_c)
    res_full = torch.zeros(n * L, dtype=torch.bool, device=device)
    res_full[cand] = use_res & coded
    res_c = res_full.view(n, L).index_select(0, rows_c)
    rank = torch.cumsum(is_runs, 1) - 1
    pos = (row_start[:, None] + MB + rank)[is_runs]
    count = ((runs_c - 1) | (res_c.to(torch.int64) * RESIDUAL_BIT))[is_runs]
    data[pos] = count.to(torch.uint8)

    # Line payloads: offsets within the row after the counts.
    size_c = size.index_select(0, rows_c)
    line_start = row_start[:, None] + MB + n_runs_lines.index_select(0, rows_c)[:, None] + torch.cumsum(size_c, 1) - size_c

    # RAW lines: their bytes.
    raw_lines = (m == MODE_RAW).nonzero()
    if raw_lines.numel():
        r, l = raw_lines[:, 0], raw_lines[:, 1]
        dst = line_start[r, l][:, None] + torch.arange(W, device=device)
        data[dst.view(-1)] = x.reshape(n * L, W).index_select(0, rows_c[r] * L + l).reshape(-1)

    # RUNS lines: run starts (low bytes, run 0 implied) then values, of the line or of its
    # residual against the reference line.
    runs_lines = is_runs.nonzero()
    if runs_lines.numel():
        r, l = runs_lines[:, 0], runs_lines[:, 1]
        flat_line = rows_c[r] * L + l
        signal = x.reshape(n * L, W).index_select(0, flat_line)
        res = res_c[r, l]
        if bool(res.any()):
            rsel = res.nonzero().squeeze(1)
            signal[rsel] -= ref.reshape(n * L, W).index_select(0, flat_line.index_select(0, rsel))
        brk = _run_breaks(signal)
        j, xs = brk.nonzero().unbind(1)
        nr = runs_c[r, l]
        first = torch.cumsum(nr, 0) - nr
        run_rank = torch.arange(j.numel(), device=device) - first[j]
        base = line_start[r, l][j]
        later = run_rank > 0
        data[(base + run_rank - 1)[later]] = (xs[later] & 255).to(torch.uint8)
        data[base + nr[j] - 1 + run_rank] = signal[j, xs]


def _encode_numba(planes, g, key_planes, has_key, ref_rows, keyed, intra, inrow) -> EncodedBatch:
    """The compiled CPU encode: :func:`encode_planes`'s bytes, lengths and checksums, one kernel call."""
    n = planes.shape[0]
    x = planes.detach().reshape(-1).contiguous().numpy()
    if keyed:
        key = key_planes.detach().reshape(-1).contiguous().numpy()
        own = has_key.detach().to(torch.bool).contiguous().numpy()
    else:
        key = np.empty(0, dtype=np.uint8)
        own = np.zeros(0, dtype=np.bool_)
    refs = ref_rows.detach().to(torch.int32).contiguous().numpy()
    data, starts, lengths, checksums = kernel_module("cpu.encoder").encode_rows(
        x, key, n, own, keyed, bool(inrow), bool(intra), refs, g.image_planes, g.height, g.width
    )
    return EncodedBatch(torch.from_numpy(data), torch.from_numpy(starts), torch.from_numpy(lengths), torch.from_numpy(checksums))


def encode_planes_at(
    sources: list[torch.Tensor],
    row_src: torch.Tensor,
    row_off: torch.Tensor,
    key_src: torch.Tensor,
    key_off: torch.Tensor,
    has_key: torch.Tensor,
    ref_rows: torch.Tensor,
    geometry: RowGeometry,
    *,
    inrow: bool = True,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> EncodedBatch:
    """:func:`encode_planes` of rows that lie inside other buffers, read where they are.

    Row ``r``'s byte planes are ``sources[row_src[r]]`` from byte ``row_off[r]`` on, its key
    row's ``sources[key_src[r]]`` from ``key_off[r]`` (read only where ``has_key``). For 1-byte
    dtypes the planes are the rows' bytes, so frames inside a batch of stacked observations are
    encoded without first being copied out of it.

    Args:
        sources: flat contiguous uint8 tensors on the CPU.
        row_src, row_off, key_src, key_off: int64 ``[n]``.
        has_key: bool ``[n]``.
        ref_rows: int32 ``[n]``, the reference row number stored with each row (checksums).
        geometry: the rows' geometry.
        inrow: as in :func:`encode_planes`.
        out: optional uint8 scratch of at least ``n * geometry.raw_bytes`` bytes for the compiled
            kernel to write into (a reused buffer spares the page faults of a fresh one); the
            returned ``data`` is then a view of it, valid until it is written again.
        backend: ``"auto"`` (the compiled kernel where Numba imports), ``"numba"`` or
            ``"torch"`` (gathers the rows, then :func:`encode_planes`).

    Returns:
        The same :class:`EncodedBatch` as :func:`encode_planes` of the gathered rows.
    """
    n = row_src.shape[0]
    g = geometry
    RB = g.raw_bytes
    if n == 0 or RB == 0 or resolve("encode_rows", sources[0], backend) != "numba":
        rows = _gather_rows(sources, row_src, row_off, RB).view(n, g.planes, g.height, g.width)
        keys = _gather_rows(sources, torch.where(has_key, key_src, row_src), torch.where(has_key, key_off, row_off), RB)
        return encode_planes(
            rows, g, key_planes=keys.view_as(rows), has_key=has_key, ref_rows=ref_rows, inrow=inrow, backend="torch"
        )
    if out is None or out.numel() < n * RB:
        out = torch.empty(n * RB, dtype=torch.uint8)
    arrays = tuple(x.detach().view(-1).numpy() for x in sources)
    keyed = bool(has_key.any())
    units, unit = _compare_units(arrays, (row_off, key_off), g.width)
    starts, lengths, checksums, total = kernel_module("cpu.encoder").encode_rows_at(
        arrays,
        units,
        unit,
        row_src.numpy(),
        row_off.numpy(),
        key_src.numpy(),
        key_off.numpy(),
        RB,
        has_key.numpy(),
        keyed,
        bool(inrow),
        False,
        ref_rows.to(torch.int32).numpy(),
        g.image_planes,
        g.height,
        g.width,
        out.numpy(),
    )
    return EncodedBatch(out[:total], torch.from_numpy(starts), torch.from_numpy(lengths), torch.from_numpy(checksums))


_UNIT_DTYPES = ((8, np.uint64), (4, np.uint32), (2, np.uint16))
_WIDE_COMPARE_BYTES = 32  # gpubuf_kernels.cpu.encoder compares lines this wide 32 bytes at a time


def _compare_units(
    arrays: tuple[np.ndarray, ...], offsets: tuple[torch.Tensor, ...], width: int
) -> tuple[tuple[np.ndarray, ...], int]:
    """``arrays`` viewed in the widest unsigned unit that divides ``width``, every offset and every
    array's size and address, and that unit's size (``arrays`` and 1 when none does).

    The compiled encoder compares lines narrower than 32 bytes in these units: short lines do not
    reach the vectorized loop's minimum trip, so the compare runs unit by unit, and wider units
    mean fewer steps.
    """
    if width >= _WIDE_COMPARE_BYTES:
        # Lines this wide are compared 32 bytes at a time on the bytes themselves: no units,
        # and one compiled specialization whatever the alignment.
        return arrays, 1
    for unit, dtype in _UNIT_DTYPES:
        if width % unit or any(a.size % unit or a.ctypes.data % unit for a in arrays):
            continue
        if any(bool(torch.bitwise_and(o, unit - 1).any()) for o in offsets if o.numel()):
            continue
        return tuple(a.view(dtype) for a in arrays), unit
    return arrays, 1


def _gather_rows(sources: list[torch.Tensor], src: torch.Tensor, off: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """uint8 ``[n, row_bytes]``: row ``r`` copied from ``sources[src[r]][off[r]:]``."""
    rows = torch.empty(src.shape[0], row_bytes, dtype=torch.uint8, device=src.device)
    span = torch.arange(row_bytes, device=src.device)
    for k, source in enumerate(sources):
        sel = (src == k).nonzero().squeeze(1)
        if sel.numel():
            rows[sel] = source.view(-1)[off.index_select(0, sel)[:, None] + span]
    return rows
