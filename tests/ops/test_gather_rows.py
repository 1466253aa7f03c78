"""The torch twin of the row gather vs a brute-force loop, and the public op's argument errors."""

from __future__ import annotations

import pytest
import torch

from gpubuf.errors import (
    BackendUnavailableError,
    DeviceMismatchError,
    DTypeMismatchError,
    IndexOutOfRangeError,
    SchemaMismatchError,
)
from gpubuf.ops.gather_rows import gather_rows, gather_rows_ref
from helpers import DTYPES, switch_numba


def _brute_force(sources, index):
    """One Python-level row copy per (source, output row)."""
    results = []
    for src in sources:
        out = torch.empty((len(index), *src.shape[1:]), dtype=src.dtype)
        for b, row in enumerate(index.tolist()):
            out[b] = src[row]
        results.append(out)
    return results


def _source(rows, trail, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, *trail), generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn((rows, *trail), generator=gen).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000) + 1, (rows, *trail), generator=gen).to(dtype)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(99)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_rows", [1, 7])
def test_twin_matches_brute_force(dtype, n_rows, gen):
    sources = [_source(n_rows, trail, dtype, gen) for trail in [(), (1,), (3,), (5, 7)]]
    index = torch.randint(0, n_rows, (11,), generator=gen)
    index[0], index[-1] = 0, n_rows - 1
    for got, want in zip(gather_rows_ref(sources, index), _brute_force(sources, index)):
        assert got.is_contiguous() and torch.equal(got, want)


def test_twin_writes_into_outs_and_returns_them(gen):
    sources = [_source(7, (3,), torch.float32, gen), _source(7, (), torch.int64, gen)]
    index = torch.tensor([5, 5, 0, 6, 2], dtype=torch.int32)
    outs = [torch.full((5, 3), -1.0), torch.full((5,), -1, dtype=torch.int64)]
    got = gather_rows_ref(sources, index, outs)
    assert got[0] is outs[0] and got[1] is outs[1]
    for g, w in zip(got, _brute_force(sources, index)):
        assert torch.equal(g, w)


def test_twin_handles_non_contiguous_sources(gen):
    base = _source(14, (4, 3), torch.float64, gen)
    sources = [base[::2], base[:7].transpose(1, 2), base[:7, :, 1]]
    index = torch.tensor([6, 0, 3, 3])
    for got, want in zip(gather_rows_ref(sources, index), _brute_force(sources, index)):
        assert torch.equal(got, want)


def test_empty_batch(gen):
    got = gather_rows([_source(7, (2,), torch.float32, gen)], torch.empty(0, dtype=torch.int64))
    assert got[0].shape == (0, 2)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_public_op_on_cpu_matches_brute_force(backend, gen):
    sources = [_source(7, (5,), torch.bfloat16, gen), _source(7, (2, 2), torch.uint8, gen)]
    index = torch.tensor([1, 6, 1, 0])
    for got, want in zip(gather_rows(sources, index, backend=backend), _brute_force(sources, index)):
        assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------
# Errors of the public op
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def src(gen):
    return _source(7, (3,), torch.float32, gen)


@pytest.mark.parametrize(
    "index",
    [
        torch.tensor([0.0, 1.0]),
        torch.tensor([0, 1], dtype=torch.int16),
        torch.tensor([True, False]),
        torch.tensor([[0, 1]]),
        torch.tensor(1),
        [0, 1],
    ],
    ids=["float", "int16", "bool", "2-D", "0-D", "list"],
)
def test_bad_index_raises_type_error(src, index):
    with pytest.raises(TypeError, match="index"):
        gather_rows([src], index)


def test_no_source(src):
    with pytest.raises(ValueError, match="at least one source"):
        gather_rows([], torch.tensor([0]))


def test_scalar_source():
    with pytest.raises(SchemaMismatchError, match="scalar"):
        gather_rows([torch.tensor(1.0)], torch.tensor([0]))


def test_sources_with_different_row_counts(src):
    with pytest.raises(SchemaMismatchError, match="6 rows"):
        gather_rows([src, src[:6]], torch.tensor([0]))


def test_sources_on_different_devices(src):
    with pytest.raises(DeviceMismatchError, match="source #1"):
        gather_rows([src, torch.empty(7, device="meta")], torch.tensor([0]))


def test_index_on_another_device(src):
    with pytest.raises(DeviceMismatchError, match="index"):
        gather_rows([src], torch.tensor([0], device="meta"))


def test_out_of_wrong_shape_leaves_outs_untouched(src):
    good = torch.full((2, 3), -5.0)
    bad = torch.full((3, 3), -5.0)
    with pytest.raises(SchemaMismatchError, match="out #1"):
        gather_rows([src, src], torch.tensor([0, 1]), [good, bad])
    assert bool((good == -5.0).all()) and bool((bad == -5.0).all())


def test_out_of_wrong_dtype(src):
    with pytest.raises(DTypeMismatchError, match="out #0"):
        gather_rows([src], torch.tensor([0, 1]), [torch.empty(2, 3, dtype=torch.float64)])


def test_out_on_wrong_device(src):
    with pytest.raises(DeviceMismatchError, match="out #0"):
        gather_rows([src], torch.tensor([0, 1]), [torch.empty(2, 3, device="meta")])


def test_non_contiguous_out(src):
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows([src], torch.tensor([0, 1]), [torch.empty(3, 2).t()])


def test_wrong_number_of_outs(src):
    with pytest.raises(ValueError, match="outputs"):
        gather_rows([src, src], torch.tensor([0, 1]), [torch.empty(2, 3)])


@pytest.mark.parametrize("bad", [7, -1, 100])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_out_of_range_index_raises_before_writing(src, bad, index_dtype):
    out = torch.full((3, 3), -5.0)
    with pytest.raises(IndexOutOfRangeError, match=str(bad)):
        gather_rows([src], torch.tensor([0, bad, 6], dtype=index_dtype), [out])
    assert bool((out == -5.0).all())


def test_out_of_range_error_is_an_index_error(src):
    with pytest.raises(IndexError):
        gather_rows([src], torch.tensor([7]))


def test_triton_backend_on_cpu_without_interpreter(src, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="triton"):
        gather_rows([src], torch.tensor([0]), backend="triton")


def test_unknown_backend(src):
    with pytest.raises(ValueError, match="backend"):
        gather_rows([src], torch.tensor([0]), backend="cuda")


# ------------------------------------------------------------------------------ large CPU batches
def test_large_cpu_batches_equal_the_twin_for_every_dtype_and_width(gen):
    """A CPU gather of a few hundred rows, checked or trusted: every dtype and row width (1-D
    sources, bytes, empty trailing dims), duplicates and the first and last rows, into fresh
    outputs or given ones, byte for byte."""
    import sys

    module = sys.modules["gpubuf.ops.gather_rows"]
    n_rows = 1000
    sources = [_source(n_rows, trail, dtype, gen) for dtype in DTYPES for trail in ((), (3,))]
    sources += [_source(n_rows, (2, 0), torch.float32, gen), _source(n_rows, (5, 7), torch.uint8, gen)]
    index = torch.randint(0, n_rows, (300,), generator=gen)
    index[:3] = torch.tensor([0, n_rows - 1, 0])
    want = _brute_force(sources, index)
    assert all(torch.equal(g, w) for g, w in zip(gather_rows(sources, index), want))
    outs = [torch.full_like(w, 1) for w in want]
    assert gather_rows(sources, index, outs) is not None and all(torch.equal(o, w) for o, w in zip(outs, want))
    assert all(torch.equal(g, w) for g, w in zip(module.gather_rows_trusted(sources, index), want))
    assert all(torch.equal(g, w) for g, w in zip(gather_rows(sources, index, backend="torch"), want))


def test_large_cpu_batch_out_of_range_raises_before_writing(gen, monkeypatch):
    """The public op checks the indices before it copies a row into the given outputs."""
    src = _source(100, (3,), torch.float32, gen)
    index = torch.randint(0, 100, (200,), generator=gen)
    index[150] = 100
    outs = [torch.zeros(200, 3)]
    with pytest.raises(IndexOutOfRangeError):
        gather_rows([src], index, outs)
    assert bool((outs[0] == 0).all())


# ------------------------------------------------------------------------------ the compiled CPU gather
def _module():
    import sys

    return sys.modules["gpubuf.ops.gather_rows"]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
def test_compiled_gather_copies_every_dtype_and_width(gen, index_dtype):
    """The kernel itself (not a fallback): every dtype, 1-D fields, bytes, empty trailing dims and
    wide rows; duplicates and both ends; into fresh outputs and into given ones."""
    pytest.importorskip("numba")
    n_rows = 500
    sources = [_source(n_rows, trail, dtype, gen) for dtype in DTYPES for trail in ((), (3,))]
    sources += [_source(n_rows, (2, 0), torch.float32, gen), _source(n_rows, (70, 3), torch.uint8, gen)]
    index = torch.randint(0, n_rows, (97,), generator=gen).to(index_dtype)
    index[:3] = torch.tensor([0, n_rows - 1, 0])
    want = _brute_force(sources, index)
    got = _module()._gather_compiled(sources, index, None)
    assert got is not None and all(g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want))
    outs = [torch.full_like(w, 1) for w in want]
    got = _module()._gather_compiled(sources, index, outs)
    assert got is not None and all(g is o and torch.equal(o, w) for g, o, w in zip(got, outs, want))
    empty = _module()._gather_compiled(sources, index[:0], None)
    assert empty is not None and [e.shape for e in empty] == [(0, *s.shape[1:]) for s in sources]


def _runs(starts_and_lengths):
    return torch.cat([torch.arange(start, start + length) for start, length in starts_and_lengths])


@pytest.mark.parametrize(
    "index",
    [
        _runs([(start, 32) for start in (5, 400, 40, 460, 37)]),  # slices, one overlapping another
        _runs([(0, 500)]),  # one run: the whole storage
        _runs([(499, 1), (0, 3), (7, 1), (10, 2), (3, 1), (480, 20)]),  # runs and singles, both ends
        _runs([(2, 2), (9, 2), (30, 2), (1, 1)]),  # 4 runs of 7 rows: 2 * runs > n, copied row by row
        _runs([(2, 2), (9, 2), (30, 2), (1, 2)]),  # 4 runs of 8 rows: 2 * runs == n, copied run by run
        torch.tensor([4, 4, 5, 5, 6, 3, 2, 1]),  # repeats and descending rows: no run longer than 2
        _runs([(start, 3) for start in range(0, 400, 7)]),  # more runs than the prefetch distance
    ],
    ids=["slices", "whole", "mixed", "row-loop", "run-loop", "repeats", "many-runs"],
)
def test_compiled_gather_copies_runs_of_consecutive_rows(gen, index):
    """Indices made of runs (trajectory slices) are copied run by run, scattered ones row by row;
    both give every field's rows exactly, wide and narrow fields alike."""
    pytest.importorskip("numba")
    sources = [_source(500, trail, dtype, gen) for dtype, trail in
               ((torch.float32, (4,)), (torch.int64, ()), (torch.bool, (1,)), (torch.uint8, (70, 3)))]
    got = _module()._gather_compiled(sources, index, None)
    assert got is not None and all(torch.equal(g, w) for g, w in zip(got, _brute_force(sources, index)))


def test_compiled_gather_reads_memory_mapped_rows(gen, tmp_path):
    pytest.importorskip("numba")
    import numpy as np

    rows = np.memmap(tmp_path / "rows", dtype=np.float32, mode="w+", shape=(300, 5))
    rows[:] = np.arange(1500, dtype=np.float32).reshape(300, 5)
    source = torch.from_numpy(rows)
    index = torch.tensor([299, 0, 150, 150])
    got = _module()._gather_compiled([source], index, None)
    assert got is not None and torch.equal(got[0], source[index])


def test_compiled_gather_declines_what_it_cannot_copy_and_writes_nothing(gen):
    """Non-contiguous rows, or an index outside [0, N): None, outputs untouched; the public op
    then runs the twin, with its result or its error. A strided index is copied, then gathered."""
    pytest.importorskip("numba")
    base = _source(20, (4,), torch.float32, gen)
    index = torch.tensor([3, 9, 0])
    assert _module()._gather_compiled([base[:, ::2]], index, None) is None
    strided = _module()._gather_compiled([base], torch.tensor([3, 0, 9, 0, 0, 0])[::2], None)
    assert strided is not None and torch.equal(strided[0], base[index])
    for bad in (20, -1):
        outs = [torch.zeros(3, 4)]
        assert _module()._gather_compiled([base], torch.tensor([3, bad, 0]), outs) is None
        assert not bool(outs[0].any())
    got = gather_rows([base[:, ::2]], index)
    assert torch.equal(got[0], base[:, ::2][index])


def test_a_batch_past_the_compiled_gathers_size_goes_to_index_select(gen, monkeypatch):
    """Large batches are copied by index_select on all of torch's threads; the same rows either way."""
    pytest.importorskip("numba")
    module = _module()
    sources = [_source(50, (4,), torch.float32, gen), _source(50, (), torch.int64, gen)]
    index = torch.randint(0, 50, (10,), generator=gen)
    assert module._gather_compiled(sources, index, None) is not None
    monkeypatch.setattr(module, "COMPILED_GATHER_BYTES", 10 * (16 + 8) - 1)
    assert module._gather_compiled(sources, index, None) is None
    got = module.gather_rows_trusted(sources, index)
    assert all(torch.equal(g, s[index]) for g, s in zip(got, sources))


@pytest.mark.parametrize("bad", [7, -1])
def test_trusted_gather_out_of_range_raises_an_index_error_not_a_crash(src, bad):
    """The sample path's entry trusts its callers; an index out of range still never reaches the
    kernel's raw copies: index_select's IndexError, as before the kernel."""
    with pytest.raises(IndexError):
        _module().gather_rows_trusted([src], torch.tensor([0, bad]))


def test_cpu_auto_takes_the_kernel_and_torch_takes_the_twin(gen, monkeypatch):
    pytest.importorskip("numba")
    module = _module()
    calls = []
    compiled = module._gather_compiled

    def spy(*args):
        result = compiled(*args)
        calls.append(result is not None)
        return result

    monkeypatch.setattr(module, "_gather_compiled", spy)
    sources = [_source(50, (3,), torch.float32, gen), _source(50, (), torch.bool, gen)]
    index = torch.tensor([49, 2, 2])
    for got in (module.gather_rows_trusted(sources, index), gather_rows(sources, index)):
        assert all(torch.equal(g, s[index]) for g, s in zip(got, sources))
    assert calls == [True, True]
    module.gather_rows_trusted(sources, index, backend="torch")
    gather_rows(sources, index, backend="torch")
    switch_numba(monkeypatch, on=False)
    module.gather_rows_trusted(sources, index)
    assert calls == [True, True]


def test_compiled_gather_follows_sources_moved_to_new_memory(gen):
    """The kept addresses of the sources are checked at every call: a source whose memory was
    replaced in place (set_) is read where it is now."""
    pytest.importorskip("numba")
    module = _module()
    source = _source(40, (3,), torch.float32, gen)
    index = torch.tensor([39, 0, 7])
    assert torch.equal(module._gather_compiled([source], index, None)[0], source[index])
    source.set_(torch.full((40, 3), 5.0))
    assert torch.equal(module._gather_compiled([source], index, None)[0], torch.full((3, 3), 5.0))


def test_compiled_gather_keeps_no_source_alive(gen):
    """What the gather keeps of its last sources (addresses, widths) holds no reference to them:
    a dropped storage's memory is freed at once, not at the next gather of other rows."""
    pytest.importorskip("numba")
    import gc
    import weakref

    module = _module()
    source = _source(40, (3,), torch.float32, gen)
    assert module._gather_compiled([source], torch.tensor([1, 2]), None) is not None
    alive = weakref.ref(source)
    del source
    gc.collect()
    assert alive() is None
