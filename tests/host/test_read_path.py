"""The one read path of a sample: the drawn rows, the draw's info in TensorDict batches, transforms,
every storage, subclasses' own read steps, and a storage reallocated between samples."""

from __future__ import annotations

import sys

import pytest
import torch
from tensordict import TensorDict

from gpubuf.errors import IndexOutOfRangeError
from gpubuf import LazyMemmapStorage, LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.buffers.prioritized import PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer

CLASSES = [ReplayBuffer, TensorDictReplayBuffer, PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer]


def _data(n: int, with_index: bool) -> TensorDict:
    gen = torch.Generator().manual_seed(n)
    fields = {
        "obs": torch.randn(n, 6, generator=gen),
        "action": torch.randint(0, 5, (n, 2), generator=gen),
        "done": torch.rand(n, 1, generator=gen) < 0.1,
        "nested": {"reward": torch.randn(n, generator=gen)},
    }
    if with_index:
        fields["index"] = torch.full((n,), -7)  # a stored column the drawn indices replace
    return TensorDict(fields, [n])


def _make(cls, storage):
    kwargs = {"alpha": 0.7, "beta": 0.5} if "Prioritized" in cls.__name__ else {}
    rb = cls(storage=storage, batch_size=9, **kwargs)
    rb.extend(_data(40, with_index=False) if cls is ReplayBuffer else _data(40, with_index=True))
    if "Prioritized" in cls.__name__:
        rb.update_priority(torch.arange(40), torch.linspace(0.1, 2.0, 40))
    return rb


def _expected(rb, info):
    """The batch a sample of ``info["index"]`` must hold: the stored rows, read item by item."""
    return rb.storage.get(info["index"])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_sample_holds_the_drawn_rows_and_the_draw_s_info(cls):
    rb = _make(cls, LazyTensorStorage(40))
    torch.manual_seed(3)
    batch, info = rb.sample(return_info=True)
    stored = _expected(rb, info)
    for key in stored.keys(True, True):
        if key == "index" and issubclass(cls, TensorDictReplayBuffer):
            continue
        assert batch.get(key).dtype == stored.get(key).dtype, key
        assert torch.equal(batch.get(key), stored.get(key)), key
    if issubclass(cls, TensorDictReplayBuffer):
        # The stored "index" column holds the drawn indices, not the stored -7.
        assert torch.equal(batch["index"], info["index"])
        if "Prioritized" in cls.__name__:
            assert torch.equal(batch["priority_weight"], info["priority_weight"])
    else:
        # A plain buffer returns what is stored, a stored "index" column included.
        assert "priority_weight" not in batch.keys()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_transforms_apply_to_every_sample(cls):
    rb = _make(cls, LazyTensorStorage(40))
    rb.sample()
    rb.append_transform(lambda td: td.set("seen", torch.ones(td.batch_size)))
    assert bool(rb.sample()["seen"].all())


@pytest.mark.parametrize(
    "storage",
    [lambda: LazyTensorStorage(40, ndim=2), lambda: LazyMemmapStorage(40), lambda: ListStorage(40)],
    ids=["ndim2", "memmap", "list"],
)
def test_other_storages_sample_through_the_same_read(storage, tmp_path):
    rb = TensorDictReplayBuffer(storage=storage(), batch_size=4)
    data = _data(8, with_index=False)
    rb.extend(data.unsqueeze(1).expand(8, 5) if rb._storage.ndim == 2 else data)
    batch, info = rb.sample(return_info=True)
    assert batch.batch_size[0] == 4
    # With ndim=2 the batch was extended along dim 1 (dim_extend): its rows are the second coordinate.
    rows = info["index"][1] if rb._storage.ndim == 2 else info["index"]
    assert torch.equal(batch["obs"].reshape(4, -1, 6)[:, 0], data["obs"][rows])


def test_subclass_reading_its_own_way_is_followed():
    class Tagged(TensorDictReplayBuffer):
        def _read_drawn(self, index, info, batch_size, route):
            return super()._read_drawn(index, info, batch_size, route).set("tag", torch.zeros(batch_size))

    rb = Tagged(storage=LazyTensorStorage(20), batch_size=5)
    rb.extend(_data(20, with_index=False))
    assert "tag" in rb.sample().keys()


def test_read_follows_a_new_storage_allocation():
    """Restored from a state dict with other fields, the stored "index" column elsewhere: the
    next sample reads the new leaves and fills the new column."""
    first = TensorDict({"index": torch.full((30,), -7), "obs": torch.randn(30, 3)}, [30])
    later = TensorDict(
        {"a": torch.randn(30), "b": torch.randn(30), "c": torch.randint(100, 200, (30,)), "index": torch.full((30,), -7)},
        [30],
    )
    source = TensorDictReplayBuffer(storage=LazyTensorStorage(30), batch_size=6)
    source.extend(later.clone())
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(30), batch_size=6)
    rb.extend(first.clone())
    rb.sample()  # reads the first layout
    rb.load_state_dict(source.state_dict())
    batch, info = rb.sample(return_info=True)
    assert sorted(batch.keys()) == ["a", "b", "c", "index"]
    assert torch.equal(batch["index"], info["index"])
    for key in ("a", "b", "c"):
        assert torch.equal(batch[key], later[key][info["index"]]), key


@pytest.mark.parametrize("storage", ["tensor", "memmap"])
def test_stored_leaves_an_info_entry_replaces_are_not_gathered(storage, tmp_path, monkeypatch):
    """A slice sampler's ("next", "done") info replaces the stored column: the batch holds the
    info's marks, and the stored column is not read (one gather fewer per sample)."""
    from gpubuf import SliceSampler

    n = 60
    episode = torch.arange(n) // 12
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[11::12] = True
    data = TensorDict({"obs": torch.arange(n).float().unsqueeze(-1), "episode": episode, ("next", "done"): done}, [n])
    store = LazyTensorStorage(n) if storage == "tensor" else LazyMemmapStorage(n, scratch_dir=tmp_path)
    rb = TensorDictReplayBuffer(storage=store, sampler=SliceSampler(slice_len=4, traj_key="episode"), batch_size=16)
    rb.extend(data)
    rb.sample()
    storage_module = sys.modules["gpubuf.storages.tensor"]
    gather = storage_module.gather_rows_trusted
    gathered = []
    monkeypatch.setattr(
        storage_module, "gather_rows_trusted", lambda sources, index, **kw: gathered.append(len(sources)) or gather(sources, index, **kw)
    )
    batch, info = rb.sample(return_info=True)
    # obs and episode are gathered; ("next", "done") comes from the info alone.
    assert gathered == [2]
    assert torch.equal(batch["next", "done"], info[("next", "done")])
    rows = info["index"][0]
    assert torch.equal(batch["obs"].squeeze(-1), rows.float()) and torch.equal(batch["episode"], episode[rows])
    # Every slice's last step is marked done (truncated), and so is a stored episode end inside a slice.
    marks = batch["next", "done"].reshape(4, 4)
    assert marks[:, -1].all()
    assert torch.equal(marks | (done[rows].reshape(4, 4)), marks)


def test_uint8_index_tensors_are_positions_on_every_read():
    """A uint8 index reads the rows it names, as an int64 one does, whatever its shape and the
    storage's dims (torch alone would take it as a mask, a use it warns is deprecated)."""
    import warnings

    one = LazyTensorStorage(10)
    one.set(torch.arange(10), torch.arange(10.0) * 10)
    two = LazyTensorStorage(8, ndim=2)  # 4 rows of 2 once written
    two.set(torch.arange(4), torch.arange(8.0).reshape(4, 2))  # element (r, c) holds 2r + c
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for index in (torch.tensor([1, 3, 3]), torch.tensor([[1, 3]]), torch.tensor([[0], [9]])):
            assert torch.equal(one.get(index.to(torch.uint8)), one.get(index.to(torch.int64)))
        rows, cols = torch.tensor([3, 0]), torch.tensor([1, 0])
        got = two.get((rows.to(torch.uint8), cols.to(torch.uint8)))
        assert torch.equal(got, two.get((rows, cols))) and torch.equal(got, torch.tensor([7.0, 0.0]))
    # A uint8 position past the written rows is refused as an int64 one is, and reads nothing.
    with pytest.raises(IndexOutOfRangeError, match=r"must lie in \[-10, 10\).*\[2, 200\]"):
        one.get(torch.tensor([[2, 200]], dtype=torch.uint8))
    assert torch.equal(one.get(torch.arange(10)), torch.arange(10.0) * 10)
