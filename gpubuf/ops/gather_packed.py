"""Packed gather: copy B variable-length rows out of a packed (values + offsets) store.

A packed store keeps the rows of a ragged field end to end in one ``values`` tensor of shape
``[M, *trail]`` (M tokens) and describes row ``r`` by ``starts[r]`` and ``lengths[r]``. Sampling
B rows of such a field is this op: it writes the rows one after another into an output of
``T = sum(lengths[index])`` tokens and returns the output's offsets, which is exactly the
``(values, offsets)`` pair a jagged nested tensor is made of. Several fields that share their
row lengths (``input_ids`` and ``attention_mask``) share ``starts``/``lengths`` and are gathered
by one call: one Triton launch on CUDA; on CPU one compiled loop per field (Numba,
``gpubuf_kernels.cpu.gather_packed``) or, without it, one shared plan of block copies.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from gpubuf.errors import IndexOutOfRangeError, SchemaMismatchError
from gpubuf.ops import _checks
from gpubuf.ops._dispatch import device_path, implementation, kernel_module, numba_enabled, resolve

__all__ = ["gather_packed", "gather_packed_ref", "gather_packed_trusted", "packed_offsets"]

def packed_offsets(lengths: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The output offsets of a packed gather: ``[0, cumsum(lengths[index])]``.

    Args:
        lengths: 1-D int64 ``[N]`` row lengths.
        index: 1-D int64/int32 ``[B]`` rows.

    Returns:
        int64 ``[B + 1]`` on ``lengths``' device; ``offsets[b]`` is where output row ``b`` starts.
    """
    offsets = torch.zeros(index.shape[0] + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.index_select(0, index), 0, out=offsets[1:])
    return offsets


def gather_packed_ref(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    total: int | None = None,
    min_length: int | None = None,
    outs: Sequence[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Pure-torch twin of the packed gather; the op's specification.

    For every source ``i`` and output row ``b``, with ``r = index[b]``::

        outs[i][offsets[b] : offsets[b + 1]] = values[i][starts[r] : starts[r] + lengths[r]]
        offsets = [0, cumsum(lengths[index])]

    Rows are copied in order, back to back; duplicates in ``index`` give independent copies.
    The path is vectorised, never a Python loop over rows: when every selected row is long,
    rows are copied as blocks of consecutive tokens (:func:`_gather_blocks`), else through a
    per-token index.

    Args:
        values: tensors of shape ``[M, *trail_i]`` (any dtype, any trailing shape, possibly
            different per source), all with the same ``M`` and on one device. Only read.
        starts: 1-D int64 ``[N]``, first token of each row in ``values``.
        lengths: 1-D int64 ``[N]``, tokens of each row (0 allowed). Every row must satisfy
            ``0 <= starts[r]`` and ``starts[r] + lengths[r] <= M`` for the rows ``index`` names.
        index: 1-D int64 or int32 ``[B]`` rows in ``[0, N)``, any order, duplicates allowed.
        offsets: the output offsets if the caller computed them already
            (:func:`packed_offsets`), else computed here.
        total: ``T = offsets[-1]`` if the caller knows it; saves a device synchronisation.
        min_length: the shortest selected row if the caller knows it (picks the block size).
        outs: optional outputs of shape ``[>= T, *trail_i]`` with the sources' dtypes on the same
            device, contiguous; rows ``[0, T)`` are overwritten and the tensors returned as given.

    Returns:
        ``(outs, offsets)``: one contiguous tensor of shape ``[T, *trail_i]`` per source (the
        given ``outs`` when passed) and the int64 ``[B + 1]`` offsets, on the sources' device.
    """
    device = values[0].device
    if offsets is None:
        offsets = packed_offsets(lengths, index)
    if total is None:
        total = int(offsets[-1])
    if total == 0:
        if outs is None:
            outs = [torch.empty((0, *v.shape[1:]), dtype=v.dtype, device=device) for v in values]
        return list(outs), offsets
    if outs is None:
        if min_length is None:
            min_length = int(lengths.index_select(0, index).min())
        block = _block_size(min_length, values[0].shape[0])
        if block:
            return _gather_blocks(values, starts, lengths, index, offsets, total, block), offsets
        outs = [torch.empty((total, *v.shape[1:]), dtype=v.dtype, device=device) for v in values]
    src = _token_index(starts, lengths, index, offsets, total)
    for v, out in zip(values, outs):
        torch.index_select(v, 0, src, out=out[:total])
    return list(outs), offsets


# Tokens per block of the block copy: 64 int64 tokens are a 512-byte memcpy.
_MAX_BLOCK = 64
_MIN_BLOCK = 8


def _block_size(min_length: int, m: int) -> int:
    """Tokens per block for :func:`_gather_blocks`, or 0 when some row is too short for it."""
    if min_length < _MIN_BLOCK:
        return 0
    block = _MIN_BLOCK
    while block * 2 <= min(min_length, _MAX_BLOCK):
        block *= 2
    return block if m >= block else 0


def _gather_blocks(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    offsets: torch.Tensor,
    total: int,
    block: int,
) -> list[torch.Tensor]:
    """The packed gather as copies of ``block`` consecutive tokens; every selected row has at least ``block``.

    The output is cut into blocks of ``block`` tokens and every block is read from the row that
    holds its first token, as one row of a sliding-window view of the values (``as_strided``
    with a stride of one token): one ``index_select`` per source moves nearly everything. A
    block that a row boundary cuts reads on past the end of its row. Rows have at least
    ``block`` tokens, so the tokens it got wrong are all covered by the first ``block`` tokens
    of the next row (and, where a read had to be moved back from the values' end, by the last
    ``block`` tokens of its own row): one more ``index_select`` of those blocks and one
    ``index_copy_`` into a sliding-window view of the output put them right. Whole blocks
    rather than single tokens keep both the plan and the copies at one entry per cut.
    """
    m = values[0].shape[0]
    device = values[0].device
    src, fix_dst, fix_src = (
        torch.from_numpy(a) if device.type == "cpu" else torch.from_numpy(a).to(device)
        for a in _block_plan(starts, index, offsets, total, block, m)
    )
    n_blocks = src.shape[0]
    outs = []
    for v in values:
        if not v.is_contiguous():
            v = v.contiguous()
        trail = v.shape[1:]
        width = math.prod(trail)
        # Window rows overlap (a stride of one token), which reading allows.
        window = v.as_strided((m - block + 1, block * width), (width, 1))
        blocks = window.index_select(0, src)
        if fix_dst.shape[0]:
            # Fix blocks may overlap one another, but only where they carry the same tokens,
            # so the order of the writes does not matter.
            out_window = blocks.as_strided((n_blocks * block - block + 1, block * width), (width, 1))
            out_window.index_copy_(0, fix_dst, window.index_select(0, fix_src))
        outs.append(blocks.view(n_blocks * block, *trail)[:total])
    return outs


def _block_plan(
    starts: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor, total: int, block: int, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where each block reads (``src``), and the fix-up blocks: output (``fix_dst``) and source (``fix_src``) tokens.

    Index arithmetic over B rows and T / block blocks, done in NumPy on the host: at these sizes
    a torch op's dispatch costs more than its work, and every NumPy call counts too.

    Fix-up blocks: for every row ``b`` whose end ``e`` falls inside a block, the next row's first
    ``block`` tokens (output ``[e, e + block)``); and, when the cut block's read had to be moved
    back to stay inside the values, row ``b``'s last ``block`` tokens (output ``[e - block, e)``).
    Both lie inside one row (rows have at least ``block`` tokens) and so are read correctly.
    """
    off = offsets.cpu().numpy()
    if starts.device.type == "cpu":
        row_starts = starts.numpy()[index.numpy()]
    else:
        row_starts = starts.index_select(0, index).cpu().numpy()
    ends = off[1:]
    n_rows = ends.shape[0]
    log_block = block.bit_length() - 1  # block is a power of two
    # shift[b]: source position minus output position, the same for every token of row b.
    shift = row_starts - off[:-1]
    # The row holding each block's first token: blocks starting in row b are those from
    # ceil(off[b] / block) to ceil(ends[b] / block), so a repeat builds it without a search.
    first_block = (off + (block - 1)) >> log_block
    row = np.repeat(np.arange(n_rows, dtype=np.int64), first_block[1:] - first_block[:-1])
    src = shift[row]
    src += np.arange(0, src.shape[0] << log_block, block, dtype=np.int64)
    left = np.nonzero(ends & (block - 1))[0]  # rows whose end falls inside a block
    # Every such row but the last has a next row, whose head repairs the cut block.
    head = left[:-1] if left.shape[0] and left[-1] == n_rows - 1 else left
    fix_dst = ends[head]
    fix_src = row_starts[head + 1]
    if src.max(initial=0) > m - block:
        # A block that would run past the values' end is read from earlier; the rows whose cut
        # block was moved then rewrite their last block from inside the row.
        over = src > m - block
        np.minimum(src, m - block, out=src)
        moved = left[over[ends[left] >> log_block]]
        tail_end = ends[moved]
        fix_dst = np.concatenate([fix_dst, tail_end - block])
        fix_src = np.concatenate([fix_src, shift[moved] + tail_end - block])
    return src, fix_dst, fix_src


def _token_index(
    starts: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor, offsets: torch.Tensor, total: int
) -> torch.Tensor:
    """``src[t] = starts[r_b] + (t - offsets[b])`` for every token ``t`` of output row ``b``.

    Built as a running sum of steps: 1 inside a row, and at the first token of a row the jump
    from the last token of the previous non-empty row. One ``cumsum`` over T tokens is cheaper
    than ``arange + repeat_interleave`` (two passes and a T-long temporary more).
    """
    s = starts.index_select(0, index)
    n = lengths.index_select(0, index)
    first = offsets[:-1]
    if not bool((n > 0).all()):
        # Empty rows would put two jumps on one token; they contribute nothing, drop them.
        keep = n > 0
        s, n, first = s[keep], n[keep], first[keep]
    # int64 throughout: torch's CPU cumsum is several times faster on int64 than on int32, and
    # index_select reads either at the same speed.
    steps = torch.ones(total, dtype=torch.int64, device=starts.device)
    steps[0] = s[0]
    if s.shape[0] > 1:
        steps[first[1:]] = s[1:] - (s[:-1] + n[:-1] - 1)
    return steps.cumsum_(0)


def _check(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    outs: Sequence[torch.Tensor] | None,
) -> None:
    if not values:
        raise ValueError("gather_packed needs at least one values tensor")
    if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.dtype not in _checks.INDEX_DTYPES:
        raise TypeError("index must be a 1-D int64 or int32 tensor")
    for name, t in (("starts", starts), ("lengths", lengths)):
        if not isinstance(t, torch.Tensor) or t.ndim != 1 or t.dtype != torch.int64:
            raise TypeError(f"{name} must be a 1-D int64 tensor")
    if starts.shape != lengths.shape:
        raise SchemaMismatchError(f"starts has shape {list(starts.shape)} but lengths {list(lengths.shape)}")
    device = _checks.check_sources(values, "values", "M", "tokens")
    _checks.check_devices((("starts", starts), ("lengths", lengths), ("index", index)), device, "values")
    if outs is not None:
        _checks.check_out_count(outs, values, "values tensors")
        for i, (v, out) in enumerate(zip(values, outs)):
            _checks.check_out_like(i, out, v, device)
            if out.shape[1:] != v.shape[1:] or not out.is_contiguous():
                raise SchemaMismatchError(
                    f"out #{i} must be contiguous of shape [T, {', '.join(map(str, v.shape[1:]))}], "
                    f"got {list(out.shape)}"
                )


def _check_bounds(values: Sequence[torch.Tensor], starts: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor) -> None:
    if index.numel() == 0:
        return
    _checks.check_index_range(index, starts.shape[0])
    s = starts.index_select(0, index)
    e = s + lengths.index_select(0, index)
    m = values[0].shape[0]
    if bool(((s < 0) | (e > m) | (e < s)).any()):
        raise IndexOutOfRangeError(f"a selected row reaches outside the {m} tokens of the values tensors")


def gather_packed(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    *,
    outs: Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
    check_bounds: bool = True,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gathers rows ``index`` of packed fields; see :func:`gather_packed_ref` for the specification.

    CUDA tensors go to one Triton launch for all ``values``, CPU tensors to the compiled CPU
    loop (Numba) or, without it, the torch twin.

    Args:
        values, starts, lengths, index, outs: as in :func:`gather_packed_ref`.
        backend: ``"auto"`` (by device), ``"torch"``, ``"triton"`` or ``"numba"``.
        check_bounds: verify the rows and their token ranges first and raise
            :class:`~gpubuf.errors.IndexOutOfRangeError` otherwise (synchronises on CUDA).

    Returns:
        ``(outs, offsets)`` as in :func:`gather_packed_ref`.

    Raises:
        TypeError, ValueError, SchemaMismatchError, DTypeMismatchError, DeviceMismatchError:
            malformed arguments, before anything is written.
        IndexOutOfRangeError: a row outside ``[0, N)`` or a token range outside ``[0, M)``.
        BackendUnavailableError: ``backend="triton"`` where Triton cannot run.
    """
    _check(values, starts, lengths, index, outs)
    which = resolve("gather_packed", values[0], backend)
    if check_bounds:
        _check_bounds(values, starts, lengths, index)
    offsets = packed_offsets(lengths, index)
    if which == "triton":
        return _triton(values, starts, lengths, index, offsets, outs)
    total = int(offsets[-1])
    if outs is not None and any(out.shape[0] < total for out in outs):
        raise SchemaMismatchError(f"outputs must hold at least {total} tokens")
    if which == "numba":
        return _numba(values, starts, index, offsets, total, outs), offsets
    return gather_packed_ref(values, starts, lengths, index, offsets=offsets, total=total, outs=outs)


def gather_packed_trusted(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    lengths: torch.Tensor,
    index: torch.Tensor,
    *,
    offsets: torch.Tensor | None = None,
    total: int | None = None,
    min_length: int | None = None,
    max_length: int | None = None,
    outs: Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The storages' entry: no argument checks, dispatch by device only.

    For callers that built every argument themselves and guarantee the contract of
    :func:`gather_packed_ref`. ``max_length`` (the longest selected row) sizes the Triton grid;
    it is computed when omitted, which synchronises once more. ``backend="triton"`` takes the
    device path (the Triton launch) whatever the device, as CUDA tensors do under ``"auto"``.
    """
    if offsets is None:
        offsets = packed_offsets(lengths, index)
    if device_path(values[0], backend):
        return _triton(values, starts, lengths, index, offsets, outs, total, max_length)
    if values[0].device.type == "cpu" and (backend == "numba" or (backend == "auto" and numba_enabled())):
        if total is None:
            total = int(offsets[-1])
        return _numba(values, starts, index, offsets, total, outs), offsets
    return gather_packed_ref(values, starts, lengths, index, offsets=offsets, total=total, min_length=min_length, outs=outs)


def _numba(
    values: Sequence[torch.Tensor],
    starts: torch.Tensor,
    index: torch.Tensor,
    offsets: torch.Tensor,
    total: int,
    outs: Sequence[torch.Tensor] | None,
) -> list[torch.Tensor]:
    """The compiled CPU gather: one call per source, each row one copy of its bytes."""
    copy_rows = kernel_module("cpu.gather_packed").copy_rows
    starts_np = starts.numpy()
    index_np = index.to(torch.int64).numpy()
    offsets_np = offsets.numpy()
    result = []
    for i, v in enumerate(values):
        out = torch.empty((total, *v.shape[1:]), dtype=v.dtype) if outs is None else outs[i]
        if total:
            v = v.contiguous()
            # Tokens as bytes: one kernel for every dtype and trailing shape.
            width = v.element_size() * math.prod(v.shape[1:])
            copy_rows(_bytes(v), _bytes(out), starts_np, index_np, offsets_np, width)
        result.append(out)
    return result


def _bytes(t: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a flat uint8 NumPy array (no copy)."""
    return t.view(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)


def _triton(values, starts, lengths, index, offsets, outs, total=None, max_length=None):
    if total is None or max_length is None:
        sel = lengths.index_select(0, index)
        total, max_length = (int(x) for x in torch.stack([offsets[-1], sel.max() if sel.numel() else offsets[-1]]).tolist())
    launcher = implementation("gather_packed", "triton")
    return launcher(list(values), starts, lengths, index, offsets, total, max_length, None if outs is None else list(outs))

