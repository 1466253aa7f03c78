"""PrioritizedSampler and the prioritized buffers: TorchRL semantics, devices, N-d storages, bad input.

TorchRL's prioritized classes need its C++ extension, which is absent here, so the expected
values are computed independently in these tests (float64 formulas over the priorities set).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.buffers.prioritized import PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer
from gpubuf.errors import (
    CapacityError,
    EmptyBufferError,
    GpubufError,
    IndexOutOfRangeError,
    PriorityError,
    SchemaMismatchError,
)
from gpubuf.samplers.prioritized import PrioritizedSampler

HAS_CUDA = torch.cuda.is_available()


def _leaf(p, alpha, eps=1e-8):
    return (torch.as_tensor(p, dtype=torch.float64) + eps) ** alpha


def _expected_weights(priorities: torch.Tensor, index: torch.Tensor, alpha: float, beta: float, eps: float = 1e-8):
    """TorchRL's formula, w_i = (P_i / P_min) ** -beta with P = (p + eps) ** alpha, min over all written items."""
    leaves = _leaf(priorities, alpha, eps)
    return (leaves[index] / leaves.min()) ** (-beta)


def _buffer(n=100, capacity=None, alpha=0.7, beta=0.5, **kwargs):
    rb = PrioritizedReplayBuffer(alpha=alpha, beta=beta, storage=LazyTensorStorage(capacity or n), **kwargs)
    rb.extend(torch.arange(n, dtype=torch.float32))
    return rb


def _snapshot(sampler: PrioritizedSampler):
    tree = sampler.tree
    return (tree.leaves.clone(), tree.sums.clone(), tree.mins.clone(), sampler.default_priority)


def _unchanged(sampler: PrioritizedSampler, snap) -> bool:
    leaves, sums, mins, default = snap
    tree = sampler.tree
    return (
        torch.equal(tree.leaves, leaves)
        and torch.equal(tree.sums, sums)
        and torch.equal(tree.mins, mins)
        and sampler.default_priority == default
    )


# ------------------------------------------------------------------------------ TorchRL semantics
def test_torchrl_docstring_example():
    """The weights printed in TorchRL's PrioritizedReplayBuffer docstring (0.36278465)."""
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.9, storage=ListStorage(10))
    rb.extend(list(range(10)))
    _, info = rb.sample(5, return_info=True)
    assert torch.all(info["priority_weight"] == 1.0)
    updated = info["index"]
    rb.update_priority(updated, torch.ones(5) * 5)
    _, info = rb.sample(50, return_info=True)
    is_updated = torch.isin(info["index"], updated)
    w = info["priority_weight"]
    torch.testing.assert_close(w[is_updated], torch.full_like(w[is_updated], 0.36278465), rtol=1e-6, atol=0)
    assert bool((w[~is_updated] == 1.0).all())


def test_new_items_get_max_priority():
    alpha = 0.6
    rb = _buffer(n=10, capacity=20, alpha=alpha)
    tree = rb.sampler.tree
    torch.testing.assert_close(tree.values()[:10], _leaf(torch.ones(10), alpha).float())  # 1.0 at first
    assert rb.sampler.default_priority == 1.0
    rb.update_priority(torch.tensor([2, 3]), torch.tensor([5.0, 0.5]))
    assert rb.sampler.default_priority == 5.0
    rb.extend(torch.arange(5, dtype=torch.float32))
    torch.testing.assert_close(tree.values()[10:15], _leaf(torch.full((5,), 5.0), alpha).float())
    rb.add(torch.tensor(1.0))
    torch.testing.assert_close(tree.values()[15], _leaf(5.0, alpha).float())
    # The maximum is the largest priority ever set (max_priority_within_buffer=False).
    rb.update_priority(torch.tensor([2]), torch.tensor([0.1]))
    assert rb.sampler.default_priority == 5.0


def test_max_priority_follows_every_kind_of_update():
    # After the first update the maximum moves by a shortcut on CPU; a skipped (negative)
    # index takes the general path. Both must agree on what counts.
    sampler = PrioritizedSampler(10, alpha=0.5, beta=1.0)
    sampler.update_priority(torch.tensor([0, 1]), torch.tensor([2.0, 3.0]))
    sampler.update_priority(torch.tensor([2, 3]), torch.tensor([1.0, 7.0]))
    assert sampler.default_priority == 7.0
    sampler.update_priority(torch.tensor([4]), torch.tensor(9))  # one integer priority
    assert sampler.default_priority == 9.0
    sampler.update_priority(torch.tensor([-1, 5]), torch.tensor([50.0, 1.0]))  # 50 is skipped with its index
    assert sampler.default_priority == 9.0
    sampler.update_priority(torch.tensor([], dtype=torch.long), torch.tensor([]))
    assert sampler.default_priority == 9.0


def test_max_priority_within_buffer():
    sampler = PrioritizedSampler(10, alpha=1.0, beta=1.0, eps=0.0, max_priority_within_buffer=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(10), sampler=sampler)
    rb.extend(torch.arange(5, dtype=torch.float32))
    rb.update_priority(torch.tensor([0, 1]), torch.tensor([7.0, 3.0]))
    assert sampler.default_priority == 7.0
    rb.update_priority(torch.tensor([0]), torch.tensor([2.0]))  # the holder of the max goes down
    assert sampler.default_priority == pytest.approx(3.0)
    rb.update_priority(torch.tensor([4]), torch.tensor([4.0]))  # a new max elsewhere
    assert sampler.default_priority == pytest.approx(4.0)


def test_weights_formula_independent():
    gen = torch.Generator().manual_seed(0)
    alpha, beta, n = 0.7, 0.4, 200
    rb = _buffer(n=n, capacity=256, alpha=alpha, beta=beta)
    priorities = torch.rand(n, generator=gen) * 10 + 0.01
    rb.update_priority(torch.arange(n), priorities)
    _, info = rb.sample(4096, return_info=True)
    expected = _expected_weights(priorities, info["index"], alpha, beta)
    torch.testing.assert_close(info["priority_weight"].double(), expected, rtol=2e-6, atol=0)
    assert info["priority_weight"].dtype == torch.float32


def test_weights_use_min_over_whole_written_range():
    """p_min is the smallest over every written item, sampled or not."""
    alpha, beta = 1.0, 1.0
    rb = _buffer(n=50, alpha=alpha, beta=beta)
    priorities = torch.full((50,), 10.0)
    priorities[7] = 1e-3  # almost never drawn, still the normaliser
    rb.update_priority(torch.arange(50), priorities)
    _, info = rb.sample(64, return_info=True)
    sampled = info["index"][info["index"] != 7]
    expected = _expected_weights(priorities, sampled, alpha, beta)
    torch.testing.assert_close(info["priority_weight"][info["index"] != 7].double(), expected, rtol=1e-6, atol=0)
    assert info["priority_weight"][info["index"] != 7][0].item() == pytest.approx(1e-3 / 10.0, rel=1e-4)


def test_double_dtype():
    rb = PrioritizedReplayBuffer(alpha=0.5, beta=0.5, dtype=torch.double, storage=LazyTensorStorage(10))
    rb.extend(torch.arange(10.0))
    rb.update_priority(torch.arange(10), torch.arange(1, 11, dtype=torch.float64))
    _, info = rb.sample(20, return_info=True)
    assert info["priority_weight"].dtype == torch.float64
    expected = _expected_weights(torch.arange(1, 11, dtype=torch.float64), info["index"], 0.5, 0.5)
    torch.testing.assert_close(info["priority_weight"], expected, rtol=1e-12, atol=0)


def test_sampled_frequencies_follow_priorities():
    gen = torch.Generator().manual_seed(1)
    rb = _buffer(n=20, alpha=1.0, beta=0.0, generator=gen)
    priorities = torch.arange(1, 21, dtype=torch.float32)
    rb.update_priority(torch.arange(20), priorities)
    _, info = rb.sample(200_000, return_info=True)
    freq = torch.bincount(info["index"], minlength=20).double() / 200_000
    torch.testing.assert_close(freq, priorities.double() / priorities.sum(), atol=4e-3, rtol=0)


def test_zero_priority_never_sampled():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, eps=0.0, storage=LazyTensorStorage(100))
    rb.extend(torch.arange(100.0))
    zero = torch.arange(0, 100, 2)
    rb.update_priority(zero, torch.zeros(50))
    _, info = rb.sample(20_000, return_info=True)
    assert not bool(torch.isin(info["index"], zero).any())
    assert bool(torch.isfinite(info["priority_weight"]).all())


def test_all_zero_priorities_refuse_to_sample():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, eps=0.0, storage=LazyTensorStorage(10))
    rb.extend(torch.arange(4.0))
    rb.update_priority(torch.arange(4), torch.zeros(4))
    with pytest.raises(EmptyBufferError):
        rb.sample(2)


def test_duplicates_last_wins_and_negative_ignored():
    rb = _buffer(n=10, alpha=1.0)
    rb.update_priority(torch.tensor([3, 3, -1, 5, 3]), torch.tensor([1.0, 2.0, 100.0, 4.0, 6.0]))
    values = rb.sampler.tree.values()
    assert values[3].item() == pytest.approx(6.0) and values[5].item() == pytest.approx(4.0)
    assert rb.sampler.default_priority == 6.0  # the priority at the ignored index does not count


def test_scalar_and_list_inputs():
    rb = _buffer(n=10, alpha=1.0)
    rb.update_priority(4, 3.0)
    rb.update_priority([1, 2], [2.0, 2.5])
    rb.update_priority(torch.tensor([6, 7]), 0.5)  # one priority for all
    values = rb.sampler.tree.values()
    assert values[4].item() == pytest.approx(3.0) and values[2].item() == pytest.approx(2.5)
    assert values[6].item() == pytest.approx(0.5) and values[7].item() == pytest.approx(0.5)
    rb.update_priority(torch.tensor([], dtype=torch.long), torch.tensor([]))  # nothing to do


def test_alpha_beta_setters():
    rb = _buffer(n=10, alpha=0.5, beta=0.5)
    sampler = rb.sampler
    priorities = torch.arange(1, 11, dtype=torch.float32)
    rb.update_priority(torch.arange(10), priorities)
    sampler.beta = 1.0
    _, info = rb.sample(100, return_info=True)
    torch.testing.assert_close(
        info["priority_weight"].double(), _expected_weights(priorities, info["index"], 0.5, 1.0), rtol=2e-6, atol=0
    )
    sampler.alpha = 0.9  # the stored values are re-transformed for the new exponent
    torch.testing.assert_close(sampler.tree.values().double(), _leaf(priorities, 0.9), rtol=2e-6, atol=0)
    torch.testing.assert_close(sampler.tree.total(), sampler.tree.values().double().sum(), rtol=1e-12, atol=0)
    _, info = rb.sample(100, return_info=True)
    torch.testing.assert_close(
        info["priority_weight"].double(), _expected_weights(priorities, info["index"], 0.9, 1.0), rtol=5e-6, atol=0
    )
    with pytest.raises(ValueError):
        sampler.alpha = -0.1
    with pytest.raises(ValueError):
        sampler.beta = float("nan")
    assert sampler.alpha == 0.9 and sampler.beta == 1.0


def test_alpha_from_zero_warns():
    rb = _buffer(n=5, alpha=0.0)
    with pytest.warns(UserWarning):
        rb.sampler.alpha = 0.5


def test_constructor_validation():
    with pytest.raises(ValueError):
        PrioritizedSampler(10, alpha=-1.0, beta=0.5)
    with pytest.raises(ValueError):
        PrioritizedSampler(10, alpha=1.0, beta=-0.5)
    with pytest.raises(CapacityError):
        PrioritizedSampler(0, alpha=1.0, beta=0.5)
    with pytest.raises(NotImplementedError):
        PrioritizedSampler(10, alpha=1.0, beta=0.5, dtype=torch.half)
    with pytest.raises(ValueError):
        PrioritizedSampler(10, alpha=1.0, beta=0.5, reduction="sum")
    with pytest.raises(TypeError):
        PrioritizedReplayBuffer(alpha=1.0, beta=1.0, sampler=PrioritizedSampler(10, 1.0, 1.0), sampler_device="cpu")
    with pytest.raises(NotImplementedError):
        PrioritizedReplayBuffer(alpha=1.0, beta=1.0, sync=False)


def test_stratified_option():
    sampler = PrioritizedSampler(64, alpha=1.0, beta=1.0, stratified=True)
    rb = ReplayBuffer(storage=LazyTensorStorage(64), sampler=sampler)
    rb.extend(torch.arange(64.0))
    _, info = rb.sample(64, return_info=True)
    # Equal priorities and one draw per slice: every item exactly once, in order.
    assert torch.equal(info["index"], torch.arange(64))


def test_empty_and_reset():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=LazyTensorStorage(10))
    with pytest.raises(EmptyBufferError):
        rb.sample(2)
    rb.extend(torch.arange(5.0))
    rb.update_priority(torch.tensor([1]), torch.tensor([9.0]))
    rb.empty()
    assert rb.sampler.tree.total().item() == 0 and rb.sampler.default_priority == 1.0
    with pytest.raises(EmptyBufferError):
        rb.sample(2)
    rb.extend(torch.arange(3.0))
    assert rb.sampler.tree.values()[:3].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_buffer_mark_update():
    rb = _buffer(n=10, alpha=1.0)
    rb.update_priority(torch.tensor([0]), torch.tensor([4.0]))
    rb.update_priority(torch.tensor([5]), torch.tensor([0.5]))
    rb.mark_update(torch.tensor([5]))
    assert rb.sampler.tree.values()[5].item() == pytest.approx(4.0)


# ------------------------------------------------------------------------------ TensorDict buffers
def _td(n, **extra):
    return TensorDict({"obs": torch.randn(n, 3), **extra}, batch_size=[n])


def test_tensordict_buffer_priority_key_and_update():
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=0.5, storage=LazyTensorStorage(50), batch_size=16)
    rb.extend(_td(10, td_error=torch.arange(1.0, 11.0)))
    torch.testing.assert_close(rb.sampler.tree.values()[:10].double(), _leaf(torch.arange(1.0, 11.0), 1.0), rtol=1e-6, atol=0)
    rb.extend(_td(5, td_error=torch.arange(1.0, 6.0)), update_priority=False)  # the max so far instead
    torch.testing.assert_close(rb.sampler.tree.values()[10:15].double(), _leaf(torch.full((5,), 10.0), 1.0), rtol=1e-6, atol=0)
    sample = rb.sample()
    assert "priority_weight" in sample.keys() and "index" in sample.keys()
    new = torch.rand(16) + 0.1
    sample.set("td_error", new)
    rb.update_tensordict_priority(sample)
    last = {}
    for i, p in zip(sample["index"].tolist(), new.tolist()):
        last[i] = p  # duplicates: the last one wins
    for i, p in last.items():
        assert rb.sampler.tree.values()[i].item() == pytest.approx(p + 1e-8, rel=1e-6)


def test_tensordict_buffer_reduction():
    rb = TensorDictPrioritizedReplayBuffer(
        alpha=1.0, beta=0.5, storage=LazyTensorStorage(10), reduction="mean", priority_key="p"
    )
    rb.extend(_td(2, p=torch.tensor([[1.0, 3.0], [2.0, 6.0]])))
    assert rb.sampler.tree.values()[:2].tolist() == pytest.approx([2.0, 4.0])


def test_tensordict_buffer_add():
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=0.5, storage=LazyTensorStorage(10))
    rb.add(TensorDict({"obs": torch.randn(3), "td_error": torch.tensor(3.0)}, batch_size=[]))
    rb.add(TensorDict({"obs": torch.randn(3), "td_error": torch.tensor(0.5)}, batch_size=[]))
    assert rb.sampler.tree.values()[:2].tolist() == pytest.approx([3.0, 0.5])
    # Without the priority key, items get the max so far (1.0 at first).
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=0.5, storage=LazyTensorStorage(10), priority_key="p")
    rb.add(TensorDict({"obs": torch.randn(3)}, batch_size=[]))
    rb.extend(_td(2))
    assert rb.sampler.tree.values()[:3].tolist() == pytest.approx([1.0, 1.0, 1.0])
    rb.update_priority(torch.tensor([0]), torch.tensor([4.0]))
    rb.add(TensorDict({"obs": torch.randn(3)}, batch_size=[]))
    assert rb.sampler.tree.values()[3].item() == pytest.approx(4.0)


def test_plain_tensordict_buffer_with_prioritized_sampler():
    sampler = PrioritizedSampler(20, alpha=1.0, beta=1.0)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(20), sampler=sampler, priority_key="td_error", batch_size=4)
    rb.extend(_td(8))
    sample = rb.sample()
    sample.set("td_error", torch.full((4,), 2.0))
    rb.update_tensordict_priority(sample)
    assert bool((sampler.tree.values()[sample["index"]] == 2.0).all())


# ------------------------------------------------------------------------------ N-d storages
def test_ndim2_storage_sample_and_update():
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=LazyTensorStorage(24, ndim=2), eps=0.0)
    data = torch.arange(24.0).reshape(6, 4)  # 4 envs x 6 steps after the dim_extend transpose
    rb.extend(data)
    assert len(rb) == 24
    sample, info = rb.sample(10, return_info=True)
    assert isinstance(info["index"], tuple) and len(info["index"]) == 2
    rows, cols = info["index"]
    assert torch.equal(sample, rb.storage[:][rows, cols])
    # Coordinates as a tuple and as a [B, 2] tensor both address flat item row * cols + col of
    # the storage's own shape.
    shape = rb.storage.shape
    rb.update_priority((torch.tensor([0, 1]), torch.tensor([1, 2])), torch.tensor([5.0, 7.0]))
    rb.update_priority(torch.tensor([[2, 3]]), torch.tensor([9.0]))
    values = rb.sampler.tree.values()
    assert values[0 * shape[1] + 1].item() == 5.0 and values[1 * shape[1] + 2].item() == 7.0
    assert values[2 * shape[1] + 3].item() == 9.0
    _, info = rb.sample(5000, return_info=True)
    flat = info["index"][0] * shape[1] + info["index"][1]
    leaves = values.double()
    torch.testing.assert_close(info["priority_weight"].double(), (leaves[flat] / leaves.min()) ** -1.0, rtol=1e-6, atol=0)


def test_ndim2_with_plain_buffer_and_tensordicts():
    sampler = PrioritizedSampler(12, alpha=1.0, beta=1.0, eps=0.0)
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(12, ndim=2), sampler=sampler, batch_size=5)
    rb.extend(TensorDict({"obs": torch.randn(3, 4)}, batch_size=[3, 4]))
    sample = rb.sample()
    assert sample["index"].shape == (5, 2)
    sample.set("td_error", torch.full((5,), 3.0))
    rb.update_tensordict_priority(sample)
    shape = rb.storage.shape
    flat = sample["index"][:, 0] * shape[1] + sample["index"][:, 1]
    assert bool((sampler.tree.values()[flat] == 3.0).all())


# ------------------------------------------------------------------------------ devices
def test_devices_cpu_cpu_and_liststorage():
    rb = _buffer(n=10, sampler_device="cpu")
    _, info = rb.sample(4, return_info=True)
    assert rb.sampler.device.type == "cpu"
    assert info["index"].device.type == "cpu" and info["priority_weight"].device.type == "cpu"
    rb = PrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=ListStorage(10))
    rb.extend([torch.tensor(i) for i in range(4)])
    _, info = rb.sample(3, return_info=True)
    assert rb.sampler.device.type == "cpu" and info["index"].device.type == "cpu"


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("storage_device,tree_device", [("cuda", None), ("cpu", "cuda"), ("cuda", "cpu"), ("cuda", "cuda")])
def test_device_pairs(storage_device, tree_device):
    rb = PrioritizedReplayBuffer(
        alpha=0.7, beta=0.5, storage=LazyTensorStorage(1000, device=storage_device), sampler_device=tree_device
    )
    rb.extend(torch.arange(1000.0))
    expected_tree = torch.device(tree_device or storage_device)
    assert rb.sampler.device.type == expected_tree.type
    priorities = torch.rand(1000) + 0.1
    rb.update_priority(torch.arange(1000, device=storage_device), priorities.to(storage_device))
    sample, info = rb.sample(256, return_info=True)
    assert sample.device.type == info["index"].device.type == info["priority_weight"].device.type == storage_device
    expected = _expected_weights(priorities, info["index"].cpu(), 0.7, 0.5)
    torch.testing.assert_close(info["priority_weight"].cpu().double(), expected, rtol=2e-6, atol=0)
    torch.testing.assert_close(sample.cpu(), info["index"].cpu().float())


# ------------------------------------------------------------------------------ seeding
def test_same_generator_seed_same_samples():
    def draw(seed):
        rb = _buffer(n=100, generator=torch.Generator().manual_seed(seed))
        rb.update_priority(torch.arange(100), torch.linspace(0.1, 5.0, 100))
        return [rb.sample(32, return_info=True)[1]["index"] for _ in range(3)]

    a, b, c = draw(3), draw(3), draw(4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_global_seed_reproducible():
    def draw():
        torch.manual_seed(11)
        rb = _buffer(n=50)
        return rb.sample(64, return_info=True)[1]["index"]

    assert torch.equal(draw(), draw())


# ------------------------------------------------------------------------------ state
def test_state_dict_roundtrip():
    rb = _buffer(n=30, alpha=0.8, beta=0.3)
    rb.update_priority(torch.arange(30), torch.rand(30, generator=torch.Generator().manual_seed(0)) + 0.1)
    state = rb.sampler.state_dict()
    other = PrioritizedSampler(30, alpha=0.1, beta=0.1)
    other.load_state_dict(state)
    assert other.alpha == 0.8 and other.beta == 0.3 and other.default_priority == rb.sampler.default_priority
    assert torch.equal(other.tree.leaves, rb.sampler.tree.leaves)
    with pytest.raises(ValueError):
        PrioritizedSampler(31, alpha=0.1, beta=0.1).load_state_dict(state)
    copy = _buffer(n=30)
    copy.load_state_dict(rb.state_dict())
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    copy.set_rng(g1)
    rb.set_rng(g2)
    assert torch.equal(copy.sample(16, return_info=True)[1]["index"], rb.sample(16, return_info=True)[1]["index"])


def test_prefetch():
    rb = PrioritizedReplayBuffer(
        alpha=1.0, beta=1.0, storage=LazyTensorStorage(100), batch_size=8, prefetch=2,
        generator=torch.Generator().manual_seed(0),
    )
    rb.extend(torch.arange(100.0))
    rb.update_priority(torch.arange(100), torch.zeros(100))
    rb.update_priority(torch.tensor([42]), torch.tensor([1.0]))
    for _ in range(3):
        sample, info = rb.sample(return_info=True)
        assert bool((sample == 42).all())


# ------------------------------------------------------------------------------ the compiled CPU path
def test_cpu_batches_take_one_compiled_call_each_way(monkeypatch):
    """A CPU tree's draw (with its weights) and every priority update, new items' included, are
    one compiled call each (the twins are made to fail), with TorchRL's results: weights by the
    formula, the running maximum for new items, last wins on duplicates."""
    import gpubuf.ops.sumtree as ops_module

    def twin(*args, **kwargs):
        raise AssertionError("the twin ran")

    calls = []
    kernels = ops_module.kernel_module("cpu.sumtree")

    class Counting:
        UPDATED = kernels.UPDATED

        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return getattr(kernels, name)(*args)

            return call

    rb = _buffer(n=50, capacity=64, alpha=0.7, beta=0.5)
    monkeypatch.setattr(ops_module, "_apply_ref", twin)
    monkeypatch.setattr(ops_module, "sumtree_sample_ref", twin)
    monkeypatch.setattr(ops_module, "kernel_module", lambda name: Counting())
    priorities = torch.linspace(0.5, 3.0, 50)
    rb.update_priority(torch.arange(50), priorities)
    sample, info = rb.sample(200, return_info=True)
    assert calls == ["update", "draw"]
    assert info["index"].dtype == torch.int64 and info["priority_weight"].dtype == torch.float32
    torch.testing.assert_close(
        info["priority_weight"].double(), _expected_weights(priorities, info["index"], 0.7, 0.5), rtol=2e-6, atol=0
    )
    rb.update_priority(torch.tensor([3, 3, 7]), torch.tensor([9.0, 2.0, 4.0]))
    assert rb.sampler.tree.values()[3].item() == pytest.approx(_leaf(2.0, 0.7).item(), rel=1e-6)
    # New items get the running maximum through the same call.
    rb.extend(torch.tensor([100.0]))
    assert calls == ["update", "draw", "update", "update"]
    assert rb.sampler.tree.values()[50].item() == pytest.approx(_leaf(9.0, 0.7).item(), rel=1e-6)  # the maximum


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "index,priority,error",
    [
        (torch.tensor([1, 2]), torch.tensor([1.0, float("nan")]), PriorityError),
        (torch.tensor([1, 2]), torch.tensor([float("inf"), 1.0]), PriorityError),
        (torch.tensor([1, 2]), torch.tensor([1.0, -2.0]), PriorityError),
        (torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0]), PriorityError),
        (torch.tensor([1, 2]), torch.ones(3), PriorityError),
        (torch.tensor([1, 20]), torch.tensor([1.0, 2.0]), IndexOutOfRangeError),  # past the written range
        (torch.tensor([1, 64]), torch.tensor([1.0, 2.0]), IndexOutOfRangeError),  # past the capacity
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([[1, 2, 3]]), torch.tensor([1.0]), SchemaMismatchError),
    ],
)
def test_bad_update_leaves_everything_unchanged(index, priority, error):
    rb = _buffer(n=20, capacity=64)
    rb.update_priority(torch.arange(20), torch.linspace(0.5, 3.0, 20))
    snap = _snapshot(rb.sampler)
    with pytest.raises(error) as excinfo:
        rb.update_priority(index, priority)
    assert isinstance(excinfo.value, (GpubufError, TypeError))
    assert _unchanged(rb.sampler, snap)
    with pytest.raises(error):
        rb.sampler.update_priority(index, priority, storage=rb.storage)
    assert _unchanged(rb.sampler, snap)


def test_bad_tensordict_priority_leaves_everything_unchanged():
    rb = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=0.5, storage=LazyTensorStorage(20), batch_size=4)
    rb.extend(_td(10, td_error=torch.ones(10)))
    snap = _snapshot(rb.sampler)
    length = len(rb)
    # Priorities are checked before the rows are written: nothing at all changes.
    for bad in (torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([1.0, -1.0, 2.0]), torch.ones(2)):
        with pytest.raises(PriorityError):
            rb.extend(_td(3, td_error=bad) if bad.numel() == 3 else TensorDict(
                {"obs": torch.randn(3, 3), "td_error": torch.ones(3, 2)[:, :0]}, batch_size=[3]))
        assert len(rb) == length and rb.write_count == length
        assert _unchanged(rb.sampler, snap)
    with pytest.raises(PriorityError):
        rb.add(TensorDict({"obs": torch.randn(3), "td_error": torch.tensor(float("inf"))}, batch_size=[]))
    assert len(rb) == length and _unchanged(rb.sampler, snap)
    sample = rb.sample()
    sample.set("td_error", torch.tensor([1.0, -1.0, 1.0, 1.0]))
    snap = _snapshot(rb.sampler)
    with pytest.raises(PriorityError):
        rb.update_tensordict_priority(sample)
    assert _unchanged(rb.sampler, snap)


def test_bad_mark_update_and_sample_args():
    rb = _buffer(n=10)
    snap = _snapshot(rb.sampler)
    with pytest.raises(IndexOutOfRangeError):
        rb.mark_update(torch.tensor([10]))
    assert _unchanged(rb.sampler, snap)
    with pytest.raises(GpubufError):
        rb.sample(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rb.sample(1)


def test_tree_follows_a_storage_whose_device_becomes_known():
    """The sampler skips re-binding the same storage, but not once the storage's device changes
    (an auto-device storage learns its device at its first write)."""
    from gpubuf.storages.base import Storage as StorageBase

    class Storage(StorageBase):
        def __init__(self) -> None:
            super().__init__(10)
            self.device = "auto"

        def __len__(self) -> int:
            return 0

    storage = Storage()
    sampler = PrioritizedSampler(10, alpha=1.0, beta=1.0)
    sampler._bind(storage)
    sampler._bind(storage)
    assert sampler.device.type == "cpu"
    storage.device = torch.device("meta")
    sampler._bind(storage)
    assert sampler.device.type == "meta"


@pytest.mark.parametrize("shape", ["per_item", "one_for_all"])
def test_priorities_that_require_grad_leave_no_graph(shape):
    """A td_error computed from a loss requires grad. The compiled path (one priority per
    item) and the general one (a single priority) store plain values: no tree or maximum
    tracks gradients, and the loss still backpropagates afterwards."""
    sampler = PrioritizedSampler(64, alpha=0.7, beta=0.5)
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(64), sampler=sampler)
    rb.extend(torch.arange(64.0))
    weight = torch.tensor(2.0, requires_grad=True)
    index = torch.arange(0, 64, 4)
    priority = weight * torch.linspace(0.5, 3.0, len(index)) if shape == "per_item" else weight * 1.5
    rb.update_priority(index, priority)
    assert not sampler._tree.values().requires_grad
    assert not sampler._max_priority[0].requires_grad
    want = (priority.detach() + sampler._eps) ** 0.7 if shape == "per_item" else None
    got = sampler._tree.values()[index].double()
    if want is not None:
        torch.testing.assert_close(got, want.double().to(got.dtype).double(), rtol=1e-6, atol=0)
    else:
        torch.testing.assert_close(got, torch.full_like(got, (1.5 * 2.0 + sampler._eps) ** 0.7), rtol=1e-6, atol=0)
    priority.sum().backward()
    assert weight.grad is not None
