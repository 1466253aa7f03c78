"""Default launch configurations of the gpubuf Triton kernels.

Plain dicts, read by the launchers at call time; nothing here touches a device. The values are
starting points to be tuned on an H200 (the benchmark machine) with ``benchmarks/``; autotuning
stays opt-in, so these are what every launch uses unless a caller overrides them.
"""

from __future__ import annotations

__all__ = ["GATHER_ROWS", "SUMTREE", "SLICE_WINDOWS", "EPISODES"]

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
# Sum tree (sumtree.py). The update's programs handle BLOCK entries each (the write and refresh
# kernels hold a [BLOCK, FANOUT] tile of children: 64 x 32 x 8 bytes = 16 KiB at num_warps=4); the
# sample's SAMPLE_BLOCK masses each. Levels of at most TOP_WHOLE nodes are rebuilt whole by the
# update's last program, NODE_BLOCK nodes at a time (16 keeps the write kernel under 90 registers
# on sm_90, no spills and no stack): with 2048, trees of up to 2**26 leaves update
# in at most 3 launches. All must be powers of two; the tests size batches around them through the
# launchers' `block=`.
SUMTREE = {
    "BLOCK": 64,
    "SAMPLE_BLOCK": 64,
    "TOP_WHOLE": 2048,
    "NODE_BLOCK": 16,
    "num_warps": 4,
}


# ---------------------------------------------------------------------------------------------
# Slice windows (slice.py). A program draws BLOCK slices and writes their [BLOCK, next_pow2(L)]
# window rows; a batch of 32 slices of 32 steps is one program. The prioritized draw also descends
# the sum tree ([BLOCK, 32] tiles) and writes a float64-computed weight per step, so it takes at
# most TREE_TILE steps a program: BLOCK = 32 spilled 16 B at L = 64 on sm_90 (fp64 leaves,
# stratified), BLOCK = TREE_TILE // next_pow2(L) does not.
SLICE_WINDOWS = {
    "BLOCK": 32,
    "TREE_TILE": 1024,
    "num_warps": 4,
}


# ---------------------------------------------------------------------------------------------
# Episode append (episodes.py). The rows kernel writes BLOCK rows of one column a program (256:
# 40 registers on sm_90; 512 spilled at 64, 1024 took 118); the lists kernel, one program per
# column, scans a list's front and the write's new trajectories LIST_BLOCK at a time (most writes
# pop and append fewer). Powers of two; the tests size writes around them through the launcher's
# `block=` and `list_block=`.
EPISODES = {
    "BLOCK": 256,
    "LIST_BLOCK": 128,
    "num_warps": 4,
}
