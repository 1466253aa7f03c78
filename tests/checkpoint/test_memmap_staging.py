"""Loads into an empty memory-mapped storage: the checkpoint's files are copied next to the
storage's while verified, and become its files once everything passed; nothing is left behind by
a refused or killed load, and the checkpoint stays independent of the storage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same, snapshot
from tensordict import TensorDict

from gpubuf import LazyMemmapStorage, RandomSampler, TensorDictReplayBuffer
from gpubuf.checkpoint import CheckpointCorruptError, CheckpointMismatchError, staging
from gpubuf.checkpoint.arrays import PACK_THRESHOLD

CAPACITY = 96
WIDTH = 4096  # 16 KiB a row: the obs file (1.5 MiB) passes PACK_THRESHOLD and is staged


def _rows(n: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict({"obs": torch.randn(n, WIDTH, generator=gen), "step": torch.arange(n)}, batch_size=[n])


def _buffer(scratch: Path | None, capacity: int = CAPACITY) -> TensorDictReplayBuffer:
    return TensorDictReplayBuffer(storage=LazyMemmapStorage(capacity, scratch_dir=scratch), sampler=RandomSampler(),
                                  batch_size=4, generator=torch.Generator().manual_seed(3))


def _state(rb: TensorDictReplayBuffer) -> dict:
    snap = snapshot(rb)
    del snap["type"]
    return snap


@pytest.fixture
def saved(tmp_path):
    rb = _buffer(tmp_path / "source")
    rb.extend(_rows(CAPACITY - 10, 0))
    path = tmp_path / "ckpt"
    rb.dumps(path)
    assert max(p.stat().st_size for p in path.rglob("*.bin")) >= PACK_THRESHOLD
    return path, rb


@pytest.fixture
def adoptions(monkeypatch):
    """Counts the storages that took staged copies as their files."""
    calls = []
    adopt = LazyMemmapStorage._adopt_files

    def spy(self, layout, sources, **kwargs):
        calls.append(list(sources))
        return adopt(self, layout, sources, **kwargs)

    monkeypatch.setattr(LazyMemmapStorage, "_adopt_files", spy)
    return calls


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_an_empty_storage_takes_the_copies_as_its_files(saved, tmp_path, adoptions):
    path, rb = saved
    target = _buffer(tmp_path / "target")
    target.loads(path)
    assert len(adoptions) == 1
    assert_same(_state(target), _state(rb), "the loaded buffer")
    storage = target.storage
    assert all(Path(f).parent == tmp_path / "target" for f in storage.files.values())
    assert not [name for name in _entries(tmp_path / "target") if name.startswith(staging.STAGE_MARK)]
    # The storage's files are copies: writing to the storage leaves the checkpoint as it was.
    target.extend(_rows(10, 9))  # the last 10 rows of the capacity
    again = _buffer(tmp_path / "again")
    again.loads(path)
    assert_same(_state(again), _state(rb), "the checkpoint after the loaded storage was written")
    assert torch.equal(target[:]["obs"][-10:], _rows(10, 9)["obs"])


def test_a_storage_without_scratch_dir_gets_a_new_directory(saved, tmp_path, adoptions):
    path, rb = saved
    target = _buffer(None)
    target.loads(path)
    assert len(adoptions) == 1
    assert_same(_state(target), _state(rb), "the loaded buffer")
    root = Path(target.storage.scratch_dir)
    assert all(Path(f).parent == root for f in target.storage.files.values())
    assert target.storage.cleanup()
    assert not root.exists()


def test_a_corrupt_byte_is_detected_and_nothing_is_left(saved, tmp_path, adoptions):
    path, _ = saved
    victim = max(path.rglob("*.bin"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x40
    victim.write_bytes(bytes(data))
    target = _buffer(tmp_path / "target")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        target.loads(path)
    assert not adoptions
    assert not target.storage.initialized and len(target) == 0
    assert _entries(tmp_path / "target") == []
    # Without a scratch_dir: the directory made for the copies goes too.
    target = _buffer(None)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        target.loads(path)
    assert target.storage.scratch_dir is None and not target.storage.initialized


def test_a_load_refused_after_the_copies_leaves_nothing(saved, tmp_path, adoptions):
    path, _ = saved
    (tmp_path / "target").mkdir()
    target = _buffer(tmp_path / "target", capacity=2 * CAPACITY)  # another capacity: refused by the codec
    with pytest.raises(CheckpointMismatchError, match="capacity"):
        target.loads(path)
    assert not adoptions
    assert not target.storage.initialized
    assert _entries(tmp_path / "target") == []
    # A scratch_dir that did not exist: the load made it for its copies, and removes it.
    target = _buffer(tmp_path / "fresh", capacity=2 * CAPACITY)
    with pytest.raises(CheckpointMismatchError, match="capacity"):
        target.loads(path)
    assert not (tmp_path / "fresh").exists()


def test_a_storage_with_files_gets_its_rows_copied(saved, tmp_path, adoptions):
    path, rb = saved
    target = _buffer(tmp_path / "target")
    target.extend(_rows(5, 4))
    files = dict(target.storage.files)
    target.loads(path)
    assert not adoptions
    assert target.storage.files == files
    assert_same(_state(target), _state(rb), "the loaded buffer")


def test_copies_of_a_killed_load_are_removed_by_the_next(saved, tmp_path):
    path, rb = saved
    scratch = tmp_path / "target"
    scratch.mkdir()
    # A load killed while it copied the checkpoint's files.
    script = (
        "import os, signal, sys, torch\n"
        "from gpubuf import LazyMemmapStorage, TensorDictReplayBuffer\n"
        "from gpubuf.checkpoint import arrays\n"
        "write = os.pwrite\n"
        "def killing(fd, data, offset):\n"
        "    if offset > 0:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return write(fd, data, offset)\n"
        "arrays.os.pwrite = killing\n"
        "rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(int(sys.argv[2]), scratch_dir=sys.argv[3]))\n"
        "rb.loads(sys.argv[1])\n"
    )
    child = subprocess.run([sys.executable, "-c", script, str(path), str(CAPACITY), str(scratch)],
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True)
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()[-2000:]
    left = [name for name in _entries(scratch) if name.startswith(staging.STAGE_MARK)]
    assert len(left) == 1 and any((scratch / left[0]).rglob("*.bin"))
    # A live process's copies are kept (its load may still be running).
    live = scratch / f"{staging.STAGE_MARK}{os.getppid()}-00000000"
    live.mkdir()
    target = _buffer(scratch)
    target.loads(path)
    assert_same(_state(target), _state(rb), "the buffer loaded after a killed load")
    assert [name for name in _entries(scratch) if name.startswith(staging.STAGE_MARK)] == [live.name]
