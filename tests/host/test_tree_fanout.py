"""The priority tree's fanout follows where it is read, and any saved fanout loads into any tree.

A host tree has :data:`~gpubuf.ops.sumtree.HOST_FANOUT` children per node, a tree on the device
path (CUDA, or the forced path of ``backend="triton"``) :data:`~gpubuf.ops.sumtree.DEFAULT_FANOUT`.
Checkpoints and state dicts written with one fanout load into a sampler of another: the same
leaves, the nodes rebuilt, the same draws as a tree built with that fanout from the start.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf import (
    LazyTensorStorage,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    ReplayBuffer,
    SharedPrioritizedSampler,
)
from gpubuf.ops.sumtree import DEFAULT_FANOUT, HOST_FANOUT, SumTree, fanout_for, sumtree_sample
from gpubuf.tools.aot import launched


def _buffer(sampler, backend="auto", capacity=300):
    return ReplayBuffer(storage=LazyTensorStorage(capacity), sampler=sampler, batch_size=8, backend=backend)


def _filled(sampler, backend="auto", seed=0):
    rb = _buffer(sampler, backend)
    rb.extend(torch.arange(250.0))
    gen = torch.Generator().manual_seed(seed)
    rb.update_priority(torch.arange(250), torch.rand(250, generator=gen) * 5)
    return rb


def test_the_fanout_rule():
    assert HOST_FANOUT != DEFAULT_FANOUT
    assert fanout_for(torch.device("cpu")) == HOST_FANOUT
    assert fanout_for(torch.device("cpu"), "numba") == HOST_FANOUT
    assert fanout_for(torch.device("cpu"), "triton") == DEFAULT_FANOUT
    assert fanout_for(torch.device("cuda", 0)) == DEFAULT_FANOUT


def test_a_host_buffer_gets_the_host_fanout_for_both_trees():
    rb = _filled(PrioritizedSliceSampler(300, 0.7, 0.5, num_slices=2))
    sampler = rb.sampler
    assert sampler._tree.fanout == HOST_FANOUT and sampler._held.fanout == HOST_FANOUT
    rb = _filled(PrioritizedSampler(300, 0.7, 0.5))
    assert rb.sampler._tree.fanout == HOST_FANOUT


@pytest.mark.interpreter
def test_the_forced_device_path_gets_the_device_fanout_for_both_trees():
    """The forced path must be the path CUDA takes, tree shape included."""
    rb = _filled(PrioritizedSliceSampler(300, 0.7, 0.5, num_slices=2), backend="triton")
    assert rb.sampler._tree.fanout == DEFAULT_FANOUT and rb.sampler._held.fanout == DEFAULT_FANOUT


@pytest.mark.interpreter
def test_a_refitted_tree_keeps_every_priority():
    """Priorities a sampler got on its own, before a buffer on the device path took it, survive
    the tree's rebuild, which the buffer's construction does: the writes that follow already go
    to a tree of the device's fanout (``extend(index)`` carries no storage to bind it later)."""
    sampler = PrioritizedSampler(300, 0.7, 0.5)
    sampler.update_priority(torch.arange(20, 25), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert sampler._tree.fanout == HOST_FANOUT
    before = sampler._tree.values().clone()
    rb = _buffer(sampler, backend="triton")
    assert sampler._tree.fanout == DEFAULT_FANOUT
    assert torch.equal(sampler._tree.values(), before)
    with launched() as found:
        rb.extend(torch.arange(30.0))
    assert {spec["constexprs"]["FANOUT"] for _, spec in found if spec["kernel"] == "_sumtree_write_kernel"} == {DEFAULT_FANOUT}
    assert int(sampler._tree.values().count_nonzero()) == 30
    _same_tree_as_built(sampler._tree, DEFAULT_FANOUT)


def _same_tree_as_built(tree: SumTree, fanout: int) -> None:
    """``tree`` equals a tree of ``fanout`` filled with its leaves: nodes, root and draws."""
    built = SumTree(tree.capacity, dtype=tree.dtype, fanout=fanout).fill_(tree.values())
    assert tree.fanout == fanout
    assert torch.equal(tree.leaves, built.leaves) and torch.equal(tree.sums, built.sums)
    assert torch.equal(tree.mins, built.mins)
    u = torch.rand(64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    for got, want in zip(sumtree_sample(tree, u), sumtree_sample(built, u)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_a_checkpoint_of_another_fanout_loads(tmp_path, shared):
    cls = SharedPrioritizedSampler if shared else PrioritizedSampler
    rb = _filled(cls(300, 0.7, 0.5))
    # A checkpoint written by a tree of the device's fanout (a CUDA buffer's, or an older version's).
    rb.sampler._tree = rb.sampler._tree.with_fanout(DEFAULT_FANOUT)
    saved = rb.sampler._tree.values().clone()
    rb.dumps(tmp_path / "ckpt")
    fresh = _buffer(cls(300, 0.7, 0.5))
    fresh.extend(torch.zeros(3))
    kept = fresh.sampler._tree
    assert kept.fanout == HOST_FANOUT
    fresh.loads(tmp_path / "ckpt")
    tree = fresh.sampler._tree
    assert torch.equal(tree.values(), saved)
    _same_tree_as_built(tree, HOST_FANOUT)
    if shared:
        assert tree is kept  # other processes map this tree: the values were copied into it


def test_a_state_dict_of_another_fanout_loads():
    rb = _filled(PrioritizedSampler(300, 0.7, 0.5))
    rb.sampler._tree = rb.sampler._tree.with_fanout(DEFAULT_FANOUT)
    state = rb.sampler.state_dict()
    assert state["_tree"]["fanout"] == DEFAULT_FANOUT
    fresh = _buffer(PrioritizedSampler(300, 0.7, 0.5))
    fresh.extend(torch.zeros(3))
    fresh.sampler.load_state_dict(state)
    assert torch.equal(fresh.sampler._tree.values(), rb.sampler._tree.values())
    _same_tree_as_built(fresh.sampler._tree, HOST_FANOUT)
