"""Fresh host memory faulted in ahead of a large read: one system call a chunk, not a fault a page.

A load reads each large checkpoint file into a new tensor. The kernel maps memory that new on
its first write, one 4 KiB page at a time, and on a virtual machine each of those faults costs
more than the copy it interrupts. Asking for a chunk's pages at once with
``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later) does the same mapping and zeroing in one
call: reading a 128 MiB file into new memory measured 70 ms with a fault a page and 56 ms with
each 16 MiB chunk populated first (2-core VM, Linux 6.18, median of 9).

The pages are ordinary anonymous memory of the tensor's own allocation (no huge pages, nothing
kept): only when they are mapped changes. Where the call is missing or refused (another OS, an
older kernel, a full memory cgroup), nothing happens and the read faults the pages in as before.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import sys

import torch

__all__ = ["populate"]

#: ``MADV_POPULATE_WRITE`` of ``<linux/mman.h>``: fault the range in, writable, as a write would.
MADV_POPULATE_WRITE = 23

_PAGE = mmap.PAGESIZE


def _madvise() -> object | None:
    """libc's ``madvise``, or None where there is no such call to make (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):  # pragma: no cover - a Linux libc without madvise
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function


_MADVISE = _madvise()
#: Cleared for the process once the kernel says it does not know the advice (before 5.14).
_supported = _MADVISE is not None


def populate(tensor: torch.Tensor, start: int, nbytes: int) -> bool:
    """Maps the pages under bytes ``[start, start + nbytes)`` of a CPU tensor's memory, writable,
    before they are written.

    Only whole pages inside the range are advised; a partial page at either end is left to fault
    in as usual. The contents are not changed (fresh anonymous pages read as zeros either way).

    Args:
        tensor: a contiguous CPU tensor; it is not modified.
        start: the first byte of the range, from the tensor's first byte.
        nbytes: the range's length in bytes (``start + nbytes`` at most the tensor's size).

    Returns:
        True when the kernel mapped the range; False when nothing was done (no whole page in the
        range, the call unavailable, or refused, e.g. under a memory limit: the write that
        follows then faults the pages in itself and meets the limit there).
    """
    global _supported
    if not _supported or nbytes <= 0:
        return False
    address = tensor.data_ptr() + start
    first = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end <= first:
        return False
    # ctypes releases the GIL for the call: the other readers keep running meanwhile.
    if _MADVISE(first, end - first, MADV_POPULATE_WRITE) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
        _supported = False  # a kernel before 5.14: never ask again
    return False
