"""Row codec of the compressed storages: format, encoder, checksums, arena store, frame stacks.

See :mod:`gpubuf.codec.format` for the byte format. The decode op (torch twin and dispatch) is
:mod:`gpubuf.ops.decode_rows`; its Triton kernels are in ``gpubuf_kernels.codec``.
"""

from gpubuf.codec.checksum import adler32_ranges
from gpubuf.codec.encoder import EncodedBatch, encode_planes
from gpubuf.codec.errors import CorruptRowError
from gpubuf.codec.format import RowGeometry
from gpubuf.codec.framestack import match_frames, stack_indices, transition_indices
from gpubuf.codec.store import RowStore

__all__ = [
    "CorruptRowError",
    "RowGeometry",
    "EncodedBatch",
    "encode_planes",
    "adler32_ranges",
    "RowStore",
    "stack_indices",
    "transition_indices",
    "match_frames",
]
