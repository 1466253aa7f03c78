"""Slice samplers side by side with TorchRL's on the same data.

Boundaries are compared exactly with TorchRL's ``find_start_stop_traj`` (what its samplers
compute at every sample) after every write, wrap-around included; draws are checked for their
structure (contiguous, one trajectory per slice, marks) and, by a chi-square test, for
TorchRL's distribution: a trajectory uniform among the eligible ones, a start uniform within it.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf import errors

torchrl_data = pytest.importorskip("torchrl.data")
from torchrl.data import find_start_stop_traj  # noqa: E402


# ---------------------------------------------------------------------- data
def _episodes(lengths: list[int], first_id: int = 0) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(first_id, first_id + len(lengths)), torch.tensor(lengths))


def _transitions(episode: torch.Tensor, offset: int = 0) -> TensorDict:
    """Steps with an id, a done flag on each episode's last step, a terminated flag and is_init."""
    n = episode.shape[0]
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[:-1, 0] = episode[1:] != episode[:-1]
    done[-1, 0] = True
    is_init = torch.zeros(n, 1, dtype=torch.bool)
    is_init[1:, 0] = episode[1:] != episode[:-1]
    is_init[0, 0] = True
    return TensorDict(
        {
            "obs": torch.arange(offset, offset + n),
            "episode": episode,
            "is_init": is_init,
            ("next", "done"): done,
            ("next", "terminated"): done & (episode % 2 == 0).unsqueeze(-1),
        },
        [n],
    )


def _random_stream(seed: int, n: int, max_len: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    return _episodes(lengths)


def _buffer(sampler, capacity: int, ndim: int = 1, seed: int = 0):
    return gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(capacity, ndim=ndim),
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
    )


# ---------------------------------------------------------------------- TorchRL's boundaries
def _torchrl_trajectories(signal: torch.Tensor, *, full: bool, cursor: int | None, traj: bool) -> set:
    """``{(column, start_row, length)}`` as TorchRL's samplers compute them from the stored signal."""
    kwargs = {"trajectory": signal} if traj else {"end": signal}
    start, _, lengths = find_start_stop_traj(at_capacity=full, cursor=cursor if full else None, **kwargs)
    column = start[:, 1:].flatten(1)
    col = torch.zeros(start.shape[0], dtype=torch.long)
    if column.shape[1]:
        col = column[:, 0]
    return {(int(c), int(s), int(n)) for c, s, n in zip(col, start[:, 0], lengths)}


def _our_trajectories(sampler) -> set:
    index = sampler._index if sampler._static is None else sampler._static
    everything = index.eligible(1)
    count = int(everything.counts().sum())
    col, start, length = index.pick(everything, torch.arange(count, device=everything.slots.device))
    rows = start % index.capacity
    return {(int(c), int(s), int(n)) for c, s, n in zip(col, rows, length)}


def _stored_signal(rb, key, size: int) -> torch.Tensor:
    values = rb.storage._storage[key]
    return values[:size].reshape(size, *values.shape[1 : rb.storage.ndim])


@pytest.mark.parametrize("source", ["traj_key", "end_key", "end_keys"])
def test_boundaries_match_torchrl_after_every_write(source):
    kwargs = {
        "traj_key": {"traj_key": "episode"},
        "end_key": {"end_key": ("next", "done")},
        "end_keys": {"end_keys": [("next", "done"), ("next", "terminated")]},
    }[source]
    sampler = gpubuf.SliceSampler(slice_len=3, **kwargs)
    capacity = 37
    rb = _buffer(sampler, capacity)
    stream = _transitions(_random_stream(1, 60))
    g = torch.Generator().manual_seed(2)
    at, cursor = 0, -1
    torchrl_rb = torchrl_data.TensorDictReplayBuffer(
        storage=torchrl_data.LazyTensorStorage(capacity), sampler=torchrl_data.SliceSampler(slice_len=3, **kwargs)
    )
    for step in range(14):
        n = int(torch.randint(1, 2 * capacity if step == 7 else 12, (1,), generator=g))
        chunk = stream[at : at + n]
        at += n
        rb.extend(chunk)
        torchrl_rb.extend(chunk)
        cursor = (cursor + n) % capacity
        sampler._sync(rb.storage)  # what a draw does first: read the rows written since the last one
        size = len(rb)
        full = size == capacity
        if source == "traj_key":
            signal, traj = _stored_signal(rb, "episode", size), True
        else:
            signal, traj = _stored_signal(rb, ("next", "done"), size).reshape(size), False
            if source == "end_keys":
                signal = signal | _stored_signal(rb, ("next", "terminated"), size).reshape(size)
        expected = _torchrl_trajectories(signal, full=full, cursor=cursor, traj=traj)
        assert _our_trajectories(sampler) == expected
        # TorchRL's own sampler sees the same trajectories.
        start, _, lengths = torchrl_rb.sampler._get_stop_and_length(torchrl_rb.storage)
        assert {(0, int(s), int(n)) for s, n in zip(start[:, 0], lengths)} == expected
    # Reading everything again (what a write the sampler did not follow leads to) gives the same.
    incremental = _our_trajectories(sampler)
    sampler._rebuild(rb.storage, capacity, 1, (), torch.device("cpu"), newest=cursor)
    assert _our_trajectories(sampler) == incremental


def test_boundaries_ndim2_match_torchrl():
    envs, capacity = 3, 11
    sampler = gpubuf.SliceSampler(num_slices=2, traj_key="episode")
    rb = _buffer(sampler, capacity * envs, ndim=2)
    streams = [_random_stream(10 + e, 30, max_len=6) + 100 * e for e in range(envs)]
    at, cursor = 0, -1
    for n in (4, 5, 1, 7, 9, 3, 11):
        episode = torch.stack([s[at : at + n] for s in streams])  # [envs, n]: extended along dim 1
        td = TensorDict({"episode": episode, "obs": episode.clone()}, [envs, n])
        rb.extend(td)
        at += n
        cursor = (cursor + n) % capacity
        sampler._sync(rb.storage)
        stored = rb.storage._storage["episode"]
        size = len(rb) // envs
        expected = _torchrl_trajectories(stored[:size], full=size == capacity, cursor=cursor, traj=True)
        assert _our_trajectories(sampler) == expected


# ---------------------------------------------------------------------- draws
def _slices(batch, num_slices: int) -> list[TensorDict]:
    return list(batch.reshape(num_slices, -1).unbind(0))


def test_slices_are_contiguous_single_trajectory_and_marked():
    slice_len, num_slices = 4, 8
    rb = _buffer(gpubuf.SliceSampler(slice_len=slice_len, traj_key="episode"), 50)
    rb.extend(_transitions(_random_stream(3, 20, max_len=9)))  # wraps
    for _ in range(5):
        batch = rb.sample(slice_len * num_slices)
        assert batch.batch_size == (slice_len * num_slices,)
        for one in _slices(batch, num_slices):
            rows = one["index"].reshape(-1)
            assert torch.equal((rows - rows[0]) % 50, torch.arange(slice_len))
            assert one["episode"].unique().numel() == 1
            truncated = one["next", "truncated"].reshape(-1)
            assert truncated.tolist() == [False] * (slice_len - 1) + [True]
            stored_done = rb.storage._storage["next", "done"][rows].reshape(-1)
            assert torch.equal(one["next", "done"].reshape(-1), stored_done | truncated)
            stored_term = rb.storage._storage["next", "terminated"][rows].reshape(-1)
            assert torch.equal(one["next", "terminated"].reshape(-1), stored_term)
            assert bool(one["is_init"][0])
            assert torch.equal(one["is_init"][1:], rb.storage._storage["is_init"][rows[1:]])


def _window_counts(draw, rounds: int) -> dict:
    counts: dict = {}
    for _ in range(rounds):
        for key in draw():
            counts[key] = counts.get(key, 0) + 1
    return counts


def _chi_square(counts: dict, expected: dict) -> tuple[float, int]:
    total = sum(counts.values())
    assert set(counts) <= set(expected), "a window outside the expected support was drawn"
    stat = sum((counts.get(k, 0) - total * p) ** 2 / (total * p) for k, p in expected.items())
    return stat, len(expected) - 1


def _expected_windows(trajectories: set, slice_len: int, capacity: int) -> dict:
    eligible = [(c, s, n) for c, s, n in trajectories if n >= slice_len]
    probs = {}
    for c, s, n in eligible:
        for r in range(n - slice_len + 1):
            probs[(c, (s + r) % capacity)] = 1.0 / (len(eligible) * (n - slice_len + 1))
    return probs


@pytest.mark.parametrize("key", ["traj_key", "end_key"])
def test_window_distribution_matches_torchrl(key):
    capacity, slice_len, num_slices = 64, 5, 16
    kwargs = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")}
    data = _transitions(_random_stream(4, 30, max_len=10))
    ours = _buffer(gpubuf.SliceSampler(slice_len=slice_len, **kwargs), capacity, seed=5)
    theirs = torchrl_data.TensorDictReplayBuffer(
        storage=torchrl_data.LazyTensorStorage(capacity),
        sampler=torchrl_data.SliceSampler(slice_len=slice_len, cache_values=True, **kwargs),
    )
    ours.extend(data)
    theirs.extend(data)
    torch.manual_seed(6)
    ours.sample(slice_len)
    trajectories = _our_trajectories(ours.sampler)
    expected = _expected_windows(trajectories, slice_len, capacity)

    def draw(rb):
        def one():
            idx = rb.sample(slice_len * num_slices)["index"].reshape(num_slices, slice_len, -1)[:, 0, 0]
            return [(0, int(i)) for i in idx]

        return one

    for rb in (ours, theirs):
        stat, df = _chi_square(_window_counts(draw(rb), 250), expected)
        assert stat < df + 6 * math.sqrt(2 * df), (stat, df)


def test_short_trajectories_with_strict_length_false_and_padding():
    capacity, slice_len = 40, 6
    data = _transitions(_episodes([2, 9, 3, 8, 1, 10, 7]))
    for pad in (False, True):
        rb = _buffer(gpubuf.SliceSampler(num_slices=10, strict_length=False, pad_output=pad, traj_key="episode"), capacity)
        rb.extend(data)
        batch, info = rb.sample(60, return_info=True)
        lengths = {int(e): int((data["episode"] == e).sum()) for e in data["episode"].unique()}
        if pad:
            assert batch.batch_size == (60,)
            mask = info[("collector", "mask")].reshape(10, slice_len)
            for one, m in zip(_slices(batch, 10), mask):
                real = int(m.sum())
                assert real == min(lengths[int(one["episode"][0])], slice_len)
                assert m.tolist() == [True] * real + [False] * (slice_len - real)
                assert torch.equal(one["obs"][real:], one["obs"][real - 1].expand(slice_len - real))
        else:
            truncated = batch["next", "truncated"].reshape(-1)
            ends = truncated.nonzero().reshape(-1).tolist()
            assert len(ends) == 10 and ends[-1] == batch.batch_size[0] - 1
            begin = 0
            for end in ends:
                one = batch[begin : end + 1]
                assert one["episode"].unique().numel() == 1
                assert one.batch_size[0] == min(lengths[int(one["episode"][0])], slice_len)
                assert torch.equal(one["obs"] - one["obs"][0], torch.arange(end + 1 - begin))
                begin = end + 1


def test_span_gives_shorter_slices_at_trajectory_edges():
    rb = _buffer(gpubuf.SliceSampler(num_slices=64, span=True, traj_key="episode"), 60)
    rb.extend(_transitions(_episodes([9, 12, 10, 14])))
    batch = rb.sample(64 * 5)
    ends = batch["next", "truncated"].reshape(-1).nonzero().reshape(-1).tolist()
    assert len(ends) == 64
    begin, sizes = 0, []
    for end in ends:
        one = batch[begin : end + 1]
        assert one["episode"].unique().numel() == 1
        assert torch.equal(one["obs"] - one["obs"][0], torch.arange(end + 1 - begin))
        sizes.append(end + 1 - begin)
        begin = end + 1
    assert min(sizes) >= 1 and max(sizes) == 5 and min(sizes) < 5


def test_ndim2_slices_stay_in_their_column():
    envs = 4
    rb = _buffer(gpubuf.SliceSampler(slice_len=3, traj_key="episode"), 20 * envs, ndim=2)
    episode = torch.stack([_random_stream(20 + e, 10, max_len=7)[:25] + 100 * e for e in range(envs)])
    rb.extend(TensorDict({"episode": episode, "obs": torch.arange(envs * 25).view(envs, 25)}, [envs, 25]))
    batch, info = rb.sample(30, return_info=True)
    time, env = info["index"]
    time, env = time.view(10, 3), env.view(10, 3)
    assert (env == env[:, :1]).all()
    assert ((time - time[:, :1]) % 20 == torch.arange(3)).all()
    episodes = batch["episode"].view(10, 3)
    assert (episodes == episodes[:, :1]).all()


def test_static_ends_and_trajectories_match_torchrl():
    ends = torch.zeros(30, dtype=torch.bool)
    ends[[4, 11, 12, 20]] = True  # rows 21..29 and 0..4 form one trajectory across the end
    trajectories = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), ends[:-1].long()]), 0) % 4
    for kwargs, signal, traj in (({"ends": ends}, ends, False), ({"trajectories": trajectories}, trajectories, True)):
        sampler = gpubuf.SliceSampler(slice_len=2, cache_values=True, **kwargs)
        rb = _buffer(sampler, 30)
        rb.extend(TensorDict({"obs": torch.arange(30)}, [30]))
        rb.sample(4)
        assert _our_trajectories(sampler) == _torchrl_trajectories(signal, full=True, cursor=None, traj=traj)


# ---------------------------------------------------------------------- without replacement
def test_without_replacement_visits_each_trajectory_once_per_epoch():
    lengths = [5, 7, 3, 9, 6, 2, 8]
    data = _transitions(_episodes(lengths))
    for strict in (True, False):
        sampler = gpubuf.SliceSamplerWithoutReplacement(num_slices=3, strict_length=strict, traj_key="episode")
        rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(100), sampler=sampler, batch_size=9)
        rb.extend(data)
        for _ in range(2):  # two epochs
            seen = []
            for batch in rb:
                ends = batch["next", "truncated"].reshape(-1).nonzero().reshape(-1).tolist()
                begin = 0
                for end in ends:
                    one = batch[begin : end + 1]
                    assert one["episode"].unique().numel() == 1
                    seen.append(int(one["episode"][0]))
                    begin = end + 1
            long_enough = [e for e, n in enumerate(lengths) if n >= 3 or not strict]
            assert sorted(seen) == long_enough


def test_without_replacement_over_long_enough_episodes_visits_each_once_per_epoch():
    """Every episode at least L long (the window draw takes the epoch's picks): each epoch holds
    every episode once, in windows of L consecutive steps, and the last batch of an epoch holds
    what is left."""
    lengths = [5, 7, 6, 9, 6, 8, 8]
    data = _transitions(_episodes(lengths))
    for shuffle in (True, False):
        sampler = gpubuf.SliceSamplerWithoutReplacement(num_slices=3, traj_key="episode", shuffle=shuffle)
        rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(100), sampler=sampler, batch_size=15)
        rb.extend(data)
        for _ in range(2):  # two epochs: batches of 3, 3 and 1 episodes
            seen, sizes = [], []
            for batch in rb:
                windows = batch.reshape(-1, 5)
                sizes.append(windows.shape[0])
                assert (windows["episode"] == windows["episode"][:, :1]).all()
                assert (windows["obs"][:, 1:] - windows["obs"][:, :-1] == 1).all()
                assert windows["next", "truncated"][:, -1].all()
                seen += windows["episode"][:, 0].tolist()
            assert sorted(seen) == list(range(len(lengths))) and sizes == [3, 3, 1]
            if not shuffle:
                assert seen == list(range(len(lengths)))


def test_without_replacement_resumes_its_epoch_from_a_checkpoint(tmp_path):
    """A checkpoint taken in the middle of an epoch: the restored buffer hands out the rest of the
    epoch exactly as the original does, then the same next epoch."""

    def make():
        return _buffer(gpubuf.SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode"), 200, seed=4)

    data = _transitions(_episodes([6, 8, 7, 9, 6, 10, 7]))
    rb = make()
    rb.extend(data)
    rb.sample(8)
    rb.dumps(tmp_path / "ckpt")
    restored = make()
    restored.loads(tmp_path / "ckpt")
    for _ in range(5):  # the epoch's last three batches (one of a single episode), then the next epoch
        want = rb.sample(8)
        got = restored.sample(8)
        assert torch.equal(got["obs"], want["obs"]) and torch.equal(got["episode"], want["episode"])


# ---------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_keeps_boundaries_and_draws(tmp_path):
    def make():
        return _buffer(gpubuf.SliceSamplerWithoutReplacement(slice_len=4, traj_key="episode"), 45, seed=9)

    rb = make()
    rb.extend(_transitions(_random_stream(7, 12)))
    rb.extend(_transitions(_random_stream(8, 5), offset=500))
    rb.sample(8)
    rb.dumps(tmp_path / "ckpt")
    restored = make()
    restored.loads(tmp_path / "ckpt")
    assert _our_trajectories(restored.sampler) == _our_trajectories(rb.sampler)
    for _ in range(3):
        assert torch.equal(restored.sample(8)["obs"], rb.sample(8)["obs"])
    more = _transitions(_random_stream(9, 4), offset=900)
    rb.extend(more)
    restored.extend(more)
    assert torch.equal(restored.sample(8)["obs"], rb.sample(8)["obs"])
    # Writes not yet read by a draw travel with the checkpoint.
    rb.extend(_transitions(_random_stream(10, 3), offset=950))
    rb.dumps(tmp_path / "ckpt2")
    again = make()
    again.loads(tmp_path / "ckpt2")
    assert torch.equal(again.sample(8)["obs"], rb.sample(8)["obs"])
    assert _our_trajectories(again.sampler) == _our_trajectories(rb.sampler)


# ---------------------------------------------------------------------- bad input
def test_bad_arguments_raise_typed_errors():
    with pytest.raises(errors.SliceArgumentError) as both:
        gpubuf.SliceSampler(num_slices=2, slice_len=3)
    assert isinstance(both.value, TypeError)
    with pytest.raises(errors.SliceArgumentError):
        gpubuf.SliceSampler()
    with pytest.raises(errors.SliceArgumentError):
        gpubuf.SliceSampler(slice_len=0)
    with pytest.raises(errors.SliceArgumentError):
        gpubuf.SliceSampler(slice_len=2, end_key="done", end_keys=["done"])
    with pytest.raises(errors.SliceArgumentError) as pad:
        gpubuf.SliceSampler(slice_len=2, pad_output=True)
    assert isinstance(pad.value, ValueError)
    with pytest.raises(errors.SliceArgumentError):
        gpubuf.SliceSampler(slice_len=2, ends=torch.ones(4, dtype=torch.bool))


def _state(rb):
    return (len(rb), rb.write_count, rb.storage._storage.clone(), rb.sampler.state_dict())


def _same_state(a, b) -> bool:
    return a[0] == b[0] and a[1] == b[1] and (a[2] == b[2]).all() and str(a[3]) == str(b[3])


def test_bad_sample_requests_raise_before_anything_changes():
    rb = _buffer(gpubuf.SliceSampler(num_slices=4, traj_key="episode"), 40)
    rb.extend(_transitions(_episodes([3, 4, 2, 5])))
    rb.sample(8)
    before = _state(rb)
    with pytest.raises(errors.BatchSizeError):
        rb.sample(10)  # not divisible by num_slices
    with pytest.raises(errors.TrajectoryLengthError) as short:
        rb.sample(4 * 6)  # slices of 6, every trajectory shorter
    assert isinstance(short.value, RuntimeError)
    assert _same_state(before, _state(rb))

    missing = _buffer(gpubuf.SliceSampler(slice_len=2, traj_key="episode_id", end_key=("next", "stop")), 10)
    missing.extend(TensorDict({"obs": torch.arange(6)}, [6]))
    with pytest.raises(errors.TrajectoryKeyError) as key:
        missing.sample(4)
    assert isinstance(key.value, KeyError) and "episode_id" in str(key.value)

    empty = _buffer(gpubuf.SliceSampler(slice_len=2), 10)
    with pytest.raises(errors.EmptyBufferError):
        empty.sample(4)


# ---------------------------------------------------------------------- prioritized
def _valid_starts(trajectories: set, slice_len: int, capacity: int, strict: bool = True) -> list[int]:
    rows = []
    for _, s, n in trajectories:
        last = n - (slice_len - 1)  # positions 0..last-1 can start a full slice
        count = max(last, 0) if strict else max(last, 1)  # without strict_length, the first step always can
        rows += [(s + r) % capacity for r in range(count)]
    return rows


@pytest.mark.parametrize("wrap", [False, True])
def test_prioritized_starts_and_weights_match_torchrl(wrap):
    capacity, slice_len, num_slices, alpha, beta = 48, 4, 16, 0.7, 0.5
    data = _transitions(_random_stream(11, 14 if wrap else 7, max_len=9))
    if not wrap:
        data = data[:capacity]
    g = torch.Generator().manual_seed(12)
    priority = torch.rand(capacity, generator=g) * 3 + 0.1

    def make(mod):
        sampler = mod.PrioritizedSliceSampler(capacity, alpha, beta, slice_len=slice_len, traj_key="episode")
        return mod.TensorDictReplayBuffer(storage=mod.LazyTensorStorage(capacity), sampler=sampler)

    ours = make(gpubuf)
    try:
        theirs = make(torchrl_data)
        providers = (ours, theirs)
    except (ImportError, RuntimeError, AttributeError, OSError, NotImplementedError):
        # TorchRL's prioritized classes need its compiled trees, which may not load with this torch.
        providers = (ours,)
    for rb in providers:
        rb.extend(data[: len(data) // 2])
        rb.extend(data[len(data) // 2 :])
        rb.update_priority(torch.arange(len(rb)), priority[: len(rb)])
    priority = priority[: len(ours)]
    ours.sample(slice_len)
    valid = _valid_starts(_our_trajectories(ours.sampler), slice_len, capacity)
    transformed = (priority.double() + 1e-8) ** alpha
    mass = transformed[valid].sum()
    expected = {(0, r): float(transformed[r] / mass) for r in valid}
    p_min = transformed.min()

    torch.manual_seed(13)
    for rb in providers:
        counts: dict = {}
        for _ in range(200):
            batch, info = rb.sample(slice_len * num_slices, return_info=True)
            rows = batch["index"].reshape(num_slices, slice_len, -1)[..., 0]
            assert ((rows - rows[:, :1]) % capacity == torch.arange(slice_len)).all()
            episodes = batch["episode"].reshape(num_slices, slice_len)
            assert (episodes == episodes[:, :1]).all()
            weight = info["priority_weight"].reshape(num_slices, slice_len).double()
            assert (weight == weight[:, :1]).all()
            want = ((transformed[rows[:, 0]] / p_min) ** -beta)
            assert torch.allclose(weight[:, 0], want, rtol=1e-5)
            for r in rows[:, 0].tolist():
                counts[(0, r)] = counts.get((0, r), 0) + 1
        stat, df = _chi_square(counts, expected)
        assert stat < df + 6 * math.sqrt(2 * df), (stat, df)


@pytest.mark.parametrize("strict", [True, False])
def test_prioritized_exclusions_follow_writes_and_updates(tmp_path, strict):
    capacity, slice_len = 30, 3

    def make():
        sampler = gpubuf.PrioritizedSliceSampler(
            capacity, 1.0, 1.0, slice_len=slice_len, traj_key="episode", strict_length=strict
        )
        return _buffer(sampler, capacity)

    rb = make()
    sampler = rb.sampler
    stream = _transitions(_random_stream(14, 40, max_len=7))
    at = 0
    for n in (5, 7, 2, 11, 9, 4, 13):
        rb.extend(stream[at : at + n])
        at += n
        rb.sample(2 * slice_len)
        valid = set(_valid_starts(_our_trajectories(sampler), slice_len, capacity, strict))
        # Before any update too: a written step holds the default priority wherever it can
        # start a slice, including a step that overwrote one held aside.
        assert set((sampler.tree.values() > 0).nonzero().reshape(-1).tolist()) == valid
        rb.update_priority(torch.arange(len(rb)), torch.rand(len(rb)) + 0.5)
        in_tree = set((sampler.tree.values() > 0).nonzero().reshape(-1).tolist())
        assert in_tree == valid
        merged = sampler.tree.values() + sampler._held.values()
        assert bool((merged[: len(rb)] > 0).all())
        batch = rb.sample(4 * slice_len)
        ends = batch["next", "truncated"].reshape(-1).nonzero().reshape(-1).tolist()
        assert len(ends) == 4
        begin = 0
        for end in ends:
            one = batch[begin : end + 1]
            assert one["episode"].unique().numel() == 1
            assert torch.equal((one["index"].reshape(-1) - one["index"][0]) % capacity, torch.arange(end + 1 - begin))
            assert int(one["index"][0]) in valid
            begin = end + 1
    rb.dumps(tmp_path / "ckpt")
    restored = make()
    restored.loads(tmp_path / "ckpt")
    restored.sample(2 * slice_len)
    assert torch.equal(restored.sampler.tree.values(), sampler.tree.values())
    assert torch.equal(restored.sampler._held.values(), sampler._held.values())


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_a_bad_priority_for_a_held_step_changes_neither_tree(bad):
    """An update's held steps go to the held tree and the others to the tree, in two updates: a
    bad priority among the held ones is refused before either tree, or the maximum, changes."""
    sampler = gpubuf.PrioritizedSliceSampler(60, 0.7, 0.5, slice_len=3, traj_key="episode")
    rb = _buffer(sampler, 60)
    rb.extend(_transitions(_episodes([6] * 8)))
    rb.sample(6)
    held = sampler._excluded.nonzero().reshape(-1)
    assert held.numel()
    index = torch.tensor([0, 1, int(held[0])])
    before = [sampler.tree.values().clone(), sampler._held.values().clone(), sampler._max_value.clone()]
    with pytest.raises(errors.PriorityError):
        rb.update_priority(index, torch.tensor([5.0, 2.0, bad]))
    after = [sampler.tree.values(), sampler._held.values(), sampler._max_value]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_an_index_past_the_tree_goes_to_the_tree_even_where_the_last_step_is_held():
    """The exclusions are looked up at ``clamp(index, -1, capacity)``, whose two ends land on an
    entry past the last step that is never set: an index past the tree is the first tree's to
    refuse whatever the last step's exclusion, so that a refused update changes neither tree."""
    sampler = gpubuf.PrioritizedSliceSampler(48, 0.7, 0.5, slice_len=3, traj_key="episode")
    rb = _buffer(sampler, 48)
    rb.extend(_transitions(_episodes([6] * 8)))  # fills the ring: each episode's last 2 steps are held
    rb.sample(6)
    assert bool(sampler._excluded[47]) and bool(sampler._excluded[0]) is False
    assert sampler._exclusions.shape == (49,) and not bool(sampler._exclusions[48])
    tree, held = sampler._update_targets(torch.tensor([48, 10**6, -1, -10**6, 47, 0]), False)
    assert tree[0] is sampler.tree and held[0] is sampler._held
    assert tree[1].tolist() == [48, 10**6, -1, -10**6, -1, 0]
    assert held[1].tolist() == [-1, -1, -1, -1, 47, -1]
    before = [sampler.tree.values().clone(), sampler._held.values().clone(), sampler._max_value.clone()]
    for index in ([48], [10**6], [0, 47, 48]):
        with pytest.raises(errors.IndexOutOfRangeError):
            rb.update_priority(torch.tensor(index), torch.full((len(index),), 3.0))
        after = [sampler.tree.values(), sampler._held.values(), sampler._max_value]
        assert all(torch.equal(a, b) for a, b in zip(before, after)), index
    rb.update_priority(torch.tensor([0, 47]), torch.tensor([3.0, 3.0]))
    value = (3.0 + sampler._eps) ** 0.7
    assert math.isclose(float(sampler.tree.values()[0]), value, rel_tol=1e-6)
    assert math.isclose(float(sampler._held.values()[47]), value, rel_tol=1e-6)
    assert float(sampler.tree.values()[47]) == 0.0 and float(sampler._held.values()[0]) == 0.0


def test_a_state_dict_is_a_snapshot_that_later_writes_leave_alone():
    """The boundaries in a sampler's state are copies: writes after it was taken (which update the
    index's tables in place) do not reach it, and loading it gives the trajectories of then."""
    data = _transitions(_random_stream(31, 30, max_len=8))
    rb = _buffer(gpubuf.SliceSampler(slice_len=3, traj_key="episode"), 40)
    rb.extend(data[:30])
    rb.sample(6)
    state = rb.sampler.state_dict()
    then = _our_trajectories(rb.sampler)
    rb.extend(data[30:60])  # wraps round the ring: every table changes
    rb.sample(6)
    assert _our_trajectories(rb.sampler) != then
    restored = gpubuf.SliceSampler(slice_len=3, traj_key="episode")
    restored.load_state_dict(state)
    assert _our_trajectories(restored) == then


def test_the_newest_id_kept_between_writes_pins_at_most_the_last_write_s_read():
    """The id of the newest row, kept to find whether the next write continues its trajectory,
    is a view of the ids that write read (no copy per write), never of a read of the whole
    storage, and a state copies it."""
    data = _transitions(_random_stream(31, 30, max_len=8))
    rb = _buffer(gpubuf.SliceSampler(slice_len=3, traj_key="episode"), 40)
    rb.extend(data[:30])
    rb.sample(6)
    sampler = rb.sampler
    rb.extend(data[30:35])
    rb.sample(6)  # reads the 5 rows written
    assert int(sampler._last) == int(data["episode"][34])
    assert sampler._last.untyped_storage().nbytes() == 5 * sampler._last.element_size()
    last = sampler.state_dict()["last"]
    assert last.untyped_storage().nbytes() == last.element_size() and torch.equal(last, sampler._last)
    # Reading every row again (a write the sampler did not follow): a copy of the one id.
    sampler._rebuild(rb.storage, 40, 1, (), torch.device("cpu"), newest=34)
    assert int(sampler._last) == int(data["episode"][34])
    assert sampler._last.untyped_storage().nbytes() == sampler._last.element_size()


# ---------------------------------------------------------------------- storages and buffers
@pytest.mark.parametrize("kind", ["memmap", "list"])
def test_other_storages_give_the_tensor_storage_draws(kind, tmp_path):
    data = _transitions(_random_stream(15, 12, max_len=8))
    storage = {
        "memmap": lambda: gpubuf.LazyMemmapStorage(40, scratch_dir=tmp_path),
        "list": lambda: gpubuf.ListStorage(40),
    }[kind]
    reference = _buffer(gpubuf.SliceSampler(slice_len=3, traj_key="episode"), 40, seed=16)
    other = gpubuf.TensorDictReplayBuffer(
        storage=storage(),
        sampler=gpubuf.SliceSampler(slice_len=3, traj_key="episode"),
        generator=torch.Generator().manual_seed(16),
    )
    for rb in (reference, other):
        rb.extend(data[:30])
        rb.extend(data[30:])
    for _ in range(3):
        a, b = reference.sample(12), other.sample(12)
        assert torch.equal(a["obs"], b["obs"])
        assert torch.equal(a["next", "truncated"], b["next", "truncated"])
    assert _our_trajectories(reference.sampler) == _our_trajectories(other.sampler)


def test_prefetch_returns_the_draws_of_a_plain_buffer():
    data = _transitions(_random_stream(17, 20, max_len=9))

    def make(prefetch):
        return gpubuf.TensorDictReplayBuffer(
            storage=gpubuf.LazyTensorStorage(60),
            sampler=gpubuf.SliceSampler(num_slices=4, traj_key="episode"),
            generator=torch.Generator().manual_seed(18),
            batch_size=16,
            prefetch=prefetch,
        )

    plain, ahead = make(None), make(2)
    for rb in (plain, ahead):
        rb.extend(data[:40])
    assert torch.equal(plain.sample()["obs"], ahead.sample()["obs"])
    for rb in (plain, ahead):
        rb.extend(data[40:])  # drops the batches drawn ahead, and their draws
    for _ in range(3):
        assert torch.equal(plain.sample()["obs"], ahead.sample()["obs"])


def test_tensordict_priority_update_from_a_sampled_batch():
    capacity, slice_len = 40, 4
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(capacity),
        sampler=gpubuf.PrioritizedSliceSampler(capacity, 1.0, 1.0, slice_len=slice_len, traj_key="episode"),
        batch_size=3 * slice_len,
    )
    rb.extend(_transitions(_episodes([10, 12, 9])))
    batch = rb.sample()
    batch["td_error"] = torch.arange(batch.batch_size[0], dtype=torch.float) + 2.0
    rb.update_tensordict_priority(batch)
    rows = batch["index"].reshape(-1)
    merged = rb.sampler.tree.values() + rb.sampler._held.values()
    last = {}
    for r, p in zip(rows.tolist(), batch["td_error"].tolist()):
        last[r] = p  # the last priority given to a row wins
    for r, p in last.items():
        assert math.isclose(float(merged[r]), p + 1e-8, rel_tol=1e-6)


@pytest.mark.gpu
def test_cuda_storage_draws_match_the_cpu_index():
    data = _transitions(_random_stream(19, 30, max_len=11))
    cpu = _buffer(gpubuf.SliceSampler(num_slices=8, traj_key="episode"), 80)
    cuda = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(80, device="cuda"),
        sampler=gpubuf.PrioritizedSliceSampler(80, 0.6, 0.4, num_slices=8, traj_key="episode"),
    )
    plain = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(80, device="cuda"), sampler=gpubuf.SliceSampler(num_slices=8, traj_key="episode")
    )
    for rb in (cpu, cuda, plain):
        rb.extend(data[:50])
        rb.extend(data[50:])
        rb.sample(32)
    assert _our_trajectories(plain.sampler) == _our_trajectories(cpu.sampler)
    valid = set(_valid_starts(_our_trajectories(cpu.sampler), 4, 80))
    assert set((cuda.sampler.tree.values() > 0).nonzero().reshape(-1).tolist()) == valid
    for rb in (cuda, plain):
        batch = rb.sample(32)
        assert batch.device.type == "cuda"
        rows = batch["index"].reshape(8, 4)
        assert ((rows - rows[:, :1]) % 80 == torch.arange(4, device="cuda")).all()
        episodes = batch["episode"].reshape(8, 4)
        assert (episodes == episodes[:, :1]).all()


def test_ensemble_members_sample_slices():
    members = [
        gpubuf.TensorDictReplayBuffer(
            storage=gpubuf.LazyTensorStorage(50), sampler=gpubuf.SliceSampler(slice_len=4, traj_key="episode")
        )
        for _ in range(2)
    ]
    for i, rb in enumerate(members):
        rb.extend(_transitions(_random_stream(30 + i, 10, max_len=9) + 100 * i))
    ensemble = gpubuf.ReplayBufferEnsemble(*members, batch_size=16, num_buffer_sampled=2)
    batch = ensemble.sample()
    assert batch.batch_size == (2, 8)
    for chunk, member in zip(batch.unbind(0), batch["index", "buffer_ids"][:, 0].tolist()):
        for one in chunk.reshape(2, 4).unbind(0):
            assert one["episode"].unique().numel() == 1 and int(one["episode"][0]) // 100 == member
            rows = one["index", "index"]
            assert torch.equal((rows - rows[0]) % 50, torch.arange(4))


def test_boundary_source_detection_and_optional_info_entries():
    data = _transitions(_episodes([4, 6, 5]))
    rb = _buffer(gpubuf.SliceSampler(slice_len=2), 30)  # neither key: "episode" is found
    rb.extend(data)
    rb.sample(4)
    assert rb.sampler._source == ("traj", ("episode",))
    collector = data.clone()
    collector["collector", "traj_ids"] = collector["episode"] + 7
    rb = _buffer(gpubuf.SliceSampler(slice_len=2), 30)
    rb.extend(collector)
    rb.sample(4)
    assert rb.sampler._source == ("traj", ("collector", "traj_ids"))
    bare = data.exclude("episode")
    rb = _buffer(gpubuf.SliceSampler(slice_len=2), 30)
    rb.extend(bare)
    rb.sample(4)
    assert rb.sampler._source == ("end", (("next", "done"),))

    rb = _buffer(gpubuf.SliceSampler(slice_len=2, traj_key="episode", truncated_key=None, init_key=None), 30)
    rb.extend(data)
    batch, info = rb.sample(8, return_info=True)
    assert set(info) == {"index"}
    assert ("next", "truncated") not in batch.keys(True)
    assert torch.equal(batch["is_init"], rb.storage._storage["is_init"][batch["index"].reshape(-1)])


@pytest.mark.parametrize("name", ["end_key", "traj_key", "step_key", "truncated_key", "init_key"])
def test_slice_sampler_keys_that_are_not_keys_are_refused_at_construction(name):
    with pytest.raises(errors.SliceArgumentError, match=name):
        gpubuf.SliceSampler(num_slices=2, **{name: 5})


def test_a_repeated_draw_follows_writes_batch_sizes_settings_and_copies():
    """Draws of one size with nothing written between them reuse the first one's checks: a write
    (into a full storage too), another size, a changed setting or a copy of the sampler must each
    be seen."""
    import pickle

    def check(batch, slice_len):
        for one in _slices(batch, batch.shape[0] // slice_len):
            rows = one["index"].reshape(-1)
            assert torch.equal((rows - rows[0]) % 20, torch.arange(slice_len))
            assert one["episode"].unique().numel() == 1
        marks = batch["next", "truncated"].reshape(-1, slice_len)
        assert not marks[:, :-1].any() and marks[:, -1].all()
        assert batch["next", "done"].reshape(-1, slice_len)[:, -1].all()
        assert batch["is_init"].reshape(-1, slice_len)[:, 0].all()

    sampler = gpubuf.SliceSampler(slice_len=4, traj_key="episode")
    rb = _buffer(sampler, 20)
    rb.extend(_transitions(_episodes([3, 6, 3, 2, 3, 3])))  # fills the storage
    for _ in range(3):
        batch = rb.sample(8)
        check(batch, 4)
        assert batch["episode"].unique().tolist() == [1]  # the only episode of 4 steps or more
    rb.extend(_transitions(_episodes([7], first_id=7), offset=20))  # overwrites episodes 0 and 1
    for _ in range(3):
        batch = rb.sample(8)
        check(batch, 4)
        assert batch["episode"].unique().tolist() == [7]
    assert rb.sample(12).shape == (12,)  # three slices now
    sampler.slice_len = 2
    check(rb.sample(12), 2)
    sampler.slice_len = 4
    sampler.truncated_key = None
    first, second = rb.sample(8), rb.sample(8)
    assert set(first.keys(True, True)) == set(second.keys(True, True))
    assert ("next", "truncated") not in second.keys(True) and second["is_init"].view(2, 4)[:, 0].all()
    sampler.truncated_key = ("next", "truncated")
    assert ("next", "truncated") in rb.sample(8).keys(True)
    copy = pickle.loads(pickle.dumps(sampler))  # without the flag columns (views of this process's tensors)
    (rows,), info = copy.sample(rb.storage, 8)
    assert torch.equal((rows.view(2, 4) - rows.view(2, 4)[:, :1]) % 20, torch.arange(4).expand(2, 4))
    rb.empty()
    rb.extend(_transitions(_episodes([5], first_id=40)))
    assert rb.sample(8)["episode"].unique().tolist() == [40]


def test_buffers_sampled_in_turn_each_draw_from_their_own_boundaries():
    """Two samplers drawing in turn (the compiled draw keeps the host views of the last tables it
    was given) each list windows of their own trajectories, before and after a write to one."""
    first, second = _buffer(gpubuf.SliceSampler(slice_len=4, traj_key="episode"), 30), _buffer(
        gpubuf.SliceSampler(slice_len=4, traj_key="episode"), 50, seed=1
    )
    first.extend(_transitions(_episodes([5, 8, 6], first_id=0)))
    second.extend(_transitions(_episodes([9, 12, 4, 20], first_id=100)))
    for turn in range(6):
        if turn == 3:
            first.extend(_transitions(_episodes([11], first_id=50), offset=19))
        for rb, ids in ((first, {0, 1, 2} | ({50} if turn >= 3 else set())), (second, {100, 101, 102, 103})):
            batch = rb.sample(16)
            for one in _slices(batch, 4):
                assert one["episode"].unique().numel() == 1
                assert int(one["episode"][0]) in ids
                rows = one["index"].reshape(-1)
                assert torch.equal((rows - rows[0]) % rb.storage.max_size, torch.arange(4))
    assert 50 in first.sample(400)["episode"].unique().tolist()


def test_an_epoch_sampler_refuses_cuda_graph_capture(monkeypatch):
    """The refusal a capture of a sampler without replacement meets (the capture itself is in the
    GPU tests): only for CUDA data, only while a capture runs, as an UnsupportedOptionError."""
    from gpubuf.errors import UnsupportedOptionError
    from gpubuf.samplers.random import _refuse_graph_capture

    sampler = gpubuf.SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(UnsupportedOptionError, match="CUDA graph replay cannot move"):
        _refuse_graph_capture(sampler, torch.device("cuda"))
    _refuse_graph_capture(sampler, torch.device("cpu"))  # CPU data is never captured
    _refuse_graph_capture(sampler, None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _refuse_graph_capture(sampler, torch.device("cuda"))


def _excluded_by_step(sampler, seq_length: int) -> torch.Tensor:
    """The steps that cannot start a slice of ``seq_length``, found step by step: a live step is
    excluded when fewer than the kept tail steps follow it in its trajectory (its first step
    excepted without strict_length)."""
    index = sampler._index
    excluded = torch.zeros_like(sampler._excluded)
    kept = sampler._tail_kept(seq_length)
    for col in range(index.columns):
        for row in range(index.size):
            c, r = torch.tensor([col]), torch.tensor([row])
            start, stop = (int(v) for v in index.trajectory_of(c, r))
            tau = int(index.absolute(r))
            out = stop - tau < kept and (sampler.strict_length or tau != start)
            excluded[row * index.columns + col] = out
    return excluded


@pytest.mark.parametrize("ndim", [1, 2])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("span", [False, (0, 1), (False, True)])
def test_prioritized_exclusions_for_a_new_slice_length_match_the_step_rule(ndim, strict, span):
    """A draw of another slice length sets every exclusion anew, trajectory by trajectory: the
    same steps as the rule read step by step, and every priority kept in one of the two trees."""
    envs = 3 if ndim == 2 else 1
    capacity = 23 * envs
    sampler = gpubuf.PrioritizedSliceSampler(capacity, 1.0, 1.0, num_slices=2, traj_key="episode",
                                             strict_length=strict, span=span)
    rb = _buffer(sampler, capacity, ndim=ndim)
    for step, n in enumerate((9, 14, 6, 17)):  # wraps the ring twice
        episode = _random_stream(40 + step, n, max_len=7)[:n] + 1000 * step
        if ndim == 2:
            episode = torch.stack([episode + 100 * e for e in range(envs)])
        rb.extend(TensorDict({"episode": episode, "obs": episode.clone()}, list(episode.shape)))
    g = torch.Generator().manual_seed(3)
    priorities = torch.rand(capacity, generator=g) + 0.5
    rb.update_priority(torch.arange(capacity), priorities)
    for seq_length in (3, 5, 2):
        try:
            rb.sample(2 * seq_length)
        except errors.TrajectoryLengthError:
            pass  # no trajectory that long with strict_length: the exclusions are set all the same
        assert sampler._excluded_for == seq_length
        want = _excluded_by_step(sampler, seq_length)
        assert torch.equal(sampler._excluded, want)
        tree, held = sampler.tree.values(), sampler._held.values()
        assert bool((tree[want] == 0).all()) and bool((held[~want] == 0).all())
        assert torch.allclose(tree + held, priorities)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8])
def test_end_flags_of_another_dtype_than_bool_mark_done_where_nonzero(dtype):
    """A ``("next", "done")`` stored as numbers (float16, uint8): the batch's done flags are the
    stored ones that are nonzero, or'ed with the truncation marks (a bitwise or of a float
    raised ``NotImplementedError``)."""
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(40), batch_size=8,
                                       sampler=gpubuf.SliceSampler(num_slices=2, end_key=("next", "done")),
                                       generator=torch.Generator().manual_seed(0))
    done = torch.zeros(40, 1, dtype=dtype)
    done[9::10] = 1
    rb.extend(TensorDict({"obs": torch.arange(40), ("next", "done"): done}, [40]))
    for _ in range(8):
        batch = rb.sample()
        flags = batch["next", "done"].reshape(-1)
        assert flags.dtype == torch.bool
        stored = rb[:]["next", "done"][batch["index"]].reshape(-1) != 0
        assert torch.equal(flags, stored | batch["next", "truncated"].reshape(-1))
