"""Triton start exclusions vs their torch twin: the moves listed and the exclusions recorded.

Runs on CUDA when present, else on CPU tensors through Triton's interpreter (set up by
tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.device_work import count_device_work
from gpubuf.ops.start_exclusions import start_exclusions_ref, start_exclusions_trusted
from gpubuf_kernels.episodes import start_exclusions_triton
from helpers import episode_index


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("capacity,columns,written", [(1, 1, 3), (9, 1, 7), (9, 1, 30), (16, 3, 40)])
def test_kernel_matches_the_twin(dtype, strict, capacity, columns, written):
    device = _device()
    index = episode_index(capacity, columns, written, seed=capacity + written)
    g = torch.Generator().manual_seed(columns)
    size = capacity * columns
    lower = max(written - capacity, 0)
    for kept in (0, 1, 3):
        for first in sorted({lower, max(written - 4, lower), written}):
            excluded = torch.rand(size, generator=g) < 0.5
            tree = torch.rand(size, generator=g).to(dtype) * ~excluded
            held = torch.rand(size, generator=g).to(dtype) * excluded
            twin_excluded, kernel_excluded = excluded.clone(), excluded.clone().to(device)
            expected = start_exclusions_ref(index.row_traj, index.start, index.stop, twin_excluded, tree, held, first,
                                            written, capacity, kept, strict)
            got = start_exclusions_triton(index.row_traj.to(device), index.start.to(device), index.stop.to(device),
                                          kernel_excluded, tree.to(device), held.to(device), first, written, capacity,
                                          kept, strict, block=4)
            for a, b in zip(expected, got):
                assert torch.equal(a, b.cpu())
            assert torch.equal(twin_excluded, kernel_excluded.cpu())
            # The steps decided hold their decision; a step moves exactly when it changed.
            changed = expected[0][expected[0] >= 0]
            assert torch.equal(twin_excluded[changed], ~excluded[changed])


def test_the_oldest_row_is_decided_once_and_only_when_outside_the_range():
    index = episode_index(8, 1, 20, seed=3)  # lower = 12
    excluded = torch.zeros(8, dtype=torch.bool)
    leaves = torch.ones(8)
    flat, _, _ = start_exclusions_ref(index.row_traj, index.start, index.stop, excluded, leaves, leaves * 0, 17, 20, 8,
                                      2, True)
    assert flat.shape[0] == 4  # times 17, 18, 19 and the oldest, 12
    flat, _, _ = start_exclusions_ref(index.row_traj, index.start, index.stop, excluded, leaves, leaves * 0, 12, 20, 8,
                                      2, True)
    assert flat.shape[0] == 8  # times 12 .. 19, the oldest among them


def test_a_refresh_is_one_launch_with_no_host_sync():
    device = _device()
    index = episode_index(32, 2, 50, seed=5)
    moved = {name: getattr(index, name).to(device) for name in ("row_traj", "start", "stop")}
    excluded = torch.zeros(64, dtype=torch.bool, device=device)
    leaves, empty = torch.ones(64, device=device), torch.zeros(64, device=device)
    with count_device_work(device.type) as work:
        start_exclusions_trusted(moved["row_traj"], moved["start"], moved["stop"], excluded, leaves, empty, 40, 50, 32,
                                 3, True, "triton")
    assert work.host_syncs == 0, work.summary()
    assert dict(work.kernels) == {"triton:_start_exclusions_kernel": 1}, work.summary()
