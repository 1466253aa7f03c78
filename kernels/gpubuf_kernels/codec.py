"""Compressed-row decode fused with the gather of the sampled rows: two Triton launches.

The torch twin and specification is :func:`gpubuf.ops.decode_rows.decode_rows_ref`; the public
entry point is :func:`gpubuf.ops.decode_rows.decode_rows`. The row format is documented in
:mod:`gpubuf.codec.format`.

Launch 1, ``_line_table_kernel``, grid ``(2B,)``: program ``t < B`` reads the header of sampled
row ``index[t]``, program ``B + t`` the header of that row's reference row (or returns at once
when it has none). Each builds its row's line table in scratch memory and verifies the row:

- ``gid[t, l]``: for every line, the number of the nearest line at or above it that is not
  ``UP`` among the row's non-``UP`` lines, which resolves ``UP`` chains with a prefix sum
  instead of a scan;
- ``entry[t, k]``: for the k-th non-``UP`` line, two int64 words: its payload offset in the
  arena, and ``mode | runs << 2 | residual << 10 | line << 11``;
- ``status[t]``: the failure bits of :mod:`gpubuf.ops.decode_rows` (bounds, length, modes,
  reference, and with ``VERIFY`` the Adler-32 checksum, computed as two sums over the bytes).

Launch 2, ``_decode_lines_kernel``, grid ``(B, cdiv(L, LINES))``: a program writes ``LINES``
output lines of one sampled row straight into the output (byte planes interleaved back into
elements on the store). Each line resolves to a base line (its own, or line ``y`` of the
reference plane) and an optional residual, both read from the arena: ``RAW`` bytes are loaded
as they are; for ``RUNS``, the run holding byte ``x`` is the count of run starts at or before
it (``tl.sum(starts <= x)``). Lines whose run starts are out of order or past the line are
flagged in ``runs_bad[b, chunk]``.

Every load is masked to the arena, so a corrupt row can produce wrong bytes in its own output
row but never a read or write out of bounds; the launcher raises
:class:`~gpubuf.codec.errors.CorruptRowError` for such rows after the launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpubuf_kernels._launch import cdiv, check_launch_device, device_guard, launch

__all__ = ["decode_rows_triton", "DECODE_ROWS", "SPECIALIZATIONS"]

# Default launch configuration (to be tuned on an H200 with benchmarks/bench_compressed.py).
# LINE_BLOCK: lines per step of the line-table program. LINES: output lines per decode
# program. X_BLOCK: bytes of a line per step. RUN_BLOCK: runs per step of the run search
# (X_BLOCK x RUN_BLOCK comparisons). CHECK_BLOCK: bytes per step of the checksum.
DECODE_ROWS = {
    "LINE_BLOCK": 128,
    "LINES": 8,
    "X_BLOCK": 128,
    "RUN_BLOCK": 32,
    "CHECK_BLOCK": 512,
    "num_warps": 4,
}

_MODE_UP: tl.constexpr = tl.constexpr(0)
_MODE_REF: tl.constexpr = tl.constexpr(1)
_MODE_RAW: tl.constexpr = tl.constexpr(2)
_MODE_RUNS: tl.constexpr = tl.constexpr(3)
_ADLER: tl.constexpr = tl.constexpr(65521)

_BAD_BOUNDS: tl.constexpr = tl.constexpr(1)
_BAD_LENGTH: tl.constexpr = tl.constexpr(2)
_BAD_CHECKSUM: tl.constexpr = tl.constexpr(4)
_BAD_MODE: tl.constexpr = tl.constexpr(8)
_BAD_RUNS: tl.constexpr = tl.constexpr(16)
_BAD_REFERENCE: tl.constexpr = tl.constexpr(32)


@triton.jit
def _load_byte(arena_ptr, addr, mask, arena_size):
    """Bytes at ``addr`` as int32 (0 where masked off or outside the arena)."""
    ok = mask & (addr >= 0) & (addr < arena_size)
    return tl.load(arena_ptr + addr, mask=ok, other=0).to(tl.int32)


@triton.jit
def _line_modes(arena_ptr, off, lines, lmask, is_raw, arena_size):
    """2-bit modes of ``lines`` read from the mode table at ``off`` (all RAW for a raw row)."""
    # Scalar conditions enter block masks through tl.where: `block & scalar` comes out of the
    # interpreter (Triton 3.9) as an int32 array that loads reject as a mask.
    byte = _load_byte(arena_ptr, off + (lines >> 2), tl.where(is_raw == 0, lmask, False), arena_size)
    modes = (byte >> ((lines & 3) * 2).to(tl.int32)) & 3
    return tl.where(is_raw != 0, _MODE_RAW, modes)


@triton.jit
def _line_table_kernel(
    arena_ptr,  # uint8 [A]: the arena
    offsets_ptr,  # int64 [R]: row offsets
    lengths_ptr,  # int32 [R]: row lengths
    checksums_ptr,  # int32 [R]: Adler-32 bit patterns
    refs_ptr,  # int32 [R]: reference rows (unused without HAS_REFS)
    tab_ptr,  # int64 [2B]: rows to parse, -1 for none
    gid_ptr,  # int32 [2B, L]: out, resolved non-UP ordinal of each line
    entry_ptr,  # int64 [2B, L, 2]: out, (payload offset, packed mode/runs/residual/line)
    status_ptr,  # int32 [2B]: in/out, failure bits (OR-ed into what the launcher set)
    arena_size,
    batch,  # B
    n_lines,  # L
    height,  # H
    width,  # W
    image_planes,  # P0
    mode_bytes,  # MB
    raw_bytes,  # L * W
    HAS_REFS: tl.constexpr,
    VERIFY: tl.constexpr,
    LINE_BLOCK: tl.constexpr,
    CHECK_BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(tab_ptr + t)
    if row >= 0:
        is_key_slot = t >= batch
        bad = tl.load(status_ptr + t)
        off = tl.load(offsets_ptr + row)
        nb = tl.load(lengths_ptr + row).to(tl.int64)
        own_ref = tl.full((), -1, tl.int32)
        if HAS_REFS:
            own_ref = tl.load(refs_ptr + row)
        if is_key_slot & (own_ref != -1):
            bad = bad | _BAD_REFERENCE
        if (off < 0) or (nb < 0) or (off + nb > arena_size):
            bad = bad | _BAD_BOUNDS
            off = off * 0
            nb = nb * 0
        is_raw = (nb == raw_bytes).to(tl.int32)
        # REF and residual lines may appear in every plane of a row with a reference row, in
        # planes p % P0 > 0 otherwise, and nowhere in a reference row.
        keyed = (own_ref >= 0) & (t < batch)

        # Pass 1: how many RUNS lines, which fixes where the payloads start.
        n_runs_lines = tl.zeros((), dtype=tl.int64)
        for l0 in range(0, n_lines, LINE_BLOCK):
            lines = l0 + tl.arange(0, LINE_BLOCK).to(tl.int64)
            lmask = lines < n_lines
            modes = _line_modes(arena_ptr, off, lines, lmask, is_raw, arena_size)
            n_runs_lines += tl.sum(((modes == _MODE_RUNS) & lmask).to(tl.int64), axis=0)

        # Pass 2: counts, payload offsets, UP resolution, entries.
        payload = off + mode_bytes + n_runs_lines
        run_rank = tl.zeros((), dtype=tl.int64)
        size_sum = tl.zeros((), dtype=tl.int64)
        group = tl.zeros((), dtype=tl.int64)
        mode_bad = tl.zeros((), dtype=tl.int32)
        for l0 in range(0, n_lines, LINE_BLOCK):
            lines = l0 + tl.arange(0, LINE_BLOCK).to(tl.int64)
            lmask = lines < n_lines
            modes = _line_modes(arena_ptr, off, lines, lmask, is_raw, arena_size)
            is_runs = (modes == _MODE_RUNS) & lmask
            rank = run_rank + tl.cumsum(is_runs.to(tl.int64), axis=0)  # 1-based where is_runs
            count = _load_byte(arena_ptr, off + mode_bytes + rank - 1, is_runs, arena_size)
            runs = tl.where(is_runs, (count & 127) + 1, 0)
            resid = tl.where(is_runs, count >> 7, 0)
            size = tl.where(modes == _MODE_RAW, width, tl.where(is_runs, 2 * runs - 1, 0)).to(tl.int64)
            size = tl.where(lmask, size, 0)
            ends = size_sum + tl.cumsum(size, axis=0)
            line_off = tl.where(is_raw != 0, off + lines * width, payload + ends - size)
            non_up = (modes != _MODE_UP) & lmask
            g = group + tl.cumsum(non_up.to(tl.int64), axis=0) - 1
            tl.store(gid_ptr + t * n_lines + lines, g.to(tl.int32), mask=lmask)
            packed = modes.to(tl.int64) | (runs.to(tl.int64) << 2) | (resid.to(tl.int64) << 10) | (lines << 11)
            slot = entry_ptr + (t * n_lines + g) * 2
            tl.store(slot, line_off, mask=non_up)
            tl.store(slot + 1, packed, mask=non_up)
            plane = lines // height
            has_ref = tl.where(keyed, lmask | True, (plane % image_planes) > 0)
            if is_key_slot:
                has_ref = lines < 0
            wrong = ((modes == _MODE_UP) & (lines % height == 0)) | (
                ((modes == _MODE_REF) | (resid != 0)) & (has_ref == 0)
            )
            mode_bad = mode_bad | tl.max((wrong & lmask).to(tl.int32), axis=0)
            run_rank += tl.sum(is_runs.to(tl.int64), axis=0)
            size_sum += tl.sum(size, axis=0)
            group += tl.sum(non_up.to(tl.int64), axis=0)
        if mode_bad != 0:
            bad = bad | _BAD_MODE
        if (is_raw == 0) and (mode_bytes + n_runs_lines + size_sum != nb):
            bad = bad | _BAD_LENGTH

        if VERIFY:
            if bad == 0:
                # Adler-32: A = 1 + sum b_i, B = n + sum (n - i) b_i (mod 65521), then the
                # reference row's 4 little-endian bytes.
                a = tl.zeros((), dtype=tl.int64)
                b = tl.zeros((), dtype=tl.int64)
                for c0 in range(0, nb, CHECK_BLOCK):
                    i = c0 + tl.arange(0, CHECK_BLOCK).to(tl.int64)
                    v = _load_byte(arena_ptr, off + i, i < nb, arena_size).to(tl.int64)
                    a += tl.sum(v, axis=0)
                    b += tl.sum(((nb - i) % _ADLER) * v, axis=0)
                a = (1 + a) % _ADLER
                b = (b + nb) % _ADLER
                word = own_ref.to(tl.int64) & 0xFFFFFFFF
                for k in tl.static_range(4):
                    a = (a + ((word >> (8 * k)) & 0xFF)) % _ADLER
                    b = (b + a) % _ADLER
                stored = tl.load(checksums_ptr + row).to(tl.int64) & 0xFFFFFFFF
                if ((b << 16) | a) != stored:
                    bad = bad | _BAD_CHECKSUM
        tl.store(status_ptr + t, bad)


@triton.jit
def _expand_line(arena_ptr, off, mode, runs, x, xmask, width, arena_size, RUN_BLOCK: tl.constexpr):
    """Bytes ``x`` of a RAW or RUNS line at ``off`` (int32), and 1 when its run starts are invalid.

    Runs 1..n-1 start at ``256 * (zero low bytes so far) + low byte``; the run holding byte ``x``
    is the number of starts at or before it.
    """
    is_raw = mode == _MODE_RAW
    n_starts = tl.where(is_raw, 0, runs - 1)
    count = tl.zeros(x.shape, dtype=tl.int32)
    blocks = tl.zeros((), dtype=tl.int64)
    bad = tl.zeros((), dtype=tl.int32)
    r = tl.arange(0, RUN_BLOCK).to(tl.int64)
    for r0 in range(0, n_starts, RUN_BLOCK):
        rmask = (r0 + r) < n_starts
        low = _load_byte(arena_ptr, off + r0 + r, rmask, arena_size).to(tl.int64)
        zero = ((low == 0) & rmask).to(tl.int64)
        block = blocks + tl.cumsum(zero, axis=0)
        start = block * 256 + low
        # The previous start: the byte before, in the block it was in.
        low_prev = _load_byte(arena_ptr, off + r0 + r - 1, rmask & ((r0 + r) > 0), arena_size).to(tl.int64)
        start_prev = tl.where((r0 + r) > 0, (block - zero) * 256 + low_prev, 0)
        wrong = rmask & ((start <= start_prev) | (start >= width))
        bad = bad | tl.max(wrong.to(tl.int32), axis=0)
        hit = (start[None, :] <= x[:, None]) & rmask[None, :]
        count += tl.sum(hit.to(tl.int32), axis=1)
        blocks += tl.sum(zero, axis=0)
    raw_vals = _load_byte(arena_ptr, off + x, tl.where(is_raw, xmask, False), arena_size)
    run_vals = _load_byte(arena_ptr, off + n_starts + count, tl.where(is_raw, False, xmask), arena_size)
    return tl.where(is_raw, raw_vals, run_vals), bad


@triton.jit
def _decode_lines_kernel(
    arena_ptr,  # uint8 [A]
    gid_ptr,  # int32 [2B, L]: from _line_table_kernel
    entry_ptr,  # int64 [2B, L, 2]: from _line_table_kernel
    has_key_ptr,  # int8 [B]: 1 where the sampled row has a reference row
    out_ptr,  # uint8 [B, row bytes]: the output rows, elements in their dtype's byte order
    runs_bad_ptr,  # int32 [B, n_chunks]: out, 1 where a line's run starts are invalid
    arena_size,
    batch,
    n_lines,  # L
    height,  # H
    width,  # W
    image_planes,  # P0
    itemsize,  # bytes per element
    row_bytes,  # bytes per output row
    n_chunks,
    LINES: tl.constexpr,
    X_BLOCK: tl.constexpr,
    RUN_BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    has_key = tl.load(has_key_ptr + b) != 0
    ref_slot = tl.where(has_key, batch + b, b)
    bad = tl.zeros((), dtype=tl.int32)
    xs = tl.arange(0, X_BLOCK).to(tl.int64)
    for i in range(LINES):
        l = chunk * LINES + i
        if l < n_lines:
            g1 = tl.maximum(tl.load(gid_ptr + b * n_lines + l).to(tl.int64), 0)
            e1 = entry_ptr + (b * n_lines + g1) * 2
            off1 = tl.load(e1)
            packed1 = tl.load(e1 + 1)
            mode1 = packed1 & 3
            runs1 = (packed1 >> 2) & 255
            resid1 = (packed1 >> 10) & 1
            line1 = packed1 >> 11
            needs = (mode1 == _MODE_REF) | (resid1 != 0)
            # Base line: this line's own, or line y of the reference plane.
            ref_line = tl.where(has_key, line1, line1 - ((line1 // height) % image_planes) * height)
            g2 = tl.maximum(tl.load(gid_ptr + ref_slot * n_lines + ref_line, mask=needs, other=0).to(tl.int64), 0)
            e2 = entry_ptr + (ref_slot * n_lines + g2) * 2
            off2 = tl.load(e2, mask=needs, other=0)
            packed2 = tl.load(e2 + 1, mask=needs, other=0)
            base_off = tl.where(needs, off2, off1)
            base_mode = tl.where(needs, packed2 & 3, mode1)
            base_runs = tl.where(needs, (packed2 >> 2) & 255, runs1)
            plane = l // height
            y = l % height
            q = plane % image_planes
            byte_plane = plane // image_planes
            out_row = out_ptr + b * row_bytes
            for x0 in range(0, width, X_BLOCK):
                x = x0 + xs
                xmask = x < width
                vals, wrong = _expand_line(arena_ptr, base_off, base_mode, base_runs, x, xmask, width, arena_size, RUN_BLOCK)
                bad = bad | wrong
                if resid1 != 0:
                    res, rwrong = _expand_line(arena_ptr, off1, mode1, runs1, x, xmask, width, arena_size, RUN_BLOCK)
                    vals = (vals + res) & 255
                    bad = bad | rwrong
                addr = ((q * height + y) * width + x) * itemsize + byte_plane
                tl.store(out_row + addr, vals.to(tl.uint8), mask=xmask)
    tl.store(runs_bad_ptr + b * n_chunks + chunk, bad)


#: What the launcher compiles (the AOT compile check reads this): the line table with and
#: without reference rows and verification, and the decode.
SPECIALIZATIONS = [
    {
        "kernel": "_line_table_kernel",
        "label": f"refs={has_refs},verify={verify}",
        "signature": {"arena_ptr": "*u8", "offsets_ptr": "*i64", "lengths_ptr": "*i32", "checksums_ptr": "*i32",
                      "refs_ptr": "*i32", "tab_ptr": "*i64", "gid_ptr": "*i32", "entry_ptr": "*i64",
                      "status_ptr": "*i32", "arena_size": "i64", "batch": "i32", "n_lines": "i32", "height": "i32",
                      "width": "i32", "image_planes": "i32", "mode_bytes": "i32", "raw_bytes": "i32"},
        "constexprs": {"HAS_REFS": has_refs, "VERIFY": verify, "LINE_BLOCK": DECODE_ROWS["LINE_BLOCK"],
                       "CHECK_BLOCK": DECODE_ROWS["CHECK_BLOCK"]},
        "num_warps": DECODE_ROWS["num_warps"],
    }
    for has_refs in (False, True)
    for verify in (False, True)
] + [
    {
        "kernel": "_decode_lines_kernel",
        "signature": {"arena_ptr": "*u8", "gid_ptr": "*i32", "entry_ptr": "*i64", "has_key_ptr": "*i8",
                      "out_ptr": "*u8", "runs_bad_ptr": "*i32", "arena_size": "i64", "batch": "i32",
                      "n_lines": "i32", "height": "i32", "width": "i32", "image_planes": "i32", "itemsize": "i32",
                      "row_bytes": "i32", "n_chunks": "i32"},
        "constexprs": {"LINES": DECODE_ROWS["LINES"], "X_BLOCK": DECODE_ROWS["X_BLOCK"],
                       "RUN_BLOCK": DECODE_ROWS["RUN_BLOCK"]},
        "num_warps": DECODE_ROWS["num_warps"],
    }
]


def decode_rows_triton(table, index: torch.Tensor, out: torch.Tensor, *, verify: bool = True) -> torch.Tensor:
    """Decodes rows ``index`` of ``table`` into ``out`` with two Triton launches; returns each row's status.

    Semantics are those of ``gpubuf.ops.decode_rows.decode_rows_ref``, bit for bit, except that
    nothing is raised here: this package never imports gpubuf. Each row's verdict comes back as
    status bits (0: the row is good; the bits are those of the twin's reasons) and the host
    raises the typed error. The verdict is taken after the decode, so a failed row leaves
    unspecified bytes in its output row (never an out-of-bounds access). Nothing synchronises.

    Args:
        table: a ``RowTable`` on CUDA (or CPU under ``TRITON_INTERPRET=1``); only read.
        index: int64/int32 ``[B]`` rows in range (not checked here).
        out: contiguous ``[B, *shape]`` output of the geometry's dtype, on the table's device;
            overwritten.
        verify: check the rows' checksums too (without it only structural checks report).

    Returns:
        int32 ``[B]`` status bits per row, on the table's device (all zero when every row is good).

    Raises:
        ValueError: a table, index or output on an unsupported device, or mixed devices.
    """
    g = table.geometry
    device = table.arena.device
    check_launch_device(device, "decode_rows_triton")
    for t in (table.offsets, table.lengths, table.checksums, index, out) + ((table.refs,) if table.refs is not None else ()):
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}, got one on {t.device}")
    B = index.shape[0]
    if B == 0 or g.raw_bytes == 0:
        return torch.zeros(B, dtype=torch.int32, device=device)
    L = g.lines
    rows = index.to(torch.int64).contiguous()
    n_rows = table.offsets.shape[0]
    status = torch.zeros(2 * B, dtype=torch.int32, device=device)
    if table.refs is not None:
        key = table.refs.index_select(0, rows).to(torch.int64)
        key_bad = key >= n_rows
        status[:B] = torch.where(key_bad, 1 << 5, 0).to(torch.int32)
        key = torch.where(key_bad, -1, key)
        has_key = (key >= 0).to(torch.int8)
        tab = torch.cat([rows, key])
    else:
        has_key = torch.zeros(B, dtype=torch.int8, device=device)
        tab = torch.cat([rows, torch.full_like(rows, -1)])
    gid = torch.empty(2 * B, L, dtype=torch.int32, device=device)
    entry = torch.zeros(2 * B, L, 2, dtype=torch.int64, device=device)
    cfg = DECODE_ROWS
    refs = table.refs if table.refs is not None else table.lengths
    n_chunks = cdiv(L, cfg["LINES"])
    runs_bad = torch.zeros(B, n_chunks, dtype=torch.int32, device=device)
    out_bytes = out.view(torch.uint8).view(B, -1)
    guard = device_guard(device)
    with guard:
        launch(
            _line_table_kernel, (2 * B,),
            table.arena, table.offsets, table.lengths, table.checksums, refs, tab, gid, entry, status,
            table.arena.numel(), B, L, g.height, g.width, g.image_planes, g.mode_bytes, g.raw_bytes,
            HAS_REFS=table.refs is not None, VERIFY=verify,
            LINE_BLOCK=cfg["LINE_BLOCK"], CHECK_BLOCK=cfg["CHECK_BLOCK"], num_warps=cfg["num_warps"],
        )
        launch(
            _decode_lines_kernel, (B, n_chunks),
            table.arena, gid, entry, has_key, out_bytes, runs_bad,
            table.arena.numel(), B, L, g.height, g.width, g.image_planes, g.itemsize, g.raw_bytes, n_chunks,
            LINES=cfg["LINES"], X_BLOCK=cfg["X_BLOCK"], RUN_BLOCK=cfg["RUN_BLOCK"], num_warps=cfg["num_warps"],
        )
    return status[:B] | torch.where(has_key.bool(), status[B:], 0) | torch.where(runs_bad.any(1), 16, 0).to(torch.int32)
