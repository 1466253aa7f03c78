"""Sampling under CUDA graph capture: a fixed batch size, captured once, replayed.

A sample on the device path launches a draw and the fused gather, never reads a device value on
the host and allocates its outputs from the graph's pool, so ``torch.cuda.graph`` can capture it;
each replay draws new indices into the same output tensors. Capture after a warm-up (which builds
the gather's pointer table, and for the slice samplers reads the boundaries written and learns
which slice lengths some trajectory holds), as ``torch.cuda.graph`` asks.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, PrioritizedSliceSampler, SliceSampler, TensorDictReplayBuffer

pytestmark = pytest.mark.gpu


def _rows(n: int) -> TensorDict:
    ids = torch.arange(n, device="cuda")
    return TensorDict(
        {
            "obs": ids[:, None].float().expand(n, 17).clone(),
            "action": ids[:, None].expand(n, 3).clone(),
            "reward": ids.double(),
            "done": ids % 2 == 0,
            "next": {"obs": (ids[:, None] + 1).float().expand(n, 17).clone()},
        },
        batch_size=[n],
        device="cuda",
    )


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: allocations, pointer tables, compiled kernels
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_a_uniform_sample_is_captured_and_replays_fresh_draws():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000, device="cuda"), batch_size=256)
    rb.extend(_rows(10_000))
    graph, batch = _capture(rb.sample)
    seen = []
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        index = batch["index"].clone()
        seen.append(index)
        # The rows gathered are those of the drawn index, for every field.
        assert torch.equal(batch["reward"], index.double())
        assert torch.equal(batch["obs"], index[:, None].float().expand(256, 17))
        assert torch.equal(batch["next", "obs"], (index[:, None] + 1).float().expand(256, 17))
        assert torch.equal(batch["done"], index % 2 == 0)
    assert not all(torch.equal(seen[0], s) for s in seen[1:]), "every replay drew the same indices"


def _episodes(n: int) -> TensorDict:
    """``n`` steps in episodes of 40 to 48 steps: ``obs`` holds the row number, ``episode`` the id."""
    lengths = torch.arange(n) % 9 + 40
    episode = torch.repeat_interleave(torch.arange(n), lengths)[:n]
    done = torch.ones(n, 1, dtype=torch.bool)
    done[:-1, 0] = episode[1:] != episode[:-1]
    rows = torch.arange(n)
    return TensorDict(
        {"obs": rows[:, None].float().expand(n, 4).clone(), "episode": episode, ("next", "done"): done},
        batch_size=[n],
    ).to("cuda")


@pytest.mark.parametrize("prioritized", [False, True])
def test_a_slice_sample_is_captured_and_replays_fresh_windows(prioritized):
    """A slice sample (the uniforms, the window draw, the gather) captures and replays: each
    replay fills the same outputs with new windows of consecutive steps of one episode each."""
    n, num_slices, length = 20_000, 8, 32
    if prioritized:
        sampler = PrioritizedSliceSampler(n, alpha=0.7, beta=0.5, num_slices=num_slices, traj_key="episode")
    else:
        sampler = SliceSampler(num_slices=num_slices, traj_key="episode")
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(n, device="cuda"), sampler=sampler, batch_size=num_slices * length
    )
    rb.extend(_episodes(n))
    graph, batch = _capture(rb.sample)
    seen = []
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        windows = batch.reshape(num_slices, length)
        index = windows["index"].reshape(num_slices, length)
        # Consecutive rows (the buffer is not full: no wrap) of one episode, gathered for every field.
        assert (index[:, 1:] - index[:, :-1] == 1).all()
        assert (windows["episode"] == windows["episode"][:, :1]).all()
        assert torch.equal(windows["obs"], index[..., None].float().expand(num_slices, length, 4))
        assert windows["next", "truncated"][:, -1].all()
        if prioritized:
            assert (windows["priority_weight"] > 0).all()
        seen.append(index.clone())
    assert not all(torch.equal(seen[0], s) for s in seen[1:]), "every replay drew the same windows"


@pytest.mark.parametrize("slices", [False, True])
def test_capturing_a_sample_without_replacement_is_refused_and_changes_nothing(slices):
    """An epoch kept on the host cannot move in a replay: capturing such a sample raises a typed
    error, and the epoch is where it was."""
    from gpubuf import SamplerWithoutReplacement, SliceSamplerWithoutReplacement
    from gpubuf.errors import UnsupportedOptionError

    n = 2_000
    if slices:
        sampler = SliceSamplerWithoutReplacement(num_slices=4, traj_key="episode")
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n, device="cuda"), sampler=sampler, batch_size=128)
        rb.extend(_episodes(n))
    else:
        sampler = SamplerWithoutReplacement()
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(n, device="cuda"), sampler=sampler, batch_size=128)
        rb.extend(_rows(n))
    rb.sample()
    left = sampler._sample_list.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), pytest.raises(UnsupportedOptionError, match="graph"):
        with torch.cuda.graph(graph):
            rb.sample()
    torch.cuda.synchronize()
    assert torch.equal(sampler._sample_list, left)
