"""CompressedListStorage's rows mode: stacked frames through the batched codec, against the item path and TorchRL."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from gpubuf import CompressedListStorage, ReplayBuffer
from gpubuf.ops.match_frames import transition_indices
from gpubuf.errors import CorruptRowError

torchrl_data = pytest.importorskip("torchrl.data")


@pytest.fixture(scope="module")
def rows(atari):
    """Transitions of the real frames: stacked ``obs`` and nested ``("next", "obs")``, action, reward."""
    obs_i, next_i = transition_indices(atari["episode_start"])
    obs_i, next_i = obs_i[:240], next_i[:240]
    pixels = torch.from_numpy(atari["frames"])
    n = len(obs_i)
    return TensorDict(
        {
            "obs": pixels[torch.from_numpy(obs_i)],
            "action": torch.from_numpy(atari["action"][obs_i[:, -1]].astype(np.int64)),
            "next": {
                "obs": pixels[torch.from_numpy(next_i)],
                "reward": torch.from_numpy(atari["reward"][next_i[:, -1]].astype(np.float32)),
            },
        },
        [n],
    )


def _zlib(t):
    return torch.frombuffer(bytearray(zlib.compress(t.contiguous().numpy().tobytes(), 3)), dtype=torch.uint8)


def _unzlib(b, meta):
    raw = zlib.decompress(b.numpy().tobytes())
    return torch.frombuffer(bytearray(raw), dtype=meta["dtype"]).reshape(meta["shape"]).to(meta["device"])


def _same(a, b):
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_rows_mode_by_default_and_exact_samples(rows):
    storage = CompressedListStorage(max_size=1000)
    rb = ReplayBuffer(storage=storage, batch_size=64)
    rb.extend(rows[:100])
    rb.extend(rows[100:])
    assert storage.mode == "rows" and len(storage) == len(rows)
    for _ in range(3):
        batch, info = rb.sample(return_info=True)
        _same(batch, rows[info["index"]])
    # The frames are stored once: far fewer bytes than one zlib stream per stacked leaf and row.
    zlib_bytes = sum(_zlib(rows[i]["obs"]).numel() + _zlib(rows[i]["next", "obs"]).numel() for i in range(len(rows)))
    assert storage.bytes() < zlib_bytes


def test_rows_mode_matches_item_path_and_torchrl(rows):
    ours = CompressedListStorage(max_size=500)
    items = CompressedListStorage(max_size=500, compression_fn=_zlib, decompression_fn=_unzlib)
    theirs = torchrl_data.CompressedListStorage(max_size=500)
    for storage in (ours, items, theirs):
        storage.set(range(len(rows)), rows)
    assert ours.mode == "rows" and items.mode == "items"
    assert len(ours) == len(items) == len(theirs) == len(rows)
    for i in (0, 7, len(rows) - 1, -1):
        a, b, c = ours.get(i), items.get(i), theirs.get(i)
        assert a.batch_size == c.batch_size == torch.Size([])
        _same(a, b)
        _same(a, c)
    for index in ([5, 0, 5, 200], slice(3, 9), torch.tensor([1, 2])):
        got, want = ours.get(index), theirs.get(index)
        assert isinstance(got, list) and len(got) == len(want)
        for a, c in zip(got, want):
            _same(a, c)
    assert ours.contains(3) and not ours.contains(len(rows))
    with pytest.raises(IndexError):
        ours.get(len(rows))
    # TorchRL's write rules hold in rows mode too.
    with pytest.raises(RuntimeError):
        ours.set(len(rows) + 1, rows[0])
    ours.set(len(rows), rows[3])
    _same(ours.get(len(rows)), rows[3])
    ours.set(2, rows[9])
    _same(ours.get(2), rows[9])
    assert ours.mode == "rows" and len(ours) == len(rows) + 1


def test_round_robin_past_capacity(rows):
    storage = CompressedListStorage(max_size=50)
    rb = ReplayBuffer(storage=storage, batch_size=8)
    rb.extend(rows[:30])
    rb.extend(rows[30:90])
    assert storage.mode == "rows" and len(storage) == 50
    # The second batch fills rows 30..49 with items 30..49, then rows 0..39 with items 50..89.
    for r in (0, 1, 39, 40, 49):
        _same(storage.get(r), rows[50 + r if r < 40 else r])


def test_custom_functions_and_other_items_take_the_item_path(rows):
    custom = CompressedListStorage(max_size=10, compression_fn=_zlib, decompression_fn=_unzlib)
    custom.set(range(4), rows[:4])
    assert custom.mode == "items"
    floats = CompressedListStorage(max_size=10)
    floats.set(range(3), torch.randn(3, 4, 8, 8))
    assert floats.mode == "items"
    listed = CompressedListStorage(max_size=10)
    ReplayBuffer(storage=listed).extend([rows[0], rows[1]])
    assert listed.mode == "items"


def test_misfit_write_moves_to_the_item_path(rows):
    storage = CompressedListStorage(max_size=100)
    rb = ReplayBuffer(storage=storage, batch_size=4)
    rb.extend(rows[:20])
    assert storage.mode == "rows"
    other = TensorDict({"obs": torch.zeros(3, 2, 5, 5, dtype=torch.uint8), "action": torch.ones(3, dtype=torch.int64)}, [3])
    rb.extend(other)
    assert storage.mode == "items" and len(storage) == 23
    for i in range(20):
        _same(storage.get(i), rows[i])
    _same(storage.get(21), other[1])
    assert len(rb.sample(4)) == 4
    storage._empty()
    assert storage.mode is None
    rb.extend(rows[:5])
    assert storage.mode == "rows"


def test_corrupt_row_names_the_row(rows):
    storage = CompressedListStorage(max_size=100)
    storage.set(range(40), rows[:40])
    frames = storage._rows._frames
    frame = int(storage._rows._refs[0, 30, 3])  # the newest frame of row 30's obs
    offset, length = int(frames.offsets[frame]), int(frames.lengths[frame])
    frames.arena[offset + length // 2] ^= 0x5A
    with pytest.raises(CorruptRowError) as caught:
        storage.get([1, 30])
    assert 30 in caught.value.rows and 1 not in caught.value.rows
    for row in caught.value.rows:
        assert bool((storage._rows._refs[:, row] == frame).any())
    _same(storage.get(1), rows[1])  # rows not using the frame still read


def test_corrupt_item_names_the_item():
    storage = CompressedListStorage(max_size=10)
    data = torch.randn(3, 6)
    storage.set(range(3), data)
    assert storage.mode == "items"
    storage._storage[1] = storage._storage[1][:-4]  # truncated
    with pytest.raises(CorruptRowError) as caught:
        storage.get(1)
    assert caught.value.rows == [1]
    storage._storage[2] = _zlib(torch.zeros(5))  # decompresses to the wrong size
    with pytest.raises(CorruptRowError, match="expected 24") as caught:
        storage.get(2)
    assert caught.value.rows == [2]
    assert torch.equal(storage.get(0), data[0])


@pytest.mark.parametrize("mode", ["rows", "items"])
def test_checkpoint_round_trip(rows, tmp_path, mode):
    kwargs = {} if mode == "rows" else {"compression_fn": _zlib, "decompression_fn": _unzlib}
    storage = CompressedListStorage(max_size=300, **kwargs)
    storage.set(range(60), rows[:60])
    assert storage.mode == mode
    storage.dumps(tmp_path / "ckpt")
    loaded = CompressedListStorage(max_size=300, **kwargs)
    loaded.loads(tmp_path / "ckpt")
    assert loaded.mode == mode and len(loaded) == 60
    for a, b in zip(loaded.get(list(range(60))), rows[:60].unbind(0)):
        _same(a, b)
    if mode == "rows":
        # Writes continue after loading.
        rb = ReplayBuffer(storage=loaded, batch_size=8)
        loaded.set(range(60, 80), rows[60:80])
        batch, info = rb.sample(return_info=True)
        _same(batch, rows[info["index"]])


def test_state_dict_is_torchrl_format(rows):
    storage = CompressedListStorage(max_size=100)
    storage.set(range(12), rows[:12])
    state = storage.state_dict()
    assert storage.mode == "rows" and len(state["_storage"]) == len(state["_metadata"]) == 12
    theirs = torchrl_data.CompressedListStorage(max_size=100)
    theirs.load_state_dict(state)
    mine = CompressedListStorage(max_size=100)
    mine.load_state_dict(state)
    assert mine.mode == "items"
    for i in range(12):
        _same(theirs.get(i), rows[i])
        _same(mine.get(i), rows[i])


def test_tensordict_buffers_sample_rows_mode(rows):
    import gpubuf

    for cls, kwargs in ((gpubuf.TensorDictReplayBuffer, {}), (gpubuf.TensorDictPrioritizedReplayBuffer, {"alpha": 0.7, "beta": 0.5})):
        storage = CompressedListStorage(max_size=300)
        rb = cls(storage=storage, batch_size=16, **kwargs)
        rb.extend(rows[:100].clone())
        assert storage.mode == "rows"
        batch = rb.sample()
        index = batch["index"]
        _same(batch.exclude("index", *[k for k in batch.keys() if k not in rows.keys()]), rows[index])
        if kwargs:
            batch.set("td_error", torch.rand(16))
            rb.update_tensordict_priority(batch)
