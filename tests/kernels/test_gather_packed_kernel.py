"""Triton packed gather vs its torch twin, bit for bit.

On CPU the kernel runs through Triton's interpreter (tests/conftest.py), which runs programs
one after another: sizes stay small here; the ``gpu``-marked tests cover RLHF-sized batches.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.gather_packed import gather_packed, gather_packed_ref
from gpubuf_kernels._launch import unit_bytes
from gpubuf_kernels.gather_packed import GATHER_PACKED, gather_packed_triton

POISON = 0xAB


def _store(n_rows, max_len, trails, dtypes, device, gen, gap=1):
    lengths = torch.randint(0, max_len + 1, (n_rows,), generator=gen)
    starts = torch.zeros(n_rows, dtype=torch.int64)
    pos = gap
    for r in torch.randperm(n_rows, generator=gen).tolist():
        starts[r] = pos
        pos += int(lengths[r]) + gap
    values = []
    for trail, dtype in zip(trails, dtypes):
        size = torch.empty((), dtype=dtype).element_size()
        if dtype == torch.bool:
            v = torch.randint(0, 2, (pos, *trail), generator=gen).bool()
        else:
            # Raw bytes below the poison: NaN payloads and -0.0 appear, so comparisons are bitwise.
            v = torch.randint(0, POISON, (pos, *trail, size), generator=gen, dtype=torch.uint8).view(dtype).reshape(pos, *trail)
        values.append(v.to(device))
    return values, starts.to(device), lengths.to(device)


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t.view(torch.uint8)


def _check(values, starts, lengths, index):
    want, want_offsets = gather_packed_ref([v.cpu() for v in values], starts.cpu(), lengths.cpu(), index.cpu())
    got, offsets = gather_packed(values, starts, lengths, index, backend="triton")
    assert torch.equal(offsets.cpu(), want_offsets)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert torch.equal(_bytes(g.cpu()), _bytes(w))


@pytest.mark.parametrize(
    "dtype,trail",
    [
        (torch.uint8, ()),  # 1-byte unit
        (torch.int16, ()),  # 2
        (torch.float32, ()),  # 4
        (torch.int64, ()),  # 8
        (torch.float32, (4,)),  # 16
        (torch.uint8, (3,)),  # odd token size: bytes
        (torch.bool, (2,)),
        (torch.bfloat16, (3,)),
    ],
)
def test_kernel_matches_twin(dtype, trail, kernel_device):
    gen = torch.Generator().manual_seed(7)
    values, starts, lengths = _store(6, 9, [trail], [dtype], kernel_device, gen)
    index = torch.tensor([5, 0, 0, 3, 2], device=kernel_device)
    _check(values, starts, lengths, index)


def test_many_sources_one_launch_int32_index(kernel_device):
    gen = torch.Generator().manual_seed(8)
    values, starts, lengths = _store(
        5, 7, [(), (2,), (3,)], [torch.int64, torch.bool, torch.float16], kernel_device, gen
    )
    _check(values, starts, lengths, torch.tensor([4, 1, 4], dtype=torch.int32, device=kernel_device))


def test_rows_longer_than_a_block_loop(kernel_device, monkeypatch):
    """A row of more units than one program step crosses chunk boundaries (and grid-axis reuse)."""
    monkeypatch.setitem(GATHER_PACKED, "BLOCK_BYTES", 16)
    gen = torch.Generator().manual_seed(9)
    values, starts, lengths = _store(3, 40, [()], [torch.int32], kernel_device, gen)
    lengths[1] = 37
    starts[1] = 0
    _check(values, starts, lengths, torch.tensor([1, 0, 2], device=kernel_device))


def test_empty_rows_and_unaligned_sources(kernel_device):
    gen = torch.Generator().manual_seed(10)
    values, starts, lengths = _store(4, 5, [(2,)], [torch.float32], kernel_device, gen)
    lengths[0] = 0
    # A view that starts 4 bytes into its storage narrows the 8-byte tokens' unit to 4 bytes.
    flat = torch.cat([torch.zeros(1, device=kernel_device), values[0].reshape(-1)])
    shifted = [flat[1:].view(-1, 2)]
    assert unit_bytes(8, shifted[0].data_ptr(), 0) == 4
    _check(shifted, starts, lengths, torch.tensor([0, 3, 1], device=kernel_device))


def test_outs_and_zero_total(kernel_device):
    gen = torch.Generator().manual_seed(11)
    values, starts, lengths = _store(3, 4, [()], [torch.int64], kernel_device, gen)
    lengths.zero_()
    index = torch.tensor([0, 1], device=kernel_device)
    offsets = torch.zeros(3, dtype=torch.int64, device=kernel_device)
    out = torch.full((2,), -1, dtype=torch.int64, device=kernel_device)
    got, _ = gather_packed_triton(values, starts, lengths, index, offsets, 0, 0, [out])
    assert got[0] is out and out.tolist() == [-1, -1]


def test_launcher_refuses_bad_arguments(kernel_device):
    gen = torch.Generator().manual_seed(12)
    values, starts, lengths = _store(3, 4, [(2,)], [torch.float32], kernel_device, gen)
    index = torch.tensor([0], device=kernel_device)
    offsets = torch.zeros(2, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="contiguous"):
        gather_packed_triton([values[0].t().contiguous().t()[:, :1].expand(-1, 2)], starts, lengths, index, offsets, 0, 0)
    with pytest.raises(TypeError, match="starts"):
        gather_packed_triton(values, starts.int(), lengths, index, offsets, 0, 0)
    with pytest.raises(ValueError, match="offsets"):
        gather_packed_triton(values, starts, lengths, index, offsets[:1], 0, 0)
    with pytest.raises(ValueError, match="at least one"):
        gather_packed_triton([], starts, lengths, index, offsets, 0, 0)


@pytest.mark.gpu
def test_rlhf_sized_batch_on_gpu():
    gen = torch.Generator().manual_seed(13)
    lengths = torch.randint(64, 2049, (4096,), generator=gen)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    total = int(lengths.sum())
    values = [torch.randint(0, 32000, (total,), generator=gen).cuda(), (torch.rand(total, generator=gen) > 0.1).cuda()]
    index = torch.randint(0, 4096, (256,), generator=gen)
    _check(values, starts.cuda(), lengths.cuda(), index.cuda())


@pytest.mark.gpu
def test_more_rows_than_a_grid_axis_on_gpu():
    lengths = torch.ones(70_000, dtype=torch.int64)
    starts = torch.arange(70_000)
    values = [torch.arange(70_000).cuda()]
    index = torch.randperm(70_000).cuda()
    _check(values, starts.cuda(), lengths.cuda(), index)


def test_packed_storage_samples_and_compacts_through_the_kernel(monkeypatch, kernel_device):
    """The storage's whole path (sampling, compaction into preallocated arenas) on the kernel:
    a CUDA storage where there is one, else CPU tensors through the interpreter (the buffer's
    ``backend="triton"``; on the CPU ``auto`` would take the twin).
    """
    from tensordict import TensorDict

    from gpubuf import ReplayBuffer
    from gpubuf.ops import gather_packed as op
    from gpubuf.storages.packed import PackedStorage

    gen = torch.Generator().manual_seed(14)
    items = [
        TensorDict(ids=torch.randint(0, 100, (n,), generator=gen), mask=torch.rand(n, generator=gen) > 0.5)
        for n in torch.randint(1, 30, (12,), generator=gen).tolist()
    ]
    calls = []
    real = op.implementation("gather_packed", "triton")
    monkeypatch.setattr(op, "implementation", lambda name, which: lambda *a: calls.append(name) or real(*a))
    rb = ReplayBuffer(storage=PackedStorage(6, device=kernel_device), batch_size=5, backend="triton")
    rb.extend(items[:6])
    rb.storage.compact()
    rb.extend(items[6:])  # overwrites every row: the arena fills and compacts
    index = torch.tensor([5, 0, 3, 3, 1], device=kernel_device)
    batch = rb.storage.get(index)
    for b, i in enumerate(index.tolist()):
        assert torch.equal(batch["ids"][b].cpu(), items[6 + i]["ids"])
        assert torch.equal(batch["mask"][b].cpu(), items[6 + i]["mask"])
    assert calls and set(calls) == {"gather_packed"}  # the kernel ran: the backend reached the storage
