"""A corrupt or truncated compressed row raises CorruptRowError on read; it never decodes silently."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from codec_helpers import make_table
from gpubuf.codec.checksum import as_int32, as_uint32, resuffix
from gpubuf.codec.errors import CorruptRowError
from gpubuf.errors import GpubufError
from gpubuf.ops.decode_rows import RowTable, decode_rows_ref


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


def test_every_single_byte_flip_is_detected():
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
                decode_rows_ref(bad, torch.tensor([0, row, 2]))
            assert info.value.rows == [1]
    # The untouched rows still read.
    assert torch.equal(decode_rows_ref(table, torch.tensor([0, 2])), rows[[0, 2]])


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_rows(verify):
    rows = _rows()
    table = make_table(rows)
    for cut in (1, 2, 5):
        bad = _clone(table)
        bad.lengths[3] -= cut
        with pytest.raises(CorruptRowError, match="length"):
            decode_rows_ref(bad, torch.tensor([3]), verify=verify)
    # A length past the arena's end.
    bad = _clone(table)
    bad.lengths[5] += 10_000
    with pytest.raises(CorruptRowError, match="outside the arena"):
        decode_rows_ref(bad, torch.tensor([5]), verify=verify)
    bad = _clone(table, arena=table.arena[: int(table.offsets[5]) + 3].clone())
    with pytest.raises(CorruptRowError):
        decode_rows_ref(bad, torch.tensor([5]), verify=verify)


def test_bad_checksum_and_offset():
    rows = _rows()
    table = make_table(rows)
    bad = _clone(table)
    bad.checksums[2] ^= 1
    with pytest.raises(CorruptRowError, match="checksum"):
        decode_rows_ref(bad, torch.tensor([2]))
    assert torch.equal(decode_rows_ref(bad, torch.tensor([2]), verify=False), rows[[2]])
    bad = _clone(table)
    bad.offsets[4] = -3
    with pytest.raises(CorruptRowError):
        decode_rows_ref(bad, torch.tensor([4]))


def test_impossible_modes_are_structural_errors():
    """A mode table saying UP on a first line, or REF without a reference plane, fails even unverified."""
    rows = torch.zeros(2, 1, 8, 40, dtype=torch.uint8)
    rows[:, 0, 0, 3] = 1
    table = make_table(rows)
    for forged in (0b00, 0b01):  # UP or REF for line 0
        bad = _clone(table)
        start = int(bad.offsets[0])
        bad.arena[start] = (bad.arena[start] & 0b11111100) | forged
        with pytest.raises(CorruptRowError):
            decode_rows_ref(bad, torch.tensor([0]), verify=False)


def test_run_starts_out_of_order():
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
            decode_rows_ref(bad, torch.tensor([0]), verify=False)


def test_reference_rows():
    frames = torch.full((6, 10, 20), 5, dtype=torch.uint8)
    frames[:, 3, :] = torch.arange(6, dtype=torch.uint8)[:, None] * 7
    keys = torch.tensor([-1, 0, 0, -1, 3, 3])
    table = make_table(frames, keys=keys)
    assert torch.equal(decode_rows_ref(table, torch.arange(6)), frames)
    # A reference row that has a reference itself (depth two) is refused.
    bad = _clone(table)
    bad.refs[0] = 3
    bad.checksums[0] = as_int32(resuffix(as_uint32(table.checksums[:1]), table.refs[:1], bad.refs[:1]))[0]
    with pytest.raises(CorruptRowError, match="reference"):
        decode_rows_ref(bad, torch.tensor([1]))
    # A reference out of range.
    bad = _clone(table)
    bad.refs[4] = 99
    with pytest.raises(CorruptRowError, match="reference"):
        decode_rows_ref(bad, torch.tensor([4]))
    # A row pointed at another (valid) reference row: its checksum covers the reference number.
    bad = _clone(table)
    bad.refs[4] = 0
    with pytest.raises(CorruptRowError, match="checksum"):
        decode_rows_ref(bad, torch.tensor([4]))
    # Corrupting a reference row fails every row that uses it.
    bad = _clone(table)
    bad.arena[int(table.offsets[3]) + int(table.lengths[3]) - 1] ^= 0x10
    with pytest.raises(CorruptRowError) as info:
        decode_rows_ref(bad, torch.tensor([0, 4, 1, 5, 3]))
    assert info.value.rows == [1, 3, 4]


@pytest.mark.parametrize("kind", ["tensor", "frames"])
def test_storage_raises_on_corrupt_rows_and_stays_usable(kind, atari):
    from gpubuf.codec.framestack import transition_indices
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
    victim = int(store.offsets[int(store.lengths.argmax())]) + 25
    store.arena[victim] ^= 0x44
    with pytest.raises(CorruptRowError):
        storage.get(torch.arange(n))
    store.arena[victim] ^= 0x44
    assert torch.equal(storage.get(torch.arange(n))["next", "obs"], td["next", "obs"])
