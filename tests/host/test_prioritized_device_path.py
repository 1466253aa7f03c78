"""The prioritized cycle on the device path, run on CPU tensors: a buffer built with
``backend="triton"`` takes every branch a CUDA buffer takes (Triton through the interpreter),
counted by :func:`gpubuf.ops.device_work.count_device_work`."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
from gpubuf.errors import IndexOutOfRangeError, PriorityError
from gpubuf.ops.device_work import count_device_work

from device_helpers import assert_work, rows_with_ids as _rows

pytestmark = pytest.mark.interpreter


def _buffer(backend: str, capacity: int, rows: int, seed: int = 0) -> TensorDictPrioritizedReplayBuffer:
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(capacity), backend=backend,
        generator=torch.Generator().manual_seed(seed),
    )
    rb.extend(_rows(rows))
    return rb


def _cycle(rb: TensorDictPrioritizedReplayBuffer, batch: int, priority: torch.Tensor) -> TensorDict:
    sample = rb.sample(batch)
    sample.set("td_error", priority)
    rb.update_tensordict_priority(sample)
    return sample


# Values checked against the host path at 256 and 4,096; the count at 65,536 is the next test.
@pytest.mark.parametrize("batch", [256, 4096])
def test_a_prioritized_cycle_is_at_most_8_launches_and_no_host_sync(batch):
    rb = _buffer("triton", capacity=2048, rows=2000)
    priority = torch.rand(batch, generator=torch.Generator().manual_seed(1)) + 0.1
    _cycle(rb, batch, priority)  # compiles and caches what the first call sets up
    with count_device_work("cpu") as work:
        sample = _cycle(rb, batch, priority)
    assert_work(work, max_launches=8, host_syncs=0)
    # Sample: the uniforms, one draw with its weights, one gather; update: claim and write.
    assert work.kernels["triton:_sumtree_sample_kernel"] == 1
    assert work.kernels["triton:_sumtree_claim_kernel"] == 1 and work.kernels["triton:_sumtree_write_kernel"] == 1
    # The same cycle on the host path: the same draws, weights and priorities (up to the power's
    # last bits), in a tree of the host's fanout (the nodes are laid out differently).
    host = _buffer("auto", capacity=2048, rows=2000)
    _cycle(host, batch, priority)
    want = _cycle(host, batch, priority)
    assert rb.sampler.tree.fanout != host.sampler.tree.fanout
    assert torch.equal(sample["index"], want["index"]) and (sample.exclude("priority_weight") == want.exclude("priority_weight")).all()
    torch.testing.assert_close(sample["priority_weight"], want["priority_weight"], rtol=1e-6, atol=0)
    torch.testing.assert_close(rb.sampler.tree.values(), host.sampler.tree.values(), rtol=1e-6, atol=0)
    for reading in ("total", "min"):
        torch.testing.assert_close(getattr(rb.sampler.tree, reading)(), getattr(host.sampler.tree, reading)(), rtol=1e-6, atol=0)
    rb.sampler.check_errors()


def test_a_prioritized_cycle_of_65536_is_at_most_8_launches_and_no_host_sync():
    # The large batch itself, counts only (its values are the 4,096 case's above, by construction):
    # about a minute through the interpreter.
    batch = 65_536
    rb = _buffer("triton", capacity=2048, rows=2000)
    priority = torch.rand(batch, generator=torch.Generator().manual_seed(1)) + 0.1
    _cycle(rb, batch, priority)
    with count_device_work("cpu") as work:
        _cycle(rb, batch, priority)
    assert_work(work, max_launches=8, host_syncs=0)
    assert work.kernels["triton:_sumtree_sample_kernel"] == 1 and work.kernels["triton:_gather_rows_kernel"] == 1
    assert work.kernels["triton:_sumtree_claim_kernel"] == 1 and work.kernels["triton:_sumtree_write_kernel"] == 1
    rb.sampler.check_errors()


def test_an_extend_of_a_prioritized_buffer_never_syncs():
    rb = _buffer("triton", capacity=64, rows=40)
    rb.update_priority(torch.tensor([3]), torch.tensor([5.0]))
    with count_device_work("cpu") as work:
        rb.extend(_rows(30, start=100))  # wraps around
    assert_work(work, host_syncs=0)
    leaves = rb.sampler.tree.values()
    assert torch.allclose(leaves[40:64].double(), torch.tensor(5.0 + 1e-8, dtype=torch.float64) ** 0.7)
    assert torch.allclose(leaves[:6].double(), torch.tensor(5.0 + 1e-8, dtype=torch.float64) ** 0.7)


def test_bad_priorities_on_the_device_path_are_skipped_and_raised_at_the_check():
    rb = _buffer("triton", capacity=64, rows=40)
    before = rb.sampler.tree.values().clone()
    with count_device_work("cpu") as work:
        rb.sampler.update_priority(torch.tensor([1, 2, 50]), torch.tensor([2.0, float("nan"), 3.0]), storage=rb.storage)
    assert_work(work, host_syncs=0)
    leaves = rb.sampler.tree.values()
    assert leaves[2] == before[2] and leaves[1] != before[1]  # the NaN was not written, the rest was
    with pytest.raises(PriorityError):
        rb.sampler.check_errors()
    rb.sampler.update_priority(torch.tensor([50]), torch.tensor([3.0]), storage=rb.storage)  # past the 40 written
    with pytest.raises(IndexOutOfRangeError):
        rb.state_dict()  # a host read of the sampler raises what the device recorded
    rb.sampler.check_errors()
