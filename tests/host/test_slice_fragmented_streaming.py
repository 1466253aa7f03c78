"""``SliceSampler(fragmented=True)`` and ``StreamingSliceSampler`` side by side with TorchRL's.

Both draw from the buffer's generator the way TorchRL's do, so the same writes and seed give the
same batches: compared entry by entry (index, data, truncation and done marks, padding mask)
after every write, wrap-around and overwritten windows included. The fragmented draw's
distribution is also checked by a chi-square test against its definition.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf import errors

torchrl_data = pytest.importorskip("torchrl.data")


def _pair(make_storage, make_sampler, batch_size: int, seed: int = 0):
    """The same buffer twice: TorchRL's and gpubuf's, each with a generator seeded alike."""
    return [
        lib.TensorDictReplayBuffer(
            storage=make_storage(lib), sampler=make_sampler(lib), batch_size=batch_size,
            generator=torch.Generator().manual_seed(seed),
        )
        for lib in (torchrl_data, gpubuf)
    ]


def _assert_same_batch(theirs: TensorDict, ours: TensorDict) -> None:
    their_keys = set(theirs.keys(True, True))
    assert their_keys == set(ours.keys(True, True))
    for key in their_keys:
        assert torch.equal(theirs[key].to(ours[key].dtype), ours[key]), key


# ---------------------------------------------------------------------- fragmented
def _interleaved(seed: int, n: int, streams: int = 3, first_traj: int = 0) -> TensorDict:
    """Steps of ``streams`` trajectories written in turn, with some steps missing (a gap splits a run)."""
    g = torch.Generator().manual_seed(seed)
    traj = torch.randint(0, streams, (n,), generator=g) + first_traj
    step = torch.zeros(n, dtype=torch.int64)
    for t in traj.unique():
        where = (traj == t).nonzero().squeeze(1)
        numbers = torch.arange(where.numel())
        numbers = numbers + (numbers >= where.numel() // 2) * torch.randint(0, 2, (1,), generator=g)  # a gap, or not
        step[where] = numbers
    return TensorDict(
        {"obs": torch.arange(n) + 1000 * seed, "traj": traj, "step_count": step,
         ("next", "done"): torch.zeros(n, 1, dtype=torch.bool)},
        [n],
    )


@pytest.mark.parametrize(("strict_length", "pad_output"), [(True, False), (False, False), (False, True)])
def test_fragmented_slices_match_torchrl_after_every_write(strict_length, pad_output):
    rbs = _pair(
        lambda lib: lib.LazyTensorStorage(50),
        lambda lib: lib.SliceSampler(slice_len=6, traj_key="traj", fragmented=True, strict_length=strict_length,
                                     pad_output=pad_output),
        batch_size=36,
    )
    # Three writes of disjoint trajectory ids; the last wraps past the capacity and overwrites.
    for write, (n, first) in enumerate([(30, 0), (15, 10), (25, 20)]):
        data = _interleaved(write, n, first_traj=first)
        for rb in rbs:
            rb.extend(data)
        for _ in range(2):
            theirs, ours = (rb.sample() for rb in rbs)
            _assert_same_batch(theirs, ours)
    # The slices follow step numbers within one trajectory, whatever rows they sit in.
    if strict_length:
        ours = ours.reshape(-1, 6)
        assert (ours["traj"] == ours["traj"][:, :1]).all()
        assert (ours["step_count"].diff(dim=1) == 1).all()
        assert ours["next", "truncated"][:, -1].all() and not ours["next", "truncated"][:, :-1].any()


def test_fragmented_draws_each_window_with_torchrl_probability():
    # Runs of lengths 5, 3 (a gap), 8 and 2 (too short); slices of 3: a run uniformly among the
    # three long enough, then a start uniformly among its len - 2 positions.
    traj = torch.tensor([0] * 5 + [0] * 3 + [1] * 8 + [2] * 2)
    step = torch.cat([torch.arange(5), torch.arange(6, 9), torch.arange(8), torch.arange(2)])
    order = torch.randperm(traj.numel(), generator=torch.Generator().manual_seed(0))
    data = TensorDict({"traj": traj[order], "step_count": step[order], "obs": torch.arange(18)}, [18])
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(18),
        sampler=gpubuf.SliceSampler(slice_len=3, traj_key="traj", fragmented=True),
        batch_size=3 * 6000, generator=torch.Generator().manual_seed(1),
    )
    rb.extend(data)
    first = rb.sample().reshape(-1, 3)[:, 0]
    expected = {}
    for t, start, length in [(0, 0, 5), (0, 6, 3), (1, 0, 8)]:
        for s in range(length - 2):
            expected[(t, start + s)] = 1 / 3 / (length - 2)
    counts = {key: 0 for key in expected}
    for t, s in zip(first["traj"].tolist(), first["step_count"].tolist()):
        counts[(t, s)] += 1  # a KeyError here is a window that cannot be drawn
    total = first.shape[0]
    chi2 = sum((counts[k] - total * p) ** 2 / (total * p) for k, p in expected.items())
    # 99.9% quantile of chi-square with 9 degrees of freedom: 27.88.
    assert chi2 < 27.88, (chi2, counts)


@pytest.mark.parametrize(
    ("bad", "builtin"),
    [
        ({"step_count": torch.tensor([0, 1, 1, 2])}, RuntimeError),  # a repeated trajectory-step pair
        ({"step_count": torch.tensor([0, 1, -1, 2])}, ValueError),
        ({"step_count": torch.tensor([0.0, 1.0, 2.0, 3.0])}, TypeError),
    ],
)
def test_fragmented_bad_records_raise_what_torchrl_raises_and_leave_the_buffer_as_it_was(bad, builtin):
    data = TensorDict({"traj": torch.zeros(4, dtype=torch.int64), "step_count": torch.arange(4), "obs": torch.arange(4)}, [4])
    bad_data = data.clone().update(bad)
    for lib in (torchrl_data, gpubuf):
        rb = lib.TensorDictReplayBuffer(
            storage=lib.LazyTensorStorage(4), sampler=lib.SliceSampler(slice_len=2, traj_key="traj", fragmented=True),
            batch_size=4,
        )
        rb.extend(bad_data)
        with pytest.raises(builtin):
            rb.sample()
    with pytest.raises(errors.TrajectoryStepError):
        rb.sample()
    assert len(rb) == 4
    if builtin is TypeError:
        return  # the storage holds float steps now; valid rows could not be written into it
    rb.extend(data)  # the same rows, now valid: sampling works again
    assert rb.sample()["step_count"].reshape(2, 2).diff(dim=1).eq(1).all()


def test_fragmented_arguments_and_storages_torchrl_refuses():
    with pytest.raises(ValueError):
        gpubuf.SliceSampler(slice_len=2, fragmented=True, step_key=None)
    with pytest.raises(NotImplementedError):
        gpubuf.SliceSampler(slice_len=2, fragmented=True, span=True)
    with pytest.raises(NotImplementedError):
        gpubuf.SliceSampler(slice_len=2, fragmented=True, compile=True)
    with pytest.raises(ValueError):
        gpubuf.SliceSampler(slice_len=2, fragmented=True, ends=torch.ones(4, dtype=torch.bool), cache_values=True)
    # End flags alone cannot order interleaved steps.
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(8), sampler=gpubuf.SliceSampler(slice_len=2, fragmented=True), batch_size=4
    )
    rb.extend(TensorDict({("next", "done"): torch.zeros(8, 1, dtype=torch.bool), "step_count": torch.arange(8)}, [8]))
    with pytest.raises(errors.TrajectoryKeyError):
        rb.sample()
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(4, ndim=2),
        sampler=gpubuf.SliceSampler(slice_len=2, traj_key="traj", fragmented=True), batch_size=4,
    )
    rb.extend(TensorDict({"traj": torch.zeros(4, 2, dtype=torch.int64), "step_count": torch.arange(8).reshape(4, 2)}, [4, 2]))
    with pytest.raises(NotImplementedError):
        rb.sample()


# ---------------------------------------------------------------------- streaming
def _stream_write(g: torch.Generator, start: int, n: int, traj_id: int, with_traj: bool) -> tuple[TensorDict, int]:
    done = torch.rand(n, 1, generator=g) < 0.1
    is_init = torch.rand(n, 1, generator=g) < 0.05
    traj = torch.full((n,), traj_id)
    traj += torch.cumsum((torch.rand(n, generator=g) < 0.1).to(torch.int64), 0)  # id changes without a done
    entries = {"value": torch.arange(start, start + n), ("next", "done"): done, "is_init": is_init}
    if with_traj:
        entries["episode"] = traj
    return TensorDict(entries, [n]), int(traj[-1])


@pytest.mark.parametrize("with_traj", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_streaming_windows_match_torchrl_through_writes_and_wrap_around(seed, with_traj):
    kwargs = {"traj_key": "episode"} if with_traj else {}
    rbs = _pair(
        lambda lib: lib.LazyTensorStorage(24),
        lambda lib: lib.StreamingSliceSampler(slice_len=3, **kwargs),
        batch_size=9, seed=seed,
    )
    g = torch.Generator().manual_seed(seed)
    start, traj_id, windows = 0, 0, 0
    for step in range(12):
        n = int(torch.randint(1, 14, (1,), generator=g)) if step else 12  # a first trajectory long enough
        data, traj_id = _stream_write(g, start, n, traj_id, with_traj)
        start += n
        for rb in rbs:
            rb.extend(data)
        if step % 3 != 1:  # some writes pile up before a draw: their oldest windows are overwritten
            # TorchRL's queued windows still current (the uniform slices after them are drawn from
            # the trajectories with the same distribution, not the same draws: compared elsewhere).
            queued, stamps = rbs[0].sampler._queued_slices, rbs[0].sampler._slot_versions
            fresh = [rows for rows, ver in queued if torch.equal(stamps[rows], ver)][:3]
            theirs, ours = (rb.sample() for rb in rbs)
            k = 3 * len(fresh)
            windows += len(fresh)
            if fresh:
                assert torch.equal(ours["index"][:k].reshape(-1), torch.cat(fresh))
            _assert_same_batch(theirs[:k], ours[:k])
            assert ours.shape == theirs.shape == (9,)
            # The uniform slices: 3 steps of one trajectory each, marked truncated at their end.
            rest = ours[k:].reshape(-1, 3) if k < 9 else ours[:0].reshape(0, 3)
            assert (rest["value"].diff(dim=1) == 1).all() and rest["next", "truncated"][:, -1].all()
    assert windows >= 6  # the comparison saw queued windows, not only uniform slices


def test_streaming_returns_each_new_window_once_in_write_order():
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(16), sampler=gpubuf.StreamingSliceSampler(slice_len=3), batch_size=6
    )
    done = torch.zeros(8, 1, dtype=torch.bool)
    done[4] = True  # a trajectory of 5 steps (one window, 2 left over), then 3 steps
    rb.extend(TensorDict({"value": torch.arange(8), ("next", "done"): done}, [8]))
    assert rb.sample()["value"].tolist() == [0, 1, 2, 5, 6, 7]
    rb.extend(TensorDict({"value": torch.arange(8, 11), ("next", "done"): torch.zeros(3, 1, dtype=torch.bool)}, [3]))
    batch = rb.sample()
    assert batch["value"][:3].tolist() == [8, 9, 10]  # the new window first, then a uniform slice
    assert batch["next", "truncated"].reshape(2, 3)[:, -1].all()


def test_streaming_bad_arguments_raise_what_torchrl_raises():
    for lib in (torchrl_data, gpubuf):
        with pytest.raises(TypeError):
            lib.StreamingSliceSampler(slice_len=2.0)
        with pytest.raises(ValueError):
            lib.StreamingSliceSampler(slice_len=0)
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(2), sampler=gpubuf.StreamingSliceSampler(slice_len=3), batch_size=3
    )
    rb.extend(TensorDict({("next", "done"): torch.zeros(2, 1, dtype=torch.bool)}, [2]))
    with pytest.raises(ValueError):  # a storage that cannot hold one window
        rb.sample()
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(16), sampler=gpubuf.StreamingSliceSampler(slice_len=3), batch_size=4
    )
    rb.extend(TensorDict({("next", "done"): torch.zeros(8, 1, dtype=torch.bool)}, [8]))
    with pytest.raises(errors.BatchSizeError):
        rb.sample()  # 4 is not a multiple of the slice length
    assert len(rb) == 8


@pytest.mark.parametrize("fragmented", [False, True])
def test_checkpoint_round_trip_keeps_the_queue_and_the_records(fragmented):
    n = 20
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[6] = True
    data = TensorDict({"value": torch.arange(n), ("next", "done"): done, "traj": torch.arange(n) // 4,
                       "step_count": torch.arange(n) % 4}, [n])

    def make():
        sampler = (gpubuf.SliceSampler(slice_len=3, traj_key="traj", fragmented=True) if fragmented
                   else gpubuf.StreamingSliceSampler(slice_len=3))
        return gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(32), sampler=sampler, batch_size=6)

    rb = make()
    rb.extend(data[:11])
    rb.sample()
    rb.extend(data[11:])
    with tempfile.TemporaryDirectory() as path:
        rb.dumps(path)
        loaded = make()
        loaded.loads(path)
    for _ in range(4):
        seed = torch.seed()
        torch.manual_seed(seed)
        want = rb.sample()
        torch.manual_seed(seed)
        _assert_same_batch(want, loaded.sample())
