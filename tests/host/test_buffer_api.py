"""The core replay-buffer API behaves as TorchRL's ``torchrl.data`` does."""

import pytest
import torch
from tensordict import TensorDict, tensorclass

import gpubuf
from gpubuf import (
    LazyTensorStorage,
    ListStorage,
    RandomSampler,
    ReplayBuffer,
    RoundRobinWriter,
    SamplerWithoutReplacement,
    TensorDictReplayBuffer,
    TensorDictRoundRobinWriter,
    TensorStorage,
)


def make_td(n, start=0):
    base = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(
        {
            "obs": base[:, None].expand(n, 3).clone(),
            ("next", "obs"): (base[:, None] + 0.5).expand(n, 3).clone(),
            "done": (base[:, None] % 2 == 0),
        },
        batch_size=[n],
    )


@tensorclass
class Transition:
    obs: torch.Tensor
    reward: torch.Tensor


def test_defaults_match_torchrl():
    rb = ReplayBuffer()
    assert isinstance(rb.storage, ListStorage) and rb.storage.max_size == 1000
    assert isinstance(rb.sampler, RandomSampler)
    assert isinstance(rb.writer, RoundRobinWriter)
    assert isinstance(TensorDictReplayBuffer().writer, TensorDictRoundRobinWriter)
    assert TensorDictReplayBuffer().priority_key == "td_error"
    assert LazyTensorStorage(5).device == torch.device("cpu")


def test_extend_returns_round_robin_indices_and_wraps():
    rb = ReplayBuffer(storage=LazyTensorStorage(5))
    assert rb.extend(torch.arange(3)).tolist() == [0, 1, 2]
    assert rb.extend(torch.arange(3, 7)).tolist() == [3, 4, 0, 1]
    assert len(rb) == 5
    assert rb.write_count == 7
    assert rb.writer._cursor == 2
    assert rb[:].tolist() == [5, 6, 2, 3, 4]


def test_extend_longer_than_capacity_keeps_the_last_rows():
    rb = ReplayBuffer(storage=LazyTensorStorage(4))
    rb.extend(torch.arange(2))
    index = rb.extend(torch.arange(10, 20))
    assert index.tolist() == [i % 4 for i in range(2, 12)]
    # A sequential writer would leave rows 16..19 behind, at positions 0..3 after 12 writes.
    assert sorted(rb[:].tolist()) == [16, 17, 18, 19]
    assert rb.writer._cursor == 0
    assert rb.write_count == 12


def test_add_returns_index_and_stores_item():
    rb = ReplayBuffer(storage=LazyTensorStorage(3))
    assert rb.add(torch.tensor([1.0, 2.0])) == 0
    assert rb.add(torch.tensor([3.0, 4.0])) == 1
    assert torch.equal(rb[1], torch.tensor([3.0, 4.0]))
    assert len(rb) == 2 and rb.write_count == 2


def test_tensordict_buffer_sample_carries_index_and_matching_rows():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=16, generator=torch.Generator().manual_seed(0))
    data = make_td(40)
    rb.extend(data)
    # the writer records indices in the stored rows, not in the caller's TensorDict (as TorchRL)
    assert "index" not in data.keys() and "index" not in data["next"].keys()
    assert torch.equal(rb[:]["index"], torch.arange(40))
    batch = rb.sample()
    assert batch.batch_size == torch.Size([16])
    index = batch["index"]
    assert index.dtype == torch.int64
    assert torch.equal(batch["obs"][:, 0], index.float())
    assert torch.equal(batch["next", "obs"][:, 0], index.float() + 0.5)
    assert torch.equal(batch["done"][:, 0], index % 2 == 0)
    assert batch.device == torch.device("cpu")


def test_sample_return_info_has_index():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.extend(torch.arange(10) * 10)
    batch, info = rb.sample(return_info=True)
    assert set(info) == {"index"}
    assert torch.equal(batch, info["index"] * 10)


def test_sample_batch_size_argument_overrides_default():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.extend(torch.arange(10))
    assert rb.sample().shape == (4,)
    assert rb.sample(7).shape == (7,)


def test_same_generator_seed_gives_same_samples():
    def run():
        rb = TensorDictReplayBuffer(
            storage=LazyTensorStorage(100), batch_size=8, generator=torch.Generator().manual_seed(123)
        )
        rb.extend(make_td(100))
        return [rb.sample()["index"] for _ in range(3)]

    for a, b in zip(run(), run()):
        assert torch.equal(a, b)


def test_getitem_int_slice_tensor_and_key():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(make_td(6))
    item = rb[2]
    assert item.batch_size == torch.Size([])
    assert item["obs"].tolist() == [2.0, 2.0, 2.0]
    assert rb[-1]["obs"][0] == 5.0
    assert rb[1:4]["obs"][:, 0].tolist() == [1.0, 2.0, 3.0]
    assert rb[torch.tensor([5, 0])]["obs"][:, 0].tolist() == [5.0, 0.0]
    assert rb[[4, 4]]["obs"][:, 0].tolist() == [4.0, 4.0]
    assert rb["obs"].shape == (6, 3)
    assert rb["next", "obs"].shape == (6, 3)


def test_tensorclass_data_round_trip():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=5)
    data = Transition(obs=torch.arange(8.0)[:, None].expand(8, 2).clone(), reward=torch.arange(8.0), batch_size=[8])
    rb.extend(data)
    batch, info = rb.sample(return_info=True)
    assert isinstance(batch, Transition)
    assert torch.equal(batch.reward, info["index"].float())
    assert torch.equal(batch.obs[:, 1], info["index"].float())


def test_pytree_data_round_trip():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)
    rb.extend({"a": torch.arange(5), "b": (torch.arange(5) * 2, torch.ones(5, 2))})
    batch, info = rb.sample(return_info=True)
    assert torch.equal(batch["a"], info["index"])
    assert torch.equal(batch["b"][0], info["index"] * 2)
    assert batch["b"][1].shape == (3, 2)


def test_list_of_items_is_stacked():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    assert rb[:].tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_list_storage_holds_arbitrary_objects():
    rb = ReplayBuffer(batch_size=3, generator=torch.Generator().manual_seed(0))
    rb.extend(["a", {"b": 1}, 3])
    assert rb[1] == {"b": 1}
    assert len(rb.sample()) == 3
    rb2 = ReplayBuffer(storage=ListStorage(10), batch_size=4)
    rb2.extend([torch.ones(2), torch.zeros(2)])
    assert rb2.sample().shape == (4, 2)  # tensors of one shape are stacked


def test_empty_resets_length_cursor_and_write_count():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.arange(4))
    rb.empty(empty_write_count=False)
    assert len(rb) == 0 and rb.writer._cursor == 0 and rb.write_count == 4
    rb.extend(torch.arange(2))
    rb.empty()
    assert rb.write_count == 0


def test_device_none_or_auto_comes_from_first_batch():
    for device in (None, "auto"):
        storage = LazyTensorStorage(10, device=device)
        rb = ReplayBuffer(storage=storage, batch_size=2)
        rb.extend(torch.arange(3))
        assert storage.device == torch.device("cpu")
        assert rb.sample().device == torch.device("cpu")


def test_tensor_storage_over_given_data():
    data = TensorDict({"a": torch.arange(6.0)}, [6])
    storage = TensorStorage(data)
    assert len(storage) == 6 and storage.max_size == 6
    assert storage.get(3)["a"] == 3.0
    rb = ReplayBuffer(storage=storage, batch_size=2)
    assert rb.sample().batch_size == torch.Size([2])


def test_sampler_without_replacement_covers_each_item_once_per_epoch():
    rb = ReplayBuffer(
        storage=LazyTensorStorage(20), sampler=SamplerWithoutReplacement(), batch_size=6,
        generator=torch.Generator().manual_seed(1),
    )
    rb.extend(torch.arange(20))
    batches = list(rb)
    assert [len(b) for b in batches] == [6, 6, 6, 2]
    assert sorted(torch.cat(batches).tolist()) == list(range(20))
    # A second epoch again covers every item.
    assert sorted(torch.cat(list(rb)).tolist()) == list(range(20))


def test_sampler_without_replacement_drop_last_and_no_shuffle():
    rb = ReplayBuffer(
        storage=LazyTensorStorage(10), sampler=SamplerWithoutReplacement(drop_last=True, shuffle=False), batch_size=4
    )
    rb.extend(torch.arange(10))
    batches = list(rb)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_transforms_apply_on_sample_and_invert_on_write():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.append_transform(lambda x: x * 10)
    rb.insert_transform(0, lambda x: x + 1)
    rb.extend(torch.zeros(5))
    assert torch.equal(rb.sample(), torch.full((4,), 10.0))  # (0 + 1) * 10: insertion order kept

    rb2 = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    rb2.append_transform(lambda x: x + 100, invert=True)
    rb2.extend(torch.zeros(3))
    assert torch.equal(rb2.storage.get(0), torch.tensor(100.0))


def test_ndim2_storage_counts_elements_and_samples_coordinates():
    storage = LazyTensorStorage(12, ndim=2)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=5)
    # data laid out [n_envs=3, time=4]; the default dim_extend=1 writes time along dim 0
    data = TensorDict({"obs": torch.arange(12.0).reshape(3, 4)}, [3, 4])
    rb.extend(data)
    assert len(rb) == 12
    assert storage.shape == torch.Size([4, 3])
    batch = rb.sample()
    index = batch["index"]
    assert index.shape == (5, 2)
    t, env = index.unbind(-1)
    assert torch.equal(batch["obs"], data["obs"][env, t])


def test_prefetch_returns_valid_batches():
    rb = ReplayBuffer(storage=LazyTensorStorage(100), batch_size=8, prefetch=3)
    rb.extend(torch.arange(100))
    for _ in range(10):
        batch = rb.sample()
        assert batch.shape == (8,) and batch.max() < 100


torchrl_data = pytest.importorskip("torchrl.data", reason="TorchRL is not installed: side-by-side checks skipped")


def test_side_by_side_with_torchrl_writes_and_reads():
    ours = TensorDictReplayBuffer(storage=LazyTensorStorage(7))
    theirs = torchrl_data.TensorDictReplayBuffer(storage=torchrl_data.LazyTensorStorage(7))
    for start, n in ((0, 3), (3, 5), (8, 6)):
        a, b = make_td(n, start), make_td(n, start)
        assert torch.equal(ours.extend(a), theirs.extend(b))
        assert ("index" in a.keys()) == ("index" in b.keys())
        assert len(ours) == len(theirs)
        assert ours.write_count == theirs.write_count
    mine, ref = ours[:], theirs[:]
    assert set(mine.keys(True, True)) == set(ref.keys(True, True))
    for key in ref.keys(True, True):
        assert torch.equal(mine[key], ref[key]), key
    for i in (0, 3, -1):
        assert (ours[i] == theirs[i]).all()
    sample = ours.sample(4)
    ref_sample = theirs.sample(4)
    assert set(sample.keys(True, True)) == set(ref_sample.keys(True, True))
    assert sample.batch_size == ref_sample.batch_size


def test_side_by_side_with_torchrl_sampler_without_replacement_epochs():
    ours = ReplayBuffer(storage=LazyTensorStorage(10), sampler=SamplerWithoutReplacement(shuffle=False), batch_size=4)
    theirs = torchrl_data.ReplayBuffer(
        storage=torchrl_data.LazyTensorStorage(10),
        sampler=torchrl_data.SamplerWithoutReplacement(shuffle=False),
        batch_size=4,
    )
    ours.extend(torch.arange(10))
    theirs.extend(torch.arange(10))
    assert [b.tolist() for b in ours] == [b.tolist() for b in theirs]


@pytest.mark.parametrize("kind", ["tensor", "list", "memmap", "prioritized", "slice"])
def test_side_by_side_with_torchrl_an_empty_batch_writes_nothing(kind, tmp_path):
    """TorchRL's TensorDict buffers take an empty batch once they hold data: no index, no write,
    no cursor move. So do gpubuf's, whatever the storage and sampler."""

    def make(lib, scratch):
        storage = {"list": lambda: lib.ListStorage(12),
                   "memmap": lambda: lib.LazyMemmapStorage(12, scratch_dir=scratch)}.get(kind, lambda: lib.LazyTensorStorage(12))()
        if kind == "prioritized":
            return lib.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage, batch_size=4)
        sampler = lib.SliceSampler(num_slices=2, traj_key="episode") if kind == "slice" else lib.RandomSampler()
        return lib.TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=4)

    ours, theirs = make(gpubuf, tmp_path / "ours"), make(torchrl_data, tmp_path / "theirs")
    for rb in (ours, theirs):
        data = make_td(10)
        data["episode"] = torch.arange(10) // 5
        rb.extend(data)
    empty = make_td(0)
    empty["episode"] = torch.zeros(0, dtype=torch.int64)
    got, want = ours.extend(empty.clone()), theirs.extend(empty.clone())
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape == (0,)
    assert (len(ours), ours.write_count) == (len(theirs), theirs.write_count) == (10, 10)
    assert torch.equal(ours[:]["obs"], theirs[:]["obs"])
    assert ours.sample().batch_size == theirs.sample().batch_size


def test_gpubuf_exports_errors_module():
    assert issubclass(gpubuf.errors.EmptyBufferError, RuntimeError)


def test_large_cpu_leaves_go_on_huge_pages(monkeypatch):
    """With huge pages asked for, a leaf of 2 MiB or more is allocated on them (a sample's scattered rows
    then cost no TLB walk each); smaller leaves keep the ordinary allocator. Either way the rows
    read back, and the storage can still move to shared memory."""
    import math

    import gpubuf.storages.tensor as tensor_module
    from gpubuf.host_memory import HUGE_PAGE_BYTES

    calls = []
    real = tensor_module.empty_host

    def recording(shape, dtype, **kwargs):
        calls.append((math.prod(shape) * dtype.itemsize, kwargs))
        return real(shape, dtype, **kwargs)

    monkeypatch.setattr(tensor_module, "empty_host", recording)
    monkeypatch.setattr(tensor_module, "huge_pages_enabled", lambda: True)  # as after use_huge_pages()
    n = 40_000
    data = TensorDict({"obs": torch.randn(n, 16), "done": torch.rand(n, 1) > 0.5}, batch_size=[n])
    storage = LazyTensorStorage(n)
    TensorDictReplayBuffer(storage=storage).extend(data)
    assert calls == [(n * 16 * 4, {"huge_from": HUGE_PAGE_BYTES, "reuse": False})]  # obs only: done is 40 kB
    index = torch.randint(0, n, (64,), generator=torch.Generator().manual_seed(0))
    got = storage.get(index)
    assert torch.equal(got["obs"], data["obs"][index]) and torch.equal(got["done"], data["done"][index])
    for leaf in storage._leaves:
        leaf.share_memory_()
        assert leaf.is_shared()
    assert torch.equal(storage.get(index)["obs"], data["obs"][index])


def test_cpu_leaves_hold_exactly_their_capacity():
    """A leaf's memory is its capacity's rows and no more (no rounding to huge pages): the
    memory per stored row is TorchRL's. The rows read back, and the storage can still move to
    shared memory."""
    n = 40_000
    data = TensorDict({"obs": torch.randn(n, 16), "done": torch.rand(n, 1) > 0.5}, batch_size=[n])
    storage = LazyTensorStorage(n)
    TensorDictReplayBuffer(storage=storage).extend(data)
    # obs, done, and the "index" entry the TensorDict writer adds (as TorchRL's does)
    assert [leaf.untyped_storage().nbytes() for leaf in storage._leaves] == [n * 16 * 4, n, n * 8]
    index = torch.randint(0, n, (64,), generator=torch.Generator().manual_seed(0))
    got = storage.get(index)
    assert torch.equal(got["obs"], data["obs"][index]) and torch.equal(got["done"], data["done"][index])
    for leaf in storage._leaves:
        leaf.share_memory_()
        assert leaf.is_shared()
    assert torch.equal(storage.get(index)["obs"], data["obs"][index])


@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
def test_a_tensordict_buffer_of_items_without_entries_samples_their_indices(backend):
    """A TensorDict without entries stores only the buffer's "index" column, which the read fills
    itself: the gather has no field left to read (it indexed the first of none)."""
    rb = gpubuf.TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=4, backend=backend,
                                       generator=torch.Generator().manual_seed(0))
    rb.extend(TensorDict({}, batch_size=[3]))
    rb.add(TensorDict({}, batch_size=[]))
    batch = rb.sample()
    assert list(batch.keys()) == ["index"] and batch.batch_size == (4,)
    assert set(batch["index"].tolist()) <= {0, 1, 2, 3}
