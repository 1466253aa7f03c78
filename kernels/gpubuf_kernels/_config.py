"""Default launch configurations of the gpubuf Triton kernels.

Plain dicts, read by the launchers at call time; nothing here touches a device. The values are
starting points to be tuned on an H200 (the benchmark machine) with ``benchmarks/``; autotuning
stays opt-in, so these are what every launch uses unless a caller overrides them.
"""

from __future__ import annotations

__all__ = ["GATHER_ROWS", "SUMTREE"]

# Row gather (gather.py). A program copies a tile of BLOCK_ROWS output rows by BLOCK_BYTES bytes
# of one source per inner-loop step, so one step moves up to BLOCK_ROWS * BLOCK_BYTES bytes
# (16 KiB here: 128 threads x 8 accesses of 16 bytes with num_warps=4). Both must be powers of
# two and BLOCK_BYTES >= 16, because the tile's width in units is BLOCK_BYTES // unit_bytes for
# units of 1, 2, 4, 8 and 16 bytes. BLOCK_ROWS trades lanes lost on narrow rows (a 4-byte reward
# uses one column of the tile) against the number of programs for wide ones (image rows loop
# over many column steps); the tests size batches around BLOCK_ROWS, so keep it small.
GATHER_ROWS = {
    "BLOCK_ROWS": 16,
    "BLOCK_BYTES": 1024,
    "num_warps": 4,
}


# ---------------------------------------------------------------------------------------------
# Sum tree (sumtree.py). The update's programs handle BLOCK entries each (the write and refresh
# kernels hold a [BLOCK, FANOUT] tile of children: 64 x 32 x 8 bytes = 16 KiB at num_warps=4); the
# sample's SAMPLE_BLOCK masses each. Levels of at most TOP_WHOLE nodes are rebuilt whole by the
# update's last program, NODE_BLOCK nodes at a time: with 2048, trees of up to 2**26 leaves update
# in at most 3 launches. All must be powers of two; the tests size batches around them through the
# launchers' `block=`.
SUMTREE = {
    "BLOCK": 64,
    "SAMPLE_BLOCK": 64,
    "TOP_WHOLE": 2048,
    "NODE_BLOCK": 64,
    "num_warps": 4,
}
