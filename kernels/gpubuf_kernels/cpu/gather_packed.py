"""Packed gather as a compiled CPU loop: the sampled rows' bytes copied back to back.

The torch twin :func:`gpubuf.ops.gather_packed.gather_packed_ref` is the specification. On the
CPU it needs a plan of block copies, two ``index_select`` calls and a fix-up pass per source;
here each row is one copy, the plain loop the op describes, compiled.
"""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def copy_rows(src, dst, starts, index, offsets, width):  # pragma: no cover - compiled
    """``dst[offsets[b] * width :][: n_b * width] = src[starts[r] * width :][: n_b * width]``, ``r = index[b]``.

    Args:
        src: uint8, one source's tokens as bytes (``width`` bytes a token), contiguous.
        dst: uint8, the output's bytes, at least ``offsets[-1] * width``.
        starts: int64 ``[N]``, each row's first token in ``src``.
        index: int64 ``[B]``, the rows to copy (in range; the caller checked).
        offsets: int64 ``[B + 1]``, where output row ``b`` starts; ``offsets[b + 1] - offsets[b]``
            is its length.
        width: bytes per token.
    """
    w = np.uint64(width)
    for b in range(index.shape[0]):
        # Unsigned positions: a signed index makes Numba test it for wraparound, and that test
        # keeps LLVM from vectorising the copy.
        s = np.uint64(starts[index[b]]) * w
        d = np.uint64(offsets[b]) * w
        n = np.uint64(offsets[b + 1] - offsets[b]) * w
        for x in range(n):
            dst[d + x] = src[s + x]
