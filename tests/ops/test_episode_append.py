"""The episode append: the twin against a brute force over the whole write history, and its checks."""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.episode_append import episode_append, episode_append_ref


class _Index:
    """The tables of an index of ``T`` rows and ``C`` columns with lists of the given lengths, fresh."""

    def __init__(self, capacity: int, columns: int, lengths: tuple[int, ...]) -> None:
        shape = (columns, capacity + 1)
        self.capacity, self.columns = capacity, columns
        self.start, self.stop, self.row_traj = (torch.zeros(shape, dtype=torch.int64) for _ in range(3))
        self.head = torch.full((columns,), -1, dtype=torch.int64)
        self.tail = torch.zeros(columns, dtype=torch.int64)
        self.deques = [(torch.zeros(shape, dtype=torch.int64), torch.zeros(columns, dtype=torch.int64),
                        torch.zeros(columns, dtype=torch.int64), length) for length in lengths]
        self.written = 0

    def append(self, breaks: torch.Tensor, append=episode_append_ref, **kwargs) -> None:
        append(breaks, self.start, self.stop, self.row_traj, self.head, self.tail, self.deques, self.written,
               self.capacity, self.written == 0, **kwargs)
        self.written += breaks.shape[0]

    def tables(self) -> list[torch.Tensor]:
        """Every table but the scratch slot ``T`` (whose contents are not specified)."""
        t = self.capacity
        out = [self.start[:, :t], self.stop[:, :t], self.row_traj[:, :t], self.head, self.tail]
        for slots, front, back, _ in self.deques:
            out += [slots[:, :t], front, back]
        return out


def _expected(history: torch.Tensor, capacity: int, lengths: tuple[int, ...]) -> dict:
    """From every row written (``history``: bool ``[W, C]`` breaks, row 0 breaking), per column:
    the live trajectories' numbers, starts and stops, the head, tail and each list's numbers."""
    w = history.shape[0]
    lower = max(w - capacity, 0)
    out = {}
    for c in range(history.shape[1]):
        g_of = history[:, c].to(torch.int64).cumsum(0) - 1
        live = range(int(g_of[lower]), int(g_of[-1]) + 1)
        start = {g: int((g_of == g).nonzero()[0]) for g in live}
        stop = {g: int((g_of == g).nonzero()[-1]) for g in live}
        lists = {length: [g for g in live if stop[g] - max(start[g], lower) + 1 >= length] for length in lengths}
        rows = {t % capacity: int(g_of[t]) for t in range(lower, w)}
        out[c] = (live, start, stop, lists, rows)
    return out


@pytest.mark.parametrize("capacity,columns,p", [(1, 1, 0.5), (7, 1, 0.3), (16, 2, 0.2), (17, 3, 0.6), (33, 1, 0.05)])
def test_twin_matches_a_brute_force_over_the_history(capacity, columns, p):
    g = torch.Generator().manual_seed(capacity * 10 + columns)
    lengths = (1, 2, 5)
    index = _Index(capacity, columns, lengths)
    history = []
    for step in range(30):
        n = int(torch.randint(1, capacity + 1 if step == 0 else max(capacity, 2), (1,), generator=g))
        n = min(n, capacity if step == 0 else capacity - 1) if capacity > 1 else 1
        if capacity == 1 and step:
            break  # a ring of one row takes one fresh write; every later one starts it over
        breaks = torch.rand(n, columns, generator=g) < p
        if step == 0:
            breaks[0] = True
        index.append(breaks)
        history.append(breaks)
        expected = _expected(torch.cat(history), capacity, lengths)
        for c, (live, start, stop, lists, rows) in expected.items():
            assert int(index.head[c]) == live[-1] and int(index.tail[c]) == live[0]
            for traj in live:
                assert int(index.start[c, traj % capacity]) == start[traj]
                assert int(index.stop[c, traj % capacity]) == stop[traj]
            for row, traj in rows.items():
                assert int(index.row_traj[c, row]) == traj
            for slots, front, back, length in index.deques:
                listed = [int(slots[c, i % capacity]) for i in range(int(front[c]), int(back[c]))]
                assert listed == lists[length], (step, c, length)


def test_a_fresh_write_of_the_whole_ring():
    index = _Index(5, 1, (2,))
    index.append(torch.tensor([[True], [False], [True], [False], [False]]))
    assert index.head.tolist() == [1] and index.tail.tolist() == [0]
    assert index.start[0, :2].tolist() == [0, 2] and index.stop[0, :2].tolist() == [1, 4]
    slots, front, back, _ = index.deques[0]
    assert slots[0, :2].tolist() == [0, 1] and front.tolist() == [0] and back.tolist() == [2]
    # One more row overwrites row 0: trajectory 0 is trimmed to one step and leaves the list,
    # trajectory 1 grows (it is listed already).
    index.append(torch.tensor([[False]]))
    assert index.tail.tolist() == [0] and front.tolist() == [1] and back.tolist() == [2]
    assert index.stop[0, 1].item() == 5


def _bad_calls(index: _Index):
    breaks = torch.zeros(3, 1, dtype=torch.bool)
    args = [index.start, index.stop, index.row_traj, index.head, index.tail, index.deques]
    yield TypeError, "breaks must be a bool", (breaks.long(), *args, 4, 8)
    yield ValueError, "a write of 8 rows", (torch.zeros(8, 1, dtype=torch.bool), *args, 4, 8)
    yield ValueError, "a write of 0 rows", (torch.zeros(0, 1, dtype=torch.bool), *args, 4, 8)
    yield TypeError, "start must be an int64", (breaks, index.start.int(), *args[1:], 4, 8)
    yield TypeError, "head must be an int64 tensor of shape \\[1\\]", (breaks, *args[:3], index.head[:0], *args[4:], 4, 8)
    yield TypeError, "deque #0 slots", (breaks, *args[:5], [(index.start[:, :3], *index.deques[0][1:])], 4, 8)
    yield ValueError, "deque #0 has length 0", (breaks, *args[:5], [(*index.deques[0][:3], 0)], 4, 8)
    yield ValueError, "written must be a non-negative int", (breaks, *args, -1, 8)
    yield ValueError, "must be contiguous", (breaks, *args[:2], torch.zeros(1, 18, dtype=torch.int64)[:, ::2], *args[3:], 4, 8)


def test_bad_arguments_are_refused_before_anything_changes():
    index = _Index(8, 1, (2,))
    index.append(torch.tensor([[True], [False], [True], [False]]))
    before = [t.clone() for t in index.tables()]
    for error, message, args in _bad_calls(index):
        with pytest.raises(error, match=message):
            episode_append(*args)
        assert all(torch.equal(a, b) for a, b in zip(before, index.tables()))


def test_the_checked_entry_runs_the_twin_on_cpu():
    history = torch.rand(40, 2, generator=torch.Generator().manual_seed(4)) < 0.3
    history[0] = True
    a, b = _Index(11, 2, (3,)), _Index(11, 2, (3,))
    for chunk in history.split([11, 4, 7, 1, 10, 7]):
        a.append(chunk)
        b.append(chunk, append=episode_append, backend="torch")
    assert all(torch.equal(x, y) for x, y in zip(a.tables(), b.tables()))


@pytest.mark.skipif(not numba_importable(), reason="needs Numba (the compiled CPU kernel)")
@pytest.mark.parametrize("capacity,columns,p", [(1, 1, 0.5), (2, 1, 0.5), (9, 1, 0.05), (16, 3, 0.3), (23, 2, 0.7)])
def test_the_compiled_cpu_kernel_matches_the_twin(capacity, columns, p):
    g = torch.Generator().manual_seed(capacity * 3 + columns)
    twin, compiled = _Index(capacity, columns, (1, 3, 6)), _Index(capacity, columns, (1, 3, 6))
    for step in range(40 if capacity > 1 else 1):
        n = capacity if step == 0 else int(torch.randint(1, capacity, (1,), generator=g))
        if step % 7 == 6:
            n = capacity - 1  # the longest write after the first
        breaks = torch.rand(n, columns, generator=g) < p
        if step == 0:
            breaks[0] = True
        twin.append(breaks)
        compiled.append(breaks, append=episode_append, backend="numba")
        assert all(torch.equal(a, b) for a, b in zip(twin.tables(), compiled.tables())), step
