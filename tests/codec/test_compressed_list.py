"""CompressedListStorage behaves like torchrl.data.CompressedListStorage on the same calls."""

from __future__ import annotations

import warnings
import zlib

import pytest
import torch
from tensordict import TensorDict

from gpubuf.buffers import ReplayBuffer
from gpubuf.storages.compressed import CompressedListStorage

torchrl_data = pytest.importorskip("torchrl.data")


def _both(**kwargs):
    return CompressedListStorage(**kwargs), torchrl_data.CompressedListStorage(**kwargs)


def _items(n=6, frames=True):
    # Frames of item shape [4, 12, 12] take the rows mode; [4, 144] rows the item path.
    shape = (n, 4, 12, 12) if frames else (n, 4, 144)
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "obs": torch.randint(0, 4, shape, dtype=torch.uint8, generator=gen),
            "reward": torch.randn(n, generator=gen),
            "next": {"obs": torch.randint(0, 4, shape, dtype=torch.uint8, generator=gen)},
        },
        [n],
    )


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key])


def test_same_defaults_and_arguments():
    ours, theirs = _both(max_size=10)
    assert ours.max_size == theirs.max_size == 10
    assert ours.compression_level == theirs.compression_level == 3
    ours, theirs = _both(max_size=5, compression_level=9, device="cpu")
    assert ours.compression_level == theirs.compression_level == 9


def test_tensordict_items_match_torchrl_bytes_and_values():
    data = _items(frames=False)
    ours, theirs = _both(max_size=100)
    for storage in (ours, theirs):
        storage.set(range(6), data)
    assert ours.mode == "items"
    assert len(ours) == len(theirs) == 6
    assert ours.bytes() == theirs.bytes()
    for i in range(6):
        _equal(ours.get(i), theirs.get(i))
    for a, b in zip(ours.get([5, 0, 3]), theirs.get([5, 0, 3])):
        _equal(a, b)
    for a, b in zip(ours.get(slice(1, 4)), theirs.get(slice(1, 4))):
        _equal(a, b)
    # The compressed bytes are zlib's at the level asked for, field by field.
    assert torch.equal(ours._storage[2]["obs"], torch.frombuffer(bytearray(zlib.compress(data[2]["obs"].numpy().tobytes(), 3)), dtype=torch.uint8))


def test_tensor_items_and_custom_functions():
    calls = []

    def compress(t):
        calls.append("c")
        return torch.frombuffer(bytearray(zlib.compress(t.numpy().tobytes(), 1)), dtype=torch.uint8)

    def decompress(b, meta):
        calls.append("d")
        raw = zlib.decompress(b.numpy().tobytes())
        return torch.frombuffer(bytearray(raw), dtype=meta["dtype"]).reshape(meta["shape"]).to(meta["device"])

    ours, theirs = _both(max_size=4, compression_fn=compress, decompression_fn=decompress)
    x = torch.randn(3, 5, 7)
    for storage in (ours, theirs):
        storage.set(0, x[0])
        storage.set(1, x[1])
    _equal(ours.get(1), theirs.get(1))
    assert calls.count("c") == 4 and calls.count("d") == 2


def test_buffer_round_robin_and_errors():
    data = _items(10)
    ours = CompressedListStorage(max_size=4)
    rb = ReplayBuffer(storage=ours, batch_size=3)
    rb.extend(data[:6])
    rb.extend(data[6:])
    assert len(ours) == 4
    _equal(ours.get(0), data[8])
    sample = rb.sample()
    assert sample["obs"].shape == (3, 4, 12, 12)
    for storage in _both(max_size=3):
        with pytest.raises(RuntimeError):
            storage.set(1, torch.zeros(2))
        storage.set(0, torch.zeros(2))
        storage.set(1, torch.zeros(2))
        storage.set(2, torch.zeros(2))
        with pytest.raises(RuntimeError):
            storage.set(3, torch.zeros(2))
        with pytest.raises(IndexError):
            storage.get(7)
        with pytest.raises(TypeError):
            storage.set([0], object())


def test_state_dict_and_empty():
    data = _items(3)
    ours, theirs = _both(max_size=10)
    for storage in (ours, theirs):
        storage.set(range(3), data)
    state = ours.state_dict()
    other = CompressedListStorage(max_size=10)
    other.load_state_dict(state)
    _equal(other.get(2), theirs.get(2))
    other._empty()
    assert len(other) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert other.bytes() == 0
    assert ours.contains(2) and not ours.contains(5)
