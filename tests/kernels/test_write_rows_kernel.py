"""Triton ring write vs its torch twin, bit for bit.

Runs on CUDA when present, else on CPU tensors through Triton's interpreter (set up by
tests/conftest.py); sizes stay small for the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.errors import DTypeMismatchError, SchemaMismatchError
from gpubuf.ops.device_work import count_device_work
from gpubuf.ops.write_rows import write_rows, write_rows_ref
from gpubuf_kernels._config import GATHER_ROWS
from gpubuf_kernels.write_rows import write_rows_triton
from helpers import DTYPES

BLOCK = GATHER_ROWS["BLOCK_ROWS"]
TRAILS = [(), (1,), (3,), (5, 7), (33,), (2, 4)]
POISON = 0xAB


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _random(rows: int, trail: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random ``[rows, *trail]`` of ``dtype`` from raw bytes below POISON (NaN payloads, -0.0)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, *trail), generator=gen).bool().to(_device())
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, POISON, (rows, *trail, size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(rows, *trail).to(_device())


def _poisoned(rows: int, trail: tuple, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((rows, *trail), dtype=dtype, device=_device())
    out.reshape(-1).view(torch.uint8).fill_(POISON)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _byte_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s bytes (``clone`` would turn a bool's poison byte into 1)."""
    out = torch.empty_like(t)
    _bytes(out).copy_(_bytes(t))
    return out


def _check(capacity: int, count: int, first: int, fields: list[tuple[tuple, torch.dtype]], seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    sources = [_random(count, trail, dtype, gen) for trail, dtype in fields]
    got = [_poisoned(capacity, trail, dtype) for trail, dtype in fields]
    want = [_byte_copy(t) for t in got]
    with count_device_work() as work:
        write_rows_triton(got, sources, first)
    write_rows_ref(want, sources, first)
    for g, w in zip(got, want):
        assert torch.equal(_bytes(g), _bytes(w))  # the written rows, and every other row untouched
    if count and any(s[0].numel() for s in sources):
        # One launch; on CUDA also the upload of the batch's pointer table (new sources, new
        # addresses), a non-blocking copy, never a host sync.
        uploads = 1 if sources[0].is_cuda else 0
        assert work.triton_launches == 1 and work.torch_ops == work.host_to_device == uploads, work.summary()
        assert work.host_syncs == 0, work.summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("trail", TRAILS, ids=str)
def test_every_dtype_and_row_shape_is_written_bit_for_bit(dtype, trail):
    _check(capacity=13, count=9, first=7, fields=[(trail, dtype)])  # wraps: rows 7..12 then 0..2


@pytest.mark.parametrize(
    ("capacity", "count", "first"),
    [(1, 1, 0), (7, 7, 0), (7, 7, 3), (8, 1, 7), (BLOCK + 1, BLOCK + 1, 5), (2 * BLOCK, BLOCK - 1, 3 * BLOCK // 2),
     (9, 0, 4), (3 * BLOCK, BLOCK + 1, 0)],
)
def test_ring_edges(capacity, count, first):
    fields = [((), torch.bool), ((3,), torch.float32), ((2, 4), torch.int64), ((1,), torch.float16), ((33,), torch.uint8)]
    _check(capacity, count, first, fields, seed=capacity + count)


def test_a_batch_field_whose_rows_are_not_dense_is_copied_beside_the_launch():
    gen = torch.Generator().manual_seed(1)
    dense = _random(6, (4,), torch.float32, gen)
    transposed = _random(3, (6,), torch.int32, gen).t()  # [6, 3]: rows not dense
    expanded = _random(1, (5,), torch.float64, gen).expand(6, 5)  # stride 0 rows: dense, one address
    got = [_poisoned(10, (4,), torch.float32), _poisoned(10, (3,), torch.int32), _poisoned(10, (5,), torch.float64)]
    want = [_byte_copy(t) for t in got]
    write_rows_triton(got, [dense, transposed, expanded], 8)
    write_rows_ref(want, [dense, transposed, expanded], 8)
    for g, w in zip(got, want):
        assert torch.equal(_bytes(g), _bytes(w))


def test_contiguous_batch_fields_get_the_table_rows_the_general_derivation_gives(monkeypatch):
    """The launcher reads a contiguous batch field's row size and stride off ``numel`` and the
    batch size; the table rows must be those :func:`_source_entry` derives from the shape and
    strides, whatever the field's address (views starting at odd bytes narrow the copy unit),
    for one row (whose stride is never read) and with dims of size one."""
    from gpubuf_kernels import write_rows as module
    from gpubuf_kernels.gather import _source_entry

    tables = []
    monkeypatch.setattr(module, "device_table", lambda entries, cols, device: tables.append(entries))
    monkeypatch.setattr(module, "launch", lambda *args, **kwargs: None)
    gen = torch.Generator().manual_seed(6)
    cases = [
        _random(9, (3,), torch.uint8, gen)[1:],  # rows of 3 bytes starting at byte 3
        _random(9, (8,), torch.float16, gen).reshape(-1)[1:65].reshape(8, 8),  # 16-byte rows at byte 2
        _random(5, (4, 1), torch.float32, gen),  # a dim of size one
        _random(9, (6,), torch.float64, gen)[4:5],  # one row, within a larger tensor
        _random(9, (), torch.int64, gen)[3:],  # one element per row, at byte 24
    ]
    for src in cases:
        assert src.is_contiguous()
        dest = _poisoned(16, tuple(src.shape[1:]), src.dtype)
        tables.clear()
        write_rows_triton([dest], [src], 3)
        address = dest.data_ptr()
        want, _ = _source_entry(src, src.shape[0], address, 0, address)
        assert list(tables[0]) == want, (src.shape, src.dtype, src.data_ptr() % 16)


def test_the_validated_entry_writes_through_the_kernel_and_refuses_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    dests = [_poisoned(5, (2,), torch.float32), _poisoned(5, (), torch.int64)]
    before = [_byte_copy(t) for t in dests]
    good = [_random(3, (2,), torch.float32, gen), _random(3, (), torch.int64, gen)]
    bad = [
        ([good[0].double(), good[1]], DTypeMismatchError, "dtype"),
        ([good[0][:, :1], good[1]], SchemaMismatchError, "rows of shape"),
        ([good[0], good[1][:2]], SchemaMismatchError, "rows"),
        ([_random(6, (2,), torch.float32, gen), _random(6, (), torch.int64, gen)], SchemaMismatchError, "do not fit"),
        ([good[0]], ValueError, "1 sources for 2 destinations"),
    ]
    for sources, error, match in bad:
        with pytest.raises(error, match=match):
            write_rows(dests, sources, 1, backend="triton")
        assert all(torch.equal(_bytes(d), _bytes(b)) for d, b in zip(dests, before))
    with pytest.raises(ValueError, match="first"):
        write_rows(dests, good, 5, backend="triton")
    with count_device_work() as work:
        write_rows(dests, good, 4, backend="triton")
    assert work.kernels == {"triton:_write_rows_kernel": 1}
    write_rows_ref(before, good, 4)
    assert all(torch.equal(_bytes(d), _bytes(b)) for d, b in zip(dests, before))


def test_the_launcher_refuses_a_storage_field_that_is_not_contiguous():
    gen = torch.Generator().manual_seed(3)
    dest = _poisoned(4, (6,), torch.float32)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        write_rows_triton([dest], [_random(2, (3,), torch.float32, gen)], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_large_write_on_the_gpu_matches_the_twin():
    fields = [((), torch.bool), ((84, 84), torch.uint8), ((17,), torch.float32), ((2,), torch.int64)]
    _check(capacity=200_003, count=150_001, first=120_000, fields=fields, seed=5)


def test_a_table_a_capture_used_outlives_the_tables_of_later_writes(monkeypatch):
    """Every batch address gives the write a new pointer table; the recent ones are kept, the
    oldest dropped. A table asked for during a CUDA graph capture is read at every replay, which
    never passes through the cache: it is kept for good, whatever comes after."""
    from gpubuf_kernels import _tables

    _tables.clear()
    device = _device()
    monkeypatch.setattr(_tables, "_capturing", lambda d: True)
    captured = _tables.device_table((1, 2, 3, 4, 5, 6, 7, 8), 8, device)
    monkeypatch.setattr(_tables, "_capturing", lambda d: False)
    gen = torch.Generator().manual_seed(4)
    dest = _poisoned(8, (2,), torch.float32)
    for _ in range(_tables._CACHE_SIZE + 5):  # a new batch tensor each time: a new table each time
        write_rows_triton([dest], [_random(3, (2,), torch.float32, gen).clone()], 2)
    first = _tables.device_table((9, 9, 9, 9, 9, 9, 9, 9), 8, device)
    assert len(_tables._CACHE) <= _tables._CACHE_SIZE
    assert _tables.device_table((1, 2, 3, 4, 5, 6, 7, 8), 8, device) is captured
    for i in range(_tables._CACHE_SIZE):
        _tables.device_table((i, 0, 0, 0, 0, 0, 0, 0), 8, device)
    assert _tables.device_table((9, 9, 9, 9, 9, 9, 9, 9), 8, device) is not first  # an ordinary one was dropped
    assert _tables.device_table((1, 2, 3, 4, 5, 6, 7, 8), 8, device) is captured
    _tables.clear()
