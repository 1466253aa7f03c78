"""Each way bad input used to change or break a buffer, as a test: it is now refused with a typed
error and the buffer unchanged, or accepted and the buffer consistent."""

from __future__ import annotations

import json
import math

import pytest
import torch
from badinput_helpers import assert_same, check_consistent, refused, snapshot
from tensordict import TensorDict

from gpubuf import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    TensorDictMaxValueWriter,
    TensorDictReplayBuffer,
)
from gpubuf.checkpoint import CheckpointCorruptError, CheckpointMismatchError
from gpubuf.errors import (
    CapacityError,
    ComponentTypeError,
    DeviceMismatchError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidDeviceError,
    PriorityError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
)


def state(rb):
    return len(rb), rb.writer._cursor, rb.write_count


# ---------------------------------------------------------------------- 1. a batch aliasing the buffer's own rows
@pytest.mark.parametrize("storage", [LazyTensorStorage, LazyMemmapStorage])
def test_extend_with_a_view_of_its_own_rows_that_wraps(storage):
    rb = ReplayBuffer(storage=storage(16))
    rb.extend(torch.arange(28.0)[:, None])
    twin = ReplayBuffer(storage=LazyTensorStorage(16))
    twin.extend(torch.arange(28.0)[:, None])
    source = rb[0:10]
    index = rb.extend(source)
    twin.extend(twin[0:10].clone())  # what the write means: the rows as they were
    assert index.tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 4, 5]
    assert state(rb) == (16, 6, 38)
    assert torch.equal(rb[:], twin[:])
    check_consistent(rb)


def test_setitem_with_a_shifted_view_of_its_own_rows():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(torch.arange(8.0)[:, None])
    rb[2:6] = rb[0:4]
    assert rb[:].flatten().tolist() == [0, 1, 0, 1, 2, 3, 6, 7]


# ---------------------------------------------------------------------- 2. the sampler refusing after the write
def _prio(storage=None):
    p = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=storage or ListStorage(16))
    p.extend(torch.zeros(6, 3))
    return p


def test_extend_on_the_meta_device_is_refused_before_the_write():
    p = _prio()
    refused(p, lambda: p.extend(torch.zeros(5, 3, device="meta")), ValueError, DeviceMismatchError)
    assert state(p) == (6, 6, 6)


def test_alpha_whose_transform_overflows_is_refused_and_extend_keeps_working():
    p = _prio()
    p.update_priority(torch.tensor([0]), torch.tensor([1e20]))
    refused(p, lambda: setattr(p.sampler, "alpha", 3.0), ValueError, PriorityError)
    assert p.sampler.alpha == 0.7
    assert math.isfinite(float(p.sampler.tree.total()))
    p.extend(torch.zeros(2, 3))
    assert state(p) == (8, 8, 8)


def test_extend_refused_before_the_write_when_new_priorities_would_overflow():
    p = _prio()
    p.update_priority(torch.tensor([0]), torch.tensor([1e20]))
    p.sampler._alpha = 3.0  # set behind the setter's back: extend still refuses before writing
    refused(p, lambda: p.extend(torch.zeros(2, 3)), ValueError, PriorityError)
    assert state(p) == (6, 6, 6)


def test_td_priority_nan_is_refused_before_the_rows_are_written():
    from gpubuf import TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(8))
    rb.extend(TensorDict({"a": torch.arange(3.0)}, [3]))
    bad = TensorDict({"a": torch.arange(2.0), "td_error": torch.tensor([1.0, float("nan")])}, [2])
    refused(rb, lambda: rb.extend(bad), ValueError, PriorityError)
    refused(rb, lambda: rb.add(bad[1]), ValueError, PriorityError)


# ---------------------------------------------------------------------- 3. and 4. load_state_dict
def _pair():
    src = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=4)
    src.extend(torch.arange(8.0)[:, None])
    src.update_priority(torch.arange(8), torch.arange(1.0, 9.0))
    dst = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=2)
    dst.extend(-torch.ones(3, 1))
    return src, dst


def _edit(path, value):
    def edit(sd):
        *head, last = path
        node = sd
        for key in head:
            node = node[key]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return edit


@pytest.mark.parametrize("path,value,error", [
    (("_writer",), KeyError, StateDictKeyError),
    (("_sampler",), KeyError, StateDictKeyError),
    (("_batch_size",), KeyError, StateDictKeyError),
    (("_storage", "_len"), KeyError, StateDictKeyError),
    (("_writer", "_cursor"), "a", StateDictError),
    (("_sampler", "_alpha"), -1, StateDictError),
    (("_sampler", "_max_priority"), float("nan"), StateDictError),
    (("_sampler", "_alpha"), 707.0, StateDictError),  # the maximum 8 overflows float32 then
    (("_storage", "_len"), 10**6, StateDictError),
    (("_storage", "_len"), -3, StateDictError),
    (("_writer", "_cursor"), -1, StateDictError),
    (("_writer", "_cursor"), 10**6, StateDictError),
    (("_writer", "_cursor"), 12, StateDictError),  # past the 8 rows written
    (("_storage",), None, StateDictError),
    (("_batch_size",), 0, StateDictError),
    (("_rng",), ("x", "cpu"), StateDictError),
])
def test_load_state_dict_is_all_or_nothing(path, value, error):
    src, dst = _pair()
    sd = src.state_dict()
    _edit(path, value)(sd)
    err = refused(dst, lambda: dst.load_state_dict(sd), ValueError, error)
    if error is StateDictKeyError:
        assert isinstance(err, KeyError)
    assert dst[:].flatten().tolist() == [-1.0, -1.0, -1.0]


def test_load_state_dict_of_another_capacity_is_refused():
    src = ReplayBuffer(storage=LazyTensorStorage(8))
    src.extend(torch.arange(8.0)[:, None])
    dst = ReplayBuffer(storage=LazyTensorStorage(16))
    dst.extend(-torch.ones(3, 1))
    refused(dst, lambda: dst.load_state_dict(src.state_dict()), ValueError, StateDictError)


def test_load_state_dict_of_plain_tensors_into_a_tensordict_buffer_is_refused():
    src = ReplayBuffer(storage=LazyTensorStorage(8))
    src.extend(torch.arange(8.0)[:, None])
    dst = TensorDictReplayBuffer(storage=LazyTensorStorage(8))
    dst.extend(TensorDict({"a": torch.zeros(2)}, [2]))
    refused(dst, lambda: dst.load_state_dict(src.state_dict()), ValueError, StateDictError)


def test_load_state_dict_priorities_on_unwritten_rows_are_refused():
    src, dst = _pair()
    sd = src.state_dict()
    sd["_storage"]["_len"] = 4  # the tree holds priorities for 8 rows
    sd["_writer"]["_cursor"] = 4
    refused(dst, lambda: dst.load_state_dict(sd), ValueError, StateDictError)


def test_a_valid_state_dict_still_loads_whole():
    src, dst = _pair()
    dst.load_state_dict(src.state_dict())
    assert_same(snapshot(dst), snapshot(src))
    check_consistent(dst)


def test_a_component_that_refuses_late_is_rolled_back(tmp_path):
    """A memory-mapped storage checks its files' layout itself, after the sampler and writer loaded."""
    src = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(8))
    src.extend(torch.arange(16.0).reshape(8, 2))
    dst = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyMemmapStorage(8, scratch_dir=tmp_path / "m"))
    dst.extend(torch.zeros(3, 5))
    refused(dst, lambda: dst.load_state_dict(src.state_dict()), ValueError, SchemaMismatchError)


# ---------------------------------------------------------------------- 5. loads
def test_loads_of_a_tensor_buffer_into_a_tensordict_buffer_is_refused(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    rb.extend(torch.arange(8.0)[:, None])
    rb.dumps(tmp_path / "c")
    target = TensorDictReplayBuffer(storage=LazyTensorStorage(16), batch_size=4)
    target.extend(TensorDict({"a": torch.zeros(2)}, [2]))
    refused(target, lambda: target.loads(tmp_path / "c"), ValueError, CheckpointMismatchError)


@pytest.mark.parametrize("edit", ["alpha", "batch_size"])
def test_loads_refuses_an_edited_meta_json(tmp_path, edit):
    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=4)
    rb.extend(torch.arange(8.0)[:, None])
    rb.dumps(tmp_path / "c")
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    if edit == "alpha":
        meta["components"]["sampler"]["state"]["alpha"] = 707.0
    else:
        meta["buffer"]["batch_size"] = 4007
    meta_path.write_text(json.dumps(meta))
    target = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=4)
    err = refused(target, lambda: target.loads(tmp_path / "c"), ValueError, CheckpointCorruptError)
    assert "digest" in str(err)


def test_loads_refuses_exponents_that_overflow_even_when_sealed(tmp_path):
    from gpubuf.checkpoint.format import seal_meta

    rb = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=4)
    rb.extend(torch.arange(8.0)[:, None])
    rb.update_priority(torch.arange(8), torch.full((8,), 5.0))
    rb.dumps(tmp_path / "c")
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["components"]["sampler"]["state"]["alpha"] = 707.0
    meta_path.write_text(json.dumps(seal_meta(meta)))
    target = PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16), batch_size=4)
    refused(target, lambda: target.loads(tmp_path / "c"), ValueError, CheckpointCorruptError)


# ---------------------------------------------------------------------- 6. transformed priorities
def test_update_whose_transform_overflows_the_leaves_is_refused():
    p = _prio()
    p.sampler.alpha = 3.0
    refused(p, lambda: p.update_priority(torch.tensor([1]), torch.tensor([1e20])), ValueError, PriorityError)
    assert math.isfinite(float(p.sampler.tree.total()))


# ---------------------------------------------------------------------- 7. constructors
@pytest.mark.parametrize("make,error,builtin", [
    (lambda: LazyTensorStorage(2**63), CapacityError, ValueError),
    (lambda: LazyMemmapStorage(2**63), CapacityError, ValueError),
    (lambda: LazyTensorStorage(10, device="gpu0"), InvalidDeviceError, RuntimeError),
    (lambda: ReplayBuffer(storage=LazyTensorStorage(10), dim_extend=-1), InvalidArgumentError, ValueError),
    (lambda: ReplayBuffer(storage=LazyTensorStorage(10), dim_extend=1.5), InvalidArgumentError, ValueError),
    (lambda: TensorDictMaxValueWriter(rank_key=5), ComponentTypeError, TypeError),
])
def test_constructors_refuse_what_cannot_work(make, error, builtin):
    with pytest.raises(error) as info:
        make()
    assert isinstance(info.value, builtin)


def test_lazy_tensor_storage_larger_than_memory_is_refused():
    with pytest.raises(CapacityError, match="bytes"):
        LazyTensorStorage(2**50)


def test_first_write_whose_rows_exceed_memory_is_refused_before_allocating():
    from gpubuf.storages.checks import device_memory_bytes

    total = device_memory_bytes(torch.device("cpu"))
    rb = ReplayBuffer(storage=LazyTensorStorage(total // 8))  # one byte per item fits; 64 do not
    refused(rb, lambda: rb.extend(torch.zeros(2, 8)), ValueError, CapacityError)
    assert not rb.storage.initialized


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_cuda_storage_without_cuda_is_refused_at_construction():
    for make in (lambda: LazyTensorStorage(10, device="cuda"), lambda: LazyMemmapStorage(10, device="cuda")):
        with pytest.raises(InvalidDeviceError):
            make()


def test_memmap_larger_than_the_disk_is_sparse_and_refused_only_past_the_file_size(tmp_path):
    rb = ReplayBuffer(storage=LazyMemmapStorage(2**40, scratch_dir=tmp_path / "big"))
    rb.extend(torch.ones(4, 3))
    assert len(rb) == 4 and float(rb[:].sum()) == 12.0
    huge = ReplayBuffer(storage=LazyMemmapStorage(2**61, scratch_dir=tmp_path / "huge"))
    refused(huge, lambda: huge.extend(torch.ones(4, 3)), ValueError, CapacityError)


def test_dim_extend_past_the_data_dims_is_refused_before_the_write():
    rb = ReplayBuffer(storage=LazyTensorStorage(10), dim_extend=5)
    refused(rb, lambda: rb.extend(torch.zeros(3, 2)), ValueError, SchemaMismatchError)
    rb.extend(torch.zeros(3, 2, 2, 2, 2, 7))  # 6 dims: dim 5 runs along the storage
    assert len(rb) == 7


# ---------------------------------------------------------------------- 8. ListStorage set past the end
def test_list_storage_setitem_past_the_end_is_refused():
    rb = ReplayBuffer(storage=ListStorage(16))
    rb.extend(torch.zeros(6, 3))
    refused(rb, lambda: rb.__setitem__(6, torch.ones(3)), IndexError, IndexOutOfRangeError)
    rb[5] = torch.ones(3)
    rb[-1] = torch.full((3,), 2.0)
    assert rb[5].tolist() == [2.0, 2.0, 2.0]
    check_consistent(rb)


def test_extend_with_a_list_of_items_on_a_tensor_storage():
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend([torch.full((3,), float(i)) for i in range(2)])
    rb.extend([torch.full((3,), float(i)) for i in range(5)])
    assert len(rb) == 7 and rb[:, 0].tolist() == [0, 1, 0, 1, 2, 3, 4]


# ---------------------------------------------------------------------- list-like storages write all or nothing
def test_compressed_list_storage_refuses_a_write_past_the_end_whole():
    from gpubuf import CompressedListStorage
    from gpubuf.errors import WritePositionError

    rb = ReplayBuffer(storage=CompressedListStorage(8))
    rb.extend(torch.arange(6.0).reshape(3, 2))
    refused(rb, lambda: rb.__setitem__([1, 5], torch.ones(2, 2)), RuntimeError, WritePositionError)
    refused(rb, lambda: rb.__setitem__([0, 1], torch.ones(3, 2)), ValueError, SchemaMismatchError)
    rb[[0, 2]] = torch.full((2, 2), 9.0)
    assert rb[:].tolist() == [[9.0, 9.0], [2.0, 3.0], [9.0, 9.0]]
    check_consistent(rb)


def test_tensordict_buffer_setitem_of_a_plain_tensor_is_refused():
    from gpubuf import LazyStackStorage
    from gpubuf.errors import UnsupportedDataError

    rb = TensorDictReplayBuffer(storage=LazyStackStorage(8))
    rb.extend(TensorDict({"a": torch.arange(3.0)}, [3]))
    refused(rb, lambda: rb.__setitem__(0, torch.ones(2)), TypeError, UnsupportedDataError)


def test_the_alias_check_sees_every_leaf_of_the_storage():
    """A write copies a batch field first when its memory overlaps any of the storage's leaves,
    whichever leaf and wherever in the sorted ranges it lies; nothing else is copied."""
    from gpubuf.storages.tensor import _StoreSpans

    shared = torch.zeros(100)
    others = [torch.zeros(10) for _ in range(6)]
    spans = _StoreSpans([others[3], shared[:40], others[0], shared[60:], others[5]])
    assert spans.overlapping(shared[45:50])  # the same memory as two of the leaves
    assert spans.overlapping(others[0][3:]) and spans.overlapping(others[5][:1]) and spans.overlapping(others[3])
    assert not any(spans.overlapping(t) for t in (others[1], others[2], others[4], torch.zeros(5)))
    assert not spans.overlapping(torch.zeros(0))
