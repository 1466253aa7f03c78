"""ReplayBufferEnsemble / StorageEnsemble: proportions (statistical test), layout, errors."""

from __future__ import annotations

import pytest
import torch

import gpubuf
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.buffers.ensemble import ReplayBufferEnsemble
from gpubuf.errors import BatchSizeError, EmptyBufferError
from gpubuf.samplers import RandomSampler
from gpubuf.samplers.ensemble import EnsembleBatchSizeError, SamplerEnsemble
from gpubuf.storages.ensemble import StorageEnsemble
from gpubuf.writers import RoundRobinWriter
from gpubuf.writers.ensemble import WriterEnsemble
from gpubuf.writers.immutable import ImmutableStorageError

# Chi-square critical values at significance 1e-3 (so a correct sampler fails one run in a
# thousand; the generator is seeded, so the test is deterministic anyway).
CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266}


def _members(k, n=20, ndim=1):
    """Member buffers whose every element holds its member id (and, in "row", its row)."""
    rbs = []
    for member in range(k):
        rb = ReplayBuffer(storage=LazyTensorStorage(n * (4 if ndim == 2 else 1), ndim=ndim))
        if ndim == 1:
            rb.extend(torch.stack([torch.full((n,), member), torch.arange(n)], -1))
        else:
            rb.extend(torch.full((n, 4), member))
        rbs.append(rb)
    return rbs


def _chi2(counts, p):
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("p", [[0.2, 0.3, 0.5], [1.0, 1.0, 2.0], None])
def test_members_are_sampled_in_the_asked_proportions(p):
    gen = torch.Generator().manual_seed(0)
    rb = ReplayBufferEnsemble(*_members(3), p=p, num_buffer_sampled=10, generator=gen)
    counts = torch.zeros(3, dtype=torch.float64)
    for _ in range(300):
        sample, info = rb.sample(40, return_info=True)
        ids = info["index", "buffer_ids"]
        assert sample.shape == (10, 4, 2)
        # Every chunk comes from the member its id names.
        assert torch.equal(sample[..., 0], ids[:, None].expand(10, 4))
        counts += torch.bincount(ids, minlength=3)
    probs = torch.tensor([1.0, 1.0, 1.0] if p is None else p, dtype=torch.float64)
    probs = probs / probs.sum()
    assert _chi2(counts, probs) < CHI2_CRIT_1E3[2], (counts, probs)


def test_a_member_of_weight_zero_is_never_sampled():
    rb = ReplayBufferEnsemble(*_members(2), p=[0.0, 1.0], num_buffer_sampled=4, generator=torch.Generator().manual_seed(1))
    for _ in range(50):
        assert bool((rb.sample(8)[..., 0] == 1).all())


def test_sample_from_all_and_rows_within_members_are_uniform():
    gen = torch.Generator().manual_seed(2)
    rb = ReplayBufferEnsemble(*_members(3, n=5), sample_from_all=True, generator=gen)
    rows = torch.zeros(5, dtype=torch.float64)
    for _ in range(200):
        sample, info = rb.sample(30, return_info=True)
        assert info["index", "buffer_ids"].tolist() == [0, 1, 2]
        assert torch.equal(sample[..., 0], torch.arange(3)[:, None].expand(3, 10))
        rows += torch.bincount(sample[..., 1].flatten(), minlength=5)
    assert _chi2(rows, torch.full((5,), 0.2, dtype=torch.float64)) < 18.467  # df=4 at 1e-3


def test_same_generator_seed_same_samples():
    a = ReplayBufferEnsemble(*_members(3), p=[0.2, 0.3, 0.5], generator=torch.Generator().manual_seed(5))
    b = ReplayBufferEnsemble(*_members(3), p=[0.2, 0.3, 0.5], generator=torch.Generator().manual_seed(5))
    for _ in range(5):
        assert torch.equal(a.sample(12), b.sample(12))


def test_tensordict_members_get_index_and_buffer_ids_and_transforms():
    members = []
    for member in range(2):
        rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10))
        rb.extend(TensorDict(obs=torch.arange(10) * 10 + member, batch_size=[10]))
        rb.append_transform(lambda td, m=member: td.set("seen_by", torch.full(td.shape, m)))
        members.append(rb)
    ensemble = ReplayBufferEnsemble(*members, num_buffer_sampled=2, generator=torch.Generator().manual_seed(3))
    ensemble.append_transform(lambda td: td.set("doubled", td["obs"] * 2))
    for _ in range(10):
        sample = ensemble.sample(6)
        assert sample.batch_size == (2, 3)
        ids, rows = sample["index", "buffer_ids"], sample["index", "index"]
        assert torch.equal(sample["obs"], rows * 10 + ids)
        assert torch.equal(sample["seen_by"], ids)
        assert torch.equal(sample["doubled"], sample["obs"] * 2)


def test_multi_dim_members():
    gen = torch.Generator().manual_seed(4)
    rb = ReplayBufferEnsemble(*_members(2, n=3, ndim=2), p=[0.5, 0.5], num_buffer_sampled=2, generator=gen)
    sample, info = rb.sample(8, return_info=True)
    assert sample.shape == (2, 4)
    assert info["index"]["index"].shape == (2, 4, 2)  # (row, column) coordinates
    assert torch.equal(sample, info["index", "buffer_ids"][:, None].expand(2, 4))


def test_built_from_components_and_list_members():
    storages = StorageEnsemble(ListStorage(5), ListStorage(5))
    samplers = SamplerEnsemble(RandomSampler(), RandomSampler(), num_buffer_sampled=2)
    writers = WriterEnsemble(RoundRobinWriter(), RoundRobinWriter())
    rb = ReplayBufferEnsemble(storages=storages, samplers=samplers, writers=writers, batch_size=4)
    rb[0].extend([torch.tensor(0)] * 5)
    rb[1].extend([torch.tensor(1)] * 5)
    assert rb.sample().shape == (2, 2)
    assert rb.write_count == 10


def test_indexing_len_state_and_empty(tmp_path):
    rb = ReplayBufferEnsemble(*_members(3), p=[0.2, 0.3, 0.5], num_buffer_sampled=3)
    assert len(rb) == 3 and len(rb.storage) == 3
    assert rb[1] is rb._rbs[1]
    sub = rb[[0, 2]]
    assert isinstance(sub, ReplayBufferEnsemble) and len(sub) == 2
    assert torch.allclose(sub.sampler.p, torch.tensor([0.2, 0.5], dtype=torch.float64) / 0.7)
    assert rb[2, 3].tolist() == [2, 3]
    assert rb[:, 0].tolist() == [[0, 0], [1, 0], [2, 0]]
    assert rb.storage[1] is rb[1].storage
    state = rb.state_dict()
    other = ReplayBufferEnsemble(*[ReplayBuffer(storage=LazyTensorStorage(20)) for _ in range(3)])
    other.load_state_dict(state)
    assert torch.equal(other[2][:], rb[2][:])
    rb.dumps(tmp_path / "ckpt")  # gpubuf's pickle-free checkpoint, member by member
    restored = ReplayBufferEnsemble(*[ReplayBuffer(storage=LazyTensorStorage(20)) for _ in range(3)])
    restored.loads(tmp_path / "ckpt")
    assert all(torch.equal(restored[i][:], rb[i][:]) for i in range(3))
    rb.empty()
    assert [len(member) for member in rb._rbs] == [0, 0, 0]


# ---------------------------------------------------------------------------------------------
# Bad input: typed errors, buffers unchanged
# ---------------------------------------------------------------------------------------------


def test_batch_size_not_a_multiple_of_the_chunks():
    rb = ReplayBufferEnsemble(*_members(3), num_buffer_sampled=4)
    with pytest.raises(EnsembleBatchSizeError):
        rb.sample(10)
    with pytest.raises(ValueError):  # TorchRL raises ValueError here
        rb.sample(10)
    with pytest.raises(BatchSizeError):
        rb.sample()


def test_writes_to_the_ensemble_are_refused():
    members = _members(2)
    rb = ReplayBufferEnsemble(*members)
    before = [member[:].clone() for member in members]
    for write in (lambda: rb.extend(torch.zeros(3, 2)), lambda: rb.add(torch.zeros(2)), lambda: rb.__setitem__(0, torch.zeros(2))):
        with pytest.raises(ImmutableStorageError):
            write()
    with pytest.raises(RuntimeError):  # also a RuntimeError, as in TorchRL
        rb.storage.set(0, torch.zeros(2))
    with pytest.raises(ImmutableStorageError):
        rb.writer.extend(torch.zeros(3, 2))
    assert all(torch.equal(m[:], b) for m, b in zip(members, before))
    assert rb.write_count == 40


def test_bad_weights_and_options():
    with pytest.raises(RuntimeError, match="sample_from_all"):
        ReplayBufferEnsemble(*_members(2), p=[0.5, 0.5], sample_from_all=True)
    with pytest.raises(ValueError, match="p must"):
        ReplayBufferEnsemble(*_members(2), p=[0.5, 0.3, 0.2])
    with pytest.raises(ValueError, match="p must"):
        ReplayBufferEnsemble(*_members(2), p=[-1.0, 2.0])
    with pytest.raises(TypeError, match="transforms"):
        StorageEnsemble(ListStorage(2), transforms=[None, None])


def test_empty_member_drawn():
    members = _members(1) + [ReplayBuffer(storage=LazyTensorStorage(5))]
    rb = ReplayBufferEnsemble(*members, sample_from_all=True)
    with pytest.raises(EmptyBufferError, match="member 1"):
        rb.sample(4)


@pytest.mark.parametrize("refusing_member", [0, 1])
def test_routed_write_refused_by_one_member_leaves_every_member_unchanged(refusing_member):
    members = [gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(8)) for _ in range(2)]
    # One member already holds rows of another schema, so it refuses its part of the batch.
    members[refusing_member].extend(TensorDict({"obs": torch.ones(3, 2), "member": torch.zeros(3, dtype=torch.long)}, [3]))
    rb = gpubuf.ReplayBufferEnsemble(*members, routing_key="member")
    before = [(len(m), m._writer._cursor, m._writer._write_count, m[:] if len(m) else None) for m in members]
    data = TensorDict({"obs": torch.arange(5.0), "member": torch.tensor([0, 1, 1, 0, 1])}, [5])
    with pytest.raises(gpubuf.errors.SchemaMismatchError):
        rb.extend(data)
    after = [(len(m), m._writer._cursor, m._writer._write_count, m[:] if len(m) else None) for m in members]
    for (n0, c0, w0, rows0), (n1, c1, w1, rows1) in zip(before, after):
        assert (n0, c0, w0) == (n1, c1, w1)
        assert (rows0 is None and rows1 is None) or (rows0 == rows1).all()
