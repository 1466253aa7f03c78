"""A corrupt or truncated compressed row raises CorruptRowError on read; it never decodes silently.

Every case runs on both CPU paths (the torch twin and the compiled kernel), and a fuzz test checks
that the kernel rejects exactly what the twin rejects, with the same message and rows.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from codec_helpers import decode, make_table
from gpubuf.codec.checksum import as_int32, as_uint32, resuffix
from gpubuf.codec.errors import CorruptRowError
from gpubuf.errors import GpubufError
from gpubuf.ops.decode_rows import RowTable, decode_rows, decode_rows_ref
from helpers import switch_numba


def _rows(n=6):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 3, (n, 2, 12, 16), dtype=torch.uint8, generator=gen)
    rows[:, :, 4:8] = 1  # repeated lines, so rows are coded (not raw)
    return rows


def _clone(t: RowTable, **changes) -> RowTable:
    fields = {k: getattr(t, k) for k in ("arena", "offsets", "lengths", "checksums", "refs")}
    fields = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()}
    fields.update(changes)
    return RowTable(fields["arena"], fields["offsets"], fields["lengths"], fields["checksums"], fields["refs"], t.geometry)


def test_error_type():
    assert issubclass(CorruptRowError, GpubufError) and issubclass(CorruptRowError, ValueError)


def test_every_single_byte_flip_is_detected(cpu_backend):
    rows = _rows(3)
    table = make_table(rows)
    row = 1
    start, n = int(table.offsets[row]), int(table.lengths[row])
    assert n < rows[0].numel()  # a coded row
    for pos in range(start, start + n):
        for bit in (0, 7):
            bad = _clone(table)
            bad.arena[pos] ^= 1 << bit
            with pytest.raises(CorruptRowError) as info:
                decode(bad, torch.tensor([0, row, 2]), cpu_backend)
            assert info.value.rows == [1]
    # The untouched rows still read.
    assert torch.equal(decode(table, torch.tensor([0, 2]), cpu_backend), rows[[0, 2]])


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_rows(verify, cpu_backend):
    rows = _rows()
    table = make_table(rows)
    for cut in (1, 2, 5):
        bad = _clone(table)
        bad.lengths[3] -= cut
        with pytest.raises(CorruptRowError, match="length"):
            decode(bad, torch.tensor([3]), cpu_backend, verify=verify)
    # A length past the arena's end.
    bad = _clone(table)
    bad.lengths[5] += 10_000
    with pytest.raises(CorruptRowError, match="outside the arena"):
        decode(bad, torch.tensor([5]), cpu_backend, verify=verify)
    bad = _clone(table, arena=table.arena[: int(table.offsets[5]) + 3].clone())
    with pytest.raises(CorruptRowError):
        decode(bad, torch.tensor([5]), cpu_backend, verify=verify)


def test_bad_checksum_and_offset(cpu_backend):
    rows = _rows()
    table = make_table(rows)
    bad = _clone(table)
    bad.checksums[2] ^= 1
    with pytest.raises(CorruptRowError, match="checksum"):
        decode(bad, torch.tensor([2]), cpu_backend)
    assert torch.equal(decode(bad, torch.tensor([2]), cpu_backend, verify=False), rows[[2]])
    bad = _clone(table)
    bad.offsets[4] = -3
    with pytest.raises(CorruptRowError):
        decode(bad, torch.tensor([4]), cpu_backend)


def test_impossible_modes_are_structural_errors(cpu_backend):
    """A mode table saying UP on a first line, or REF without a reference plane, fails even unverified."""
    rows = torch.zeros(2, 1, 8, 40, dtype=torch.uint8)
    rows[:, 0, 0, 3] = 1
    table = make_table(rows)
    for forged in (0b00, 0b01):  # UP or REF for line 0
        bad = _clone(table)
        start = int(bad.offsets[0])
        bad.arena[start] = (bad.arena[start] & 0b11111100) | forged
        with pytest.raises(CorruptRowError):
            decode(bad, torch.tensor([0]), cpu_backend, verify=False)


def test_run_starts_out_of_order(cpu_backend):
    rows = torch.zeros(1, 1, 1, 40, dtype=torch.uint8)
    rows[0, 0, 0, 10:20] = 3
    rows[0, 0, 0, 30:] = 4
    table = make_table(rows)
    # Layout: 1 mode byte, 1 count byte, starts (10, 20, 30), values.
    start = int(table.offsets[0])
    assert table.arena[start + 2 : start + 5].tolist() == [10, 20, 30]
    for forged in ([20, 10, 30], [10, 10, 30], [10, 20, 45]):
        bad = _clone(table)
        bad.arena[start + 2 : start + 5] = torch.tensor(forged, dtype=torch.uint8)
        with pytest.raises(CorruptRowError, match="run starts"):
            decode(bad, torch.tensor([0]), cpu_backend, verify=False)


def test_reference_rows(cpu_backend):
    frames = torch.full((6, 10, 20), 5, dtype=torch.uint8)
    frames[:, 3, :] = torch.arange(6, dtype=torch.uint8)[:, None] * 7
    keys = torch.tensor([-1, 0, 0, -1, 3, 3])
    table = make_table(frames, keys=keys)
    assert torch.equal(decode(table, torch.arange(6), cpu_backend), frames)
    # A reference row that has a reference itself (depth two) is refused.
    bad = _clone(table)
    bad.refs[0] = 3
    bad.checksums[0] = as_int32(resuffix(as_uint32(table.checksums[:1]), table.refs[:1], bad.refs[:1]))[0]
    with pytest.raises(CorruptRowError, match="reference"):
        decode(bad, torch.tensor([1]), cpu_backend)
    # A reference out of range.
    bad = _clone(table)
    bad.refs[4] = 99
    with pytest.raises(CorruptRowError, match="reference"):
        decode(bad, torch.tensor([4]), cpu_backend)
    # A row pointed at another (valid) reference row: its checksum covers the reference number.
    bad = _clone(table)
    bad.refs[4] = 0
    with pytest.raises(CorruptRowError, match="checksum"):
        decode(bad, torch.tensor([4]), cpu_backend)
    # Corrupting a reference row fails every row that uses it.
    bad = _clone(table)
    bad.arena[int(table.offsets[3]) + int(table.lengths[3]) - 1] ^= 0x10
    with pytest.raises(CorruptRowError) as info:
        decode(bad, torch.tensor([0, 4, 1, 5, 3]), cpu_backend)
    assert info.value.rows == [1, 3, 4]


@pytest.mark.parametrize("kind", ["tensor", "frames"])
def test_storage_raises_on_corrupt_rows_and_stays_usable(kind, atari, cpu_backend, monkeypatch):
    switch_numba(monkeypatch, on=cpu_backend == "numba")
    from gpubuf.ops.match_frames import transition_indices
    from gpubuf.storages.codec_storage import CompressedTensorStorage
    from gpubuf.storages.frame_stack import FrameStackStorage

    frames = torch.from_numpy(atari["frames"][:80])
    obs_i, next_i = transition_indices(atari["episode_start"][:80])
    td = TensorDict(
        {"obs": frames[torch.from_numpy(obs_i)], "next": {"obs": frames[torch.from_numpy(next_i)]}},
        [len(obs_i)],
    )
    storage = CompressedTensorStorage(100) if kind == "tensor" else FrameStackStorage(100)
    storage._write_rows(0, td)
    n = len(storage)
    assert torch.equal(storage.get(torch.arange(n))["obs"], td["obs"])
    store = storage._stores[0] if kind == "tensor" else storage._frames
    row = int(store.lengths.argmax())
    victim = int(store.offsets[row]) + 25
    store.arena[victim] ^= 0x44
    with pytest.raises(CorruptRowError) as err:
        storage.get(torch.arange(n))
    if kind == "tensor":  # one stored row per item: the error names it
        assert err.value.rows == [row]
    store.arena[victim] ^= 0x44
    assert torch.equal(storage.get(torch.arange(n))["next", "obs"], td["next", "obs"])


def test_truncated_zstd_row_is_named(atari):
    from gpubuf.storages.codec_storage import CompressedTensorStorage

    frames = torch.from_numpy(atari["frames"][:12])
    storage = CompressedTensorStorage(12)
    storage._write_rows(0, frames)
    assert storage._codec == "zstd"
    store = storage._stores[0]
    store.lengths[5] -= 1
    with pytest.raises(CorruptRowError, match="failed to decode") as err:
        storage.get(torch.tensor([2, 5, 7, 5]))
    assert err.value.rows == [1, 3]
    store.lengths[5] += 1
    assert torch.equal(storage.get(torch.tensor([2, 5])), frames[[2, 5]])


def test_nothing_is_written_on_failure(cpu_backend):
    rows = _rows()
    table = make_table(rows)
    bad = _clone(table)
    bad.arena[int(table.offsets[4]) + 3] ^= 0x21
    out = torch.full((3, *rows.shape[1:]), 0xAB, dtype=torch.uint8)
    with pytest.raises(CorruptRowError) as info:
        decode(bad, torch.tensor([0, 4, 2]), cpu_backend, out)
    assert info.value.rows == [1]
    assert bool((out == 0xAB).all())
    assert decode(bad, torch.tensor([0, 5, 2]), cpu_backend, out) is out
    assert torch.equal(out, rows[[0, 5, 2]])


# ------------------------------------------------------------------------------ kernel vs twin
def _fuzz_tables() -> dict[str, tuple[RowTable, torch.Tensor]]:
    """Tables of every layout the decode knows, with a batch (duplicates, reference rows) for each."""
    gen = torch.Generator().manual_seed(5)
    tables = {}
    stacks = _rows(8)
    stacks[:, 1] = stacks[:, 0]  # REF lines against plane 0
    stacks[3, 1, 2] += 1  # a residual line
    tables["stacked"] = (make_table(stacks), torch.tensor([3, 0, 7, 3, 5, 1]))
    frames = torch.full((8, 10, 20), 5, dtype=torch.uint8)
    frames[:, 3, :] = torch.arange(8, dtype=torch.uint8)[:, None] * 7
    frames[:, 6, 4:9] = torch.randint(0, 255, (8, 5), dtype=torch.uint8, generator=gen)
    keys = torch.tensor([-1, 0, 0, -1, 3, 3, 3, -1])
    tables["keys"] = (make_table(frames, keys=keys), torch.tensor([5, 1, 4, 4, 7, 2, 3]))
    wide = torch.zeros(4, 2, 3, 300, dtype=torch.int16)
    wide[:, :, :, 100:290] = torch.randint(0, 3, (4, 1, 1, 1), generator=gen).to(torch.int16)
    wide[1, 0, 1, ::9] = 700
    tables["wide_int16"] = (make_table(wide), torch.tensor([1, 3, 0, 1]))
    noise = torch.randint(0, 256, (4, 3, 5, 7), dtype=torch.uint8, generator=gen)
    noise[2] = 0
    tables["raw"] = (make_table(noise), torch.tensor([0, 2, 3]))
    return tables


def _corrupt(table: RowTable, gen: torch.Generator) -> RowTable:
    """One to three random changes to the arena bytes, a row's length, offset, reference or checksum."""
    bad = _clone(table)
    n_rows = bad.offsets.shape[0]
    for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
        what = int(torch.randint(0, 10, (1,), generator=gen))
        row = int(torch.randint(0, n_rows, (1,), generator=gen))
        if what < 6:
            pos = int(torch.randint(0, bad.arena.numel(), (1,), generator=gen))
            bad.arena[pos] ^= int(torch.randint(1, 256, (1,), generator=gen))
        elif what == 6:
            bad.lengths[row] += int(torch.randint(-4, 5, (1,), generator=gen))
        elif what == 7:
            bad.offsets[row] += int(torch.randint(-3, 4, (1,), generator=gen))
        elif what == 8 and bad.refs is not None:
            bad.refs[row] = int(torch.randint(-3, n_rows + 2, (1,), generator=gen))
        else:
            bad.checksums[row] ^= 1 << int(torch.randint(0, 31, (1,), generator=gen))
    return bad


@pytest.mark.parametrize("verify", [True, False])
def test_kernel_rejects_what_the_twin_rejects(verify):
    """Random corruptions of every layout: the kernel raises the twin's error (message and rows
    included) and leaves ``out`` untouched, or decodes the twin's bytes (possible unverified)."""
    pytest.importorskip("numba")
    gen = torch.Generator().manual_seed(11 + verify)
    for name, (table, index) in _fuzz_tables().items():
        g = table.geometry
        for case in range(120):
            bad = _corrupt(table, gen)
            try:
                want, error = decode_rows_ref(bad, index, verify=verify), None
            except CorruptRowError as e:
                want, error = None, e
            out = torch.full((index.numel(), *g.shape), 0, dtype=g.dtype)
            out.view(torch.uint8).fill_(0x5A)
            if error is None:
                got = decode_rows(bad, index, out, verify=verify, backend="numba")
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, case)
                continue
            with pytest.raises(CorruptRowError) as info:
                decode_rows(bad, index, out, verify=verify, backend="numba")
            assert str(info.value) == str(error) and info.value.rows == error.rows, (name, case)
            assert bool((out.view(torch.uint8) == 0x5A).all()), (name, case)
