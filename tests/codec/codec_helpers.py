"""Helpers shared by the codec tests (imported by name: the test folders are not packages)."""

from __future__ import annotations

import torch

from gpubuf.codec.checksum import as_int32
from gpubuf.ops.encode_rows import encode_planes
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.decode_rows import RowTable, decode_rows, decode_rows_ref


def make_table(rows: torch.Tensor, *, keys: torch.Tensor | None = None, intra_keys: bool = True) -> RowTable:
    """Encodes ``[n, *shape]`` rows into a :class:`RowTable`; ``keys[k]`` (< k or -1) is row k's reference row."""
    g = RowGeometry.of(rows.dtype, rows.shape[1:])
    planes = g.to_planes(rows)
    if keys is None:
        enc = encode_planes(planes, g)
        refs = None
    else:
        has_key = keys >= 0
        key_planes = planes[keys.clamp_min(0)]
        enc = encode_planes(planes, g, key_planes=key_planes, has_key=has_key, ref_rows=keys.to(torch.int32), inrow=not intra_keys)
        refs = keys.to(torch.int32)
    return RowTable(enc.data, enc.starts, enc.lengths.to(torch.int32), as_int32(enc.checksums), refs, g)


def decode(table: RowTable, index: torch.Tensor, backend: str, out: torch.Tensor | None = None, *, verify: bool = True):
    """Decodes on one CPU path: the twin itself for ``"torch"``, else :func:`decode_rows` with that backend."""
    if backend == "torch":
        return decode_rows_ref(table, index, out, verify=verify)
    return decode_rows(table, index, out, verify=verify, backend=backend)
