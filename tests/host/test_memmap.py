"""LazyMemmapStorage: TorchRL's documented behaviour, files on disk, cleanup, bad input and faults.

Multiprocess sharing is in test_multiprocess.py.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from tensordict import TensorDict, tensorclass

import gpubuf
from gpubuf.errors import (
    DTypeMismatchError,
    EmptyBufferError,
    GpubufError,
    SchemaMismatchError,
    UnsupportedDataError,
)
from gpubuf.storages import _memmap_files
from gpubuf.storages.memmap import (
    DiskFullError,
    LazyMemmapStorage,
    MemmapStorageError,
    ScratchDirError,
    StorageExistsError,
    StorageMismatchError,
)
from helpers import TED_ROW_BYTES, ted_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@tensorclass
class MyClass:
    foo: torch.Tensor
    bar: torch.Tensor


def _files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


# ---------------------------------------------------------------------------------- documentation
def test_doc_example_tensordict_nested_keys():
    data = TensorDict(
        {"some data": torch.randn(10, 11), ("some", "nested", "data"): torch.randn(10, 11, 12)},
        batch_size=[10, 11],
    )
    storage = LazyMemmapStorage(100)
    storage.set(range(10), data)
    assert len(storage) == 10  # only the first dimension is considered as indexable
    item = storage.get(0)
    assert item.batch_size == torch.Size([11])
    assert item["some", "nested", "data"].shape == torch.Size([11, 12])
    torch.testing.assert_close(item["some data"], data[0]["some data"])
    torch.testing.assert_close(item["some", "nested", "data"], data[0]["some", "nested", "data"])
    # One file per leaf, nested keys mirrored as folders.
    names = _files_under(storage.scratch_dir)
    assert "some data.memmap" in names
    assert os.path.join("some", "nested", "data.memmap") in names
    assert storage.cleanup() is True


def test_doc_example_tensorclass():
    data = MyClass(foo=torch.randn(10, 11), bar=torch.randn(10, 11, 12), batch_size=[10, 11])
    storage = LazyMemmapStorage(10)
    storage.set(range(10), data)
    item = storage.get(0)
    assert isinstance(item, MyClass)
    assert item.batch_size == torch.Size([11])
    torch.testing.assert_close(item.bar, data[0].bar)
    torch.testing.assert_close(item.foo, data[0].foo)
    storage.cleanup()


def test_doc_example_checkpoint_in_place(tmp_path, monkeypatch):
    pytest.importorskip("gpubuf.checkpoint")
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    td = TensorDict(a=0, b=1).expand(1000).clone()
    # We pass a path that is <main_ckpt_dir>/storage to LazyMemmapStorage
    rb_memmap = gpubuf.ReplayBuffer(storage=LazyMemmapStorage(10_000_000, scratch_dir="dump/storage"))
    rb_memmap.extend(td)
    # Checkpointing in `dump` puts the buffer next to the storage's files.
    rb_memmap.dumps(Path("./dump"))
    rb_copy = gpubuf.ReplayBuffer(storage=LazyMemmapStorage(10_000_000))
    rb_copy.loads(Path("./dump"))
    assert len(rb_copy) == 1000
    assert torch.equal(rb_copy[:]["a"], td["a"]) and torch.equal(rb_copy[:]["b"], td["b"])
    rb_copy.storage.cleanup()


# ------------------------------------------------------------------------------------------- files
def test_files_are_created_on_first_write_one_per_leaf(tmp_path):
    root = tmp_path / "buf"
    storage = LazyMemmapStorage(1000, scratch_dir=root)
    assert not root.exists()  # nothing before the first write
    assert not storage.initialized and len(storage) == 0 and storage.files == {}
    data = ted_rows(10)
    storage.set(range(10), data)
    files = storage.files
    assert len(files) == 8
    for key, path in files.items():
        assert path == os.path.join(str(root), *key[:-1], key[-1] + ".memmap")
        leaf = data.get(key)
        assert os.path.getsize(path) == 1000 * leaf[0].numel() * leaf.element_size()
    # Raw C-contiguous bytes: readable with numpy alone.
    raw = np.fromfile(files[("observation",)], dtype=np.float32).reshape(1000, 32)
    assert np.array_equal(raw[:10], data["observation"].numpy())
    description = json.load(open(root / ".gpubuf" / "layout.json"))
    assert description["capacity_dim0"] == 1000 and len(description["leaves"]) == 8


def test_plain_tensor_and_pytree_files(tmp_path):
    storage = LazyMemmapStorage(20, scratch_dir=tmp_path / "t")
    storage.set(range(4), torch.arange(12).view(4, 3))
    assert _files_under(str(tmp_path / "t")) == [".gpubuf/layout.json", ".gpubuf/lock", ".gpubuf/state", "tensor.memmap"]
    assert torch.equal(storage.get(slice(0, 4)), torch.arange(12).view(4, 3))
    tree = LazyMemmapStorage(20, scratch_dir=tmp_path / "p")
    tree.set(range(2), {"x": torch.ones(2, 3), "y": (torch.zeros(2), torch.arange(2))})
    assert [n for n in _files_under(str(tmp_path / "p")) if n.endswith(".memmap")] == ["0.memmap", "1.memmap", "2.memmap"]
    got = tree.get(1)
    assert torch.equal(got["x"], torch.ones(3)) and int(got["y"][1]) == 1


def test_len_counts_the_first_ndim_dims(tmp_path):
    storage = LazyMemmapStorage(12, scratch_dir=tmp_path / "s", ndim=2)
    rb = gpubuf.ReplayBuffer(storage=storage, batch_size=5)
    data = TensorDict({"obs": torch.arange(12.0).view(3, 4)}, batch_size=[3, 4])
    rb.extend(data)  # as TorchRL: extended along the last dim (dim_extend = ndim - 1)
    assert len(storage) == 12 and storage.shape == torch.Size([4, 3])
    assert rb.sample()["obs"].shape == torch.Size([5])
    assert os.path.getsize(storage.files[("obs",)]) == 12 * 4


def test_same_contents_as_torchrl_with_wrap_around(tmp_path):
    import torchrl.data as trl

    ours = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(25, scratch_dir=tmp_path / "g"))
    theirs = trl.TensorDictReplayBuffer(storage=trl.LazyMemmapStorage(25, scratch_dir=tmp_path / "t"))
    for start, n in [(0, 10), (10, 10), (20, 12), (32, 40), (72, 3)]:
        a = ours.extend(ted_rows(n, start))
        b = theirs.extend(ted_rows(n, start))
        assert torch.equal(a, b)
    assert len(ours) == len(theirs) == 25
    assert ours.write_count == theirs.write_count == 75
    mine, other = ours[:], theirs[:]
    for key in ted_rows(1).keys(True, True):
        assert torch.equal(mine[key], other[key]), key
    assert torch.equal(mine["index"], other["index"])


def test_sampling_and_reads(tmp_path):
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(1000, scratch_dir=tmp_path / "s"), batch_size=64)
    rb.extend(ted_rows(300))
    batch = rb.sample()
    ids = batch["next", "reward"].squeeze(-1).long()
    assert torch.equal(ids, batch["index"])
    assert torch.equal(batch["observation"][:, 5].long(), ids)
    assert torch.equal(rb[torch.tensor([3, 299, -1])]["action"][:, 0], torch.tensor([3.0, 299.0, 299.0]))
    assert rb.storage.device == torch.device("cpu")


def test_device_auto_takes_the_first_batch_device(tmp_path):
    storage = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", device=None)
    storage.set(range(3), torch.ones(3, 2))
    assert storage.device == torch.device("cpu")
    assert storage.get(0).device == torch.device("cpu")


@pytest.mark.gpu
def test_device_cuda_returns_batches_on_the_gpu(tmp_path):
    storage = LazyMemmapStorage(100, scratch_dir=tmp_path / "s", device="cuda")
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb.extend(ted_rows(50))
    batch = rb.sample()
    assert batch.device.type == "cuda" and batch["observation"].is_cuda
    assert storage._leaves[0].device.type == "cpu"  # the rows stay in the files
    assert storage.get(slice(0, 5))["action"].is_cuda and storage.get(torch.tensor([1, 2]))["action"].is_cuda
    assert torch.equal(batch["observation"][:, 0].long().cpu(), batch["index"].cpu())


def test_state_dict_round_trip(tmp_path):
    src = LazyMemmapStorage(30, scratch_dir=tmp_path / "a")
    src.set(range(20), ted_rows(20))
    state = src.state_dict()
    dst = LazyMemmapStorage(30, scratch_dir=tmp_path / "b")
    dst.load_state_dict(state)
    assert len(dst) == 20 and dst.files[("observation",)].startswith(str(tmp_path / "b"))
    assert torch.equal(dst.get(slice(0, 20))["next", "reward"], src.get(slice(0, 20))["next", "reward"])


def test_pickle_round_trip_shares_the_files(tmp_path):
    rb = gpubuf.ReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "s"))
    rb.extend(torch.arange(10.0).view(5, 2))
    other = pickle.loads(pickle.dumps(rb.storage))
    assert len(other) == 5 and torch.equal(other.get(slice(0, 5)), torch.arange(10.0).view(5, 2))
    gpubuf.ReplayBuffer(storage=other).extend(torch.full((3, 2), -1.0))
    # The cursor and the length are shared through the files: the first buffer sees the rows.
    assert len(rb) == 8 and rb.writer._cursor == 8
    assert torch.equal(rb[5:8], torch.full((3, 2), -1.0))


# ----------------------------------------------------------------------------------------- cleanup
def test_auto_cleanup_defaults(tmp_path):
    temp = LazyMemmapStorage(10)
    user = LazyMemmapStorage(10, scratch_dir=tmp_path / "u")
    assert temp._auto_cleanup is True and user._auto_cleanup is False
    temp.set(range(2), torch.ones(2))
    user.set(range(2), torch.ones(2))
    directory = temp.scratch_dir
    assert os.path.isdir(directory)
    assert temp.cleanup() is True
    assert not os.path.exists(directory)
    assert temp.cleanup() is False


def test_cleanup_in_a_user_dir_keeps_other_files(tmp_path):
    root = tmp_path / "u"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    storage = LazyMemmapStorage(10, scratch_dir=root)
    storage.set(range(2), ted_rows(2))
    assert storage.cleanup() is True
    assert sorted(os.listdir(root)) == ["notes.txt"]
    with pytest.raises(MemmapStorageError):
        storage.set(range(2), ted_rows(2))


def test_cleanup_before_any_write_returns_false():
    assert LazyMemmapStorage(10).cleanup() is False


def test_collected_storage_removes_its_temporary_files():
    storage = LazyMemmapStorage(10)
    storage.set(range(2), torch.ones(2))
    directory = storage.scratch_dir
    del storage
    import gc

    gc.collect()
    assert not os.path.exists(directory)


_CHILD = textwrap.dedent(
    """
    import os, sys, time, torch
    sys.path.insert(0, {root!r})
    from gpubuf.storages.memmap import LazyMemmapStorage
    storage = LazyMemmapStorage(1000{extra})
    storage.set(range(10), torch.ones(10, 4))
    print(storage.scratch_dir, flush=True)
    sys.stdin.readline()  # the parent has seen the files
    print("tail", flush=True)
    {tail}
    """
)


class _Child:
    """A Python process that makes a storage, reports its directory, then runs ``tail`` when told."""

    def __init__(self, tail: str, extra: str = "") -> None:
        code = _CHILD.format(root=ROOT, extra=extra, tail=tail)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.directory: str | None = None

    def ready(self) -> str:
        """Waits for the storage's files, lets the child go on to its tail, returns the directory."""
        self.directory = self.proc.stdout.readline().strip()
        assert self.directory, self.proc.stderr.read()
        assert os.path.isfile(os.path.join(self.directory, "tensor.memmap"))
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "tail", self.proc.stderr.read()  # it reached its tail
        return self.directory


@pytest.fixture(scope="module")
def children(tmp_path_factory):
    # Started together: each pays the interpreter and torch start-up, once, side by side.
    keep = tmp_path_factory.mktemp("keep") / "storage"
    started = {
        "exit": _Child("pass"),
        "sigterm": _Child("time.sleep(60)"),
        "sigint": _Child("time.sleep(60)"),
        "user_dir": _Child("pass", extra=f", scratch_dir={str(keep)!r}"),
    }
    yield started
    for child in started.values():
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()


def test_cleanup_at_normal_exit(children):
    child = children["exit"]
    directory = child.ready()
    assert child.proc.wait(timeout=300) == 0
    assert not os.path.exists(directory)


def test_cleanup_when_killed_with_sigterm(children):
    child = children["sigterm"]
    directory = child.ready()
    child.proc.send_signal(signal.SIGTERM)
    assert child.proc.wait(timeout=300) == -signal.SIGTERM  # still dies of SIGTERM
    assert not os.path.exists(directory)


def test_cleanup_on_ctrl_c(children):
    child = children["sigint"]
    directory = child.ready()
    child.proc.send_signal(signal.SIGINT)
    child.proc.wait(timeout=300)
    assert "KeyboardInterrupt" in child.proc.stderr.read()
    assert not os.path.exists(directory)


def test_no_cleanup_of_a_user_dir_at_exit(children):
    child = children["user_dir"]
    directory = child.ready()
    assert child.proc.wait(timeout=300) == 0
    assert os.path.isfile(os.path.join(directory, "tensor.memmap"))


# --------------------------------------------------------------------------------- bad input, faults
def test_existing_files_with_existsok_false(tmp_path):
    first = LazyMemmapStorage(10, scratch_dir=tmp_path / "s")
    first.set(range(3), ted_rows(3))
    second = LazyMemmapStorage(10, scratch_dir=tmp_path / "s")
    with pytest.raises(StorageExistsError) as info:
        second.set(range(3), ted_rows(3, 100))
    assert isinstance(info.value, FileExistsError) and isinstance(info.value, GpubufError)
    assert not second.initialized and len(second) == 0
    # The first storage's rows are untouched.
    assert torch.equal(first.get(slice(0, 3))["next", "reward"].squeeze(-1), torch.arange(3.0))
    assert len(first) == 3


def test_existing_files_with_existsok_true_are_reused(tmp_path):
    first = LazyMemmapStorage(10, scratch_dir=tmp_path / "s")
    first.set(range(3), ted_rows(3))
    del first
    again = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", existsok=True)
    assert len(again) == 0
    again.set(range(2), ted_rows(2, 50))
    assert len(again) == 2
    assert torch.equal(again.get(1)["next", "reward"], torch.tensor([51.0]))


def test_scratch_dir_under_a_file_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ScratchDirError) as info:
        LazyMemmapStorage(10, scratch_dir=blocker / "sub")
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOTDIR


def _try_read_only_dir(path: str) -> str:
    try:
        LazyMemmapStorage(10, scratch_dir=os.path.join(path, "sub"))
    except ScratchDirError as err:
        return f"ScratchDirError {err.errno}"
    return "no error"


def test_scratch_dir_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        if os.geteuid() != 0:
            assert _try_read_only_dir(str(locked)).startswith("ScratchDirError")
        else:
            # root writes anywhere: check as an unprivileged user, in a child process.
            # The child imports this module, so it needs this folder and tests/ (for helpers) on its path.
            here = os.path.dirname(os.path.abspath(__file__))
            code = (
                f"import os, sys; sys.path.insert(0, {ROOT!r}); sys.path.insert(0, {os.path.dirname(here)!r}); "
                f"sys.path.insert(0, {here!r}); "
                f"import test_memmap as t; os.setgid(65534); os.setuid(65534); "
                f"print(t._try_read_only_dir({str(locked)!r}))"
            )
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
            assert out.stdout.strip() == f"ScratchDirError {errno.EACCES}", out.stderr
    finally:
        locked.chmod(0o755)


def test_scratch_dir_refused_at_first_write_leaves_storage_empty(tmp_path, monkeypatch):
    storage = LazyMemmapStorage(10, scratch_dir=tmp_path / "s")
    real = _memmap_files.create_file

    def denied(path, nbytes, *, exclusive):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(_memmap_files, "create_file", denied)
    with pytest.raises(ScratchDirError):
        storage.set(range(2), ted_rows(2))
    assert not storage.initialized and len(storage) == 0
    assert [n for n in _files_under(str(tmp_path)) if n.endswith(".memmap")] == []
    monkeypatch.setattr(_memmap_files, "create_file", real)
    storage.set(range(2), ted_rows(2))
    assert len(storage) == 2


def test_disk_full_at_creation(tmp_path, monkeypatch):
    rb = gpubuf.ReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "s"))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_memmap_files, "allocate_blocks", full)
    with pytest.raises(DiskFullError) as info:
        rb.storage.set(range(5), ted_rows(5))
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert not rb.storage.initialized and len(rb) == 0
    assert [n for n in _files_under(str(tmp_path)) if n.endswith(".memmap")] == []


def test_disk_full_keeps_stored_rows_intact(tmp_path, monkeypatch):
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "s"), batch_size=8)
    rb.extend(ted_rows(40))
    before = rb[:].clone()
    calls = []

    def full(fd, offset, length):
        calls.append((offset, length))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_memmap_files, "allocate_blocks", full)
    batch = ted_rows(30, 1000)
    with pytest.raises(DiskFullError):
        rb.extend(batch)
    with pytest.raises(DiskFullError):
        rb.add(ted_rows(1, 2000)[0])
    with pytest.raises(DiskFullError):
        rb.storage.set(torch.arange(50, 60), ted_rows(10, 3000))
    assert calls  # the writes asked for blocks before copying anything
    assert len(rb) == 40 and rb.write_count == 40 and rb.writer._cursor == 40
    assert "index" not in batch.keys()
    after = rb[:]
    for key in before.keys(True, True):
        assert torch.equal(before[key], after[key]), key
    rb.sample()  # still readable
    monkeypatch.undo()  # space is back
    rb.extend(ted_rows(30, 1000))
    assert len(rb) == 70 and int(rb[69]["next", "reward"]) == 1029


def test_rejected_batch_changes_nothing(tmp_path):
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(100, scratch_dir=tmp_path / "s"))
    rb.extend(ted_rows(10))
    bad = ted_rows(5)
    bad["observation"] = bad["observation"].double()
    with pytest.raises(DTypeMismatchError):
        rb.extend(bad)
    missing = ted_rows(5).exclude("action")
    with pytest.raises(SchemaMismatchError):
        rb.extend(missing)
    assert len(rb) == 10 and rb.write_count == 10 and rb.writer._cursor == 10
    assert rb.storage._write_state.alloc_rows == 10


def test_reading_an_empty_storage_raises(tmp_path):
    with pytest.raises(EmptyBufferError):
        LazyMemmapStorage(10, scratch_dir=tmp_path / "s").get(0)


def test_shared_init_with_another_capacity_is_refused(tmp_path):
    LazyMemmapStorage(10, scratch_dir=tmp_path / "s", shared_init=True)
    with pytest.raises(StorageMismatchError):
        LazyMemmapStorage(11, scratch_dir=tmp_path / "s", shared_init=True)


def test_shared_init_with_another_layout_is_refused(tmp_path):
    a = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", shared_init=True)
    b = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", shared_init=True)
    a.set(range(2), ted_rows(2))
    with pytest.raises(SchemaMismatchError):
        b.set(range(2), TensorDict({"x": torch.ones(2, 3)}, [2]))
    with pytest.raises(UnsupportedDataError):
        gpubuf.ReplayBuffer(storage=b).extend(torch.ones(2, 3))
    assert len(a) == len(b) == 2 and a._write_state.cursor == 0


def test_attaching_with_another_layout_is_refused(tmp_path):
    a = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", shared_init=True)
    b = LazyMemmapStorage(10, scratch_dir=tmp_path / "s", shared_init=True)
    a.set(range(2), ted_rows(2))
    # b maps the files with the layout of its own first batch, checked against the one on disk.
    with pytest.raises(StorageMismatchError):
        b._append_rows(torch.ones(2, 3))
    assert not b.initialized or b.layout.kind == "tensordict"
    assert len(a) == 2


# ------------------------------------------------------------------------------------------- scale
def _sparse_fill_and_sample(tmp_path, capacity: int, rows: int, chunk: int) -> None:
    rb = gpubuf.ReplayBuffer(storage=LazyMemmapStorage(capacity, scratch_dir=tmp_path / "big"), batch_size=4096)
    for start in range(0, rows, chunk):
        rb.extend(ted_rows(min(chunk, rows - start), start))
    files = rb.storage.files
    size = sum(os.path.getsize(p) for p in files.values())
    allocated = sum(os.stat(p).st_blocks * 512 for p in files.values())
    assert size == capacity * TED_ROW_BYTES
    # Blocks exist for the rows written (plus file-system rounding), not for the capacity.
    assert allocated < 2 * rows * TED_ROW_BYTES + 64 * 2**20
    assert allocated < size / 20
    batch = rb.sample()
    ids = batch["next", "reward"].squeeze(-1).long()
    assert int(ids.max()) < rows
    assert torch.equal(batch["observation"][:, 0].long(), ids)
    rb.storage.cleanup()


def test_sparse_files_quick(tmp_path):
    _sparse_fill_and_sample(tmp_path, capacity=2_000_000, rows=20_000, chunk=10_000)


@pytest.mark.slow
def test_sparse_files_1e8_rows(tmp_path):
    # 10^8 rows of 292 B is 29.2 GB of files; only the rows written get blocks.
    _sparse_fill_and_sample(tmp_path, capacity=100_000_000, rows=3_000_000, chunk=100_000)
