"""Migration: a TorchRL ``CompressedListStorage`` checkpoint (``ReplayBuffer.dumps``) loads into gpubuf's.

TorchRL writes the checkpoint here. Its compressed items are taken over as they are (no
recompression); gpubuf then returns TorchRL's items bit for bit and draws TorchRL's next samples
under the restored generator. Nothing is unpickled.
"""

from __future__ import annotations

import json
import pickle
import warnings

import pytest
import torch
from tensordict import TensorDict

from gpubuf import CompressedListStorage, LazyTensorStorage, ReplayBuffer
from gpubuf.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from gpubuf.errors import CorruptRowError

trl = pytest.importorskip("torchrl.data", reason="TorchRL is not installed: the migration tests need it to write checkpoints")


def _data(kind: str, n: int):
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 4, (n, 4, 6, 6), dtype=torch.uint8, generator=g)  # runs: compressible
    if kind == "tensor":
        return frames
    return TensorDict({"obs": frames, "reward": torch.randn(n, generator=g), "action": torch.arange(n)}, [n])


def _dumped(tmp_path, kind: str = "tensordict", n: int = 9):
    theirs = trl.ReplayBuffer(storage=trl.CompressedListStorage(12), batch_size=4, generator=torch.Generator().manual_seed(0))
    theirs.extend(_data(kind, n))
    theirs.sample()
    path = tmp_path / "torchrl_ckpt"
    theirs.dumps(path)
    return theirs, path


def _load(buffer, path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prefetch.pkl is skipped with a warning (see test_torchrl_import)
        buffer.loads(path)
    monkeypatch.undo()


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("kind", ["tensor", "tensordict"])
def test_torchrl_compressed_list_checkpoint_loads(tmp_path, monkeypatch, kind):
    theirs, path = _dumped(tmp_path, kind)
    ours = ReplayBuffer(storage=CompressedListStorage(12), batch_size=4, generator=torch.Generator().manual_seed(5))
    _load(ours, path, monkeypatch)
    assert len(ours) == len(theirs) == 9
    assert ours.storage.mode == "items"
    assert ours.writer._cursor == theirs._writer._cursor
    # The compressed bytes are TorchRL's, unchanged.
    for mine, saved in zip(ours.storage._storage, theirs.storage._storage):
        for x, y in ([(mine, saved)] if kind == "tensor" else [(mine[k], saved[k]) for k in saved]):
            assert torch.equal(x, y)
    for i in range(9):
        _same(ours.storage.get(i), theirs.storage.get(i))
    for _ in range(3):
        _same(ours.sample(), theirs.sample())
    ours.extend(_data(kind, 3))  # the storage goes on from TorchRL's cursor
    assert len(ours) == 12


def test_torchrl_compressed_list_corrupt_item_is_refused_at_load(tmp_path, monkeypatch):
    _, path = _dumped(tmp_path)
    index = json.loads((path / "storage" / "data_indices.json").read_text())[4]
    leaf = path / "storage" / "compressed_data" / str(index) / "obs.memmap"
    raw = bytearray(leaf.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    leaf.write_bytes(bytes(raw))
    ours = ReplayBuffer(storage=CompressedListStorage(12), batch_size=4)
    before = ours.storage.state_dict()
    # TorchRL records no checksum: every item is decoded once at load, so a corrupt one is named
    # there and nothing is loaded.
    with pytest.raises(CheckpointMismatchError, match="item 4") as err:
        _load(ours, path, monkeypatch)
    assert CorruptRowError.__name__ in str(err.value)
    assert ours.storage.state_dict() == before and len(ours) == 0


def test_torchrl_compressed_list_inconsistent_files_are_refused(tmp_path, monkeypatch):
    _, path = _dumped(tmp_path)
    meta_file = path / "storage" / "metadata.json"
    metadata = json.loads(meta_file.read_text())
    ours = ReplayBuffer(storage=CompressedListStorage(12), batch_size=4)
    before = ours.storage.state_dict()

    metadata[2]["fields"]["extra"] = metadata[2]["fields"]["obs"]
    meta_file.write_text(json.dumps(metadata))
    with pytest.raises(CheckpointCorruptError, match="extra"):
        _load(ours, path, monkeypatch)

    del metadata[2]["fields"]["extra"]
    metadata[2]["fields"]["obs"]["dtype"]["value"] = "__import__('os')"
    meta_file.write_text(json.dumps(metadata))
    with pytest.raises(CheckpointCorruptError, match="dtype"):
        _load(ours, path, monkeypatch)

    meta_file.write_text(json.dumps(metadata[:-1]))
    with pytest.raises(CheckpointCorruptError, match="one length"):
        _load(ours, path, monkeypatch)
    assert ours.storage.state_dict() == before and len(ours) == 0


def test_torchrl_compressed_list_into_another_storage_is_refused(tmp_path, monkeypatch):
    _, path = _dumped(tmp_path)
    ours = ReplayBuffer(storage=LazyTensorStorage(12), batch_size=4)
    with pytest.raises(CheckpointMismatchError):
        _load(ours, path, monkeypatch)
    assert len(ours) == 0
