"""Every kind of bad input at the public API raises a gpubuf error that is also the builtin class
TorchRL raises, with a message saying what was expected, and leaves the buffer as it was."""

from __future__ import annotations

import pytest
import torch
from badinput_helpers import refused
from tensordict import TensorDict

from gpubuf import (
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    PrioritizedSampler,
    ReplayBuffer,
    TensorDictMaxValueWriter,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
    TensorStorage,
)
from gpubuf.checkpoint import CheckpointIOError, CheckpointPathError, NotACheckpointError
from gpubuf.errors import (
    BatchSizeError,
    CapacityError,
    ComponentTypeError,
    GpubufError,
    IndexOutOfRangeError,
    InvalidArgumentError,
    InvalidDeviceError,
    InvalidIndexError,
    InvalidSliceError,
    MissingKeyError,
    PriorityError,
    SchemaMismatchError,
    StateDictError,
    StateDictKeyError,
    UnsupportedDataError,
    UnsupportedOptionError,
)

CONSTRUCTORS = {
    "alpha < 0": (lambda: PrioritizedSampler(10, -1, 0.5), InvalidArgumentError, ValueError),
    "beta nan": (lambda: PrioritizedSampler(10, 0.5, float("nan")), InvalidArgumentError, ValueError),
    "eps < 0": (lambda: PrioritizedSampler(10, 0.5, 0.5, eps=-1), InvalidArgumentError, ValueError),
    "reduction": (lambda: PrioritizedSampler(10, 0.5, 0.5, reduction="x"), InvalidArgumentError, ValueError),
    "tree dtype": (lambda: PrioritizedSampler(10, 0.5, 0.5, dtype=torch.int32), UnsupportedOptionError,
                   NotImplementedError),
    "tree too large": (lambda: PrioritizedSampler(2**62, 0.5, 0.5), CapacityError, ValueError),
    "tree beyond memory": (lambda: PrioritizedSampler(2**40, 0.5, 0.5), CapacityError, ValueError),
    "tree device": (lambda: PrioritizedSampler(10, 0.5, 0.5, device="gpu0"), InvalidDeviceError, RuntimeError),
    "buffer alpha": (lambda: PrioritizedReplayBuffer(alpha=-1, beta=0.5), InvalidArgumentError, ValueError),
    "ndim 0": (lambda: LazyTensorStorage(10, ndim=0), InvalidArgumentError, ValueError),
    "device string": (lambda: LazyTensorStorage(10, device="gpu0"), InvalidDeviceError, RuntimeError),
    "memmap device": (lambda: LazyMemmapStorage(10, device="gpu0"), InvalidDeviceError, RuntimeError),
    "device float": (lambda: LazyTensorStorage(10, device=3.5), InvalidDeviceError, RuntimeError),
    "batch_device": (lambda: ReplayBuffer(batch_device="gpu0"), InvalidDeviceError, RuntimeError),
    "prefetch -1": (lambda: ReplayBuffer(storage=LazyTensorStorage(10), prefetch=-1, batch_size=2),
                    InvalidArgumentError, ValueError),
    "dim_extend -1": (lambda: ReplayBuffer(storage=LazyTensorStorage(10), dim_extend=-1), InvalidArgumentError,
                      ValueError),
    "storage 3": (lambda: ReplayBuffer(storage=3), ComponentTypeError, TypeError),
    "writer reduction": (lambda: TensorDictMaxValueWriter(rank_key="r", reduction="bad"), InvalidArgumentError,
                         ValueError),
    "rank_key 5": (lambda: TensorDictMaxValueWriter(rank_key=5), ComponentTypeError, TypeError),
    "no storage": (lambda: TensorStorage(None), InvalidArgumentError, ValueError),
    "capacity -1": (lambda: ListStorage(-1), CapacityError, ValueError),
    "capacity 2**63": (lambda: LazyTensorStorage(2**63), CapacityError, ValueError),
    "batch_size 0": (lambda: ReplayBuffer(batch_size=0), BatchSizeError, RuntimeError),
}


@pytest.mark.parametrize("name", list(CONSTRUCTORS))
def test_constructor_errors_are_typed(name):
    make, error, builtin = CONSTRUCTORS[name]
    with pytest.raises(error) as info:
        make()
    assert isinstance(info.value, GpubufError) and isinstance(info.value, builtin)
    assert "expected" in str(info.value) or "must" in str(info.value) or "use" in str(info.value)


def tensor_buffer():
    rb = ReplayBuffer(storage=LazyTensorStorage(16))
    rb.extend(torch.arange(18.0).reshape(6, 3))
    return rb


def list_buffer():
    rb = ReplayBuffer(storage=ListStorage(16))
    rb.extend(torch.arange(18.0).reshape(6, 3))
    return rb


def td_buffer():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(16))
    rb.extend(TensorDict({"a": torch.arange(6.0)}, [6]))
    return rb


def prio_buffer():
    rb = TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(16))
    rb.extend(TensorDict({"a": torch.arange(6.0)}, [6]))
    return rb


# (buffer factory, call, typed error, builtin class)
OPERATIONS = {
    "td add None": (td_buffer, lambda rb: rb.add(None), UnsupportedDataError, TypeError),
    "add None": (tensor_buffer, lambda rb: rb.add(None), UnsupportedDataError, TypeError),
    "list add None": (list_buffer, lambda rb: rb.add(None), UnsupportedDataError, TypeError),
    "extend 3.0": (tensor_buffer, lambda rb: rb.extend(3.0), UnsupportedDataError, TypeError),
    "list extend 3.0": (list_buffer, lambda rb: rb.extend(3.0), UnsupportedDataError, TypeError),
    "extend str": (tensor_buffer, lambda rb: rb.extend("abc"), UnsupportedDataError, TypeError),
    "extend meta": (tensor_buffer, lambda rb: rb.extend(torch.zeros(2, 3, device="meta")), GpubufError, ValueError),
    "extend wrong shape": (tensor_buffer, lambda rb: rb.extend(torch.zeros(2, 4)), SchemaMismatchError, ValueError),
    "extend empty list": (tensor_buffer, lambda rb: rb.extend([]), SchemaMismatchError, ValueError),
    "rb[2.5]": (tensor_buffer, lambda rb: rb[2.5], InvalidIndexError, IndexError),
    "rb[float tensor]": (tensor_buffer, lambda rb: rb[torch.tensor([1.0])], InvalidIndexError, IndexError),
    "rb[::0]": (tensor_buffer, lambda rb: rb[::0], InvalidSliceError, ValueError),
    "rb[::-1]": (tensor_buffer, lambda rb: rb[::-1], InvalidSliceError, ValueError),
    "rb[short mask]": (tensor_buffer, lambda rb: rb[torch.tensor([True, False, True])], InvalidIndexError, IndexError),
    "rb['nope']": (tensor_buffer, lambda rb: rb["nope"], MissingKeyError, KeyError),
    "td['nope']": (td_buffer, lambda rb: rb["nope"], MissingKeyError, KeyError),
    "rb[100]": (tensor_buffer, lambda rb: rb[100], IndexOutOfRangeError, IndexError),
    "list rb[2.5]": (list_buffer, lambda rb: rb[2.5], InvalidIndexError, IndexError),
    "list rb[::0]": (list_buffer, lambda rb: rb[::0], InvalidSliceError, ValueError),
    "rb[['a']]": (tensor_buffer, lambda rb: rb[["a"]], InvalidIndexError, IndexError),
    "rb[2.5] =": (tensor_buffer, lambda rb: rb.__setitem__(2.5, torch.ones(3)), InvalidIndexError, IndexError),
    "rb[::0] =": (tensor_buffer, lambda rb: rb.__setitem__(slice(None, None, 0), torch.ones(3)), InvalidSliceError,
                  ValueError),
    "rb[0] = str": (tensor_buffer, lambda rb: rb.__setitem__(0, "x"), UnsupportedDataError, TypeError),
    "rb[0] = None": (tensor_buffer, lambda rb: rb.__setitem__(0, None), UnsupportedDataError, TypeError),
    "rb[20] =": (tensor_buffer, lambda rb: rb.__setitem__(20, torch.ones(3)), IndexOutOfRangeError, IndexError),
    "list rb[6] =": (list_buffer, lambda rb: rb.__setitem__(6, torch.ones(3)), IndexOutOfRangeError, IndexError),
    "priority None": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0]), None), PriorityError, ValueError),
    "priority str": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0]), "a"), PriorityError, ValueError),
    "priority nan": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0]), float("nan")), PriorityError,
                     ValueError),
    "priority -1": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0]), -1.0), PriorityError, ValueError),
    "priority count": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0, 1]), torch.ones(3)),
                       PriorityError, ValueError),
    "priority index str": (prio_buffer, lambda rb: rb.update_priority("a", 1.0), InvalidIndexError, TypeError),
    "priority index float": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([0.5]), 1.0),
                             InvalidIndexError, TypeError),
    "priority index None": (prio_buffer, lambda rb: rb.update_priority(None, 1.0), InvalidIndexError, TypeError),
    "priority index past": (prio_buffer, lambda rb: rb.update_priority(torch.tensor([10]), 1.0),
                            IndexOutOfRangeError, IndexError),
    "td priority without index": (
        prio_buffer, lambda rb: rb.update_tensordict_priority(TensorDict({"td_error": torch.ones(2)}, [2])),
        MissingKeyError, KeyError),
    "sample 0": (tensor_buffer, lambda rb: rb.sample(0), BatchSizeError, RuntimeError),
    "sample 2.5": (tensor_buffer, lambda rb: rb.sample(2.5), BatchSizeError, RuntimeError),
    "sample beyond memory": (tensor_buffer, lambda rb: rb.sample(2**40), BatchSizeError, RuntimeError),
    "list sample beyond memory": (list_buffer, lambda rb: rb.sample(2**40), BatchSizeError, RuntimeError),
    "load_state_dict None": (tensor_buffer, lambda rb: rb.load_state_dict(None), StateDictError, ValueError),
    "load_state_dict {}": (tensor_buffer, lambda rb: rb.load_state_dict({}), StateDictKeyError, KeyError),
    "load_state_dict list": (list_buffer, lambda rb: rb.load_state_dict({**rb.state_dict(), "_storage": {
        "_storage": 5}}), StateDictError, ValueError),
    "load_state_dict list too long": (list_buffer, lambda rb: rb.load_state_dict({**rb.state_dict(), "_storage": {
        "_storage": [torch.ones(3)] * 17}}), StateDictError, ValueError),
    "dumps None": (tensor_buffer, lambda rb: rb.dumps(None), CheckpointPathError, TypeError),
    "loads None": (tensor_buffer, lambda rb: rb.loads(None), CheckpointPathError, TypeError),
    "loads missing": (tensor_buffer, lambda rb: rb.loads("/nonexistent/gpubuf/x"), NotACheckpointError, ValueError),
}


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_operation_errors_are_typed_and_change_nothing(name):
    factory, call, error, builtin = OPERATIONS[name]
    rb = factory()
    refused(rb, lambda: call(rb), builtin, error)


def test_dumps_under_a_regular_file(tmp_path):
    (tmp_path / "file").write_text("x")
    rb = tensor_buffer()
    err = refused(rb, lambda: rb.dumps(tmp_path / "file" / "ckpt"), OSError, CheckpointIOError)
    assert "expected" in str(err)
    assert (tmp_path / "file").read_text() == "x"
