"""A device-resident store of encoded rows: one flat byte arena plus a row table.

Rows are appended at the end of the arena; rewriting a row appends its new bytes and leaves the
old ones as garbage. When an append does not fit, the live rows are copied, back to back, into
a new arena (compaction), grown to twice the live size when more than half of it would be live,
so that each byte is copied O(1) times on average. Nothing here leaves the store's device except
the few sizes that allocation needs.
"""

from __future__ import annotations

from typing import Callable

import torch

from gpubuf.codec.checksum import as_int32, as_uint32, resuffix
from gpubuf.ops.encode_rows import EncodedBatch
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.decode_rows import RowTable
from gpubuf.ops.gather_packed import gather_packed_trusted
from gpubuf.host_memory import HUGE_PAGE_BYTES, empty_host_bytes

__all__ = ["RowStore"]

_MIN_ARENA = 1 << 16
_COPY_CHUNK = 1 << 22  # bytes per compaction step, to bound the index temporaries


def _empty_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised byte arena; on the CPU on huge pages from 2 MiB.

    An arena is filled once, append by append, and replaced only when it is full: each of its
    pages faults in once. In 2 MiB pages that is 512 times fewer faults, which on a filling
    buffer of Atari frames is most of the time spent in the appends and compactions.
    """
    if device.type == "cpu":
        return empty_host_bytes(nbytes, huge_from=HUGE_PAGE_BYTES, reuse=False)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class RowStore:
    """Encoded rows of one geometry on one device.

    Args:
        geometry: the rows' :class:`~gpubuf.codec.format.RowGeometry`.
        rows: number of row slots.
        device: where the arena and table live.
        with_refs: keep a reference row per row (frame deduplication); otherwise every row is
            self-contained.

    Attributes:
        arena: ``uint8 [capacity]``; bytes ``[0, used)`` have been written.
        offsets, lengths, checksums, refs: the row table (see
            :class:`~gpubuf.ops.decode_rows.RowTable`); a slot never written has length 0.
    """

    def __init__(self, geometry: RowGeometry, rows: int, device: torch.device, *, with_refs: bool = False) -> None:
        self.geometry = geometry
        self.device = torch.device(device)
        self.arena = torch.empty(0, dtype=torch.uint8, device=self.device)
        self.used = 0
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.checksums = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.refs = torch.full((rows,), -1, dtype=torch.int32, device=self.device) if with_refs else None

    # ------------------------------------------------------------------ views
    @property
    def rows(self) -> int:
        return self.offsets.shape[0]

    def table(self) -> RowTable:
        """The arena and row table as the decode op reads them (views, no copy)."""
        return RowTable(self.arena, self.offsets, self.lengths, self.checksums, self.refs, self.geometry)

    def live_bytes(self, live: torch.Tensor) -> int:
        """Stored bytes of the rows where ``live`` (bool ``[rows]``) is True."""
        return int(self.lengths[live].sum()) if live.numel() else 0

    # ------------------------------------------------------------------ writing
    def write(
        self,
        ids: torch.Tensor,
        encoded: EncodedBatch,
        live: Callable[[], torch.Tensor],
        refs: torch.Tensor | None = None,
    ) -> None:
        """Stores ``encoded`` row k as row ``ids[k]``, replacing what was there.

        Args:
            ids: int64 ``[n]`` distinct row slots in ``[0, rows)``, on the store's device.
            encoded: the rows' bytes (:func:`~gpubuf.ops.encode_rows.encode_planes`).
            live: returns bool ``[rows]``, the rows whose bytes must survive a compaction (the
                rows being written may be included or not: their old bytes are dropped).
            refs: int32 ``[n]`` reference rows (stores made ``with_refs``), -1 for none.
        """
        need = int(encoded.data.numel())
        if self.used + need > self.arena.numel():
            keep = live().clone().index_fill_(0, ids, False)
            # Room for every slot at this batch's mean row size, so that filling the store does
            # not copy the arena over and over; an unwritten CPU page costs nothing.
            expected = need * self.rows // max(int(ids.numel()), 1) + need
            self._compact(keep, need, reserve=expected if self.arena.numel() == 0 else 0)
        start = self.used
        if need:
            self.arena[start : start + need].copy_(encoded.data)
        self.used = start + need
        # index_copy_ / index_fill_ rather than ``t[ids] = v``: on the CPU, torch runs an index
        # assignment of a few thousand rows on its thread pool, which costs milliseconds when
        # the cores are busy; these stay on the calling thread at this size.
        self.offsets.index_copy_(0, ids, (encoded.starts + start).to(torch.int64))
        self.lengths.index_copy_(0, ids, encoded.lengths.to(torch.int32))
        self.checksums.index_copy_(0, ids, as_int32(encoded.checksums))
        if self.refs is not None:
            if refs is None:
                self.refs.index_fill_(0, ids, -1)
            else:
                self.refs.index_copy_(0, ids, refs.to(torch.int32))

    def _compact(self, keep: torch.Tensor, need: int, reserve: int = 0) -> None:
        """Moves the rows where ``keep`` into a fresh arena with room for ``need`` more bytes.

        The new arena holds at least ``reserve`` bytes, and twice the live bytes plus ``need``.
        """
        kept = keep.nonzero().squeeze(1)
        lengths = self.lengths.index_select(0, kept).to(torch.int64)
        live = int(lengths.sum()) if kept.numel() else 0
        target = live + need
        capacity = self.arena.numel()
        if 2 * target > capacity:
            capacity = max(2 * target, _MIN_ARENA, reserve)
        arena = _empty_arena(capacity, self.device)
        new_offsets = torch.cumsum(lengths, 0) - lengths
        self._copy_rows(arena, self.offsets.index_select(0, kept), lengths)
        # Slots not kept keep length 0 and offset 0: they read as corrupt, never as old bytes.
        self.offsets.zero_()
        self.lengths.zero_()
        self.offsets.index_copy_(0, kept, new_offsets)
        self.lengths.index_copy_(0, kept, lengths.to(torch.int32))
        self.arena = arena
        self.used = live

    def _copy_rows(self, dst: torch.Tensor, src_off: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copies rows ``arena[src_off[k] : +lengths[k]]`` to ``dst``, back to back from 0, in order.

        That is a packed gather of the rows (:func:`~gpubuf.ops.gather_packed.gather_packed_trusted`,
        block copies on the CPU, one launch on CUDA) written straight into ``dst``, done in
        chunks of about ``_COPY_CHUNK`` bytes to bound its index temporaries.
        """
        n = lengths.shape[0]
        if n == 0:
            return
        ends = torch.cumsum(lengths, 0)
        first = 0
        while first < n:
            # Rows [first, last) of roughly _COPY_CHUNK bytes.
            base = int(ends[first - 1]) if first else 0
            last = int(torch.searchsorted(ends, base + _COPY_CHUNK, right=True))
            last = min(max(last, first + 1), n)
            end = int(ends[last - 1])
            rows = torch.arange(first, last, device=self.device)
            gather_packed_trusted([self.arena], src_off, lengths, rows, total=end - base, outs=[dst[base:end]])
            first = last

    # ------------------------------------------------------------------ rows
    def keep_rows(self, kept: torch.Tensor, rows: int) -> None:
        """Renumbers rows: row ``kept[k]`` becomes row ``k``; ``rows`` slots afterwards.

        The caller remaps whatever points at rows. ``refs`` are remapped here, and the checksums
        of rows whose reference number changed are updated to the new number (see
        :func:`~gpubuf.codec.checksum.resuffix`). A kept row whose reference row is not kept
        gets the out-of-range number ``rows`` with its checksum unchanged, so it fails verification
        on read rather than decoding against another row.
        """
        n = kept.shape[0]
        new_of_old = torch.full((self.rows,), -1, dtype=torch.int64, device=self.device)
        new_of_old.index_copy_(0, kept, torch.arange(n, device=self.device))
        offsets = self.offsets.index_select(0, kept)
        lengths = self.lengths.index_select(0, kept)
        checksums = self.checksums.index_select(0, kept)
        self.offsets = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.lengths = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.checksums = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.offsets[:n] = offsets
        self.lengths[:n] = lengths
        self.checksums[:n] = checksums
        if self.refs is not None:
            old_refs = self.refs.index_select(0, kept)
            mapped = torch.where(old_refs >= 0, new_of_old.index_select(0, old_refs.clamp_min(0).to(torch.int64)), -1)
            lost = (old_refs >= 0) & (mapped < 0)
            mapped = torch.where(lost, rows, mapped).to(torch.int32)
            changed = (mapped != old_refs) & ~lost
            if bool(changed.any()):
                fixed = resuffix(as_uint32(checksums), old_refs, mapped)
                checksums = torch.where(changed, as_int32(fixed), checksums)
                self.checksums[:n] = checksums
            self.refs = torch.full((rows,), -1, dtype=torch.int32, device=self.device)
            self.refs[:n] = mapped

    def empty(self) -> None:
        """Forgets every row (the arena's memory is kept for reuse)."""
        self.used = 0
        self.offsets.zero_()
        self.lengths.zero_()
        self.checksums.zero_()
        if self.refs is not None:
            self.refs.fill_(-1)
