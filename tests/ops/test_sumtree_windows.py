"""Prioritized slice windows: the twin against the tree draw and a per-slice brute force, and every
backend against the twin."""

from __future__ import annotations

import pytest
import torch

from gpubuf.errors import DeviceMismatchError
from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.sumtree import SumTree, sumtree_sample_ref, sumtree_update
from gpubuf.ops.sumtree_windows import sumtree_windows, sumtree_windows_ref


def _inputs(seed: int, capacity: int, dtype: torch.dtype = torch.float32):
    """A tree over ``capacity`` rows with some zero leaves (steps that cannot start a slice), its
    last row among the likely starts (a window that wraps around the ring), and two flag columns."""
    g = torch.Generator().manual_seed(seed)
    tree = SumTree(capacity, dtype=dtype)
    priority = torch.rand(capacity, generator=g, dtype=torch.float64) * 3 + 0.25
    priority[torch.rand(capacity, generator=g) < 0.3] = 0.0
    priority[-1] = 50.0
    sumtree_update(tree, torch.arange(capacity), priority, alpha=1.0, eps=0.0, backend="torch")
    flags = torch.rand(2, capacity, generator=g) < 0.4
    return tree, flags, g


@pytest.mark.parametrize("stratified", [False, True])
@pytest.mark.parametrize("seq_length", [1, 3, 8])
def test_twin_is_the_tree_draw_then_the_windows(seq_length, stratified):
    capacity, slices, beta = 41, 9, 0.6
    tree, flags, g = _inputs(1, capacity)
    uniforms = torch.rand(slices, generator=g, dtype=torch.float64)
    held_min = torch.tensor(0.2, dtype=torch.float64)
    rows, marks, weights = sumtree_windows_ref(tree, uniforms, held_min, beta, capacity, seq_length, *flags,
                                               stratified=stratified)
    starts, values = sumtree_sample_ref(tree, uniforms, stratified=stratified)
    assert (values > 0).all()  # a zero leaf (a step that cannot start a slice) is never drawn
    rows, marks, weights = rows.view(slices, seq_length), marks.view(3, slices, seq_length), weights.view(slices, -1)
    for s in range(slices):
        want_rows = [(int(starts[s]) + j) % capacity for j in range(seq_length)]
        assert rows[s].tolist() == want_rows
        last = [j == seq_length - 1 for j in range(seq_length)]
        assert marks[0, s].tolist() == last
        assert marks[1, s].tolist() == [bool(flags[0, r]) or e for r, e in zip(want_rows, last)]
        assert marks[2, s].tolist() == [bool(flags[1, r]) for r in want_rows]
        # p_min is the smaller minimum (held aside: 0.2 < the tree's 0.25 at least).
        want = torch.tensor((float(values[s]) / 0.2) ** -beta, dtype=torch.float32)
        assert torch.equal(weights[s], want.expand(seq_length))


def test_the_tree_minimum_counts_when_it_is_the_smaller():
    tree, flags, g = _inputs(2, 30)
    uniforms = torch.rand(4, generator=g, dtype=torch.float64)
    held_min = torch.tensor(float("inf"), dtype=torch.float64)  # nothing held aside
    _, _, weights = sumtree_windows_ref(tree, uniforms, held_min, 1.0, 30, 2)
    _, values = sumtree_sample_ref(tree, uniforms)
    p_min = float(tree.values()[tree.values() > 0].min())
    torch.testing.assert_close(weights.view(4, 2)[:, 0], (values.double() / p_min).reciprocal().float())


@pytest.mark.parametrize("backend", ["triton", "numba"])
@pytest.mark.parametrize(("slices", "present", "dtype", "stratified"), [
    (1, (1, 1), torch.float32, False), (31, (0, 0), torch.float64, True), (32, (1, 0), torch.float32, False),
    (33, (0, 1), torch.float64, False),
])
def test_backends_match_the_twin(backend, slices, present, dtype, stratified, kernel_device):
    if backend == "numba" and not numba_importable():
        pytest.skip("numba is not installed")
    device = kernel_device if backend == "triton" else torch.device("cpu")
    capacity, seq_length, beta = 97, 5, 0.4
    tree, flags, g = _inputs(3, capacity, dtype)
    flags = [f if p else None for f, p in zip(flags, present)]
    uniforms = torch.rand(slices, generator=g, dtype=torch.float64)
    held_min = torch.tensor(0.3, dtype=torch.float64)
    want = sumtree_windows_ref(tree, uniforms, held_min, beta, capacity, seq_length, *flags, stratified=stratified)
    got = sumtree_windows(tree.to(device), uniforms.to(device), held_min.to(device), beta, capacity, seq_length,
                          *(None if f is None else f.to(device) for f in flags), stratified=stratified, backend=backend)
    got = [t.cpu() for t in got]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].dtype == dtype
    torch.testing.assert_close(got[2], want[2], rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)


def test_an_empty_tree_sets_the_error_bit_on_the_device_path(kernel_device):
    tree = SumTree(40, device=kernel_device)
    uniforms = torch.rand(3, dtype=torch.float64, device=kernel_device)
    held_min = torch.tensor(float("inf"), dtype=torch.float64, device=kernel_device)
    rows, _, _ = sumtree_windows(tree, uniforms, held_min, 0.5, 40, 4, backend="triton")
    assert int(tree.flags[0]) & 8
    assert rows.view(3, 4)[:, 0].tolist() == [0, 0, 0]


def test_bad_inputs_raise():
    tree, flags, _ = _inputs(5, 20)
    uniforms = torch.rand(4, dtype=torch.float64)
    one = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(TypeError):
        sumtree_windows(tree.leaves, uniforms, one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        sumtree_windows(tree, uniforms.float(), one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        sumtree_windows(tree, uniforms.view(2, 2), one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        sumtree_windows(tree, uniforms, one.float(), 0.5, 20, 2)
    with pytest.raises(DeviceMismatchError):
        sumtree_windows(tree, uniforms.to("meta"), one, 0.5, 20, 2)
    with pytest.raises(ValueError):
        sumtree_windows(tree, uniforms, one, 0.5, 20, 0)
    with pytest.raises(TypeError):
        sumtree_windows(tree, uniforms, one, 0.5, 20, 2, done=torch.zeros(20, dtype=torch.uint8))
    with pytest.raises(ValueError):
        sumtree_windows(tree, uniforms, one, 0.5, 20, 2, terminated=torch.zeros(19, dtype=torch.bool))
