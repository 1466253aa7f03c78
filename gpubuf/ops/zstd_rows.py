"""Rows as zstd frames on the host: batched encode, decode of chosen rows.

Each row's bytes are one zstd frame (``zstandard``, with its content size and checksum), so
any row decodes on its own. The frames live in a :class:`~gpubuf.ops.decode_rows.RowTable`
like the row codec's (the table's checksums are unused: zstd checks its own).
"""

from __future__ import annotations

import numpy as np
import torch
import zstandard

from gpubuf.codec.errors import CorruptRowError
from gpubuf.ops.decode_rows import RowTable, empty_output
from gpubuf.ops.encode_rows import EncodedBatch

__all__ = ["zstd_encode_rows", "zstd_decode_rows"]


def zstd_encode_rows(rows: torch.Tensor, level: int = 3) -> EncodedBatch:
    """Compresses each row of CPU ``rows`` (``[n, *shape]``, any dtype) into one zstd frame.

    Returns:
        The frames back to back (``checksums`` are zeros).
    """
    n = rows.shape[0]
    raw = rows.detach().contiguous().reshape(n, rows[0].numel() if n else 0).view(torch.uint8).numpy()
    compressor = zstandard.ZstdCompressor(level=level, write_checksum=True)
    frames = [compressor.compress(row) for row in raw]
    lengths = torch.tensor([len(f) for f in frames], dtype=torch.int64)
    data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    return EncodedBatch(data, torch.cumsum(lengths, 0) - lengths, lengths, torch.zeros(n, dtype=torch.int64))


def zstd_decode_rows(table: RowTable, index: torch.Tensor) -> torch.Tensor:
    """Decodes rows ``index`` (int64 ``[B]``) of a CPU table of zstd frames.

    Returns:
        ``[B, *shape]`` of the table geometry's dtype.

    Raises:
        CorruptRowError: a row lies outside the arena, is not one valid zstd frame of the row's
            size, or fails its checksum (truncated or corrupt); ``err.rows`` lists its positions.
    """
    g = table.geometry
    B, size = index.shape[0], g.raw_bytes
    out = empty_output(B, g, torch.device("cpu"))
    if B == 0 or size == 0:
        return out  # nothing to decode, as with the row codec
    flat = out.view(torch.uint8).reshape(B, size).numpy()
    arena = table.arena.numpy()
    decompressor = zstandard.ZstdDecompressor()
    bad, reasons = [], set()
    rows = zip(table.offsets.index_select(0, index).tolist(), table.lengths.index_select(0, index).tolist())
    for b, (start, length) in enumerate(rows):
        try:
            if length <= 0 or start < 0 or start + length > arena.shape[0]:
                raise zstandard.ZstdError("offset/length outside the arena")
            frame = arena[start : start + length]
            if zstandard.frame_content_size(frame) != size:
                raise zstandard.ZstdError(f"the frame does not hold the row's {size} bytes")
            flat[b] = np.frombuffer(decompressor.decompress(frame), dtype=np.uint8)
        except zstandard.ZstdError as err:
            bad.append(b)
            reasons.add(str(err))
    if bad:
        shown = ", ".join(map(str, bad[:8])) + (" ..." if len(bad) > 8 else "")
        raise CorruptRowError(
            f"{len(bad)} compressed row(s) failed to decode (rows {shown}): {'; '.join(sorted(reasons))}", rows=bad
        )
    return out
