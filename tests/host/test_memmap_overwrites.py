"""Overwriting the rows of a memory-mapped storage: through the mapping while their pages are
still dirty, with ``pwrite`` once the kernel has written them back; the rows are the same."""

from __future__ import annotations

import os

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.storages import _memmap_files as files


def _batch(n: int, start: int) -> TensorDict:
    ids = torch.arange(start, start + n)
    return TensorDict({"obs": ids[:, None].float().expand(n, 300).clone(), "id": ids}, [n])


def _written_back(storage) -> None:
    for handle in storage._files:
        os.fsync(handle.fd)


def _cachestat_here(tmp_path) -> bool:
    path = tmp_path / "probe"
    path.write_bytes(b"\0" * 8192)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\1" * 8192, 0)
        return files.mostly_dirty(fd, 0, 8192)
    finally:
        os.close(fd)


def test_rows_still_dirty_are_copied_through_the_mapping_and_written_back_ones_with_pwrite(tmp_path, monkeypatch):
    if not _cachestat_here(tmp_path):
        pytest.skip("the kernel's cachestat is not available here")
    pwrites = []
    real = files.write_rows
    monkeypatch.setattr(files, "write_rows", lambda fd, offset, rows: pwrites.append(offset) or real(fd, offset, rows))
    capacity = 64
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyMemmapStorage(capacity, scratch_dir=tmp_path / "rows"))
    rb.extend(_batch(capacity, 0))  # first write: through the mapping
    assert pwrites == []
    rb.extend(_batch(20, 100))  # rows 0..19, still dirty: through the mapping
    assert pwrites == []
    _written_back(rb.storage)
    rb.extend(_batch(20, 200))  # rows 20..39, written back: pwrite
    assert len(pwrites) == len(rb.storage._files)  # one per stored field ("index" included)
    ids = rb.storage[torch.arange(capacity)]["id"]
    want = torch.cat([torch.arange(100, 120), torch.arange(200, 220), torch.arange(40, 64)])
    assert torch.equal(ids, want)
    assert torch.equal(rb.storage[torch.arange(capacity)]["obs"][:, 299], want.float())


def test_without_cachestat_every_overwrite_uses_pwrite(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_syscall", lambda: None)
    pwrites = []
    real = files.write_rows
    monkeypatch.setattr(files, "write_rows", lambda fd, offset, rows: pwrites.append(offset) or real(fd, offset, rows))
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyMemmapStorage(32, scratch_dir=tmp_path / "rows"))
    rb.extend(_batch(32, 0))
    rb.extend(_batch(40, 500))  # more than the capacity: the last 32 rows of the batch stay
    assert pwrites
    assert torch.equal(rb.storage[torch.arange(32)]["id"].sort().values, torch.arange(508, 540))


def test_dirty_pages_are_told_from_written_back_ones(tmp_path):
    if not _cachestat_here(tmp_path):
        pytest.skip("the kernel's cachestat is not available here")
    path = tmp_path / "f"
    path.write_bytes(b"\0" * (64 << 10))
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
        assert not files.mostly_dirty(fd, 0, 64 << 10)
        os.pwrite(fd, b"\1" * (64 << 10), 0)
        assert files.mostly_dirty(fd, 0, 64 << 10)
        assert not files.mostly_dirty(fd, 0, 0)
        os.fsync(fd)
        assert not files.mostly_dirty(fd, 0, 64 << 10)
    finally:
        os.close(fd)


def test_on_a_memory_only_file_system_overwrites_always_go_through_the_mapping(monkeypatch):
    import shutil
    import tempfile

    if not (os.path.isdir("/dev/shm") and files.in_memory_fs("/dev/shm")):
        pytest.skip("no tmpfs at /dev/shm here")
    assert not files.in_memory_fs(os.path.dirname(os.path.abspath(__file__)))  # the checkout is on a disk
    pwrites = []
    real = files.write_rows
    monkeypatch.setattr(files, "write_rows", lambda fd, offset, rows: pwrites.append(offset) or real(fd, offset, rows))
    scratch = tempfile.mkdtemp(dir="/dev/shm")
    try:
        rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyMemmapStorage(32, scratch_dir=scratch + "/rows"))
        rb.extend(_batch(32, 0))
        _written_back(rb.storage)  # tmpfs pages stay as they are (its cachestat never reports them dirty)
        rb.extend(_batch(10, 300))
        assert pwrites == []
        assert torch.equal(rb.storage[torch.arange(32)]["id"], torch.cat([torch.arange(300, 310), torch.arange(10, 32)]))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.mark.parametrize("dirty", [True, False], ids=["through the mapping", "with pwrite"])
def test_a_batch_read_from_the_storage_itself_overwrites_rows_correctly_either_way(tmp_path, monkeypatch, dirty):
    """``rb.extend(rb.storage[20:30])`` into rows that wrap over the view's own rows: the batch is
    copied first, so every row gets the value it had before the write, whichever copy runs."""
    monkeypatch.setattr(files, "mostly_dirty", lambda fd, offset, length: dirty)
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyMemmapStorage(32, scratch_dir=tmp_path / "rows"))
    rb.extend(_batch(32, 0))
    rb.extend(_batch(25, 100))  # the cursor is now at row 25
    view = rb.storage._leaves[rb.storage._layout.index_of(("id",))][20:30]
    before = view.clone()
    rb.extend(TensorDict({"obs": rb.storage[torch.arange(20, 30)]["obs"], "id": view}, [10]))  # rows 25..31, 0..2
    ids = rb.storage[torch.arange(32)]["id"]
    assert torch.equal(ids[25:32], before[:7]) and torch.equal(ids[0:3], before[7:])
