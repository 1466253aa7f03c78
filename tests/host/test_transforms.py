"""Transforms at sampling time (append_transform, insert_transform), from the user's side, and ndim > 1."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement, TensorDictReplayBuffer, TensorStorage

torchrl_data = pytest.importorskip("torchrl.data")
transforms = pytest.importorskip("torchrl.envs.transforms")


class Scale:
    """A transform with both directions: x * factor on read, x / factor on write."""

    def __init__(self, factor):
        self.factor = factor
        self.calls = 0

    def __call__(self, data):
        self.calls += 1
        return data * self.factor

    def inv(self, data):
        return data / self.factor

    def state_dict(self):
        return {"factor": self.factor}

    def load_state_dict(self, state):
        self.factor = state["factor"]


def _td(n, start=0):
    return TensorDict(a=torch.arange(start, start + n, dtype=torch.float32), batch_size=[n])


def test_appended_transform_applies_at_sampling_not_on_storage():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    rb.extend(torch.arange(10.0))
    rb.append_transform(lambda x: x + 100)
    sample, info = rb.sample(return_info=True)
    assert torch.equal(sample, info["index"].float() + 100)
    assert torch.equal(rb.storage[:], torch.arange(10.0))  # stored data untouched
    assert torch.equal(rb[:3], torch.tensor([100.0, 101.0, 102.0]))  # reads transform as TorchRL's do


def test_insert_transform_orders_the_chain():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    rb.extend(torch.ones(10))
    rb.append_transform(lambda x: x * 3)  # [*3]
    rb.insert_transform(0, lambda x: x + 1)  # [+1, *3] -> (1 + 1) * 3
    rb.append_transform(lambda x: x - 6)  # [+1, *3, -6]
    assert rb.sample().tolist() == [0.0, 0.0]
    rb.insert_transform(1, lambda x: x * 10)  # [+1, *10, *3, -6] -> 54
    assert rb.sample().tolist() == [54.0, 54.0]
    assert len(rb.transform) == 4


def test_constructor_transform_and_invert():
    scale = Scale(2.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(10), transform=scale, batch_size=3)
    rb.extend(torch.full((10,), 4.0))
    assert torch.equal(rb.storage[:], torch.full((10,), 2.0))  # inv on write
    assert torch.equal(rb.sample(), torch.full((3,), 4.0))  # forward on read
    inverted = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)
    inverted.append_transform(Scale(2.0), invert=True)
    inverted.extend(torch.full((10,), 4.0))
    assert torch.equal(inverted.storage[:], torch.full((10,), 8.0))  # forward on write
    assert torch.equal(inverted.sample(), torch.full((3,), 4.0))  # inv on read


def test_torchrl_transform_side_by_side():
    results = []
    for rb_cls, storage_cls in ((TensorDictReplayBuffer, LazyTensorStorage), (torchrl_data.TensorDictReplayBuffer, torchrl_data.LazyTensorStorage)):
        torch.manual_seed(0)
        rb = rb_cls(storage=storage_cls(10), batch_size=4)
        rb.append_transform(transforms.RenameTransform(["a"], ["b"]))
        rb.extend(_td(10))
        sample = rb.sample()
        results.append((sorted(sample.keys()), sample["b"].tolist(), sorted(rb.storage[0:2].keys())))
    assert results[0] == results[1]
    assert results[0][2] == ["a", "index"]


def test_transform_state_round_trips_with_the_buffer():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), transform=Scale(3.0), batch_size=2)
    rb.extend(torch.ones(10))
    state = rb.state_dict()
    other = ReplayBuffer(storage=LazyTensorStorage(10), transform=Scale(1.0), batch_size=2)
    other.load_state_dict(state)
    assert other.transform._items[0][0].factor == 3.0
    assert torch.equal(other.sample(), torch.ones(2))  # stored 1/3, read *3


def test_transforms_with_prefetch_and_iteration():
    scale = Scale(10.0)
    rb = ReplayBuffer(storage=LazyTensorStorage(8), sampler=SamplerWithoutReplacement(), batch_size=4, prefetch=2)
    rb.extend(torch.arange(8.0))
    rb.append_transform(scale)
    seen = torch.cat([batch for batch in rb])
    assert sorted(seen.tolist()) == [float(10 * i) for i in range(8)]


def test_transform_on_locked_sampled_tensordicts():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10), batch_size=3)
    rb.extend(_td(10))
    rb.append_transform(lambda td: td.set("c", td["a"] * 2))
    sample = rb.sample()
    assert torch.equal(sample["c"], sample["a"] * 2)


def test_non_callable_transform_is_refused():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(TypeError, match="callable"):
        rb.append_transform(3)
    with pytest.raises(TypeError, match="callable"):
        rb.insert_transform(0, "not a transform")
    assert len(rb.transform) == 0


# ---------------------------------------------------------------------------------------------
# Storages with ndim > 1 (side by side with TorchRL), with transforms
# ---------------------------------------------------------------------------------------------


def test_ndim2_storage_matches_torchrl():
    shapes = []
    for rb_cls, storage_cls in ((TensorDictReplayBuffer, LazyTensorStorage), (torchrl_data.TensorDictReplayBuffer, torchrl_data.LazyTensorStorage)):
        rb = rb_cls(storage=storage_cls(12, ndim=2), batch_size=5)
        rb.extend(TensorDict(a=torch.arange(12.0).reshape(3, 4), batch_size=[3, 4]))
        sample = rb.sample()
        shapes.append((len(rb), tuple(rb[:].shape), tuple(sample.shape), tuple(sample["index"].shape)))
        # dim_extend defaults to ndim - 1: the [3, 4] batch is stored transposed, as [4, 3], and
        # every sampled element is the one its (row, column) coordinates name there.
        rows, cols = sample["index"].unbind(-1)
        assert torch.equal(sample["a"], (cols * 4 + rows).float())
    assert shapes[0] == shapes[1]


def test_ndim2_storage_with_transform_and_dim_extend():
    rb = ReplayBuffer(storage=LazyTensorStorage(8, ndim=2), batch_size=6, dim_extend=1)
    rb.append_transform(lambda x: -x)
    data = torch.arange(8.0).reshape(4, 2)  # dim_extend=1: 2 rows along dim 0 of the storage, 4 along dim 1
    rb.extend(data)
    assert rb.storage.shape == (2, 4)
    sample, info = rb.sample(return_info=True)
    rows, cols = info["index"]
    assert torch.equal(sample, -data.T[rows, cols])


def test_ndim2_tensor_storage_given_data_and_sampler_without_replacement():
    storage = TensorStorage(torch.arange(12).reshape(3, 4), ndim=2)
    rb = ReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=4)
    rb.append_transform(lambda x: x * 2)
    seen = torch.cat([rb.sample() for _ in range(3)])
    assert sorted(seen.tolist()) == [2 * i for i in range(12)]
