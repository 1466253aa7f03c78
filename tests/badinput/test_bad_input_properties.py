"""Property-based: hostile input at every public operation either raises a gpubuf error with the
buffer exactly as it was (a deep snapshot: length, cursor, write count, every stored value,
priorities, sampler and writer state), or is accepted and leaves the buffer consistent.

The default run keeps few examples (a few seconds per buffer kind); ``-m slow`` runs the deeper
profile of the same machines.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from badinput_helpers import assert_same, check_consistent, snapshot
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tensordict import TensorDict

from gpubuf import (
    CompressedListStorage,
    CompressedTensorStorage,
    LazyStackStorage,
    PackedStorage,
    PrioritizedSliceSampler,
    ReplayBufferEnsemble,
    SharedPrioritizedSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    SpillStorage,
    LazyMemmapStorage,
    LazyTensorStorage,
    ListStorage,
    PrioritizedReplayBuffer,
    ReplayBuffer,
    SamplerWithoutReplacement,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from gpubuf.errors import GpubufError

CAPACITY = 8
DTYPES = [torch.float32, torch.float64, torch.int64, torch.bool, torch.float16, torch.uint8]
SPECIAL = [0.0, -1.0, 2.5, 1e20, 1e40, -1e40, float("nan"), float("inf"), -float("inf")]


@st.composite
def tensors(draw, rows=st.integers(0, 12)):
    """Tensors of odd shapes, dtypes and values; rarely on the meta device or non-contiguous."""
    n = draw(rows)
    shape = draw(st.sampled_from([(), (n,), (n, 3), (n, 4), (n, 3, 1), (3, n), (n, 0)]))
    dtype = draw(st.sampled_from(DTYPES))
    fill = draw(st.sampled_from(SPECIAL + [1.0, 3.0]))
    t = torch.full(shape, fill if dtype.is_floating_point else 1, dtype=torch.float64).to(dtype)
    if draw(st.integers(0, 9)) == 0:
        t = torch.empty(shape, dtype=dtype, device="meta")
    elif len(shape) == 2 and draw(st.booleans()):
        t = t.t().contiguous().t()
    return t


@st.composite
def tensordicts(draw):
    n = draw(st.integers(0, 10))
    keys = draw(st.sets(st.sampled_from(["obs", "r", "other"]), max_size=3))
    data = {}
    for key in sorted(keys):
        shape = (n, 3) if key == "obs" else (n,)
        if draw(st.integers(0, 4)) == 0:
            shape = draw(st.sampled_from([(n, 4), (n, 3, 1), (n,)]))
        dtype = torch.float32 if draw(st.integers(0, 4)) else draw(st.sampled_from(DTYPES))
        fill = draw(st.sampled_from(SPECIAL + [1.0])) if dtype.is_floating_point else 1
        data[key] = torch.full(shape, fill, dtype=torch.float64).to(dtype)
    if draw(st.booleans()) and n:
        data["td_error"] = torch.full((n,), draw(st.sampled_from(SPECIAL + [0.5, 2.0])), dtype=torch.float64).float()
    return TensorDict(data, [n])


def valid_tensor(n):
    return torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)


def valid_td(n):
    return TensorDict({"obs": valid_tensor(n), "r": torch.arange(n, dtype=torch.float32)}, [n])


scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-20, 20),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=3), st.complex_numbers(max_magnitude=4),
)
lists = st.one_of(
    st.lists(st.integers(-20, 20), max_size=6), st.lists(st.floats(), max_size=3), st.lists(st.text(max_size=2), max_size=3),
    st.lists(st.booleans(), min_size=0, max_size=9), st.lists(tensors(st.integers(0, 3)), max_size=4),
)
slices = st.builds(slice, st.one_of(st.none(), st.integers(-20, 20), st.floats(-3, 3)),
                   st.one_of(st.none(), st.integers(-20, 20)), st.one_of(st.none(), st.integers(-3, 3)))
arrays = st.builds(lambda v, kind: np.asarray(v, dtype=kind), st.lists(st.integers(-10, 10), max_size=5),
                   st.sampled_from(["int64", "float32", "bool", "int8"]))
hostile = st.one_of(scalars, lists, slices, arrays, tensors(), tensordicts(),
                    st.tuples(st.integers(-10, 10), st.integers(-10, 10)))
indices = st.one_of(st.integers(-12, 12), slices, tensors(st.integers(0, 10)), lists, arrays,
                    st.sampled_from(["obs", "nope", ("obs",), "index"]), hostile)


class HostileUser(RuleBasedStateMachine):
    """Applies hostile input to one buffer; after each call the buffer is unchanged (on a typed
    error) or consistent (accepted). Subclasses choose the buffer."""

    kind = "tensor"

    def make(self):
        raise NotImplementedError

    def valid(self, n):
        return valid_td(n) if self.kind == "td" else valid_tensor(n)

    @initialize(n=st.integers(0, 11))
    def setup(self, n):
        self.rb = self.make()
        if n:
            self.rb.extend(self.valid(n))

    def attempt(self, call, *, writes=True):
        before = snapshot(self.rb)
        try:
            result = call()
        except GpubufError as err:
            assert str(err)
            assert_same(snapshot(self.rb), before, f"the buffer after {type(err).__name__}: {err}")
            return None
        except Exception as err:  # noqa: BLE001 - the property: nothing else escapes
            raise AssertionError(f"a raw {type(err).__name__} escaped: {err}") from err
        if not writes:
            assert_same(snapshot(self.rb), before, "the buffer after a read")
        return result

    @invariant()
    def consistent(self):
        if hasattr(self, "rb"):
            check_consistent(self.rb)

    # ------------------------------------------------------------------ writes
    @rule(data=st.one_of(hostile, tensors(), tensordicts()))
    def extend(self, data):
        self.attempt(lambda: self.rb.extend(data))

    @rule(data=st.one_of(hostile, tensors(st.just(1)), tensordicts()))
    def add(self, data):
        if isinstance(data, (torch.Tensor, TensorDict)) and data.ndim and data.shape[0] == 1:
            data = data[0]
        self.attempt(lambda: self.rb.add(data))

    @rule(index=indices, value=st.one_of(hostile, tensors(), tensordicts()))
    def setitem(self, index, value):
        def call():
            self.rb[index] = value
        self.attempt(call)

    @rule(n=st.integers(1, 20))
    def extend_valid(self, n):
        # Valid for the buffer as made; a state loaded since may hold items of another layout.
        self.attempt(lambda: self.rb.extend(self.valid(n)))

    @rule(start=st.integers(0, 10), stop=st.integers(0, 12))
    def extend_own_rows(self, start, stop):
        if len(self.rb) and not isinstance(self.rb.storage, ListStorage):
            self.attempt(lambda: self.rb.extend(self.rb[start:stop]))

    # ------------------------------------------------------------------ reads
    @rule(index=indices)
    def getitem(self, index):
        self.attempt(lambda: self.rb[index], writes=False)

    @rule(batch_size=st.one_of(st.integers(-3, 20), scalars.filter(lambda v: not isinstance(v, int) or v < 100)))
    def sample(self, batch_size):
        # A draw may move the sampler (an epoch without replacement); refused, it changes nothing.
        self.attempt(lambda: self.rb.sample(batch_size))

    # ------------------------------------------------------------------ priorities
    @rule(index=indices, priority=st.one_of(hostile, st.sampled_from(SPECIAL), tensors(st.integers(0, 10))))
    def update_priority(self, index, priority):
        self.attempt(lambda: self.rb.update_priority(index, priority))

    @rule(alpha=st.one_of(st.sampled_from([0.0, 0.5, 3.0, 50.0, 707.0, -1.0, float("nan")]), scalars))
    def set_alpha(self, alpha):
        if hasattr(self.rb.sampler, "alpha"):
            self.attempt(lambda: setattr(self.rb.sampler, "alpha", alpha))

    # ------------------------------------------------------------------ state
    @rule(data=st.data())
    def load_state_dict(self, data):
        sd = self.rb.state_dict()
        paths = list(_paths(sd))
        path = data.draw(st.sampled_from(paths)) if paths else ()
        action = data.draw(st.sampled_from(["delete", "replace", "sibling"]))
        if action == "sibling":
            other = self.make()
            other.extend(self.valid(data.draw(st.integers(1, 11))))
            sd = other.state_dict()
        elif path:
            node = sd
            for key in path[:-1]:
                node = node[key]
            if action == "delete":
                del node[path[-1]]
            else:
                node[path[-1]] = data.draw(st.one_of(hostile, st.integers(-3, 20)))
        self.attempt(lambda: self.rb.load_state_dict(sd))


def _paths(node, prefix=()):
    """Every key path of a nested state dict."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))


class TensorBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=LazyTensorStorage(CAPACITY))


class ListBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=ListStorage(CAPACITY))


class PrioritizedBuffer(HostileUser):
    def make(self):
        return PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY))


class WithoutReplacementBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=SamplerWithoutReplacement())


class PrioritizedListBuffer(HostileUser):
    def make(self):
        return PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=ListStorage(CAPACITY))


class TensorDictBuffer(HostileUser):
    kind = "td"

    def make(self):
        return TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY))


class TensorDictPrioritizedBuffer(HostileUser):
    kind = "td"

    def make(self):
        return TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY))


class MemmapBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=LazyMemmapStorage(CAPACITY))


class StackBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=LazyStackStorage(CAPACITY))


class StackTensorDictBuffer(HostileUser):
    kind = "td"

    def make(self):
        return TensorDictReplayBuffer(storage=LazyStackStorage(CAPACITY))


class PackedBuffer(HostileUser):
    kind = "td"

    def make(self):
        return TensorDictReplayBuffer(storage=PackedStorage(CAPACITY))


class SpillBuffer(HostileUser):
    def make(self):
        # 3 rows on the device tier, the rest in the memmap tier.
        return ReplayBuffer(storage=SpillStorage(CAPACITY, device="cpu", device_budget=36))


class CompressedListBuffer(HostileUser):
    kind = "td"

    def make(self):
        return TensorDictReplayBuffer(storage=CompressedListStorage(CAPACITY))


class CompressedTensorBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=CompressedTensorStorage(CAPACITY, min_row_bytes=1))


class SharedPrioritizedBuffer(HostileUser):
    def make(self):
        return ReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=SharedPrioritizedSampler(CAPACITY, 0.7, 0.5))


def valid_episodes(n):
    """Steps of episodes of 3 steps: an id and a done flag, for the slice samplers."""
    i = torch.arange(n)
    return TensorDict({"obs": i.float(), "episode": i // 3, ("next", "done"): (i % 3 == 2).unsqueeze(-1)}, [n])


class SliceBuffer(HostileUser):
    kind = "td"
    sampler = staticmethod(lambda: SliceSampler(num_slices=2, traj_key="episode", strict_length=False))

    def valid(self, n):
        return valid_episodes(n)

    def make(self):
        return TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), sampler=self.sampler())


class SliceWithoutReplacementBuffer(SliceBuffer):
    sampler = staticmethod(lambda: SliceSamplerWithoutReplacement(num_slices=2, end_key=("next", "done"), strict_length=False))


class PrioritizedSliceBuffer(SliceBuffer):
    sampler = staticmethod(
        lambda: PrioritizedSliceSampler(CAPACITY, 0.7, 0.5, num_slices=2, traj_key="episode", strict_length=False)
    )


MACHINES = [
    TensorBuffer, ListBuffer, PrioritizedBuffer, PrioritizedListBuffer, WithoutReplacementBuffer, TensorDictBuffer,
    TensorDictPrioritizedBuffer, MemmapBuffer, StackBuffer, StackTensorDictBuffer, PackedBuffer, SpillBuffer,
    CompressedListBuffer, CompressedTensorBuffer, SharedPrioritizedBuffer, SliceBuffer, SliceWithoutReplacementBuffer,
    PrioritizedSliceBuffer,
]
_HEALTH = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]
FAST = settings(max_examples=25, stateful_step_count=15, deadline=None, suppress_health_check=_HEALTH,
                derandomize=True, database=None)
DEEP = settings(max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=_HEALTH, database=None)


@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_hostile_input_never_changes_or_breaks_the_buffer(machine):
    machine.TestCase.settings = FAST
    machine.TestCase().runTest()


@pytest.mark.slow
@pytest.mark.parametrize("machine", MACHINES, ids=lambda m: m.__name__)
def test_hostile_input_deep(machine):
    machine.TestCase.settings = DEEP
    machine.TestCase().runTest()


# ---------------------------------------------------------------------- checkpoints edited in place
def _leaf_paths(node, prefix=()):
    """Key paths of the values in a parsed meta.json (not the file and array tables' internals)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaf_paths(value, prefix + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaf_paths(value, prefix + (i,))
    else:
        yield prefix


json_values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 40), st.integers(-2**70, 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4), st.lists(st.integers(-2, 9), max_size=3), st.just({}),
)


def _edited_checkpoint_loads(make, fill, source_dir, data, tmp_root):
    import json
    import shutil

    from gpubuf.checkpoint.format import seal_meta

    shutil.copytree(source_dir, tmp_root / "c")
    meta_path = tmp_root / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    paths = [p for p in _leaf_paths(meta) if p and p[0] in ("components", "buffer")]
    path = data.draw(st.sampled_from(paths))
    node = meta
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = data.draw(json_values)
    meta_path.write_text(json.dumps(seal_meta(meta)))  # sealed: the value checks themselves are exercised
    target = make()
    fill(target)
    before = snapshot(target)
    try:
        target.loads(tmp_root / "c")
    except GpubufError as err:
        assert str(err)
        assert_same(snapshot(target), before, f"the buffer after {type(err).__name__}: {err}")
        return
    except Exception as err:  # noqa: BLE001
        raise AssertionError(f"a raw {type(err).__name__} escaped loads after editing {path}: {err}") from err
    check_consistent(target)


CHECKPOINTED = {
    "prioritized": (
        lambda: PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=LazyTensorStorage(CAPACITY), batch_size=4),
        lambda rb: (rb.extend(valid_tensor(5)), rb.update_priority(torch.arange(5), torch.arange(1.0, 6.0))),
    ),
    "tensordict": (
        lambda: TensorDictReplayBuffer(storage=LazyTensorStorage(CAPACITY), batch_size=4),
        lambda rb: rb.extend(valid_td(11)),
    ),
    "list": (lambda: ReplayBuffer(storage=ListStorage(CAPACITY), batch_size=2), lambda rb: rb.extend(valid_tensor(3))),
}


@pytest.mark.parametrize("kind", list(CHECKPOINTED))
def test_an_edited_checkpoint_never_changes_or_breaks_the_buffer(kind, tmp_path_factory):
    from hypothesis import given

    make, fill = CHECKPOINTED[kind]
    source = make()
    fill(source)
    source_dir = tmp_path_factory.mktemp("source") / "c"
    source.dumps(source_dir)

    @settings(max_examples=15, deadline=None, suppress_health_check=_HEALTH, derandomize=True, database=None)
    @given(data=st.data())
    def run(data):
        _edited_checkpoint_loads(make, fill, source_dir, data, tmp_path_factory.mktemp("edit"))

    run()
