"""Round trips: every storage x sampler x writer x data kind that exists, through dumps/loads.

A buffer loaded into a freshly built one (with another generator seed) must be in exactly the
same state (length, rows, cursor, write count, sampler state, generator) and produce the same
next samples, also after both are extended with the same new data.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from ckpt_helpers import (
    CAPACITY,
    assert_same,
    fill,
    make_buffer,
    make_items,
    same_batches,
    snapshot,
)
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, RandomSampler, ReplayBuffer, SamplerWithoutReplacement
from gpubuf.checkpoint import FORMAT_NAME, FORMAT_VERSION, dump_buffer, load_buffer

STORAGES = ["list", "tensor", "lazy", "lazy2d"]
KINDS = ["tensor", "tensordict", "tensorclass", "pytree"]
SAMPLERS = ["random", "swr", "swr_drop"]
WRITERS = ["rr", "tdrr"]


def _combos():
    for storage in STORAGES:
        for kind in (["any"] if storage == "list" else KINDS):
            for sampler in SAMPLERS:
                for writer in WRITERS:
                    # TensorDictRoundRobinWriter writes an "index" entry: TensorDict data only, as in TorchRL.
                    if writer == "tdrr" and kind not in ("tensordict",):
                        continue
                    yield storage, kind, sampler, writer


@pytest.mark.parametrize("storage,kind,sampler,writer", list(_combos()))
def test_round_trip_every_combination(tmp_path, storage, kind, sampler, writer):
    rb = make_buffer(storage, sampler, writer, seed=1, kind=kind)
    fill(rb, storage, kind)
    before = snapshot(rb)
    rb.dumps(tmp_path / "ckpt")
    assert_same(snapshot(rb), before, "dumps must not change the buffer")

    fresh = make_buffer(storage, sampler, writer, seed=99, kind=kind)
    fresh.loads(tmp_path / "ckpt")
    assert_same(snapshot(fresh), before)
    same_batches(rb, fresh)
    if storage != "list":
        rest = (2,) if storage == "lazy2d" else ()
        rb.extend(make_items(kind, 3, 500, rest=rest))
        fresh.extend(make_items(kind, 3, 500, rest=rest))
        assert_same(snapshot(fresh), snapshot(rb), "after a new extend")
        same_batches(rb, fresh)


@pytest.mark.parametrize("alias_dump,alias_load", [("dump", "load"), ("save", "loads"), ("dumps", "load")])
def test_aliases(tmp_path, alias_dump, alias_load):
    rb = make_buffer("lazy", "random", "rr", seed=1)
    fill(rb, "lazy", "tensordict")
    getattr(rb, alias_dump)(str(tmp_path / "c"))
    fresh = make_buffer("lazy", "random", "rr", seed=2)
    getattr(fresh, alias_load)(str(tmp_path / "c"))
    assert_same(snapshot(fresh), snapshot(rb))


def test_overwrite_existing_checkpoint_and_empty_dir(tmp_path):
    target = tmp_path / "c"
    target.mkdir()  # an empty directory is a valid target, as TorchRL's dumps(tmpdir)
    rb = make_buffer("lazy", "swr", "rr", seed=1)
    fill(rb, "lazy", "tensordict")
    rb.dumps(target)
    rb.extend(make_items("tensordict", 2, 900))
    rb.dumps(target)
    fresh = make_buffer("lazy", "swr", "rr", seed=3)
    fresh.loads(target)
    assert_same(snapshot(fresh), snapshot(rb))
    siblings = sorted(p.name for p in tmp_path.iterdir())
    assert siblings == ["c"], "no temporary or previous directory is left behind"


def test_empty_and_uninitialized_buffers(tmp_path):
    rb = make_buffer("lazy", "swr", "rr", seed=1)
    rb.dumps(tmp_path / "empty")
    loaded = make_buffer("lazy", "swr", "rr", seed=5)
    fill(loaded, "lazy", "tensordict")
    loaded.loads(tmp_path / "empty")
    assert len(loaded) == 0 and not loaded.storage.initialized
    assert_same(snapshot(loaded), snapshot(rb))
    lst = ReplayBuffer(storage=ListStorage())
    lst.dumps(tmp_path / "empty_list")
    fresh = ReplayBuffer(storage=ListStorage())
    fresh.loads(tmp_path / "empty_list")
    assert len(fresh) == 0


def test_buffer_without_generator_samples_the_same_under_the_same_seed(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(10), sampler=RandomSampler(), batch_size=4)
    rb.extend(torch.arange(7.0))
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(10), batch_size=4)
    fresh.loads(tmp_path / "c")
    torch.manual_seed(7)
    a = [rb.sample() for _ in range(3)]
    torch.manual_seed(7)
    b = [fresh.sample() for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_state_dict_round_trip():
    rb = make_buffer("lazy", "swr", "rr", seed=1)
    fill(rb, "lazy", "tensordict")
    fresh = make_buffer("lazy", "swr", "rr", seed=2)
    fresh.load_state_dict(rb.state_dict())
    assert_same(snapshot(fresh), snapshot(rb))
    same_batches(rb, fresh)


def test_list_storage_items_exact(tmp_path):
    items = [
        None, True, 3, -(2**70), 2.5, float("inf"), float("-inf"), 1 + 2j, "héllo", b"\x00\x01", bytearray(b"ab"),
        (1, (2, [3])), {"a": 1, 2: "b", (3, 4): None}, {1, 2}, frozenset({"x"}), np.float32(1.5), np.arange(6).reshape(2, 3),
        torch.arange(4, dtype=torch.int16), torch.ones(2, 2, dtype=torch.complex64), torch.zeros(0, 3),
        torch.tensor(True), torch.randn(3, requires_grad=True), torch.float16,
        torch.Size([2, 3]), torch.device("cpu"), torch.arange(10)[::2],
        TensorDict({"a": torch.ones(2, 3), "b": {"c": torch.zeros(2)}}, [2]),
    ]
    rb = ReplayBuffer(storage=ListStorage(100))
    rb.extend(items)
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=ListStorage(100))
    fresh.loads(tmp_path / "c")
    loaded = fresh.storage._storage
    assert len(loaded) == len(items)
    for a, b in zip(items, loaded):
        if isinstance(a, torch.Tensor):
            assert a.requires_grad == b.requires_grad
            a, b = a.detach(), b.detach()
        assert_same(a, b)


def test_meta_json_is_versioned_and_arrays_open_with_numpy_and_torch(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(300_000))
    data = TensorDict({"obs": torch.randn(300_000), "small": torch.arange(300_000, dtype=torch.int8)}, [300_000])
    rb.extend(data)
    rb.dumps(tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["format"] == FORMAT_NAME and meta["version"] == FORMAT_VERSION and meta["byteorder"] == "little"
    for name, entry in meta["arrays"].items():
        if not name.startswith("storage/"):
            continue
        path = tmp_path / "c" / entry["file"]
        array = np.memmap(path, dtype=np.dtype(entry["dtype"]).newbyteorder("<"), mode="r", offset=entry["offset"],
                          shape=tuple(entry["shape"]))
        key = meta["components"]["storage"]["state"]["layout"]["leaves"][int(name.split("_")[-1])]["key"]
        assert np.array_equal(array, data[tuple(key)].numpy())
        flat = torch.from_file(str(path), size=entry["nbytes"] // np.dtype(entry["dtype"]).itemsize,
                               dtype=getattr(torch, entry["dtype"])) if entry["offset"] == 0 else None
        if flat is not None:
            assert torch.equal(flat.view(entry["shape"]), data[tuple(key)])


def test_dump_buffer_and_load_buffer_functions(tmp_path):
    rb = make_buffer("lazy", "random", "rr", seed=1, kind="pytree")
    fill(rb, "lazy", "pytree")
    dump_buffer(rb, tmp_path / "c")
    fresh = make_buffer("lazy", "random", "rr", seed=2, kind="pytree")
    load_buffer(fresh, tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))


def test_capacity_one_and_full_wrap(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(1), batch_size=1, generator=torch.Generator().manual_seed(0))
    rb.extend(torch.arange(5.0).unsqueeze(-1))
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(1), batch_size=1, generator=torch.Generator().manual_seed(1))
    fresh.loads(tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))
    assert fresh[0].item() == 4.0


@pytest.mark.parametrize("capacity", [7, CAPACITY * 4 + 1])
def test_large_pack_threshold_boundaries(tmp_path, capacity):
    # Leaves below and above the 1 MiB packing threshold round-trip alike.
    rb = ReplayBuffer(storage=LazyTensorStorage(capacity))
    rb.extend(TensorDict({"big": torch.randn(capacity, 40_000), "tiny": torch.arange(capacity)}, [capacity]))
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(capacity))
    fresh.loads(tmp_path / "c")
    assert_same(snapshot(fresh), snapshot(rb))


def test_prefetched_batches_are_not_skipped(tmp_path):
    def make(seed, prefetch):
        rb = ReplayBuffer(storage=LazyTensorStorage(30), sampler=SamplerWithoutReplacement(), batch_size=4,
                          prefetch=prefetch, generator=torch.Generator().manual_seed(seed))
        rb.extend(torch.arange(25.0))
        return rb

    reference = make(0, None)
    expected = [reference.sample() for _ in range(8)]
    rb = make(0, 3)
    for i in range(2):
        assert torch.equal(rb.sample(), expected[i])  # three more batches are now drawn ahead
    rb.dumps(tmp_path / "c")
    for prefetch in (None, 2):
        fresh = ReplayBuffer(storage=LazyTensorStorage(30), sampler=SamplerWithoutReplacement(), batch_size=4,
                             prefetch=prefetch, generator=torch.Generator().manual_seed(5))
        fresh.loads(tmp_path / "c")
        for i in range(2, 8):
            assert torch.equal(fresh.sample(), expected[i])
    for i in range(2, 8):
        assert torch.equal(rb.sample(), expected[i]), "dumps does not disturb the buffer's own batches"


class _Scale:
    """A transform with state: samples are multiplied by ``factor``."""

    def __init__(self, factor: float = 1.0) -> None:
        self.factor = torch.tensor(factor)

    def __call__(self, data):
        return data * self.factor

    def state_dict(self):
        return {"factor": self.factor.clone(), "note": ("scale", 1)}

    def load_state_dict(self, state):
        if state["note"] != ("scale", 1):
            raise ValueError("not a scale state")
        self.factor = state["factor"].clone()


def test_transform_states_round_trip(tmp_path):
    rb = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2, transform=_Scale(3.0))
    rb.extend(torch.arange(4.0))
    rb.dumps(tmp_path / "c")
    fresh = ReplayBuffer(storage=LazyTensorStorage(8), batch_size=2, transform=_Scale(1.0))
    fresh.loads(tmp_path / "c")
    assert float(fresh.transform._items[0][0].factor) == 3.0
    assert torch.equal(fresh[:4], torch.arange(4.0) * 3)
