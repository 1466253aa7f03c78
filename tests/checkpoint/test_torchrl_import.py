"""Migration: checkpoints written by TorchRL's ``ReplayBuffer.dumps`` load into gpubuf buffers.

The checkpoints are written here, by TorchRL itself, with its plain (pure Python) classes. Where
TorchRL's parts cannot load in this environment (its C++ extension, which prioritized sampling
needs), the test is skipped and says why. The next samples must match TorchRL's own under the
same generator state; nothing is ever unpickled (TorchRL's ``prefetch.pkl`` is skipped with a
warning).
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from ckpt_helpers import RewardData, assert_same, snapshot
from tensordict import TensorDict

import gpubuf
from gpubuf import LazyTensorStorage, RandomSampler, ReplayBuffer, SamplerWithoutReplacement, TensorDictReplayBuffer
from gpubuf.checkpoint import CheckpointMismatchError, CheckpointWarning, UnsafeCheckpointError

trl = pytest.importorskip("torchrl.data", reason="TorchRL is not installed: the migration tests need it to write checkpoints")


def _refuse_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


def _data(kind: str, n: int, start: int = 0):
    base = torch.arange(start, start + n, dtype=torch.float32)
    if kind == "tensor":
        return torch.stack([base, base * 2, -base], -1)
    if kind == "tensordict":
        return TensorDict({"obs": base.unsqueeze(-1).expand(n, 4).clone(), "a.b": base.long(),
                           "next": {"obs": base.unsqueeze(-1) + 1, "bf": base.to(torch.bfloat16)}}, [n])
    if kind == "tensorclass":
        return RewardData(input_ids=base.long().unsqueeze(-1).expand(n, 3).clone(), attention_mask=torch.ones(n, 3, dtype=torch.bool),
                          rewards=base.unsqueeze(-1), end_scores=base, batch_size=[n])
    raise ValueError(kind)


def _pair(tmp_path, trl_storage, gpubuf_storage, *, sampler="random", kind="tensordict", ndim=1, n=11, cls="rb"):
    """Fills a TorchRL buffer, dumps it, loads it into a fresh gpubuf buffer; returns both."""
    samplers = {"random": (trl.RandomSampler, RandomSampler), "swr": (trl.SamplerWithoutReplacement, SamplerWithoutReplacement)}
    trl_cls, gb_cls = (trl.ReplayBuffer, ReplayBuffer) if cls == "rb" else (trl.TensorDictReplayBuffer, TensorDictReplayBuffer)
    theirs = trl_cls(storage=trl_storage, sampler=samplers[sampler][0](), batch_size=3,
                     generator=torch.Generator().manual_seed(0))
    data = _data(kind, n)
    if ndim == 2:
        data = data.reshape(n // 2, 2) if isinstance(data, TensorDict) else data[: (n // 2) * 2].reshape(n // 2, 2, -1)
    theirs.extend(data)
    theirs.sample()
    path = tmp_path / "torchrl_ckpt"
    theirs.dumps(path)
    ours = gb_cls(storage=gpubuf_storage, sampler=samplers[sampler][1](), batch_size=3,
                  generator=torch.Generator().manual_seed(123), dim_extend=0 if ndim == 2 else None)
    return theirs, ours, path


def _load(ours, path, monkeypatch):
    _refuse_pickle(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours.loads(path)
    monkeypatch.undo()
    messages = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any("prefetch.pkl" in m and "not read" in m for m in messages), messages
    return messages


def _same_next_samples(theirs, ours, n=4):
    for _ in range(n):
        a, b = theirs.sample(), ours.sample()
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(a, (tuple, dict, list)):
            la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
            assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))
        else:
            ta = a if isinstance(a, TensorDict) else a._tensordict
            tb = b if isinstance(b, TensorDict) else b._tensordict
            for key in ta.keys(True, True):
                if key == "index":
                    continue
                assert torch.equal(ta.get(key), tb.get(key)), key


@pytest.mark.parametrize("memmap", [False, True], ids=["LazyTensorStorage", "LazyMemmapStorage"])
@pytest.mark.parametrize("sampler", ["random", "swr"])
@pytest.mark.parametrize("kind", ["tensor", "tensordict", "tensorclass"])
def test_torchrl_checkpoint_loads(tmp_path, monkeypatch, memmap, sampler, kind):
    trl_storage = trl.LazyMemmapStorage(16, scratch_dir=tmp_path / "scratch") if memmap else trl.LazyTensorStorage(16)
    theirs, ours, path = _pair(tmp_path, trl_storage, LazyTensorStorage(16), sampler=sampler, kind=kind)
    _load(ours, path, monkeypatch)
    assert len(ours) == len(theirs)
    assert ours.writer._cursor == theirs._writer._cursor and ours.write_count == theirs._writer._write_count
    assert ours.batch_size == 3
    assert torch.equal(ours._rng.get_state(), theirs._rng.get_state())
    rows = ours[: len(ours)]
    expected = theirs[: len(theirs)]
    if isinstance(rows, torch.Tensor):
        assert torch.equal(rows, expected)
    else:
        assert_same(rows if isinstance(rows, TensorDict) else rows._tensordict.exclude("index"),
                    expected if isinstance(expected, TensorDict) else expected._tensordict)
    _same_next_samples(theirs, ours)


def test_torchrl_ndim2_and_wrapped_ring(tmp_path, monkeypatch):
    theirs, ours, path = _pair(tmp_path, trl.LazyTensorStorage(12, ndim=2), LazyTensorStorage(12, ndim=2), ndim=2, n=20)
    _load(ours, path, monkeypatch)
    assert len(ours) == len(theirs)
    _same_next_samples(theirs, ours)


def test_torchrl_tensordict_replay_buffer(tmp_path, monkeypatch):
    theirs, ours, path = _pair(tmp_path, trl.LazyTensorStorage(16), LazyTensorStorage(16), sampler="swr", cls="td")
    _load(ours, path, monkeypatch)
    _same_next_samples(theirs, ours)


def test_torchrl_pytree_needs_an_initialized_target(tmp_path, monkeypatch):
    theirs = trl.ReplayBuffer(storage=trl.LazyTensorStorage(8), batch_size=2, generator=torch.Generator().manual_seed(0))
    theirs.extend((torch.arange(5.0), {"x": torch.arange(5), "y": torch.ones(5, 2)}))
    theirs.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2)
    _refuse_pickle(monkeypatch)
    with pytest.raises(CheckpointMismatchError, match="structure"):
        fresh.loads(tmp_path / "c")
    monkeypatch.undo()
    fresh.extend((torch.zeros(1), {"x": torch.zeros(1, dtype=torch.long), "y": torch.zeros(1, 2)}))
    _load(fresh, tmp_path / "c", monkeypatch)
    _same_next_samples(theirs, fresh)


def test_torchrl_checkpoint_with_planted_pickle_is_refused(tmp_path, monkeypatch):
    theirs, ours, path = _pair(tmp_path, trl.LazyTensorStorage(16), LazyTensorStorage(16))
    (path / "storage" / "extra_state.pt").write_bytes(pickle.dumps({"x": 1}))
    ours.extend(_data("tensordict", 2, 50))
    before = snapshot(ours)
    _refuse_pickle(monkeypatch)
    with pytest.raises(UnsafeCheckpointError):
        ours.loads(path)
    monkeypatch.undo()
    assert_same(snapshot(ours), before)


def test_torchrl_symlink_escape_is_refused(tmp_path, monkeypatch):
    theirs, ours, path = _pair(tmp_path, trl.LazyTensorStorage(16), LazyTensorStorage(16), kind="tensor")
    leaf = path / "storage" / "_-single-tensor-_.memmap"
    outside = tmp_path / "outside.memmap"
    outside.write_bytes(leaf.read_bytes())
    leaf.unlink()
    leaf.symlink_to(outside)
    _refuse_pickle(monkeypatch)
    with pytest.raises(UnsafeCheckpointError):
        ours.loads(path)


def test_torchrl_truncated_memmap_is_refused(tmp_path, monkeypatch):
    from gpubuf.checkpoint import CheckpointCorruptError

    theirs, ours, path = _pair(tmp_path, trl.LazyTensorStorage(16), LazyTensorStorage(16), kind="tensor")
    leaf = path / "storage" / "_-single-tensor-_.memmap"
    leaf.write_bytes(leaf.read_bytes()[:-4])
    _refuse_pickle(monkeypatch)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ours.loads(path)


def test_torchrl_prioritized_checkpoint(tmp_path, monkeypatch):
    try:
        sampler = trl.PrioritizedSampler(16, alpha=0.7, beta=0.5)
        theirs = trl.ReplayBuffer(storage=trl.LazyTensorStorage(16), sampler=sampler, batch_size=3)
        theirs.extend(torch.arange(10.0))
        theirs.update_priority(torch.arange(10), torch.arange(10.0) + 1)
    except Exception as err:  # the sum tree is TorchRL's C++ extension
        pytest.skip(f"TorchRL's PrioritizedSampler cannot run here ({type(err).__name__}: {str(err)[:120]}); "
                    "the import of its checkpoints is covered with hand-written files in test_components.py")
    from gpubuf.samplers.prioritized import PrioritizedSampler

    theirs.dumps(tmp_path / "c")
    ours = ReplayBuffer(storage=LazyTensorStorage(16), sampler=PrioritizedSampler(16, 0.7, 0.5), batch_size=3)
    _load(ours, tmp_path / "c", monkeypatch)
    leaves = ours.sampler.tree.values()
    assert torch.allclose(leaves[:10].double(), (torch.arange(10.0, dtype=torch.float64) + 1 + 1e-8) ** 0.7, rtol=1e-5)


def test_public_names_match_torchrl():
    import gpubuf.checkpoint as ckpt

    for name in ("TensorStorageCheckpointer", "FlatStorageCheckpointer", "NestedStorageCheckpointer",
                 "H5StorageCheckpointer", "ListStorageCheckpointer", "CompressedListStorageCheckpointer",
                 "StorageEnsembleCheckpointer"):
        assert hasattr(ckpt, name) and hasattr(trl, name), name
    assert gpubuf.checkpoint.StorageCheckpointerBase
