"""Row decode: gather rows of a compressed store and decode them, one fused op.

Rows are stored in the format of :mod:`gpubuf.codec.format` (line run-length coding with one
level of references) in one flat ``uint8`` arena, described by a row table. The twin below is
the specification and the CPU path without Numba; CPU tensors otherwise run the compiled
kernel ``gpubuf_kernels.cpu.codec`` (each row decoded line by line into the output). On CUDA
tensors the op runs as two Triton launches (``gpubuf_kernels.codec``): one program per sampled
row builds its line table and verifies it, then programs over (row, block of lines) write the
decoded bytes straight into the output.
"""

from __future__ import annotations

import numpy as np
import torch

from gpubuf.codec.checksum import adler32_ranges, adler32_ranges_host, as_uint32
from gpubuf.codec.errors import CorruptRowError
from gpubuf.codec.format import MODE_RAW, MODE_REF, MODE_RUNS, MODE_UP, RESIDUAL_BIT, RUN_BLOCK, RowGeometry
from gpubuf.errors import DeviceMismatchError, IndexOutOfRangeError
from gpubuf.ops._dispatch import implementation, kernel_module, resolve
from gpubuf.ops.host_memory import empty_host

__all__ = ["decode_rows", "decode_rows_ref", "RowTable", "empty_output"]

# Reasons a row fails verification: bits of the per-row status word (kernel and twin alike).
BAD_BOUNDS = 1  # offset or length outside the arena
BAD_LENGTH = 2  # the header implies another length than the stored one
BAD_CHECKSUM = 4
BAD_MODE = 8  # UP on a plane's first line, REF or residual without a reference plane
BAD_RUNS = 16  # run starts of a line not strictly increasing inside it
BAD_REFERENCE = 32  # reference row out of range, or one that has a reference itself

_REASONS = {
    BAD_BOUNDS: "offset/length outside the arena",
    BAD_LENGTH: "length differs from what the header describes (truncated or corrupt)",
    BAD_CHECKSUM: "checksum mismatch",
    BAD_MODE: "impossible line mode",
    BAD_RUNS: "run starts out of order or past the line",
    BAD_REFERENCE: "bad reference row",
}


class RowTable:
    """The row table and arena of a compressed store: what :func:`decode_rows` reads.

    Attributes:
        arena: ``uint8 [A]``, the rows' bytes.
        offsets: int64 ``[R]``, start of each row in ``arena``.
        lengths: int32 ``[R]``, stored length of each row.
        checksums: int32 ``[R]``, Adler-32 bit patterns (see :mod:`gpubuf.codec.format`).
        refs: int32 ``[R]`` reference row of each row (-1 for none), or None when no row has one.
        geometry: the rows' :class:`~gpubuf.codec.format.RowGeometry`.

    All tensors live on one device. Only read by the decode.
    """

    __slots__ = ("arena", "offsets", "lengths", "checksums", "refs", "geometry")

    def __init__(self, arena, offsets, lengths, checksums, refs, geometry: RowGeometry) -> None:
        self.arena = arena
        self.offsets = offsets
        self.lengths = lengths
        self.checksums = checksums
        self.refs = refs
        self.geometry = geometry

    @property
    def device(self) -> torch.device:
        return self.arena.device


def empty_output(n: int, geometry: RowGeometry, device: torch.device) -> torch.Tensor:
    """A new ``[n, *shape]`` tensor of the geometry's dtype for decoded rows.

    On the CPU its memory comes from :func:`~gpubuf.ops.host_memory.empty_host`: page faults on
    a fresh output would cost more than decoding it. The result is an ordinary torch tensor
    owning its memory.
    """
    shape = (n, *geometry.shape)
    if device.type != "cpu":
        return torch.empty(shape, dtype=geometry.dtype, device=device)
    return empty_host(shape, geometry.dtype)


def _describe(bad_rows: list[int], status: list[int], what: str) -> str:
    reasons = sorted({text for code in status for bit, text in _REASONS.items() if code & bit})
    shown = ", ".join(str(r) for r in bad_rows[:8]) + (" ..." if len(bad_rows) > 8 else "")
    return f"{len(bad_rows)} compressed {what} failed verification on read (rows {shown}): " + "; ".join(reasons)


def decode_rows_ref(
    table: RowTable,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    verify: bool = True,
) -> torch.Tensor:
    """Pure-torch twin of the row decode; the op's specification.

    For every ``b``: ``out[b]`` is row ``index[b]`` of ``table`` decoded as described in
    :mod:`gpubuf.codec.format`, bit for bit the row that was encoded.

    Steps, over the *needed* rows (the distinct sampled rows and their reference rows):

    1. check that ``[offset, offset + length)`` lies inside the arena, and that a reference row
       is in range, has no reference itself and holds no ``REF`` or residual line;
    2. read the line modes (a raw row has every line ``RAW``) and the count bytes, and derive
       each line's payload offset; the total the header implies must equal the stored length;
    3. check that each mode is allowed where it appears (``UP`` never on a plane's first line,
       ``REF`` and residuals only in planes with a reference plane); with ``verify``, check the
       Adler-32 checksum of the row's bytes and reference number;
    4. expand every ``RAW`` and ``RUNS`` line once (the *pool*), checking that each line's run
       starts are strictly increasing and inside the line;
    5. resolve every line: follow ``UP`` to the nearest line above that is not ``UP``; if that
       line is ``REF`` or a residual, take line ``y`` of the reference plane, resolved the same
       way, as the base. Output line = base (+ residual, mod 256).

    Args:
        table: the store (see :class:`RowTable`); only read.
        index: int64/int32 ``[B]`` row numbers in ``[0, R)``, on the table's device. Duplicates
            and any order are allowed.
        out: optional ``[B, *shape]`` tensor of the geometry's dtype, contiguous, on the same
            device; overwritten and returned.
        verify: check checksums. The structural checks (steps 1-4) always run, since they keep
            every read inside the arena; ``verify=False`` skips only the checksum, so a corrupt
            row that still parses would decode to wrong bytes.

    Returns:
        ``[B, *shape]`` of the geometry's dtype (``out`` when given). When a row fails, nothing
        is written to ``out``.

    Raises:
        CorruptRowError: a needed row failed a check; ``err.rows`` lists the positions ``b`` in
            ``index`` whose row (or reference row) failed.
    """
    g = table.geometry
    device = table.device
    B = index.shape[0]
    if out is None:
        out = empty_output(B, g, device)
    if B == 0 or g.raw_bytes == 0:
        return out
    P0, H, W, L, MB = g.image_planes, g.height, g.width, g.lines, g.mode_bytes
    arena = table.arena
    arena_size = arena.numel()
    last = max(arena_size - 1, 0)
    i64 = torch.int64
    rows = index.to(i64)
    n_rows = table.offsets.shape[0]

    # 1. Needed rows (distinct), which of them serve as reference rows.
    if table.refs is not None:
        key = table.refs.index_select(0, rows).to(i64)
        key_bad = key >= n_rows
        has_key = (key >= 0) & ~key_bad
        keyed = has_key.nonzero().squeeze(1)
        tab, inv = torch.unique(torch.cat([rows, key.index_select(0, keyed)]), return_inverse=True)
        row_slot = inv[:B]
        key_slot = torch.zeros(B, dtype=i64, device=device)
        key_slot[keyed] = inv[B:]
        own_ref = table.refs.index_select(0, tab).to(i64)
        as_key = torch.zeros(tab.shape[0], dtype=torch.bool, device=device)
        as_key[inv[B:]] = True
    else:
        key_bad = torch.zeros(B, dtype=torch.bool, device=device)
        has_key = key_bad
        tab, row_slot = torch.unique(rows, return_inverse=True)
        key_slot = row_slot
        own_ref = torch.full(tab.shape, -1, dtype=i64, device=device)
        as_key = torch.zeros(tab.shape[0], dtype=torch.bool, device=device)
    T = tab.shape[0]
    status = torch.zeros(T, dtype=torch.int32, device=device)
    _flag(status, as_key & (own_ref != -1), BAD_REFERENCE)
    off = table.offsets.index_select(0, tab)
    nb = table.lengths.index_select(0, tab).to(i64)
    oob = (off < 0) | (nb < 0) | (off + nb > arena_size)
    _flag(status, oob, BAD_BOUNDS)
    # A row outside the arena is parsed as an empty row at 0, so that nothing below reads out of
    # bounds; it is reported, never decoded.
    off = off.masked_fill(oob, 0)
    nb = nb.masked_fill(oob, 0)
    is_raw = nb == g.raw_bytes

    # 2. Line modes (dense, [T, L]).
    ar_l = torch.arange(L, device=device)
    if arena_size:
        hdr = arena.index_select(0, (off[:, None] + torch.arange(MB, device=device)).clamp_(max=last).view(-1))
    else:
        hdr = torch.zeros(T * MB, dtype=torch.uint8, device=device)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=device)
    modes = ((hdr.view(T, MB, 1) >> shifts) & 3).view(T, MB * 4)[:, :L]
    modes = modes.masked_fill(is_raw[:, None], MODE_RAW)

    # Coded lines (RAW or RUNS), sparse, in (row, line) order.
    coded = (modes >= MODE_RAW).view(-1)
    cl = coded.nonzero().squeeze(1)
    crow = cl // L
    cmode = modes.view(-1).index_select(0, cl)
    c_runs = cmode == MODE_RUNS
    n_runs_lines = torch.zeros(T, dtype=i64, device=device).index_add_(0, crow, c_runs.to(i64))
    runs_before_row = torch.cumsum(n_runs_lines, 0) - n_runs_lines
    rank = torch.cumsum(c_runs.to(i64), 0) - 1 - runs_before_row.index_select(0, crow)
    row_off = off.index_select(0, crow)
    count_at = (row_off + MB + rank).clamp_(0, last)
    counts = arena.index_select(0, count_at).to(i64) if arena_size else torch.zeros_like(cl)
    runs = torch.where(c_runs, (counts & 127) + 1, 0)
    resid = c_runs & (counts >= RESIDUAL_BIT)
    size = torch.where(c_runs, 2 * runs - 1, W)
    end = torch.cumsum(size, 0)
    size_before_row = torch.zeros(T, dtype=i64, device=device).index_add_(0, crow, size)
    row_bytes = size_before_row
    size_before_row = torch.cumsum(size_before_row, 0) - size_before_row
    c_raw_row = is_raw.index_select(0, crow)
    line_off = torch.where(
        c_raw_row,
        row_off + (cl % L) * W,
        row_off + MB + n_runs_lines.index_select(0, crow) + end - size - size_before_row.index_select(0, crow),
    )
    _flag(status, ~is_raw & (MB + n_runs_lines + row_bytes != nb), BAD_LENGTH)

    # 3. Where each mode may appear.
    resid_dense = torch.zeros(T * L, dtype=torch.bool, device=device)
    resid_dense[cl] = resid
    resid_dense = resid_dense.view(T, L)
    plane_has_ref = ((own_ref >= 0) & ~as_key)[:, None] | (((ar_l // H) % P0 > 0)[None, :] & ~as_key[:, None])
    wrong = ((modes == MODE_UP) & (ar_l % H == 0)) | (((modes == MODE_REF) | resid_dense) & ~plane_has_ref)
    _flag(status, wrong.any(1), BAD_MODE)
    if verify:
        check_len = nb.masked_fill(status != 0, 0)
        ref32 = own_ref.to(torch.int32)
        if device.type == "cpu":
            check = adler32_ranges_host(arena, off, check_len, ref32)
        else:
            check = adler32_ranges(arena, off, check_len, ref32)
        stored = as_uint32(table.checksums.index_select(0, tab))
        _flag(status, (status == 0) & (check != stored), BAD_CHECKSUM)

    # 4. The pool: every coded line expanded once. Runs are expanded without a per-byte index:
    # the value change at each run start is written into zeros, and a running sum (mod 256)
    # along the pool spreads it over the run.
    C = cl.shape[0]
    pool = torch.zeros(C * W, dtype=torch.uint8, device=device)
    raw_sel = (~c_runs).nonzero().squeeze(1)
    if raw_sel.numel():
        src_idx = (line_off.index_select(0, raw_sel)[:, None] + torch.arange(W, device=device)).clamp_(max=last)
        raw_bytes = arena.index_select(0, src_idx.view(-1)).view(-1, W)
    runs_sel = c_runs.nonzero().squeeze(1)
    if runs_sel.numel():
        n = runs.index_select(0, runs_sel)
        total = int(n.sum())
        # Per-run positions are int32 when every index fits (half the memory traffic of int64).
        small = arena_size < 2**31 and C * W < 2**31 and total < 2**31
        idx = torch.int32 if small else i64
        first = torch.cumsum(n, 0) - n
        line_of_run = torch.repeat_interleave(
            torch.arange(n.numel(), device=device, dtype=idx), n.to(idx), output_size=total
        )
        ramp = torch.arange(total, device=device, dtype=idx)
        at0 = line_off.index_select(0, runs_sel) - first  # arena position of start byte k is at0 + k - 1
        value_at = (at0 + n - 1).to(idx).index_select(0, line_of_run) + ramp
        start_at = (at0 - 1).to(idx).index_select(0, line_of_run) + ramp
        later = ramp != first.to(idx).index_select(0, line_of_run)  # runs 1..n-1 of each line
        values = arena.index_select(0, value_at.clamp_(max=last))
        low = arena.index_select(0, start_at.clamp_(0, last)).to(idx).mul_(later)
        if W > RUN_BLOCK:
            # Start = 256 * (zero low bytes among runs 1..k of the line) + low byte.
            zeros_seen = torch.cumsum((low == 0) & later, 0, dtype=idx)
            start = (zeros_seen - zeros_seen.index_select(0, first.to(idx).index_select(0, line_of_run))) * 256 + low
        else:
            start = low  # a zero low byte past run 0 is invalid here: caught as not increasing
        bad_run = (start >= W) | (later & (start == 0))
        bad_run[1:] |= later[1:] & (start[1:] <= start[:-1])
        if bool(bad_run.any()):
            bad_t = crow.index_select(0, runs_sel.index_select(0, line_of_run[bad_run].to(i64)))
            status[bad_t] |= BAD_RUNS
        else:
            # The value change at each run start, spread along the pool by a running sum mod 256.
            step = values.clone()
            step[1:] -= values[:-1]
            pos = (runs_sel * W).to(idx).index_select(0, line_of_run) + start
            pool.index_put_((pos,), step)
            pool = torch.cumsum(pool, 0, dtype=torch.uint8)
    pool = pool.view(C, W)
    if raw_sel.numel():
        pool.index_copy_(0, raw_sel, raw_bytes)

    # Verdict: a sampled row fails when its row or its reference row failed. Nothing has been
    # written to ``out`` before this point.
    row_status = status.index_select(0, row_slot) | torch.where(has_key, status.index_select(0, key_slot), 0)
    _flag(row_status, key_bad, BAD_REFERENCE)
    if bool((row_status != 0).any()):
        bad = (row_status != 0).nonzero().squeeze(1)
        raise CorruptRowError(
            _describe(bad.tolist(), row_status.index_select(0, bad).tolist(), "row(s)"), rows=bad.tolist()
        )

    # 5. Resolve lines to pool ids, for every needed row, then gather the sampled rows' lines.
    pid = torch.full((T * L,), -1, dtype=i64, device=device)
    pid[cl] = torch.arange(C, device=device)
    src = torch.cummax(torch.where(modes != MODE_UP, ar_l, -1), 1).values.clamp_(min=0)
    src_flat = (torch.arange(T, device=device)[:, None] * L + src).view(-1)
    own = pid.index_select(0, src_flat).view(T, L)  # pool id of the resolved line, -1 for REF
    keyed_t = own_ref >= 0
    ref_row = torch.where(keyed_t, _slot_of(tab, own_ref), torch.arange(T, device=device))

    def base_of(rows: torch.Tensor, lines: torch.Tensor) -> torch.Tensor:
        """Pool id of line ``y`` of the reference plane of ``lines`` (flat ``[k]``) of table ``rows``."""
        ref_line = torch.where(keyed_t.index_select(0, rows), lines, lines - ((lines // H) % P0) * H)
        r = ref_row.index_select(0, rows)
        return pid.index_select(0, r * L + src.view(-1).index_select(0, r * L + ref_line))

    # Residual lines become decoded lines in place (base + residual): reference planes hold no
    # residual, so the order does not matter, and output lines then need a single gather.
    res_c = resid.nonzero().squeeze(1)
    if res_c.numel():
        bases = base_of(crow.index_select(0, res_c), cl.index_select(0, res_c) % L)
        pool.index_copy_(0, res_c, pool.index_select(0, res_c) + pool.index_select(0, bases))
    ref_lines = (own < 0).view(-1).nonzero().squeeze(1)
    base = own.view(-1).clone()
    if ref_lines.numel():
        base[ref_lines] = base_of(ref_lines // L, src.view(-1).index_select(0, ref_lines))

    flat = out.view(torch.uint8) if g.itemsize == 1 else torch.empty(B, g.planes, H, W, dtype=torch.uint8, device=device)
    flat = flat.view(B * L, W)
    lines_of_rows = base.to(torch.int32).view(T, L).index_select(0, row_slot).view(-1)
    torch.index_select(pool, 0, lines_of_rows, out=flat)
    if g.itemsize != 1:
        s_ = g.itemsize
        out.view(torch.uint8).view(B, P0, H, W, s_).copy_(flat.view(B, s_, P0, H, W).permute(0, 2, 3, 4, 1))
    return out


def _flag(status: torch.Tensor, cond: torch.Tensor, bit: int) -> None:
    """ORs ``bit`` into ``status`` where ``cond`` (several failures of one row add up)."""
    status.bitwise_or_(cond.to(torch.int32) * bit)


def _slot_of(tab: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Position in the sorted distinct rows ``tab`` of each of ``rows`` (0 where absent or negative)."""
    pos = torch.searchsorted(tab, rows.clamp_min(0))
    return pos.clamp_(max=max(tab.shape[0] - 1, 0))


def _check_args(table: RowTable, index: torch.Tensor, out: torch.Tensor | None) -> None:
    if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.dtype not in (torch.int64, torch.int32):
        raise TypeError("index must be a 1-D int64 or int32 tensor")
    device = table.device
    for name in ("offsets", "lengths", "checksums", "refs"):
        t = getattr(table, name)
        if t is not None and t.device != device:
            raise DeviceMismatchError(f"table.{name} is on {t.device}, expected the arena's device {device}")
    if index.device != device:
        raise DeviceMismatchError(f"index is on {index.device}, expected the table's device {device}")
    if out is not None:
        expected = (index.shape[0], *table.geometry.shape)
        if tuple(out.shape) != expected or out.dtype != table.geometry.dtype or out.device != device:
            raise ValueError(
                f"out must be a {table.geometry.dtype} tensor of shape {list(expected)} on {device}, got "
                f"{out.dtype} {list(out.shape)} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")


def decode_rows(
    table: RowTable,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    verify: bool = True,
    backend: str = "auto",
    check_bounds: bool = True,
) -> torch.Tensor:
    """Decodes rows ``index`` of ``table``; see :func:`decode_rows_ref` for the specification.

    CUDA tensors go to the Triton kernels (two launches: line tables and verification, then
    decode into ``out``), CPU tensors to the compiled CPU kernel (Numba) or, without it, the
    torch twin. All give the twin's output, errors and messages.

    Args:
        table, index, out, verify: as in :func:`decode_rows_ref`.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.
        check_bounds: raise :class:`~gpubuf.errors.IndexOutOfRangeError` for an index outside
            ``[0, R)`` first (synchronises on CUDA).

    Raises:
        TypeError, ValueError, DeviceMismatchError: malformed arguments.
        IndexOutOfRangeError: an index outside ``[0, R)`` with ``check_bounds``.
        CorruptRowError: a needed row failed verification (see :func:`decode_rows_ref`).
    """
    _check_args(table, index, out)
    n_rows = table.offsets.shape[0]
    if check_bounds and index.numel():
        lo, hi = torch.aminmax(index)
        if int(lo) < 0 or int(hi) >= n_rows:
            bad = int(lo) if int(lo) < 0 else int(hi)
            raise IndexOutOfRangeError(f"row index {bad} is out of range for {n_rows} stored rows")
    which = resolve("decode_rows", table.arena, backend)
    if which == "triton":
        return _decode_triton(table, index, out, verify)
    if which == "numba":
        return _decode_numba(table, index, out, verify)
    return decode_rows_ref(table, index, out, verify=verify)


def _decode_triton(table: RowTable, index: torch.Tensor, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
    """The Triton decode; with ``verify``, reads the rows' status back (one synchronisation) and
    raises the twin's error for failed rows. Without it nothing synchronises and a failed row
    leaves unspecified bytes in its output row."""
    if out is None:
        out = empty_output(index.shape[0], table.geometry, table.arena.device)
    status = implementation("decode_rows", "triton")(table, index, out, verify=verify)
    if verify and status.numel():
        failed = status != 0
        if bool(failed.any()):
            bad = failed.nonzero().squeeze(1)
            raise CorruptRowError(_describe(bad.tolist(), status.index_select(0, bad).tolist(), "row(s)"), rows=bad.tolist())
    return out


# -------------------------------------------------------------------- compiled CPU kernel
_NO_REFS = np.zeros(0, dtype=np.int32)


def _decode_numba(table: RowTable, index: torch.Tensor, out: torch.Tensor | None, verify: bool) -> torch.Tensor:
    """The compiled CPU decode: :func:`decode_rows_ref`'s output and errors, one kernel call.

    The kernel verifies every needed row before it writes anything and returns per-position
    status bits; the error is raised here, with the twin's message. An index outside the table
    (possible with ``check_bounds=False``) never reaches the kernel's reads: the twin then runs
    and fails as it does.
    """
    g = table.geometry
    n = index.shape[0]
    if out is None:
        out = empty_output(n, g, table.device)
    if n == 0 or g.raw_bytes == 0:
        return out
    n_rows = table.offsets.shape[0]
    refs = table.refs
    if table.lengths.shape[0] != n_rows or table.checksums.shape[0] != n_rows or (refs is not None and refs.shape[0] != n_rows):
        return decode_rows_ref(table, index, out, verify=verify)  # a malformed table: the twin's error
    kernels = kernel_module("cpu.codec")
    status = np.zeros(n, dtype=np.int32)
    code = kernels.decode_rows(
        table.arena.detach().contiguous().numpy(),
        table.offsets.detach().contiguous().numpy(),
        table.lengths.detach().contiguous().numpy(),
        table.checksums.detach().contiguous().numpy(),
        _NO_REFS if refs is None else refs.detach().contiguous().numpy(),
        refs is not None,
        index.detach().to(torch.int64).contiguous().numpy(),
        out.view(torch.uint8).view(-1).numpy(),
        g.image_planes, g.height, g.width, g.itemsize, bool(verify), status,
    )
    if code == kernels.BAD_INDEX:
        return decode_rows_ref(table, index, out, verify=verify)
    if code == kernels.CORRUPT:
        bad = np.nonzero(status)[0].tolist()
        raise CorruptRowError(_describe(bad, status[bad].tolist(), "row(s)"), rows=bad)
    return out
