"""Fills and wrap-around extends leave the same rows as TorchRL's, in memory and memory-mapped."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import gpubuf

torchrl_data = pytest.importorskip("torchrl.data")


def _chunk(n: int, seed: int, *, strided: bool = False) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    obs = torch.randn(n, 5, generator=gen)
    if strided:
        # A leaf whose rows are not contiguous in memory: written through the mapping.
        obs = torch.randn(5, n, generator=gen).t()
    return TensorDict(
        {"obs": obs, "action": torch.randint(0, 9, (n, 2), generator=gen), "done": torch.rand(n, 1, generator=gen) < 0.3,
         "nested": {"r": torch.randn(n, generator=gen).to(torch.bfloat16)}},
        batch_size=[n],
    )


def _storage(lib, kind: str, capacity: int, tmp_path, name: str):
    if kind == "memmap":
        return lib.LazyMemmapStorage(capacity, scratch_dir=str(tmp_path / name))
    return lib.LazyTensorStorage(capacity)


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
@pytest.mark.parametrize("capacity,sizes", [
    (7, [3, 3, 3, 1, 9, 2]),            # wraps, and one batch longer than the capacity
    (64, [64, 10, 60, 1, 130]),         # full at once, then wrap-arounds
    (100, [33, 33, 33, 33, 1]),
])
def test_fills_leave_torchrl_rows(tmp_path, kind, capacity, sizes):
    ours = gpubuf.TensorDictReplayBuffer(storage=_storage(gpubuf, kind, capacity, tmp_path, "ours"))
    theirs = torchrl_data.TensorDictReplayBuffer(storage=_storage(torchrl_data, kind, capacity, tmp_path, "theirs"))
    for step, n in enumerate(sizes):
        batch = _chunk(n, step, strided=step % 2 == 1)
        got = ours.extend(batch.clone())
        want = theirs.extend(batch.clone())
        assert torch.equal(got, want), f"indices of extend {step}"
        assert len(ours) == len(theirs)
        a, b = ours.storage[: len(ours)], theirs.storage[: len(theirs)]
        for key in b.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a[key], b[key]), f"{key} after extend {step}"
