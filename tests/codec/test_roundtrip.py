"""Encode then decode is the identity, bit for bit, for every dtype and edge row, on both CPU paths
(the torch twin and the compiled kernel)."""

from __future__ import annotations

import zlib

import pytest
import torch

from gpubuf.codec.checksum import adler32_bytes, adler32_ranges, adler32_ranges_host, as_uint32
from gpubuf.ops.encode_rows import encode_planes
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.decode_rows import decode_rows, decode_rows_ref

from codec_helpers import decode, make_table
from helpers import DTYPES

SHAPES = [(), (1,), (7,), (3, 5), (2, 4, 9), (4, 1, 1), (1, 300), (2, 3, 513)]


def _random(n: int, shape, dtype, gen) -> torch.Tensor:
    """Raw random bytes viewed as ``dtype`` (NaN payloads, infinities, -0.0 included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n, *shape), generator=gen).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n, *shape, size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(n, *shape)


def _structured(n: int, shape, dtype, gen) -> torch.Tensor:
    """Rows with flat areas, repeated lines and a few distinct values: what the codec is for."""
    x = _random(n, shape, dtype, gen)
    if x.numel() == 0:
        return x
    flat = x.reshape(n, -1)
    flat[:, : flat.shape[1] // 2] = flat[:, :1]
    if n > 1:
        flat[1] = flat[0]
    return flat.view(x.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_every_dtype(dtype, shape, cpu_backend):
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    for rows in (_random(5, shape, dtype, gen), _structured(5, shape, dtype, gen)):
        table = make_table(rows)
        out = decode(table, torch.tensor([4, 0, 2, 2, 1, 3]), cpu_backend)
        _assert_bitwise(out, rows[[4, 0, 2, 2, 1, 3]])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_edge_rows(dtype, cpu_backend):
    """All-equal, full-range noise, single element, empty trailing dims and scalar items."""
    gen = torch.Generator().manual_seed(1)
    cases = {
        "constant": torch.full((3, 4, 84, 84), 7, dtype=torch.uint8)
        if dtype == torch.uint8
        else torch.full((3, 4, 21, 84), 1.5 if dtype.is_floating_point else (True if dtype == torch.bool else 9), dtype=dtype),
        "noise": _random(3, (4, 21, 84), dtype, gen),
        "single": _random(4, (1,), dtype, gen),
        "scalar": _random(4, (), dtype, gen),
        "empty_last": torch.empty(3, 4, 0, dtype=dtype),
        "empty_middle": torch.empty(3, 0, 5, dtype=dtype),
        "wide_lines": _structured(2, (2, 700), dtype, gen),
    }
    for name, rows in cases.items():
        table = make_table(rows)
        index = torch.arange(rows.shape[0]).flip(0)
        _assert_bitwise(decode(table, index, cpu_backend), rows[index])
        if name == "constant":
            # One mode table, one count byte and one value per plane's first line.
            assert int(table.lengths.max()) < rows[0].numel() * rows.element_size() // 100
        if name == "noise":
            # Incompressible rows are stored raw: no byte beyond the data.
            g = table.geometry
            assert int(table.lengths.max()) <= g.raw_bytes


def test_runs_split_every_256_bytes(cpu_backend):
    """A constant line wider than 256 bytes still decodes (runs restart at multiples of 256)."""
    rows = torch.zeros(2, 1, 1000, dtype=torch.uint8)
    rows[1, 0, 300:700] = 5
    rows[1, 0, 256] = 9
    table = make_table(rows)
    assert int(table.lengths.max()) < 40
    _assert_bitwise(decode(table, torch.tensor([0, 1]), cpu_backend), rows)


def test_real_frames_stacked_and_with_key_frames(atari, cpu_backend):
    frames = torch.from_numpy(atari["frames"][:120])
    from gpubuf.ops.match_frames import stack_indices

    stacks = frames[torch.from_numpy(stack_indices(atari["episode_start"][:120]))]
    table = make_table(stacks)  # planes 1..3 coded against plane 0 of the same row
    index = torch.randint(0, 120, (64,), generator=torch.Generator().manual_seed(0))
    _assert_bitwise(decode(table, index, cpu_backend), stacks[index])
    assert float(table.lengths.float().mean()) < stacks[0].numel() / 8

    # Frames against key frames every 4 frames: depth-one references.
    keys = torch.arange(120)
    keys = torch.where(keys % 4 == 0, -1, keys - keys % 4)
    table = make_table(frames, keys=keys)
    _assert_bitwise(decode(table, index, cpu_backend), frames[index])
    _assert_bitwise(decode_rows(table, index, backend=cpu_backend), frames[index])


def test_checksums_are_adler32_of_bytes_and_reference():
    gen = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=gen)
    starts = torch.tensor([0, 17, 100, 4000, 4999, 3])
    lengths = torch.tensor([17, 0, 3000, 1000, 1, 65])
    suffix = torch.tensor([-1, 0, 5, 2**31 - 1, -(2**31), 77], dtype=torch.int32)
    expected = [
        adler32_bytes(data[s : s + n].numpy().tobytes(), int(x))
        for s, n, x in zip(starts.tolist(), lengths.tolist(), suffix.tolist())
    ]
    assert adler32_ranges(data, starts, lengths, suffix).tolist() == expected
    assert adler32_ranges_host(data, starts, lengths, suffix).tolist() == expected
    assert adler32_ranges(data, starts, lengths).tolist() == [
        zlib.adler32(data[s : s + n].numpy().tobytes()) for s, n in zip(starts.tolist(), lengths.tolist())
    ]


def test_stored_checksums_match_zlib():
    rows = torch.randint(0, 3, (6, 2, 10, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    table = make_table(rows)
    for k in range(6):
        start, n = int(table.offsets[k]), int(table.lengths[k])
        assert int(as_uint32(table.checksums[k : k + 1])) == adler32_bytes(table.arena[start : start + n].numpy().tobytes(), -1)


def test_geometry_planes_round_trip():
    x = torch.randn(3, 2, 5, 7, dtype=torch.float64)
    g = RowGeometry.of(x.dtype, x.shape[1:])
    assert (g.planes, g.image_planes, g.height, g.width) == (16, 2, 5, 7)
    assert torch.equal(g.from_planes(g.to_planes(x)), x)


def test_encoder_prefers_free_lines():
    """A frame of one colour with one changed line costs a few bytes against its key frame."""
    key = torch.full((1, 84, 84), 87, dtype=torch.uint8)
    frame = key.clone()
    frame[0, 40, 10:14] = 200
    g = RowGeometry.of(torch.uint8, (84, 84))
    enc = encode_planes(
        g.to_planes(torch.cat([key, frame])), g, key_planes=g.to_planes(torch.cat([key, key])),
        has_key=torch.tensor([False, True]), ref_rows=torch.tensor([-1, 0], dtype=torch.int32), inrow=False,
    )
    # Key: 21 mode bytes + one RUNS line (count + value). Frame: 21 + one residual RUNS line.
    assert enc.lengths.tolist()[0] <= 24
    assert enc.lengths.tolist()[1] <= 21 + 1 + 5


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_key_rows_every_dtype(dtype, cpu_backend):
    """Rows coded against reference rows (REF lines and residuals in every byte plane), any item size."""
    gen = torch.Generator().manual_seed(21)
    rows = _structured(40, (2, 6, 10), dtype, gen)
    rows[1::2] = rows[0::2]
    changed = rows.view(torch.uint8) if dtype != torch.bool else rows
    changed[3::4, :, 2] = changed[2::4, :, 4] if dtype != torch.bool else ~changed[3::4, :, 2]
    keys = torch.arange(40)
    keys = torch.where(keys % 5 == 0, -1, keys - keys % 5)  # keys 0, 5, ... 35: more than fit one cache slot each
    for intra in (True, False):
        table = make_table(rows, keys=keys, intra_keys=intra)
        index = torch.randint(0, 40, (90,), generator=gen)
        _assert_bitwise(decode(table, index, cpu_backend), rows[index])


def test_few_rows_of_a_large_table(cpu_backend):
    """A batch far smaller than the table (the kernel then finds its distinct rows by sorting)."""
    gen = torch.Generator().manual_seed(22)
    rows = _structured(6000, (3, 4), torch.int32, gen)
    keys = torch.arange(6000)
    table = make_table(rows, keys=torch.where(keys % 3 == 0, -1, keys - keys % 3))
    for index in (torch.tensor([5999, 4, 4, 3001]), torch.randint(0, 6000, (700,), generator=gen)):
        _assert_bitwise(decode(table, index, cpu_backend), rows[index])
