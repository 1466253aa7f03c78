"""Row prefetch before a small host gather: the targets it reads, that it is only a hint, and
that a storage keeps its targets only while its leaves stay where they were."""

from __future__ import annotations

import pickle
import sys

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.ops._dispatch import numba_importable
from gpubuf.ops.gather_rows import gather_rows_ref, gather_rows_trusted, prefetch_rows, row_targets

pytestmark = pytest.mark.skipif(not numba_importable(), reason="needs Numba (the cpu extra)")

# ``gpubuf.ops`` exports the function ``gather_rows``, which hides the module of that name.
gather_module = sys.modules["gpubuf.ops.gather_rows"]


def _sources():
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randn(1000, 32, generator=gen),
        torch.randint(0, 2, (1000, 1), generator=gen).bool(),
        torch.randn(1000, 3, 5, generator=gen).double(),
        torch.randint(-9, 9, (1000,), generator=gen),
    ]


def test_row_targets_are_each_source_s_row_address_stride_and_length():
    sources = _sources()
    sources.append(torch.randn(1000, 8)[:, :3])  # rows of 12 bytes, 32 apart
    targets = row_targets(sources)
    assert targets.dtype.name == "int64" and targets.shape == (5, 3)
    for (address, stride, length), src in zip(targets.tolist(), sources):
        assert address == src.data_ptr()
        assert stride == src.stride(0) * src.element_size()
        assert length == src[0].numel() * src.element_size()


def test_row_targets_are_none_without_the_compiled_kernels_or_off_the_host(monkeypatch):
    assert row_targets([]) is None
    assert row_targets([torch.tensor(1.0)]) is None  # no rows to speak of
    monkeypatch.setenv("GPUBUF_NUMBA", "0")
    assert row_targets(_sources()) is None


def test_a_prefetching_gather_returns_the_twin_s_rows_and_changes_no_source(monkeypatch):
    monkeypatch.setattr(gather_module, "PREFETCH_MIN_ROWS", 1)
    sources = _sources()
    before = [s.clone() for s in sources]
    index = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1))
    index[:3] = torch.tensor([0, 999, 999])  # the first row, the last row, a duplicate
    got = gather_rows_trusted(sources, index, row_targets(sources))
    for g, w, s, b in zip(got, gather_rows_ref(sources, index), sources, before):
        assert torch.equal(g, w) and torch.equal(s, b)


def test_prefetching_addresses_that_hold_nothing_does_not_fault():
    """A prefetch is a hint: stale targets (a freed tensor, no memory at all) cost a fetch at
    most. A fault would end this process."""
    index = torch.arange(0, 1 << 20, 4099, dtype=torch.int64)
    freed = row_targets([torch.randn(1 << 20, 16)])  # the tensor is gone after this line
    nowhere = row_targets([torch.zeros(1, 4)])
    nowhere[0] = (64, 1 << 30, 256)  # page zero, then terabytes past it
    prefetch_rows(freed, index)
    prefetch_rows(nowhere, index)


def test_a_large_sample_prefetches_only_past_the_threshold(monkeypatch):
    seen = []
    monkeypatch.setattr(gather_module, "prefetch_rows", lambda targets, index: seen.append(index.shape[0]))
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(2000))
    rb.extend(TensorDict({"obs": torch.randn(2000, 4), "done": torch.zeros(2000, 1, dtype=torch.bool)}, [2000]))
    threshold = gather_module.PREFETCH_MIN_ROWS
    rb.sample(threshold - 1)
    rb.sample(threshold)
    assert seen == [threshold]


def _filled_storage(rows=600):
    storage = gpubuf.LazyTensorStorage(rows)
    rb = gpubuf.TensorDictReplayBuffer(storage=storage)
    rb.extend(TensorDict({"obs": torch.arange(rows * 3.0).view(rows, 3), "act": torch.arange(rows)}, [rows]))
    return storage


def test_a_storage_keeps_its_targets_while_its_leaves_stay_put():
    storage = _filled_storage()
    index = torch.arange(0, 600, 3)
    storage._gather(index)
    kept = storage._prefetch_targets[3]
    storage._gather(index)
    assert storage._prefetch_targets[3] is kept  # not rebuilt on every call
    leaves = storage._flat_leaves
    assert kept.tolist() == row_targets(leaves).tolist()
    # With a leaf skipped (the buffer fills the "index" column itself), that leaf is left out.
    storage._gather(index, 0)
    assert storage._prefetch_targets[3].tolist() == row_targets(leaves[1:]).tolist()


def test_a_storage_rebuilds_its_targets_for_new_leaves():
    storage = _filled_storage()
    storage._gather(torch.arange(200))
    state = storage.state_dict()
    other = _filled_storage(rows=600)
    other._gather(torch.arange(200))
    other.load_state_dict(state)
    got = other._gather(torch.arange(200))
    assert other._prefetch_targets[3].tolist() == row_targets(other._flat_leaves).tolist()
    assert all(torch.equal(g, w) for g, w in zip(got, storage._gather(torch.arange(200))))


def test_a_copy_of_the_storage_elsewhere_does_not_reuse_the_original_s_addresses():
    """A pickled copy (another process's, say) keeps the cache's leaves list as its own, so the
    list alone cannot tell that the leaves now live elsewhere."""
    storage = _filled_storage()
    storage._gather(torch.arange(200))
    copy = pickle.loads(pickle.dumps(storage))
    assert copy._prefetch_targets[0] is copy._flat_leaves
    copy._gather(torch.arange(200))
    assert copy._prefetch_targets[3].tolist() == row_targets(copy._flat_leaves).tolist()
    assert copy._prefetch_targets[3].tolist() != row_targets(storage._flat_leaves).tolist()


def test_turning_the_compiled_kernels_off_stops_prefetching_with_kept_targets(monkeypatch):
    seen = []
    monkeypatch.setattr(gather_module, "prefetch_rows", lambda targets, index: seen.append(index.shape[0]))
    sources = _sources()
    targets = row_targets(sources)
    index = torch.arange(gather_module.PREFETCH_MIN_ROWS)
    gather_rows_trusted(sources, index, targets)
    monkeypatch.setenv("GPUBUF_NUMBA", "0")
    got = gather_rows_trusted(sources, index, targets)
    assert seen == [index.shape[0]]
    assert all(torch.equal(g, w) for g, w in zip(got, gather_rows_ref(sources, index)))
