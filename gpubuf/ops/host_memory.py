"""Host memory for sampled batches: large outputs on transparent huge pages.

A sampled batch is a new tensor every call. Past glibc's largest mmap threshold (32 MiB on
64-bit Linux) every new block comes straight from the kernel and is faulted in 4 KiB at a time
when first written: for a batch of 4,096 stacked Atari observations (231 MB) the faults cost
more than filling the memory. Anonymous memory advised with ``MADV_HUGEPAGE`` faults in 2 MiB
at a time instead, 512 times fewer faults.

Blocks below the threshold come from numpy's allocator (glibc's heap): it keeps freed blocks
of a batch's size mapped, so the next batch of that size reuses their pages without faults.
Either way the result is an ordinary, writable tensor that owns its memory (the mapping is
released when the last tensor using it is freed).

``GPUBUF_HUGE_PAGES=0`` turns huge pages off; so does a kernel whose transparent huge pages
are ``never``, or a platform without ``MADV_HUGEPAGE``.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

#: Outputs of at least this many bytes go on huge pages (glibc's largest mmap threshold).
LARGE_OUTPUT_BYTES = 32 << 20
#: The transparent huge page size on x86-64 and most arm64 kernels; mappings are rounded up to it.
HUGE_PAGE_BYTES = 2 << 20

_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def _kernel_offers_huge_pages() -> bool:
    """Whether ``madvise(MADV_HUGEPAGE)`` can take effect here (read once per process)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = _THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting


def huge_pages_enabled() -> bool:
    """Whether large CPU outputs are allocated on transparent huge pages in this process."""
    return os.environ.get("GPUBUF_HUGE_PAGES", "1") != "0" and _kernel_offers_huge_pages()


def _huge_page_block(nbytes: int) -> torch.Tensor | None:
    size = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    try:
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None  # address space or overcommit limits: the ordinary allocator decides
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # advice refused: still a valid block of ordinary pages
    # The tensor holds a reference to ``block``; the mapping goes when the last view does.
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)


def empty_host_bytes(nbytes: int) -> torch.Tensor:
    """A new uninitialised ``uint8`` CPU tensor of ``nbytes`` elements for an output batch.

    Args:
        nbytes: the size in bytes (``>= 0``).

    Returns:
        A contiguous, writable 1-D tensor that owns its memory; view it as the output's dtype
        and shape. Blocks of at least :data:`LARGE_OUTPUT_BYTES` are on transparent huge pages
        when :func:`huge_pages_enabled`.
    """
    if nbytes >= LARGE_OUTPUT_BYTES and huge_pages_enabled():
        block = _huge_page_block(nbytes)
        if block is not None:
            return block
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


def empty_host(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A new uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` (see :func:`empty_host_bytes`)."""
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # (an empty numpy block has stride 0: no dtype view)
    return empty_host_bytes(nbytes).view(dtype).view(shape)


__all__ = ["HUGE_PAGE_BYTES", "LARGE_OUTPUT_BYTES", "empty_host", "empty_host_bytes", "huge_pages_enabled"]
