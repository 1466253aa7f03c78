"""The compressed row format: line-based run-length coding with references, one row at a time.

A *row* is one item of one tensor leaf (for example one stacked observation ``[4, 84, 84]``).
Every row decodes on its own from its bytes, its table entry and at most one *reference row*,
so a sample decodes only the sampled rows, each independently of the others.

**Planes and lines.** A row of dtype ``d`` (``s = d.itemsize`` bytes per element) and item shape
``S`` is seen as bytes arranged in ``P = s * P0`` planes of ``H`` lines of ``W`` bytes, with
``W = S[-1]``, ``H = S[-2]`` and ``P0 = prod(S[:-2])`` (``H = 1`` for 1-D items, ``H = W = 1`` for
scalars). Plane ``b * P0 + q`` holds byte ``b`` (little-endian) of every element of image plane
``q``: splitting elements into byte planes puts the slowly varying high bytes of integers and
floats together, where they form long runs. Line ``l = p * H + y`` is line ``y`` of plane ``p``;
``L = P * H`` lines in all. See :class:`RowGeometry`.

**Reference planes.** Plane ``p`` of a row may be coded against a *reference plane*:

- plane ``p`` of the row's reference row, when the row has one (frame deduplication stores a
  frame against a recent key frame); the reference row must itself have no reference row;
- else plane ``p - p % P0`` of the same row when ``p % P0 > 0`` (the first image plane of the
  same byte: in a stack of frames, frame 0 for frames 1..3);
- else none.

A reference plane is always decoded without references of its own (depth one), which bounds
the work of decoding any line to two lines.

**Row bytes.** A row whose stored length equals its raw size ``L * W`` is stored raw: its bytes
are the planes in order. Otherwise (the encoder only keeps a coded row when it is strictly
smaller) the row is::

    modes   ceil(L / 4) bytes   2 bits per line: line l in byte l >> 2, bits 2 * (l & 3)
    counts  one byte per RUNS line, in line order: bit 7 = residual, bits 0-6 = runs - 1
    payload for each line in order: RAW -> W bytes; RUNS -> the starts of runs 1 .. n-1
            (low byte of the position, one byte each; run 0 starts at 0) then the n run
            values (one byte each), 2n - 1 bytes; UP and REF -> nothing

with line modes

- ``UP`` (0): a copy of line ``y - 1`` of the same plane (invalid on a plane's first line);
- ``REF`` (1): a copy of line ``y`` of the reference plane (invalid without one);
- ``RAW`` (2): the ``W`` bytes as they are;
- ``RUNS`` (3): ``n`` runs (1 <= n <= 128) covering the line, run ``k`` from its start to the
  next run's. Without the residual bit the runs are the line; with it they are added, modulo
  256, to line ``y`` of the reference plane (invalid without one).

Run starts are stored as their low byte. Every multiple of 256 starts a run (the encoder splits
runs there), so a stored low byte of 0 marks the next block of 256: the start of run ``k`` is
``256 * (number of zero bytes among runs 1..k) + byte``. Starts must be strictly increasing and
below ``W``. There is no padding anywhere, and ``W`` may be any size.

**Row table.** Beside the bytes, a storage keeps per row: the offset of its bytes in a flat
``uint8`` arena (int64), its length (int32), its reference row (int32, -1 for none) and a
checksum (int32): Adler-32 of the row's bytes followed by the 4 little-endian bytes of the
reference row number (so a row cannot silently be pointed at another reference).

**What a read verifies**, for every row it decodes and every reference row it uses: offset and
length inside the arena; the length the header implies equals the stored length (truncation);
the line modes allowed where they appear; run starts strictly increasing inside the line; the
reference row in range and without references of its own; and, with ``verify`` (the default),
the checksum. Any failure raises :class:`~gpubuf.codec.errors.CorruptRowError` and nothing is
returned. Not covered: a row's identity. A table entry copied whole from another row (offset,
length and checksum together) reads as that other row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "MODE_UP",
    "MODE_REF",
    "MODE_RAW",
    "MODE_RUNS",
    "MAX_RUNS",
    "RUN_BLOCK",
    "RESIDUAL_BIT",
    "ADLER_MOD",
    "RowGeometry",
]

MODE_UP = 0
MODE_REF = 1
MODE_RAW = 2
MODE_RUNS = 3

MAX_RUNS = 128  # runs - 1 fits the 7 low bits of a count byte
RUN_BLOCK = 256  # runs are split at multiples of 256, so a start is known from its low byte
RESIDUAL_BIT = 0x80

ADLER_MOD = 65521


@dataclass(frozen=True)
class RowGeometry:
    """How the bytes of one row of a leaf are laid out as planes of lines.

    Attributes:
        dtype: the leaf's dtype.
        shape: the item shape (the leaf's shape without its leading storage dim).
        planes: ``P``, byte planes times image planes.
        image_planes: ``P0``, planes per byte (``prod(shape[:-2])``).
        height: ``H``, lines per plane.
        width: ``W``, bytes per line.
    """

    dtype: torch.dtype
    shape: torch.Size
    planes: int
    image_planes: int
    height: int
    width: int

    @classmethod
    def of(cls, dtype: torch.dtype, shape: torch.Size | tuple[int, ...]) -> "RowGeometry":
        """The geometry of rows of ``dtype`` and item shape ``shape``."""
        shape = torch.Size(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        width = shape[-1] if len(shape) >= 1 else 1
        height = shape[-2] if len(shape) >= 2 else 1
        image_planes = math.prod(shape[:-2]) if len(shape) > 2 else 1
        return cls(dtype, shape, itemsize * image_planes, image_planes, height, width)

    @property
    def itemsize(self) -> int:
        return self.planes // self.image_planes if self.image_planes else 1

    @property
    def lines(self) -> int:
        """``L = P * H``."""
        return self.planes * self.height

    @property
    def raw_bytes(self) -> int:
        """Bytes of one uncompressed row: ``P * H * W``."""
        return self.lines * self.width

    @property
    def mode_bytes(self) -> int:
        """Bytes of the 2-bit line-mode table at the start of a coded row."""
        return (self.lines + 3) // 4

    def to_planes(self, rows: torch.Tensor) -> torch.Tensor:
        """``[n, *shape]`` rows of ``dtype`` -> ``[n, P, H, W]`` uint8 byte planes (a copy unless 1-byte)."""
        n = rows.shape[0]
        s = self.itemsize
        raw = rows.contiguous().view(torch.uint8).reshape(n, self.image_planes, self.height, self.width, s)
        if s == 1:
            return raw.view(n, self.planes, self.height, self.width)
        return raw.permute(0, 4, 1, 2, 3).reshape(n, self.planes, self.height, self.width)

    def from_planes(self, planes: torch.Tensor) -> torch.Tensor:
        """``[n, P, H, W]`` uint8 byte planes -> ``[n, *shape]`` rows of ``dtype`` (inverse of :meth:`to_planes`)."""
        n = planes.shape[0]
        s = self.itemsize
        if s == 1:
            return planes.reshape(n, *self.shape).view(self.dtype)
        x = planes.reshape(n, s, self.image_planes, self.height, self.width).permute(0, 2, 3, 4, 1).contiguous()
        return x.view(self.dtype).reshape(n, *self.shape)
