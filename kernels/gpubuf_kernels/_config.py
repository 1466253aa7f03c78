"""Default launch configurations of the gpubuf Triton kernels.

Plain dicts, read by the launchers at call time; nothing here touches a device. The values are
starting points to be tuned on an H200 (the benchmark machine) with ``benchmarks/``; autotuning
stays opt-in, so these are what every launch uses unless a caller overrides them.
"""

from __future__ import annotations

__all__ = ["GATHER_ROWS", "SUMTREE", "SLICE_WINDOWS"]

# Row gather (gather.py). A program copies BLOCK_ROWS output rows of its sources; each width
# class has its own tile (gather.py's docstring), at most 2 units or 2 16-byte vectors per thread
# with num_warps=4 and BLOCK_ROWS=32 (registers grow with BLOCK_ROWS: 64 takes 128 on sm_90). TARGET_PROGRAMS is how many programs a launch aims for
# (about 8 per SM of an H100/H200): below it, sources and column steps are spread over more
# programs. BLOCK_ROWS must be a power of two; the tests size batches around it, keep it small.
GATHER_ROWS = {
    "BLOCK_ROWS": 32,
    "TARGET_PROGRAMS": 1024,
    "num_warps": 4,
}


# ---------------------------------------------------------------------------------------------
# Sum tree (sumtree.py). Every program handles BLOCK entries times FANOUT children (the tree's
# fan-out, 32 by default), so a refresh or sample program holds a [BLOCK, FANOUT] float64 tile:
# 64 x 32 x 8 bytes = 16 KiB with num_warps=4. LEAF_BLOCK is the plain leaf scatter's width. All
# must be powers of two; the tests size batches around them through the launchers' `block=`.
SUMTREE = {
    "LEAF_BLOCK": 256,
    "REFRESH_BLOCK": 64,
    "SAMPLE_BLOCK": 64,
    "num_warps": 4,
}


# ---------------------------------------------------------------------------------------------
# Slice windows (slice.py). A program draws BLOCK slices and writes their [BLOCK, next_pow2(L)]
# window rows; a batch of 32 slices of 32 steps is one program.
SLICE_WINDOWS = {
    "BLOCK": 32,
    "num_warps": 4,
}
