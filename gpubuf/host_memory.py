"""Host memory for sampled batches: large outputs on transparent huge pages, when asked for.

Off by default: every CPU output comes from the ordinary allocator until
:func:`use_huge_pages` turns this on for the process. Nothing here runs at import.

A sampled batch is a new tensor every call. Past glibc's largest mmap threshold (32 MiB on
64-bit Linux) every new block comes straight from the kernel and is faulted in 4 KiB at a time
when first written: for a batch of 4,096 stacked Atari observations (231 MB) the faults cost
more than filling the memory. Anonymous memory advised with ``MADV_HUGEPAGE`` faults in 2 MiB
at a time instead, 512 times fewer faults.

Faulting even 2 MiB pages in is not free: the kernel zeroes each one, and under a hypervisor
that reclaims freed guest memory a fresh huge page can cost far more (on a 2-core VM, sampling
231 MB batches of 4,096 Atari rows into fresh blocks ranged from 1.9x to 7.7x faster than
TorchRL's compressed storage in the same run, depending on the process's earlier allocations;
with kept blocks, 10.7x and 11.0x). So a large block is kept mapped once its batch is freed, and the next batch of the
same size reuses it, already faulted in: a training loop that samples one batch size pays the
faults once. At most :data:`IDLE_BLOCKS` freed blocks are kept; :func:`release_idle_blocks`
unmaps them (as ``torch.cuda.empty_cache`` does for the CUDA cache).

Blocks below the threshold come from numpy's allocator (glibc's heap): it keeps freed blocks
of a batch's size mapped, so the next batch of that size reuses their pages without faults.
Either way the result is an ordinary, writable tensor that owns its memory; a kept block is
reused only once no tensor (no view) of its previous batch is alive.

Even when asked for, a kernel whose transparent huge pages are ``never``, or a platform
without ``MADV_HUGEPAGE``, keeps the ordinary allocator.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import threading
from pathlib import Path

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

#: Outputs of at least this many bytes go on huge pages (glibc's largest mmap threshold).
LARGE_OUTPUT_BYTES = 32 << 20
#: The transparent huge page size on x86-64 and most arm64 kernels; mappings are rounded up to it.
HUGE_PAGE_BYTES = 2 << 20
#: Freed huge-page blocks kept mapped for the next batches of their size.
IDLE_BLOCKS = 2

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


_asked = False
_fork_hook = False


def use_huge_pages(enabled: bool = True) -> None:
    """Turns huge-page outputs and the kept blocks on (or off again) for this process.

    On: CPU outputs of :data:`LARGE_OUTPUT_BYTES` and more (sampled batches, decoded frames),
    a tensor storage's CPU leaves and a sum tree's leaves of :data:`HUGE_PAGE_BYTES` and more,
    and the compressed storages' encoded-row arenas go on transparent huge pages where the
    kernel offers them, and freed batch blocks are kept for the next batches of their size.
    Turning it off unmaps the kept blocks that are free; live ones go with their batches.
    """
    global _asked, _fork_hook
    _asked = bool(enabled)
    if _asked and not _fork_hook and hasattr(os, "register_at_fork"):
        # A child forked while another thread held the lock would wait on it forever; its
        # copies of the blocks are its own (private mappings), so it keeps them with a fresh lock.
        os.register_at_fork(after_in_child=_reset_lock_in_child)
        _fork_hook = True
    if not _asked:
        _CACHE.release()


def _reset_lock_in_child() -> None:
    _CACHE.reset_lock()


def huge_pages_enabled() -> bool:
    """Whether large CPU outputs are allocated on transparent huge pages in this process."""
    return _asked and _kernel_offers_huge_pages()


class _BlockCache:
    """Huge-page blocks, with the storage of the batch each one last backed.

    A block is free once that storage has died (no tensor or view of the batch is left), which
    :class:`~torch.multiprocessing.reductions.StorageWeakRef` tells without keeping it alive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a prefetching sampler allocates from its own thread
        self._blocks: list[tuple[mmap.mmap, StorageWeakRef]] = []

    def take(self, nbytes: int) -> torch.Tensor | None:
        size = _block_size(nbytes)
        with self._lock:
            block = None
            for at, (candidate, ref) in enumerate(self._blocks):
                if len(candidate) == size and ref.expired():
                    block = candidate
                    del self._blocks[at]
                    break
            if block is None:
                self._trim(IDLE_BLOCKS - 1)  # room for this block among the idle ones later
                block = _map_block(size)
                if block is None:
                    return None
            # The tensor holds a reference to ``block``: the mapping lasts while any view does.
            tensor = torch.frombuffer(block, dtype=torch.uint8, count=nbytes)
            self._blocks.append((block, StorageWeakRef(tensor.untyped_storage())))
            return tensor

    def _trim(self, keep: int) -> None:
        """Unmaps the oldest free blocks until at most ``keep`` are free."""
        free = [at for at, (_, ref) in enumerate(self._blocks) if ref.expired()]
        for at in reversed(free[: max(len(free) - keep, 0)]):
            block, _ = self._blocks.pop(at)
            try:
                block.close()
            except BufferError:  # pragma: no cover - an export outlived its storage
                pass  # the mapping goes with that export

    def release(self) -> None:
        with self._lock:
            self._trim(0)

    def reset_lock(self) -> None:
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)


def _block_size(nbytes: int) -> int:
    """``nbytes`` rounded up to whole huge pages."""
    return -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


def _map_block(size: int) -> mmap.mmap | None:
    try:
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None  # address space or overcommit limits: the ordinary allocator decides
    try:
        block.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # advice refused: still a valid block of ordinary pages
    return block


_CACHE = _BlockCache()


def _huge_page_block(nbytes: int) -> torch.Tensor | None:
    """A huge-page tensor of ``nbytes`` from the kept blocks, or None where mapping fails."""
    return _CACHE.take(nbytes)


def _single_huge_page_block(nbytes: int) -> torch.Tensor | None:
    """A huge-page tensor of ``nbytes`` on a block of its own, unmapped with its last view."""
    block = _map_block(_block_size(nbytes))
    return None if block is None else torch.frombuffer(block, dtype=torch.uint8, count=nbytes)


def release_idle_blocks() -> None:
    """Unmaps the huge-page blocks kept for reuse whose batches have been freed."""
    _CACHE.release()


def empty_host_bytes(nbytes: int, *, huge_from: int | None = None, reuse: bool = True) -> torch.Tensor:
    """A new uninitialised ``uint8`` CPU tensor of ``nbytes`` elements for an output batch.

    Args:
        nbytes: the size in bytes (``>= 0``).

    Keyword Args:
        huge_from: blocks of at least this many bytes go on huge pages (default
            :data:`LARGE_OUTPUT_BYTES`). Long-lived blocks that are filled once (an encoded-row
            arena) take :data:`HUGE_PAGE_BYTES`: the heap would not reuse them, so every 4 KiB
            page of theirs would fault.
        reuse: a huge-page block comes from, and goes back to, the blocks kept for reuse.
            Blocks that live long and are replaced by larger ones (an arena) pass False: kept
            after that, they would only hold memory.

    Returns:
        A contiguous, writable 1-D tensor that owns its memory; view it as the output's dtype
        and shape. Blocks of at least ``huge_from`` bytes are on transparent huge pages when
        :func:`huge_pages_enabled`.
    """
    if nbytes >= (LARGE_OUTPUT_BYTES if huge_from is None else huge_from) and huge_pages_enabled():
        block = _huge_page_block(nbytes) if reuse else _single_huge_page_block(nbytes)
        if block is not None:
            return block
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8))


def empty_host(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, huge_from: int | None = None, reuse: bool = True
) -> torch.Tensor:
    """A new uninitialised contiguous CPU tensor of ``shape`` and ``dtype``.

    ``huge_from`` and ``reuse`` are :func:`empty_host_bytes`'s.
    """
    shape = tuple(int(s) for s in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # (an empty numpy block has stride 0: no dtype view)
    return empty_host_bytes(nbytes, huge_from=huge_from, reuse=reuse).view(dtype).view(shape)


__all__ = [
    "HUGE_PAGE_BYTES",
    "IDLE_BLOCKS",
    "LARGE_OUTPUT_BYTES",
    "empty_host",
    "empty_host_bytes",
    "huge_pages_enabled",
    "release_idle_blocks",
    "use_huge_pages",
]
