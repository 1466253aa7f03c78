"""A slice sample on the device path, run on CPU tensors: a buffer built with ``backend="triton"``
takes every branch a CUDA buffer takes (Triton through the interpreter), counted by
:func:`gpubuf.ops.device_work.count_device_work`, and gives the host path's batch."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import (
    LazyTensorStorage,
    PrioritizedSliceSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from gpubuf.ops.device_work import count_device_work

from device_helpers import assert_work

pytestmark = pytest.mark.interpreter


def _steps(n: int, flags: bool) -> TensorDict:
    """Episodes of 5 to 13 steps with an id and a done flag (and terminated and is_init with ``flags``)."""
    lengths = torch.arange(n) % 9 + 5
    episode = torch.repeat_interleave(torch.arange(n), lengths)[:n]
    done = torch.ones(n, 1, dtype=torch.bool)
    done[:-1, 0] = episode[1:] != episode[:-1]
    return _columns(episode, done, flags)


def _columns(episode: torch.Tensor, done: torch.Tensor, flags: bool) -> TensorDict:
    """Steps of ``episode`` ids and ``done`` flags, with ``obs`` the row number (and terminated
    on even episodes' last steps and is_init with ``flags``)."""
    n = episode.shape[0]
    entries = {"obs": torch.arange(n).float().unsqueeze(-1).expand(n, 3).clone(), "episode": episode,
               ("next", "done"): done}
    if flags:
        entries[("next", "terminated")] = done & (episode % 2 == 0).unsqueeze(-1)
        entries["is_init"] = torch.cat([torch.ones(1, 1, dtype=torch.bool), done[:-1]])
    return TensorDict(entries, [n])


def _buffer(sampler, backend: str, flags: bool) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(300), sampler=sampler, backend=backend, batch_size=64,
        generator=torch.Generator().manual_seed(0),
    )
    rb.extend(_steps(200, flags))
    rb.extend(_steps(150, flags))  # wraps around the ring
    return rb


@pytest.mark.parametrize("flags", [False, True])
@pytest.mark.parametrize("source", [{"traj_key": "episode"}, {"end_key": ("next", "done")}])
def test_a_slice_sample_is_the_window_draw_and_the_gather(source, flags):
    rb = _buffer(SliceSampler(num_slices=8, **source), "triton", flags)
    rb.sample()  # reads the boundaries written and builds the eligible list
    with count_device_work("cpu") as work:
        batch = rb.sample()
    # The uniforms, one launch drawing the windows and marking their steps, one gather.
    assert_work(work, launches=3, host_syncs=0,
                kernels={"aten:rand.generator": 1, "triton:_slice_windows_kernel": 1, "triton:_gather_rows_kernel": 1})
    host = _buffer(SliceSampler(num_slices=8, **source), "auto", flags)
    host.sample()
    want = host.sample()
    assert set(batch.keys(True, True)) == set(want.keys(True, True))
    assert (batch == want).all()
    windows = batch.reshape(8, 8)
    assert (windows["episode"] == windows["episode"][:, :1]).all() and windows["next", "truncated"][:, -1].all()


@pytest.mark.parametrize("flags", [False, True])
def test_a_prioritized_slice_sample_is_the_windows_draw_and_the_gather(flags):
    def make(backend):
        return _buffer(PrioritizedSliceSampler(300, alpha=0.7, beta=0.5, num_slices=8, traj_key="episode"), backend,
                       flags)

    rb = make("triton")
    rb.sample()
    with count_device_work("cpu") as work:
        batch = rb.sample()
    # The uniforms, one launch drawing the starts from the sum tree and listing the windows' rows
    # with their marks and weights (the minimum over every step, held-aside ones included, read on
    # the device), the gather.
    assert_work(work, launches=3, host_syncs=0,
                kernels={"aten:rand.generator": 1, "triton:_sumtree_windows_kernel": 1,
                         "triton:_gather_rows_kernel": 1})
    host = make("auto")
    host.sample()
    want = host.sample()
    assert set(batch.keys(True, True)) == set(want.keys(True, True))
    assert torch.equal(batch["index"], want["index"])
    assert (batch.exclude("priority_weight") == want.exclude("priority_weight")).all()
    torch.testing.assert_close(batch["priority_weight"], want["priority_weight"], rtol=1e-6, atol=0)
    windows = batch.reshape(8, 8)
    assert (windows["episode"] == windows["episode"][:, :1]).all() and windows["next", "truncated"][:, -1].all()
    assert (windows["priority_weight"] == windows["priority_weight"][:, :1]).all()


def test_prioritized_slice_writes_updates_and_samples_on_the_device_path_never_sync():
    """The loop a learner runs (extend, sample, update the sampled steps' priorities), repeated
    with wrap-around: the held-aside steps move between the two trees by masks, never by a
    selection whose size the host would wait for, and the batches are the host path's."""

    def make(backend):
        rb = _buffer(PrioritizedSliceSampler(300, alpha=0.7, beta=0.5, num_slices=8, traj_key="episode"), backend,
                     False)
        rb.sample()
        return rb

    rb, host = make("triton"), make("auto")
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        data = _steps(60, False)
        data["episode"] += 1000 * (step + 1)
        priority = torch.rand(64, generator=gen) + 0.1
        with count_device_work("cpu") as work:
            rb.extend(data)
            batch = rb.sample()
            rb.update_priority(batch["index"], priority)
        # The boundaries and the exclusions of the steps the write touched are one kernel each
        # (and a cumsum). Six sum-tree updates of two launches each: the new steps' priority,
        # the zeroed held leaves of every step written (no gather or select to pick the held
        # ones), the refresh's two moves, and the update's priorities of the steps in the tree
        # and of those held aside, told apart by one lookup of the exclusions at a clamped
        # index and two selects. No launch of a constant: the -1 of a masked index and the
        # zero priority are kept on the device, and an update without a running maximum
        # allocates none.
        assert_work(work, launches=29, host_syncs=0, kernels={
            "triton:_episode_rows_kernel": 1, "triton:_episode_lists_kernel": 1, "triton:_start_exclusions_kernel": 1,
            "triton:_sumtree_windows_kernel": 1, "triton:_sumtree_claim_kernel": 6, "aten:full.default": 0,
            "aten:scalar_tensor.default": 0, "aten:zeros.default": 0, "aten:where.self": 2, "aten:index.Tensor": 2,
            "aten:clamp.default": 1, "aten:eq.Tensor": 0, "aten:bitwise_and.Tensor": 0})
        host.extend(data)
        want = host.sample()
        host.update_priority(want["index"], priority)
        assert torch.equal(batch["index"], want["index"]), step
        torch.testing.assert_close(batch["priority_weight"], want["priority_weight"], rtol=1e-6, atol=0)
        torch.testing.assert_close(rb.sampler.tree.values(), host.sampler.tree.values(), rtol=1e-6, atol=0)
        torch.testing.assert_close(rb.sampler._held.values(), host.sampler._held.values(), rtol=1e-6, atol=0)
    rb.sampler.check_errors()


def test_a_bad_priority_for_a_held_step_is_skipped_and_reported_at_the_check():
    """On the device path a bad priority is skipped (the held tree keeps its leaf) and raised by
    ``check_errors``, as the prioritized sampler reports its own; the valid ones are written."""
    from gpubuf.errors import PriorityError

    rb = _buffer(PrioritizedSliceSampler(300, alpha=0.7, beta=0.5, num_slices=8, traj_key="episode"), "triton", False)
    rb.sample()
    sampler = rb.sampler
    held = int(sampler._excluded.nonzero().reshape(-1)[0])
    free = int((~sampler._excluded[:300]).nonzero().reshape(-1)[0])
    held_before, tree_before = sampler._held.values().clone(), sampler.tree.values().clone()
    with count_device_work("cpu") as work:
        rb.update_priority(torch.tensor([free, held]), torch.tensor([3.0, float("nan")]))
    assert work.host_syncs == 0, work.summary()
    assert torch.equal(sampler._held.values(), held_before)
    assert sampler.tree.values()[free] != tree_before[free]
    with pytest.raises(PriorityError):
        sampler.check_errors()


def test_a_prioritized_slice_update_past_the_tree_is_reported_at_the_check_without_a_sync():
    """An index past the tree, on the device path: the update skips it and records the error (no
    host read), the exclusions are read at a clamped index (never out of bounds), and the valid
    entry lands."""
    from gpubuf.errors import IndexOutOfRangeError

    sampler = PrioritizedSliceSampler(300, alpha=1.0, beta=0.5, num_slices=8, traj_key="episode")
    rb = _buffer(sampler, "triton", False)
    rb.sample()
    before = sampler.tree.values() + sampler._held.values()
    with count_device_work("cpu") as work:
        rb.update_priority(torch.tensor([5, 10**6]), torch.tensor([2.0, 3.0]))
    assert work.host_syncs == 0, work.summary()
    with pytest.raises(IndexOutOfRangeError):
        sampler.check_errors()
    after = sampler.tree.values() + sampler._held.values()
    assert float(after[5]) == 2.0
    assert torch.equal(torch.cat([after[:5], after[6:]]), torch.cat([before[:5], before[6:]]))


def test_a_slice_cycle_on_the_device_path_never_syncs_and_an_emptied_buffer_is_reported_at_the_check():
    """Whether a trajectory holds a slice is read on the host once per length; after that a
    write-sample cycle has no host read, and a write that leaves no trajectory long enough makes
    the draw return rows of -1 and record the error, raised once by ``check_errors``. The host
    path raises at the sample."""
    from gpubuf.errors import TrajectoryLengthError

    def make(backend):
        rb = _buffer(SliceSampler(num_slices=8, traj_key="episode"), backend, False)
        rb.sample()  # the first draw of slices of 8 reads the eligible count on the host
        return rb

    rb, host = make("triton"), make("auto")
    for step in range(3):
        data = _steps(60, False)
        data["episode"] += 1000 * (step + 1)
        with count_device_work("cpu") as work:
            rb.extend(data)
            batch = rb.sample()
        # The write (the fused copy and one index range), its rows' ids and breaks, the
        # boundaries (a cumsum, one rows kernel, one kernel for the list of slices of 8), the
        # sample's three.
        assert_work(work, launches=11, host_syncs=0, kernels={
            "triton:_write_rows_kernel": 1, "aten:cumsum.default": 1, "triton:_episode_rows_kernel": 1,
            "triton:_episode_lists_kernel": 1, "triton:_slice_windows_kernel": 1, "triton:_gather_rows_kernel": 1,
            "aten:clone.default": 0})  # the newest id is kept as a view of the ids read
        host.extend(data)
        assert (batch == host.sample()).all()
    rb.sampler.check_errors()  # nothing recorded
    # Episodes of 3 steps over the whole ring: no slice of 8 anywhere.
    short = _columns(torch.arange(300) // 3 + 10**6, (torch.arange(300) % 3 == 2).unsqueeze(-1), False)
    chunks = short.split(60)
    for chunk in chunks[:-1]:  # each write a part of the ring, each followed by a draw: the incremental path
        rb.extend(chunk)
        host.extend(chunk)
        rb.sample()
    with count_device_work("cpu") as work:
        rb.extend(chunks[-1])
        batch = rb.sample()
    host.extend(chunks[-1])
    assert work.host_syncs == 0, work.summary()
    assert bool((batch["index"] == -1).all())
    with pytest.raises(TrajectoryLengthError, match="required=8"):
        rb.sampler.check_errors()
    rb.sampler.check_errors()  # reported once
    with pytest.raises(TrajectoryLengthError, match="required=8"):
        host.sample()


def test_a_write_of_the_whole_ring_starts_the_index_over_without_a_sync():
    """A write of the storage's capacity or more starts the episode index over: on the device path
    the list of slices is rebuilt over as many trajectory numbers as live rows, masked, instead
    of reading their count on the host; the draws are the host path's."""

    def make(backend):
        rb = _buffer(SliceSampler(num_slices=8, traj_key="episode"), backend, False)
        rb.sample()
        return rb

    rb, host = make("triton"), make("auto")
    for n, first in ((300, 10**4), (450, 2 * 10**4)):
        data = _steps(n, False)
        data["episode"] += first
        with count_device_work("cpu") as work:
            rb.extend(data)
            batch = rb.sample()
        assert work.host_syncs == 0, work.summary()
        host.extend(data)
        assert (batch == host.sample()).all()


def test_a_prioritized_slice_draw_from_an_empty_tree_is_reported_at_the_check_without_a_sync():
    """Every priority 0 (eps 0): the fused draw flags the tree on the device instead of reading its
    total on the host; ``check_errors`` raises it, once."""
    from gpubuf.errors import EmptyBufferError

    sampler = PrioritizedSliceSampler(300, alpha=1.0, beta=0.5, eps=0.0, num_slices=8, traj_key="episode")
    rb = _buffer(sampler, "triton", False)
    rb.sample()
    rb.update_priority(torch.arange(300), torch.zeros(300))
    sampler.check_errors()  # the update itself was valid
    with count_device_work("cpu") as work:
        rb.sample()
    assert_work(work, launches=3, host_syncs=0)
    with pytest.raises(EmptyBufferError, match="every priority 0"):
        sampler.check_errors()
    sampler.check_errors()  # reported once, then cleared


def _whole_episodes(count: int, flags: bool) -> TensorDict:
    """``count`` whole episodes of 9 to 17 steps (every one long enough for slices of 8)."""
    lengths = torch.arange(count) % 9 + 9
    n = int(lengths.sum())
    episode = torch.repeat_interleave(torch.arange(count), lengths)
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[(lengths.cumsum(0) - 1), 0] = True
    return _columns(episode, done, flags)


@pytest.mark.parametrize("flags", [False, True])
def test_a_slice_sample_without_replacement_is_the_window_draw_and_the_gather(flags):
    """Every episode long enough: the epoch's picks go to the window draw as uniforms, so a batch
    is the start draws, the windows and the gather, with no host read while nothing is written;
    the epoch visits every episode once and the batches are the host path's."""

    def make(backend):
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(1000), sampler=SliceSamplerWithoutReplacement(num_slices=4, traj_key="episode"),
            backend=backend, batch_size=32, generator=torch.Generator().manual_seed(1),
        )
        rb.extend(_whole_episodes(30, flags))
        return rb

    rb, host = make("triton"), make("auto")
    seen = []
    for step in range(8):  # the epoch's 8 batches (30 episodes: 7 of 4, one of 2), then the next epoch's first
        if step == 1:
            with count_device_work("cpu") as work:
                batch = rb.sample()
            assert_work(work, launches=3, host_syncs=0,
                        kernels={"aten:uniform_.default": 1, "triton:_slice_windows_kernel": 1, "triton:_gather_rows_kernel": 1})
        else:
            batch = rb.sample()
        want = host.sample()
        assert (batch == want).all()
        windows = batch.reshape(-1, 8)
        assert (windows["episode"] == windows["episode"][:, :1]).all()
        assert (windows["obs"][:, 1:, 0] - windows["obs"][:, :-1, 0] == 1).all()
        assert windows["next", "truncated"][:, -1].all() and not windows["next", "truncated"][:, :-1].any()
        seen += windows["episode"][:, 0].tolist()
    assert sorted(seen) == list(range(30))
    batch = rb.sample()  # a new epoch
    assert (batch == host.sample()).all()
    # A write changes the trajectories: the next draw reads their number once, the one after none.
    more = _whole_episodes(2, flags)
    more["episode"] += 100
    rb.extend(more)
    host.extend(more)
    rb.sample()
    host.sample()
    with count_device_work("cpu") as work:
        batch = rb.sample()
    assert_work(work, launches=3, host_syncs=0)
    assert (batch == host.sample()).all()
