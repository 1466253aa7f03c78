"""SpillStorage: a device tier up to a byte budget, then a lazily created memmap tier; one buffer.

On this CPU-only machine the device tier is on the CPU (a budget in bytes); the same code runs
with a CUDA device tier (see the ``gpu`` test).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
from tensordict import TensorDict, tensorclass

import gpubuf
from gpubuf.errors import (
    DTypeMismatchError,
    EmptyBufferError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    SchemaMismatchError,
)
from gpubuf.buffers.prioritized import PrioritizedReplayBuffer
from gpubuf.samplers.prioritized import PrioritizedSampler
from gpubuf.storages import _memmap_files
from gpubuf.storages.memmap import DiskFullError
from gpubuf.storages.spill import SpillStorage
from helpers import TED_ROW_BYTES, ted_rows

ROW = TED_ROW_BYTES  # bytes of one ted_rows row


def ids_of(td: TensorDict) -> torch.Tensor:
    ids = td["next", "reward"].squeeze(-1).long()
    assert torch.equal(td["observation"].long(), ids[:, None].expand(-1, 32))
    assert torch.equal(td["next", "observation"].long(), (ids + 1)[:, None].expand(-1, 32))
    assert torch.equal(td["action"].long(), ids[:, None].expand(-1, 7))
    assert torch.equal(td["next", "truncated"].squeeze(-1), ids % 7 == 0)
    return ids


def spill(capacity: int, device_rows: int, tmp_path=None, **kwargs) -> SpillStorage:
    scratch = None if tmp_path is None else tmp_path / "spill"
    return SpillStorage(capacity, device="cpu", device_budget=device_rows * ROW, scratch_dir=scratch, **kwargs)


def test_larger_than_budget_round_trips_every_row(tmp_path):
    storage = spill(1000, 100, tmp_path)
    rb = gpubuf.ReplayBuffer(storage=storage, batch_size=512)
    rb.extend(ted_rows(1000))
    tiers = storage.tiers
    assert tiers["device_rows"] == 100 and tiers["spill_rows"] == 900
    assert tiers["device_bytes"] == 100 * ROW <= tiers["device_budget"]
    assert tiers["rows_on_device"] == 100 and tiers["rows_spilled"] == 900
    assert tiers["spill_created"] and tiers["spill_dir"] == str(tmp_path / "spill")
    assert torch.equal(ids_of(rb[:]), torch.arange(1000))
    assert torch.equal(ids_of(storage.get(torch.tensor([0, 99, 100, 999, -1]))), torch.tensor([0, 99, 100, 999, 999]))
    assert int(ids_of(storage.get(slice(95, 105)))[-1]) == 104
    assert int(storage.get(150)["next", "reward"]) == 150
    # Both tiers hold real rows: the device tier in memory, the rest in the memmap files.
    assert storage._hot[0].shape[0] == 100
    assert os.path.getsize(storage._cold.files[("observation",)]) == 900 * 32 * 4
    assert "rows_spilled=900" in repr(storage)


def test_samples_come_from_both_tiers(tmp_path):
    rb = gpubuf.TensorDictReplayBuffer(storage=spill(1000, 300, tmp_path), batch_size=2048)
    rb.extend(ted_rows(1000))
    batch = rb.sample()
    ids = ids_of(batch)
    assert torch.equal(ids, batch["index"])
    assert bool((ids < 300).any()) and bool((ids >= 300).any())


def test_spill_tier_is_created_lazily(tmp_path):
    storage = spill(1000, 100, tmp_path)
    rb = gpubuf.ReplayBuffer(storage=storage)
    rb.extend(ted_rows(60))
    assert not storage.tiers["spill_created"] and storage.tiers["spill_dir"] is None
    assert not (tmp_path / "spill").exists()
    rb.extend(ted_rows(60, 60))
    assert storage.tiers["spill_created"] and storage.tiers["rows_spilled"] == 20
    assert torch.equal(ids_of(rb[:]), torch.arange(120))


def test_wrap_around_matches_a_single_tier_buffer(tmp_path):
    ours = gpubuf.TensorDictReplayBuffer(storage=spill(250, 70, tmp_path))
    ref = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(250))
    start = 0
    for n in [100, 100, 120, 31, 400, 7]:
        a = ours.extend(ted_rows(n, start))
        b = ref.extend(ted_rows(n, start))
        assert torch.equal(a, b)
        start += n
    ours.add(ted_rows(1, start)[0])
    ref.add(ted_rows(1, start)[0])
    assert len(ours) == len(ref) == 250 and ours.write_count == ref.write_count
    mine, theirs = ours[:], ref[:]
    assert torch.equal(ids_of(mine), ids_of(theirs))
    assert torch.equal(mine["index"], theirs["index"])


def test_prioritized_sampling_across_tiers(tmp_path):
    storage = spill(600, 200, tmp_path)
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=0.5, storage=storage, batch_size=1024)
    rb.extend(ted_rows(600))
    device_rows = torch.arange(200)
    spilled_rows = torch.arange(200, 600)
    rb.update_priority(device_rows, torch.zeros(200))
    batch, info = rb.sample(return_info=True)
    assert bool((info["index"] >= 200).all())
    assert torch.equal(ids_of(batch), info["index"])
    rb.update_priority(device_rows, torch.ones(200))
    rb.update_priority(spilled_rows, torch.zeros(400))
    batch, info = rb.sample(return_info=True)
    assert bool((info["index"] < 200).all())
    assert torch.equal(ids_of(batch), info["index"])
    # Mixed priorities: rows of both tiers, weights from the one tree.
    rb.update_priority(spilled_rows, torch.full((400,), 3.0))
    batch, info = rb.sample(return_info=True)
    idx = info["index"]
    assert bool((idx < 200).any()) and bool((idx >= 200).any())
    assert torch.equal(ids_of(batch), idx)
    expected = torch.where(idx < 200, torch.tensor(1.0), torch.tensor(3.0)) ** -0.5  # (P_i / P_min) ** -beta
    assert torch.allclose(info["priority_weight"].double(), expected.double(), rtol=1e-5)
    assert isinstance(rb.sampler, PrioritizedSampler)


def test_set_and_get_across_tiers(tmp_path):
    storage = spill(100, 30, tmp_path)
    storage.set(range(100), ted_rows(100))
    assert len(storage) == 100
    rows = torch.tensor([5, 29, 30, 31, 99, 0])
    storage.set(rows, ted_rows(6, 1000))
    assert torch.equal(ids_of(storage.get(rows)), torch.arange(1000, 1006))
    storage.set(-1, ted_rows(1, 5000)[0])
    assert int(storage.get(99)["next", "reward"]) == 5000
    mask = torch.zeros(100, dtype=torch.bool)
    mask[[1, 50]] = True
    assert torch.equal(ids_of(storage.get(mask)), torch.tensor([1, 50]))
    with pytest.raises(IndexOutOfRangeError):
        storage.get(100)
    with pytest.raises(IndexOutOfRangeError):
        storage.set(torch.tensor([3, 100]), ted_rows(2))


def test_tensorclass_and_plain_tensors(tmp_path):
    @tensorclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor

    storage = SpillStorage(50, device="cpu", device_budget=10 * 12, scratch_dir=tmp_path / "a")
    storage.set(range(50), Pair(x=torch.arange(50.0)[:, None].expand(50, 2).clone(), y=torch.arange(50.0), batch_size=[50]))
    got = storage.get(torch.tensor([3, 40]))
    assert isinstance(got, Pair) and torch.equal(got.y, torch.tensor([3.0, 40.0]))
    plain = gpubuf.ReplayBuffer(storage=SpillStorage(20, device="cpu", device_budget=0, scratch_dir=tmp_path / "b"))
    plain.extend(torch.arange(40).view(20, 2))
    assert plain.storage.tiers["device_rows"] == 0 and plain.storage.tiers["rows_spilled"] == 20
    assert torch.equal(plain[:], torch.arange(40).view(20, 2))


def test_budget_above_the_capacity_never_spills(tmp_path):
    storage = SpillStorage(100, device="cpu", device_budget=10**9, scratch_dir=tmp_path / "s")
    gpubuf.ReplayBuffer(storage=storage).extend(ted_rows(250))
    assert storage.tiers["spill_rows"] == 0 and not storage.tiers["spill_created"]
    assert not (tmp_path / "s").exists()
    assert torch.equal(ids_of(storage.get(slice(0, 100))), torch.cat([torch.arange(200, 250), torch.arange(150, 200)]))


def test_state_dict_and_checkpoint_see_one_buffer(tmp_path):
    src = spill(300, 50, tmp_path)
    rb = gpubuf.ReplayBuffer(storage=src)
    rb.extend(ted_rows(280))
    dst = SpillStorage(300, device="cpu", device_budget=200 * ROW, scratch_dir=tmp_path / "other")
    dst.load_state_dict(src.state_dict())
    assert len(dst) == 280 and dst.tiers["device_rows"] == 200
    assert torch.equal(ids_of(dst.get(slice(0, 280))), torch.arange(280))


def test_checkpoint_round_trip(tmp_path):
    pytest.importorskip("gpubuf.checkpoint")
    rb = gpubuf.ReplayBuffer(storage=spill(300, 50, tmp_path))
    rb.extend(ted_rows(280))
    rb.dumps(tmp_path / "ckpt")
    other = gpubuf.ReplayBuffer(storage=SpillStorage(300, device="cpu", device_budget=120 * ROW, scratch_dir=tmp_path / "o"))
    other.loads(tmp_path / "ckpt")
    assert len(other) == 280 and other.write_count == 280
    assert torch.equal(ids_of(other[:]), torch.arange(280))


def test_disk_full_in_the_spill_tier_keeps_rows(tmp_path, monkeypatch):
    rb = gpubuf.ReplayBuffer(storage=spill(500, 100, tmp_path))
    rb.extend(ted_rows(150))
    before = ids_of(rb[:])

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_memmap_files, "allocate_blocks", full)
    with pytest.raises(DiskFullError):
        rb.extend(ted_rows(100, 1000))
    with pytest.raises(DiskFullError):
        rb.storage.set(torch.tensor([10, 300]), ted_rows(2, 2000))
    assert len(rb) == 150 and rb.write_count == 150
    assert torch.equal(ids_of(rb[:]), before)  # the device rows were not touched either
    monkeypatch.undo()
    rb.extend(ted_rows(100, 1000))
    assert len(rb) == 250 and int(rb[249]["next", "reward"]) == 1099


def test_rejected_batch_changes_nothing(tmp_path):
    rb = gpubuf.ReplayBuffer(storage=spill(100, 10, tmp_path))
    rb.extend(ted_rows(30))
    bad = ted_rows(5)
    bad["action"] = bad["action"].double()
    with pytest.raises(DTypeMismatchError):
        rb.extend(bad)
    with pytest.raises(SchemaMismatchError):
        rb.extend(ted_rows(5).exclude("done"))
    assert len(rb) == 30 and rb.write_count == 30
    assert torch.equal(ids_of(rb[:]), torch.arange(30))


def test_empty_and_bad_arguments(tmp_path):
    storage = spill(10, 2, tmp_path)
    with pytest.raises(EmptyBufferError):
        storage.get(0)
    with pytest.raises(ValueError):
        SpillStorage(10, device="cpu", device_budget=-1)
    assert storage.cleanup() is False


def test_cleanup_removes_the_spill_files():
    storage = SpillStorage(100, device="cpu", device_budget=10 * ROW)
    gpubuf.ReplayBuffer(storage=storage).extend(ted_rows(50))
    directory = storage.tiers["spill_dir"]
    assert os.path.isdir(directory)
    assert storage.cleanup() is True and not os.path.exists(directory)


@pytest.mark.gpu
def test_cuda_device_tier(tmp_path):
    storage = SpillStorage(1000, device="cuda", device_budget=100 * ROW, scratch_dir=tmp_path / "s")
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, batch_size=512)
    rb.extend(ted_rows(1000).to("cuda"))
    tiers = storage.tiers
    # The stored rows also hold the "index" the TensorDict buffer writes (8 bytes more than ROW).
    hot = 100 * ROW // tiers["row_bytes"]
    assert storage._hot[0].is_cuda and tiers["rows_on_device"] == hot and tiers["rows_spilled"] == 1000 - hot
    batch = rb.sample()
    assert batch["observation"].is_cuda
    ids = ids_of(batch.cpu())
    assert torch.equal(ids, batch["index"].cpu())
    assert bool((ids < 100).any()) and bool((ids >= 100).any())
    assert torch.equal(ids_of(rb[:].cpu()), torch.arange(1000))


def test_scratch_dir_under_a_regular_file_is_refused_at_construction(tmp_path):
    regular = tmp_path / "a_file"
    regular.write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        SpillStorage(8, device="cpu", scratch_dir=regular / "spill")
    # A directory still to be made under an existing one is fine.
    assert SpillStorage(8, device="cpu", scratch_dir=tmp_path / "new" / "spill").scratch_dir.endswith("spill")
