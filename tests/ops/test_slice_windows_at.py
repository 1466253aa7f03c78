"""Windows at drawn starts: the twin against a per-slice brute force, and every backend against the twin."""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.slice_windows_at import slice_windows_at, slice_windows_at_ref


def _inputs(seed: int, slices: int, capacity: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, capacity, (slices,), generator=g)
    starts[0] = capacity - 1  # a window that wraps around the ring
    values = (torch.rand(slices, generator=g, dtype=torch.float64) * 3 + 0.25).to(dtype)
    flags = torch.rand(2, capacity, generator=g) < 0.4
    return starts, values, flags


@pytest.mark.parametrize("seq_length", [1, 3, 8])
def test_twin_matches_brute_force(seq_length):
    capacity, slices, beta = 41, 9, 0.6
    starts, values, flags = _inputs(1, slices, capacity)
    min_a, min_b = torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    rows, marks, weights = slice_windows_at_ref(starts, values, min_a, min_b, beta, capacity, seq_length, *flags)
    rows, marks, weights = rows.view(slices, seq_length), marks.view(3, slices, seq_length), weights.view(slices, -1)
    for s in range(slices):
        want_rows = [(int(starts[s]) + j) % capacity for j in range(seq_length)]
        assert rows[s].tolist() == want_rows
        last = [j == seq_length - 1 for j in range(seq_length)]
        assert marks[0, s].tolist() == last
        assert marks[1, s].tolist() == [bool(flags[0, r]) or e for r, e in zip(want_rows, last)]
        assert marks[2, s].tolist() == [bool(flags[1, r]) for r in want_rows]
        # p_min is the smaller minimum: (value / 0.2) ** -beta, rounded to the values' dtype.
        want = torch.tensor((float(values[s]) / 0.2) ** -beta, dtype=torch.float32)
        assert torch.equal(weights[s], want.expand(seq_length))


@pytest.mark.parametrize("backend", ["triton", "numba"])
@pytest.mark.parametrize(("slices", "present", "dtype"), [
    (1, (1, 1), torch.float32), (31, (0, 0), torch.float64), (32, (1, 0), torch.float32), (33, (0, 1), torch.float64),
])
def test_backends_match_the_twin(backend, slices, present, dtype):
    if backend == "numba" and not numba_importable():
        pytest.skip("numba is not installed")
    capacity, seq_length, beta = 97, 5, 0.4
    starts, values, flags = _inputs(3, slices, capacity, dtype)
    flags = [f if p else None for f, p in zip(flags, present)]
    min_a, min_b = torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.25, dtype=torch.float64)
    want = slice_windows_at_ref(starts, values, min_a, min_b, beta, capacity, seq_length, *flags)
    got = slice_windows_at(starts, values, min_a, min_b, beta, capacity, seq_length, *flags, backend=backend)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[2].dtype == dtype
    torch.testing.assert_close(got[2], want[2], rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=0)


def test_bad_inputs_raise():
    starts, values, flags = _inputs(5, 4, 20)
    one = torch.tensor(1.0, dtype=torch.float64)
    with pytest.raises(TypeError):
        slice_windows_at(starts.to(torch.int32), values, one, one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        slice_windows_at(starts, values.half(), one, one, 0.5, 20, 2)
    with pytest.raises(ValueError):
        slice_windows_at(starts, values[:3], one, one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        slice_windows_at(starts, values, one.float(), one, 0.5, 20, 2)
    with pytest.raises(TypeError):
        slice_windows_at(starts, values, one, one, 0.5, 20, 2, done=torch.zeros(20, dtype=torch.uint8))
    with pytest.raises(ValueError):
        slice_windows_at(starts, values, one, one, 0.5, 20, 2, terminated=torch.zeros(19, dtype=torch.bool))
