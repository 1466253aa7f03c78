"""Invalid checkpoints: each raises its typed error, executes nothing, leaves the buffer unchanged.

Every test loads into a buffer that already holds other data, and checks that its whole state
(rows, length, cursor, sampler, generator) is the same after the failed load. Unpickling is made
to fail the test outright, so a load that tried it would be caught even if it raised.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import assert_same, fill, make_buffer, snapshot

from gpubuf import LazyTensorStorage, ListStorage, RandomSampler, ReplayBuffer
from gpubuf.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointVersionError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UnserializableDataError,
)
from gpubuf.errors import GpubufError
from gpubuf.checkpoint.format import seal_meta


class _Boom:
    """Unpickling this creates a marker file: proof that a pickle was executed."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load tried to unpickle")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture
def ckpt(tmp_path):
    rb = make_buffer("lazy", "swr", "rr", seed=1)
    fill(rb, "lazy", "tensordict")
    path = tmp_path / "ckpt"
    rb.dumps(path)
    return path


@pytest.fixture
def target():
    rb = make_buffer("lazy", "swr", "rr", seed=7)
    rb.extend(make_other())
    rb.sample()
    return rb


def make_other():
    from ckpt_helpers import make_items

    return make_items("tensordict", 3, 1000)


def _meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


def _write_meta(path: Path, meta: dict) -> None:
    # Sealed again, so that each edit reaches the check it is meant for (the digest catches any).
    (path / "meta.json").write_text(json.dumps(seal_meta(meta)))


def _biggest_file(path: Path) -> Path:
    files = _meta(path)["files"]
    return path / max(files, key=lambda rel: files[rel]["nbytes"])


def _fails(target, path, error):
    before = snapshot(target)
    with pytest.raises(error) as info:
        target.loads(path)
    assert isinstance(info.value, CheckpointError) and isinstance(info.value, GpubufError)
    assert isinstance(info.value, ValueError)
    assert_same(snapshot(target), before, "the buffer after a refused load")
    return info.value


# ---------------------------------------------------------------------- files
def test_truncated_file(ckpt, target):
    victim = _biggest_file(ckpt)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 1)
    assert "truncated" in str(_fails(target, ckpt, CheckpointCorruptError))


def test_trailing_bytes(ckpt, target):
    with open(_biggest_file(ckpt), "ab") as f:
        f.write(b"\0")
    _fails(target, ckpt, CheckpointCorruptError)


def test_flipped_byte_fails_the_checksum(ckpt, target):
    victim = _biggest_file(ckpt)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    assert "checksum" in str(_fails(target, ckpt, CheckpointCorruptError))


def test_missing_file(ckpt, target):
    _biggest_file(ckpt).unlink()
    _fails(target, ckpt, CheckpointCorruptError)


@pytest.mark.parametrize("field,value", [
    ("nbytes", 12345), ("dtype", "float64"), ("dtype", "float128"), ("dtype", "object"), ("dtype", 3),
    ("shape", [-1]), ("shape", "ten"), ("offset", 10**12), ("file", "storage/nowhere.bin"),
])
def test_wrong_array_entry(ckpt, target, field, value):
    meta = _meta(ckpt)
    name = next(n for n in meta["arrays"] if n.startswith("storage/"))
    meta["arrays"][name][field] = value
    _write_meta(ckpt, meta)
    _fails(target, ckpt, CheckpointCorruptError)


def test_same_size_other_dtype_or_shape_is_refused_by_the_layout(ckpt, target):
    meta = _meta(ckpt)
    leaves = meta["components"]["storage"]["state"]["layout"]["leaves"]
    i = next(i for i, leaf in enumerate(leaves) if leaf["dtype"] == "float32")
    entry = meta["arrays"][f"storage/leaf_{i}"]
    entry["dtype"] = "int32"  # same size: the files table and checksum still agree
    _write_meta(ckpt, meta)
    _fails(target, ckpt, CheckpointCorruptError)
    entry["dtype"] = "float32"
    entry["shape"] = [entry["shape"][0] * entry["shape"][1], 1] if len(entry["shape"]) == 2 else entry["shape"][::-1] + [1]
    _write_meta(ckpt, meta)
    _fails(target, ckpt, CheckpointCorruptError)


def test_wrong_file_size_in_table(ckpt, target):
    meta = _meta(ckpt)
    rel = next(iter(meta["files"]))
    meta["files"][rel]["nbytes"] += 8
    _write_meta(ckpt, meta)
    _fails(target, ckpt, CheckpointCorruptError)


# ---------------------------------------------------------------------- meta.json
@pytest.mark.parametrize("version", [3, 0, "1", None, 1.0, True])
def test_unknown_format_version(ckpt, target, version):
    meta = _meta(ckpt)
    meta["version"] = version
    _write_meta(ckpt, meta)
    error = _fails(target, ckpt, CheckpointVersionError)
    if version == 3:
        assert "newer" in str(error)


def test_malformed_meta(ckpt, target):
    (ckpt / "meta.json").write_text("{not json")
    _fails(target, ckpt, CheckpointCorruptError)
    (ckpt / "meta.json").write_bytes(b"\xff\xfe")
    _fails(target, ckpt, CheckpointCorruptError)


@pytest.mark.parametrize("mutation", ["len", "cursor", "codec", "sample_list", "missing_sampler", "layout_kind"])
def test_inconsistent_component_state(ckpt, target, mutation):
    meta = _meta(ckpt)
    comps = meta["components"]
    error = CheckpointCorruptError
    if mutation == "len":
        comps["storage"]["state"]["len"] = 10**6
    elif mutation == "cursor":
        comps["writer"]["state"]["cursor"] = 10**6
    elif mutation == "codec":
        comps["sampler"]["codec"] = "something_else"
        error = CheckpointMismatchError
    elif mutation == "sample_list":
        comps["sampler"]["state"]["len_storage"] = 1
    elif mutation == "missing_sampler":
        del comps["sampler"]
        error = CheckpointMismatchError
    else:
        comps["storage"]["state"]["layout"]["kind"] = "pickle"
    _write_meta(ckpt, meta)
    _fails(target, ckpt, error)


def test_foreign_directories(tmp_path, target):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.csv").write_text("a,b\n1,2\n")
    _fails(target, foreign, NotACheckpointError)
    (foreign / "meta.json").write_text(json.dumps({"format": "someone-else", "version": 1}))
    _fails(target, foreign, NotACheckpointError)
    _fails(target, tmp_path / "missing", NotACheckpointError)
    (tmp_path / "file").write_text("x")
    _fails(target, tmp_path / "file", NotACheckpointError)


def test_partial_directory_is_not_a_checkpoint(ckpt, target, tmp_path):
    partial = tmp_path / ".ckpt.gpubuf-tmp-1-dead"
    shutil.copytree(ckpt, partial)
    (partial / "meta.json").unlink()  # a dump writes meta.json last
    _fails(target, partial, NotACheckpointError)


# ---------------------------------------------------------------------- unsafe content
def test_symlink_to_a_file_outside(ckpt, target, tmp_path):
    victim = _biggest_file(ckpt)
    outside = tmp_path / "outside.bin"
    shutil.copy(victim, outside)  # same bytes: only where it points is wrong
    victim.unlink()
    victim.symlink_to(outside)
    _fails(target, ckpt, UnsafeCheckpointError)


def test_symlink_to_a_directory_outside(ckpt, target):
    (ckpt / "extra").symlink_to("/")
    _fails(target, ckpt, UnsafeCheckpointError)


def test_meta_json_symlink(ckpt, target, tmp_path):
    real = tmp_path / "real_meta.json"
    shutil.move(ckpt / "meta.json", real)
    (ckpt / "meta.json").symlink_to(real)
    _fails(target, ckpt, UnsafeCheckpointError)


def test_path_traversal_in_meta(ckpt, target, tmp_path):
    meta = _meta(ckpt)
    rel = next(iter(meta["files"]))
    shutil.copy(ckpt / rel, tmp_path / "escaped.bin")
    entry = meta["files"].pop(rel)
    meta["files"]["../escaped.bin"] = entry
    for array in meta["arrays"].values():
        if array["file"] == rel:
            array["file"] = "../escaped.bin"
    _write_meta(ckpt, meta)
    _fails(target, ckpt, UnsafeCheckpointError)


@pytest.mark.parametrize("name", ["evil.pkl", "storage/state.pt", "sampler/notes.bin", "transform.t", "README"])
def test_planted_pickle_is_refused_and_never_executed(ckpt, target, tmp_path, name):
    marker = tmp_path / "executed"
    planted = ckpt / name
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(pickle.dumps(_Boom(str(marker))))
    error = _fails(target, ckpt, UnsafeCheckpointError)
    assert "pickle" in str(error)
    assert not marker.exists()


def test_listed_pickle_name_is_refused(ckpt, target):
    meta = _meta(ckpt)
    rel = next(iter(meta["files"]))
    os.rename(ckpt / rel, ckpt / "payload.pkl")
    meta["files"]["payload.pkl"] = meta["files"].pop(rel)
    for array in meta["arrays"].values():
        if array["file"] == rel:
            array["file"] = "payload.pkl"
    _write_meta(ckpt, meta)
    _fails(target, ckpt, UnsafeCheckpointError)


def test_unlisted_file(ckpt, target):
    (ckpt / "storage" / "extra.bin").write_bytes(b"\0" * 16)
    _fails(target, ckpt, UnsafeCheckpointError)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_fifo_is_refused_without_blocking(ckpt, target):
    victim = _biggest_file(ckpt)
    victim.unlink()
    os.mkfifo(victim)
    _fails(target, ckpt, UnsafeCheckpointError)


# ---------------------------------------------------------------------- checkpoints that do not fit
@pytest.mark.parametrize("build", [
    lambda: ReplayBuffer(storage=LazyTensorStorage(99), sampler=RandomSampler()),
    lambda: make_buffer("lazy", "random", "rr", seed=3),
    lambda: make_buffer("list", "swr", "rr", seed=3),
    lambda: make_buffer("lazy2d", "swr", "rr", seed=3),
])
def test_mismatched_buffer(ckpt, build):
    target = build()
    if isinstance(target.storage, ListStorage):
        target.extend([1, 2, 3])
    _fails(target, ckpt, CheckpointMismatchError)


def test_tensorclass_of_a_module_not_imported(tmp_path, target):
    rb = make_buffer("lazy", "swr", "rr", seed=1, kind="tensorclass")
    fill(rb, "lazy", "tensorclass")
    rb.dumps(tmp_path / "c")
    meta = _meta(tmp_path / "c")
    meta["components"]["storage"]["state"]["layout"]["container"] = "module_never_imported_here:RewardData"
    _write_meta(tmp_path / "c", meta)
    fresh = make_buffer("lazy", "swr", "rr", seed=2, kind="tensorclass")
    fresh.extend(make_other_tc())
    error = _fails(fresh, tmp_path / "c", CheckpointMismatchError)
    assert "module_never_imported_here" not in sys.modules
    assert "import module_never_imported_here" in str(error)


def make_other_tc():
    from ckpt_helpers import make_items

    return make_items("tensorclass", 2, 50)


# ---------------------------------------------------------------------- dumps that must not happen
def test_dump_refuses_a_foreign_directory(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    rb = make_buffer("lazy", "random", "rr", seed=1)
    fill(rb, "lazy", "tensordict")
    with pytest.raises(NotACheckpointError):
        rb.dumps(foreign)
    assert sorted(p.name for p in foreign.iterdir()) == ["cat.jpg"]
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotACheckpointError):
        rb.dumps(tmp_path / "afile")


class _Opaque:
    pass


@pytest.mark.parametrize("item", [_Opaque(), lambda: 1, object(), type, {"nested": [1, _Opaque()]},
                                  __import__("numpy").array([object()])])
def test_unserializable_list_item_leaves_the_previous_checkpoint(tmp_path, item):
    rb = ReplayBuffer(storage=ListStorage(10))
    rb.extend([1, "two", torch.ones(2)])
    path = tmp_path / "c"
    rb.dumps(path)
    before = sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))
    meta_before = (path / "meta.json").read_bytes()
    rb.add(item)
    with pytest.raises(UnserializableDataError) as info:
        rb.dumps(path)
    assert isinstance(info.value, TypeError) and "pickle" in str(info.value)
    assert sorted(p.relative_to(path).as_posix() for p in path.rglob("*")) == before
    assert (path / "meta.json").read_bytes() == meta_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    fresh = ReplayBuffer(storage=ListStorage(10))
    fresh.loads(path)
    assert len(fresh) == 3


def test_locally_defined_tensorclass_is_refused_at_dump(tmp_path):
    from tensordict import tensorclass

    @tensorclass
    class Local:
        x: torch.Tensor

    rb = ReplayBuffer(storage=LazyTensorStorage(4))
    rb.extend(Local(x=torch.ones(2), batch_size=[2]))
    with pytest.raises(UnserializableDataError, match="module level"):
        rb.dumps(tmp_path / "c")
    assert not (tmp_path / "c").exists()
