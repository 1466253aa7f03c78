"""Sum-tree twins vs brute force: updates, duplicates, sampling, the minimum, drift, bad input.

Oracles are independent of the tree: a Python list of leaves written one by one, float64 sums
over leaf ranges, ``searchsorted`` over a flat float64 prefix sum. Integer-valued priorities
(with ``alpha=1, eps=0``) keep every sum exact, so those comparisons are ``torch.equal``.
"""

from __future__ import annotations

import math
import subprocess
import sys

import warnings

import pytest
import torch

from gpubuf.errors import DeviceMismatchError, IndexOutOfRangeError, PriorityError
from gpubuf.ops import sumtree as sumtree_module
from gpubuf.ops._dispatch import kernel_module
from gpubuf.ops.sumtree import (
    SumTree,
    importance_weights,
    sumtree_rebuild,
    sumtree_sample,
    sumtree_sample_ref,
    sumtree_sample_weighted,
    sumtree_update,
    sumtree_update_ref,
    transform_priority,
)

SHAPES = [(1, 32), (7, 4), (16, 4), (17, 4), (64, 8), (65, 8), (1000, 4), (1025, 32), (4096, 16)]


def _brute_internal(tree: SumTree) -> tuple[torch.Tensor, torch.Tensor]:
    """Every internal node's sum and positive-min computed straight from the leaf range it covers."""
    leaves = tree.leaves.to(torch.float64)
    sums = torch.zeros_like(tree.sums)
    mins = torch.full_like(tree.mins, math.inf)
    for k in range(tree.depth):
        span = tree.fanout ** (tree.depth - k)
        for j in range(tree.level_sizes[k]):
            block = leaves[j * span : (j + 1) * span]
            sums[tree.level_offsets[k] + j] = block.sum()
            pos = block[block > 0]
            if pos.numel():
                mins[tree.level_offsets[k] + j] = pos.min()
    return sums, mins


def _apply_sequential(leaves: list[float], index, priority, alpha=1.0, eps=0.0) -> None:
    for i, p in zip(index.tolist(), priority.tolist()):
        if i >= 0:
            leaves[i] = (p + eps) ** alpha


def _brute_sample(leaves: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    csum = leaves.to(torch.float64).cumsum(0)
    return torch.searchsorted(csum, mass, right=True)


# ------------------------------------------------------------------------------ geometry
@pytest.mark.parametrize("capacity,fanout", SHAPES + [(2**20, 32), (2**20, 64), (2**20, 16)])
def test_geometry(capacity, fanout):
    tree = SumTree(capacity, fanout=fanout)
    assert tree.level_sizes[0] == 1 and tree.level_sizes[-1] == capacity
    assert fanout**tree.depth >= capacity and (tree.depth == 1 or fanout ** (tree.depth - 1) < capacity)
    for k in range(1, tree.depth + 1):
        assert tree.level_sizes[k - 1] == -(-tree.level_sizes[k] // fanout)
    assert tree.leaves.numel() == (tree.level_sizes[-2] + 1) * fanout > capacity
    assert tree.sums.dtype == tree.mins.dtype == torch.float64
    assert tree.total().item() == 0 and tree.min().item() == math.inf
    if capacity == 2**20 and fanout == 32:
        assert tree.depth == 4


def test_constructor_rejects_bad_shapes():
    with pytest.raises(ValueError):
        SumTree(0)
    with pytest.raises(ValueError):
        SumTree(10, fanout=6)
    with pytest.raises(TypeError):
        SumTree(10, dtype=torch.float16)


# ------------------------------------------------------------------------------ update
@pytest.mark.parametrize("capacity,fanout", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_update_matches_brute_force(capacity, fanout, dtype):
    gen = torch.Generator().manual_seed(capacity * 31 + fanout)
    tree = SumTree(capacity, fanout=fanout, dtype=dtype)
    leaves = [0.0] * capacity
    for _ in range(5):
        b = int(torch.randint(1, 3 * capacity + 2, (1,), generator=gen))
        # Negative and duplicate indices on purpose.
        index = torch.randint(-3, capacity, (b,), generator=gen)
        priority = torch.randint(0, 50, (b,), generator=gen).to(torch.float64)
        sumtree_update(tree, index, priority)
        _apply_sequential(leaves, index, priority)
        assert torch.equal(tree.values(), torch.tensor(leaves, dtype=dtype))
        assert torch.all(tree.leaves[capacity:] == 0)
        sums, mins = _brute_internal(tree)
        assert torch.equal(tree.sums, sums)
        assert torch.equal(tree.mins, mins)


@pytest.mark.parametrize("capacity,fanout", [(7, 4), (1000, 4), (1025, 32)])
def test_update_float_priorities_close_to_brute_force(capacity, fanout):
    gen = torch.Generator().manual_seed(1)
    tree = SumTree(capacity, fanout=fanout)
    leaves = [0.0] * capacity
    for _ in range(4):
        index = torch.randint(0, capacity, (300,), generator=gen)
        priority = torch.rand(300, generator=gen, dtype=torch.float64) * 10
        sumtree_update(tree, index, priority, alpha=0.6, eps=1e-6)
        _apply_sequential(leaves, index, priority, alpha=0.6, eps=1e-6)
    expected = torch.tensor(leaves, dtype=torch.float64).to(torch.float32)
    assert torch.equal(tree.values(), expected)
    sums, mins = _brute_internal(tree)
    torch.testing.assert_close(tree.sums, sums, rtol=1e-13, atol=0)
    assert torch.equal(tree.mins, mins)


@pytest.mark.parametrize("capacity,fanout", [(7, 4), (65, 8), (300, 4)])
def test_batched_equals_sequential_with_duplicates(capacity, fanout):
    gen = torch.Generator().manual_seed(7)
    batched = SumTree(capacity, fanout=fanout)
    sequential = SumTree(capacity, fanout=fanout)
    for _ in range(3):
        index = torch.randint(-2, capacity, (2 * capacity,), generator=gen)
        index[-5:] = index[:5]  # guaranteed duplicates whose last write differs
        priority = torch.rand(index.numel(), generator=gen)
        sumtree_update(batched, index, priority, alpha=0.7, eps=1e-3)
        for i, p in zip(index, priority):
            sumtree_update(sequential, i, p, alpha=0.7, eps=1e-3)
        # Parents are recomputed from their final children in both cases: bit for bit.
        assert torch.equal(batched.leaves, sequential.leaves)
        assert torch.equal(batched.sums, sequential.sums)
        assert torch.equal(batched.mins, sequential.mins)


def test_last_duplicate_wins():
    tree = SumTree(10, fanout=4)
    sumtree_update(tree, torch.tensor([3, 5, 3, 3, 5]), torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0]))
    assert tree.values()[3].item() == 4.0 and tree.values()[5].item() == 6.0
    assert tree.total().item() == 10.0


def test_negative_indices_ignored():
    tree = SumTree(10, fanout=4)
    sumtree_update(tree, torch.tensor([-1, 2, -7]), torch.tensor([5.0, 1.0, 9.0]))
    assert tree.total().item() == 1.0 and tree.values()[2].item() == 1.0
    before = tree.clone()
    sumtree_update(tree, torch.tensor([-1, -1]), torch.tensor([3.0, 4.0]))
    sumtree_update(tree, torch.tensor([], dtype=torch.int64), torch.tensor([]))
    assert torch.equal(tree.sums, before.sums) and torch.equal(tree.leaves, before.leaves)


def test_scalar_priority_and_0d_index():
    tree = SumTree(20, fanout=4)
    sumtree_update(tree, torch.arange(20), torch.tensor(2.0))
    assert torch.all(tree.values() == 2.0)
    sumtree_update(tree, torch.tensor(3), torch.tensor([5.0]))
    assert tree.values()[3].item() == 5.0
    # Integer priorities (TorchRL's own examples use them) and index dtypes other than int64.
    sumtree_update(tree, torch.tensor([4, 5], dtype=torch.int32), torch.tensor([0, 1000]))
    assert tree.values()[4].item() == 0.0 and tree.values()[5].item() == 1000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_transform(dtype):
    p = torch.tensor([0.0, 0.5, 1.0, 7.25, 1e6], dtype=torch.float64)
    tree = SumTree(5, fanout=4, dtype=dtype)
    sumtree_update(tree, torch.arange(5), p, alpha=0.6, eps=1e-8)
    assert torch.equal(tree.values(), ((p + 1e-8) ** 0.6).to(dtype))
    assert torch.equal(transform_priority(p, 0.6, 1e-8, dtype), ((p + 1e-8) ** 0.6).to(dtype))
    sumtree_update(tree, torch.arange(5), p, alpha=0.0, eps=0.0)
    assert torch.all(tree.values() == 1.0)  # 0 ** 0 == 1, as torch.pow and TorchRL have it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("n", [1, 7, 256, 40_000])
def test_compiled_transform_is_the_twins_to_an_ulp(dtype, n):
    """The compiled update computes ``(p + eps) ** alpha`` with the C library's pow: float32
    leaves get the twin's values (rounding absorbs the last bit of float64), float64 leaves the
    twin's to an ulp; the caller's priorities are untouched."""
    pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(n)
    if dtype.is_floating_point:
        p = (torch.rand(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (n,), generator=gen)).to(dtype)
    else:
        p = torch.randint(0, 1000, (n,), generator=gen, dtype=dtype)
    kept = p.clone()
    for leaf in (torch.float32, torch.float64):
        tree = SumTree(n, dtype=leaf)
        sumtree_update(tree, torch.arange(n), p, alpha=0.7, eps=1e-8, backend="numba")
        want = transform_priority(p, 0.7, 1e-8, leaf)
        if leaf == torch.float32:
            assert torch.equal(tree.values(), want)
        else:
            ulps = (tree.values().view(torch.int64) - want.view(torch.int64)).abs()
            assert int(ulps.max()) <= 1
    assert torch.equal(p, kept)


@pytest.mark.parametrize("which", ["twin", "torch", "numba"])
def test_update_work_is_local(which):
    """A batched update rewrites the paths of the leaves written, and nothing else, on every path."""
    tree = SumTree(4096, fanout=8)
    sumtree_update(tree, torch.arange(4096), torch.ones(4096))
    # Corrupt every internal node, then update two leaves: only the nodes rewritten lose the mark.
    tree.sums.fill_(-1.0)
    if which == "twin":
        sumtree_update_ref(tree, torch.tensor([0, 4095]), torch.tensor([2.0, 3.0]))
    else:
        sumtree_update(tree, torch.tensor([0, 4095]), torch.tensor([2.0, 3.0]), backend=which)
    written = [int((tree.level(k) != -1.0).sum()) for k in range(tree.depth)]
    assert written == [1, 2, 2, 2]  # two paths sharing the root


@pytest.mark.parametrize("capacity,b", [(5000, 3000), (2**16, 600), (2**16, 40), (2**20 + 3, 70)])
def test_update_refreshes_each_ancestor_of_a_large_batch(capacity, b):
    """The compiled update sorts the leaves it wrote (a radix sort from 64 entries, an insertion
    pass below; input in order is kept as it is) and refreshes their ancestors in one pass in that
    order: contiguous runs, repeats far apart, negative and random indices all leave exactly the
    twin's tree."""
    gen = torch.Generator().manual_seed(capacity + b)
    fast, twin = SumTree(capacity, fanout=4), SumTree(capacity, fanout=4)
    for step in range(4):
        index = torch.randint(-1, capacity, (b,), generator=gen)
        index[: b // 3] = torch.arange(b // 3) + step * 7  # a contiguous run
        index[b // 3 :: 5] = index[b // 3]  # one index again and again, far apart
        if step == 3:
            index = index.sort().values  # in order already: no sort
        priority = torch.rand(b, generator=gen, dtype=torch.float64)
        sumtree_update(fast, index, priority, alpha=0.5, backend="numba")
        sumtree_update_ref(twin, index, priority, alpha=0.5)
        assert _same(fast, twin), f"step {step}"


@pytest.mark.parametrize("n", [0, 1, 5, 63, 64, 1000, 70_000])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_update_sorts_the_leaves_it_refreshes(n, dtype):
    """The compiled update's sort of the leaves it wrote: increasing order, repeats kept, for
    spans from one value to a whole dtype's range, at the low and high ends."""
    sort = kernel_module("cpu.sumtree")._sort_leaves
    gen = torch.Generator().manual_seed(n)
    top = torch.iinfo(dtype).max
    for low, high in [(0, 4), (0, 1000), (0, top), (top - 4, top)]:
        keys = torch.randint(low, high, (n,), generator=gen, dtype=torch.int64).to(dtype).to(torch.int64)
        want = keys.sort().values
        assert torch.equal(torch.from_numpy(sort(keys.numpy().copy())), want), (low, high)
        assert torch.equal(torch.from_numpy(sort(want.numpy().copy())), want)  # in order: as it is


# ------------------------------------------------------------------------------ min
def test_min_tracks_positive_leaves():
    tree = SumTree(100, fanout=4)
    assert tree.min().item() == math.inf
    sumtree_update(tree, torch.tensor([10, 20, 30]), torch.tensor([3.0, 0.5, 2.0]))
    assert tree.min().item() == 0.5  # unwritten (zero) leaves do not count
    sumtree_update(tree, torch.tensor([20]), torch.tensor([4.0]))
    assert tree.min().item() == 2.0  # raising the minimum is seen at once
    sumtree_update(tree, torch.tensor([30]), torch.tensor([0.0]))
    assert tree.min().item() == 3.0  # a zero-priority leaf cannot be sampled, so it is not p_min
    sumtree_update(tree, torch.tensor([99]), torch.tensor([0.25]))
    assert tree.min().item() == 0.25


@pytest.mark.parametrize("capacity,fanout", [(1000, 4), (1025, 32)])
def test_min_matches_brute_force(capacity, fanout):
    gen = torch.Generator().manual_seed(3)
    tree = SumTree(capacity, fanout=fanout)
    for _ in range(20):
        index = torch.randint(0, capacity, (50,), generator=gen)
        priority = torch.rand(50, generator=gen) * (torch.rand(50, generator=gen) > 0.2)
        sumtree_update(tree, index, priority)
        vals = tree.values()
        expected = vals[vals > 0].min().item() if bool((vals > 0).any()) else math.inf
        assert tree.min().item() == expected


# ------------------------------------------------------------------------------ sampling
@pytest.mark.parametrize("capacity,fanout", SHAPES)
@pytest.mark.parametrize("stratified", [False, True])
def test_sample_matches_brute_force(capacity, fanout, stratified):
    gen = torch.Generator().manual_seed(capacity + fanout)
    tree = SumTree(capacity, fanout=fanout)
    # Integer leaves with many zeros: every prefix sum is exact.
    priority = torch.randint(0, 9, (capacity,), generator=gen) * (torch.rand(capacity, generator=gen) > 0.3)
    priority[capacity // 2] = 1  # at least one positive leaf
    sumtree_update(tree, torch.arange(capacity), priority)
    b = 513
    u = torch.rand(b, dtype=torch.float64, generator=gen)
    index, value = sumtree_sample(tree, u, stratified=stratified)
    total = tree.total()
    mass = (u + torch.arange(b, dtype=torch.float64)) * (total / b) if stratified else u * total
    assert index.dtype == torch.int64 and value.dtype == tree.dtype
    assert torch.equal(index, _brute_sample(tree.values(), mass))
    assert torch.equal(value, tree.values()[index])
    assert bool((value > 0).all())


def test_sample_boundaries_never_return_zero_leaves():
    """Masses exactly on prefix boundaries, at 0 and just under the total."""
    leaves = torch.tensor([0, 1, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.float64)
    tree = SumTree(leaves.numel(), fanout=2)
    sumtree_update(tree, torch.arange(leaves.numel()), leaves)
    total = 6.0
    top = 1.0 - 2.0**-53
    u = torch.tensor([0.0, 1 / 6, 3 / 6, 0.5, top, 2.0**-60, 1 / 6 - 2.0**-55], dtype=torch.float64)
    index, value = sumtree_sample(tree, u)
    assert bool((value > 0).all())
    assert torch.equal(index, _brute_sample(leaves, u * total))
    # Stratified: the last stratum's mass rounds up to the total; it must still land on leaf 8.
    index, value = sumtree_sample(tree, torch.full((3,), top, dtype=torch.float64), stratified=True)
    assert bool((value > 0).all()) and index[-1].item() == 8


def test_sample_mass_past_row_total_takes_last_positive_child():
    """Rounding can leave a mass at a row's total; the rule then takes the last positive child."""
    tree = SumTree(16, fanout=4)
    sumtree_update(tree, torch.tensor([1, 6]), torch.tensor([1.0, 1.0]))
    # Corrupt the root so the mass overshoots: the descent must not step into zero leaves.
    tree.sums[0] = 4.0
    u = torch.tensor([0.99, 0.6], dtype=torch.float64)
    index, value = sumtree_sample_ref(tree, u)
    assert index.tolist() == [6, 6] and bool((value > 0).all())
    assert all(torch.equal(x, y) for x, y in zip(sumtree_sample(tree, u), (index, value)))  # the CPU path


def test_zero_priority_never_sampled_many_draws():
    gen = torch.Generator().manual_seed(11)
    capacity = 5000
    tree = SumTree(capacity, fanout=8)
    priority = torch.rand(capacity, generator=gen) * (torch.rand(capacity, generator=gen) > 0.5)
    # Very small priorities next to zeros: the rounding-sensitive case.
    priority[::7] = 1e-30
    sumtree_update(tree, torch.arange(capacity), priority)
    for stratified in (False, True):
        u = torch.rand(200_000, dtype=torch.float64, generator=gen)
        index, value = sumtree_sample(tree, u, stratified=stratified)
        assert bool((value > 0).all())
        assert bool((tree.values()[index] > 0).all())


def test_sample_empty_tree_returns_zeros():
    tree = SumTree(10, fanout=4)
    index, value = sumtree_sample(tree, torch.rand(5, dtype=torch.float64))
    assert index.tolist() == [0] * 5 and value.tolist() == [0.0] * 5


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    n = counts.sum().to(torch.float64)
    expected = probs.to(torch.float64) * n
    stat = ((counts.to(torch.float64) - expected) ** 2 / expected).sum()
    df = torch.tensor(float(counts.numel() - 1), dtype=torch.float64)
    # Survival function of chi-square(df) at stat: the regularized upper incomplete gamma.
    p = torch.special.gammaincc(df / 2, stat / 2)
    return float(stat), float(p)


@pytest.mark.parametrize("stratified", [False, True])
def test_chi_square_sampled_distribution(stratified):
    gen = torch.Generator().manual_seed(2024)
    capacity = 500
    tree = SumTree(capacity, fanout=8)
    priority = torch.rand(capacity, generator=gen) * 5 + 0.1
    sumtree_update(tree, torch.arange(capacity), priority, alpha=0.7, eps=1e-8)
    n = 400_000
    counts = torch.zeros(capacity, dtype=torch.int64)
    for _ in range(4):
        u = torch.rand(n // 4, dtype=torch.float64, generator=gen)
        index, _ = sumtree_sample(tree, u, stratified=stratified)
        counts += torch.bincount(index, minlength=capacity)
    probs = (priority.double() + 1e-8) ** 0.7
    probs = probs / probs.sum()
    stat, p = _chi_square_p(counts, probs)
    # Seeded, so deterministic; a wrong distribution gives p ~ 0 with this many draws.
    assert p > 1e-3, (stat, p)
    if stratified:
        # Stratified draws are far less variable than i.i.d. ones.
        assert stat < capacity


def test_importance_weights_formula():
    value = torch.tensor([0.5, 1.0, 2.0, 4.0])
    w = importance_weights(value, torch.tensor(0.5, dtype=torch.float64), beta=0.4)
    expected = torch.tensor([(v / 0.5) ** -0.4 for v in [0.5, 1.0, 2.0, 4.0]])
    torch.testing.assert_close(w, expected, rtol=1e-6, atol=0)
    assert w.dtype == torch.float32 and w.max().item() == 1.0


# ------------------------------------------------------------------------------ drift
def _drift_run(capacity: int, n_updates: int, batch: int, seed: int) -> tuple[float, SumTree]:
    gen = torch.Generator().manual_seed(seed)
    tree = SumTree(capacity)
    sumtree_update(tree, torch.arange(capacity), torch.rand(capacity, generator=gen), alpha=0.6, eps=1e-8)
    for _ in range(n_updates // batch):
        index = torch.randint(0, capacity, (batch,), generator=gen)
        # Priorities over many orders of magnitude: the case where delta updates drift.
        priority = torch.rand(batch, generator=gen) * 10.0 ** torch.randint(-6, 6, (batch,), generator=gen)
        sumtree_update(tree, index, priority, alpha=0.6, eps=1e-8)
    exact = tree.values().to(torch.float64).sum()
    rel = abs(tree.total().item() - exact.item()) / exact.item()
    return rel, tree


def test_drift_reduced():
    rel, tree = _drift_run(capacity=2**16, n_updates=200_000, batch=1000, seed=5)
    assert rel < 1e-12
    # Every internal node is exactly what a rebuild from the leaves computes.
    rebuilt = sumtree_rebuild(tree.clone())
    assert torch.equal(rebuilt.sums, tree.sums) and torch.equal(rebuilt.mins, tree.mins)


@pytest.mark.slow
def test_drift_full(request):
    """10**7 leaf updates, in random batches of 1024, on 2**20 leaves (minutes: ``-m slow`` only)."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("long-running; run with -m slow")
    rel, tree = _drift_run(capacity=2**20, n_updates=10**7, batch=1024, seed=6)
    print(f"relative root error after 1e7 updates: {rel:.3e}")
    assert rel < 1e-6
    rebuilt = sumtree_rebuild(tree.clone())
    assert torch.equal(rebuilt.sums, tree.sums) and torch.equal(rebuilt.mins, tree.mins)


# ------------------------------------------------------------------------------ whole-tree helpers
def test_rebuild_fill_state_dict_roundtrip():
    gen = torch.Generator().manual_seed(9)
    tree = SumTree(777, fanout=8, dtype=torch.float64)
    sumtree_update(tree, torch.randint(0, 777, (500,), generator=gen), torch.rand(500, generator=gen))
    state = tree.state_dict()
    loaded = SumTree.from_state_dict(state)
    assert loaded.capacity == 777 and loaded.fanout == 8 and loaded.dtype == torch.float64
    assert torch.equal(loaded.leaves, tree.leaves)
    torch.testing.assert_close(loaded.sums, tree.sums, rtol=1e-14, atol=0)
    assert torch.equal(loaded.mins, tree.mins)
    moved = tree.to("cpu", copy=True)
    assert moved.leaves.data_ptr() != tree.leaves.data_ptr() and torch.equal(moved.sums, tree.sums)
    tree.clear_()
    assert tree.total().item() == 0 and tree.min().item() == math.inf


def test_ref_twin_is_the_cpu_path():
    gen = torch.Generator().manual_seed(4)
    a, b = SumTree(300, fanout=4), SumTree(300, fanout=4)
    index = torch.randint(-1, 300, (400,), generator=gen)
    priority = torch.rand(400, generator=gen)
    sumtree_update(a, index, priority, alpha=0.5, eps=0.1)
    sumtree_update_ref(b, index, priority, alpha=0.5, eps=0.1)
    assert torch.equal(a.leaves, b.leaves) and torch.equal(a.sums, b.sums) and torch.equal(a.mins, b.mins)
    u = torch.rand(100, dtype=torch.float64, generator=gen)
    assert all(torch.equal(x, y) for x, y in zip(sumtree_sample(a, u), sumtree_sample_ref(b, u)))


# ------------------------------------------------------------------------------ CPU paths
# CPU trees run the compiled kernels (gpubuf_kernels.cpu.sumtree, Numba) or the twins; the twins
# are the kernels' specification, so every tensor the kernels produce must equal the twin's bit for
# bit ("torch" runs the twins themselves through the op's checks).


@pytest.fixture(params=["torch", "numba"])
def cpu_backend(request):
    return request.param


@pytest.fixture(params=["default", "tiny"])
def cpu_thresholds(request, monkeypatch):
    """The draw's size threshold as shipped, or shrunk so that small batches also descend in
    increasing order of mass."""
    if request.param == "tiny":
        monkeypatch.setattr(sumtree_module, "_SORTED_DRAWS", 5)
    return request.param


def _priorities(step: int, b: int, gen: torch.Generator) -> torch.Tensor:
    if step % 4 == 1:
        return torch.randint(0, 3, (b,), generator=gen).double()  # zeros, and equal values
    if step % 4 == 3:
        return torch.rand(1, generator=gen)  # one priority for all
    # Many orders of magnitude: rounding differs between summation orders.
    return torch.rand(b, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-6, 6, (b,), generator=gen)


@pytest.mark.parametrize("capacity,fanout", [(1, 32), (5, 2), (33, 32), (100, 4), (1025, 32), (4096, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_path_equals_twin(capacity, fanout, dtype, cpu_thresholds, cpu_backend):
    gen = torch.Generator().manual_seed(capacity * 31 + fanout)
    fast, twin = SumTree(capacity, fanout=fanout, dtype=dtype), SumTree(capacity, fanout=fanout, dtype=dtype)
    for step, b in enumerate([1, 3, capacity // 2 + 1, 3 * capacity] * 2):
        # Negative indices, duplicates (b up to 3x the capacity), partly written trees.
        index = torch.randint(-1 if step % 3 == 0 else 0, capacity, (b,), generator=gen)
        priority = _priorities(step, b, gen)
        eps = 1e-8 if step % 2 else 0.0
        sumtree_update(fast, index, priority, alpha=0.6, eps=eps, backend=cpu_backend)
        sumtree_update_ref(twin, index, priority, alpha=0.6, eps=eps)
        _follow_compiled_leaves(fast, twin, cpu_backend)
        assert _same(fast, twin), f"update {step} (B={b})"
        for n in (1, 6, 40):
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            u[0] = 1.0 - 2.0**-53 if step % 2 else 0.0  # the ends of the mass range
            for stratified in (False, True):
                got = sumtree_sample(fast, u, stratified=stratified, backend=cpu_backend)
                want = sumtree_sample_ref(twin, u, stratified=stratified)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"sample {step}, n={n}"


def test_cpu_path_large_batches_equal_twin(cpu_backend):
    """The shipped thresholds at scale: chunks, draws sorted by mass, whole-level rebuilds."""
    gen = torch.Generator().manual_seed(17)
    capacity = 2**15
    fast, twin = SumTree(capacity), SumTree(capacity)
    for step in range(3):
        b = 40_000
        index = torch.randint(-1, capacity, (b,), generator=gen)
        priority = _priorities(step, b, gen)
        sumtree_update(fast, index, priority, alpha=0.7, eps=1e-8, backend=cpu_backend)
        sumtree_update_ref(twin, index, priority, alpha=0.7, eps=1e-8)
        assert _same(fast, twin)
        u = torch.rand(b, generator=gen, dtype=torch.float64)
        got, want = sumtree_sample(fast, u, backend=cpu_backend), sumtree_sample_ref(twin, u)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("capacity,fanout", [(5, 4), (70, 4), (1000, 8)])
def test_cpu_path_overshoot_into_padding(capacity, fanout, cpu_thresholds, cpu_backend):
    """A mass past a row's total takes the row's last child, a padding node when the level's
    last row is not full: the descent must read the zero sentinel row there, as the twin does."""
    tree = SumTree(capacity, fanout=fanout)
    sumtree_update(tree, torch.arange(capacity), torch.ones(capacity), backend=cpu_backend)
    tree.sums[0] = 3.0 * capacity  # a root larger than its children: high masses overshoot
    u = torch.linspace(0.0, 1.0 - 2.0**-53, 50, dtype=torch.float64)
    got, want = sumtree_sample(tree, u, backend=cpu_backend), sumtree_sample_ref(tree, u)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert bool((got[1] > 0).all())


def test_cpu_path_without_validation_still_skips_negative_indices(cpu_backend):
    tree = SumTree(10, fanout=4)
    sumtree_update(tree, torch.tensor([-1, 2, 2, -3]), torch.tensor([5.0, 1.0, 2.0, 9.0]), validate=False, backend=cpu_backend)
    assert tree.total().item() == 2.0 and tree.values()[2].item() == 2.0


def test_cpu_path_overflow_check_near_the_bound(cpu_backend):
    """The host-side overflow bound is conservative: near it, the exact check decides."""
    tree = SumTree(4, fanout=2)
    sumtree_update(tree, torch.tensor([0]), torch.tensor([1e19]), alpha=2.0, backend=cpu_backend)  # 1e38: finite in float32
    assert tree.values()[0].item() == pytest.approx(1e38, rel=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the typed error alone, no NumPy overflow warning before it
        with pytest.raises(PriorityError, match="overflows"):
            sumtree_update(tree, torch.tensor([1]), torch.tensor([2e19]), alpha=2.0, backend=cpu_backend)  # 4e38: past float32
    assert tree.values()[1].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b", [1, 3, 255, 1000])
@pytest.mark.parametrize("stratified", [False, True])
def test_level_by_level_descent_equals_twin(dtype, b, stratified):
    """Batches below the sorting threshold descend level by level (a prefix table for a level
    from 4 draws per row, 132 here for the third, prefetches ahead of the scans, scans without
    branches): the twin's draws exactly, on a tree with zero leaves and a padded last row."""
    assert b < sumtree_module._SORTED_DRAWS
    gen = torch.Generator().manual_seed(b)
    capacity = 2**15 + 77
    tree = SumTree(capacity, dtype=dtype)
    priority = torch.rand(capacity, generator=gen, dtype=torch.float64) * (torch.rand(capacity, generator=gen) > 0.3)
    sumtree_update(tree, torch.arange(capacity), priority, alpha=0.7, eps=0.0)
    u = torch.rand(b, generator=gen, dtype=torch.float64)
    u[0] = 1.0 - 2.0**-53  # a mass at the very top of the range
    got = sumtree_sample(tree, u, stratified=stratified, backend="numba")
    want = sumtree_sample_ref(tree, u, stratified=stratified)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert bool((got[1] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b", [300, 4096])
def test_weighted_draw_equals_sample_and_weights(dtype, b):
    """The weighted draw is one compiled call on a CPU tree: the twin's indices, and the weights
    by the formula (the C library's pow against torch.pow: the same to an ulp of float64)."""
    gen = torch.Generator().manual_seed(5)
    tree = SumTree(5000, dtype=dtype)
    sumtree_update(tree, torch.arange(5000), torch.rand(5000, generator=gen) + 0.01, alpha=0.6, eps=1e-8)
    u = torch.rand(b, generator=gen, dtype=torch.float64)
    index, weight = sumtree_sample_weighted(tree, u, 0.8, backend="numba")
    want_index, want_value = sumtree_sample_ref(tree, u)
    assert torch.equal(index, want_index) and weight.dtype == dtype
    rtol = 1e-6 if dtype == torch.float32 else 1e-15
    torch.testing.assert_close(weight, importance_weights(want_value, tree.min(), 0.8), rtol=rtol, atol=0)
    twin_index, twin_weight = sumtree_sample_weighted(tree, u, 0.8, backend="torch")
    assert torch.equal(twin_index, want_index) and torch.equal(twin_weight, importance_weights(want_value, tree.min(), 0.8))
    # Nothing to draw from: the twin's answer (index 0, the sampler raises before drawing).
    empty = sumtree_sample_weighted(SumTree(10, dtype=dtype), u[:4], 0.8, backend="numba")
    assert torch.equal(empty[0], torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_update_tracks_the_running_maximum(dtype, backend):
    """The update raises a running maximum of the raw priorities given to non-negative indices, in
    place, on every path; None as the priority gives the items that maximum (1.0 before any)."""
    gen = torch.Generator().manual_seed(11)
    capacity = 3000
    fast, twin = SumTree(capacity, dtype=dtype, fanout=8), SumTree(capacity, dtype=dtype, fanout=8)
    running = torch.full((1,), -math.inf, dtype=torch.float64)
    slot = running.data_ptr()
    sumtree_update(fast, torch.tensor([5]), None, max_priority=running, backend=backend)
    assert fast.values()[5].item() == 1.0 and running.item() == 1.0
    sumtree_update_ref(twin, torch.tensor([5]), torch.tensor([1.0]))
    expected = 1.0
    for step in range(6):
        b = [1, 7, 256, 900, 256, 3000][step]
        index = torch.randint(-1 if step % 2 else 0, capacity, (b,), generator=gen)
        priority = _priorities(0, b, gen).to(torch.float32 if step % 3 == 0 else torch.float64)
        sumtree_update(fast, index, priority, alpha=0.7, eps=1e-8, max_priority=running, backend=backend)
        sumtree_update_ref(twin, index, priority, alpha=0.7, eps=1e-8)
        _follow_compiled_leaves(fast, twin, backend)
        valid = index >= 0
        if bool(valid.any()):
            expected = max(expected, priority.double()[valid].max().item())
        assert running.item() == expected and running.data_ptr() == slot
        assert _same(fast, twin), f"step {step}"
    sumtree_update(fast, torch.tensor([9]), None, alpha=0.7, eps=1e-8, max_priority=running, backend=backend)
    want = transform_priority(torch.tensor([expected], dtype=torch.float64), 0.7, 1e-8, dtype).item()
    assert fast.values()[9].item() == pytest.approx(want, rel=1e-15 if backend == "numba" else 0.0, abs=0.0)


@pytest.mark.parametrize(
    "index,priority,error,match",
    [
        (torch.tensor([1, 2]), torch.tensor([1.0, float("nan")]), PriorityError, "NaN"),
        (torch.tensor([1, 2]), torch.tensor([float("inf"), 1.0]), PriorityError, "NaN or infinite"),
        (torch.tensor([1, 2]), torch.tensor([1.0, -0.5]), PriorityError, "negative"),
        (torch.tensor([1, 40]), torch.tensor([1.0, 2.0]), IndexOutOfRangeError, "out of range"),
        (torch.tensor([1, 2]), torch.tensor([1.0, 2e19]), PriorityError, "overflows"),
    ],
)
def test_compiled_update_rejects_bad_input_and_changes_nothing(index, priority, error, match):
    tree = _filled()
    before = tree.clone()
    running = torch.tensor([3.0], dtype=torch.float64)
    with pytest.raises(error, match=match):
        sumtree_update(tree, index, priority, alpha=2.0, eps=0.0, limit=40, max_priority=running, backend="numba")
    assert _same(tree, before) and running.item() == 3.0


# ------------------------------------------------------------------------------ bad input
def _filled(capacity=50):
    tree = SumTree(capacity, fanout=4)
    sumtree_update(tree, torch.arange(capacity), torch.rand(capacity, generator=torch.Generator().manual_seed(0)))
    return tree


def _same(a: SumTree, b: SumTree) -> bool:
    return torch.equal(a.leaves, b.leaves) and torch.equal(a.sums, b.sums) and torch.equal(a.mins, b.mins)


def _follow_compiled_leaves(fast: SumTree, twin: SumTree, backend: str) -> None:
    """After the same update of both: float64 leaves the compiled update wrote are the twin's to
    an ulp (the C library's pow against torch's); the twin then takes them, rebuilt by its own
    rules, so that the nodes and later draws are still compared bit for bit."""
    if backend != "numba" or fast.dtype != torch.float64:
        return
    ulps = (fast.leaves.view(torch.int64) - twin.leaves.view(torch.int64)).abs()
    assert int(ulps.max()) <= 1
    twin.fill_(fast.values(), validate=False)


@pytest.mark.parametrize(
    "index,priority,error",
    [
        (torch.tensor([1, 2]), torch.tensor([1.0, float("nan")]), PriorityError),
        (torch.tensor([1, 2]), torch.tensor([float("inf"), 1.0]), PriorityError),
        (torch.tensor([1, 2]), torch.tensor([-float("inf"), 1.0]), PriorityError),
        (torch.tensor([1, 2]), torch.tensor([1.0, -0.5]), PriorityError),
        (torch.tensor([1, 50]), torch.tensor([1.0, 2.0]), IndexOutOfRangeError),
        (torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0]), PriorityError),
        (torch.tensor([1, 2]), torch.ones(2, 2), PriorityError),
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([[1, 2]]), torch.tensor([1.0, 2.0]), TypeError),
        ([1, 2], torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([1, 2]), [1.0, 2.0], TypeError),
        (torch.tensor([1, 2]), torch.tensor([1e30, 1.0]), PriorityError),  # (1e30)**2 overflows float32
    ],
)
def test_bad_update_raises_and_leaves_tree_unchanged(index, priority, error):
    tree = _filled()
    before = tree.clone()
    with pytest.raises(error):
        sumtree_update(tree, index, priority, alpha=2.0)
    assert _same(tree, before)


def test_limit_bounds_indices_to_the_written_range():
    tree = _filled()
    before = tree.clone()
    with pytest.raises(IndexOutOfRangeError, match="30 written items"):
        sumtree_update(tree, torch.tensor([5, 30]), torch.tensor([1.0, 1.0]), limit=30)
    assert _same(tree, before)
    sumtree_update(tree, torch.tensor([5, 29]), torch.tensor([1.0, 1.0]), limit=30)
    with pytest.raises(ValueError):
        sumtree_update(tree, torch.tensor([5]), torch.tensor([1.0]), limit=51)


@pytest.mark.parametrize("alpha,eps", [(-1.0, 0.0), (float("nan"), 0.0), (1.0, -1e-3), (1.0, float("inf"))])
def test_bad_alpha_eps(alpha, eps):
    tree = _filled()
    before = tree.clone()
    with pytest.raises(ValueError):
        sumtree_update(tree, torch.tensor([1]), torch.tensor([1.0]), alpha=alpha, eps=eps)
    assert _same(tree, before)


def test_bad_sample_input():
    tree = _filled()
    with pytest.raises(TypeError):
        sumtree_sample(tree, torch.tensor([1, 2]))
    with pytest.raises(TypeError):
        sumtree_sample(tree, torch.rand(2, 2, dtype=torch.float64))
    with pytest.raises(ValueError):
        sumtree_sample(tree, torch.rand(2, dtype=torch.float64), backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_device_mismatch():
    tree = _filled()
    with pytest.raises(DeviceMismatchError):
        sumtree_update(tree, torch.tensor([1], device="cuda"), torch.tensor([1.0], device="cuda"))
    with pytest.raises(DeviceMismatchError):
        sumtree_sample(tree, torch.rand(3, dtype=torch.float64, device="cuda"))


_WITHOUT_TRITON = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("triton is blocked in this test")
sys.meta_path.insert(0, Block())
import torch
from gpubuf.ops.sumtree import SumTree, sumtree_sample, sumtree_update
tree = SumTree(100)
sumtree_update(tree, torch.arange(100), torch.rand(100))
index, value = sumtree_sample(tree, torch.rand(8, dtype=torch.float64))
assert "gpubuf_kernels.sumtree" not in sys.modules and bool((value > 0).all())
print("ok")
"""


def test_cpu_path_needs_no_triton():
    result = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.parametrize("stratified", [False, True])
def test_cpu_path_draws_in_mass_order_equal_twin(cpu_thresholds, cpu_backend, stratified):
    """Draws descended in increasing order of mass, over rows with zero children after their
    positive ones, with equal masses and masses past a row's total (a root larger than its
    children), give the twin's index and value at every draw, each at its own position."""
    gen = torch.Generator().manual_seed(23)
    tree = SumTree(256, fanout=4)
    index = torch.tensor([i for i in range(256) if i % 4 in (0, 1) or i % 16 == 6])
    priority = torch.rand(len(index), generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-3, 3, (len(index),), generator=gen)
    sumtree_update(tree, index, priority, alpha=0.7, eps=1e-8, backend=cpu_backend)
    for scale in (1.0, 1.5):
        tree.sums[0] = float(tree.sums[1:5].sum()) * scale  # 1.5: the top half of the masses overshoot
        u = torch.sort(torch.rand(300, generator=gen, dtype=torch.float64)).values
        u[100:110] = u[100]  # equal masses, neighbours in the descent order
        got = sumtree_sample(tree, u, stratified=stratified, backend=cpu_backend)
        want = sumtree_sample_ref(tree, u, stratified=stratified)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert bool((got[1] > 0).all())


def test_an_overflow_only_the_compiled_update_sees_is_a_priority_error_and_writes_nothing(monkeypatch):
    """At the leaf dtype's bound the C library's pow may overflow where torch's does not: the
    kernel refuses the update (nothing written) and the host raises the overflow's error."""
    pytest.importorskip("numba")
    from gpubuf.ops._dispatch import kernel_module

    kernels = kernel_module("cpu.sumtree")
    tree = SumTree(64, fanout=4)
    sumtree_update(tree, torch.arange(64), torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.1, backend="numba")
    before = (tree.leaves.clone(), tree.sums.clone(), tree.mins.clone())
    monkeypatch.setattr(kernels, "update", lambda *args: kernels.OVERFLOW)
    with pytest.raises(PriorityError, match="overflows torch.float32"):
        sumtree_update(tree, torch.tensor([3, 9]), torch.tensor([1.0, 2.0]), alpha=0.7, backend="numba")
    assert all(torch.equal(a, b) for a, b in zip(before, (tree.leaves, tree.sums, tree.mins)))
