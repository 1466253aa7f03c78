"""Checkpointer classes and component codecs: TED compaction (flat, nested, HDF5), hooks,
storages on their own, memory-mapped storages (zero copy), prioritized samplers, progress bars."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same, make_items, same_batches, snapshot
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, SamplerWithoutReplacement
from gpubuf.checkpoint.format import seal_meta
from gpubuf.checkpoint import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    ListStorageCheckpointer,
    NestedStorageCheckpointer,
    NotACheckpointError,
    TensorStorageCheckpointer,
)


# ---------------------------------------------------------------------- TED data
def ted_batch(steps: int, envs: int | None, start: int) -> TensorDict:
    """Trajectories of lengths 1..5 (per env column), observation ``t`` continuing into ``next``."""
    lead = (steps,) if envs is None else (steps, envs)
    cols = 1 if envs is None else envs
    obs = torch.empty(steps, cols, 3)
    nxt = torch.empty(steps, cols, 3)
    done = torch.zeros(steps, cols, 1, dtype=torch.bool)
    for c in range(cols):
        value, left = float(start * 100 + c * 1000), 1 + (start + c) % 5
        for t in range(steps):
            obs[t, c] = value + torch.arange(3)
            left -= 1
            if left == 0:
                done[t, c] = True
                nxt[t, c] = -value - torch.arange(3)  # terminal observation, then a reset
                value, left = value + 50.0, 1 + (t + c) % 5
            else:
                value += 1.0
                nxt[t, c] = value + torch.arange(3)
    shape = lambda x: x.reshape(*lead, *x.shape[2:])  # noqa: E731
    return TensorDict(
        {
            "observation": shape(obs),
            "action": shape(torch.arange(steps * cols).view(steps, cols) % 4),
            "done": torch.zeros(*lead, 1, dtype=torch.bool),
            "terminated": torch.zeros(*lead, 1, dtype=torch.bool),
            "next": {"observation": shape(nxt), "done": shape(done), "terminated": shape(done.clone()),
                     "reward": shape(torch.rand(steps, cols, 1))},
        },
        batch_size=lead,
    )


def ted_buffer(checkpointer, *, ndim: int = 1, seed: int = 0) -> ReplayBuffer:
    storage = LazyTensorStorage(24 if ndim == 1 else 24 * 3, ndim=ndim)
    storage.checkpointer = checkpointer
    return ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=4,
                        generator=torch.Generator().manual_seed(seed), dim_extend=0)


CHECKPOINTERS = {
    "flat": FlatStorageCheckpointer,
    "nested": NestedStorageCheckpointer,
    "h5": lambda: H5StorageCheckpointer(h5_kwargs={"compression": "gzip"}),
}


@pytest.mark.parametrize("name", list(CHECKPOINTERS))
@pytest.mark.parametrize("ndim,wrap", [(1, False), (1, True), (2, True)])
def test_ted_checkpointers_round_trip(tmp_path, name, ndim, wrap):
    pytest.importorskip("h5py") if name == "h5" else None
    rb = ted_buffer(CHECKPOINTERS[name](), ndim=ndim)
    envs = None if ndim == 1 else 3
    rb.extend(ted_batch(13, envs, 0))
    if wrap:
        rb.extend(ted_batch(17, envs, 7))
    rb.sample()
    rb.dumps(tmp_path / "c")
    fresh = ted_buffer(CHECKPOINTERS[name](), ndim=ndim, seed=9)
    fresh.loads(tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))
    same_batches(rb, fresh)
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    compact = meta["components"]["storage"]["state"]["compact"]
    assert compact["paired"] == [["observation"]]
    assert ["done"] in compact["zero"] and ["terminated"] in compact["zero"]
    rows = compact["rows"] * compact["columns"]
    paired = meta["arrays"]["storage/paired_0"]["shape"][0]
    assert rows < paired < 2 * rows, "each observation is written once, plus one per run end"
    if name == "h5":
        import h5py

        with h5py.File(tmp_path / "c" / "storage" / "checkpoint.h5") as f:
            assert "paired_0" in f


def test_ted_compaction_is_lossless_when_the_conventions_do_not_hold(tmp_path):
    rb = ted_buffer(FlatStorageCheckpointer())
    data = ted_batch(10, None, 0)
    data["next", "observation"] = torch.randn(10, 3)  # no step continues into the next
    data["done"][3] = True  # a root done that is not all False is kept
    rb.extend(data)
    rb.dumps(tmp_path / "c")
    fresh = ted_buffer(FlatStorageCheckpointer(), seed=3)
    fresh.loads(tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))


def test_flat_checkpointer_on_data_without_next_writes_it_whole(tmp_path):
    rb = ted_buffer(FlatStorageCheckpointer())
    rb.extend(make_items("tensordict", 5).exclude("next"))
    rb.dumps(tmp_path / "c")
    fresh = ted_buffer(FlatStorageCheckpointer())
    fresh.loads(tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))


def test_compact_checkpoint_needs_the_same_checkpointer(tmp_path):
    rb = ted_buffer(FlatStorageCheckpointer())
    rb.extend(ted_batch(6, None, 0))
    rb.dumps(tmp_path / "c")
    plain = ted_buffer(TensorStorageCheckpointer())
    with pytest.raises(CheckpointMismatchError):
        plain.loads(tmp_path / "c")


def test_corrupt_run_lengths_are_refused(tmp_path):
    rb = ted_buffer(NestedStorageCheckpointer())
    rb.extend(ted_batch(9, None, 0))
    rb.dumps(tmp_path / "c")
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["components"]["storage"]["state"]["compact"]["rows"] += 1
    meta_path.write_text(json.dumps(seal_meta(meta)))  # a checkpoint as that machine wrote it
    with pytest.raises(CheckpointCorruptError):
        ted_buffer(NestedStorageCheckpointer()).loads(tmp_path / "c")


# ---------------------------------------------------------------------- hooks, storages alone
def test_save_and_load_hooks(tmp_path):
    seen = {}

    def save_hook(data, path=None):
        seen["path"] = path
        return data.apply(lambda x: x * 2 if x.dtype.is_floating_point else x)

    def load_hook(data, out=None):
        return data.apply(lambda x: x / 2 if x.dtype.is_floating_point else x)

    rb = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    rb.storage.register_save_hook(save_hook)
    rb.extend(TensorDict({"x": torch.arange(5.0), "i": torch.arange(5)}, [5]))
    rb.dumps(tmp_path / "c")
    assert seen["path"] is not None and not Path(seen["path"]).exists(), "the hook's scratch dir is removed"
    fresh = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    fresh.storage.register_load_hook(load_hook)
    fresh.loads(tmp_path / "c")
    assert torch.equal(fresh[:5]["x"], torch.arange(5.0)) and torch.equal(fresh[:5]["i"], torch.arange(5))
    unhooked = ReplayBuffer(storage=LazyTensorStorage(8))
    unhooked.loads(tmp_path / "c")
    assert torch.equal(unhooked[:5]["x"], torch.arange(5.0) * 2)  # what was written is the hook's output


def test_checkpointer_dumps_and_loads_a_storage_alone(tmp_path):
    storage = LazyTensorStorage(6)
    storage.set(range(4), TensorDict({"a": torch.arange(4.0)}, [4]))
    TensorStorageCheckpointer().dumps(storage, tmp_path / "s")
    other = LazyTensorStorage(6)
    TensorStorageCheckpointer().loads(other, tmp_path / "s")
    assert len(other) == 4 and torch.equal(other.get(slice(0, 4))["a"], torch.arange(4.0))
    items = ListStorage(5)
    items.set(0, {"a": 1})
    items.set(1, torch.ones(2))
    ListStorageCheckpointer().dumps(items, tmp_path / "l")
    loaded = ListStorage(5)
    ListStorageCheckpointer().loads(loaded, tmp_path / "l")
    assert loaded.get(0) == {"a": 1} and torch.equal(loaded.get(1), torch.ones(2))
    with pytest.raises(CheckpointMismatchError):
        # A storage checkpoint is not a buffer's.
        ReplayBuffer(storage=LazyTensorStorage(6)).loads(tmp_path / "s")


def test_foreign_checkpointer_object_is_refused(tmp_path):
    class NotOurs:
        def dumps(self, storage, path):
            raise AssertionError

    storage = LazyTensorStorage(4)
    storage.checkpointer = NotOurs()
    rb = ReplayBuffer(storage=storage)
    rb.extend(torch.ones(2, 2))
    with pytest.raises(CheckpointMismatchError):
        rb.dumps(tmp_path / "c")


# ---------------------------------------------------------------------- memory-mapped storages
try:
    from gpubuf.storages import memmap
except ImportError:
    memmap = None
needs_memmap = pytest.mark.skipif(memmap is None, reason="LazyMemmapStorage is not available in this gpubuf")


def _memmap_buffer(scratch, seed=0):
    return ReplayBuffer(storage=memmap.LazyMemmapStorage(16, scratch_dir=scratch), sampler=SamplerWithoutReplacement(),
                        batch_size=3, generator=torch.Generator().manual_seed(seed))


def _inodes(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.stat().st_ino for p in root.rglob("*.memmap")}


@needs_memmap
def test_memmap_dump_where_it_lives_copies_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    rb = _memmap_buffer(ckpt / "storage")
    data = TensorDict({"obs": torch.randn(12, 2048), ("next", "obs"): torch.randn(12, 2048)}, [12])
    rb.extend(data)
    rb.sample()
    inodes = _inodes(ckpt)
    rb.dumps(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["in_place"] is True
    storage_arrays = {n: a for n, a in meta["arrays"].items() if n.startswith("storage/")}
    assert {a["file"] for a in storage_arrays.values()} == {"storage/obs.memmap", "storage/next/obs.memmap"}
    assert all(meta["files"][a["file"]]["live"] for a in storage_arrays.values())
    assert _inodes(ckpt) == inodes, "the storage's files are listed, never rewritten"
    copied = sum(e["nbytes"] for e in meta["files"].values() if not e.get("live"))
    assert copied < data.bytes() / 4, "only the sampler, writer and generator state is written"

    # Loading into a fresh storage on the same directory maps the files in place.
    fresh = _memmap_buffer(ckpt / "storage", seed=5)
    fresh.loads(ckpt)
    assert fresh.storage.files == rb.storage.files
    assert_same(snapshot(fresh), snapshot(rb))
    same_batches(rb, fresh)

    # Into a storage elsewhere, or in memory, the rows are copied.
    elsewhere = _memmap_buffer(tmp_path / "other", seed=6)
    elsewhere.loads(ckpt)
    in_memory = ReplayBuffer(storage=LazyTensorStorage(16), sampler=SamplerWithoutReplacement(), batch_size=3)
    in_memory.loads(ckpt)
    for other in (elsewhere, in_memory):
        assert torch.equal(other[:12]["obs"], rb[:12]["obs"])

    # A second dump in place replaces the first; the previous generation goes.
    rb.extend(data[:2])
    rb.dumps(ckpt)
    generations = [p.name for p in ckpt.iterdir() if p.name.startswith(".gpubuf-ckpt-")]
    assert len(generations) == 1
    again = ReplayBuffer(storage=LazyTensorStorage(16), sampler=SamplerWithoutReplacement(), batch_size=3)
    again.loads(ckpt)
    assert len(again) == 14


@needs_memmap
def test_memmap_dump_elsewhere_copies_and_loads(tmp_path):
    rb = _memmap_buffer(tmp_path / "scratch")
    rb.extend(TensorDict({"obs": torch.randn(5, 4)}, [5]))
    rb.dumps(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "storage").is_dir() and not list((tmp_path / "ckpt").rglob("*.memmap"))
    fresh = _memmap_buffer(tmp_path / "scratch2", seed=1)
    fresh.loads(tmp_path / "ckpt")
    assert_same(snapshot(fresh), snapshot(rb))


@needs_memmap
def test_in_place_checkpoint_is_not_replaced_by_another_storage(tmp_path):
    ckpt = tmp_path / "ckpt"
    rb = _memmap_buffer(ckpt / "storage")
    rb.extend(TensorDict({"obs": torch.randn(5, 4)}, [5]))
    rb.dumps(ckpt)
    other = ReplayBuffer(storage=LazyTensorStorage(4))
    other.extend(torch.ones(2))
    with pytest.raises(NotACheckpointError, match="memory-mapped"):
        other.dumps(ckpt)
    assert (ckpt / "storage" / "obs.memmap").exists()


@needs_memmap
def test_memmap_in_place_refuses_foreign_files(tmp_path):
    ckpt = tmp_path / "ckpt"
    rb = _memmap_buffer(ckpt / "storage")
    rb.extend(TensorDict({"obs": torch.randn(5, 4)}, [5]))
    (ckpt / "notes.txt").write_text("mine")
    with pytest.raises(NotACheckpointError):
        rb.dumps(ckpt)
    assert (ckpt / "notes.txt").read_text() == "mine" and not (ckpt / "meta.json").exists()


@needs_memmap
def test_memmap_in_place_debris_of_a_killed_dump_is_ignored_then_removed(tmp_path):
    ckpt = tmp_path / "ckpt"
    rb = _memmap_buffer(ckpt / "storage")
    rb.extend(TensorDict({"obs": torch.randn(5, 4)}, [5]))
    rb.dumps(ckpt)
    debris = ckpt / ".gpubuf-ckpt-999999999-dead"  # a dump killed before its meta.json rename
    (debris / "rng").mkdir(parents=True)
    (debris / "rng" / "packed.bin").write_bytes(b"\0" * 10)
    fresh = ReplayBuffer(storage=LazyTensorStorage(16), sampler=SamplerWithoutReplacement(), batch_size=3)
    fresh.loads(ckpt)
    assert not debris.exists()
    assert len(fresh) == 5


# ---------------------------------------------------------------------- prioritized sampling
try:
    from gpubuf.samplers import prioritized
except ImportError:
    prioritized = None
needs_prioritized = pytest.mark.skipif(prioritized is None, reason="PrioritizedSampler is not available in this gpubuf")


def _prio_buffer(seed=0, capacity=40, **kwargs):
    return ReplayBuffer(storage=LazyTensorStorage(capacity), batch_size=5,
                        sampler=prioritized.PrioritizedSampler(capacity, 0.6, 0.4, **kwargs),
                        generator=torch.Generator().manual_seed(seed))


@needs_prioritized
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prioritized_tree_round_trip(tmp_path, dtype):
    rb = _prio_buffer(dtype=dtype)
    rb.extend(TensorDict({"x": torch.arange(33.0)}, [33]))
    for _ in range(3):
        _, info = rb.sample(return_info=True)
        rb.update_priority(info["index"], torch.rand(5) * 10)
    rb.dumps(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    tree = rb.sampler.tree
    for name, tensor in (("leaves", tree.leaves), ("sums", tree.sums), ("mins", tree.mins)):
        assert meta["arrays"][f"sampler/{name}"]["shape"] == list(tensor.shape), "the tree is written whole"
    fresh = _prio_buffer(seed=4, dtype=dtype)
    fresh.loads(tmp_path / "c")
    for name in ("leaves", "sums", "mins"):
        assert torch.equal(getattr(fresh.sampler.tree, name), getattr(tree, name))
    assert float(fresh.sampler._max_priority[0]) == float(rb.sampler._max_priority[0])
    for _ in range(4):
        (a, ia), (b, ib) = rb.sample(return_info=True), fresh.sample(return_info=True)
        assert torch.equal(ia["index"], ib["index"]) and torch.equal(ia["priority_weight"], ib["priority_weight"])


@needs_prioritized
def test_prioritized_mismatch_and_corrupt_tree(tmp_path):
    rb = _prio_buffer()
    rb.extend(TensorDict({"x": torch.arange(10.0)}, [10]))
    rb.update_priority(torch.arange(10), torch.arange(10.0))
    rb.dumps(tmp_path / "c")
    with pytest.raises(CheckpointMismatchError):
        _prio_buffer(capacity=41).loads(tmp_path / "c")
    with pytest.raises(CheckpointMismatchError):
        _prio_buffer(dtype=torch.float64).loads(tmp_path / "c")
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["components"]["sampler"]["state"]["alpha"] = -1
    meta_path.write_text(json.dumps(seal_meta(meta)))  # sealed: the value check itself refuses it
    target = _prio_buffer()
    before = snapshot(target)
    with pytest.raises(CheckpointCorruptError):
        target.loads(tmp_path / "c")
    assert_same(snapshot(target), before)


@needs_prioritized
def test_prioritized_torchrl_layout_is_imported(tmp_path):
    """A TorchRL PrioritizedSampler directory, written by hand (TorchRL's sum tree is C++): its
    leaves are the transformed priorities; the tree is rebuilt from them."""
    trl = pytest.importorskip("torchrl.data")
    theirs = trl.ReplayBuffer(storage=trl.LazyTensorStorage(16), batch_size=3)
    theirs.extend(torch.arange(6.0))
    path = tmp_path / "c"
    theirs.dumps(path)
    sampler_dir = path / "sampler"
    sampler_dir.mkdir()
    leaves = torch.zeros(16, dtype=torch.float64)
    leaves[:6] = (torch.arange(6, dtype=torch.float64) + 1 + 1e-8) ** 0.6
    leaves.numpy().tofile(sampler_dir / "sumtree.memmap")
    leaves.numpy().tofile(sampler_dir / "mintree.memmap")
    (sampler_dir / "sampler_metadata.json").write_text(json.dumps(
        {"_alpha": 0.6, "_beta": 0.4, "_eps": 1e-8, "_max_priority": [6.0, 5.0], "_max_capacity": 16.0, "_schema_version": 1}))
    ours = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=3,
                        sampler=prioritized.PrioritizedSampler(16, 0.6, 0.4))
    with pytest.warns(Warning, match="prefetch.pkl"):
        ours.loads(path)
    assert torch.allclose(ours.sampler.tree.values().double(), leaves, rtol=1e-6)
    assert float(ours.sampler.tree.total()) == pytest.approx(float(leaves.sum()), rel=1e-6)
    assert float(ours.sampler._max_priority[0]) == 6.0


# ---------------------------------------------------------------------- progress
def test_progress_bar_only_when_asked_or_in_a_terminal(tmp_path, monkeypatch, capsys):
    from gpubuf.checkpoint import progress

    rb = ReplayBuffer(storage=LazyTensorStorage(64))
    rb.extend(torch.randn(64, 1024))
    rb.dumps(tmp_path / "quiet")
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(progress, "MIN_BYTES", 1024)
    monkeypatch.setenv("GPUBUF_PROGRESS", "1")
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # the built-in bar
    rb.dumps(tmp_path / "loud")
    ReplayBuffer(storage=LazyTensorStorage(64)).loads(tmp_path / "loud")
    err = capsys.readouterr().err
    assert "gpubuf dump" in err and "gpubuf load" in err and "100%" in err
    monkeypatch.setenv("GPUBUF_PROGRESS", "0")
    rb.dumps(tmp_path / "off")
    assert capsys.readouterr().err == ""


def test_progress_follows_the_terminal(monkeypatch):
    from gpubuf.checkpoint import progress

    monkeypatch.delenv("GPUBUF_PROGRESS", raising=False)

    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            pass

        def flush(self):
            pass

    monkeypatch.setattr(progress.sys, "stderr", Tty())
    assert progress._wanted(progress.MIN_BYTES)
    assert not progress._wanted(progress.MIN_BYTES - 1)
    monkeypatch.setattr(progress.sys, "stderr", open(os.devnull, "w"))
    assert not progress._wanted(progress.MIN_BYTES)


# ---------------------------------------------------------------------- devices
def _written_on_cuda_7(path: Path) -> None:
    """A checkpoint of six rows and a generator, as a machine whose buffer lived on ``cuda:7`` wrote it."""
    rb = ReplayBuffer(storage=LazyTensorStorage(8, device="auto"), batch_size=2,
                      generator=torch.Generator().manual_seed(0))
    rb.extend(torch.arange(6.0))
    rb.dumps(path)
    meta_path = path / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["components"]["storage"]["state"]["device"] = "cuda:7"
    meta["buffer"]["rng"]["device"] = "cuda:7"
    meta_path.write_text(json.dumps(seal_meta(meta)))


def _loaded_on_the_cpu(path: Path) -> str:
    """Loads ``path`` into a fresh buffer, which must warn and hold the six rows on the CPU;
    returns the warnings' text."""
    from gpubuf.checkpoint import CheckpointWarning

    fresh = ReplayBuffer(storage=LazyTensorStorage(8, device="auto"), batch_size=2)
    with pytest.warns(CheckpointWarning) as caught:
        fresh.loads(path)
    assert fresh.storage._leaves[0].device.type == "cpu" and torch.equal(fresh[:6], torch.arange(6.0))
    return " ".join(str(w.message) for w in caught)


def test_checkpoint_from_a_gpu_machine_loads_on_the_cpu(tmp_path):
    _written_on_cuda_7(tmp_path / "c")
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    messages = _loaded_on_the_cpu(tmp_path / "c")
    assert "cuda:7" in messages and "CPU" in messages


def test_a_cuda_index_the_machine_lacks_counts_as_missing(tmp_path, monkeypatch):
    """On a machine with one GPU, a checkpoint written on ``cuda:7`` loads on the CPU with the
    warning (its generator state included), the way it does on a machine without CUDA."""
    from gpubuf.checkpoint.values import exists_here

    _written_on_cuda_7(tmp_path / "c")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert exists_here(torch.device("cuda:0")) and exists_here(torch.device("cuda"))
    assert not exists_here(torch.device("cuda:7"))
    messages = _loaded_on_the_cpu(tmp_path / "c")
    assert "generator on cuda:7" in messages and "CPU" in messages


@pytest.mark.gpu
def test_cuda_storage_and_tree_round_trip(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(64, device="cuda"), batch_size=8,
                      generator=torch.Generator(device="cuda").manual_seed(0))
    rb.extend(TensorDict({"obs": torch.randn(50, 300, device="cuda"), "i": torch.arange(50, device="cuda")}, [50]))
    rb.sample()
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(64, device="cuda"), batch_size=8,
                         generator=torch.Generator(device="cuda").manual_seed(1))
    fresh.loads(tmp_path / "c")
    assert fresh.storage._leaves[0].device.type == "cuda"
    assert_same(snapshot(fresh), snapshot(rb))
    same_batches(rb, fresh)
    if prioritized is not None:
        sampler = prioritized.PrioritizedSampler(64, 0.6, 0.4, device="cuda")
        rb = ReplayBuffer(storage=LazyTensorStorage(64, device="cuda"), sampler=sampler, batch_size=8)
        rb.extend(torch.arange(40.0, device="cuda"))
        rb.update_priority(torch.arange(40, device="cuda"), torch.rand(40, device="cuda"))
        rb.dumps(tmp_path / "p")
        fresh = ReplayBuffer(storage=LazyTensorStorage(64, device="cuda"), batch_size=8,
                             sampler=prioritized.PrioritizedSampler(64, 0.6, 0.4, device="cuda"))
        fresh.loads(tmp_path / "p")
        assert fresh.sampler.tree.device.type == "cuda"
        assert torch.equal(fresh.sampler.tree.sums, rb.sampler.tree.sums)
