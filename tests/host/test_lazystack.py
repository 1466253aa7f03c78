"""LazyStackStorage (TorchRL's behaviour, side by side) and its packed ``densify=True`` mode."""

from __future__ import annotations

import pytest
import torch
from tensordict import LazyStackedTensorDict, NonTensorStack, TensorDict, lazy_stack

from gpubuf import ReplayBuffer, TensorDictReplayBuffer
from gpubuf.errors import DTypeMismatchError, EmptyBufferError, IndexOutOfRangeError, SchemaMismatchError, UnsupportedDataError
from gpubuf.storages.packed import PackedStorage
from gpubuf.storages.stack import LazyStackStorage

torchrl_data = pytest.importorskip("torchrl.data")


def _doc_example(rb_cls, storage_cls, **kwargs):
    """TorchRL's LazyStackStorage docstring example, as written."""
    _ = torch.manual_seed(0)
    rb = rb_cls(storage=storage_cls(max_size=1000, stack_dim=-1, **kwargs))
    data0 = TensorDict(a=torch.randn((10,)), b=torch.rand(4), c="a string!")
    data1 = TensorDict(a=torch.randn((11,)), b=torch.rand(4), c="another string!")
    _ = rb.add(data0)
    _ = rb.add(data1)
    return rb, rb.sample(10)


def test_documentation_example_prints_what_torchrl_prints():
    _, ours = _doc_example(ReplayBuffer, LazyStackStorage)
    _, theirs = _doc_example(torchrl_data.ReplayBuffer, torchrl_data.LazyStackStorage)
    assert isinstance(ours, LazyStackedTensorDict)
    assert str(ours) == str(theirs)
    assert ours.batch_size == (10,) and ours.stack_dim == 0
    assert ours.get("a", as_nested_tensor=True).shape[0] == 10
    assert ours["c"] == theirs["c"]


def test_documentation_example_densified_equals_torchrl_densify():
    rb, ours = _doc_example(ReplayBuffer, LazyStackStorage, densify=True)
    _, theirs = _doc_example(torchrl_data.ReplayBuffer, torchrl_data.LazyStackStorage)
    theirs = theirs.densify(layout=torch.jagged)
    assert ours.batch_size == theirs.batch_size == (10,)
    assert ours["a"].is_nested and ours["a"].layout == torch.jagged
    assert torch.equal(ours["a"].offsets(), theirs["a"].offsets())
    assert torch.equal(ours["a"].values(), theirs["a"].values())
    assert torch.equal(ours["b"], theirs["b"]) and not ours["b"].is_nested
    assert isinstance(ours.get("c"), NonTensorStack) and ours["c"] == theirs["c"]


def _items(n, gen, max_len=12, with_string=True):
    items = []
    for i in range(n):
        length = int(torch.randint(1, max_len + 1, (), generator=gen))
        td = TensorDict(
            tokens=torch.randint(0, 1000, (length,), generator=gen),
            mask=torch.rand(length, generator=gen) > 0.3,
            emb=torch.randn(length, 3, generator=gen),
            score=torch.randn((), generator=gen),
            nested=TensorDict(prompt=torch.randint(0, 9, (int(torch.randint(0, 5, (), generator=gen)),), generator=gen)),
        )
        if with_string:
            td["name"] = f"item-{i}"
        items.append(td)
    return items


def _naive_batch(items, index):
    """What TorchRL's sample gives once densified: the per-row reference."""
    return lazy_stack([items[i] for i in index]).densify(layout=torch.jagged)


def _assert_batch_equal(got, want):
    assert got.batch_size == want.batch_size
    for key in want.keys(include_nested=True, leaves_only=True):
        g, w = got.get(key), want.get(key)
        if isinstance(w, torch.Tensor) and w.is_nested:
            g_rows = g.unbind() if g.is_nested else list(g)
            assert len(g_rows) == len(w.unbind())
            for a, b in zip(g_rows, w.unbind()):
                assert torch.equal(a, b)
        elif isinstance(w, torch.Tensor):
            assert torch.equal(g, w), key
        else:
            assert g.tolist() == w.tolist(), key


@pytest.mark.parametrize("storage_cls", ["packed", "densify"])
def test_packed_sampling_equals_the_naive_per_row_result(storage_cls):
    gen = torch.Generator().manual_seed(3)
    items = _items(40, gen)
    storage = PackedStorage(64) if storage_cls == "packed" else LazyStackStorage(64, densify=True)
    rb = ReplayBuffer(storage=storage, batch_size=16)
    rb.extend(items)
    for _ in range(5):
        batch, info = rb.sample(return_info=True)
        _assert_batch_equal(batch, _naive_batch(items, info["index"].tolist()))
    assert batch["tokens"].offsets() is batch["mask"].offsets()  # shared lengths share offsets


def test_packed_overwrites_and_compaction_keep_rows_exact():
    gen = torch.Generator().manual_seed(4)
    mirror: list = [None] * 10
    rb = ReplayBuffer(storage=PackedStorage(10), batch_size=8)
    cursor = 0
    for step in range(30):
        batch = _items(int(torch.randint(1, 7, (), generator=gen)), gen, max_len=40, with_string=False)
        rb.extend(batch)
        for item in batch:
            mirror[cursor % 10] = item
            cursor += 1
        index = torch.arange(len(rb))
        _assert_batch_equal(rb.storage.get(index), _naive_batch(mirror, index.tolist()))
    # Garbage from overwrites was reclaimed: the arena stays within a few times the live tokens.
    group = rb.storage._groups[0]
    assert group.capacity <= 4 * max(rb.storage.num_tokens, 1024)


def test_packed_set_with_slots_and_duplicates():
    gen = torch.Generator().manual_seed(5)
    items = _items(6, gen, with_string=False)
    storage = PackedStorage(10)
    storage.set(range(4), items[:4])
    storage.set(torch.tensor([1, 4, 1]), items[3:6])  # slot 1 twice: the last item wins
    assert len(storage) == 5
    _assert_batch_equal(storage.get([0, 1, 2, 3, 4]), _naive_batch([items[0], items[5], items[2], items[3], items[4]], range(5)))
    assert torch.equal(storage[1]["tokens"], items[5]["tokens"])
    assert torch.equal(storage[-1]["emb"], items[4]["emb"])


def test_item_reads_are_views_that_later_writes_do_not_change():
    storage = PackedStorage(2)
    storage.set(0, TensorDict(x=torch.arange(5)))
    first = storage[0]["x"]
    storage.set(0, TensorDict(x=torch.arange(100, 103)))
    storage.set(1, TensorDict(x=torch.arange(7)))
    assert first.tolist() == list(range(5))
    assert storage[0]["x"].tolist() == [100, 101, 102]


def test_uniform_lengths_give_dense_tensors_and_plain_tensors_work():
    rb = ReplayBuffer(storage=PackedStorage(10), batch_size=4)
    rb.extend(torch.arange(12).reshape(4, 3))  # a dense batch: 4 rows of 3 tokens
    sample = rb.sample()
    assert not sample.is_nested and sample.shape == (4, 3)
    rb.add(torch.arange(5))
    full = rb[:]
    assert full.is_nested and [r.tolist() for r in full.unbind()][-1] == list(range(5))


def test_nested_batches_and_lazy_stacks_are_accepted():
    gen = torch.Generator().manual_seed(6)
    items = _items(5, gen, with_string=False)
    storage = PackedStorage(20)
    storage._write_rows(0, lazy_stack(items))
    storage._write_rows(5, lazy_stack(items).densify(layout=torch.jagged))
    _assert_batch_equal(storage.get(range(10)), _naive_batch(items + items, range(10)))


def test_state_dict_round_trip_both_modes(tmp_path):
    gen = torch.Generator().manual_seed(7)
    items = _items(12, gen)
    for densify in (False, True):
        rb = ReplayBuffer(storage=LazyStackStorage(8, densify=densify))
        rb.extend(items)
        state = rb.state_dict()
        torch.save(state, tmp_path / "state.pt")
        other = ReplayBuffer(storage=LazyStackStorage(8, densify=densify))
        other.load_state_dict(torch.load(tmp_path / "state.pt", weights_only=False))
        assert len(other) == len(rb) == 8
        index = torch.arange(8)
        a, b = rb.storage.get(index), other.storage.get(index)
        if not densify:
            a, b = a.densify(layout=torch.jagged), b.densify(layout=torch.jagged)
        _assert_batch_equal(b, a)
        with pytest.raises(SchemaMismatchError):
            ReplayBuffer(storage=LazyStackStorage(8, densify=not densify)).load_state_dict(state)


def test_tensordict_replay_buffer_marks_index():
    gen = torch.Generator().manual_seed(8)
    rb = TensorDictReplayBuffer(storage=LazyStackStorage(50), batch_size=6)
    rb.extend(lazy_stack(_items(10, gen)))
    sample = rb.sample()
    assert sample["index"].shape == (6,)
    rb = TensorDictReplayBuffer(storage=LazyStackStorage(50, densify=True), batch_size=6)
    rb.extend(lazy_stack(_items(10, gen)))
    sample = rb.sample()
    assert sample["index"].shape == (6,) and sample["tokens"].is_nested


def test_ragged_plain_tensors_become_jagged_and_objects_stay_lists():
    rb = ReplayBuffer(storage=LazyStackStorage(10))
    rb.extend([torch.arange(3), torch.arange(5)])
    out = rb[:]
    assert out.is_nested and [r.tolist() for r in out.unbind()] == [[0, 1, 2], [0, 1, 2, 3, 4]]
    rb = ReplayBuffer(storage=LazyStackStorage(10))
    rb.extend(["a", {"b": 1}])
    assert rb[:] == ["a", {"b": 1}]


def test_heterogeneous_keys_are_lazily_stacked():
    rb = ReplayBuffer(storage=LazyStackStorage(10))
    rb.add(TensorDict(a=torch.zeros(2), b=torch.ones(1)))
    rb.add(TensorDict(a=torch.zeros(3), c=torch.ones(1)))
    out = rb[:]
    assert isinstance(out, LazyStackedTensorDict) and "a" in out.keys()


# ---------------------------------------------------------------------------------------------
# Bad input: typed errors, storage unchanged
# ---------------------------------------------------------------------------------------------


def _snapshot(rb):
    storage = rb.storage
    return len(rb), rb.write_count, rb.writer._cursor, repr(storage.state_dict())


@pytest.mark.parametrize(
    "bad,error",
    [
        (torch.zeros(3), SchemaMismatchError),  # a tensor among TensorDicts
        (TensorDict(a=torch.zeros(2, 3), batch_size=[2]), SchemaMismatchError),  # another batch ndim
    ],
)
def test_lazy_stack_refuses_items_it_cannot_stack(bad, error):
    rb = ReplayBuffer(storage=LazyStackStorage(10))
    rb.extend([TensorDict(a=torch.zeros(2)), TensorDict(a=torch.zeros(4))])
    before = _snapshot(rb)
    with pytest.raises(error):
        rb.add(bad)
    with pytest.raises(error):
        rb.extend([TensorDict(a=torch.zeros(1)), bad])
    assert _snapshot(rb) == before


@pytest.mark.parametrize(
    "bad,error,match",
    [
        (TensorDict(tokens=torch.zeros(3, dtype=torch.long)), SchemaMismatchError, "missing"),
        (TensorDict(tokens=torch.zeros(3), mask=torch.ones(3, dtype=torch.bool)), DTypeMismatchError, "dtype"),
        (TensorDict(tokens=torch.zeros(3, 2, dtype=torch.long), mask=torch.ones(3, dtype=torch.bool)), SchemaMismatchError, "shape"),
        (TensorDict(tokens=torch.zeros(3, dtype=torch.long), mask="not a tensor"), SchemaMismatchError, "non-tensor"),
        (torch.zeros(3), UnsupportedDataError, "holds TensorDicts"),
        ("a string", UnsupportedDataError, "str"),
        (TensorDict(tokens=torch.zeros(2, 3, dtype=torch.long), mask=torch.ones(2, 3, dtype=torch.bool), batch_size=[2]), UnsupportedDataError, "batch_size"),
    ],
)
def test_densified_storage_needs_one_structure(bad, error, match):
    rb = ReplayBuffer(storage=LazyStackStorage(10, densify=True))
    rb.extend([TensorDict(tokens=torch.arange(n), mask=torch.ones(n, dtype=torch.bool)) for n in (2, 5)])
    before = _snapshot(rb)
    with pytest.raises(error, match=match):
        rb.add(bad)
    with pytest.raises(error, match=match):
        rb.extend([TensorDict(tokens=torch.arange(4), mask=torch.ones(4, dtype=torch.bool)), bad])
    assert _snapshot(rb) == before
    assert rb.sample(3)["tokens"].shape[0] == 3


def test_packed_index_errors_and_empty_storage():
    storage = PackedStorage(4)
    with pytest.raises(EmptyBufferError):
        storage.get(torch.tensor([0]))
    with pytest.raises(EmptyBufferError):
        ReplayBuffer(storage=PackedStorage(4)).sample(2)
    storage.set(0, TensorDict(x=torch.arange(3)))
    with pytest.raises(IndexOutOfRangeError):
        storage.get(torch.tensor([1]))
    with pytest.raises(IndexOutOfRangeError):
        storage.set(2, TensorDict(x=torch.arange(3)))  # skips slot 1
    with pytest.raises(IndexOutOfRangeError):
        storage.set(torch.tensor([1, 4]), [TensorDict(x=torch.arange(1))] * 2)  # past max_size
    assert len(storage) == 1 and storage[0]["x"].tolist() == [0, 1, 2]


def test_densify_needs_stack_dim_zero():
    with pytest.raises(ValueError, match="stack_dim"):
        LazyStackStorage(10, stack_dim=1, densify=True)
