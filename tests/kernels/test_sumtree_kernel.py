"""Triton sum-tree kernels vs their torch twins.

Runs on CUDA when present, else on CPU tensors through Triton's interpreter (set up by
tests/conftest.py). The interpreter runs programs one after another, so sizes stay small and
the launchers get a small ``block``; the ``gpu``-marked tests at the end cover the duplicate
paths at scale, where programs really run concurrently.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.errors import EmptyBufferError, IndexOutOfRangeError, PriorityError
from gpubuf.ops.sumtree import (
    SumTree,
    importance_weights,
    sumtree_check,
    sumtree_sample_weighted,
    sumtree_sample,
    sumtree_sample_ref,
    sumtree_update,
    sumtree_update_ref,
)
from gpubuf_kernels._config import SUMTREE
from gpubuf_kernels.sumtree import sumtree_sample_triton, sumtree_update_triton

BLOCK = 16  # small, so that batches around it stay cheap in the interpreter
CAPACITIES = [1, 7, 64, 65, 256, 257]
FANOUTS = [4, 32]
BATCHES = [1, BLOCK - 1, BLOCK, BLOCK + 1]


def _same(a: SumTree, b: SumTree) -> bool:
    return torch.equal(a.leaves, b.leaves) and torch.equal(a.sums, b.sums) and torch.equal(a.mins, b.mins)


def _seeded_pair(capacity, fanout, device, seed, dtype=torch.float32, integer=True):
    """Two equal trees on ``device``, half filled through the twin."""
    gen = torch.Generator().manual_seed(seed)
    tree = SumTree(capacity, fanout=fanout, dtype=dtype, device=device)
    n = max(1, capacity // 2)
    index = torch.randint(0, capacity, (n,), generator=gen)
    if integer:
        priority = torch.randint(0, 20, (n,), generator=gen).double()
    else:
        priority = torch.rand(n, generator=gen, dtype=torch.float64) * 3
    sumtree_update_ref(tree, index.to(device), priority.to(device))
    return tree, tree.clone(), gen


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("fanout", FANOUTS)
@pytest.mark.parametrize("batch", BATCHES)
def test_update_kernel_matches_twin(capacity, fanout, batch, kernel_device):
    kernel_tree, twin_tree, gen = _seeded_pair(capacity, fanout, kernel_device, seed=capacity * 7 + batch)
    for _ in range(2):
        # Negative and duplicate indices on purpose; integer priorities keep sums exact.
        index = torch.randint(-2, capacity, (batch,), generator=gen).to(kernel_device)
        priority = torch.randint(0, 20, (batch,), generator=gen).double().to(kernel_device)
        sumtree_update_triton(kernel_tree, index, priority, block=BLOCK)
        sumtree_update_ref(twin_tree, index, priority)
        assert _same(kernel_tree, twin_tree)


@pytest.mark.parametrize("capacity,fanout", [(257, 4), (1000, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_kernel_float_priorities(capacity, fanout, dtype, kernel_device):
    kernel_tree, twin_tree, gen = _seeded_pair(capacity, fanout, kernel_device, seed=5, dtype=dtype, integer=False)
    for _ in range(2):
        index = torch.randint(-1, capacity, (3 * BLOCK + 5,), generator=gen).to(kernel_device)
        priority = torch.rand(index.numel(), generator=gen, dtype=torch.float64).to(kernel_device)
        sumtree_update(kernel_tree, index, priority, alpha=0.6, eps=1e-8, backend="triton")
        sumtree_update_ref(twin_tree, index, priority, alpha=0.6, eps=1e-8)
    # Leaves and minima are exact on a GPU (CUDA's pow is torch's there); through the interpreter
    # the power is exp(alpha * log(x)), within a few ulps of float64 before rounding. Sums may
    # differ in the last bits (reduction order).
    if kernel_device.type == "cuda":
        assert torch.equal(kernel_tree.leaves, twin_tree.leaves)
        assert torch.equal(kernel_tree.mins, twin_tree.mins)
    else:
        ulp = 4 * torch.finfo(dtype).eps
        torch.testing.assert_close(kernel_tree.leaves, twin_tree.leaves, rtol=ulp, atol=0)
        torch.testing.assert_close(kernel_tree.mins, twin_tree.mins, rtol=ulp, atol=0)
    torch.testing.assert_close(kernel_tree.sums, twin_tree.sums, rtol=1e-13 if dtype == torch.float64 else 1e-6, atol=0)


def test_update_kernel_last_duplicate_wins(kernel_device):
    tree = SumTree(40, fanout=4, device=kernel_device)
    index = torch.tensor([3, 5, 3, -1, 3, 5, 39, 39], device=kernel_device)
    values = torch.tensor([1.0, 2.0, 3.0, 100.0, 4.0, 6.0, 7.0, 8.0], device=kernel_device)
    # A block smaller than the batch puts duplicates in different programs.
    sumtree_update_triton(tree, index, values, block=2)
    assert tree.values()[3].item() == 4.0 and tree.values()[5].item() == 6.0 and tree.values()[39].item() == 8.0
    assert tree.total().item() == 18.0 and tree.min().item() == 4.0


def test_update_kernel_default_blocks(kernel_device):
    kernel_tree, twin_tree, gen = _seeded_pair(300, 32, kernel_device, seed=9)
    b = SUMTREE["BLOCK"] + 1
    index = torch.randint(-1, 300, (b,), generator=gen).to(kernel_device)
    priority = torch.randint(0, 9, (b,), generator=gen).double().to(kernel_device)
    sumtree_update(kernel_tree, index, priority, backend="triton")
    sumtree_update_ref(twin_tree, index, priority)
    assert _same(kernel_tree, twin_tree)


@pytest.mark.parametrize("capacity", CAPACITIES)
@pytest.mark.parametrize("fanout", FANOUTS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("stratified", [False, True])
def test_sample_kernel_matches_twin(capacity, fanout, batch, stratified, kernel_device):
    tree, _, gen = _seeded_pair(capacity, fanout, kernel_device, seed=capacity + 3 * batch, integer=False)
    if tree.total().item() == 0:
        sumtree_update_ref(tree, torch.tensor([capacity - 1], device=kernel_device), torch.tensor([1.0], device=kernel_device))
    u = torch.rand(batch, dtype=torch.float64, generator=gen).to(kernel_device)
    index, value, _ = sumtree_sample_triton(tree, u, stratified=stratified, block=BLOCK)
    ref_index, ref_value = sumtree_sample_ref(tree, u, stratified=stratified)
    assert torch.equal(index, ref_index)
    assert torch.equal(value, ref_value)
    assert bool((value > 0).all())


def test_sample_kernel_boundaries(kernel_device):
    leaves = torch.tensor([0, 1, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    tree = SumTree(16, fanout=2, device=kernel_device)
    sumtree_update_ref(tree, torch.arange(16, device=kernel_device), leaves.to(kernel_device))
    top = 1.0 - 2.0**-53
    u = torch.tensor([0.0, 1 / 6, 3 / 6, 0.5, top, 2.0**-60], dtype=torch.float64, device=kernel_device)
    for stratified in (False, True):
        index, value = sumtree_sample(tree, u, stratified=stratified, backend="triton")
        ref_index, _ = sumtree_sample_ref(tree, u, stratified=stratified)
        assert torch.equal(index, ref_index) and bool((value > 0).all())


def test_sample_kernel_overshoot_takes_last_positive(kernel_device):
    tree = SumTree(16, fanout=4, device=kernel_device)
    sumtree_update_ref(tree, torch.tensor([1, 6], device=kernel_device), torch.tensor([1.0, 1.0], device=kernel_device))
    tree.sums[0] = 4.0  # a root larger than its children: every high mass overshoots
    u = torch.tensor([0.99, 0.6, 0.1], dtype=torch.float64, device=kernel_device)
    index, value, _ = sumtree_sample_triton(tree, u, block=2)
    assert index.tolist() == [6, 6, 1] and bool((value > 0).all())
    assert torch.equal(index, sumtree_sample_ref(tree, u)[0])


def test_sample_kernel_empty_tree(kernel_device):
    tree = SumTree(10, fanout=4, device=kernel_device)
    index, value, _ = sumtree_sample_triton(tree, torch.rand(5, dtype=torch.float64, device=kernel_device))
    assert index.tolist() == [0] * 5 and value.tolist() == [0.0] * 5
    # Nothing to draw from: recorded on the device, raised by the check.
    with pytest.raises(EmptyBufferError):
        sumtree_check(tree)
    empty_index, empty_value, _ = sumtree_sample_triton(tree, torch.empty(0, dtype=torch.float64, device=kernel_device))
    assert empty_index.numel() == 0 and empty_value.numel() == 0


def test_sample_kernel_zero_leaves_never_returned(kernel_device):
    gen = torch.Generator().manual_seed(1)
    capacity = 300
    priority = torch.rand(capacity, generator=gen) * (torch.rand(capacity, generator=gen) > 0.6)
    priority[::11] = 1e-30
    tree = SumTree(capacity, fanout=4, device=kernel_device)
    sumtree_update_ref(tree, torch.arange(capacity, device=kernel_device), priority.to(kernel_device))
    u = torch.rand(2000, dtype=torch.float64, generator=gen).to(kernel_device)
    index, value = sumtree_sample(tree, u, backend="triton")
    assert bool((value > 0).all()) and bool((tree.values()[index] > 0).all())


def test_launchers_check_arguments(kernel_device):
    tree = SumTree(10, fanout=4, device=kernel_device)
    index = torch.tensor([1, 2], device=kernel_device)
    with pytest.raises(TypeError):
        sumtree_update_triton(tree, index.float(), torch.ones(2, device=kernel_device))
    with pytest.raises(TypeError):
        sumtree_update_triton(tree, index, torch.ones(2, 1, dtype=torch.float64, device=kernel_device))
    with pytest.raises(TypeError):
        sumtree_update_triton(tree, index, torch.ones(3, device=kernel_device))
    with pytest.raises(TypeError):
        sumtree_update_triton(tree, index, torch.ones(2, device=kernel_device), max_priority=torch.zeros(1, device=kernel_device))
    with pytest.raises(TypeError):
        sumtree_sample_triton(tree, torch.rand(3, device=kernel_device))  # float32 uniforms
    with pytest.raises(TypeError):
        sumtree_sample_triton(tree, torch.rand(3, 1, dtype=torch.float64, device=kernel_device))


@pytest.mark.parametrize("capacity,fanout", [(3000, 4), (257, 4)])
def test_update_kernel_refreshes_large_levels_then_rebuilds_the_top(capacity, fanout, kernel_device, monkeypatch):
    """With few levels rebuilt whole, the levels between the leaves' parents and the top are
    refreshed one launch each, from the parents the write kernel recomputed; the last program of
    the last launch rebuilds the top and resets its counter."""
    monkeypatch.setitem(SUMTREE, "TOP_WHOLE", 2)
    kernel_tree, twin_tree, gen = _seeded_pair(capacity, fanout, kernel_device, seed=capacity)
    assert kernel_tree.depth >= 4
    for b in (1, BLOCK + 1, 3 * BLOCK):
        index = torch.randint(-1, capacity, (b,), generator=gen).to(kernel_device)
        priority = torch.randint(0, 20, (b,), generator=gen).double().to(kernel_device)
        sumtree_update_triton(kernel_tree, index, priority, block=BLOCK)
        sumtree_update_ref(twin_tree, index, priority)
        assert _same(kernel_tree, twin_tree), f"B={b}"
        assert kernel_tree.flags.tolist() == [0, 0]


def test_update_kernel_tracks_the_maximum_and_gives_new_items_it(kernel_device):
    tree = SumTree(40, fanout=4, device=kernel_device)
    twin = SumTree(40, fanout=4, device=kernel_device)
    running = torch.full((1,), -float("inf"), dtype=torch.float64, device=kernel_device)
    twin_running = running.clone()
    slot = running.data_ptr()
    steps = [
        (torch.arange(10), None),  # new items before any update: 1.0
        (torch.tensor([3, -1, 3, 7]), torch.tensor([0.5, 9.0, 2.5, 0.25])),  # 9.0 goes to a skipped index
        (torch.arange(10, 14), None),  # new items: the maximum, 2.5
        (torch.tensor([1]), torch.tensor([4.0])),
    ]
    for index, priority in steps:
        index = index.to(kernel_device)
        priority = None if priority is None else priority.to(kernel_device)
        sumtree_update(tree, index, priority, alpha=0.5, eps=0.1, max_priority=running, backend="triton")
        sumtree_update_ref(twin, index, priority, alpha=0.5, eps=0.1, max_priority=twin_running)
        assert running.item() == twin_running.item() and running.data_ptr() == slot
        torch.testing.assert_close(tree.leaves, twin.leaves, rtol=4 * torch.finfo(tree.dtype).eps, atol=0)
    assert running.item() == 4.0


def test_error_bits_agree_between_kernels_and_op():
    from gpubuf.ops.sumtree import ERROR_BITS
    from gpubuf_kernels.sumtree import ERROR_BITS as KERNEL_BITS

    assert ERROR_BITS == KERNEL_BITS


def test_update_kernel_skips_and_records_bad_entries(kernel_device):
    """Bad priorities and indices given on the device are never written; the others are, the tree
    stays consistent, and the check raises the typed error once."""
    tree = SumTree(50, fanout=4, device=kernel_device)
    twin = SumTree(50, fanout=4, device=kernel_device)
    fill = (torch.arange(30, device=kernel_device), torch.ones(30, dtype=torch.float64, device=kernel_device))
    sumtree_update(tree, *fill, backend="triton")
    sumtree_update_ref(twin, *fill)
    cases = [
        (torch.tensor([1, 2, 3]), torch.tensor([5.0, float("nan"), 7.0]), PriorityError, [1, 3]),
        (torch.tensor([4, 5]), torch.tensor([-1.0, 6.0]), PriorityError, [5]),
        (torch.tensor([6, 35, 8]), torch.tensor([2.0, 3.0, 4.0]), IndexOutOfRangeError, [6, 8]),  # 35 >= limit
        (torch.tensor([9]), torch.tensor([1e30]), PriorityError, []),  # (1e30) ** 2 overflows float32
    ]
    for index, priority, error, written in cases:
        sumtree_update(tree, index.to(kernel_device), priority.to(kernel_device), alpha=2.0, limit=30, backend="triton")
        keep = torch.tensor([i in written for i in index.tolist()])
        sumtree_update_ref(twin, index[keep].to(kernel_device), priority[keep].to(kernel_device), alpha=2.0)
        assert _same(tree, twin)
        with pytest.raises(error):
            sumtree_check(tree)
        sumtree_check(tree)  # cleared
    # Eager: checked on the host, raised at the call, nothing written.
    before = tree.clone()
    with pytest.raises(PriorityError):
        sumtree_update(tree, torch.tensor([1, 2], device=kernel_device), torch.tensor([1.0, -1.0], device=kernel_device),
                       eager=True, backend="triton")
    assert _same(tree, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_sample_kernel_matches_twin(dtype, kernel_device):
    tree, _, gen = _seeded_pair(300, 4, kernel_device, seed=4, dtype=dtype, integer=False)
    u = torch.rand(3 * BLOCK + 1, dtype=torch.float64, generator=gen).to(kernel_device)
    index, value, weight = sumtree_sample_triton(tree, u, beta=0.6, block=BLOCK)
    ref_index, ref_value = sumtree_sample_ref(tree, u)
    assert torch.equal(index, ref_index) and torch.equal(value, ref_value)
    want = importance_weights(ref_value, tree.min(), 0.6)
    if kernel_device.type == "cuda":
        assert torch.equal(weight, want)
    else:
        torch.testing.assert_close(weight, want, rtol=4 * torch.finfo(dtype).eps, atol=0)
    same_index, same_weight = sumtree_sample_weighted(tree, u, 0.6, backend="triton")
    assert torch.equal(same_index, index)


# ------------------------------------------------------------------------------ real GPU
@pytest.mark.gpu
def test_gpu_duplicates_deterministic_at_scale():
    """Heavy duplicates in one large batch: programs race on leaves and ancestors on a GPU."""
    gen = torch.Generator().manual_seed(0)
    capacity = 1 << 20
    index = torch.randint(0, 512, (1 << 18,), generator=gen)  # ~512 writes per index
    index[::97] = -1
    priority = torch.rand(index.numel(), generator=gen, dtype=torch.float64)
    twin = SumTree(capacity)
    sumtree_update_ref(twin, index, priority, alpha=0.7, eps=1e-6)
    results = []
    for _ in range(3):
        tree = SumTree(capacity, device="cuda")
        sumtree_update(tree, index.cuda(), priority.cuda(), alpha=0.7, eps=1e-6)
        results.append(tree)
        assert torch.equal(tree.leaves.cpu(), twin.leaves)
        assert torch.equal(tree.mins.cpu(), twin.mins)
        torch.testing.assert_close(tree.sums.cpu(), twin.sums, rtol=1e-12, atol=0)
    assert all(_same(results[0], r) for r in results[1:])


@pytest.mark.gpu
def test_gpu_update_and_sample_large():
    gen = torch.Generator().manual_seed(1)
    capacity = 1 << 20
    twin = SumTree(capacity)
    tree = SumTree(capacity, device="cuda")
    priority = torch.rand(capacity, generator=gen) * (torch.rand(capacity, generator=gen) > 0.3)
    for t in (twin, tree):
        sumtree_update(t, torch.arange(capacity, device=t.device), priority.to(t.device), alpha=0.6, eps=0.0)
    for _ in range(20):
        index = torch.randint(0, capacity, (65536,), generator=gen)
        p = torch.rand(65536, generator=gen)
        for t in (twin, tree):
            sumtree_update(t, index.to(t.device), p.to(t.device), alpha=0.6, eps=0.0)
    assert torch.equal(tree.leaves.cpu(), twin.leaves) and torch.equal(tree.mins.cpu(), twin.mins)
    exact = twin.values().double().sum().item()
    assert abs(tree.total().item() - exact) / exact < 1e-12
    u = torch.rand(1 << 20, dtype=torch.float64, generator=gen)
    for stratified in (False, True):
        index, value = sumtree_sample(tree, u.cuda(), stratified=stratified)
        ref_index, _ = sumtree_sample_ref(twin, u, stratified=stratified)
        assert bool((value > 0).all())
        # Parallel scans and reductions round differently: only draws within an ulp of a
        # boundary may land elsewhere.
        assert (index.cpu() != ref_index).float().mean().item() < 1e-4


@pytest.mark.gpu
def test_gpu_torch_backend_never_returns_zero_leaves():
    """The twin on CUDA uses a parallel cumsum; its zero-child guard must hold."""
    gen = torch.Generator().manual_seed(2)
    capacity = 1 << 16
    priority = torch.rand(capacity, generator=gen) * (torch.rand(capacity, generator=gen) > 0.5)
    priority[::5] = 1e-30
    tree = SumTree(capacity, device="cuda")
    sumtree_update(tree, torch.arange(capacity, device="cuda"), priority.cuda(), backend="torch")
    u = torch.rand(1 << 20, dtype=torch.float64, device="cuda")
    index, value = sumtree_sample(tree, u, backend="torch")
    assert bool((value > 0).all())


@pytest.mark.gpu
def test_gpu_prioritized_step_captured_in_a_cuda_graph_replays():
    """Sample and update of a fixed batch size, captured once and replayed: each replay draws anew
    from the current tree and writes its priorities; the running maximum stays the fixed tensor."""
    from tensordict import TensorDict

    from gpubuf import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

    torch.manual_seed(0)
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(4096, device="cuda"))
    rb.extend(TensorDict({"obs": torch.randn(4096, 8, device="cuda")}, batch_size=[4096]))
    priority = torch.rand(256, device="cuda") + 0.1
    slot = rb.sampler._max_value.data_ptr()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture
            batch = rb.sample(256)
            rb.update_priority(batch["index"], priority)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch = rb.sample(256)
        rb.update_priority(batch["index"], priority)
    seen = []
    for step in range(3):
        priority.copy_(torch.rand(256, device="cuda") + step + 1.0)
        graph.replay()
        torch.cuda.synchronize()
        index = batch["index"].clone()
        seen.append(index)
        leaves = rb.sampler.tree.values()[index].double()
        want = (priority.double() + rb.sampler._eps) ** 0.7
        last = torch.full((4096,), -1, dtype=torch.long, device="cuda")
        last.scatter_reduce_(0, index, torch.arange(256, device="cuda"), "amax")  # the last write of each index
        torch.testing.assert_close(leaves, want[last[index]].to(leaves.dtype), rtol=1e-6, atol=0)
        exact = rb.sampler.tree.values().double().sum()
        torch.testing.assert_close(rb.sampler.tree.total(), exact, rtol=1e-9, atol=0)
    assert not torch.equal(seen[0], seen[1])
    assert rb.sampler._max_value.data_ptr() == slot and rb.sampler._max_value.item() == pytest.approx(priority.max().item())
    rb.sampler.check_errors()


def test_libdevice_follows_how_the_kernels_were_decorated():
    """A launcher picks CUDA's pow (LIBDEVICE) by the kernel it launches, compiled or interpreted,
    not by the environment at launch time: the interpreter has no libdevice."""
    import os

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import gpubuf_kernels.sumtree as kernels
    from gpubuf_kernels._launch import compiled

    def body(x):
        pass

    assert compiled(JITFunction(body)) and not compiled(InterpretedFunction(body))
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert kernels._LIBDEVICE is (not interpreted) is compiled(kernels._sumtree_claim_kernel)
