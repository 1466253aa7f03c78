"""A dump writes its large files on several threads: the same checkpoint as one thread writes,
and a failure in any of them leaves the previous checkpoint and no open file behind."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, TensorDictReplayBuffer
from gpubuf.checkpoint import arrays

ROWS = 4096


def _buffer(seed: int) -> TensorDictReplayBuffer:
    # Two leaves of 1 MiB and more (written on their own threads) and small ones packed together.
    g = torch.Generator().manual_seed(seed)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=8)
    rb.extend(TensorDict({
        "obs": torch.randn(ROWS, 64, generator=g),
        "next": {"obs": torch.randn(ROWS, 96, generator=g)},
        "reward": torch.randn(ROWS, generator=g),
        "done": torch.rand(ROWS, generator=g) < 0.1,
    }, [ROWS]))
    return rb


def _files_table(path) -> dict:
    return json.loads((path / "meta.json").read_text())["files"]


def _files_open_under(root) -> list[str]:
    """The files under ``root`` this process holds open (other tests' files may come and go)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since listed
        if target.startswith(str(root)):
            found.append(target)
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_large_files_are_written_on_threads_and_give_the_one_thread_checkpoint(tmp_path, monkeypatch):
    rb = _buffer(0)
    threads: dict[str, int] = {}
    write_file = arrays._write_file

    def recorded(root, rel, *args):
        threads[rel] = threading.get_ident()
        return write_file(root, rel, *args)

    monkeypatch.setattr(arrays, "_write_file", recorded)
    monkeypatch.setattr(arrays, "WRITERS", 1)
    rb.dumps(tmp_path / "one")
    assert set(threads.values()) == {threading.get_ident()}
    threads.clear()
    monkeypatch.setattr(arrays, "WRITERS", 2)
    rb.dumps(tmp_path / "two")
    large = [rel for rel, entry in _files_table(tmp_path / "two").items() if entry["nbytes"] >= arrays.PACK_THRESHOLD]
    assert len(large) >= 2
    assert threading.get_ident() not in {threads[rel] for rel in large}
    # The same files, sizes and checksums, listed in the same order, as the one-thread dump's.
    one, two = _files_table(tmp_path / "one"), _files_table(tmp_path / "two")
    assert list(one) == list(two) and one == two
    loaded = TensorDictReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=8)
    loaded.loads(tmp_path / "two")
    assert (loaded[:] == rb[:]).all()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_a_failed_threaded_write_keeps_the_last_checkpoint_and_closes_every_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    saved = _buffer(1)
    saved.dumps(path)
    before = sorted(p.relative_to(path) for p in path.rglob("*"))
    rb = _buffer(2)
    write_file = arrays._write_file

    def failing(root, rel, placed, bar, unsynced):
        if rel.endswith("leaf_1.bin"):  # ("next", "obs"), the largest leaf
            raise OSError(28, "No space left on device")
        return write_file(root, rel, placed, bar, unsynced)

    monkeypatch.setattr(arrays, "WRITERS", 2)
    monkeypatch.setattr(arrays, "_write_file", failing)
    with pytest.raises(OSError, match="No space left"):
        rb.dumps(path)
    assert _files_open_under(tmp_path) == []
    assert sorted(p.relative_to(path) for p in path.rglob("*")) == before
    loaded = TensorDictReplayBuffer(storage=LazyTensorStorage(ROWS), batch_size=8)
    loaded.loads(path)
    assert (loaded[:] == saved[:]).all()
    assert not [p for p in tmp_path.iterdir() if p != path]  # no staging directory left
