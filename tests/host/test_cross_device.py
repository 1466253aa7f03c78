"""Cross-device batches: packing, the host gather into staging, the pinned ring, the buffer path.

On a machine without CUDA the host-side parts run for real, and the buffer's cross-device path
runs end to end with the CUDA runtime replaced by stand-ins (events, streams, pinned memory),
so the same code packs, gathers, stages, copies and builds the batch; only the device differs.
The ``gpu`` tests check the real thing: batches equal the source rows, and stream ordering
(a slow side stream never lets the consumer read an unfinished copy).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from tensordict import TensorDict

import gpubuf.staging as staging
from gpubuf import LazyTensorStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.errors import DeviceMismatchError
from gpubuf.staging import ALIGN, CrossDeviceGather, PackPlan, PinnedRing, gather_packed_host, transfer_kind
from helpers import DTYPES as GATHER_DTYPES

HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")

DTYPES = [*GATHER_DTYPES, torch.complex64]
# Odd per-row shapes: scalars, 1-byte rows, primes, an empty trailing dim.
TRAILS = [(), (1,), (3,), (5, 7), (2, 3, 4), (0,), (13,)]


def _source(dtype: torch.dtype, trail: tuple, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, *trail, dtype.itemsize), generator=gen, dtype=torch.uint8)
    # Random bytes reinterpreted: every bit pattern (NaN payloads, -0.0) must survive the copy.
    if dtype == torch.bool:
        return (raw[..., 0] & 1).bool()
    return raw.view(dtype).reshape(rows, *trail)


def _indices(rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "B=1": torch.tensor([rows - 1]),
        "first-last-dup": torch.tensor([0, rows - 1, 0, rows - 1, 0]),
        "unsorted-dups": torch.randint(0, rows, (37,), generator=gen),
        # The fused kernel's row block is 16: one short of it, it, one past it.
        "B=15": torch.randint(0, rows, (15,), generator=gen),
        "B=16": torch.randint(0, rows, (16,), generator=gen),
        "B=17": torch.randint(0, rows, (17,), generator=gen),
    }


# ------------------------------------------------------------------------------------------
# PackPlan and the host gather
# ------------------------------------------------------------------------------------------


def test_pack_plan_aligns_every_leaf_and_views_share_the_buffer():
    specs = [(dtype, trail) for dtype in DTYPES for trail in ((), (3,), (5, 7))]
    plan = PackPlan.for_leaves(specs, batch=9)
    assert all(offset % ALIGN == 0 for offset in plan.offsets)
    buffer = torch.zeros(plan.nbytes, dtype=torch.uint8)
    views = plan.views(buffer)
    for (dtype, trail), view in zip(specs, views):
        assert view.dtype == dtype and view.shape == (9, *trail) and view.is_contiguous()
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    # No two leaves overlap: filling each with its own byte pattern leaves the others intact.
    for i, view in enumerate(views):
        view.view(torch.uint8).fill_(i + 1)
    for i, view in enumerate(views):
        assert (view.view(torch.uint8) == i + 1).all()


def test_pack_plan_rejects_a_small_or_typed_buffer():
    plan = PackPlan.for_leaves([(torch.float32, (4,))], batch=3)
    with pytest.raises(ValueError):
        plan.views(torch.zeros(plan.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(TypeError):
        plan.views(torch.zeros(plan.nbytes, dtype=torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_host_gather_into_staging_equals_index_select(dtype):
    rows = 23
    sources = [_source(dtype, trail, rows, seed) for seed, trail in enumerate(TRAILS)]
    for name, index in _indices(rows).items():
        plan = PackPlan.for_leaves([(s.dtype, s.shape[1:]) for s in sources], index.shape[0])
        buffer = torch.full((plan.nbytes,), 0xAB, dtype=torch.uint8)
        out = gather_packed_host(sources, index, plan.views(buffer))
        for src, got in zip(sources, out):
            # Compared as bytes: NaN != NaN, but the bits must be the same.
            assert torch.equal(got.view(torch.uint8), src[index].view(torch.uint8)), name


def test_host_gather_fills_skipped_leaves():
    rows = 11
    a = _source(torch.float32, (3,), rows, 0)
    index = torch.tensor([4, 0, 10, 4])
    fill = index.unsqueeze(-1).clone()
    plan = PackPlan.for_leaves([(a.dtype, (3,)), (fill.dtype, (1,))], 4)
    out = gather_packed_host([a, None], index, plan.views(torch.empty(plan.nbytes, dtype=torch.uint8)), {1: fill})
    assert torch.equal(out[0], a[index]) and torch.equal(out[1], fill)


# ------------------------------------------------------------------------------------------
# The ring of staging buffers
# ------------------------------------------------------------------------------------------


class FakeEvent:
    """A stand-in CUDA event: "completes" when synchronized; records the order of waits."""

    log: list = []

    def __init__(self, *args, **kwargs) -> None:
        self.done = False

    def record(self, stream=None) -> None:
        self.done = False

    def synchronize(self) -> None:
        FakeEvent.log.append(self)
        self.done = True

    def query(self) -> bool:
        return self.done


def test_ring_waits_for_the_last_copy_before_reusing_a_slot():
    ring = PinnedRing(2, pin=False)
    first = ring.acquire(100)
    copy_a = FakeEvent()
    ring.release(first, copy_a)
    second = ring.acquire(100)
    assert second is not first  # round robin: the other slot first
    ring.release(second, None)
    FakeEvent.log.clear()
    again = ring.acquire(50)
    assert again is first and FakeEvent.log == [copy_a], "slot reused before its copy was waited for"
    assert again.buffer.numel() >= 100
    ring.release(again, None)


def test_ring_skips_slots_being_filled_and_grows():
    ring = PinnedRing(3, pin=False)
    held = [ring.acquire(10) for _ in range(3)]
    assert len({id(s) for s in held}) == 3
    got = []
    waiter = threading.Thread(target=lambda: got.append(ring.acquire(5_000_000)))
    waiter.start()
    waiter.join(0.05)
    assert not got, "acquired a slot that another thread is filling"
    ring.release(held[1], None)
    waiter.join(120)  # generous: only a hang would take this long
    assert got and got[0] is held[1] and got[0].buffer.numel() >= 5_000_000
    for slot in (held[0], held[2], got[0]):
        ring.release(slot, None)
    with pytest.raises(ValueError):
        PinnedRing(0)


def test_transfer_kinds():
    assert transfer_kind(CPU, CPU) is None
    assert transfer_kind(torch.device("cpu"), torch.device("cuda", 0)) == "h2d"
    assert transfer_kind(torch.device("cuda", 0), CPU) == "d2h"
    assert transfer_kind(torch.device("cuda", 0), torch.device("cuda", 1)) == "generic"
    assert transfer_kind(CPU, CPU, pin=True) == ("pin" if HAS_CUDA else None)


# ------------------------------------------------------------------------------------------
# The buffer's API
# ------------------------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="checks the error raised without CUDA")
def test_batch_device_cuda_without_cuda_raises():
    with pytest.raises(DeviceMismatchError):
        ReplayBuffer(storage=LazyTensorStorage(10), batch_device="cuda")


def test_batch_device_on_the_storage_device_changes_nothing():
    data = TensorDict({"x": torch.arange(20.0).unsqueeze(-1)}, [20])
    a = TensorDictReplayBuffer(storage=LazyTensorStorage(20), generator=torch.Generator().manual_seed(0))
    b = TensorDictReplayBuffer(storage=LazyTensorStorage(20), generator=torch.Generator().manual_seed(0),
                               batch_device="cpu")
    a.extend(data)
    b.extend(data)
    assert b.batch_device == CPU and a.batch_device is None
    for _ in range(3):
        x, y = a.sample(5), b.sample(5)
        assert torch.equal(x["x"], y["x"]) and torch.equal(x["index"], y["index"])
    assert b._route().transfer is None  # no transfer object: the plain path


# ------------------------------------------------------------------------------------------
# The buffer's cross-device path, end to end, with the CUDA runtime stood in for
# ------------------------------------------------------------------------------------------


class FakeSide:
    def __init__(self, device):
        self.device = device
        self.stream = object()
        self.runs = 0

    def mark_ready(self):
        return FakeEvent()

    @contextlib.contextmanager
    def run(self, ready=None):
        self.runs += 1
        yield

    def record(self):
        return FakeEvent()


@pytest.fixture
def fake_cuda(monkeypatch):
    """Lets CrossDeviceGather's h2d/d2h code run between CPU tensors."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(staging, "SideStream", FakeSide)
    monkeypatch.setattr(staging, "_pinned_empty", lambda n: torch.empty(n, dtype=torch.uint8))
    copies = []
    monkeypatch.setattr(staging, "_before_copy", lambda: copies.append(1))
    return copies


def _stand_in(rb, kind: str, slots: int = 3) -> CrossDeviceGather:
    transfer = CrossDeviceGather(CPU, CPU)
    transfer.kind = kind
    if kind == "h2d":
        transfer._ring = PinnedRing(slots, pin=False)
    rb._route_cache = rb._route()._replace(transfer=transfer)
    return transfer


def _mixed(rows: int) -> TensorDict:
    gen = torch.Generator().manual_seed(5)
    return TensorDict(
        {
            "obs": torch.randn(rows, 5, 7, generator=gen),
            "action": torch.randint(0, 9, (rows, 3), generator=gen, dtype=torch.int16),
            "done": torch.rand(rows, 1, generator=gen) < 0.3,
            ("next", "reward"): torch.randn(rows, generator=gen).to(torch.bfloat16),
            ("next", "pixels"): torch.randint(0, 256, (rows, 2, 3, 3), generator=gen, dtype=torch.uint8),
        },
        [rows],
    )


@pytest.mark.parametrize("kind", ["h2d", "d2h"])
@pytest.mark.parametrize("cls", [TensorDictReplayBuffer, ReplayBuffer], ids=lambda c: c.__name__)
def test_cross_device_batches_equal_the_source_rows(fake_cuda, kind, cls):
    rows = 31
    data = _mixed(rows)
    rb = cls(storage=LazyTensorStorage(rows), generator=torch.Generator().manual_seed(0))
    rb.extend(data.clone())
    transfer = _stand_in(rb, kind)
    for batch_size in (1, 15, 16, 17, 64):
        batch, info = rb.sample(batch_size, return_info=True)
        index = info["index"]
        expected = data[index]
        for key in expected.keys(True, True):
            assert torch.equal(batch[key], expected[key]), key
        if cls is TensorDictReplayBuffer:
            assert torch.equal(batch["index"], index)
        # Every leaf of the batch lies in one buffer: the batch crossed in a single copy.
        leaves = [batch[k] for k in expected.keys(True, True)]
        assert len({t.untyped_storage().data_ptr() for t in leaves}) == 1
    assert len(fake_cuda) == 5  # one copy per batch
    if kind == "h2d":
        assert all(not slot.busy for slot in transfer._ring._slots)


def test_cross_device_prefetch_matches_no_prefetch(fake_cuda):
    data = _mixed(40)

    def run(prefetch):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(40), batch_size=9, prefetch=prefetch,
                                    generator=torch.Generator().manual_seed(2))
        rb.extend(data[:30].clone())
        _stand_in(rb, "h2d", slots=(prefetch or 0) + 2)
        out = []
        for step in range(12):
            out.append(rb.sample())
            if step == 4:
                rb.extend(data[30:].clone())
        return out

    for got, ref in zip(run(2), run(None)):
        for key in ref.keys(True, True):
            assert torch.equal(got[key], ref[key])


# ------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [None, 2])
def test_gpu_host_storage_cuda_batches(prefetch):
    data = _mixed(257)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(257), batch_size=33, prefetch=prefetch,
                                batch_device="cuda", generator=torch.Generator().manual_seed(0))
    rb.extend(data.clone())
    for _ in range(6):
        batch, info = rb.sample(return_info=True)
        assert batch.device.type == "cuda" and batch["obs"].is_cuda
        expected = data[info["index"].cpu()]
        for key in expected.keys(True, True):
            assert torch.equal(batch[key].cpu(), expected[key]), key


@pytest.mark.gpu
def test_gpu_cuda_storage_cpu_batches():
    data = _mixed(100).to("cuda")
    rb = ReplayBuffer(storage=LazyTensorStorage(100, device="cuda"), batch_device="cpu",
                      generator=torch.Generator(device="cuda").manual_seed(0))
    rb.extend(data)
    for batch_size in (1, 16, 17, 300):
        batch, info = rb.sample(batch_size, return_info=True)
        assert batch["obs"].device.type == "cpu" and batch["obs"].is_pinned()
        expected = data[info["index"]].cpu()
        for key in expected.keys(True, True):
            assert torch.equal(batch[key], expected[key]), key


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [None, 2])
def test_gpu_h2d_consumer_waits_for_a_slow_copy(monkeypatch, prefetch):
    # The side stream sleeps ~50 ms before each copy: a consumer not ordered after the copy would
    # read the batch's memory before it is written.
    monkeypatch.setattr(staging, "_before_copy", lambda: torch.cuda._sleep(50_000_000))
    rows = 4096
    values = torch.arange(rows, dtype=torch.float32).unsqueeze(-1).expand(rows, 64).contiguous()
    rb = ReplayBuffer(storage=LazyTensorStorage(rows), batch_size=1024, prefetch=prefetch, batch_device="cuda",
                      generator=torch.Generator().manual_seed(0))
    rb.extend(values)
    for _ in range(4):
        batch, info = rb.sample(return_info=True)
        # Enqueued on the consumer's stream at once, no host sync in between.
        total = batch.sum(-1)
        expected = info["index"].to(torch.float32) * 64
        assert torch.equal(total.cpu(), expected)


@pytest.mark.gpu
def test_gpu_d2h_host_waits_for_a_slow_copy(monkeypatch):
    monkeypatch.setattr(staging, "_before_copy", lambda: torch.cuda._sleep(50_000_000))
    values = torch.arange(512, device="cuda", dtype=torch.float64)
    rb = ReplayBuffer(storage=LazyTensorStorage(512, device="cuda"), batch_device="cpu")
    rb.extend(values)
    batch, info = rb.sample(256, return_info=True)
    assert torch.equal(batch, info["index"].double().cpu())


@pytest.mark.gpu
def test_gpu_prefetch_on_a_cuda_storage_is_fresh_and_reproducible(monkeypatch):
    def run(prefetch):
        rb = ReplayBuffer(storage=LazyTensorStorage(64, device="cuda"), batch_size=16, prefetch=prefetch,
                          generator=torch.Generator(device="cuda").manual_seed(0))
        rb.extend(torch.arange(64, device="cuda"))
        out = []
        for gen in range(1, 5):
            out.append(rb.sample().cpu())
            rb.extend(torch.arange(64, device="cuda") + 1000 * gen)
            fresh = rb.sample()
            assert (fresh >= 1000 * gen).all()
            out.append(fresh.cpu())
        return out

    for got, ref in zip(run(3), run(None)):
        assert torch.equal(got, ref)


@pytest.mark.gpu
def test_gpu_pin_memory_gathers_into_pinned_memory():
    rb = ReplayBuffer(storage=LazyTensorStorage(100), pin_memory=True)
    rb.extend(torch.arange(100.0))
    batch, info = rb.sample(10, return_info=True)
    assert batch.is_pinned() and torch.equal(batch, info["index"].float())
