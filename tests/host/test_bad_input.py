"""Bad input gets a typed error naming what was wrong, and leaves the buffer exactly as it was."""

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, TensorDictReplayBuffer
from gpubuf.errors import (
    BatchSizeError,
    CapacityError,
    DeviceMismatchError,
    DTypeMismatchError,
    EmptyBufferError,
    GpubufError,
    IndexOutOfRangeError,
    SchemaMismatchError,
    UnsupportedDataError,
)


def make_td(n):
    return TensorDict(
        {
            "obs": torch.randn(n, 4),
            ("next", "obs"): torch.randn(n, 4),
            "reward": torch.randn(n, 1),
            "done": torch.zeros(n, 1, dtype=torch.bool),
        },
        batch_size=[n],
    )


def snapshot(rb):
    storage = rb.storage
    leaves = None if storage._leaves is None else [leaf.clone() for leaf in storage._leaves]
    return len(rb), rb.write_count, rb.writer._cursor, leaves


def assert_unchanged(rb, before):
    after = snapshot(rb)
    assert after[:3] == before[:3]
    if before[3] is None:
        assert after[3] is None
    else:
        assert len(after[3]) == len(before[3])
        for a, b in zip(after[3], before[3]):
            # Compare bytes: rows never written hold uninitialised memory, which may read as NaN.
            assert torch.equal(_bytes(a), _bytes(b))


def _bytes(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def filled():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    rb.extend(make_td(15))  # wraps nothing yet; cursor at 15
    return rb


def _drop(td, key):
    td = td.clone()
    td.del_(key)
    return td


BAD_BATCHES = {
    "missing key": (lambda: _drop(make_td(5), "reward"), SchemaMismatchError, "missing key"),
    "missing nested key": (lambda: _drop(make_td(5), ("next", "obs")), SchemaMismatchError, "'next', 'obs'"),
    "extra key": (lambda: make_td(5).set("extra", torch.zeros(5)), SchemaMismatchError, "unexpected key"),
    "wrong trailing shape": (lambda: make_td(5).set("obs", torch.randn(5, 3)), SchemaMismatchError, "expected [5, 4]"),
    "wrong dtype": (lambda: make_td(5).set("obs", torch.randn(5, 4, dtype=torch.float64)), DTypeMismatchError, "float32"),
    "wrong item batch": (
        lambda: TensorDict({k: v.unsqueeze(1) for k, v in make_td(5).items(True, True)}, [5, 1]),
        SchemaMismatchError,
        "batch_size",
    ),
    "non-tensor leaf": (lambda: make_td(5).set("note", "hello"), UnsupportedDataError, "note"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_bad_extend_raises_typed_error_and_changes_nothing(filled, case):
    make, error, fragment = BAD_BATCHES[case]
    batch = make()
    before = snapshot(filled)
    had_index = "index" in batch.keys()
    with pytest.raises(error) as excinfo:
        filled.extend(batch)
    assert isinstance(excinfo.value, GpubufError)
    assert fragment in str(excinfo.value)
    assert_unchanged(filled, before)
    # the writer's "index" entry is not left behind on a rejected batch
    assert ("index" in batch.keys()) == had_index


def test_bad_extend_near_wrap_changes_nothing(filled):
    before = snapshot(filled)
    bad = make_td(10).set("obs", torch.randn(10, 4, dtype=torch.float16))
    with pytest.raises(DTypeMismatchError):
        filled.extend(bad)
    assert_unchanged(filled, before)
    # and a good batch after the failure lands where the cursor was
    assert filled.extend(make_td(10)).tolist() == [15, 16, 17, 18, 19, 0, 1, 2, 3, 4]


def test_non_tensor_into_tensor_storage():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.arange(3.0))
    before = snapshot(rb)
    for bad in (["a", "b"], [{"x": "y"}], "text"):
        with pytest.raises(UnsupportedDataError):
            rb.extend(bad)
        assert_unchanged(rb, before)
    with pytest.raises(UnsupportedDataError):
        rb.add("text")
    assert_unchanged(rb, before)


def test_non_tensor_into_empty_tensor_storage_leaves_it_uninitialised():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    with pytest.raises(UnsupportedDataError):
        rb.extend(["a", "b"])
    assert not rb.storage.initialized and len(rb) == 0 and rb.write_count == 0


def test_tensor_of_wrong_shape_into_tensor_buffer():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.zeros(4, 3))
    before = snapshot(rb)
    with pytest.raises(SchemaMismatchError, match=r"expected \[2, 3\]"):
        rb.extend(torch.zeros(2, 5))
    with pytest.raises(DTypeMismatchError):
        rb.extend(torch.zeros(2, 3, dtype=torch.int32))
    assert_unchanged(rb, before)


def test_batch_on_wrong_device_when_device_is_fixed():
    # device="auto" fixes the device with the first batch (here the CPU); a later batch elsewhere is refused.
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10, device="auto"))
    rb.extend(make_td(3))
    before = snapshot(rb)
    with pytest.raises(DeviceMismatchError, match="expected cpu"):
        rb.extend(make_td(2).to("meta"))
    assert_unchanged(rb, before)


def test_batch_that_cannot_be_moved_to_explicit_device():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10, device="cpu"))
    rb.extend(make_td(3))
    before = snapshot(rb)
    with pytest.raises(DeviceMismatchError, match="meta"):
        rb.extend(make_td(2).to("meta"))
    assert_unchanged(rb, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised where CUDA is absent")
def test_cuda_storage_without_cuda_is_refused_at_construction():
    # As TorchRL: the storage is refused where it is made, not at the first write.
    with pytest.raises(DeviceMismatchError, match="CUDA is not available"):
        LazyTensorStorage(10, device="cuda")


@pytest.mark.parametrize("storage", [lambda: LazyTensorStorage(10), lambda: ListStorage(10)])
def test_sampling_an_empty_buffer(storage):
    rb = ReplayBuffer(storage=storage(), batch_size=2)
    with pytest.raises(EmptyBufferError, match="empty"):
        rb.sample()
    assert len(rb) == 0 and rb.write_count == 0


def test_sampling_after_empty_raises():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=2)
    rb.extend(torch.arange(4))
    rb.empty()
    with pytest.raises(EmptyBufferError):
        rb.sample()


def test_no_batch_size_anywhere():
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.arange(4))
    before = snapshot(rb)
    with pytest.raises(BatchSizeError, match="batch_size"):
        rb.sample()
    with pytest.raises(BatchSizeError):
        iter(rb).__next__()
    assert_unchanged(rb, before)


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_non_positive_batch_size(bad):
    rb = ReplayBuffer(storage=LazyTensorStorage(10))
    rb.extend(torch.arange(4))
    with pytest.raises(BatchSizeError):
        rb.sample(bad)
    with pytest.raises(BatchSizeError):
        ReplayBuffer(storage=LazyTensorStorage(10), batch_size=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.5, "10", None, True])
def test_bad_max_size(bad):
    with pytest.raises(CapacityError):
        LazyTensorStorage(bad)
    if bad is not None:
        with pytest.raises(CapacityError):
            ListStorage(bad)


def test_index_out_of_range_on_read(filled):
    before = snapshot(filled)
    with pytest.raises(IndexOutOfRangeError):
        filled[15]
    with pytest.raises(IndexOutOfRangeError):
        filled[torch.tensor([0, 99])]
    with pytest.raises(IndexOutOfRangeError):
        filled.storage.get(torch.tensor([-16]))
    assert_unchanged(filled, before)


def test_set_out_of_range_cursor_writes_nothing(filled):
    before = snapshot(filled)
    with pytest.raises(IndexOutOfRangeError):
        filled.storage.set(torch.tensor([3, 25]), make_td(2).set("index", torch.zeros(2, dtype=torch.long)))
    assert_unchanged(filled, before)


def test_an_empty_batch_writes_nothing_into_a_tensordict_buffer_and_a_plain_buffer_refuses_it(filled):
    """TorchRL's TensorDict buffers take an empty batch (a collector step that kept nothing) and
    write nothing; its ReplayBuffer refuses one with a RuntimeError. gpubuf's do the same."""
    before = snapshot(filled)
    index = filled.extend(make_td(0))
    assert index.dtype == torch.int64 and index.shape == (0,)
    assert_unchanged(filled, before)
    assert len(filled.sample()) == 4
    plain = ReplayBuffer(storage=LazyTensorStorage(20), batch_size=4)
    plain.extend(make_td(5))
    before = snapshot(plain)
    with pytest.raises(SchemaMismatchError, match="empty batch") as raised:
        plain.extend(make_td(0))
    assert isinstance(raised.value, RuntimeError)
    assert_unchanged(plain, before)


def test_tensordict_buffer_refuses_plain_tensors(filled):
    before = snapshot(filled)
    with pytest.raises(UnsupportedDataError, match="TensorDict"):
        filled.extend(torch.zeros(3, 4))
    assert_unchanged(filled, before)
