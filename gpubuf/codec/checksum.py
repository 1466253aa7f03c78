"""Adler-32 checksums of many byte ranges of one tensor at once, on any device.

Each stored row carries ``adler32(row bytes + 4 little-endian bytes of its reference row)``:
the very value ``zlib.adler32`` gives, which is what the tests check against. Adler-32 needs no
table and splits into two sums that vectorise (and that a Triton program computes the same way):
for bytes ``b_0 .. b_{n-1}``

    A = 1 + sum_i b_i                  (mod 65521)
    B = n + sum_i (n - i) * b_i        (mod 65521)
    adler32 = B << 16 | A
"""

from __future__ import annotations

import torch

from gpubuf.codec.format import ADLER_MOD

__all__ = ["adler32_ranges", "adler32_ranges_host", "adler32_bytes", "as_int32", "as_uint32", "resuffix"]


def _extend(a: torch.Tensor, b: torch.Tensor, suffix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Feeds the 4 little-endian bytes of the int32 ``suffix`` into running sums ``a``, ``b``."""
    word = suffix.to(torch.int64) & 0xFFFFFFFF
    for k in range(4):
        byte = (word >> (8 * k)) & 0xFF
        a = (a + byte) % ADLER_MOD
        b = (b + a) % ADLER_MOD
    return a, b


def adler32_ranges(
    data: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    suffix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Adler-32 of ``data[starts[k] : starts[k] + lengths[k]]`` (then ``suffix[k]``'s 4 bytes) for every k.

    Args:
        data: flat ``uint8`` tensor; only read.
        starts: int64 ``[n]`` start offsets into ``data``, on its device.
        lengths: int64 ``[n]`` lengths; every range must lie inside ``data`` (not checked here).
        suffix: optional int32 ``[n]``: four more bytes per range, little-endian.

    Returns:
        int64 ``[n]`` checksums in ``[0, 2**32)``, on ``data``'s device.
    """
    n = starts.shape[0]
    device = data.device
    lengths = lengths.to(torch.int64)
    a = torch.ones(n, dtype=torch.int64, device=device)
    b = torch.zeros(n, dtype=torch.int64, device=device)
    total = int(lengths.sum()) if n else 0
    if total:
        seg = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=total)
        first = torch.cumsum(lengths, 0) - lengths
        pos = torch.arange(total, device=device) - first[seg]
        byte = data[starts[seg] + pos].to(torch.int64)
        # (n - i) is reduced first so that every product stays below 2**24 and no sum overflows.
        weight = (lengths[seg] - pos) % ADLER_MOD
        a.index_add_(0, seg, byte)
        b.index_add_(0, seg, weight * byte)
    a = a % ADLER_MOD
    b = (b + lengths) % ADLER_MOD
    if suffix is not None:
        a, b = _extend(a, b, suffix)
    return (b << 16) | a


def _suffix_bytes(suffix: torch.Tensor) -> list[torch.Tensor]:
    word = suffix.to(torch.int64) & 0xFFFFFFFF
    return [(word >> (8 * k)) & 0xFF for k in range(4)]


def resuffix(checksum: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Replaces the 4-byte suffix a checksum was computed with, without the bytes before it.

    Adler-32 appends a byte ``c`` as ``A += c; B += A``; that step is undone exactly, so
    ``resuffix(adler32(x + old), old, new) == adler32(x + new)``. Used when rows are renumbered
    and their stored reference numbers change.

    Args:
        checksum: int64 checksums in ``[0, 2**32)``.
        old, new: int32 suffixes (reference rows) before and after.

    Returns:
        int64 checksums in ``[0, 2**32)``.
    """
    a = checksum & 0xFFFF
    b = (checksum >> 16) & 0xFFFF
    s = _suffix_bytes(old)
    a0 = (a - (s[0] + s[1] + s[2] + s[3])) % ADLER_MOD
    b0 = (b - 4 * a0 - (4 * s[0] + 3 * s[1] + 2 * s[2] + s[3])) % ADLER_MOD
    a1, b1 = _extend(a0, b0, new)
    return (b1 << 16) | a1


def adler32_ranges_host(
    data: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    suffix: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as :func:`adler32_ranges` for CPU tensors, one ``zlib.adler32`` call per range.

    On the CPU this is the faster of the two: zlib's loop runs at memory speed, while the
    vectorised formula materialises several int64 values per byte. The loop is over ranges
    (rows), never over bytes.
    """
    import zlib

    buf = memoryview(data.numpy()) if data.numel() else memoryview(b"")
    out = []
    if suffix is None:
        for start, length in zip(starts.tolist(), lengths.tolist()):
            out.append(zlib.adler32(buf[start : start + length]))
    else:
        for start, length, extra in zip(starts.tolist(), lengths.tolist(), suffix.tolist()):
            out.append(zlib.adler32((extra & 0xFFFFFFFF).to_bytes(4, "little"), zlib.adler32(buf[start : start + length])))
    return torch.tensor(out, dtype=torch.int64)


def adler32_bytes(data: bytes | bytearray | memoryview, suffix: int | None = None) -> int:
    """Host reference: ``zlib.adler32`` of ``data`` followed by ``suffix`` as 4 little-endian bytes."""
    import zlib

    value = zlib.adler32(bytes(data))
    if suffix is not None:
        value = zlib.adler32(int(suffix & 0xFFFFFFFF).to_bytes(4, "little"), value)
    return value


def as_int32(checksum: torch.Tensor) -> torch.Tensor:
    """Checksums in ``[0, 2**32)`` (int64) -> their int32 bit patterns, for compact storage."""
    return torch.where(checksum >= 2**31, checksum - 2**32, checksum).to(torch.int32)


def as_uint32(checksum: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`as_int32`: int32 bit patterns -> int64 values in ``[0, 2**32)``."""
    return checksum.to(torch.int64) & 0xFFFFFFFF
