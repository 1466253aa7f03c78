"""Row prefetch inside a CPU row gather of 128 to 4,096 rows: the rows are the twin's, the
sources are untouched, a prefetch of addresses holding nothing does not fault, and only gathers
inside the range prefetch."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.ops._dispatch import kernel_module, numba_importable
from gpubuf.ops.gather_rows import gather_rows_ref, gather_rows_trusted

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


def test_a_prefetching_gather_returns_the_twin_s_rows_and_changes_no_source(monkeypatch):
    monkeypatch.setattr(gather_module, "PREFETCH_MIN_ROWS", 1)
    seen = []
    real = gather_module._prefetch_rows
    monkeypatch.setattr(gather_module, "_prefetch_rows", lambda *a: seen.append(1) or real(*a))
    sources = _sources()
    before = [s.clone() for s in sources]
    index = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(1))
    index[:3] = torch.tensor([0, 999, 999])  # the first row, the last row, a duplicate
    got = gather_rows_trusted(sources, index)
    assert seen == [1]
    for g, w, s, b in zip(got, gather_rows_ref(sources, index), sources, before):
        assert torch.equal(g, w) and torch.equal(s, b)


def test_prefetching_addresses_that_hold_nothing_does_not_fault():
    """A prefetch is a hint: addresses of a freed tensor, or of no memory at all, cost a fetch at
    most. A fault would end this process."""
    index = np.arange(0, 1 << 20, 4099, dtype=np.int64)
    freed = torch.randn(1 << 20, 16)
    targets = np.array([(freed.data_ptr(), 64, 64)], dtype=np.int64)
    del freed
    nowhere = np.array([(64, 1 << 30, 256)], dtype=np.int64)  # page zero, then terabytes past it
    prefetch = kernel_module("cpu.prefetch").prefetch_rows
    prefetch(targets, index, 0)
    prefetch(nowhere, index, 0)


def test_a_large_sample_prefetches_only_past_the_threshold(monkeypatch):
    seen = []
    monkeypatch.setattr(gather_module, "_prefetch_rows", lambda sources, widths, index: seen.append(index.shape[0]))
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(2000))
    rb.extend(TensorDict({"obs": torch.randn(2000, 4), "done": torch.zeros(2000, 1, dtype=torch.bool)}, [2000]))
    threshold = gather_module.PREFETCH_MIN_ROWS
    rb.sample(threshold - 1)
    rb.sample(threshold)
    assert seen == [threshold]
    # Past PREFETCH_MAX_ROWS index_select keeps enough reads in flight by itself.
    monkeypatch.setattr(gather_module, "PREFETCH_MAX_ROWS", 1500)
    rb.sample(1500)
    rb.sample(1501)
    assert seen == [threshold, 1500]


def test_a_checked_gather_prefetches_inside_the_range_and_returns_the_twin_s_rows(monkeypatch):
    seen = []
    real = gather_module._prefetch_rows
    monkeypatch.setattr(gather_module, "_prefetch_rows", lambda *a: seen.append(a[2].shape[0]) or real(*a))
    sources = _sources()
    index = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    want = gather_rows_ref(sources, index)
    for got in (gather_module.gather_rows(sources, index), gather_module.gather_rows(sources, index, [torch.empty_like(w) for w in want])):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    gather_module.gather_rows(sources, index[:100])  # below PREFETCH_MIN_ROWS
    gather_module.gather_rows(sources, index, backend="torch")
    gather_module.gather_rows([s[::2] for s in sources], index % 500)  # strided rows: no prefetch
    assert seen == [300, 300]


def test_without_the_compiled_kernels_nothing_is_prefetched(monkeypatch):
    monkeypatch.setattr(gather_module, "numba_enabled", lambda: False)
    monkeypatch.setattr(gather_module, "_prefetch_rows", lambda *a: pytest.fail("prefetched without Numba"))
    sources = _sources()
    index = torch.arange(0, 1000, 2)
    for g, w in zip(gather_rows_trusted(sources, index), gather_rows_ref(sources, index)):
        assert torch.equal(g, w)
