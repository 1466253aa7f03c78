"""TensorDictMaxValueWriter (keeps exactly the top rows) and ImmutableDatasetWriter (refuses writes)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict, tensorclass

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer, TensorStorage
from gpubuf.errors import SchemaMismatchError, UnsupportedDataError
from gpubuf.samplers import SamplerWithoutReplacement
from gpubuf.storages.packed import PackedStorage
from gpubuf.writers.immutable import ImmutableDatasetWriter, ImmutableStorageError
from gpubuf.writers.max_value import RankKeyError, RankValueError, TensorDictMaxValueWriter

torchrl_data = pytest.importorskip("torchrl.data")


def _batch(ranks, start=0):
    ranks = torch.as_tensor(ranks, dtype=torch.float32)
    n = ranks.shape[0]
    return TensorDict({"key": ranks, "obs": torch.arange(start, start + n)}, batch_size=[n])


def test_torchrl_docstring_example():
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(1),
        sampler=SamplerWithoutReplacement(),
        batch_size=1,
        writer=TensorDictMaxValueWriter(rank_key="key"),
    )
    rb.extend(TensorDict({"key": torch.arange(10), "obs": torch.arange(10)}, batch_size=10))
    assert rb.sample().get("obs").item() == 9
    rb.extend(TensorDict({"key": torch.arange(10, 20), "obs": torch.arange(10, 20)}, batch_size=10))
    assert rb.sample().get("obs").item() == 19
    rb.extend(TensorDict({"key": torch.arange(10), "obs": torch.arange(10)}, batch_size=10))
    assert rb.sample().get("obs").item() == 19


@pytest.mark.parametrize("storage", ["tensor", "list", "packed"])
@pytest.mark.parametrize("capacity", [1, 7, 16])
def test_keeps_exactly_the_top_rows(storage, capacity):
    gen = torch.Generator().manual_seed(capacity)
    make = {"tensor": LazyTensorStorage, "list": ListStorage, "packed": PackedStorage}[storage]
    rb = ReplayBuffer(storage=make(capacity), writer=TensorDictMaxValueWriter(rank_key="key"))
    seen_ranks, seen_obs = [], []
    start = 0
    for _ in range(12):
        n = int(torch.randint(1, 10, (), generator=gen))
        ranks = torch.randperm(10_000, generator=gen)[:n].float()  # distinct ranks: one right answer
        rb.extend(_batch(ranks, start))
        seen_ranks.append(ranks)
        seen_obs.append(torch.arange(start, start + n))
        start += n
        all_ranks, all_obs = torch.cat(seen_ranks), torch.cat(seen_obs)
        top = all_obs[torch.argsort(all_ranks, descending=True)[:capacity]]
        stored = rb.storage.get(torch.arange(len(rb)))
        stored = torch.stack([s["obs"] for s in stored]) if isinstance(stored, list) else stored["obs"]
        assert sorted(stored.tolist()) == sorted(top.tolist())


def test_same_rows_as_torchrl():
    gen = torch.Generator().manual_seed(0)
    ours = TensorDictReplayBuffer(storage=LazyTensorStorage(8), writer=TensorDictMaxValueWriter(rank_key="key"))
    theirs = torchrl_data.TensorDictReplayBuffer(
        storage=torchrl_data.LazyTensorStorage(8), writer=torchrl_data.TensorDictMaxValueWriter(rank_key="key")
    )
    start = 0
    for _ in range(6):
        ranks = torch.randperm(1000, generator=gen)[:5].float()
        index_ours = ours.extend(_batch(ranks, start))
        index_theirs = theirs.extend(_batch(ranks, start))
        assert ((index_ours >= 0) == (index_theirs >= 0)).all()  # the same rows make the cut
        start += 5
    assert sorted(ours[:]["obs"].tolist()) == sorted(theirs[:]["obs"].tolist())


def test_extend_returns_slots_and_minus_one_and_counts_writes():
    rb = ReplayBuffer(storage=LazyTensorStorage(3), writer=TensorDictMaxValueWriter(rank_key="key"))
    assert rb.extend(_batch([5.0, 1.0])).tolist() == [0, 1]
    index = rb.extend(_batch([0.5, 7.0, 3.0], start=2))
    # 0.5 drops; 7 and 3 make the cut and go, in batch order, to the free slot 2 and then to
    # slot 1, whose rank (1.0) is now the lowest.
    assert index.tolist() == [-1, 2, 1]
    assert sorted(rb[:]["obs"].tolist()) == [0, 3, 4]
    assert rb.write_count == 4


def test_ties_keep_what_is_stored():
    rb = ReplayBuffer(storage=LazyTensorStorage(2), writer=TensorDictMaxValueWriter(rank_key="key"))
    rb.extend(_batch([1.0, 1.0]))
    assert rb.extend(_batch([1.0], start=2)).tolist() == [-1]
    assert sorted(rb[:]["obs"].tolist()) == [0, 1]


@pytest.mark.parametrize("reduction,expected", [("sum", [1]), ("max", [0]), ("min", [1]), ("mean", [1]), ("median", [1])])
def test_reductions_rank_trajectories(reduction, expected):
    rewards = torch.tensor([[0.0, 0.0, 9.0], [2.0, 2.0, 2.0]])  # sum 9 vs 6, max 9 vs 2, min 0 vs 2 ...
    rewards[0] = torch.tensor([-5.0, 0.0, 9.0])  # sum 4 < 6, max 9 > 2, min -5 < 2, mean 1.33 < 2, median 0 < 2
    data = TensorDict({("next", "reward"): rewards, "obs": torch.arange(2)}, batch_size=[2])
    rb = ReplayBuffer(storage=LazyTensorStorage(1), writer=TensorDictMaxValueWriter(reduction=reduction))
    rb.extend(data)
    assert rb[:]["obs"].tolist() == expected


def test_add_one_item_and_get_insert_index():
    writer = TensorDictMaxValueWriter(rank_key="key")
    rb = ReplayBuffer(storage=LazyTensorStorage(2), writer=writer)
    assert rb.add(TensorDict(key=torch.tensor(3.0), obs=torch.tensor(0))) == 0
    assert rb.add(TensorDict(key=torch.tensor(1.0), obs=torch.tensor(1))) == 1
    assert writer.get_insert_index(TensorDict(key=torch.tensor(0.0), obs=torch.tensor(2))) is None
    assert rb.add(TensorDict(key=torch.tensor(2.0), obs=torch.tensor(3))) == 1
    assert sorted(rb[:]["obs"].tolist()) == [0, 3]


def test_checkpoint_keeps_the_ranks(tmp_path):
    writer = TensorDictMaxValueWriter(rank_key=("next", "reward"))
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(3), writer=writer)
    rb.extend(TensorDict({("next", "reward"): torch.arange(5.0), "obs": torch.arange(5)}, batch_size=[5]))
    rb.dumps(tmp_path / "ckpt")
    other = TensorDictReplayBuffer(storage=LazyTensorStorage(3), writer=TensorDictMaxValueWriter(rank_key=("next", "reward")))
    other.loads(tmp_path / "ckpt")
    assert other.writer.rank_key == ("next", "reward")
    other.extend(TensorDict({("next", "reward"): torch.tensor([2.5]), "obs": torch.tensor([9])}, batch_size=[1]))
    assert sorted(other[:]["obs"].tolist()) == [3, 4, 9]


def test_tensorclass_rows_and_state_dict_round_trip():
    @tensorclass
    class Scored:
        key: torch.Tensor
        obs: torch.Tensor

    rb = ReplayBuffer(storage=LazyTensorStorage(3), writer=TensorDictMaxValueWriter(rank_key="key"))
    rb.extend(Scored(key=torch.tensor([3.0, 1.0, 2.0, 9.0]), obs=torch.arange(4), batch_size=[4]))
    assert sorted(rb[:].obs.tolist()) == [0, 2, 3]
    other = ReplayBuffer(storage=LazyTensorStorage(3), writer=TensorDictMaxValueWriter(rank_key="key"))
    other.load_state_dict(rb.state_dict())
    other.extend(Scored(key=torch.tensor([2.5]), obs=torch.tensor([7]), batch_size=[1]))
    assert sorted(other[:].obs.tolist()) == [0, 3, 7]
    rb.empty()
    assert len(rb) == 0 and rb.extend(Scored(key=torch.tensor([0.0]), obs=torch.tensor([5]), batch_size=[1])).tolist() == [0]


# ---------------------------------------------------------------------------------------------
# Bad input: typed errors, buffer unchanged
# ---------------------------------------------------------------------------------------------


def _state(rb):
    return len(rb), rb.write_count, rb.writer._cursor, rb[:]["obs"].tolist(), rb.writer._ranks.tolist()


def test_missing_rank_key_is_a_typed_error_and_changes_nothing():
    rb = ReplayBuffer(storage=LazyTensorStorage(4), writer=TensorDictMaxValueWriter(rank_key="key"))
    rb.extend(_batch([1.0, 2.0]))
    before = _state(rb)
    with pytest.raises(RankKeyError, match="'key'"):
        rb.extend(TensorDict(obs=torch.arange(3), batch_size=[3]))
    with pytest.raises(KeyError):  # TorchRL raises KeyError
        rb.add(TensorDict(obs=torch.tensor(1)))
    with pytest.raises(SchemaMismatchError):
        rb.add(TensorDict(obs=torch.tensor(1)))
    assert _state(rb) == before


def test_other_bad_rank_inputs():
    rb = ReplayBuffer(storage=LazyTensorStorage(4), writer=TensorDictMaxValueWriter(rank_key="key"))
    rb.extend(_batch([1.0, 2.0]))
    before = _state(rb)
    with pytest.raises(RankValueError, match="NaN"):
        rb.extend(_batch([float("nan"), 1.0]))
    with pytest.raises(UnsupportedDataError):
        rb.extend(torch.zeros(3))
    with pytest.raises(SchemaMismatchError):
        rb.extend(TensorDict(key=torch.zeros(2, 2, 2), obs=torch.zeros(2, 2, 2), batch_size=[2, 2, 2]))
    with pytest.raises(SchemaMismatchError):  # the storage refuses: "obs" of another shape
        rb.extend(TensorDict(key=torch.tensor([5.0]), obs=torch.zeros(1, 3, dtype=torch.long), batch_size=[1]))
    assert _state(rb) == before
    with pytest.raises(ValueError, match="reduction"):
        TensorDictMaxValueWriter(reduction="prod")
    with pytest.raises(ValueError, match="more than one dimension"):
        ReplayBuffer(storage=LazyTensorStorage(4, ndim=2), writer=TensorDictMaxValueWriter())


# ---------------------------------------------------------------------------------------------
# ImmutableDatasetWriter
# ---------------------------------------------------------------------------------------------


def test_immutable_dataset_samples_and_refuses_every_write():
    data = TensorDict(obs=torch.arange(10), batch_size=[10])
    rb = TensorDictReplayBuffer(storage=TensorStorage(data), writer=ImmutableDatasetWriter(), batch_size=4)
    assert rb.sample()["obs"].shape == (4,)
    before = rb[:]["obs"].clone()
    writes = [
        lambda: rb.extend(TensorDict(obs=torch.arange(3), batch_size=[3])),
        lambda: rb.add(TensorDict(obs=torch.tensor(1))),
        lambda: rb.empty(),
        lambda: rb.__setitem__(0, TensorDict(obs=torch.tensor(-1))),
    ]
    for write in writes:
        with pytest.raises(ImmutableStorageError):
            write()
        with pytest.raises(RuntimeError):  # TorchRL raises RuntimeError
            write()
    assert torch.equal(rb[:]["obs"], before) and len(rb) == 10 and rb.write_count == 0
    assert rb.state_dict()["_writer"] == {}
    rb.load_state_dict(rb.state_dict())


def test_immutable_dataset_over_packed_sequences():
    storage = PackedStorage(4)
    storage.set(range(3), [TensorDict(tokens=torch.arange(n)) for n in (2, 3, 4)])
    rb = ReplayBuffer(storage=storage, writer=ImmutableDatasetWriter(), batch_size=2)
    assert rb.sample()["tokens"].shape[0] == 2
    with pytest.raises(ImmutableStorageError):
        rb.extend([TensorDict(tokens=torch.arange(5))])
    assert len(rb) == 3
