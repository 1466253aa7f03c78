"""Paths of the compiled CPU decode that the small tables of the other tests do not reach.

Rows well inside a large arena are verified without clamped reads; sampled reference rows are
read back from the output instead of being decoded again; duplicates are copied right after
their row is decoded; checksums are summed a block at a time. Each is compared with the twin.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from codec_helpers import make_table
from gpubuf.codec.errors import CorruptRowError
from gpubuf.ops.decode_rows import RowTable, decode_rows, decode_rows_ref

pytest.importorskip("numba")

PAD = 70_000  # more than any parse of these rows can reach past their start


def _padded(table: RowTable, gen: torch.Generator) -> RowTable:
    """The table with random bytes after its arena, so that no row sits near the arena's end."""
    pad = torch.randint(0, 256, (PAD,), dtype=torch.uint8, generator=gen)
    return RowTable(
        torch.cat([table.arena, pad]), table.offsets.clone(), table.lengths.clone(), table.checksums.clone(),
        None if table.refs is None else table.refs.clone(), table.geometry,
    )


def _tables(gen: torch.Generator) -> dict[str, tuple[RowTable, torch.Tensor]]:
    """Keyed frames (reference rows sampled, unsampled and duplicated), stacks and wide lines."""
    frames = torch.randint(0, 3, (9, 12, 40), dtype=torch.uint8, generator=gen)
    frames[:, 3:8] = 9
    frames[:, 9, 5:30] = torch.arange(9, dtype=torch.uint8)[:, None]
    keys = torch.tensor([-1, 0, 0, -1, 3, 3, -1, 6, 6])
    tables = {
        # Key 3 sampled (twice) before its rows, key 0 and 6 only as references; duplicates.
        "keys": (make_table(frames, keys=keys), torch.tensor([5, 3, 1, 4, 4, 3, 8, 2, 7, 5])),
    }
    wide = torch.zeros(4, 3, 300, dtype=torch.int16)
    wide[:, :, 20:280] = torch.randint(0, 4, (4, 1, 1), generator=gen).to(torch.int16)
    wide[1, 1, ::9] = 700
    wide_keys = torch.tensor([-1, 0, -1, 2])
    tables["wide_int16_keys"] = (make_table(wide, keys=wide_keys), torch.tensor([3, 1, 0, 1, 2]))
    stacks = torch.randint(0, 2, (6, 3, 7, 16), dtype=torch.uint8, generator=gen)
    stacks[:, 1] = stacks[:, 0]
    stacks[2, 1, 3] += 1
    tables["stacked"] = (make_table(stacks), torch.tensor([2, 0, 5, 2, 4]))
    return tables


def _corrupt_rows(table: RowTable, gen: torch.Generator) -> RowTable:
    """One to three changes to the rows' own bytes (not the padding) or their table entries."""
    bad = RowTable(
        table.arena.clone(), table.offsets.clone(), table.lengths.clone(), table.checksums.clone(),
        None if table.refs is None else table.refs.clone(), table.geometry,
    )
    n_rows = bad.offsets.shape[0]
    used = int((table.offsets + table.lengths).max())
    for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
        what = int(torch.randint(0, 10, (1,), generator=gen))
        row = int(torch.randint(0, n_rows, (1,), generator=gen))
        if what < 7:
            pos = int(torch.randint(0, used, (1,), generator=gen))
            bad.arena[pos] ^= int(torch.randint(1, 256, (1,), generator=gen))
        elif what == 7:
            bad.lengths[row] += int(torch.randint(-4, 5, (1,), generator=gen))
        elif what == 8:
            bad.offsets[row] += int(torch.randint(-3, 4, (1,), generator=gen))
        else:
            bad.checksums[row] ^= 1 << int(torch.randint(0, 31, (1,), generator=gen))
    return bad


@pytest.mark.parametrize("padded", [False, True], ids=["at_end", "inside"])
def test_kernel_matches_twin_on_keys_and_duplicates(padded):
    gen = torch.Generator().manual_seed(21)
    for name, (table, index) in _tables(gen).items():
        if padded:
            table = _padded(table, gen)
        want = decode_rows_ref(table, index)
        got = decode_rows(table, index, backend="numba")
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


@pytest.mark.parametrize("verify", [True, False])
def test_kernel_rejects_what_the_twin_rejects_inside_a_large_arena(verify):
    """Corruptions of rows far from the arena's end: the kernel's error is the twin's, ``out`` untouched."""
    gen = torch.Generator().manual_seed(31 + verify)
    for name, (table, index) in _tables(gen).items():
        g = table.geometry
        for case in range(150):
            bad = _padded(_corrupt_rows(table, gen), gen)
            try:
                want, error = decode_rows_ref(bad, index, verify=verify), None
            except CorruptRowError as e:
                want, error = None, e
            out = torch.zeros((index.numel(), *g.shape), dtype=g.dtype)
            out.view(torch.uint8).fill_(0x5A)
            if error is None:
                got = decode_rows(bad, index, out, verify=verify, backend="numba")
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, case)
                continue
            with pytest.raises(CorruptRowError) as info:
                decode_rows(bad, index, out, verify=verify, backend="numba")
            assert str(info.value) == str(error) and info.value.rows == error.rows, (name, case)
            assert bool((out.view(torch.uint8) == 0x5A).all()), (name, case)


@pytest.mark.parametrize("n", [0, 1, 7, 5551, 5552, 5553, 11105, 65536, 200_003])
def test_block_checksum_is_adler32(n):
    from gpubuf_kernels.cpu.codec import _adler32

    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, n + 8, dtype=np.uint8)
    if n % 2:
        data[:] = 255  # the largest sums
    for suffix in (-1, 0, 12345, 2**31 - 1):
        want = zlib.adler32(data[3 : 3 + n].tobytes() + suffix.to_bytes(4, "little", signed=True))
        assert _adler32(data, 3, n, suffix) == want


@pytest.mark.parametrize("n_rows", [50, 70_000, 300_000])
@pytest.mark.parametrize("has_refs", [False, True])
def test_needed_rows_found_by_marks_and_by_sorting(n_rows, has_refs):
    """Small tables mark their needed rows; a table far larger than the batch sorts them. Both
    give the sorted distinct rows and every position's slots."""
    from gpubuf_kernels.cpu.codec import _needed_rows

    rng = np.random.default_rng(n_rows)
    index = rng.integers(0, n_rows, 40)
    index[5] = index[9] = index[2]  # duplicates
    index[7] = n_rows - 1  # the last row: the marks are read a word at a time
    refs = np.where(rng.random(n_rows) < 0.5, rng.integers(0, n_rows, n_rows), -1).astype(np.int32)
    refs[index[3]] = n_rows + 4  # a reference outside the table: no slot
    tab, row_slot, key, key_slot = _needed_rows(index, refs, has_refs, n_rows)

    keys = refs[index].astype(np.int64) if has_refs else np.full(len(index), -1)
    in_table = (keys >= 0) & (keys < n_rows)
    want_tab = np.unique(np.concatenate([index, keys[in_table]]))
    assert np.array_equal(tab, want_tab)
    assert np.array_equal(tab[row_slot], index)
    assert np.array_equal(key, keys)
    assert np.array_equal(key_slot >= 0, in_table)
    assert np.array_equal(tab[key_slot[in_table]], keys[in_table])
