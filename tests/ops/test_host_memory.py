"""Output memory on the CPU: huge-page blocks for large batches, the ordinary heap below.

The size threshold is lowered in these tests so that the huge-page path runs on small data.
"""

from __future__ import annotations

import gc
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from gpubuf.ops import host_memory
from gpubuf.ops.gather_rows import gather_rows_trusted

# The module (``gpubuf.ops.gather_rows`` the attribute is the function of that name).
gather_rows_mod = importlib.import_module("gpubuf.ops.gather_rows")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codec"))
from codec_helpers import make_table  # noqa: E402

from gpubuf.ops.decode_rows import decode_rows, decode_rows_ref  # noqa: E402


def _record_sizes(monkeypatch, name):
    """Replaces ``host_memory.<name>`` by a wrapper that records the size it is called with."""
    sizes = []
    real = getattr(host_memory, name)

    def recording(size):
        sizes.append(size)
        return real(size)

    monkeypatch.setattr(host_memory, name, recording)
    return sizes


@pytest.fixture
def spy(monkeypatch):
    """Counts huge-page blocks handed out."""
    return _record_sizes(monkeypatch, "_huge_page_block")


@pytest.fixture
def small_threshold(monkeypatch):
    monkeypatch.setattr(host_memory, "LARGE_OUTPUT_BYTES", 4096)
    monkeypatch.setattr(gather_rows_mod, "LARGE_OUTPUT_BYTES", 4096)


def _thp_file(tmp_path, monkeypatch, text):
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(host_memory, "_THP_SETTING", path)
    host_memory._kernel_offers_huge_pages.cache_clear()
    monkeypatch.setattr(host_memory.mmap, "MADV_HUGEPAGE", 14, raising=False)


@pytest.fixture(autouse=True)
def _fresh_detection():
    host_memory._kernel_offers_huge_pages.cache_clear()
    yield
    host_memory._kernel_offers_huge_pages.cache_clear()


def test_small_outputs_stay_on_the_heap(spy):
    out = host_memory.empty_host((3, 5), torch.float32)
    assert out.shape == (3, 5) and out.dtype == torch.float32 and out.is_contiguous()
    assert spy == []


@pytest.mark.parametrize("shape", [(0,), (4, 0, 3), (0, 84, 84)])
@pytest.mark.parametrize("dtype", [torch.int16, torch.float64, torch.uint8])
def test_empty_outputs_take_any_dtype(shape, dtype):
    out = host_memory.empty_host(shape, dtype)
    assert out.shape == shape and out.dtype == dtype and out.numel() == 0


def test_large_output_is_a_huge_page_block_that_outlives_its_mapping_object(spy, small_threshold, tmp_path, monkeypatch):
    _thp_file(tmp_path, monkeypatch, "always [madvise] never\n")
    monkeypatch.delenv("GPUBUF_HUGE_PAGES", raising=False)
    out = host_memory.empty_host((1000, 3), torch.int64)
    assert spy == [24_000]
    assert out.shape == (1000, 3) and out.dtype == torch.int64 and out.is_contiguous()
    out.copy_(torch.arange(3000).reshape(1000, 3))
    tail = out[990:]
    del out
    gc.collect()
    # The view alone keeps the mapping alive, and the memory is writable.
    assert tail.flatten().tolist() == list(range(2970, 3000))
    tail += 1
    assert int(tail[-1, -1]) == 3000


@pytest.mark.parametrize(
    "text, env, expected",
    [
        ("always [madvise] never\n", None, True),
        ("[always] madvise never\n", None, True),
        ("always madvise [never]\n", None, False),
        ("always [madvise] never\n", "0", False),
    ],
)
def test_huge_pages_follow_the_kernel_setting_and_the_switch(tmp_path, monkeypatch, spy, small_threshold, text, env, expected):
    _thp_file(tmp_path, monkeypatch, text)
    if env is None:
        monkeypatch.delenv("GPUBUF_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("GPUBUF_HUGE_PAGES", env)
    assert host_memory.huge_pages_enabled() is expected
    out = host_memory.empty_host((8192,), torch.uint8)
    assert out.numel() == 8192
    assert len(spy) == int(expected)


def test_unreadable_setting_means_no_huge_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(host_memory, "_THP_SETTING", tmp_path / "missing")
    assert host_memory.huge_pages_enabled() is False


def test_refused_mapping_falls_back_to_the_heap(monkeypatch, small_threshold, tmp_path):
    _thp_file(tmp_path, monkeypatch, "always [madvise] never\n")

    def refuse(*args, **kwargs):
        raise OSError("no address space")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    out = host_memory.empty_host((100, 100), torch.float32)
    out.fill_(2.0)
    assert float(out.sum()) == 20_000.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.int64, torch.uint8])
def test_large_gathers_equal_index_select(spy, small_threshold, tmp_path, monkeypatch, dtype):
    _thp_file(tmp_path, monkeypatch, "always [madvise] never\n")
    gen = torch.Generator().manual_seed(3)
    src = (torch.randn(500, 7, 3, generator=gen) * 50).to(dtype)
    index = torch.randint(0, 500, (300,), generator=gen)
    small = torch.randint(0, 500, (2,), generator=gen)  # 2 * 7 * 3 elements: under the threshold
    big_out, small_out = gather_rows_trusted([src], index)[0], gather_rows_trusted([src], small)[0]
    assert torch.equal(big_out, src[index]) and torch.equal(small_out, src[small])
    assert len(spy) == 1


def test_large_decode_output_equals_the_twin(spy, small_threshold, tmp_path, monkeypatch):
    _thp_file(tmp_path, monkeypatch, "always [madvise] never\n")
    gen = torch.Generator().manual_seed(4)
    frames = torch.randint(0, 4, (12, 20, 30), dtype=torch.uint8, generator=gen)
    frames[:, 5:15] = 7
    table = make_table(frames, keys=torch.tensor([-1, 0, 0, -1, 3, 3, -1, 6, 6, -1, 9, 9]))
    index = torch.randint(0, 12, (40,), generator=gen)
    got = decode_rows(table, index)
    assert spy, "the output did not take the huge-page path"
    assert torch.equal(got, decode_rows_ref(table, index))


# ---------------------------------------------------------------------- kept blocks
@pytest.fixture
def cache(monkeypatch, small_threshold, tmp_path):
    """A fresh cache of kept blocks, huge pages on, and a count of the blocks mapped."""
    _thp_file(tmp_path, monkeypatch, "always [madvise] never\n")
    monkeypatch.delenv("GPUBUF_HUGE_PAGES", raising=False)
    fresh = host_memory._BlockCache()
    monkeypatch.setattr(host_memory, "_CACHE", fresh)
    fresh.mapped = _record_sizes(monkeypatch, "_map_block")
    return fresh


def test_a_freed_batch_block_is_reused_by_the_next_batch_of_its_size(cache):
    first = host_memory.empty_host((1000, 3), torch.int64)
    address = first.data_ptr()
    del first
    gc.collect()
    second = host_memory.empty_host((1000, 3), torch.int64)
    assert second.data_ptr() == address
    assert len(cache.mapped) == 1
    second.copy_(torch.arange(3000).reshape(1000, 3))
    assert int(second.sum()) == sum(range(3000))


def test_a_block_is_not_reused_while_a_view_of_its_batch_lives(cache):
    first = host_memory.empty_host((1000, 3), torch.int64)
    first.copy_(torch.arange(3000).reshape(1000, 3))
    view = first[10:20]
    address = first.data_ptr()
    del first
    gc.collect()
    second = host_memory.empty_host((1000, 3), torch.int64)
    assert second.data_ptr() != address
    second.fill_(-1)
    assert view.flatten().tolist() == list(range(30, 60))
    assert len(cache.mapped) == 2


def test_at_most_the_allowed_number_of_freed_blocks_stay_mapped(cache):
    sizes = [host_memory.HUGE_PAGE_BYTES * k for k in (1, 2, 3, 4)]
    batches = [host_memory.empty_host_bytes(size) for size in sizes]
    del batches
    gc.collect()
    assert len(cache) == 4  # all freed, none unmapped yet: nothing asked for a new block
    kept = host_memory.empty_host_bytes(host_memory.HUGE_PAGE_BYTES * 5)
    idle = len(cache) - 1
    assert idle <= host_memory.IDLE_BLOCKS - 1
    # The newest freed blocks are the ones kept: a batch of the last size reuses its block.
    before = len(cache.mapped)
    host_memory.empty_host_bytes(sizes[-1])
    assert len(cache.mapped) == before
    del kept


def test_release_unmaps_freed_blocks_and_keeps_live_ones(cache):
    live = host_memory.empty_host((1000,), torch.float64)
    live.fill_(1.5)
    freed = host_memory.empty_host((2000,), torch.float64)
    del freed
    gc.collect()
    assert len(cache) == 2
    host_memory.release_idle_blocks()
    assert len(cache) == 1
    assert float(live.sum()) == 1500.0
    again = host_memory.empty_host((2000,), torch.float64)
    assert len(cache.mapped) == 3 and again.numel() == 2000


def test_blocks_taken_without_reuse_are_not_kept(cache):
    arena = host_memory.empty_host_bytes(host_memory.HUGE_PAGE_BYTES, huge_from=host_memory.HUGE_PAGE_BYTES, reuse=False)
    assert arena.numel() == host_memory.HUGE_PAGE_BYTES and len(cache.mapped) == 1
    assert len(cache) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_the_cache_is_locked_can_allocate(cache):
    with cache._lock:  # as if another thread were allocating at the moment of the fork
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                ok = host_memory.empty_host_bytes(8192).numel() == 8192
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 300  # a hang detector only: generous on a loaded machine
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the cache's lock")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
