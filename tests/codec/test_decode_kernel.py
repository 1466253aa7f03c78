"""Triton decode vs its torch twin, bit for bit, through the interpreter on CPU (or on CUDA).

The interpreter runs programs one after another, so rows stay small here; one test decodes two
real Atari frames against their key frame. ``gpu``-marked tests cover full-size batches. Every
case also runs the compiled CPU kernel (Numba) against the twin, where Numba is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from codec_helpers import make_table
from gpubuf.codec.errors import CorruptRowError
from gpubuf.ops.decode_rows import RowTable, decode_rows, decode_rows_ref

triton = pytest.importorskip("triton")
HAS_NUMBA = importlib.util.find_spec("numba") is not None


def _on(table: RowTable, device) -> RowTable:
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return RowTable(
        move(table.arena), move(table.offsets), move(table.lengths), move(table.checksums), move(table.refs), table.geometry
    )


def _check(table: RowTable, index: torch.Tensor, device) -> None:
    expected = decode_rows_ref(table, index)
    got = decode_rows(_on(table, device), index.to(device), backend="triton")
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got.cpu().contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
    if HAS_NUMBA:
        got = decode_rows(table, index, backend="numba")
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def _rows(n, shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 4, (n, *shape, size), generator=gen, dtype=torch.uint8)
    x = raw.view(dtype).reshape(n, *shape).clone()
    if x.numel():
        flat = x.reshape(n, -1)
        flat[:, : flat.shape[1] // 3] = flat[:, :1]
    return x


@pytest.mark.parametrize(
    "dtype,shape",
    [
        (torch.uint8, (3, 6, 10)),
        (torch.int16, (2, 5, 9)),
        (torch.float32, (4, 7)),
        (torch.bool, (3, 11)),
        (torch.uint8, ()),
        (torch.float64, (1,)),
        (torch.uint8, (2, 0, 4)),
    ],
    ids=str,
)
def test_kernel_matches_twin(dtype, shape, kernel_device):
    rows = _rows(5, shape, dtype, seed=len(shape))
    table = make_table(rows)
    _check(table, torch.tensor([4, 0, 3, 3, 1]), kernel_device)


def test_kernel_raw_rows_and_wide_lines(kernel_device):
    gen = torch.Generator().manual_seed(7)
    noise = torch.randint(0, 256, (3, 2, 5, 6), dtype=torch.uint8, generator=gen)  # stored raw
    _check(make_table(noise), torch.tensor([2, 0, 1]), kernel_device)
    wide = torch.zeros(2, 1, 2, 600, dtype=torch.uint8)
    wide[1, 0, 1, 250:520] = 3
    wide[1, 0, 0, ::7] = 1
    _check(make_table(wide), torch.tensor([1, 0]), kernel_device)


def test_kernel_key_frames(kernel_device):
    gen = torch.Generator().manual_seed(8)
    frames = torch.randint(0, 2, (6, 9, 12), dtype=torch.uint8, generator=gen)
    frames[:, 2:6] = 3
    frames[2] = frames[0]
    frames[4, 1] += 1
    keys = torch.tensor([-1, 0, 0, -1, 3, 3])
    _check(make_table(frames, keys=keys), torch.tensor([5, 1, 0, 4, 2]), kernel_device)


def test_kernel_real_atari_frames(atari, kernel_device):
    frames = torch.from_numpy(atari["frames"][300:304].copy())
    keys = torch.tensor([-1, 0, 0, 0])
    _check(make_table(frames, keys=keys), torch.tensor([3, 1]), kernel_device)


def test_kernel_detects_corruption(kernel_device):
    rows = _rows(4, (2, 6, 9), torch.uint8, seed=3)
    table = make_table(rows)
    cases = []
    bad = _on(table, "cpu")
    bad.arena = bad.arena.clone()
    bad.arena[int(table.offsets[2]) + int(table.lengths[2]) - 1] ^= 1
    cases.append((bad, "checksum"))
    bad = _on(table, "cpu")
    bad.lengths = bad.lengths.clone()
    bad.lengths[2] -= 1
    cases.append((bad, "length"))
    for bad, what in cases:
        with pytest.raises(CorruptRowError, match=what) as twin:
            decode_rows_ref(bad, torch.tensor([0, 2, 1]))
        with pytest.raises(CorruptRowError, match=what) as kern:
            decode_rows(_on(bad, kernel_device), torch.tensor([0, 2, 1], device=kernel_device), backend="triton")
        assert kern.value.rows == twin.value.rows == [1]
        if HAS_NUMBA:
            with pytest.raises(CorruptRowError) as cpu:
                decode_rows(bad, torch.tensor([0, 2, 1]), backend="numba")
            assert str(cpu.value) == str(twin.value) and cpu.value.rows == [1]


@pytest.mark.gpu
def test_kernel_full_size_batch():
    frames = torch.randint(0, 3, (512, 84, 84), dtype=torch.uint8)
    frames[:, 10:70] = 87
    keys = torch.arange(512)
    keys = torch.where(keys % 4 == 0, -1, keys - keys % 4)
    table = make_table(frames, keys=keys)
    index = torch.randint(0, 512, (4096,))
    _check(table, index, torch.device("cuda"))
