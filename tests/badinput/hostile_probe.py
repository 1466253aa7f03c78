"""A hostile user over the storages, samplers and ensembles beyond the plain tensor and list
buffers: every public entry point, many kinds of bad input, a deep snapshot before and after.

Each *kind* is one (buffer configuration, operation) pair. A kind is **broken** when any of its
cases (a) raises a gpubuf error and leaves the buffer changed, (b) raises anything that is not
a gpubuf error, (c) is accepted and leaves the buffer inconsistent, or (d) runs past a time
limit. Run it as a script for the table::

    PYTHONPATH=$PWD:$PWD/kernels python tests/badinput/hostile_probe.py [-v] [config ...]

``tests/badinput/test_bad_input_storages.py`` runs every kind as a test.
"""

from __future__ import annotations

import atexit
import copy
import json
import shutil
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tensordict import TensorDict, TensorDictBase

import gpubuf
from gpubuf.errors import GpubufError

CAPACITY = 8
TIME_LIMIT_S = 20
#: Every file the probe writes (spill tiers, checkpoints) lies under this folder, removed at exit.
ROOT = tempfile.mkdtemp(prefix="gpubuf_probe_")
atexit.register(shutil.rmtree, ROOT, True)


# ---------------------------------------------------------------------- snapshots
def _freeze(value: Any) -> Any:
    """A deep, detached copy of a state value: tensors cloned, TensorDicts as dicts."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":
            return ("meta", value.dtype, tuple(value.shape))
        if value.is_nested:
            return ("nested", [_freeze(t) for t in value.unbind()])
        return value.detach().clone()
    if isinstance(value, TensorDictBase) or (hasattr(value, "batch_size") and hasattr(value, "to_dict")):
        try:
            return ("td", tuple(value.batch_size), _freeze(value.to_dict()))
        except Exception:  # noqa: BLE001 - a lazy stack of ragged items
            return ("td", tuple(value.batch_size), [_freeze(v.to_dict()) for v in value.unbind(0)])
    if isinstance(value, dict):
        return {key: _freeze(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_freeze(v) for v in value) if type(value) in (list, tuple) else [_freeze(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, (int, float, str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size)):
        return value
    if type(value).__eq__ is object.__eq__:  # compared by identity: compare what it says instead
        return ("object", type(value).__name__, repr(value))
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001
        return repr(value)


def same(a: Any, b: Any, where: str = "") -> str | None:
    """None when ``a`` and ``b`` are equal (tensors bitwise, NaN equal to NaN), else where they differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{where}: tensor vs {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if a.dtype.is_floating_point or a.dtype.is_complex:
            eq = (a == b) | (a.isnan() & b.isnan())
        else:
            eq = a == b
        return None if bool(eq.all()) else f"{where} changed"
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return f"{where}: keys {list(a)[:8]} != {list(b)[:8] if isinstance(b, dict) else type(b).__name__}"
        for key in a:
            diff = same(a[key], b[key], f"{where}[{key!r}]")
            if diff:
                return diff
        return None
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return f"{where}: {type(a).__name__}[{len(a)}] != {type(b).__name__}[{len(b) if hasattr(b, '__len__') else '?'}]"
        for i, (x, y) in enumerate(zip(a, b)):
            diff = same(x, y, f"{where}[{i}]")
            if diff:
                return diff
        return None
    if isinstance(a, np.ndarray):
        ok = isinstance(b, np.ndarray) and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
        return None if ok else f"{where} changed"
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return None
    return None if a == b else f"{where}: {a!r} != {b!r}"


def snapshot(rb: Any) -> dict:
    """Length, cursor, write count, batch size, the whole state dict (stored values, sampler and
    writer state), and every readable row."""
    snap: dict[str, Any] = {"len": len(rb), "batch_size": rb.batch_size}
    writer = rb.writer
    snap["cursor"] = getattr(writer, "_cursor", None)
    snap["write_count"] = getattr(writer, "_write_count", None)
    snap["state"] = _freeze(rb.state_dict())
    if isinstance(rb, gpubuf.ReplayBufferEnsemble):
        snap["members"] = [snapshot(member) for member in rb._rbs]
    elif len(rb):
        snap["rows"] = _freeze(rb[: len(rb)])
    return snap


# ---------------------------------------------------------------------- consistency
def _rows_of(value: Any) -> int:
    if isinstance(value, list):
        return len(value)
    if isinstance(value, torch.Tensor) and value.is_nested:
        return value.size(0)
    shape = value.batch_size if hasattr(value, "batch_size") else value.shape
    return int(shape[0])


def check_consistent(rb: Any, config: "Config", *, loaded: bool = False) -> None:
    """A buffer that accepted something still works: length within capacity, cursor at the
    length while filling, every row readable, a sample draws written rows, and a valid write
    lands where the cursor says. ``loaded``: the call loaded a state, which may hold items of
    another layout (valid for the buffer, and then a batch of the old layout is refused, typed)."""
    if isinstance(rb, gpubuf.ReplayBufferEnsemble):
        for member, sub in zip(rb._rbs, config.members):
            check_consistent(member, sub, loaded=loaded)
        try:
            rb.sample(4)
        except GpubufError:
            pass
        return
    n = len(rb)
    capacity = rb.storage.max_size
    assert 0 <= n <= capacity, f"len {n} outside [0, {capacity}]"
    cursor = getattr(rb.writer, "_cursor", None)
    if cursor is not None:
        assert 0 <= int(cursor) < capacity, f"cursor {cursor} outside [0, {capacity})"
        if n < capacity:
            assert int(cursor) == n, f"cursor {cursor} while {n} of {capacity} rows are written"
    if n:
        rows = rb[:n]
        assert _rows_of(rows) == n, f"rb[:{n}] holds {_rows_of(rows)} rows"
        rb[n - 1]
        try:
            _, info = rb.sample(4, return_info=True)
        except (gpubuf.errors.TrajectoryLengthError, gpubuf.errors.EmptyBufferError):
            pass  # typed: no slice long enough after an edit that is valid
        else:
            index = info["index"]
            flat = index[0] if isinstance(index, tuple) else index
            assert bool(((flat >= 0) & (flat < max(n, 1))).all()), f"sampled {flat.tolist()} of {n} rows"
    # A valid write after the accepted call lands at the cursor and is read back.
    data = config.valid(2, 100)
    before = len(rb)
    try:
        index = rb.extend(data)
    except (gpubuf.errors.SchemaMismatchError, gpubuf.errors.DTypeMismatchError, gpubuf.errors.UnsupportedDataError) as err:
        if loaded:
            assert len(rb) == before, "a refused write changed the length"
            return
        raise AssertionError(f"a valid batch is refused: {err}") from err
    after = len(rb)
    assert after == min(before + 2, capacity), f"a write of 2 rows took len {before} -> {after}"
    flat = index.reshape(-1) if isinstance(index, torch.Tensor) else torch.as_tensor(index).reshape(-1)
    assert bool(((flat >= 0) & (flat < capacity)).all()), f"extend returned {flat.tolist()}"
    back = rb[int(flat[-1])]
    expect = config.valid(2, 100)
    expect = expect[-1]
    if isinstance(back, TensorDictBase) and "index" in back.keys() and "index" not in expect.keys():
        back = back.exclude("index")  # the TensorDict writer records each row's index in it
    diff = same(_freeze(back), _freeze(expect), "the row just written")
    assert diff is None, diff


# ---------------------------------------------------------------------- configurations
def _td(n: int, start: int = 0) -> TensorDict:
    i = torch.arange(start, start + n)
    return TensorDict({"obs": (i[:, None] * 3 + torch.arange(3)).float(), "r": i.float()}, [n])


def _tensor(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start * 3, (start + n) * 3, dtype=torch.float32).reshape(n, 3)


def _episodes_td(n: int, start: int = 0) -> TensorDict:
    """Steps of episodes of 4 steps (the episode id and done flags), for the slice samplers."""
    i = torch.arange(start, start + n)
    episode = i // 4
    done = ((i % 4) == 3).unsqueeze(-1)
    return TensorDict({"obs": i.float(), "episode": episode, ("next", "done"): done}, [n])


def _frames_td(n: int, start: int = 0) -> TensorDict:
    i = torch.arange(start, start + n)
    frames = ((i[:, None, None, None] + torch.arange(2)[None, :, None, None]) * 7 + torch.arange(12).reshape(1, 1, 3, 4)) % 251
    return TensorDict({"obs": frames.to(torch.uint8), "action": i}, [n])


def _ragged_td(n: int, start: int = 0) -> list:
    return [TensorDict({"tokens": torch.arange((start + k) % 3 + 1), "score": torch.tensor(float(start + k))}, []) for k in range(n)]


class Config:
    """A buffer configuration: how to build it, what a valid batch is, what is hostile for it."""

    def __init__(self, name: str, make: Callable[[], Any], valid: Callable[[int, int], Any], *, td: bool,
                 prioritized: bool = False, members: list["Config"] | None = None, fill: int = 5) -> None:
        self.name, self.make, self._valid, self.td = name, make, valid, td
        self.prioritized, self.members, self.fill = prioritized, members, fill

    def valid(self, n: int, start: int = 0) -> Any:
        return self._valid(n, start)

    def build(self, fill: int | None = None) -> Any:
        rb = self.make()
        n = self.fill if fill is None else fill
        if self.members:
            for member, sub in zip(rb._rbs, self.members):
                if n:
                    member.extend(sub.valid(n))
        elif n:
            rb.extend(self.valid(n))
        return rb


def _member_configs() -> list[Config]:
    return [
        Config("member_tensor", lambda: gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY)), _tensor, td=False),
        Config("member_list", lambda: gpubuf.ReplayBuffer(storage=gpubuf.ListStorage(CAPACITY)), _tensor, td=False),
    ]


def _ensemble() -> Any:
    a = gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY))
    b = gpubuf.ReplayBuffer(storage=gpubuf.ListStorage(CAPACITY))
    return gpubuf.ReplayBufferEnsemble(a, b, batch_size=4)


def _td_ensemble() -> Any:
    a = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY))
    b = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY))
    return gpubuf.ReplayBufferEnsemble(a, b, batch_size=4, p=[0.5, 0.5])


def _td_members() -> list[Config]:
    make = lambda: gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY))  # noqa: E731
    return [Config("member_td", make, _td, td=True), Config("member_td", make, _td, td=True)]


def _components_ensemble() -> Any:
    storages = gpubuf.StorageEnsemble(gpubuf.LazyTensorStorage(CAPACITY), gpubuf.LazyTensorStorage(CAPACITY))
    samplers = gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), gpubuf.SamplerWithoutReplacement())
    writers = gpubuf.WriterEnsemble(gpubuf.RoundRobinWriter(), gpubuf.RoundRobinWriter())
    return gpubuf.ReplayBufferEnsemble(storages=storages, samplers=samplers, writers=writers, batch_size=4)


def _tensor_members() -> list[Config]:
    make = lambda: gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY))  # noqa: E731
    return [Config("m", make, _tensor, td=False), Config("m", make, _tensor, td=False)]


def _slice(sampler: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY * 2), sampler=sampler(), batch_size=4)


def configs() -> list[Config]:
    def rb(storage, td=False, **kwargs):
        cls = gpubuf.TensorDictReplayBuffer if td else gpubuf.ReplayBuffer
        return lambda: cls(storage=storage(), **kwargs)

    tmp = ROOT
    return [
        Config("lazystack_tensor", rb(lambda: gpubuf.LazyStackStorage(CAPACITY)), _tensor, td=False),
        Config("lazystack_td", rb(lambda: gpubuf.LazyStackStorage(CAPACITY), td=True), _td, td=True),
        Config("lazystack_densify", rb(lambda: gpubuf.LazyStackStorage(CAPACITY, densify=True)), _ragged_td, td=True),
        Config("packed", rb(lambda: gpubuf.PackedStorage(CAPACITY)), _ragged_td, td=True),
        Config("spill", rb(lambda: gpubuf.SpillStorage(CAPACITY, device="cpu", device_budget=12 * 3, scratch_dir=tempfile.mkdtemp(dir=tmp))), _tensor, td=False),
        Config("spill_td", rb(lambda: gpubuf.SpillStorage(CAPACITY, device="cpu", device_budget=16 * 3, scratch_dir=tempfile.mkdtemp(dir=tmp)), td=True), _td, td=True),
        Config("compressed_list", rb(lambda: gpubuf.CompressedListStorage(CAPACITY)), _tensor, td=False),
        Config("compressed_list_frames", rb(lambda: gpubuf.CompressedListStorage(CAPACITY), td=True), _frames_td, td=True),
        Config("compressed_tensor", rb(lambda: gpubuf.CompressedTensorStorage(CAPACITY, min_row_bytes=1)), _tensor, td=False),
        Config("compressed_tensor_td", rb(lambda: gpubuf.CompressedTensorStorage(CAPACITY, min_row_bytes=1), td=True), _td, td=True),
        Config("frame_stack", rb(lambda: gpubuf.FrameStackStorage(CAPACITY), td=True), _frames_td, td=True),
        Config("ensemble", _ensemble, _tensor, td=False, members=_member_configs()),
        Config("ensemble_td", _td_ensemble, _td, td=True, members=_td_members()),
        Config("ensemble_components", _components_ensemble, _tensor, td=False, members=_tensor_members()),
        Config("shared_prioritized",
               lambda: gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY),
                                           sampler=gpubuf.SharedPrioritizedSampler(CAPACITY, 0.7, 0.5)),
               _tensor, td=False, prioritized=True),
        Config("slice", _slice(lambda: gpubuf.SliceSampler(num_slices=2, traj_key="episode")), _episodes_td, td=True, fill=12),
        Config("slice_end_key", _slice(lambda: gpubuf.SliceSampler(slice_len=2, end_key=("next", "done"))), _episodes_td, td=True, fill=12),
        Config("slice_without_replacement", _slice(lambda: gpubuf.SliceSamplerWithoutReplacement(num_slices=2, traj_key="episode")),
               _episodes_td, td=True, fill=12),
        Config("prioritized_slice", _slice(lambda: gpubuf.PrioritizedSliceSampler(CAPACITY * 2, 0.7, 0.5, num_slices=2, traj_key="episode")),
               _episodes_td, td=True, prioritized=True, fill=12),
    ]


# ---------------------------------------------------------------------- hostile operations
META = torch.empty(3, 3, device="meta")


def _bad_batches(config: Config, rb: Any) -> list[tuple[str, Any]]:
    """Batches that do not fit ``config``'s buffer (plus a few that do, oddly)."""
    v = config.valid(3, 50)
    out: list[tuple[str, Any]] = [
        ("None", None), ("float", 3.0), ("str", "abc"), ("empty list", []), ("dict", {"a": 1}),
        ("meta tensor", META), ("int tensor", torch.ones(3, 3, dtype=torch.int64)),
        ("wrong trailing shape", torch.ones(3, 5)), ("0-d tensor", torch.tensor(1.0)), ("bool", True),
        ("list of str", ["a", "b"]), ("nested list", [[1, 2], [3]]), ("nan rows", torch.full((3, 3), float("nan"))),
        ("over capacity", config.valid(3 * CAPACITY, 60)), ("zero rows", torch.zeros(0, 3)),
        ("td missing key", TensorDict({"obs": torch.ones(3, 3)}, [3])),
        ("td extra key", TensorDict({"obs": torch.ones(3, 3), "r": torch.ones(3), "zz": torch.ones(3)}, [3])),
        ("td wrong dtype", TensorDict({"obs": torch.ones(3, 3, dtype=torch.float64), "r": torch.ones(3)}, [3])),
        ("td on meta", TensorDict({"obs": torch.ones(3, 3), "r": torch.ones(3)}, [3]).to("meta")),
        ("td no batch dim", TensorDict({"obs": torch.ones(3, 3)}, [])),
    ]
    if isinstance(v, TensorDictBase):
        out += [
            ("valid td int64 leaf", v.apply(lambda t: t.long() if t.dtype.is_floating_point else t)),
            ("valid td missing leaf", v.exclude(*[k for k in list(v.keys())[:1]])),
            ("valid td extra leaf", v.clone().set("extra", torch.ones(v.shape[0]))),
            ("valid td shape", v.apply(lambda t: t.unsqueeze(-1))),
            ("valid td 2 batch dims", v.unsqueeze(0).expand(2, *v.shape).clone()),
        ]
    elif isinstance(v, torch.Tensor):
        out += [("valid as float64", v.double()), ("valid unsqueezed", v.unsqueeze(-1)), ("valid transposed", v.t())]
    if len(rb):
        try:
            own = rb[0 : len(rb)]
        except Exception:  # noqa: BLE001
            own = None
        if own is not None and not isinstance(own, list):
            out.append(("own rows view", own))
    return out


def _bad_indices(n: int) -> list[tuple[str, Any]]:
    return [
        ("float", 2.5), ("float tensor", torch.tensor([0.5, 1.0])), ("slice step 0", slice(None, None, 0)),
        ("slice step -1", slice(None, None, -1)), ("slice float", slice(0.5, 2)), ("mask short", torch.tensor([True, False])),
        ("mask long", torch.ones(n + 3, dtype=torch.bool)), ("str", "nope"), ("past end", 100), ("negative past", -100),
        ("list past end", [0, 100]), ("None", None), ("nested tuple", ((0,),)), ("huge int", 2**70), ("obj", object()),
        ("meta index", torch.zeros(2, dtype=torch.long, device="meta")), ("complex", 1j), ("list of floats", [0.5]),
        ("int tensor 2d", torch.zeros(2, 2, dtype=torch.long)), ("numpy float", np.float32(1.0)), ("bool", True),
        ("tuple of ints", (0, 1)), ("tuple 3 parts", (0, 0, 0)), ("list of str", ["a"]),
    ]


def _bad_priorities(n: int) -> list[tuple[str, Any, Any]]:
    idx = torch.arange(min(n, 2))
    return [
        ("nan", idx, torch.full((len(idx),), float("nan"))), ("inf", idx, torch.full((len(idx),), float("inf"))),
        ("negative", idx, -torch.ones(len(idx))), ("None", idx, None), ("strings", idx, ["a", "b"][: len(idx)]),
        ("length mismatch", idx, torch.ones(len(idx) + 3)), ("index past end", torch.tensor([100]), torch.ones(1)),
        ("float index", torch.tensor([0.5]), torch.ones(1)), ("huge", idx, torch.full((len(idx),), 1e40, dtype=torch.float64)),
        ("complex", idx, torch.ones(len(idx), dtype=torch.complex64)), ("index None", None, torch.ones(1)),
        ("index str", "a", 1.0), ("huge index", 2**70, 1.0), ("meta", idx, torch.ones(len(idx), device="meta")),
        ("python 1e20", idx, 1e20), ("bool mask", torch.ones(len(idx), dtype=torch.bool), torch.ones(len(idx))),
    ]


def _state_edits(rb: Any, config: Config) -> list[tuple[str, Callable[[], Any]]]:
    """Edited, partial and foreign state dicts."""
    edits: list[tuple[str, Callable[[], Any]]] = []
    base = rb.state_dict()

    def paths(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                yield prefix + (key,)
                yield from paths(value, prefix + (key,))
        elif isinstance(node, (list, tuple)) and len(prefix) < 4 and len(node) < 12:
            for i, value in enumerate(node):
                yield from paths(value, prefix + (i,))

    def edited(path, action, value=None):
        def make():
            sd = copy.deepcopy(base)
            node = sd
            for key in path[:-1]:
                node = node[key]
            if isinstance(node, tuple):
                return None
            if action == "delete":
                if isinstance(node, list):
                    del node[path[-1]]
                else:
                    del node[path[-1]]
            else:
                node[path[-1]] = value(node[path[-1]]) if callable(value) else value
            return sd
        return make

    def flip(old):
        if isinstance(old, torch.Tensor) and old.numel():
            return old.flatten().flip(0).reshape(old.shape) * 3 - 1 if old.dtype != torch.bool else ~old
        if isinstance(old, (int, float)) and not isinstance(old, bool):
            return old * 10**6 + 7
        return old

    def wrong_dtype(old):
        if isinstance(old, torch.Tensor):
            return old.to(torch.float16 if old.dtype != torch.float16 else torch.int32)
        return old

    def truncate(old):
        if isinstance(old, torch.Tensor) and old.ndim:
            return old[: max(old.shape[0] // 2, 0)]
        if isinstance(old, list):
            return old[: len(old) // 2]
        return old

    for path in list(paths(base))[:120]:
        edits.append((f"delete {path}", edited(path, "delete")))
        edits.append((f"None at {path}", edited(path, "set", None)))
        edits.append((f"-1 at {path}", edited(path, "set", -1)))
        edits.append((f"str at {path}", edited(path, "set", "a")))
        edits.append((f"10**6 at {path}", edited(path, "set", 10**6)))
        edits.append((f"scaled at {path}", edited(path, "set", flip)))
        edits.append((f"dtype at {path}", edited(path, "set", wrong_dtype)))
        edits.append((f"truncated at {path}", edited(path, "set", truncate)))
    edits.append(("not a dict", lambda: [1, 2]))
    edits.append(("empty dict", lambda: {}))
    edits.append(("None", lambda: None))
    return edits


def _foreign_states(config: Config) -> list[tuple[str, Callable[[], Any]]]:
    """States of other buffers: other capacity, other kind, more rows."""
    def state_of(make, data):
        def build():
            other = make()
            other.extend(data)
            return other.state_dict()
        return build

    out = [
        ("tensor buffer", state_of(lambda: gpubuf.ReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY)), _tensor(5))),
        ("list buffer", state_of(lambda: gpubuf.ReplayBuffer(storage=gpubuf.ListStorage(CAPACITY)), _tensor(5))),
        ("td buffer", state_of(lambda: gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(CAPACITY)), _td(5))),
        ("capacity 3 list", state_of(lambda: gpubuf.ReplayBuffer(storage=gpubuf.ListStorage(3)), _tensor(3))),
        ("prioritized", state_of(lambda: gpubuf.PrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=gpubuf.LazyTensorStorage(CAPACITY)), _tensor(5))),
        ("lazystack td", state_of(lambda: gpubuf.ReplayBuffer(storage=gpubuf.LazyStackStorage(CAPACITY)), _td(5))),
    ]
    for other in configs_cache():
        if other.name != config.name and not other.members:
            out.append((f"state of {other.name}", lambda other=other: other.build().state_dict()))
    # The same configuration, more rows (a wrapped cursor) or none.
    out.append(("same kind, wrapped", lambda: config.build(fill=CAPACITY + 3).state_dict()))
    out.append(("same kind, empty", lambda: config.build(fill=0).state_dict()))
    return out


_CONFIGS: list[Config] | None = None


def configs_cache() -> list[Config]:
    global _CONFIGS
    if _CONFIGS is None:
        _CONFIGS = configs()
    return _CONFIGS


def operations(config: Config) -> dict[str, Callable[[Any], list[tuple[str, Callable[[Any], Any]]]]]:
    """Operation name -> cases: each case is (label, call(rb)) on a freshly built buffer."""

    def extend(rb):
        return [(label, lambda rb, d=d: rb.extend(d)) for label, d in _bad_batches(config, rb)]

    def extend_list(rb):
        items = config.valid(3, 40)
        as_list = items if isinstance(items, list) else [items[i] for i in range(3)]
        return [("list of items", lambda rb: rb.extend(as_list)), ("list with None", lambda rb: rb.extend([as_list[0], None])),
                ("list mixed", lambda rb: rb.extend([as_list[0], "x"]))]

    def add(rb):
        cases = [(label, lambda rb, d=d: rb.add(d)) for label, d in _bad_batches(config, rb)]
        one = config.valid(1, 30)
        one = one[0]
        cases.append(("valid item", lambda rb: rb.add(one)))
        return cases

    def getitem(rb):
        return [(label, lambda rb, i=i: rb[i]) for label, i in _bad_indices(len(rb))]

    def setitem(rb):
        one = config.valid(1, 70)[0]
        cases = []
        for label, i in _bad_indices(len(rb)):
            def call(rb, i=i):
                rb[i] = one
            cases.append((f"index {label}", call))
        for label, value in _bad_batches(config, rb)[:14]:
            def call(rb, value=value):
                rb[0] = value
            cases.append((f"value {label}", call))

        def at_len(rb):
            rb[len(rb)] = one
        cases.append(("at len", at_len))

        def own(rb):
            rb[0:2] = rb[1:3]
        cases.append(("own rows shifted", own))
        return cases

    def sample(rb):
        return [(repr(b), lambda rb, b=b: rb.sample(b)) for b in (0, -1, 2.5, "a", None, 10**12, True, 2**70, torch.tensor(3))]

    def sample_empty(rb):
        def call(rb):
            rb.empty()
            return rb.sample(4)
        return [("empty then sample", call)]

    def priorities(rb):
        cases = [(label, lambda rb, i=i, p=p: rb.update_priority(i, p)) for label, i, p in _bad_priorities(len(rb))]
        if hasattr(rb.sampler, "alpha"):
            for alpha in (-1.0, float("nan"), 707.0, "a", None):
                cases.append((f"alpha {alpha!r}", lambda rb, a=alpha: setattr(rb.sampler, "alpha", a)))
            for beta in (-1.0, float("nan"), "a"):
                cases.append((f"beta {beta!r}", lambda rb, b=beta: setattr(rb.sampler, "beta", b)))
        return cases

    def load_state(rb):
        return [(label, lambda rb, m=m: _load_made(rb, m)) for label, m in _state_edits(rb, config)]

    def load_foreign(rb):
        return [(label, lambda rb, m=m: _load_made(rb, m)) for label, m in _foreign_states(config)]

    def checkpoints(rb):
        return _checkpoint_cases(config, rb)

    def empty(rb):
        return [("empty", lambda rb: rb.empty()), ("empty keep count", lambda rb: rb.empty(empty_write_count=False))]

    ops = {
        "extend": extend, "extend_list": extend_list, "add": add, "getitem": getitem, "setitem": setitem,
        "sample": sample, "sample_empty": sample_empty, "priorities": priorities, "load_state_dict": load_state,
        "load_foreign_state": load_foreign, "dumps_loads": checkpoints, "empty": empty,
    }
    return ops


def _load_made(rb: Any, make: Callable[[], Any]) -> None:
    sd = make()
    rb.load_state_dict(sd)


def _checkpoint_cases(config: Config, rb: Any) -> list[tuple[str, Callable[[Any], Any]]]:
    from gpubuf.checkpoint.format import seal_meta

    root = Path(tempfile.mkdtemp(prefix="ckpt_", dir=ROOT))
    source = config.build(fill=CAPACITY + 2)
    good = root / "good"
    try:
        source.dumps(good)
    except GpubufError:
        good = None
    cases: list[tuple[str, Callable[[Any], Any]]] = [
        ("dumps(None)", lambda rb: rb.dumps(None)),
        ("dumps under a file", lambda rb: rb.dumps(_a_file(root) / "sub")),
        ("loads missing", lambda rb: rb.loads(root / "missing")),
        ("loads a file", lambda rb: rb.loads(_a_file(root))),
        ("loads None", lambda rb: rb.loads(None)),
        ("loads empty dir", lambda rb: rb.loads(_mk(root / "emptydir"))),
    ]
    if good is None:
        return cases
    cases.append(("round trip", lambda rb: rb.loads(good)))
    meta = json.loads((good / "meta.json").read_text())

    def leaf_paths(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from leaf_paths(value, prefix + (key,))
        elif isinstance(node, list) and len(node) < 8:
            for i, value in enumerate(node):
                yield from leaf_paths(value, prefix + (i,))
        else:
            yield prefix

    for k, path in enumerate(p for p in leaf_paths(meta) if p and p[0] in ("components", "buffer")):
        for j, value in enumerate((None, -1, 10**6, "x", 0.5)):
            def call(rb, path=path, value=value, tag=f"e{k}_{j}"):
                target = root / tag
                if not target.exists():
                    shutil.copytree(good, target)
                    m = json.loads((target / "meta.json").read_text())
                    node = m
                    for key in path[:-1]:
                        node = node[key]
                    node[path[-1]] = value
                    (target / "meta.json").write_text(json.dumps(seal_meta(m)))
                rb.loads(target)
            cases.append((f"meta {'.'.join(map(str, path))}={value!r}", call))

    def truncated(rb):
        import shutil

        target = root / "trunc"
        if not target.exists():
            shutil.copytree(good, target)
            for f in sorted(target.rglob("*")):
                if f.is_file() and f.name != "meta.json" and f.stat().st_size > 8:
                    with open(f, "r+b") as fh:
                        fh.truncate(f.stat().st_size // 2)
        rb.loads(target)
    cases.append(("truncated data", truncated))

    def flipped(rb):
        import shutil

        target = root / "flip"
        if not target.exists():
            shutil.copytree(good, target)
            for f in sorted(target.rglob("*")):
                if f.is_file() and f.name != "meta.json" and f.stat().st_size > 8:
                    data = bytearray(f.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    f.write_bytes(bytes(data))
        rb.loads(target)
    cases.append(("flipped byte", flipped))

    def unsealed(rb):
        import shutil

        target = root / "unsealed"
        if not target.exists():
            shutil.copytree(good, target)
            m = json.loads((target / "meta.json").read_text())
            m.setdefault("buffer", {})["batch_size"] = 4007
            (target / "meta.json").write_text(json.dumps(m))
        rb.loads(target)
    cases.append(("edited without seal", unsealed))

    for other in configs_cache():
        if other.name == config.name:
            continue

        def foreign(rb, other=other):
            target = root / f"other_{other.name}"
            if not target.exists():
                other.build().dumps(target)
            rb.loads(target)
        cases.append((f"checkpoint of {other.name}", foreign))
    return cases


def _a_file(root: Path) -> Path:
    f = root / "a_file"
    f.write_text("x")
    return f


def _mk(path: Path) -> Path:
    path.mkdir(exist_ok=True)
    return path


# ---------------------------------------------------------------------- constructors
def constructor_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    """(class, label, call): constructions that must be refused with a typed error (or accepted and work)."""
    sizes = [0, -1, 2.5, "8", None, 2**63, 2**40, True]
    cases: list[tuple[str, str, Callable[[], Any]]] = []
    storages = {
        "LazyStackStorage": lambda s, **k: gpubuf.LazyStackStorage(s, **k),
        "PackedStorage": lambda s, **k: gpubuf.PackedStorage(s, **k),
        "SpillStorage": lambda s, **k: gpubuf.SpillStorage(s, **k),
        "CompressedListStorage": lambda s, **k: gpubuf.CompressedListStorage(s, **k),
        "CompressedTensorStorage": lambda s, **k: gpubuf.CompressedTensorStorage(s, **k),
        "FrameStackStorage": lambda s, **k: gpubuf.FrameStackStorage(s, **k),
    }
    for name, make in storages.items():
        for size in sizes:
            if size is None and name in ("LazyStackStorage", "PackedStorage"):
                continue  # unbounded, as in TorchRL
            cases.append((name, f"max_size={size!r}", lambda make=make, size=size: make(size)))
        for device in ("gpu0", "cuda", "meta", 3.5):
            cases.append((name, f"device={device!r}", lambda make=make, device=device: make(8, device=device)))
    cases += [
        ("LazyStackStorage", "densify stack_dim=2", lambda: gpubuf.LazyStackStorage(8, densify=True, stack_dim=2)),
        ("LazyStackStorage", "stack_dim='a'", lambda: gpubuf.LazyStackStorage(8, stack_dim="a")),
        ("SpillStorage", "device_budget=-1", lambda: gpubuf.SpillStorage(8, device="cpu", device_budget=-1)),
        ("SpillStorage", "device_budget=2.5", lambda: gpubuf.SpillStorage(8, device="cpu", device_budget=2.5)),
        ("SpillStorage", "scratch_dir under a file", lambda: gpubuf.SpillStorage(8, device="cpu", scratch_dir=_a_file(Path(tempfile.mkdtemp(dir=ROOT))) / "x")),
        ("CompressedListStorage", "compression_level='a'", lambda: gpubuf.CompressedListStorage(8, compression_level="a")),
        ("CompressedListStorage", "compression_level=99", lambda: gpubuf.CompressedListStorage(8, compression_level=99)),
        ("CompressedListStorage", "compression_fn=3", lambda: gpubuf.CompressedListStorage(8, compression_fn=3)),
        ("CompressedTensorStorage", "min_row_bytes=-1", lambda: gpubuf.CompressedTensorStorage(8, min_row_bytes=-1)),
        ("CompressedTensorStorage", "min_row_bytes='a'", lambda: gpubuf.CompressedTensorStorage(8, min_row_bytes="a")),
        ("CompressedTensorStorage", "compress_keys=5", lambda: gpubuf.CompressedTensorStorage(8, compress_keys=5)),
        ("FrameStackStorage", "key_interval=0", lambda: gpubuf.FrameStackStorage(8, key_interval=0)),
        ("FrameStackStorage", "key_interval=2.5", lambda: gpubuf.FrameStackStorage(8, key_interval=2.5)),
        ("FrameStackStorage", "stack_keys=5", lambda: gpubuf.FrameStackStorage(8, stack_keys=5)),
        ("StorageEnsemble", "no members", lambda: gpubuf.StorageEnsemble()),
        ("StorageEnsemble", "a non-storage", lambda: gpubuf.StorageEnsemble(3, gpubuf.ListStorage(3))),
        ("StorageEnsemble", "transforms of wrong length", lambda: gpubuf.StorageEnsemble(gpubuf.ListStorage(3), transforms=[None, None])),
        ("SamplerEnsemble", "no members", lambda: gpubuf.SamplerEnsemble()),
        ("SamplerEnsemble", "a non-sampler", lambda: gpubuf.SamplerEnsemble(3)),
        ("SamplerEnsemble", "p negative", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), gpubuf.RandomSampler(), p=[-1, 2])),
        ("SamplerEnsemble", "p nan", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), gpubuf.RandomSampler(), p=[float("nan"), 1])),
        ("SamplerEnsemble", "p length", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), p=[0.5, 0.5])),
        ("SamplerEnsemble", "p zero", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), gpubuf.RandomSampler(), p=[0, 0])),
        ("SamplerEnsemble", "p str", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), p="abc")),
        ("SamplerEnsemble", "p and all", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), p=[1.0], sample_from_all=True)),
        ("SamplerEnsemble", "num_buffer_sampled=0", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), num_buffer_sampled=0)),
        ("SamplerEnsemble", "num_buffer_sampled=-2", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), num_buffer_sampled=-2)),
        ("SamplerEnsemble", "num_buffer_sampled=2.5", lambda: gpubuf.SamplerEnsemble(gpubuf.RandomSampler(), num_buffer_sampled=2.5)),
        ("WriterEnsemble", "no members", lambda: gpubuf.WriterEnsemble()),
        ("WriterEnsemble", "a non-writer", lambda: gpubuf.WriterEnsemble(3)),
        ("ReplayBufferEnsemble", "no members", lambda: gpubuf.ReplayBufferEnsemble()),
        ("ReplayBufferEnsemble", "a non-buffer", lambda: gpubuf.ReplayBufferEnsemble(3)),
        ("ReplayBufferEnsemble", "p and all", lambda: gpubuf.ReplayBufferEnsemble(_member_configs()[0].make(), p=[1.0], sample_from_all=True)),
        ("ReplayBufferEnsemble", "routing_key and dim", lambda: gpubuf.ReplayBufferEnsemble(_member_configs()[0].make(), routing_key="a", routing_dim=0)),
        ("ReplayBufferEnsemble", "routing_dim=2.5", lambda: gpubuf.ReplayBufferEnsemble(_member_configs()[0].make(), routing_dim=2.5)),
        ("ReplayBufferEnsemble", "batch_size=0", lambda: gpubuf.ReplayBufferEnsemble(_member_configs()[0].make(), batch_size=0)),
        ("ReplayBufferEnsemble", "mismatched components", lambda: gpubuf.ReplayBufferEnsemble(
            storages=gpubuf.StorageEnsemble(gpubuf.ListStorage(3), gpubuf.ListStorage(3)),
            samplers=gpubuf.SamplerEnsemble(gpubuf.RandomSampler()), writers=gpubuf.WriterEnsemble(gpubuf.RoundRobinWriter()))),
    ]
    for label, kwargs in [("alpha=-1", dict(alpha=-1.0, beta=0.5)), ("alpha=nan", dict(alpha=float("nan"), beta=0.5)),
                          ("beta=-1", dict(alpha=0.7, beta=-1.0)), ("eps=-1", dict(alpha=0.7, beta=0.5, eps=-1.0)),
                          ("reduction=x", dict(alpha=0.7, beta=0.5, reduction="x")), ("device=gpu0", dict(alpha=0.7, beta=0.5, device="gpu0")),
                          ("device=cuda", dict(alpha=0.7, beta=0.5, device="cuda")), ("device=3.5", dict(alpha=0.7, beta=0.5, device=3.5)),
                          ("alpha='a'", dict(alpha="a", beta=0.5)), ("dtype=int", dict(alpha=0.7, beta=0.5, dtype=torch.int64))]:
        cases.append(("SharedPrioritizedSampler", label, lambda kw=kwargs: gpubuf.SharedPrioritizedSampler(8, **kw)))
    for size in (0, -1, 2.5, 2**63, 2**40, "8", None):
        cases.append(("SharedPrioritizedSampler", f"max_capacity={size!r}", lambda s=size: gpubuf.SharedPrioritizedSampler(s, 0.7, 0.5)))
    slice_args = [
        ("neither", {}), ("both", dict(num_slices=2, slice_len=2)), ("num_slices=0", dict(num_slices=0)),
        ("num_slices=-1", dict(num_slices=-1)), ("num_slices=2.5", dict(num_slices=2.5)), ("slice_len=0", dict(slice_len=0)),
        ("slice_len='a'", dict(slice_len="a")), ("num_slices=True", dict(num_slices=True)),
        ("pad and strict", dict(num_slices=2, pad_output=True, strict_length=True)),
        ("traj_key and end_key", dict(num_slices=2, traj_key="episode", end_key="done")),
        ("traj_key=5", dict(num_slices=2, traj_key=5)), ("span=-1", dict(num_slices=2, span=-1)), ("span='a'", dict(num_slices=2, span="a")),
        ("ends and trajectories", dict(num_slices=2, ends=torch.zeros(3, dtype=torch.bool), trajectories=torch.zeros(3, dtype=torch.long))),
        ("ends float", dict(num_slices=2, ends=torch.zeros(3))), ("trajectories float", dict(num_slices=2, trajectories=torch.zeros(3))),
        ("ends 2d", dict(num_slices=2, ends=torch.zeros(3, 2, dtype=torch.bool))), ("cache_values='a'", dict(num_slices=2, cache_values="a")),
    ]
    import inspect

    makers = {
        "SliceSampler": gpubuf.SliceSampler, "SliceSamplerWithoutReplacement": gpubuf.SliceSamplerWithoutReplacement,
        "PrioritizedSliceSampler": lambda **kw: gpubuf.PrioritizedSliceSampler(16, 0.7, 0.5, **kw),
    }
    for label, kwargs in slice_args:
        for name, make in makers.items():
            cls = getattr(gpubuf, name)
            if set(kwargs) <= set(inspect.signature(cls.__init__).parameters):  # arguments the class takes
                cases.append((name, label, lambda kw=kwargs, make=make: make(**kw)))
    for label, args in [("max_capacity=0", (0, 0.7, 0.5)), ("alpha=-1", (16, -1.0, 0.5)), ("beta=nan", (16, 0.7, float("nan"))),
                        ("max_capacity=2.5", (2.5, 0.7, 0.5))]:
        cases.append(("PrioritizedSliceSampler", label, lambda a=args: gpubuf.PrioritizedSliceSampler(*a, num_slices=2)))
    return cases


# ---------------------------------------------------------------------- running
class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_case(config: Config, call: Callable[[Any], Any], *, fill: int | None = None, loaded: bool = False) -> tuple[str, str]:
    """Runs one case on a fresh buffer: returns (outcome, detail). Outcomes: "typed", "accepted"
    (fine), "changed", "raw", "broken", "hang" (failures)."""
    rb = config.build(fill)
    before = snapshot(rb)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIME_LIMIT_S)
    try:
        try:
            call(rb)
        except _Timeout:
            return "hang", f"no answer in {TIME_LIMIT_S} s"
        except GpubufError as err:
            if not str(err):
                return "raw", f"{type(err).__name__} with no message"
            try:
                diff = same(before, snapshot(rb), "buffer")
            except _Timeout:
                return "hang", "snapshot after the error"
            except Exception as snap_err:  # noqa: BLE001
                return "changed", f"{type(err).__name__}: {err} -- then unreadable: {type(snap_err).__name__}: {snap_err}"
            if diff:
                return "changed", f"{type(err).__name__}: {str(err)[:160]} -- {diff}"
            return "typed", f"{type(err).__name__}: {str(err)[:160]}"
        except Exception as err:  # noqa: BLE001
            return "raw", f"{type(err).__name__}: {str(err)[:200]} @ {_where(err)}"
        try:
            check_consistent(rb, config, loaded=loaded)
        except _Timeout:
            return "hang", "the buffer after the call"
        except AssertionError as err:
            return "broken", f"accepted, then {str(err)[:200]}"
        except Exception as err:  # noqa: BLE001
            return "broken", f"accepted, then {type(err).__name__}: {str(err)[:200]} @ {_where(err)}"
        return "accepted", ""
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _where(err: BaseException) -> str:
    tb = traceback.extract_tb(err.__traceback__)
    frames = [f for f in tb if "gpubuf" in f.filename and "hostile_probe" not in f.filename]
    f = (frames or tb)[-1]
    return f"{Path(f.filename).name}:{f.lineno}"


def run_constructor(call: Callable[[], Any]) -> tuple[str, str]:
    try:
        obj = call()
    except GpubufError as err:
        return ("typed", f"{type(err).__name__}: {str(err)[:160]}") if str(err) else ("raw", "empty message")
    except Exception as err:  # noqa: BLE001
        return "raw", f"{type(err).__name__}: {str(err)[:200]} @ {_where(err)}"
    return "accepted", type(obj).__name__


FAILURES = ("changed", "raw", "broken", "hang")
LOADS = ("load_state_dict", "load_foreign_state", "dumps_loads")


def kinds(names: list[str] | None = None) -> list[tuple[Config, str]]:
    out = []
    for config in configs_cache():
        if names and config.name not in names:
            continue
        for op in operations(config):
            out.append((config, op))
    return out


def run_kind(config: Config, op: str) -> list[tuple[str, str, str]]:
    """Every case of one kind: (label, outcome, detail)."""
    fill = 0 if op == "sample_empty" else None
    probe = config.build(fill)
    results = []
    for label, call in operations(config)[op](probe):
        outcome, detail = run_case(config, call, fill=fill, loaded=op in LOADS)
        results.append((label, outcome, detail))
    return results


def main(argv: list[str]) -> int:
    verbose = "-v" in argv
    names = [a for a in argv if not a.startswith("-")]
    broken_kinds, total_kinds, total_cases = 0, 0, 0
    for config, op in kinds(names):
        results = run_kind(config, op)
        total_kinds += 1
        total_cases += len(results)
        bad = [r for r in results if r[1] in FAILURES]
        if bad:
            broken_kinds += 1
        print(f"{'BROKEN' if bad else 'ok    '} {config.name:28s} {op:20s} {len(results):4d} cases {len(bad):4d} failing", flush=True)
        for label, outcome, detail in bad[: (50 if verbose else 3)]:
            print(f"         {outcome:8s} {label}: {detail}")
    if not names or "constructors" in names:
        by_class: dict[str, list] = {}
        for cls, label, call in constructor_cases():
            outcome, detail = run_constructor(call)
            by_class.setdefault(cls, []).append((label, outcome, detail))
        for cls, results in by_class.items():
            total_kinds += 1
            total_cases += len(results)
            bad = [r for r in results if r[1] in FAILURES]
            broken_kinds += bool(bad)
            print(f"{'BROKEN' if bad else 'ok    '} {cls:28s} {'constructor':20s} {len(results):4d} cases {len(bad):4d} failing")
            for label, outcome, detail in bad[: (50 if verbose else 5)]:
                print(f"         {outcome:8s} {label}: {detail}")
            for label, outcome, detail in results:
                if verbose and outcome == "accepted":
                    print(f"         accepted {label}")
    print(f"{total_kinds} kinds, {total_cases} cases, {broken_kinds} kinds broken")
    return 1 if broken_kinds else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main(sys.argv[1:]))
