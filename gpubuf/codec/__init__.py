"""The compressed-row format shared by the encode and decode ops: layout, checksums, errors.

See :mod:`gpubuf.codec.format` for the byte format. The ops that write and read it are
:mod:`gpubuf.ops.encode_rows`, :mod:`gpubuf.ops.match_frames` (frame-stack dedup) and
:mod:`gpubuf.ops.decode_rows`; the encoded rows' arena is :mod:`gpubuf.storages._row_store`.
This package imports nothing of gpubuf but its errors, so every layer above may use it.
"""

from gpubuf.codec.checksum import adler32_ranges
from gpubuf.codec.errors import CorruptRowError
from gpubuf.codec.format import RowGeometry

__all__ = ["CorruptRowError", "RowGeometry", "adler32_ranges"]
