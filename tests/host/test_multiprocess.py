"""Buffers on a LazyMemmapStorage shared by real processes (fork and spawn).

The write cursor lives with the storage, so concurrent writers never overwrite each other;
``shared_init=True`` lets processes that start together create the files exactly once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.samplers.shared import SharedPrioritizedSampler
from gpubuf.storages import _memmap_files
from gpubuf.storages.memmap import LazyMemmapStorage, StorageNotSharableError

FORK = mp.get_context("fork")
SPAWN = mp.get_context("spawn")


def _rows(wid: int, seq: torch.Tensor) -> TensorDict:
    return TensorDict({"wid": torch.full_like(seq, wid), "seq": seq}, batch_size=[seq.numel()])


def _join(procs, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 1))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0] * len(procs)


# ------------------------------------------------------------------------- TorchRL's documented use
def _torchrl_worker(rb):
    # Updates the replay buffer with new data
    td = TensorDict({"a": torch.ones(10)}, [10])
    rb.extend(td)


def test_torchrl_sharing_example_fork():
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(21))
    td = TensorDict({"a": torch.zeros(10)}, [10])
    rb.extend(td)
    proc = FORK.Process(target=_torchrl_worker, args=(rb,))
    proc.start()
    _join([proc])
    # the replay buffer now has a length of 20, since the worker updated it
    assert len(rb) == 20
    assert (rb[:]["a"][:10] == 0).all()  # data from main process
    assert (rb[:]["a"][10:20] == 1).all()  # data from remote process
    assert torch.equal(rb[:]["index"], torch.arange(20))
    assert rb.write_count == 20 and rb.writer._cursor == 20
    rb.storage.cleanup()


def test_torchrl_sharing_example_spawn_passes_the_buffer_itself():
    # Spawned workers receive the buffer by pickling: its locks and threads are made anew there,
    # its storage and shared cursor are the same files.
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyMemmapStorage(21), prefetch=2, batch_size=4)
    rb.extend(TensorDict({"a": torch.zeros(10)}, [10]))
    rb.sample()
    proc = SPAWN.Process(target=_torchrl_worker, args=(rb,))
    proc.start()
    _join([proc])
    assert len(rb) == 20
    assert (rb[:]["a"][:10] == 0).all() and (rb[:]["a"][10:20] == 1).all()
    assert rb.write_count == 20 and rb.writer._cursor == 20
    assert rb.sample().batch_size == torch.Size([4])
    rb.storage.cleanup()


def _storage_worker(storage, wid: int, n: int, batch: int, start_barrier=None):
    rb = gpubuf.TensorDictReplayBuffer(storage=storage)
    if start_barrier is not None:
        start_barrier.wait()
    for s in range(0, n, batch):
        rb.extend(_rows(wid, torch.arange(s, min(s + batch, n))))


def _prioritized_worker(storage, sampler, wid: int, n: int, batch: int, barrier=None):
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, sampler=sampler)
    if barrier is not None:
        barrier.wait()
    for s in range(0, n, batch):
        index = rb.extend(_rows(wid, torch.arange(s, min(s + batch, n))))
        # Rows of worker w get priority w + 1; every tenth row gets 0 (never sampled).
        priority = torch.full((index.numel(),), float(wid + 1))
        priority[::10] = 0.0
        rb.update_priority(index, priority)


def test_sharing_with_spawned_workers():
    storage = LazyMemmapStorage(1000)
    sampler = SharedPrioritizedSampler(1000, alpha=1.0, beta=0.5)
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=256)
    rb.extend(_rows(-1, torch.arange(5)))
    procs = [SPAWN.Process(target=_prioritized_worker, args=(storage, sampler, 0, 400, 50))]
    for p in procs:
        p.start()
    _join(procs)
    assert len(rb) == 405 and rb.write_count == 405
    data = rb[:]
    assert torch.equal(data["index"], torch.arange(405))
    assert data["wid"][:5].eq(-1).all() and torch.equal(data["seq"][5:], torch.arange(400))
    # The worker's priorities reached the parent's tree.
    leaves = sampler.tree.values()[:405]
    assert torch.equal(leaves[:5], torch.ones(5))
    expected = torch.ones(400)
    expected[::10] = 0
    assert torch.allclose(leaves[5:].double(), expected.double(), atol=1e-6)
    batch = rb.sample()
    assert not bool((batch["seq"] % 10 == 0)[batch["wid"] == 0].any())
    storage.cleanup()


def test_empty_storage_cannot_be_spawned_without_shared_init():
    storage = LazyMemmapStorage(10)
    proc = SPAWN.Process(target=_storage_worker, args=(storage, 0, 1, 1))
    with pytest.raises(StorageNotSharableError):
        proc.start()


# ---------------------------------------------------------------------------- concurrent writers
def _indexed_worker(storage, wid: int, n: int, batch: int, barrier, returned, first_written=None):
    rb = gpubuf.TensorDictReplayBuffer(storage=storage)
    barrier.wait()
    for s in range(0, n, batch):
        seq = torch.arange(s, min(s + batch, n))
        returned[wid, s : s + seq.numel()] = rb.extend(_rows(wid, seq))
        if s == 0 and first_written is not None:
            first_written.wait()  # the parent samples from here on, while the rest is written


def _run_writers(capacity: int, workers: int, per_worker: int, batch: int, sample_while_writing: bool = False):
    storage = LazyMemmapStorage(capacity)
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, batch_size=512)
    rb.extend(_rows(-1, torch.arange(1)))  # the parent creates the files
    rb.empty()
    returned = torch.full((workers, per_worker), -1, dtype=torch.long).share_memory_()
    barrier = FORK.Barrier(workers)
    # With sampling, every worker waits after its first batch until the parent joins: rows are
    # there to sample, however the processes were scheduled.
    first_written = FORK.Barrier(workers + 1) if sample_while_writing else None
    procs = [
        FORK.Process(target=_indexed_worker, args=(storage, w, per_worker, batch, barrier, returned, first_written))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    samples = 0
    if sample_while_writing:
        first_written.wait()
        while True:
            batch_td = rb.sample()
            # Every row below len() holds written data: its stored index is its position.
            assert torch.equal(rb.storage.get(batch_td["index"])["index"], batch_td["index"])
            assert (batch_td["wid"] >= 0).all()
            samples += 1
            if not any(p.is_alive() for p in procs):
                break
            time.sleep(0.005)
    _join(procs)
    return rb, returned, samples


def test_eight_processes_800k_rows_no_loss_no_duplicate():
    workers, per_worker = 8, 100_000
    rb, returned, samples = _run_writers(800_000, workers, per_worker, batch=2_000, sample_while_writing=True)
    assert len(rb) == 800_000 and rb.write_count == 800_000
    data = rb.storage.get(torch.arange(800_000))
    # Each slot holds the row its writer was told it went to.
    assert torch.equal(data["index"], torch.arange(800_000))
    assert torch.equal(returned[data["wid"], data["seq"]], torch.arange(800_000))
    key = data["wid"] * per_worker + data["seq"]
    assert torch.unique(key).numel() == 800_000  # 800,000 distinct rows: none lost, none duplicated
    assert int(key.min()) == 0 and int(key.max()) == workers * per_worker - 1
    assert samples > 0
    rb.storage.cleanup()


def test_concurrent_writers_wrap_around():
    workers, per_worker, capacity = 8, 25_000, 50_000
    rb, returned, _ = _run_writers(capacity, workers, per_worker, batch=500)
    total = workers * per_worker
    assert len(rb) == capacity and rb.write_count == total
    assert rb.writer._cursor == total % capacity
    data = rb.storage.get(torch.arange(capacity))
    assert torch.equal(data["index"], torch.arange(capacity))
    # Every surviving row is where its writer put it; no row is there twice.
    assert torch.equal(returned[data["wid"], data["seq"]], torch.arange(capacity))
    assert torch.unique(data["wid"] * per_worker + data["seq"]).numel() == capacity
    # Every reservation got a slot, in order: the returned indices cover each slot total/capacity times.
    assert torch.equal(torch.bincount(returned.flatten(), minlength=capacity), torch.full((capacity,), total // capacity))
    rb.storage.cleanup()


def _add_worker(storage, wid: int, n: int, barrier):
    rb = gpubuf.ReplayBuffer(storage=storage)
    barrier.wait()
    for i in range(n):
        rb.add(torch.tensor([wid, i]))


def test_add_from_several_processes():
    storage = LazyMemmapStorage(2_000)
    barrier = FORK.Barrier(4)
    rb = gpubuf.ReplayBuffer(storage=storage)
    rb.add(torch.tensor([-1, 0]))
    procs = [FORK.Process(target=_add_worker, args=(storage, w, 200, barrier)) for w in range(4)]
    for p in procs:
        p.start()
    _join(procs)
    assert len(rb) == 801
    rows = rb[:]
    assert len({tuple(r) for r in rows.tolist()}) == 801
    storage.cleanup()


# -------------------------------------------------------------------------------------- shared_init
def _slow_create(real):
    def create(path, nbytes, *, exclusive):
        time.sleep(0.1)  # a slow file system: peers must wait, not see half-made files
        return real(path, nbytes, exclusive=exclusive)

    return create


def _shared_init_worker(root: str, wid: int, n: int, barrier, results):
    _memmap_files.create_file = _slow_create(_memmap_files.create_file)
    barrier.wait()
    storage = LazyMemmapStorage(10_000, scratch_dir=root, shared_init=True)
    rb = gpubuf.TensorDictReplayBuffer(storage=storage)
    rb.extend(_rows(wid, torch.arange(n)))
    complete = all(os.path.getsize(path) == 10_000 * 8 for path in storage.files.values())
    complete = complete and os.path.isfile(os.path.join(root, ".gpubuf", "layout.json"))
    mine = storage.get(torch.arange(len(storage)))
    seen = int((mine["wid"] == wid).sum())
    results[wid] = torch.tensor([int(storage._created_files), int(complete), seen])


def test_shared_init_six_processes_started_together(tmp_path):
    workers, n = 6, 300
    root = str(tmp_path / "shared")
    barrier = FORK.Barrier(workers)
    results = torch.zeros(workers, 3, dtype=torch.long).share_memory_()
    procs = [FORK.Process(target=_shared_init_worker, args=(root, w, n, barrier, results)) for w in range(workers)]
    for p in procs:
        p.start()
    _join(procs)
    created, complete, seen = results.unbind(1)
    assert int(created.sum()) == 1  # exactly one process created the files
    assert bool(complete.all())  # nobody saw a half-created storage
    assert torch.equal(seen, torch.full((workers,), n))
    reader = LazyMemmapStorage(10_000, scratch_dir=root, shared_init=True)
    assert len(reader) == workers * n and not reader._created_files
    data = reader.get(torch.arange(workers * n))
    assert torch.equal(data["index"], torch.arange(workers * n))
    assert len(set(zip(data["wid"].tolist(), data["seq"].tolist()))) == workers * n
    assert reader.cleanup() is True  # a scratch_dir of the user's: removal is explicit
    assert os.listdir(root) == [] if os.path.isdir(root) else True


def test_shared_init_storage_built_by_the_parent_spawn():
    storage = LazyMemmapStorage(1_000, shared_init=True)  # nothing written: the workers initialise it
    assert os.path.isdir(storage.scratch_dir)
    procs = [SPAWN.Process(target=_storage_worker, args=(storage, w, 100, 25)) for w in range(2)]
    for p in procs:
        p.start()
    _join(procs)
    assert len(storage) == 200
    data = storage.get(torch.arange(200))
    assert sorted(zip(data["wid"].tolist(), data["seq"].tolist())) == [(w, i) for w in range(2) for i in range(100)]
    directory = storage.scratch_dir
    assert storage.cleanup() is True and not os.path.exists(directory)


@pytest.mark.parametrize("context", [FORK, SPAWN], ids=["fork", "spawn"])
def test_a_lazy_tensor_storage_with_shared_init_is_written_by_its_workers(context):
    """TorchRL's LazyTensorStorage(shared_init=True): built empty in the parent, handed to workers
    with the buffer, initialised by the first of them to write; every row of every worker lands."""
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(1_000, shared_init=True), batch_size=8)
    assert not rb.storage.initialized
    procs = [context.Process(target=_storage_worker, args=(rb.storage, w, 100, 25)) for w in range(3)]
    for p in procs:
        p.start()
    _join(procs)
    assert len(rb) == 300 and rb.write_count == 300
    data = rb[:]
    assert sorted(zip(data["wid"].tolist(), data["seq"].tolist())) == [(w, i) for w in range(3) for i in range(100)]
    assert rb.sample().batch_size == (8,)
    directory = rb.storage.scratch_dir
    assert rb.storage.cleanup() is True and not os.path.exists(directory)


# ------------------------------------------------------------------------------ shared priorities
def test_shared_prioritized_sampler_fork():
    workers, n, capacity = 4, 2_000, 10_000
    storage = LazyMemmapStorage(capacity)
    sampler = SharedPrioritizedSampler(capacity, alpha=1.0, beta=1.0)
    rb = gpubuf.TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=4096)
    rb.extend(_rows(-1, torch.arange(10)))
    barrier = FORK.Barrier(workers)
    procs = [
        FORK.Process(target=_prioritized_worker, args=(storage, sampler, w, n, 100, barrier)) for w in range(workers)
    ]
    for p in procs:
        p.start()
    _join(procs)
    total = 10 + workers * n
    assert len(rb) == total
    data = storage.get(torch.arange(total))
    expected = (data["wid"] + 1).double()
    expected[data["wid"] >= 0] *= (data["seq"][data["wid"] >= 0] % 10 != 0).double()
    expected[:10] = 1.0  # the parent's rows kept the default priority
    # Every process's updates landed in the one tree, and its internal nodes agree with its leaves.
    leaves = sampler.tree.values()[:total].double()
    assert torch.allclose(leaves, expected, atol=1e-6)
    assert float(sampler.tree.total()) == pytest.approx(float(expected.sum()), rel=1e-9)
    assert sampler.default_priority == 4.0  # the largest priority any process set
    batch, info = rb.sample(return_info=True)
    assert not bool(((batch["seq"] % 10 == 0) & (batch["wid"] >= 0)).any())
    counts = torch.bincount(batch["wid"][batch["wid"] >= 0], minlength=workers).double()
    share = counts / counts.sum()
    assert share[3] > share[0] * 2  # priority 4 rows drawn far more than priority 1 rows
    weight = info["priority_weight"]
    assert torch.allclose(weight.double(), (leaves[info["index"]] / leaves[leaves > 0].min()) ** -1.0, rtol=1e-5)
    storage.cleanup()


# ------------------------------------------------------------------ in-memory tensor storages, spawned
def _spawned_tensor_writer(rb, wid: int, n: int, batch: int, barrier) -> None:
    barrier.wait()
    for s in range(0, n, batch):
        rb.extend(_rows(wid, torch.arange(s, s + batch)))


def test_spawned_processes_extending_a_lazy_tensor_storage_lose_no_rows():
    """TorchRL's usage with an in-memory storage: the buffer itself goes to spawned workers. The
    rows travel as shared memory and the length and cursor as a shared state file, so the workers'
    rows land in distinct slots the parent sees, and the parent's own writes go on after them."""
    workers, per_worker, batch = 3, 600, 50
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(4_000), batch_size=16)
    rb.extend(_rows(-1, torch.arange(10)))
    barrier = SPAWN.Barrier(workers)
    procs = [SPAWN.Process(target=_spawned_tensor_writer, args=(rb, w, per_worker, batch, barrier)) for w in range(workers)]
    for p in procs:
        p.start()
    _join(procs)
    total = 10 + workers * per_worker
    assert len(rb) == total and rb.write_count == total
    data = rb[:]
    assert torch.equal(data["index"], torch.arange(total))  # each slot holds the row written there
    key = data["wid"] * per_worker + data["seq"]
    assert torch.unique(key[data["wid"] >= 0]).numel() == workers * per_worker  # none lost, none twice
    rb.extend(_rows(-2, torch.arange(5)))  # the parent's cursor is past the workers' rows
    assert len(rb) == total + 5 and torch.equal(rb[total:]["wid"], torch.full((5,), -2))
    assert set(rb.sample(256)["wid"].unique().tolist()) <= {-2, -1, 0, 1, 2}


def test_an_empty_lazy_tensor_storage_is_not_sent_to_a_spawned_process():
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(10))
    proc = SPAWN.Process(target=_torchrl_worker, args=(rb,))
    with pytest.raises(StorageNotSharableError, match="Cowardly refusing to share a storage of type LazyTensorStorage"):
        proc.start()
    rb.extend(TensorDict({"a": torch.zeros(3)}, [3]))  # the buffer still works, on its own
    assert len(rb) == 3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda lib: lib.TensorDictReplayBuffer(storage=lib.ListStorage(20)), "Cannot share a storage of type"),
        (lambda lib: lib.TensorDictReplayBuffer(storage=lib.LazyStackStorage(20)), "Cannot share a storage of type"),
        (lambda lib: lib.TensorDictReplayBuffer(storage=lib.LazyMemmapStorage(20),
                                                sampler=lib.PrioritizedSampler(20, 0.7, 0.5)),
         "cannot be shared between processes"),
        (lambda lib: lib.TensorDictReplayBuffer(storage=lib.LazyMemmapStorage(20),
                                                sampler=lib.PrioritizedSliceSampler(20, 0.7, 0.5, num_slices=2)),
         "cannot be shared between processes"),
        (lambda lib: lib.TensorDictReplayBuffer(storage=lib.LazyMemmapStorage(20),
                                                writer=lib.TensorDictMaxValueWriter(rank_key="a")),
         "cannot be shared between processes"),
    ],
    ids=["list", "lazy_stack", "prioritized", "prioritized_slice", "max_value_writer"],
)
def test_components_whose_state_stays_in_one_process_are_not_sent_to_a_spawned_process(make, match):
    """As TorchRL refuses them: the child would write to copies the parent never sees. The refusal
    comes before any process starts, and the buffer is unchanged; a plain pickle still copies."""
    import pickle

    # TorchRL's own tensor storages keep counters in fork-context multiprocessing values, which a
    # spawn-context process refuses before TorchRL's refusal is reached: compared on list storages.
    compared = "storage of type" in match
    torchrl_data = pytest.importorskip("torchrl.data") if compared else None
    for lib in (torchrl_data, gpubuf) if compared else (gpubuf,):
        rb = make(lib)
        rb.extend(TensorDict({"a": torch.arange(4.0), ("next", "done"): torch.zeros(4, 1, dtype=torch.bool)}, [4]))
        proc = SPAWN.Process(target=_torchrl_worker, args=(rb,))
        with pytest.raises(RuntimeError, match=match):
            proc.start()
        assert len(rb) == 4
        if lib is gpubuf:
            assert len(pickle.loads(pickle.dumps(rb))) == 4
            with pytest.raises(gpubuf.errors.NotSharableError):
                SPAWN.Process(target=_torchrl_worker, args=(rb,)).start()


def _prioritized_tensor_worker(rb) -> None:
    rb.extend(TensorDict({"a": torch.ones(10), "td_error": torch.full((10,), 100.0)}, [10]))


def test_a_shared_prioritized_sampler_over_an_in_memory_storage_with_spawned_writers():
    """What the refusal of ``sync=False`` points to: writer processes extend the buffer itself,
    their rows' priorities go into the one shared tree, and the learner draws them."""
    with pytest.raises(NotImplementedError, match="SharedPrioritizedSampler"):
        gpubuf.TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=0.5, sync=False)
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(40), batch_size=256, priority_key="td_error",
                                       sampler=SharedPrioritizedSampler(40, alpha=1.0, beta=0.5))
    rb.extend(TensorDict({"a": torch.zeros(10), "td_error": torch.full((10,), 1.0)}, [10]))
    procs = [SPAWN.Process(target=_prioritized_tensor_worker, args=(rb,))]
    procs[0].start()
    _join(procs)
    assert len(rb) == 20 and torch.equal(rb[10:20]["a"], torch.ones(10))
    drawn = rb.sample()["index"]
    # Priorities 100 against 1: the workers' rows hold 1000/1010 of the mass.
    assert 0.95 < float((drawn >= 10).float().mean()) <= 1.0
