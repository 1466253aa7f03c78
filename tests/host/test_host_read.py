"""The settled host read of a sample gives exactly what the general read gives, and steps aside
whenever the general read does more (transforms, other storages, other read steps)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import gpubuf
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


def _sample_both(rb, monkeypatch, seed: int = 3):
    """A sample through the settled read and one through the general read, same seed."""
    torch.manual_seed(seed)
    direct = rb.sample(return_info=True)
    with monkeypatch.context() as m:
        m.setattr(rb, "_host_read_plan", lambda: None)
        torch.manual_seed(seed)
        general = rb.sample(return_info=True)
    return direct, general


def _assert_same(a, b):
    (da, ia), (db, ib) = a, b
    assert type(da) is type(db)
    assert da.batch_size == db.batch_size and da.device == db.device
    assert sorted(map(str, da.keys(True, True))) == sorted(map(str, db.keys(True, True)))
    for key in da.keys(True, True):
        assert da.get(key).dtype == db.get(key).dtype, key
        assert torch.equal(da.get(key), db.get(key)), key
    assert ia.keys() == ib.keys()
    for key in ia:
        assert torch.equal(ia[key], ib[key]), key


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_settled_read_equals_the_general_read(cls, monkeypatch):
    rb = _make(cls, LazyTensorStorage(40))
    read = []
    real = rb._read_planned
    monkeypatch.setattr(rb, "_read_planned", lambda *a: read.append(1) or real(*a))
    direct, general = _sample_both(rb, monkeypatch)
    assert read == [1]  # the first sample took the settled read, the second did not
    _assert_same(direct, general)
    batch, info = direct
    if issubclass(cls, TensorDictReplayBuffer):
        # The stored "index" column holds the drawn indices, not the stored -7.
        assert torch.equal(batch["index"], info["index"])
        if "Prioritized" in cls.__name__:
            assert torch.equal(batch["priority_weight"], info["priority_weight"])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_transforms_take_the_general_read(cls, monkeypatch):
    rb = _make(cls, LazyTensorStorage(40))
    rb.sample()  # settles the read
    rb.append_transform(lambda td: td.set("seen", torch.ones(td.batch_size)))
    monkeypatch.setattr(rb, "_read_planned", lambda *a: pytest.fail("settled read with a transform"))
    assert bool(rb.sample()["seen"].all())


@pytest.mark.parametrize(
    "storage",
    [lambda: LazyTensorStorage(40, ndim=2), lambda: LazyMemmapStorage(40), lambda: ListStorage(40)],
    ids=["ndim2", "memmap", "list"],
)
def test_other_storages_take_the_general_read(storage, monkeypatch, tmp_path):
    rb = TensorDictReplayBuffer(storage=storage(), batch_size=4)
    data = _data(8, with_index=False)
    rb.extend(data.unsqueeze(1).expand(8, 5) if rb._storage.ndim == 2 else data)
    monkeypatch.setattr(rb, "_read_planned", lambda *a: pytest.fail("settled read of another storage"))
    assert rb.sample().batch_size[0] == 4


def test_subclass_reading_its_own_way_takes_the_general_read(monkeypatch):
    class Tagged(TensorDictReplayBuffer):
        def _read_drawn(self, index, info, batch_size):
            return super()._read_drawn(index, info, batch_size).set("tag", torch.zeros(batch_size))

    rb = Tagged(storage=LazyTensorStorage(20), batch_size=5)
    rb.extend(_data(20, with_index=False))
    assert "tag" in rb.sample().keys()


def test_settled_read_follows_a_new_storage_allocation():
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
    rb.sample()  # settles the read for the first layout
    rb.load_state_dict(source.state_dict())
    batch, info = rb.sample(return_info=True)
    assert sorted(batch.keys()) == ["a", "b", "c", "index"]
    assert torch.equal(batch["index"], info["index"])
    for key in ("a", "b", "c"):
        assert torch.equal(batch[key], later[key][info["index"]]), key
