"""The start exclusions: the compiled CPU loop against the twin, and the twin against the step rule."""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.start_exclusions import start_exclusions_ref, start_exclusions_trusted
from helpers import episode_index


def _cases():
    for capacity, columns, written in ((1, 1, 3), (9, 1, 7), (9, 1, 30), (16, 3, 40)):
        lower = max(written - capacity, 0)
        for first in sorted({lower, max(written - 4, lower), written}):
            yield capacity, columns, written, first


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kept", [0, 1, 3])
def test_the_twin_decides_by_the_step_rule(strict, kept):
    for capacity, columns, written, first in _cases():
        index = episode_index(capacity, columns, written, seed=capacity + written)
        excluded = torch.zeros(capacity * columns, dtype=torch.bool)
        tree = torch.rand(capacity * columns, generator=torch.Generator().manual_seed(1)) + 1
        flat, to_held, _ = start_exclusions_ref(index.row_traj, index.start, index.stop, excluded, tree, tree * 0, first,
                                                written, capacity, kept, strict)
        lower = max(written - capacity, 0)
        times = list(range(first, written)) + ([lower] if lower < first else [])
        for c in range(columns):
            for tau in times:
                g = int(index.row_traj[c, tau % capacity])
                a, b = max(int(index.start[c, g % capacity]), lower), int(index.stop[c, g % capacity])
                want = b - tau < kept and (strict or tau != a)
                f = (tau % capacity) * columns + c
                assert bool(excluded[f]) == want
                # Nothing was excluded before: a step moves to the held tree exactly when excluded now.
                assert (f in flat.tolist()) == want
        moved = flat >= 0
        assert torch.equal(to_held[moved], tree[flat[moved]].double())


@pytest.mark.skipif(not numba_importable(), reason="needs Numba (the compiled CPU kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strict", [True, False])
def test_the_compiled_cpu_loop_matches_the_twin(dtype, strict):
    g = torch.Generator().manual_seed(7)
    for capacity, columns, written, first in _cases():
        index = episode_index(capacity, columns, written, seed=capacity + written)
        size = capacity * columns
        for kept in (0, 1, 3):
            excluded = torch.rand(size, generator=g) < 0.5
            tree = torch.rand(size, generator=g).to(dtype) * ~excluded
            held = torch.rand(size, generator=g).to(dtype) * excluded
            twin_excluded, compiled_excluded = excluded.clone(), excluded.clone()
            expected = start_exclusions_ref(index.row_traj, index.start, index.stop, twin_excluded, tree, held, first,
                                            written, capacity, kept, strict)
            got = start_exclusions_trusted(index.row_traj, index.start, index.stop, compiled_excluded, tree, held,
                                           first, written, capacity, kept, strict, "numba")
            assert all(torch.equal(a, b) for a, b in zip(expected, got))
            assert torch.equal(twin_excluded, compiled_excluded)
