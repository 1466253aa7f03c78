"""Prefetch: the same batches as without prefetch for the same seed, and never a stale one.

Indices are drawn in the caller's thread in submission order and only the reads run ahead, so
``prefetch=k`` must return exactly the batches of ``prefetch=None``; a write drops (and undoes
the draws of) every batch drawn before it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

from gpubuf import (
    LazyTensorStorage,
    RandomSampler,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
)
from gpubuf.errors import EmptyBufferError

BUFFERS = [TensorDictReplayBuffer, ReplayBuffer]
SAMPLERS = [RandomSampler, SamplerWithoutReplacement]


def _rows(start: int, n: int) -> TensorDict:
    values = torch.arange(start, start + n)
    return TensorDict({"a": values.float().unsqueeze(-1), "b": values.clone(), ("n", "c"): values.to(torch.int16)}, [n])


def _script(cls, sampler_cls, prefetch, seed=3, batch_size=7):
    """Samples interleaved with every kind of write; returns the batches and their indices."""
    gen = torch.Generator().manual_seed(seed)
    rb = cls(storage=LazyTensorStorage(40), sampler=sampler_cls(), batch_size=batch_size, prefetch=prefetch,
             generator=gen)
    rb.extend(_rows(0, 25))
    out = []
    for step in range(40):
        batch, info = rb.sample(return_info=True)
        out.append((batch, info["index"]))
        if step == 5:
            rb.extend(_rows(100, 9))
        elif step == 11:
            rb.add(_rows(200, 1)[0])
        elif step == 17:
            item = _rows(300, 1)[0]
            if cls is TensorDictReplayBuffer:
                item["index"] = torch.tensor(3)  # the stored column that sampling refills
            rb[3] = item
        elif step == 23:
            rb.empty()
            rb.extend(_rows(400, 13))
        elif step == 29:
            rb.extend(_rows(500, 40))  # overwrites everything, length unchanged
    return out


def _equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    keys = set(x.keys(True, True))
    return keys == set(y.keys(True, True)) and all(torch.equal(x[k], y[k]) for k in keys)


@pytest.mark.parametrize("sampler_cls", SAMPLERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("cls", BUFFERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("prefetch", [1, 3])
def test_prefetch_returns_the_batches_of_no_prefetch(cls, sampler_cls, prefetch):
    expected = _script(cls, sampler_cls, None)
    got = _script(cls, sampler_cls, prefetch)
    assert len(got) == len(expected)
    for step, ((batch, index), (ref, ref_index)) in enumerate(zip(got, expected)):
        assert torch.equal(index, ref_index), f"step {step}: other indices"
        assert _equal(batch, ref), f"step {step}: other data"


@pytest.mark.parametrize("cls", BUFFERS, ids=lambda c: c.__name__)
def test_changing_batch_size_keeps_the_sequence(cls):
    def run(prefetch):
        gen = torch.Generator().manual_seed(0)
        rb = cls(storage=LazyTensorStorage(30), batch_size=4, prefetch=prefetch, generator=gen)
        rb.extend(_rows(0, 30))
        return [rb.sample(size)["b"] for size in (4, 4, 6, 4, 6, 6, 4)]

    for x, y in zip(run(2), run(None)):
        assert torch.equal(x, y)


def test_iteration_without_replacement_matches():
    def run(prefetch):
        gen = torch.Generator().manual_seed(1)
        rb = ReplayBuffer(storage=LazyTensorStorage(20), sampler=SamplerWithoutReplacement(), batch_size=4,
                          prefetch=prefetch, generator=gen)
        rb.extend(torch.arange(10))
        epochs = [[b.tolist() for b in rb] for _ in range(2)]
        for b in rb:  # an iteration left early: the rest of its epoch comes next
            epochs.append([b.tolist()])
            break
        epochs.append([b.tolist() for b in rb])
        return epochs

    expected = run(None)
    assert [sorted(sum(e, [])) for e in expected[:2]] == [list(range(10))] * 2
    assert run(1) == expected
    assert run(3) == expected


class _SlowGather:
    """Wraps a storage's gather so that reads take a while (writes then land mid-flight)."""

    def __init__(self, storage, delay: float) -> None:
        self.inner = storage._gather
        self.delay = delay
        self.threads: set[int] = set()

    def __call__(self, index, skip=None):
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        return self.inner(index, skip)


@pytest.mark.parametrize("cls", BUFFERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "default-rng"])
def test_no_stale_batch_after_a_write(cls, seeded):
    capacity = 12
    gen = torch.Generator().manual_seed(0) if seeded else None
    storage = LazyTensorStorage(capacity)
    rb = cls(storage=storage, batch_size=5, prefetch=3, generator=gen)
    rb.extend(_rows(0, capacity))
    storage._gather = _SlowGather(storage, 0.01)
    for generation in range(1, 6):
        rb.sample()  # the queue fills with batches of the previous generation
        base = 1000 * generation
        rb.extend(_rows(base, capacity))  # overwrites every row
        for _ in range(4):
            batch = rb.sample()
            assert (batch["b"] >= base).all(), f"generation {generation}: a batch from before the write"
            assert torch.equal(batch["a"].squeeze(-1).long(), batch["b"])


def test_no_stale_batch_after_setitem_add_and_empty():
    rb = ReplayBuffer(storage=LazyTensorStorage(1), batch_size=3, prefetch=2)
    rb.extend(torch.tensor([5]))
    assert rb.sample().tolist() == [5, 5, 5]
    rb[0] = torch.tensor(6)
    assert rb.sample().tolist() == [6, 6, 6]
    rb.add(torch.tensor(7))
    assert rb.sample().tolist() == [7, 7, 7]
    rb.empty()
    with pytest.raises(EmptyBufferError):
        rb.sample()
    rb.extend(torch.tensor([8]))
    assert rb.sample().tolist() == [8, 8, 8]


def test_draws_in_the_callers_thread_reads_in_workers():
    storage = LazyTensorStorage(50)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4, prefetch=2)
    rb.extend(_rows(0, 50))
    slow = storage._gather = _SlowGather(storage, 0.002)
    draw_threads = set()
    sample = rb.sampler.sample

    def recording_sample(*args, **kwargs):
        draw_threads.add(threading.get_ident())
        return sample(*args, **kwargs)

    rb.sampler.sample = recording_sample
    for _ in range(10):
        rb.sample()
    assert draw_threads == {threading.get_ident()}
    assert slow.threads - {threading.get_ident()}, "no read ran ahead in a worker"


#: Generations wrap here so that every stored value stays below 2**24, which float32 ("a") holds
#: exactly; two generations that far apart are never both in flight.
GENERATIONS = 1 << 14


def _generation_rows(generation: int, capacity: int) -> TensorDict:
    return _rows((generation % GENERATIONS) * capacity, capacity)


def _assert_not_torn(batch: TensorDict) -> None:
    """Every field of every row holds the same generation's value (``a`` and ``c`` are ``b`` cast)."""
    rows = batch["b"]
    assert torch.equal(batch["a"].squeeze(-1).long(), rows), "a torn read: 'a' and 'b' of one row differ"
    assert torch.equal(batch["n", "c"].long(), rows.to(torch.int16).long()), "a torn read: ('n', 'c') differs"


def test_the_torn_read_check_catches_a_read_torn_on_purpose():
    # A read torn by hand, field by field around a write, the way a concurrent writer would tear it.
    capacity = 64
    storage = LazyTensorStorage(capacity)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb.extend(_generation_rows(GENERATIONS - 1, capacity))  # the last generation before the wrap
    index = torch.arange(0, capacity, 4)
    before = rb[index]
    rb.extend(_generation_rows(GENERATIONS, capacity))  # wraps to generation 0's values
    after = rb[index]
    _assert_not_torn(before)
    _assert_not_torn(after)
    torn = after.clone()
    torn["a"] = before["a"]
    with pytest.raises(AssertionError, match="torn"):
        _assert_not_torn(torn)
    torn = after.clone()
    torn["n", "c"] = before["n", "c"]
    with pytest.raises(AssertionError, match="torn"):
        _assert_not_torn(torn)


def test_torn_reads_never_returned_with_a_concurrent_writer():
    # Rows hold the same value in "a" and "b"; a writer thread overwrites the whole buffer again
    # and again, field by field, while batches are read ahead. A batch read while a write is under
    # way would mix generations. The reader lets the writer start one more generation after each
    # batch (so the writes land while the next batches are in flight), and takes a fixed number of
    # batches: the outcome depends neither on how fast the machine is nor on which thread runs more.
    capacity = 64
    storage = LazyTensorStorage(capacity)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16, prefetch=3, generator=torch.Generator().manual_seed(0))
    rb.extend(_generation_rows(0, capacity))
    storage._gather = _SlowGather(storage, 0.001)
    go = threading.Semaphore(0)
    stop = threading.Event()

    def writer():
        generation = 1
        while True:
            go.acquire()
            if stop.is_set():
                return
            rb.extend(_generation_rows(generation, capacity))
            generation += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(300):
            _assert_not_torn(rb.sample())
            go.release()
    finally:
        stop.set()
        go.release()
        thread.join()


def test_empty_buffer_error_propagates_and_recovers():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2, prefetch=2)
    with pytest.raises(EmptyBufferError):
        rb.sample()
    rb.extend(torch.arange(10))
    assert rb.sample().shape == (2,)


def test_priority_updates_do_not_invalidate():
    # As in TorchRL: prefetched batches keep the indices drawn before an update.
    gen = torch.Generator().manual_seed(0)
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2, prefetch=2, generator=gen)
    rb.extend(torch.arange(10))
    rb.sample()
    queued = len(rb._prefetcher)
    rb.update_priority(torch.tensor([0]), torch.tensor([2.0]))
    assert len(rb._prefetcher) == queued == 2
