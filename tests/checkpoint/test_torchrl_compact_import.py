"""TorchRL's compact checkpoints (Flat, Nested, H5) load into gpubuf buffers, and TorchRL's TED
hooks (``TED2Flat``, ``Flat2TED``, ...) give the same results in gpubuf.

The checkpoints are written here by TorchRL itself; nothing is unpickled when loading them.
"""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.checkpoint import CheckpointWarning

trl = pytest.importorskip("torchrl.data", reason="TorchRL writes the checkpoints of these tests")


def ted(n: int, start: int = 0, ends=(3,)) -> TensorDict:
    """``n`` TED steps whose ``("next", "obs")`` is the next step's ``"obs"`` within a trajectory."""
    obs = torch.arange(start, start + n + 1, dtype=torch.float32)
    done = torch.zeros(n, 1, dtype=torch.bool)
    for e in ends:
        if e < n:
            done[e] = True
    return TensorDict(
        {
            "obs": torch.stack([obs[:-1], -obs[:-1]], -1),
            "action": torch.arange(start, start + n),
            "done": torch.zeros(n, 1, dtype=torch.bool),
            "next": {"obs": torch.stack([obs[1:], -obs[1:]], -1), "done": done, "reward": obs[1:, None] / 2},
        },
        [n],
    )


def _refuse_pickle(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.mark.parametrize("checkpointer", ["FlatStorageCheckpointer", "NestedStorageCheckpointer", "H5StorageCheckpointer"])
@pytest.mark.parametrize("fill", ["partial", "wrapped"])
def test_torchrl_compact_checkpoint_loads(tmp_path, monkeypatch, checkpointer, fill):
    if checkpointer == "H5StorageCheckpointer":
        pytest.importorskip("h5py")
    theirs = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(10), checkpointer=getattr(trl, checkpointer)())
    theirs.extend(ted(7))
    if fill == "wrapped":
        theirs.extend(ted(6, start=20, ends=(2,)))
    theirs.dumps(tmp_path / "ckpt")
    reloaded = trl.ReplayBuffer(storage=trl.LazyMemmapStorage(10), checkpointer=getattr(trl, checkpointer)())
    reloaded.loads(tmp_path / "ckpt")

    ours = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(10))
    _refuse_pickle(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        ours.loads(tmp_path / "ckpt")
    monkeypatch.undo()
    assert len(ours) == len(theirs)
    assert ours.write_count == theirs.write_count
    expected, got = reloaded[:], ours[:]
    assert set(expected.keys(True, True)) == set(got.keys(True, True))
    for key in expected.keys(True, True):
        assert torch.equal(expected.get(key), got.get(key)), key
    # Where TED holds (every row but the newest one's "next" at the cursor), the rows are the originals.
    original = theirs[:]
    for key in ("obs", "action", ("next", "reward"), ("next", "done")):
        assert torch.equal(original.get(key), got.get(key)), key


@pytest.mark.parametrize("is_full", [False, True])
def test_ted_hooks_match_torchrl(tmp_path, is_full):
    data = ted(10, ends=(3, 6)) if is_full else ted(10, ends=(3,))
    shift = 4 if is_full else 7
    results = []
    for lib, name in ((trl, "torchrl"), (gpubuf, "gpubuf")):
        hook = lib.TED2Flat()
        hook.shift, hook.is_full = shift, is_full
        flat = hook(data.clone(), path=tmp_path / f"flat-{name}")
        back = lib.Flat2TED()(flat)
        results.append((flat, back))
    (t_flat, t_back), (g_flat, g_back) = results
    for key in t_flat.keys(True, True):
        if isinstance(t_flat.get(key), torch.Tensor):
            assert torch.equal(t_flat.get(key), g_flat.get(key)), key
    assert t_flat.get_non_tensor("shift") == g_flat.get_non_tensor("shift") == shift
    for key in t_back.keys(True, True):
        assert torch.equal(t_back.get(key), g_back.get(key)), key


def test_nested_and_h5_hooks_match_torchrl(tmp_path):
    data = ted(10, ends=(3,))
    nested = {}
    for lib, name in ((trl, "torchrl"), (gpubuf, "gpubuf")):
        hook = lib.TED2Nested()
        hook.shift, hook.is_full = 7, False
        nested[name] = hook(data.clone(), path=tmp_path / f"nested-{name}")
    t, g = nested["torchrl"], nested["gpubuf"]
    assert t.batch_size == g.batch_size
    split_t, split_g = trl.H5Split()(t), gpubuf.H5Split()(g)
    assert sorted(split_t.keys()) == sorted(split_g.keys())
    combined = gpubuf.H5Combine()(split_g)
    back_t, back_g = trl.Nested2TED()(t), gpubuf.Nested2TED()(combined)
    for key in back_t.keys(True, True):
        assert torch.equal(back_t.get(key), back_g.get(key)), key


@pytest.mark.parametrize("fill", ["partial", "wrapped"])
def test_ted_hooks_on_a_gpubuf_buffer_round_trip(tmp_path, fill):
    # TorchRL's documented usage: a save hook writes the flat layout, a load hook rebuilds TED.
    rb = gpubuf.ReplayBuffer(storage=gpubuf.LazyMemmapStorage(10, scratch_dir=tmp_path / "rows"))
    rb.register_save_hook(gpubuf.TED2Flat())
    rb.extend(ted(7))
    if fill == "wrapped":
        rb.extend(ted(6, start=20, ends=(2,)))
    rb.dumps(tmp_path / "ckpt")
    loaded = gpubuf.ReplayBuffer(storage=gpubuf.LazyMemmapStorage(10, scratch_dir=tmp_path / "rows2"))
    loaded.register_load_hook(gpubuf.Flat2TED())
    loaded.loads(tmp_path / "ckpt")
    original, got = rb[:], loaded[:]
    for key in ("obs", "action", ("next", "reward"), ("next", "done")):
        assert torch.equal(original.get(key), got.get(key)), key
