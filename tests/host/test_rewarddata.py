"""RewardData: TorchRL's tensorclass, through memmap and through every storage, with random lengths."""

from __future__ import annotations

import inspect

import pytest
import torch
from tensordict import LazyStackedTensorDict, TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, TensorStorage
from gpubuf.data import RewardData, load_memmap_packed, memmap_packed, pack_jagged, reward_data_from_sequences, unpack_jagged
from gpubuf.errors import SchemaMismatchError, UnsupportedDataError
from gpubuf.storages.packed import PackedStorage
from gpubuf.storages.stack import LazyStackStorage

torchrl_llm = pytest.importorskip("torchrl.data.llm")


def _items(n, gen, lo=1, hi=40, rewards=True):
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    ids = [torch.randint(0, 32000, (length,), generator=gen) for length in lengths]
    masks = [torch.rand(length, generator=gen) > 0.2 for length in lengths]
    per_token = [torch.randn(length, generator=gen) for length in lengths] if rewards else None
    return reward_data_from_sequences(ids, masks, per_token, torch.randn(n, generator=gen))


def _rows_equal(batch, items, index):
    """Row b of the batch is item index[b], field by field (jagged, dense or lazily stacked)."""
    assert batch.batch_size == (len(index),)
    lazy = isinstance(batch._tensordict, LazyStackedTensorDict)
    for field in ("input_ids", "attention_mask", "rewards", "end_scores"):
        if getattr(items[0], field) is None:
            assert getattr(batch, field) is None
            continue
        if lazy:
            # Ragged fields of a lazy stack are read row by row (TorchRL's attribute access would stack them).
            rows = [getattr(batch[b], field) for b in range(len(index))]
        else:
            rows = getattr(batch, field).unbind(0)
        for b, i in enumerate(index):
            assert torch.equal(rows[b], getattr(items[i], field)), (field, b, i)


def test_same_fields_and_constructor_as_torchrl():
    ours, theirs = RewardData, torchrl_llm.RewardData
    assert list(ours.__dataclass_fields__) == list(theirs.__dataclass_fields__)
    assert str(inspect.signature(ours.__init__)) == str(inspect.signature(theirs.__init__))
    data = RewardData(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3), batch_size=[2], names=["b"])
    assert data.rewards is None and data.end_scores is None and data.names == ["b"]
    for method in ("memmap", "memmap_", "memmap_like", "load_memmap", "save", "state_dict", "to_tensordict", "unbind"):
        assert callable(getattr(data, method))


def test_memmap_round_trip_fixed_length(tmp_path):
    gen = torch.Generator().manual_seed(0)
    data = RewardData(
        input_ids=torch.randint(0, 100, (4, 6), generator=gen),
        attention_mask=torch.rand(4, 6, generator=gen) > 0.5,
        end_scores=torch.randn(4, generator=gen),
        batch_size=[4],
    )
    mm = data.memmap(tmp_path / "a")
    loaded = RewardData.load_memmap(tmp_path / "a")
    assert isinstance(loaded, RewardData) and loaded.rewards is None
    assert torch.equal(loaded.input_ids, data.input_ids) and torch.equal(loaded.end_scores, data.end_scores)
    assert mm.is_memmap()
    like = data.memmap_like(tmp_path / "b")
    assert like.input_ids.shape == (4, 6)
    copy = data.clone().memmap_()
    assert torch.equal(copy.attention_mask, data.attention_mask)
    data.save(tmp_path / "c")
    assert torch.equal(RewardData.load_memmap(tmp_path / "c").input_ids, data.input_ids)
    state = data.state_dict()
    fresh = RewardData(input_ids=torch.zeros(4, 6, dtype=torch.long), attention_mask=torch.zeros(4, 6, dtype=torch.bool), end_scores=torch.zeros(4), batch_size=[4])
    fresh.load_state_dict(state)
    assert torch.equal(fresh.input_ids, data.input_ids)
    assert set(data.to_tensordict().keys()) == {"input_ids", "attention_mask", "end_scores"}
    assert [r.batch_size for r in data.unbind(0)] == [torch.Size([])] * 4


def test_random_length_batch_round_trips_through_memmap(tmp_path):
    gen = torch.Generator().manual_seed(1)
    items = _items(30, gen)
    rb = ReplayBuffer(storage=PackedStorage(30), batch_size=12)
    rb.extend(items)
    batch, info = rb.sample(return_info=True)
    assert batch.input_ids.is_nested
    memmap_packed(batch, tmp_path / "batch")
    loaded = load_memmap_packed(tmp_path / "batch", RewardData)
    assert isinstance(loaded, RewardData)
    _rows_equal(loaded, items, info["index"].tolist())
    # The packed form is plain tensors; unpack without a class gives a TensorDict.
    assert isinstance(unpack_jagged(pack_jagged(batch)), TensorDict)


def _storages():
    return {
        "list": lambda: ListStorage(64),
        "lazystack": lambda: LazyStackStorage(64),
        "lazystack-densify": lambda: LazyStackStorage(64, densify=True),
        "packed": lambda: PackedStorage(64),
    }


@pytest.mark.parametrize("name", list(_storages()))
def test_random_lengths_stored_sampled_saved_and_loaded(name, tmp_path):
    gen = torch.Generator().manual_seed(2)
    items = _items(50, gen)
    make = _storages()[name]
    rb = ReplayBuffer(storage=make(), batch_size=16)
    rb.extend(items)
    batch, info = rb.sample(return_info=True)
    index = info["index"].tolist()
    if name == "list":
        assert isinstance(batch, list)  # ragged items cannot be stacked: ListStorage returns them as they are
        for b, i in enumerate(index):
            assert batch[b] is items[i]
    else:
        assert isinstance(batch, RewardData)
        if name == "lazystack":
            assert isinstance(batch._tensordict, LazyStackedTensorDict)
        _rows_equal(batch, items, index)

    torch.save(rb.state_dict(), tmp_path / "state.pt")
    from_state = ReplayBuffer(storage=make(), batch_size=16)
    from_state.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
    rb.dumps(tmp_path / "checkpoint")  # gpubuf's pickle-free checkpoint
    from_checkpoint = ReplayBuffer(storage=make(), batch_size=16)
    from_checkpoint.loads(tmp_path / "checkpoint")
    for other in (from_state, from_checkpoint):
        assert len(other) == 50
        if name == "list":
            for i in range(50):
                assert torch.equal(other[i].input_ids, items[i].input_ids)
        else:
            _rows_equal(other.storage.get(torch.arange(50)), items, list(range(50)))


@pytest.mark.parametrize("storage_cls", [LazyTensorStorage, TensorStorage])
def test_fixed_length_reward_data_in_tensor_storages(storage_cls, tmp_path):
    gen = torch.Generator().manual_seed(3)
    data = RewardData(
        input_ids=torch.randint(0, 100, (10, 8), generator=gen),
        attention_mask=torch.ones(10, 8, dtype=torch.bool),
        end_scores=torch.randn(10, generator=gen),
        batch_size=[10],
    )
    if storage_cls is TensorStorage:
        rb = ReplayBuffer(storage=TensorStorage(data.clone()), batch_size=4)
    else:
        rb = ReplayBuffer(storage=storage_cls(10), batch_size=4)
        rb.extend(data)
    batch, info = rb.sample(return_info=True)
    assert isinstance(batch, RewardData) and batch.rewards is None
    assert torch.equal(batch.input_ids, data.input_ids[info["index"]])
    state = rb.state_dict()
    torch.save(state, tmp_path / "s.pt")
    other = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    other.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=False))
    assert torch.equal(other[:].end_scores, data.end_scores)


def test_packed_rows_share_one_gather_and_offsets():
    gen = torch.Generator().manual_seed(4)
    items = _items(20, gen)
    storage = PackedStorage(20)
    storage.set(range(20), items)
    # input_ids, attention_mask and per-token rewards share their lengths: one group, one gather.
    assert len(storage._groups) == 2  # the 0-d end_scores is a group of its own
    batch = storage.get(torch.tensor([3, 3, 19, 0]))
    assert batch.input_ids.offsets() is batch.attention_mask.offsets() is batch.rewards.offsets()
    _rows_equal(batch, items, [3, 3, 19, 0])


def test_groups_split_when_lengths_stop_matching():
    storage = PackedStorage(10)
    same = RewardData(input_ids=torch.arange(4), attention_mask=torch.ones(4), batch_size=[])
    storage.set(0, same)
    assert len(storage._groups) == 1
    different = RewardData(input_ids=torch.arange(3), attention_mask=torch.ones(5), batch_size=[])
    storage.set(1, different)
    assert len(storage._groups) == 2
    batch = storage.get([0, 1, 0])
    assert [r.tolist() for r in batch.input_ids.unbind()] == [[0, 1, 2, 3], [0, 1, 2], [0, 1, 2, 3]]
    assert [len(r) for r in batch.attention_mask.unbind()] == [4, 5, 4]


def test_bad_reward_data_is_refused_and_storage_unchanged():
    gen = torch.Generator().manual_seed(5)
    rb = ReplayBuffer(storage=PackedStorage(10))
    rb.extend(_items(3, gen))
    before = (len(rb), repr(rb.storage.state_dict()))
    with pytest.raises(SchemaMismatchError, match="missing"):
        rb.extend(_items(2, gen, rewards=False))  # rewards absent where items had them
    with pytest.raises(UnsupportedDataError, match="RewardData"):
        rb.add(TensorDict(input_ids=torch.arange(3)))
    with pytest.raises(UnsupportedDataError, match="batch_size"):
        rb.add(RewardData(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3, dtype=torch.bool), batch_size=[2]))
    assert (len(rb), repr(rb.storage.state_dict())) == before
    tensor_rb = ReplayBuffer(storage=LazyTensorStorage(10))
    tensor_rb.extend(RewardData(input_ids=torch.zeros(2, 3, dtype=torch.long), attention_mask=torch.ones(2, 3), batch_size=[2]))
    with pytest.raises(SchemaMismatchError):
        tensor_rb.extend(RewardData(input_ids=torch.zeros(2, 4, dtype=torch.long), attention_mask=torch.ones(2, 4), batch_size=[2]))
    assert len(tensor_rb) == 2


def test_reward_data_from_sequences_checks_lengths():
    with pytest.raises(ValueError, match="attention_mask"):
        reward_data_from_sequences([torch.arange(3)], [torch.ones(4)])
    with pytest.raises(ValueError, match="end_scores"):
        reward_data_from_sequences([torch.arange(3)], end_scores=torch.zeros(2))
    (item,) = reward_data_from_sequences([torch.arange(3)])
    assert item.attention_mask.dtype == torch.bool and item.batch_size == ()


@pytest.mark.gpu
def test_packed_reward_data_on_gpu_equals_cpu():
    gen = torch.Generator().manual_seed(6)
    items = _items(64, gen, lo=64, hi=2048)
    cpu, gpu = PackedStorage(64), PackedStorage(64, device="cuda")
    cpu.set(range(64), items)
    gpu.set(range(64), items)
    index = torch.randint(0, 64, (32,), generator=gen)
    a, b = cpu.get(index), gpu.get(index.cuda())
    assert b.input_ids.is_cuda
    for x, y in zip(a.input_ids.unbind(), b.input_ids.unbind()):
        assert torch.equal(x, y.cpu())


@pytest.mark.parametrize("container", ["module_never_imported_here:RewardData", "os:system", "gpubuf.data.reward:torch"])
def test_a_packed_state_naming_anything_but_an_imported_tensorclass_is_refused(container):
    """A state names its items' class; loading looks it up in modules already imported and takes
    only a tensorclass type: no import on the state's word, nothing else called."""
    import sys

    gen = torch.Generator().manual_seed(5)
    saved = PackedStorage(8)
    saved.set(range(8), _items(8, gen))
    state = saved.state_dict()
    state["_schema"] = dict(state["_schema"], container=container)
    target = PackedStorage(8)
    target.set(range(3), _items(3, gen))
    before = target.get(torch.arange(3))
    with pytest.raises(SchemaMismatchError, match="never imports code|not a tensorclass"):
        target.load_state_dict(state)
    assert "module_never_imported_here" not in sys.modules
    assert len(target) == 3
    _rows_equal(target.get(torch.arange(3)), before, [0, 1, 2])
    # The class recorded by the storage itself loads.
    fresh = PackedStorage(8)
    fresh.load_state_dict(saved.state_dict())
    assert isinstance(fresh.get(torch.arange(2)), RewardData)
