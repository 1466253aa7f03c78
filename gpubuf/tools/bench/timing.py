"""Timing several callables side by side, round robin, in one process.

Each repeat times every callable once, in a rotated order, so that slow phases of a shared,
noisy machine (another process, frequency changes, a page-cache flush) fall on all of them
alike instead of on whichever happened to run then. One timed *block* runs a callable
``number`` times, with ``number`` calibrated so that a block lasts at least ``min_block_s``;
the block's time divided by ``number`` is one sample.

CPU: ``time.perf_counter`` around the block. CUDA: the device is synchronised before the block
(so no earlier work is queued) and ``torch.cuda.Event`` pairs measure from the block's first
launch to the completion of its last kernel, which includes the host-side launch overhead
that small ops are dominated by.
"""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

_MAX_NUMBER = 100_000


@dataclass
class Timing:
    """Per-call times of one callable.

    Attributes:
        samples: seconds per call, one value per timed block.
        number: calls per timed block.
    """

    samples: list[float] = field(default_factory=list)
    number: int = 1

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100) of the per-call time, linear interpolation."""
        if not self.samples:
            raise ValueError("no timing samples")
        return float(np.percentile(self.samples, q))

    @property
    def p50(self) -> float:
        return self.percentile(50)

    @property
    def p20(self) -> float:
        return self.percentile(20)

    @property
    def p80(self) -> float:
        return self.percentile(80)

    @property
    def repeats(self) -> int:
        return len(self.samples)


def _cpu_block(fn: Callable[[], Any], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def _cuda_block(fn: Callable[[], Any], number: int) -> float:
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(number):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / number


def block_timer(device: torch.device | str) -> Callable[[Callable[[], Any], int], float]:
    """The function that times one block on ``device``: ``timer(fn, number) -> seconds per call``."""
    return _cuda_block if torch.device(device).type == "cuda" else _cpu_block


def measure_round_robin(
    calls: dict[str, Callable[[], Any]],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    repeats: int = 30,
    min_repeats: int = 5,
    min_block_s: float = 0.0,
    max_total_s: float = math.inf,
) -> dict[str, Timing]:
    """Times every callable of ``calls``, interleaved round robin.

    Args:
        calls: name -> a callable doing the operation once.
        device: the device the calls run on (chooses the clock).
        warmup: untimed calls of each callable first (allocator, caches, lazy initialisation).
        repeats: timed blocks per callable.
        min_repeats: blocks per callable that are always done, even past ``max_total_s``.
        min_block_s: each block runs the callable often enough to last at least this long, so
            that very short calls are not lost in the clock's resolution and overhead.
        max_total_s: stop after the round that passes this much wall time (once
            ``min_repeats`` is reached).

    Returns:
        name -> :class:`Timing`, in the order of ``calls``.
    """
    timer = block_timer(device)
    names = list(calls)
    timings = {name: Timing() for name in names}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    # A collection triggered inside a block would be charged to whichever call was running.
    gc.disable()
    try:
        for name in names:
            for _ in range(warmup):
                calls[name]()
            # Calibration: the fastest of three single calls, so that a stall does not shrink `number`.
            one = min(timer(calls[name], 1) for _ in range(3))
            want = math.ceil(min_block_s / one) if one > 0 else _MAX_NUMBER
            timings[name].number = int(min(max(1, want), _MAX_NUMBER))
        begin = time.perf_counter()
        for rep in range(max(repeats, min_repeats)):
            shift = rep % len(names)
            for name in names[shift:] + names[:shift]:
                timings[name].samples.append(timer(calls[name], timings[name].number))
            if rep + 1 >= min_repeats and time.perf_counter() - begin > max_total_s:
                break
    finally:
        if gc_was_enabled:
            gc.enable()
    return timings


__all__ = ["Timing", "block_timer", "measure_round_robin"]
