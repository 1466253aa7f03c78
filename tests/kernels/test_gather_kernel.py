"""Triton row gather vs its torch twin, bit for bit.

Runs on CUDA when present, else on CPU tensors through Triton's interpreter (set up by
tests/conftest.py). The interpreter runs programs one after another, so sizes stay small here;
the ``gpu``-marked tests at the end cover large storages.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.gather_rows import gather_rows, gather_rows_ref
from gpubuf_kernels import gather as gather_mod
from gpubuf_kernels._config import GATHER_ROWS
import triton

from gpubuf_kernels._launch import cdiv, next_power_of_2, unit_bytes
from gpubuf_kernels.gather import gather_rows_triton
from helpers import DTYPES

BLOCK = GATHER_ROWS["BLOCK_ROWS"]

# Row byte sizes across these and the dtypes above hit every unit: 1, 2, 4, 8 and 16 bytes.
TRAILS = [(), (1,), (3,), (5, 7), (33,), (2, 4)]

# Outputs are filled with this byte before a gather. Sources are drawn from bytes below it (bools
# from 0/1), so a byte of the poison left in an output is a byte the kernel did not write.
POISON = 0xAB


def _source(rows: int, trail: tuple[int, ...], dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """Random ``[rows, *trail]`` tensor of ``dtype`` whose bytes never equal POISON.

    Floats come from raw bytes, so NaNs with payloads, infinities and -0.0 show up and the
    comparison below must be bitwise.
    """
    if dtype == torch.bool:
        return torch.randint(0, 2, (rows, *trail), generator=gen).bool().to(device)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, POISON, (rows, *trail, size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(rows, *trail).to(device)


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t, memory_format=torch.contiguous_format)
    _bytes(out).fill_(POISON)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a contiguous tensor, as a flat uint8 view."""
    return t.reshape(-1).view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape and got.device == want.device
    assert got.is_contiguous()
    # Bitwise: torch.equal would call two NaNs different and -0.0 equal to 0.0.
    assert torch.equal(_bytes(got), _bytes(want.contiguous()))


def _assert_fully_written(out: torch.Tensor) -> None:
    if out.dtype == torch.bool:
        assert bool((_bytes(out) <= 1).all()), "bool output holds poison"
    else:
        assert not bool((_bytes(out) == POISON).any()), "output holds poison bytes: some element was not written"


def _index(values, device, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


class _LaunchCounter:
    """Stands in for the jitted kernel and counts launches (kernel[grid](...))."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch):
    counter = _LaunchCounter(gather_mod._gather_rows_kernel)
    monkeypatch.setattr(gather_mod, "_gather_rows_kernel", counter)
    return counter


# ---------------------------------------------------------------------------------------------
# Dtypes, shapes, unit widths
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_trailing_shape(dtype, kernel_device, gen):
    sources = [_source(7, trail, dtype, kernel_device, gen) for trail in TRAILS]
    index = _index([6, 0, 3, 3, 1, 6, 0, 2, 5, 4], kernel_device)
    got = gather_rows(sources, index, backend="triton")
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)


def test_all_dtypes_and_shapes_in_one_launch(kernel_device, gen, launches):
    sources = [_source(7, trail, dtype, kernel_device, gen) for dtype in DTYPES for trail in TRAILS]
    index = _index([0, 6, 6, 2, 5], kernel_device)
    got = gather_rows(sources, index, backend="triton")
    assert launches.launches == 1
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)


@pytest.mark.parametrize(
    "row_bytes",
    [1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 17, 24, 31, 32, 40, 48, 1000, 1024, 1025, 2056],
)
def test_row_byte_sizes(row_bytes, kernel_device, gen):
    """Rows that are and are not multiples of 2/4/8/16 bytes, and rows longer than one loop step."""
    sources = [_source(7, (row_bytes,), torch.uint8, kernel_device, gen)]
    if row_bytes % 4 == 0:
        sources.append(_source(7, (row_bytes // 4,), torch.float32, kernel_device, gen))
    index = _index([3, 0, 6, 3], kernel_device)
    outs = [_poisoned_like(gather_rows_ref(sources, index)[i]) for i in range(len(sources))]
    got = gather_rows(sources, index, outs, backend="triton")
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)
        _assert_fully_written(g)


@pytest.mark.parametrize(
    "row_bytes, src_addr, out_addr, stride, unit",
    [
        (64, 0, 64, 64, 16),
        (48, 16, 32, 48, 16),
        (24, 0, 0, 24, 8),  # 24 bytes: not a multiple of 16
        (32, 8, 0, 32, 8),  # source only 8-byte aligned
        (32, 0, 0, 40, 8),  # row stride of 40 bytes breaks 16-byte alignment of odd rows
        (12, 0, 0, 12, 4),
        (16, 0, 4, 16, 4),  # output only 4-byte aligned
        (6, 0, 0, 6, 2),
        (16, 1, 0, 16, 1),  # odd source address
        (3, 0, 0, 3, 1),
        (16, 0, 0, 0, 16),  # stride 0 (an expanded source)
    ],
)
def test_unit_choice(row_bytes, src_addr, out_addr, stride, unit):
    assert unit_bytes(row_bytes, src_addr, out_addr, stride) == unit


def test_launch_arithmetic_matches_triton():
    """The launchers' integer helpers give what Triton's constexpr functions give."""
    for a in range(0, 300):
        for b in range(1, 40):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in list(range(0, 2100)) + [2**31 - 1, 2**31, 2**31 + 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n)


def test_a_kept_plan_follows_its_sources(kernel_device, gen):
    """The launcher keeps the plan of the last sources: the same sources gather right again, and a
    source replaced in place (other storage, other row width) or another set of sources is
    planned anew, never read through the old plan."""
    a = _source(50, (3,), torch.float32, kernel_device, gen)
    b = _source(50, (), torch.int64, kernel_device, gen)
    index = _index([3, 49, 0, 7, 7], kernel_device)
    for _ in range(2):
        got = gather_rows_triton([a, b], index)
        for out, src in zip(got, (a, b)):
            _assert_same(out, gather_rows_ref([src], index)[0])
    # The same tensor objects, new memory and a wider row.
    a.set_(_source(60, (5,), torch.float32, kernel_device, gen))
    b.set_(_source(60, (2,), torch.int64, kernel_device, gen))
    got = gather_rows_triton([a, b], index)
    assert [tuple(g.shape) for g in got] == [(5, 5), (5, 2)]
    for out, src in zip(got, (a, b)):
        _assert_same(out, gather_rows_ref([src], index)[0])
    # Another set of sources, then back to the first.
    c = _source(50, (7,), torch.uint8, kernel_device, gen)
    _assert_same(gather_rows_triton([c], index)[0], gather_rows_ref([c], index)[0])
    got = gather_rows_triton([a, b], index)
    for out, src in zip(got, (a, b)):
        _assert_same(out, gather_rows_ref([src], index)[0])


def test_a_kept_plan_does_not_keep_its_sources_alive(kernel_device, gen):
    """The launcher remembers its last sources weakly: a dropped storage's leaves are freed."""
    import gc
    import weakref

    a = _source(30, (4,), torch.float32, kernel_device, gen)
    gather_rows_triton([a], _index([1, 2], kernel_device))
    alive = weakref.ref(a)
    del a
    gc.collect()
    assert alive() is None


def test_a_kept_plan_still_checks_the_index(kernel_device, gen):
    """With the sources' plan kept, a malformed index is still refused before any launch."""
    a = _source(20, (2,), torch.float32, kernel_device, gen)
    gather_rows_triton([a], _index([1, 2], kernel_device))
    with pytest.raises(TypeError, match="1-D int64 or int32"):
        gather_rows_triton([a], torch.zeros(2, 2, dtype=torch.int64, device=kernel_device))
    with pytest.raises(TypeError, match="1-D int64 or int32"):
        gather_rows_triton([a], torch.zeros(2, dtype=torch.float32, device=kernel_device))


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 8])
def test_misaligned_source_and_output(offset, kernel_device, gen):
    """Sources and outputs that start `offset` bytes into an allocation fall back to narrower units."""
    index = _index([4, 1, 1, 6, 0], kernel_device)
    flat = _source(7 * 32 + offset, (), torch.uint8, kernel_device, gen)
    src = flat[offset:].view(7, 32)  # 32-byte rows at an address that is only `offset`-aligned
    out_flat = torch.full((5 * 32 + offset,), POISON, dtype=torch.uint8, device=kernel_device)
    out = out_flat[offset:].view(5, 32)
    wide = _source(7 * 4 + 1, (), torch.int64, kernel_device, gen)[1:].view(7, 4)  # 8-aligned only
    wide_out = torch.empty(5, 4, dtype=torch.int64, device=kernel_device)
    got = gather_rows([src, wide], index, [out, wide_out], backend="triton")
    _assert_same(got[0], gather_rows_ref([src], index)[0])
    _assert_same(got[1], gather_rows_ref([wide], index)[0])
    assert bool((out_flat[:offset] == POISON).all()), "bytes before the output were overwritten"


# ---------------------------------------------------------------------------------------------
# Indices and sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_rows", [1, 7])
@pytest.mark.parametrize("batch", [1, BLOCK - 1, BLOCK, BLOCK + 1])
def test_batch_sizes_around_the_row_block(n_rows, batch, kernel_device, gen):
    sources = [
        _source(n_rows, (3,), torch.float32, kernel_device, gen),
        _source(n_rows, (5, 7), torch.uint8, kernel_device, gen),
        _source(n_rows, (), torch.int64, kernel_device, gen),
        _source(n_rows, (4,), torch.bfloat16, kernel_device, gen),
    ]
    # Unsorted, duplicated, and always hitting the first and the last row.
    perm = torch.randint(0, n_rows, (batch,), generator=gen)
    perm[0] = n_rows - 1
    if batch > 1:
        perm[-1] = 0
    index = perm.to(kernel_device)
    want = gather_rows_ref(sources, index)
    outs = [_poisoned_like(w) for w in want]
    got = gather_rows(sources, index, outs, backend="triton")
    for g, o, w in zip(got, outs, want):
        assert g is o
        _assert_same(g, w)
        _assert_fully_written(g)


def test_int32_index(kernel_device, gen):
    sources = [_source(7, (5,), torch.float16, kernel_device, gen), _source(7, (2,), torch.int64, kernel_device, gen)]
    index = _index([6, 5, 0, 0, 3], kernel_device, dtype=torch.int32)
    got = gather_rows(sources, index, backend="triton")
    for g, w in zip(got, gather_rows_ref(sources, index.long())):
        _assert_same(g, w)


def test_non_contiguous_index(kernel_device, gen):
    sources = [_source(7, (3,), torch.int16, kernel_device, gen)]
    index = _index([6, 9, 5, 9, 0, 9, 2, 9], kernel_device)[::2].remainder(7)
    got = gather_rows(sources, index, backend="triton")
    _assert_same(got[0], gather_rows_ref(sources, index)[0])


def test_empty_batch_launches_nothing(kernel_device, gen, launches):
    sources = [_source(7, (3,), torch.float32, kernel_device, gen), _source(7, (), torch.bool, kernel_device, gen)]
    got = gather_rows(sources, _index([], kernel_device), backend="triton")
    assert launches.launches == 0
    assert [tuple(g.shape) for g in got] == [(0, 3), (0,)]
    assert [g.dtype for g in got] == [torch.float32, torch.bool]


def test_zero_width_rows(kernel_device, gen, launches):
    sources = [torch.empty(7, 0, device=kernel_device), torch.empty(7, 3, 0, dtype=torch.int8, device=kernel_device)]
    got = gather_rows(sources, _index([1, 2], kernel_device), backend="triton")
    assert launches.launches == 0
    assert [tuple(g.shape) for g in got] == [(2, 0), (2, 3, 0)]


def test_out_of_range_rows_are_left_unwritten(kernel_device, gen):
    """Without the bounds check the kernel still never reads outside the source."""
    src = _source(7, (6,), torch.int32, kernel_device, gen)
    index = _index([2, 7, -1, 6, 100], kernel_device)
    out = _poisoned_like(torch.empty(5, 6, dtype=torch.int32, device=kernel_device))
    gather_rows([src], index, [out], backend="triton", check_bounds=False)
    assert torch.equal(out[0], src[2]) and torch.equal(out[3], src[6])
    for row in (1, 2, 4):
        assert bool((out[row].reshape(-1).view(torch.uint8) == POISON).all())


# ---------------------------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------------------------


def test_row_contiguous_views_go_through_the_kernel(kernel_device, gen, monkeypatch):
    base = _source(14, (8,), torch.float32, kernel_device, gen)
    sources = [
        base[::2],  # row stride of 16 elements
        base[:7, 1:4],  # 3-element rows inside 8-element rows
        base[3:10, 5],  # one element per row, row stride 8
        _source(1, (5,), torch.int16, kernel_device, gen).expand(7, 5),  # row stride 0
    ]
    # The torch fallback must not be taken for these.
    def no_fallback(*args, **kwargs):
        raise AssertionError("index_select fallback used for a row-contiguous source")

    monkeypatch.setattr(gather_mod.torch, "index_select", no_fallback)
    index = _index([6, 0, 2, 2, 5], kernel_device)
    got = gather_rows(sources, index, backend="triton")
    monkeypatch.undo()
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)


def test_sources_with_scattered_rows_are_still_gathered(kernel_device, gen):
    sources = [
        _source(7, (4, 3), torch.float64, kernel_device, gen).transpose(1, 2),  # rows not dense
        _source(3, (7,), torch.uint8, kernel_device, gen).t(),  # [7, 3], column-major rows
        torch.randn(7, 4, generator=gen, dtype=torch.complex64).to(kernel_device).conj(),  # lazy conj
        _source(7, (4,), torch.int32, kernel_device, gen),  # a dense one beside them
    ]
    index = _index([6, 1, 1, 0, 3], kernel_device)
    got = gather_rows(sources, index, backend="triton")
    for g, w in zip(got, gather_rows_ref(sources, index)):
        assert g.is_contiguous()
        assert torch.equal(g.resolve_conj(), w.resolve_conj())


def test_launcher_allocates_contiguous_outputs(kernel_device, gen):
    sources = [_source(14, (2, 3), torch.float32, kernel_device, gen)[::2]]
    got = gather_rows_triton(sources, _index([1, 6], kernel_device))
    assert got[0].is_contiguous() and got[0].shape == (2, 2, 3)
    _assert_same(got[0], sources[0][[1, 6]])


def test_outputs_it_allocates_share_one_buffer_and_keep_their_own_bytes(kernel_device, gen):
    """Launcher-allocated outputs are views of one buffer, each at a 16-byte boundary, none overlapping."""
    sources = [_source(9, trail, dtype, kernel_device, gen) for dtype, trail in
               [(torch.bool, ()), (torch.float64, (3,)), (torch.uint8, (5,)), (torch.int16, (1,)), (torch.float32, (33,))]]
    index = _index([8, 0, 4, 4, 7, 1, 2], kernel_device)
    got = gather_rows_triton(sources, index)
    base = got[0].untyped_storage().data_ptr()
    spans = []
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)
        assert g.untyped_storage().data_ptr() == base
        assert (g.data_ptr() - base) % gather_mod.OUT_ALIGN == 0
        spans.append((g.data_ptr(), g.data_ptr() + g.numel() * g.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("target", [1, 3, 4096])
def test_every_spread_of_sources_and_columns_over_programs(target, kernel_device, gen, monkeypatch):
    """One program for all sources, a few, or one per source and column step: the same bytes."""
    monkeypatch.setitem(GATHER_ROWS, "TARGET_PROGRAMS", target)
    sources = [
        _source(7, (300,), torch.float32, kernel_device, gen),  # 1,200-byte rows: several column steps
        _source(7, (), torch.bool, kernel_device, gen),
        _source(7, (3,), torch.uint8, kernel_device, gen),
        _source(7, (2,), torch.int64, kernel_device, gen),
    ]
    index = _index([6, 0, 3, 3, 2], kernel_device)
    want = gather_rows_ref(sources, index)
    outs = [_poisoned_like(w) for w in want]
    for g, w in zip(gather_rows_triton(sources, index, outs), want):
        _assert_same(g, w)
        _assert_fully_written(g)


def test_a_layout_builds_its_pointer_table_once(kernel_device, gen, monkeypatch):
    """Batches of any size from the same sources reuse one table: no host-to-device copy after the first."""
    from gpubuf_kernels import _tables

    made = []
    real = _tables._make
    monkeypatch.setattr(_tables, "_make", lambda *a: made.append(a[0]) or real(*a))
    _tables.clear()
    sources = [_source(7, (3,), torch.float32, kernel_device, gen), _source(7, (), torch.bool, kernel_device, gen)]
    for index in ([1, 2], [6, 6, 0], [0, 1, 2, 3, 4, 5, 6, 0, 1]):
        got = gather_rows_triton(sources, _index(index, kernel_device))
        for g, w in zip(got, gather_rows_ref(sources, _index(index, kernel_device))):
            _assert_same(g, w)
    assert len(made) == 1


# ---------------------------------------------------------------------------------------------
# The launcher's own checks (gather_rows checks first; the launcher is public too)
# ---------------------------------------------------------------------------------------------


def test_launcher_rejects_bad_arguments(kernel_device, gen):
    src = _source(7, (3,), torch.float32, kernel_device, gen)
    idx = _index([0, 1], kernel_device)
    with pytest.raises(ValueError, match="at least one source"):
        gather_rows_triton([], idx)
    with pytest.raises(TypeError, match="index"):
        gather_rows_triton([src], idx.float())
    with pytest.raises(TypeError, match="index"):
        gather_rows_triton([src], idx[None])
    with pytest.raises(TypeError, match="source #0"):
        gather_rows_triton([src.tolist()], idx)
    with pytest.raises(ValueError, match="rows"):
        gather_rows_triton([src, src[:6]], idx)
    with pytest.raises(ValueError, match="scalar"):
        gather_rows_triton([src[0, 0]], idx)
    with pytest.raises(TypeError, match="dtype"):
        gather_rows_triton([src], idx, [torch.empty(2, 3, dtype=torch.float64, device=kernel_device)])
    with pytest.raises(ValueError, match="shape"):
        gather_rows_triton([src], idx, [torch.empty(3, 3, device=kernel_device)])
    with pytest.raises(ValueError, match="contiguous"):
        gather_rows_triton([src], idx, [torch.empty(3, 2, device=kernel_device).t()])
    with pytest.raises(ValueError, match="outputs"):
        gather_rows_triton([src], idx, [])
    with pytest.raises(ValueError, match="meta"):
        gather_rows_triton([src, torch.empty(7, device="meta")], idx)


def test_launcher_rejects_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        gather_rows_triton([torch.zeros(3, 2)], torch.tensor([0]))


# ---------------------------------------------------------------------------------------------
# Large storages (CUDA only)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_large_mixed_gather_on_cuda():
    gen = torch.Generator().manual_seed(7)
    n, batch, dev = 1_000_000, 65_536, torch.device("cuda")
    sources = [
        _source(n, (17,), torch.float32, dev, gen),  # 68-byte rows: 4-byte units
        _source(n, (4, 8), torch.bfloat16, dev, gen),  # 64-byte rows: 16-byte units
        _source(n, (3,), torch.int64, dev, gen),  # 24-byte rows: 8-byte units
        _source(n, (), torch.float32, dev, gen),
        _source(n, (), torch.bool, dev, gen),
        _source(n, (5,), torch.uint8, dev, gen),  # odd rows: bytes
        _source(n, (3, 7), torch.float16, dev, gen),  # 42-byte rows: 2-byte units
    ]
    index = torch.randint(0, n, (batch,), generator=gen).to(dev)
    index[:3] = torch.tensor([0, n - 1, n - 1], device=dev)
    want = gather_rows_ref(sources, index)
    outs = [_poisoned_like(w) for w in want]
    got = gather_rows(sources, index, outs, backend="triton", check_bounds=False)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        _assert_same(g, w)
        _assert_fully_written(g)


@pytest.mark.gpu
def test_offsets_past_2_31_bytes_on_cuda():
    """Source offsets of N x row bytes > 2^31 need 64-bit address arithmetic in the kernel."""
    dev = torch.device("cuda")
    n, row = 1_100_000, 2048  # 2.25 GB of uint8
    src = torch.empty(n, row, dtype=torch.uint8, device=dev)
    src[-4:] = torch.arange(4 * row, device=dev).reshape(4, row).remainder(251).to(torch.uint8)
    src[:1] = 7
    index = torch.tensor([n - 1, 0, n - 3, n - 1], device=dev)
    got = gather_rows([src], index, backend="triton")[0]
    assert torch.equal(got, src[index])


@pytest.mark.gpu
def test_a_warm_gather_on_cuda_is_one_launch_without_copies_or_syncs():
    from gpubuf.ops.device_work import count_device_work

    gen = torch.Generator().manual_seed(9)
    dev = torch.device("cuda")
    sources = [_source(1000, (32,), torch.float32, dev, gen), _source(1000, (), torch.bool, dev, gen),
               _source(1000, (7,), torch.int64, dev, gen)]
    index = torch.randint(0, 1000, (256,), generator=gen).to(dev)
    gather_rows_triton(sources, index)  # builds and copies the pointer table
    with count_device_work("cuda") as work:
        got = gather_rows_triton(sources, index)
    assert (work.launches, work.triton_launches, work.host_to_device, work.host_syncs) == (1, 1, 0, 0), work.summary()
    for g, w in zip(got, gather_rows_ref(sources, index)):
        _assert_same(g, w)
