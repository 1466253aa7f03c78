"""The packed-gather twin against a per-row brute force, and the public op's errors."""

from __future__ import annotations

import pytest
import torch

from gpubuf.errors import BackendUnavailableError, DeviceMismatchError, DTypeMismatchError, IndexOutOfRangeError, SchemaMismatchError
from gpubuf.ops.gather_packed import _block_size, _gather_blocks, gather_packed, gather_packed_ref, gather_packed_trusted, packed_offsets
from helpers import switch_numba


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _store(n_rows, max_len, trails, dtypes, gen, gap=3):
    """A packed store with garbage between rows (as after overwrites) and rows out of order."""
    lengths = torch.randint(0, max_len + 1, (n_rows,), generator=gen)
    order = torch.randperm(n_rows, generator=gen)
    starts = torch.zeros(n_rows, dtype=torch.int64)
    pos = gap
    for r in order.tolist():
        starts[r] = pos
        pos += int(lengths[r]) + gap
    values = []
    for trail, dtype in zip(trails, dtypes):
        if dtype == torch.bool:
            values.append(torch.randint(0, 2, (pos, *trail), generator=gen).bool())
        elif dtype.is_floating_point:
            values.append(torch.randn((pos, *trail), generator=gen).to(dtype))
        else:
            values.append(torch.randint(-100, 100, (pos, *trail), generator=gen).to(dtype))
    return values, starts, lengths


def _brute_force(values, starts, lengths, index):
    """The specification written as the per-row loop the op replaces."""
    outs = []
    for v in values:
        rows = [v[int(starts[r]) : int(starts[r]) + int(lengths[r])] for r in index.tolist()]
        outs.append(torch.cat(rows) if rows else v[:0])
    offsets = torch.tensor([0] + [int(lengths[r]) for r in index.tolist()]).cumsum(0)
    return outs, offsets


DTYPES = [torch.bool, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trail", [(), (3,), (2, 5)])
def test_twin_matches_brute_force(dtype, trail, gen):
    values, starts, lengths = _store(13, 9, [trail], [dtype], gen)
    index = torch.randint(0, 13, (17,), generator=gen)
    index[0], index[-1] = 0, 12
    got, offsets = gather_packed_ref(values, starts, lengths, index)
    want, want_offsets = _brute_force(values, starts, lengths, index)
    assert torch.equal(offsets, want_offsets)
    assert got[0].is_contiguous() and torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trail", [(), (3,), (2, 5)])
def test_compiled_cpu_path_matches_brute_force(dtype, trail, gen):
    pytest.importorskip("numba")
    values, starts, lengths = _store(13, 9, [trail, ()], [dtype, torch.bool], gen)
    lengths[4] = 0  # an empty row, sampled twice below
    index = torch.randint(0, 13, (17,), generator=gen)
    index[0], index[5], index[-1] = 4, 4, 12
    want, want_offsets = _brute_force(values, starts, lengths, index)
    got, offsets = gather_packed(values, starts, lengths, index, backend="numba")
    assert torch.equal(offsets, want_offsets)
    assert all(g.is_contiguous() and torch.equal(g, w) for g, w in zip(got, want))
    # The storages' entry takes it by default on CPU.
    got, _ = gather_packed_trusted(values, starts, lengths, index.to(torch.int32))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_compiled_cpu_path_writes_only_the_outputs_rows(gen):
    pytest.importorskip("numba")
    values, starts, lengths = _store(5, 6, [(3,)], [torch.float64], gen)
    index = torch.tensor([4, 1, 4])
    total = int(lengths[index].sum())
    out = torch.full((total + 5, 3), -7.0, dtype=torch.float64)
    got, _ = gather_packed(values, starts, lengths, index, outs=[out], backend="numba")
    assert got[0] is out
    assert torch.equal(out[:total], _brute_force(values, starts, lengths, index)[0][0])
    assert bool((out[total:] == -7.0).all())


def test_trusted_entry_without_cpu_kernels_runs_the_twin(gen, monkeypatch):
    values, starts, lengths = _store(9, 8, [()], [torch.int64], gen)
    index = torch.tensor([8, 0, 4])
    switch_numba(monkeypatch, on=False)
    monkeypatch.setattr("gpubuf.ops.gather_packed.kernel_module", lambda name: pytest.fail(f"loaded {name}"))
    got, _ = gather_packed_trusted(values, starts, lengths, index)
    assert torch.equal(got[0], _brute_force(values, starts, lengths, index)[0][0])


def test_many_sources_share_one_index(gen):
    values, starts, lengths = _store(11, 7, [(), (4,), (2, 2)], [torch.int64, torch.bool, torch.float16], gen)
    index = torch.tensor([3, 3, 10, 0, 7], dtype=torch.int32)
    got, _ = gather_packed(values, starts, lengths, index)
    for g, w in zip(got, _brute_force(values, starts, lengths, index)[0]):
        assert torch.equal(g, w)


@pytest.mark.parametrize("batch", [1, 2, 31, 64])
def test_duplicates_empty_rows_and_batch_sizes(batch, gen):
    values, starts, lengths = _store(7, 5, [(2,)], [torch.float32], gen)
    lengths[2] = 0
    lengths[5] = 0
    index = torch.randint(0, 7, (batch,), generator=gen)
    index[0] = 2  # an empty first row
    got, offsets = gather_packed_ref(values, starts, lengths, index)
    want, want_offsets = _brute_force(values, starts, lengths, index)
    assert torch.equal(got[0], want[0]) and torch.equal(offsets, want_offsets)


def test_all_rows_empty_and_empty_batch(gen):
    values, starts, lengths = _store(4, 3, [()], [torch.float32], gen)
    lengths.zero_()
    got, offsets = gather_packed(values, starts, lengths, torch.tensor([1, 2]))
    assert got[0].shape == (0,) and offsets.tolist() == [0, 0, 0]
    got, offsets = gather_packed(values, starts, lengths, torch.empty(0, dtype=torch.int64))
    assert got[0].shape == (0,) and offsets.tolist() == [0]


def test_outs_are_written_and_returned(gen):
    values, starts, lengths = _store(5, 6, [(3,)], [torch.float64], gen)
    index = torch.tensor([4, 1])
    total = int(lengths[index].sum())
    out = torch.full((total + 5, 3), -7.0, dtype=torch.float64)
    got, _ = gather_packed(values, starts, lengths, index, outs=[out])
    assert got[0] is out
    assert torch.equal(out[:total], _brute_force(values, starts, lengths, index)[0][0])
    assert bool((out[total:] == -7.0).all())


def test_trusted_entry_and_offsets_helper(gen):
    values, starts, lengths = _store(9, 8, [()], [torch.int64], gen)
    index = torch.tensor([8, 0, 4])
    offsets = packed_offsets(lengths, index)
    got, same = gather_packed_trusted(values, starts, lengths, index, offsets=offsets)
    assert same is offsets
    assert torch.equal(got[0], _brute_force(values, starts, lengths, index)[0][0])


@pytest.mark.parametrize("block", [8, 16, 64])
@pytest.mark.parametrize("trail,dtype", [((), torch.int64), ((3,), torch.float16), ((), torch.bool), ((2, 2), torch.uint8)])
def test_block_copy_matches_brute_force(block, trail, dtype, gen):
    """Rows of at least ``block`` tokens go through the block copy: aligned and cut blocks, duplicates."""
    values, starts, lengths = _store(40, 200, [trail], [dtype], gen, gap=0)
    lengths.clamp_(min=block)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    m = int(lengths.sum())
    values = [v.repeat(-(-m // v.shape[0]), *([1] * (v.ndim - 1)))[:m] for v in values]
    lengths[4] = block  # exactly one block
    lengths[5] = 2 * block + 1
    index = torch.randint(0, 40, (60,), generator=gen)
    index[:5] = torch.tensor([4, 5, 5, 4, 39])
    index[-1] = 39  # the row that ends the values: its windows are clamped back
    offsets = packed_offsets(lengths, index)
    got = _gather_blocks(values, starts, lengths, index, offsets, int(offsets[-1]), block)
    want, _ = _brute_force(values, starts, lengths, index)
    assert got[0].is_contiguous() and torch.equal(got[0], want[0])


@pytest.mark.parametrize("seed", range(20))
def test_block_copy_fix_ups_match_brute_force(seed):
    """Cut blocks are repaired by head and tail blocks: rows ending the values, back to back, repeated."""
    gen = torch.Generator().manual_seed(seed)
    block = [8, 16, 32, 64][seed % 4]
    n = 12
    lengths = torch.randint(block, 3 * block + 2, (n,), generator=gen)
    lengths[: seed % 3] = block  # rows of exactly one block
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    m = int(lengths.sum())
    values = [torch.randint(-1000, 1000, (m,), generator=gen), torch.randint(0, 2, (m, 3), generator=gen).bool()]
    index = torch.randint(0, n, (30,), generator=gen)
    index[torch.randint(0, 30, (6,), generator=gen)] = n - 1  # the last row: its reads are moved back
    offsets = packed_offsets(lengths, index)
    got = _gather_blocks(values, starts, lengths, index, offsets, int(offsets[-1]), block)
    want, _ = _brute_force(values, starts, lengths, index)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_block_copy_of_non_contiguous_values(gen):
    values, starts, lengths = _store(5, 40, [(4,)], [torch.float32], gen)
    lengths.clamp_(min=8)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    values = [torch.randn(int(lengths.sum()), 4, generator=gen)]
    strided = [torch.stack([values[0], values[0]], -1)[..., 0]]  # same values, not contiguous
    assert not strided[0].is_contiguous()
    index = torch.tensor([0, 1, 2, 3, 4, 0])
    offsets = packed_offsets(lengths, index)
    got = _gather_blocks(strided, starts, lengths, index, offsets, int(offsets[-1]), 8)
    assert torch.equal(got[0], _brute_force(values, starts, lengths, index)[0][0])


def test_block_size_choice():
    assert _block_size(64, 10**6) == 64  # RLHF rows: the largest block
    assert _block_size(2048, 10**6) == 64
    assert _block_size(40, 10**6) == 32
    assert _block_size(7, 10**6) == 0  # a short row: per-token index
    assert _block_size(100, 30) == 0  # fewer values than a block


@pytest.mark.parametrize("lo", [0, 3, 9, 70])
def test_public_op_on_long_and_short_rows(lo, gen):
    """Whichever path the shortest row selects, the result is the specification's."""
    values, starts, lengths = _store(30, 300, [(), (2,)], [torch.int64, torch.bool], gen, gap=2)
    lengths.clamp_(min=lo)
    starts = torch.cat([torch.tensor([2]), (lengths + 2).cumsum(0)[:-1] + 2])
    m = int(starts[-1] + lengths[-1])
    values = [v.repeat(-(-m // v.shape[0]), *([1] * (v.ndim - 1)))[:m] for v in values]
    index = torch.randint(0, 30, (25,), generator=gen)
    index[-1] = 29
    got, offsets = gather_packed(values, starts, lengths, index)
    want, want_offsets = _brute_force(values, starts, lengths, index)
    assert torch.equal(offsets, want_offsets)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_no_python_loop_over_rows(gen, monkeypatch):
    """The CPU path reads starts/lengths as tensors: no ``tolist`` of the index happens."""
    values, starts, lengths = _store(50, 20, [()], [torch.int32], gen)
    index = torch.randint(0, 50, (200,), generator=gen)
    calls = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: calls.append(self.numel()) or real(self))
    gather_packed_ref(values, starts, lengths, index)
    assert not calls


# ---------------------------------------------------------------------------------------------
# Errors of the public op
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def store(gen):
    return _store(6, 4, [(2,)], [torch.float32], gen)


@pytest.mark.parametrize("index", [torch.tensor([0.0]), torch.tensor([[0]]), [0], torch.tensor([0], dtype=torch.int16)])
def test_bad_index_type(store, index):
    values, starts, lengths = store
    with pytest.raises(TypeError, match="index"):
        gather_packed(values, starts, lengths, index)


def test_bad_starts_or_lengths(store):
    values, starts, lengths = store
    with pytest.raises(TypeError, match="starts"):
        gather_packed(values, starts.int(), lengths, torch.tensor([0]))
    with pytest.raises(SchemaMismatchError, match="lengths"):
        gather_packed(values, starts, lengths[:3], torch.tensor([0]))


def test_values_must_agree(store):
    values, starts, lengths = store
    with pytest.raises(ValueError, match="at least one"):
        gather_packed([], starts, lengths, torch.tensor([0]))
    with pytest.raises(SchemaMismatchError, match="tokens"):
        gather_packed([values[0], values[0][:-1]], starts, lengths, torch.tensor([0]))
    with pytest.raises(DeviceMismatchError, match="values #1"):
        gather_packed([values[0], torch.empty(values[0].shape, device="meta")], starts, lengths, torch.tensor([0]))
    with pytest.raises(DeviceMismatchError, match="index"):
        gather_packed(values, starts, lengths, torch.tensor([0], device="meta"))


def test_bad_outs_leave_them_untouched(store):
    values, starts, lengths = store
    out = torch.full((100, 2), -1.0, dtype=torch.float64)
    with pytest.raises(DTypeMismatchError, match="out #0"):
        gather_packed(values, starts, lengths, torch.tensor([0]), outs=[out])
    small = torch.full((0, 2), -1.0)
    lengths = lengths.clone()
    lengths[0] = 3
    with pytest.raises(SchemaMismatchError, match="at least"):
        gather_packed(values, starts, lengths, torch.tensor([0]), outs=[small])
    assert bool((out == -1.0).all())


@pytest.mark.parametrize("bad", [6, -1])
def test_out_of_range_row(store, bad):
    values, starts, lengths = store
    with pytest.raises(IndexOutOfRangeError, match=str(bad)):
        gather_packed(values, starts, lengths, torch.tensor([0, bad]))


def test_row_reaching_past_the_values(store):
    values, starts, lengths = store
    lengths = lengths.clone()
    lengths[1] = values[0].shape[0]
    with pytest.raises(IndexOutOfRangeError, match="outside"):
        gather_packed(values, starts, lengths, torch.tensor([1]))


def test_triton_backend_without_interpreter(store, monkeypatch):
    values, starts, lengths = store
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError):
        gather_packed(values, starts, lengths, torch.tensor([0]), backend="triton")
