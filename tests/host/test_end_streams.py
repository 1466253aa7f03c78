"""``ReplayBufferEnsemble.end_streams``: each member's stream ends at its last row before restarted
producers append, side by side with TorchRL's."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import gpubuf

torchrl_data = pytest.importorskip("torchrl.data", reason="TorchRL is not installed: side-by-side checks skipped")
LIBS = pytest.mark.parametrize("lib", [torchrl_data, gpubuf], ids=["torchrl", "gpubuf"])
SLICE_LEN = 4


def _steps(n: int, start: int = 0, *, done_at_end: bool = False, truncated: bool = True, terminated=None) -> TensorDict:
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[-1] = done_at_end
    entries = {"obs": torch.arange(start, start + n, dtype=torch.float32).unsqueeze(-1), ("next", "done"): done,
               "env": torch.zeros(n, dtype=torch.int64)}
    if truncated:
        entries[("next", "truncated")] = torch.zeros(n, 1, dtype=torch.bool)
    if terminated is not None:
        entries[("next", "terminated")] = torch.full((n, 1), terminated, dtype=torch.bool)
    return TensorDict(entries, [n])


def _member(lib, capacity: int = 64, *, sampler=None, writer=None, storage=None, batch_size: int = 4 * SLICE_LEN):
    return lib.TensorDictReplayBuffer(
        storage=storage if storage is not None else lib.LazyTensorStorage(capacity),
        sampler=sampler if sampler is not None else lib.SliceSampler(slice_len=SLICE_LEN, end_key=("next", "done")),
        writer=writer if writer is not None else lib.TensorDictRoundRobinWriter(track_generations=True),
        batch_size=batch_size,
    )


@LIBS
def test_the_last_row_of_each_member_is_marked_done_and_truncated_keeping_counts_and_generations(lib):
    first, second, empty = _member(lib), _member(lib), _member(lib)
    first.extend(_steps(3))
    second.extend(_steps(5, done_at_end=True))  # already ended: done stays, truncated stays False
    ensemble = lib.ReplayBufferEnsemble(first, second, empty, batch_size=2 * SLICE_LEN)
    generations = [rb.writer.generations_of(torch.arange(len(rb))).clone() for rb in (first, second)]
    ensemble.end_streams()
    assert first[:]["next", "done"].flatten().tolist() == [False, False, True]
    assert first[:]["next", "truncated"].flatten().tolist() == [False, False, True]
    assert second[:]["next", "done"].flatten().tolist() == [False] * 4 + [True]
    assert second[:]["next", "truncated"].flatten().tolist() == [False] * 5
    assert (first.write_count, second.write_count, len(empty)) == (3, 5, 0)
    for rb, before in zip((first, second), generations):
        assert torch.equal(rb.writer.generations_of(torch.arange(len(rb))), before)


@LIBS
def test_a_terminated_tail_is_not_marked_truncated(lib):
    member = _member(lib)
    member.extend(_steps(3, terminated=True))
    lib.ReplayBufferEnsemble(member, batch_size=SLICE_LEN).end_streams()
    assert member[:]["next", "done"].flatten().tolist() == [False, False, True]
    assert member[:]["next", "truncated"].flatten().tolist() == [False, False, False]


def _crossing_slices(lib, *, end: bool, sampler_cls: str = "SliceSampler") -> int:
    """Slices drawn across the boundary between a stream cut off at row 9 and the restarted one."""
    sampler = getattr(lib, sampler_cls)(slice_len=SLICE_LEN, end_key=("next", "done"))
    member = _member(lib, sampler=sampler)
    member.extend(_steps(10))  # the stream is cut off mid-trajectory
    member.sample()  # the boundaries are read before the cut
    ensemble = lib.ReplayBufferEnsemble(member, batch_size=4 * SLICE_LEN)
    if end:
        ensemble.end_streams()
    member.extend(_steps(10, 100, done_at_end=True))  # the restarted producer
    torch.manual_seed(0)
    crossing = 0
    for _ in range(50):
        obs = member.sample()["obs"].reshape(-1, SLICE_LEN)
        crossing += int(((obs < 100).any(-1) & (obs >= 100).any(-1)).sum())
    return crossing


@LIBS
def test_a_restarted_stream_starts_a_new_trajectory(lib):
    assert _crossing_slices(lib, end=False) > 0  # without it, the restart continues the old trajectory
    assert _crossing_slices(lib, end=True) == 0


def test_a_prioritized_slice_sampler_also_sees_the_stream_end():
    def make():
        return gpubuf.PrioritizedSliceSampler(64, 0.7, 0.5, slice_len=SLICE_LEN, end_key=("next", "done"))

    member = _member(gpubuf, sampler=make())
    member.extend(_steps(10))
    member.sample()
    gpubuf.ReplayBufferEnsemble(member, batch_size=4 * SLICE_LEN).end_streams()
    member.extend(_steps(10, 100, done_at_end=True))
    for _ in range(50):
        obs = member.sample()["obs"].reshape(-1, SLICE_LEN)
        assert not bool(((obs < 100).any(-1) & (obs >= 100).any(-1)).any())


@LIBS
def test_a_streaming_sampler_drops_the_unfinished_window_and_starts_anew(lib):
    member = _member(lib, sampler=lib.StreamingSliceSampler(slice_len=SLICE_LEN, end_key=("next", "done")),
                     batch_size=SLICE_LEN)
    member.extend(_steps(6))  # one whole window (rows 0-3) and two rows of an unfinished one
    lib.ReplayBufferEnsemble(member, batch_size=SLICE_LEN).end_streams()
    member.extend(_steps(4, 100, done_at_end=True))  # the restart: one whole window of its own
    fresh = [member.sample()["obs"].flatten().tolist() for _ in range(2)]
    assert fresh == [[0.0, 1.0, 2.0, 3.0], [100.0, 101.0, 102.0, 103.0]]


@LIBS
def test_members_that_are_not_one_stream_are_refused_before_any_row_changes(lib):
    good = _member(lib)
    good.extend(_steps(3))
    for bad in (
        _member(lib, writer=lib.TensorDictRoundRobinWriter()),  # no slot generations
        _member(lib, sampler=lib.RandomSampler()),
        _member(lib, storage=lib.ListStorage(64)),
    ):
        bad.extend(_steps(3))
        with pytest.raises(RuntimeError):
            lib.ReplayBufferEnsemble(good, bad, batch_size=SLICE_LEN).end_streams()
        assert good[:]["next", "done"].flatten().tolist() == [False] * 3
    with pytest.raises(ValueError):
        lib.ReplayBufferEnsemble(good, batch_size=SLICE_LEN).end_streams(truncated_key=("next", "done"))


@LIBS
def test_a_trajectory_keyed_member_needs_one_id_per_stream(lib):
    same = _member(lib, sampler=lib.SliceSampler(slice_len=SLICE_LEN, traj_key="env"))
    same.extend(_steps(5))
    lib.ReplayBufferEnsemble(same, batch_size=SLICE_LEN).end_streams()
    assert same[:]["next", "done"].flatten().tolist() == [False] * 4 + [True]
    mixed = _member(lib, sampler=lib.SliceSampler(slice_len=SLICE_LEN, traj_key="env"))
    data = _steps(5)
    data["env"][3:] = 1
    mixed.extend(data)
    with pytest.raises(RuntimeError, match="same trajectory id"):
        lib.ReplayBufferEnsemble(mixed, batch_size=SLICE_LEN).end_streams()
    assert not bool(mixed[:]["next", "done"].any())


@LIBS
def test_an_end_flag_that_is_not_boolean_is_refused_before_any_member_changes(lib):
    good = _member(lib)
    good.extend(_steps(3))
    bad = _member(lib)
    data = _steps(3)
    data["next", "done"] = data["next", "done"].to(torch.uint8)
    bad.extend(data)
    with pytest.raises(TypeError):
        lib.ReplayBufferEnsemble(good, bad, batch_size=SLICE_LEN).end_streams()
    assert good[:]["next", "done"].flatten().tolist() == [False] * 3
    assert bad[:]["next", "done"].flatten().tolist() == [0, 0, 0]
    assert good.write_count == bad.write_count == 3
