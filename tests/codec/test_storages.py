"""CompressedTensorStorage and FrameStackStorage return exactly what a plain storage of the same rows returns."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf.buffers import ReplayBuffer
from gpubuf.ops.match_frames import stack_indices, transition_indices
from gpubuf.errors import EmptyBufferError, IndexOutOfRangeError, SchemaMismatchError
from gpubuf.storages.codec_storage import CompressedTensorStorage
from gpubuf.storages.frame_stack import FrameStackStorage
from gpubuf.storages.tensor import LazyTensorStorage


def _transitions(atari, flat: bool = False, start: int = 0, stop: int | None = None) -> TensorDict:
    """Real transitions (obs, next obs, action, reward) stacked as a frame-stacking env does."""
    frames = torch.from_numpy(atari["frames"])
    obs_i, next_i = transition_indices(atari["episode_start"])
    obs_i, next_i = obs_i[start:stop], next_i[start:stop]
    n = len(obs_i)
    obs, nxt = frames[torch.from_numpy(obs_i)], frames[torch.from_numpy(next_i)]
    fields = {"obs": obs, "action": torch.from_numpy(atari["action"][obs_i[:, -1]]).long(), "reward": torch.arange(n).float()}
    if flat:
        fields["next_obs"] = nxt
    else:
        fields["next"] = {"obs": nxt, "reward": torch.arange(n).float() * 2}
    return TensorDict(fields, [n])


def _same(a: TensorDict, b: TensorDict) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key]), key


def _pair(storage, capacity):
    return storage, LazyTensorStorage(capacity)


@pytest.mark.parametrize("make", [lambda c: CompressedTensorStorage(c), lambda c: FrameStackStorage(c)], ids=["tensor", "frames"])
@pytest.mark.parametrize("capacity,chunk", [(700, 97), (129, 64), (1, 5), (41, 1)])
def test_matches_naive_storage_through_buffer(atari, make, capacity, chunk):
    """Across episode boundaries, wrap-around and batch sizes 1..97, sampled batches are identical."""
    data = _transitions(atari)
    ours, naive = make(capacity), LazyTensorStorage(capacity)
    rb_ours = ReplayBuffer(storage=ours, batch_size=32)
    rb_naive = ReplayBuffer(storage=naive, batch_size=32)
    stop = min(len(data), 400 if chunk > 1 else 60)
    for i in range(0, stop, chunk):
        rb_ours.extend(data[i : i + chunk])
        rb_naive.extend(data[i : i + chunk])
    assert len(ours) == len(naive)
    gen = torch.Generator().manual_seed(capacity)
    for _ in range(3):
        index = torch.randint(0, len(naive), (64,), generator=gen)
        _same(ours.get(index), naive.get(index))
    _same(ours.get(torch.arange(len(naive))), naive.get(torch.arange(len(naive))))
    _same(ours[len(naive) - 1], naive[len(naive) - 1])
    _same(ours[-1], naive[-1])


def test_framestack_add_one_step_at_a_time(atari):
    """Single-item writes (rb.add, one env step at a time) still find the frames shared with the previous row."""
    data = _transitions(atari, start=40, stop=110)
    ours = FrameStackStorage(200)
    rb = ReplayBuffer(storage=ours, batch_size=8)
    for i in range(len(data)):
        rb.add(data[i])
    _same(ours.get(torch.arange(len(data))), data)
    stats = ours.stats()
    # One new frame per step, plus the reset frames of episodes (and the first stack).
    n_starts = int(atari["episode_start"][40:115].sum())
    assert stats["frames"] <= len(data) + n_starts + 4
    assert stats["dedup"] > 7


def test_framestack_flat_next_key_and_obs_only(atari):
    data = _transitions(atari, flat=True, stop=200)
    ours = FrameStackStorage(300)
    ours._write_rows(0, data)
    _same(ours.get(torch.arange(200)), data)
    assert ours.stats()["dedup"] > 7
    obs_only = FrameStackStorage(300, stack_keys=["obs"])
    obs_only._write_rows(0, data.exclude("next_obs"))
    _same(obs_only.get(torch.arange(200)), data.exclude("next_obs"))
    assert obs_only.stats()["dedup"] > 3.5


@pytest.mark.parametrize("key_interval", [1, 2, 8])
def test_framestack_key_intervals_and_frame_compaction(atari, key_interval):
    """A small storage overwritten many times renumbers and compacts its frames; results stay exact."""
    data = _transitions(atari)
    ours, naive = FrameStackStorage(50, key_interval=key_interval), LazyTensorStorage(50)
    for i in range(0, len(data), 37):
        ours._write_rows(i, data[i : i + 37])
        naive._write_rows(i, data[i : i + 37])
    _same(ours.get(torch.arange(50)), naive.get(torch.arange(50)))
    stats = ours.stats()
    assert stats["frames"] < 50 * 2 + 40


def test_framestack_set_arbitrary_rows_and_duplicates(atari):
    data = _transitions(atari, stop=64)
    ours, naive = FrameStackStorage(64), LazyTensorStorage(64)
    ours._write_rows(0, data)
    naive._write_rows(0, data)
    cursor = torch.tensor([5, 9, 5, 63, 0])
    items = data[torch.tensor([40, 41, 42, 43, 44])]
    ours.set(cursor, items)
    naive.set(torch.tensor([9, 5, 63, 0]), items[1:])  # the last item for row 5 wins
    _same(ours.get(torch.arange(64)), naive.get(torch.arange(64)))
    ours.set(7, data[3])
    naive.set(7, data[3])
    _same(ours.get(torch.arange(64)), naive.get(torch.arange(64)))


def test_compressed_tensor_storage_plain_tensor_and_arena_compaction():
    gen = torch.Generator().manual_seed(0)
    ours, naive = CompressedTensorStorage(40, min_row_bytes=1), LazyTensorStorage(40)
    for step in range(30):
        batch = torch.randint(0, 3, (17, 3, 20, 24), dtype=torch.uint8, generator=gen)
        batch[:, :, 5:15] = step % 7
        ours._write_rows(step * 17, batch)
        naive._write_rows(step * 17, batch)
    assert torch.equal(ours.get(torch.arange(40)), naive.get(torch.arange(40)))
    stats = ours.stats()
    assert stats["rows"] == 40 and stats["ratio"] > 1.5
    # The arena holds the live rows and bounded garbage.
    assert stats["arena_bytes"] <= 4 * stats["stored_bytes"] + 2**16


def test_compress_keys_selects_leaves_and_state_dict_round_trip(atari):
    data = _transitions(atari, stop=50)
    ours = CompressedTensorStorage(60, compress_keys=[("next", "obs")])
    ours._write_rows(0, data)
    assert [ours.layout.leaves[i].key for i in ours._encoded] == [("next", "obs")]
    state = ours.state_dict()
    other = CompressedTensorStorage(60, compress_keys=[("next", "obs")])
    other.load_state_dict(state)
    _same(other.get(torch.arange(50)), data)
    with pytest.raises(SchemaMismatchError):
        CompressedTensorStorage(10, compress_keys=["nope"])._write_rows(0, data[:3])


@pytest.mark.interpreter
@pytest.mark.parametrize("saved, loaded", [("triton", "auto"), ("auto", "triton")])
def test_state_moves_between_host_and_device_codecs(atari, saved, loaded):
    """Host rows are zstd frames, device rows (here the forced device path) the row codec; a
    state saved with one codec is re-encoded when loaded with the other."""
    data = _transitions(atari, stop=10)
    src = ReplayBuffer(storage=CompressedTensorStorage(12), backend=saved).storage
    src._write_rows(0, data[:8])
    dst = ReplayBuffer(storage=CompressedTensorStorage(12), backend=loaded).storage
    dst.load_state_dict(src.state_dict())
    codec = {"triton": "rows", "auto": "zstd"}
    assert (src._codec, dst._codec) == (codec[saved], codec[loaded])
    dst._backend = "auto"  # row-codec rows read by the host decode (Triton's interpreter takes minutes)
    _same(dst.get(torch.arange(8)), data[:8])
    dst._write_rows(8, data[8:])
    _same(dst.get(torch.arange(10)), data)


def test_framestack_state_dict_round_trip_and_keeps_writing(atari):
    data = _transitions(atari, stop=120)
    ours, naive = FrameStackStorage(100), LazyTensorStorage(100)
    ours._write_rows(0, data[:80])
    naive._write_rows(0, data[:80])
    other = FrameStackStorage(100)
    other.load_state_dict(ours.state_dict())
    _same(other.get(torch.arange(80)), naive.get(torch.arange(80)))
    other._write_rows(80, data[80:])
    naive._write_rows(80, data[80:])
    _same(other.get(torch.arange(100)), naive.get(torch.arange(100)))
    rb = ReplayBuffer(storage=FrameStackStorage(100), batch_size=4)
    rb.extend(data[:10])
    assert "_storage" in rb.state_dict()


def test_errors_leave_storage_unchanged(atari):
    data = _transitions(atari, stop=20)
    for storage in (CompressedTensorStorage(30), FrameStackStorage(30)):
        with pytest.raises(EmptyBufferError):
            storage.get(0)
        storage._write_rows(0, data)
        before = storage.get(torch.arange(20))
        with pytest.raises(SchemaMismatchError):
            storage._write_rows(20, data.exclude("reward"))
        with pytest.raises(IndexOutOfRangeError):
            storage.set(30, data[0])
        with pytest.raises(IndexOutOfRangeError):
            storage.get(20)
        assert len(storage) == 20
        _same(storage.get(torch.arange(20)), before)
        storage._empty()
        assert len(storage) == 0
        storage._write_rows(0, data[:5])
        _same(storage.get(torch.arange(5)), data[:5])


def test_stack_indices_repeat_first_frame():
    starts = torch.tensor([1, 0, 0, 0, 0, 1, 0]).bool().numpy()
    idx = stack_indices(starts, 4)
    assert idx.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4], [5, 5, 5, 5], [5, 5, 5, 6]]
    obs, nxt = transition_indices(starts, 4)
    assert len(obs) == 5 and nxt[3].tolist() == [1, 2, 3, 4]
