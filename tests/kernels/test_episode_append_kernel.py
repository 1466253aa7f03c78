"""Triton episode append vs its torch twin, table for table.

Runs on CUDA when present, else on CPU tensors through Triton's interpreter (set up by
tests/conftest.py); rings stay small for the interpreter, and the launcher's blocks are shrunk so
that every loop of the lists kernel takes several turns.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.device_work import count_device_work
from gpubuf.ops.episode_append import episode_append, episode_append_ref
from gpubuf_kernels.episodes import episode_append_triton

def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class _Index:
    """Tables of a fresh index (as ``EpisodeIndex`` keeps them) on ``device``."""

    def __init__(self, capacity: int, columns: int, lengths: tuple[int, ...], device: torch.device) -> None:
        shape = (columns, capacity + 1)
        self.capacity = capacity
        self.start, self.stop, self.row_traj = (torch.zeros(shape, dtype=torch.int64, device=device) for _ in range(3))
        self.head = torch.full((columns,), -1, dtype=torch.int64, device=device)
        self.tail = torch.zeros(columns, dtype=torch.int64, device=device)
        self.deques = [(torch.zeros(shape, dtype=torch.int64, device=device),
                        torch.zeros(columns, dtype=torch.int64, device=device),
                        torch.zeros(columns, dtype=torch.int64, device=device), length) for length in lengths]
        self.written = 0

    def args(self, breaks: torch.Tensor) -> tuple:
        return (breaks, self.start, self.stop, self.row_traj, self.head, self.tail, self.deques, self.written,
                self.capacity, self.written == 0)

    def tables(self) -> list[torch.Tensor]:
        t = self.capacity
        out = [self.start[:, :t], self.stop[:, :t], self.row_traj[:, :t], self.head, self.tail]
        for slots, front, back, _ in self.deques:
            out += [slots[:, :t], front, back]
        return [x.cpu() for x in out]


def _writes(seed: int, capacity: int, columns: int, p: float, steps: int) -> list[torch.Tensor]:
    """Breaks of ``steps`` writes: a fresh one (up to the whole ring), then 1 to ``T - 1`` rows each."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        n = int(torch.randint(1, capacity + 1 if step == 0 else capacity, (1,), generator=g))
        if step % 5 == 4:
            n = capacity if step == 0 else capacity - 1  # the longest writes
        breaks = torch.rand(n, columns, generator=g) < p
        if step == 0:
            breaks[0] = True
        out.append(breaks)
    return out


@pytest.mark.parametrize("block,list_block", [(1, 1), (2, 4), (4, 2), (1024, 128)])
@pytest.mark.parametrize("capacity,columns,p", [(2, 1, 0.5), (9, 1, 0.05), (16, 3, 0.3), (23, 2, 0.7)])
def test_kernels_match_the_twin_after_every_write(block, list_block, capacity, columns, p):
    device = _device()
    lengths = (1, 3, 6)
    twin, kernel = _Index(capacity, columns, lengths, torch.device("cpu")), _Index(capacity, columns, lengths, device)
    for breaks in _writes(capacity * 7 + columns, capacity, columns, p, 24 if block < 1024 else 12):
        episode_append_ref(*twin.args(breaks))
        episode_append_triton(*kernel.args(breaks.to(device)), block=block, list_block=list_block)
        twin.written += breaks.shape[0]
        kernel.written += breaks.shape[0]
        for a, b in zip(twin.tables(), kernel.tables()):
            assert torch.equal(a, b)


def test_without_a_list_the_head_and_tail_still_move():
    device = _device()
    twin, kernel = _Index(10, 2, (), torch.device("cpu")), _Index(10, 2, (), device)
    for breaks in _writes(5, 10, 2, 0.4, 10):
        episode_append_ref(*twin.args(breaks))
        episode_append_triton(*kernel.args(breaks.to(device)), block=2)
        twin.written += breaks.shape[0]
        kernel.written += breaks.shape[0]
        assert all(torch.equal(a, b) for a, b in zip(twin.tables(), kernel.tables()))
    assert int(kernel.tail.max()) > 0  # trajectories retired on the way


def test_an_append_is_a_cumsum_and_a_kernel_per_list_with_no_host_sync():
    device = _device()
    index = _Index(50, 1, (2, 4), device)
    writes = _writes(9, 50, 1, 0.2, 3)
    episode_append(*index.args(writes[0].to(device)), backend="triton")
    index.written += writes[0].shape[0]
    breaks = writes[1].to(device)
    with count_device_work(device.type) as work:
        episode_append(*index.args(breaks), backend="triton")
    assert work.host_syncs == 0, work.summary()
    assert dict(work.kernels) == {"aten:cumsum.default": 1, "triton:_episode_rows_kernel": 1,
                            "triton:_episode_lists_kernel": 2}, work.summary()


@pytest.mark.gpu
def test_a_large_write_on_the_gpu_matches_the_twin():
    """Many programs writing at once, and lists scanned over thousands of new trajectories."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    capacity, columns = 1 << 20, 4
    twin, kernel = _Index(capacity, columns, (1, 16, 64), torch.device("cpu")), _Index(capacity, columns, (1, 16, 64),
                                                                                       torch.device("cuda"))
    g = torch.Generator().manual_seed(0)
    for n in (capacity, 300_000, 1, 700_000, capacity - 1):
        breaks = torch.rand(n, columns, generator=g) < 0.02
        if twin.written == 0:
            breaks[0] = True
        episode_append_ref(*twin.args(breaks))
        episode_append_triton(*kernel.args(breaks.cuda()))
        twin.written += n
        kernel.written += n
        assert all(torch.equal(a, b) for a, b in zip(twin.tables(), kernel.tables()))
