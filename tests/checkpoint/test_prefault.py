"""A load's fresh memory is faulted in a chunk at a time before each read (``MADV_POPULATE_WRITE``):
the pages get mapped, the bytes stay as they were, and a kernel without the advice changes nothing."""

from __future__ import annotations

import ctypes
import errno
import mmap
import resource
import sys

import numpy as np
import pytest
import torch
from ckpt_helpers import assert_same, snapshot
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, TensorDictReplayBuffer
from gpubuf.checkpoint import arrays, prefault

PAGE = mmap.PAGESIZE
PAGES = 1024

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is a Linux call")


def _fresh(pages: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A new anonymous mapping on 4 KiB pages, none of them touched yet, and a tensor over it."""
    block = mmap.mmap(-1, pages * PAGE)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        block.madvise(mmap.MADV_NOHUGEPAGE)  # one fault a page whatever the machine's THP setting
    return block, torch.frombuffer(block, dtype=torch.uint8)


def _faults_while_writing(tensor: torch.Tensor, start: int, stop: int) -> int:
    """Minor page faults of this process while NumPy (one thread) writes bytes ``[start, stop)``."""
    view = tensor.numpy()[start:stop]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    view[:] = 7
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _kernel_populates() -> bool:
    _, probe = _fresh(1)
    return prefault.populate(probe, 0, PAGE)


@linux_only
def test_populated_pages_take_no_fault_when_written_and_read_as_zeros():
    if not _kernel_populates():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    _, control = _fresh(PAGES)
    # The control shows what is saved: a write into untouched pages faults each one in.
    assert _faults_while_writing(control, 0, PAGES * PAGE) >= PAGES * 9 // 10
    _block, tensor = _fresh(PAGES)
    assert prefault.populate(tensor, 0, PAGES * PAGE)
    assert _faults_while_writing(tensor, 0, PAGES * PAGE) < 16  # a few from the interpreter at most
    # Populated pages are zeroed anonymous memory, like pages faulted in by a read or a write.
    _other_block, other = _fresh(PAGES)
    assert prefault.populate(other, 0, PAGES * PAGE)
    assert not other.any()


@linux_only
def test_only_whole_pages_inside_the_range_are_populated():
    if not _kernel_populates():
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    _block, tensor = _fresh(8)
    assert not prefault.populate(tensor, 10, PAGE - 20)  # no whole page inside: nothing asked
    # Bytes [100, 5 pages + 100): pages 1 to 4 are whole inside it; 0 and 5 only in part.
    assert prefault.populate(tensor, 100, 5 * PAGE)
    assert _faults_while_writing(tensor, PAGE, 5 * PAGE) < 4
    assert _faults_while_writing(tensor, 5 * PAGE, 6 * PAGE) >= 1
    assert _faults_while_writing(tensor, 0, PAGE) >= 1
    assert _faults_while_writing(tensor, 6 * PAGE, 8 * PAGE) >= 2


def _rows(n: int) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    # 8 KiB a row: the obs file passes PACK_THRESHOLD and is read in several chunks below.
    return TensorDict({"obs": torch.randn(n, 2048, generator=gen), "step": torch.arange(n)}, batch_size=[n])


def _round_trip(tmp_path, name: str) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer]:
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(256), batch_size=4)
    rb.extend(_rows(256))
    rb.dumps(tmp_path / name)
    loaded = TensorDictReplayBuffer(storage=LazyTensorStorage(256), batch_size=4)
    loaded.loads(tmp_path / name)
    return rb, loaded


def test_a_load_populates_each_chunk_of_a_large_file_before_reading_it(tmp_path, monkeypatch):
    calls = []

    def spy(tensor, start, nbytes):
        calls.append((tensor.numel(), start, nbytes))
        return prefault.populate(tensor, start, nbytes)

    monkeypatch.setattr(arrays, "CHUNK", 512 << 10)
    monkeypatch.setattr(arrays, "populate", spy)
    rb, loaded = _round_trip(tmp_path, "ckpt")
    assert_same(snapshot(rb), snapshot(loaded))
    obs_bytes = 256 * 2048 * 4
    chunks = sorted(call[1:] for call in calls if call[0] == obs_bytes)
    assert chunks == [(start, 512 << 10) for start in range(0, obs_bytes, 512 << 10)]
    # Files under PACK_THRESHOLD (the packed small arrays) are read as before.
    assert all(size >= arrays.PACK_THRESHOLD for size, _, _ in calls)


def test_a_kernel_without_the_advice_is_asked_once_and_loads_as_before(tmp_path, monkeypatch):
    asked = []

    def refused(address, length, advice):
        asked.append(advice)
        ctypes.set_errno(errno.EINVAL)  # what a kernel before 5.14 answers
        return -1

    monkeypatch.setattr(prefault, "_MADVISE", refused)
    monkeypatch.setattr(prefault, "_supported", True)
    rb, loaded = _round_trip(tmp_path, "ckpt")
    assert_same(snapshot(rb), snapshot(loaded))
    assert asked == [prefault.MADV_POPULATE_WRITE]
    assert prefault._supported is False
    again = torch.empty(4 * PAGE, dtype=torch.uint8)
    assert not prefault.populate(again, 0, again.numel()) and len(asked) == 1


def test_a_refusal_other_than_unknown_advice_keeps_asking(monkeypatch):
    asked = []

    def out_of_memory(address, length, advice):
        asked.append(length)
        ctypes.set_errno(errno.ENOMEM)  # a memory cgroup at its limit: this range only
        return -1

    monkeypatch.setattr(prefault, "_MADVISE", out_of_memory)
    monkeypatch.setattr(prefault, "_supported", True)
    tensor = torch.from_numpy(np.zeros(4 * PAGE, dtype=np.uint8))
    assert not prefault.populate(tensor, 0, tensor.numel())
    assert not prefault.populate(tensor, 0, tensor.numel())
    assert len(asked) == 2 and prefault._supported
