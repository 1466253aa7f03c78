"""The slice-window draw: the twin against a per-slice brute force, and every backend against the twin."""

from __future__ import annotations

import math

import pytest
import torch

from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.slice_windows import slice_windows, slice_windows_ref


def _tables(seed: int, capacity: int, seq_length: int, wrap: bool):
    """A ring of trajectories over a storage of ``capacity`` rows, the eligible ones listed."""
    g = torch.Generator().manual_seed(seed)
    written = capacity + 13 if wrap else capacity - 3
    lower = max(written - capacity, 0)
    starts, t = [], 0
    while t < written:
        starts.append(t)
        t += int(torch.randint(1, 3 * seq_length, (1,), generator=g))
    stops = [s - 1 for s in starts[1:]] + [written - 1]
    live = [(i, a, b) for i, (a, b) in enumerate(zip(starts, stops)) if b >= lower]
    start = torch.zeros(capacity + 1, dtype=torch.int64)
    stop = torch.zeros(capacity + 1, dtype=torch.int64)
    for i, a, b in live:
        start[i % capacity], stop[i % capacity] = a, b
    eligible = [i for i, a, b in live if b - max(a, lower) + 1 >= seq_length]
    front = 5  # anywhere in the ring
    slots = torch.zeros(capacity + 1, dtype=torch.int64)
    for position, i in enumerate(eligible):
        slots[(front + position) % capacity] = i
    return slots, start, stop, torch.tensor([front]), torch.tensor([front + len(eligible)]), lower, eligible


@pytest.mark.parametrize("wrap", [False, True])
@pytest.mark.parametrize("seq_length", [1, 3, 8])
def test_twin_matches_brute_force(wrap, seq_length):
    capacity = 61
    slots, start, stop, front, back, lower, eligible = _tables(1, capacity, seq_length, wrap)
    u = torch.rand(2 * 33, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    flags = torch.rand(3, capacity + 1, generator=torch.Generator().manual_seed(3)) < 0.3
    got, marks = slice_windows_ref(slots, start, stop, front, back, u, lower, capacity, seq_length, *flags)
    got, marks = got.view(33, seq_length), marks.view(4, 33, seq_length)
    for s in range(33):
        g = eligible[math.floor(float(u[s]) * len(eligible))]
        a = max(int(start[g % capacity]), lower)
        n = int(stop[g % capacity]) - a + 1
        first = a + math.floor(float(u[33 + s]) * (n - seq_length + 1))
        rows = [(first + j) % capacity for j in range(seq_length)]
        assert got[s].tolist() == rows
        last = [j == seq_length - 1 for j in range(seq_length)]
        assert marks[0, s].tolist() == last
        assert marks[1, s].tolist() == [bool(flags[0, r]) or e for r, e in zip(rows, last)]
        assert marks[2, s].tolist() == [bool(flags[1, r]) for r in rows]
        assert marks[3, s].tolist() == [bool(flags[2, r]) or j == 0 for j, r in enumerate(rows)]


@pytest.mark.parametrize("backend", ["triton", "numba"])
@pytest.mark.parametrize(("slices", "present"), [(1, (1, 1, 1)), (31, (0, 0, 0)), (32, (1, 0, 1)), (33, (1, 1, 0))])
def test_backends_match_the_twin(backend, slices, present, kernel_device):
    if backend == "numba" and not numba_importable():
        pytest.skip("numba is not installed")
    device = kernel_device if backend == "triton" else torch.device("cpu")
    capacity, seq_length = 97, 5
    slots, start, stop, front, back, lower, _ = _tables(3, capacity, seq_length, True)
    u = torch.rand(2 * slices, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    u[0] = 1.0 - 2.0**-53  # the largest uniform still lands in range
    flags = torch.rand(3, capacity, generator=torch.Generator().manual_seed(5)) < 0.5
    flags = [f if p else None for f, p in zip(flags, present)]
    want = slice_windows_ref(slots, start, stop, front, back, u, lower, capacity, seq_length, *flags)
    on = [t.to(device) for t in (slots, start, stop, front, back, u)]
    got = slice_windows(*on, lower, capacity, seq_length, *(None if f is None else f.to(device) for f in flags),
                        backend=backend)
    got = [t.cpu() for t in got]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(got[0].min()) >= 0 and int(got[0].max()) < capacity


def test_bad_inputs_raise():
    slots, start, stop, front, back, lower, _ = _tables(5, 20, 2, False)
    u = torch.rand(6, dtype=torch.float64)
    with pytest.raises(TypeError):
        slice_windows(slots.to(torch.int32), start, stop, front, back, u, lower, 20, 2)
    with pytest.raises(TypeError):
        slice_windows(slots, start, stop, front, back, u.float(), lower, 20, 2)
    with pytest.raises(ValueError):
        slice_windows(slots, start, stop, front, back, u[:5], lower, 20, 2)
    with pytest.raises(TypeError):
        slice_windows(slots, start, stop, front, back, u, lower, 20, 2, done=torch.zeros(20, dtype=torch.uint8))
    with pytest.raises(ValueError):
        slice_windows(slots, start, stop, front, back, u, lower, 20, 2, init=torch.zeros(19, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["torch", "numba", "triton"])
def test_an_empty_ring_draws_no_window_and_the_device_draw_reports_it(backend, kernel_device):
    """No eligible trajectory: every backend returns rows of -1 and no mark (a gather reads
    nothing for them); the Triton draw sets the error word it is given, and only then."""
    from gpubuf.ops.slice_windows import slice_windows_trusted

    if backend == "numba" and not numba_importable():
        pytest.skip("numba is not installed")
    device = kernel_device if backend == "triton" else torch.device("cpu")
    capacity, seq_length = 31, 4
    slots, start, stop, front, back, lower, _ = _tables(6, capacity, seq_length, True)
    u = torch.rand(2 * 9, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    flags = torch.ones(3, capacity, dtype=torch.bool)  # every stored flag set: a False mark is no window
    on = [t.to(device) for t in (slots, start, stop, front, front, u)]  # back == front: empty
    error = torch.zeros(1, dtype=torch.int32, device=device)
    rows, marks = slice_windows_trusted(*on, lower, capacity, seq_length, tuple(f.to(device) for f in flags),
                                        backend, error)
    assert rows.tolist() == [-1] * (9 * seq_length)
    assert not bool(marks.any())
    assert int(error) == (1 if backend == "triton" else 0)
    if backend == "triton":
        error.zero_()
        full = [t.to(device) for t in (slots, start, stop, front, back, u)]
        rows, _ = slice_windows_trusted(*full, lower, capacity, seq_length, (None, None, None), backend, error)
        assert int(error) == 0 and int(rows.min()) >= 0
