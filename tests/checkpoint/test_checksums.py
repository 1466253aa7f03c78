"""Checksums: computed while writing, verified while reading (read into memory, or through a
mapping for a memory-mapped target); format version 1 checkpoints (CRC-32) still load."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from gpubuf.checkpoint.format import DIGEST_KEY, seal_meta
import torch
import xxhash
from ckpt_helpers import assert_same, snapshot
from tensordict import TensorDict

from gpubuf import LazyMemmapStorage, LazyTensorStorage, RandomSampler, TensorDictReplayBuffer
from gpubuf.checkpoint import CheckpointCorruptError
from gpubuf.checkpoint.arrays import PACK_THRESHOLD

ROWS = 64
# 16 KiB a row: the leaf files pass PACK_THRESHOLD, so a memory-mapped target maps them.
WIDTH = 4096


def _rows(n: int, seed: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    return TensorDict(
        {"obs": torch.randn(n, WIDTH, generator=gen), "done": torch.rand(n, 1, generator=gen) < 0.5,
         "step": torch.randint(0, 1000, (n,), generator=gen)},
        batch_size=[n],
    )


def _buffer(kind: str, scratch: Path | None, seed: int) -> TensorDictReplayBuffer:
    storage = LazyMemmapStorage(ROWS, scratch_dir=scratch) if kind == "memmap" else LazyTensorStorage(ROWS)
    return TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=4,
                                  generator=torch.Generator().manual_seed(seed))


def _state(rb: TensorDictReplayBuffer) -> dict:
    """What a load restores, whatever the storage class holding it."""
    snap = snapshot(rb)
    del snap["type"]
    return snap


def _meta(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())


@pytest.fixture
def ckpt(tmp_path):
    rb = _buffer("tensor", None, 1)
    rb.extend(_rows(ROWS - 5, 0))
    rb.sample()
    path = tmp_path / "ckpt"
    rb.dumps(path)
    return path, rb


def _target(kind: str, tmp_path: Path) -> TensorDictReplayBuffer:
    """``"memmap-empty"``: a memory-mapped storage without files yet, which takes verified copies
    of the checkpoint's files as its own; the other targets hold rows already."""
    rb = _buffer(kind.removesuffix("-empty"), tmp_path / "target-files", 7)
    if not kind.endswith("-empty"):
        rb.extend(_rows(9, 5))
    return rb


def _left_in(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")) if directory.exists() else []


def test_files_record_the_xxh3_of_their_bytes(ckpt):
    path, _ = ckpt
    meta = _meta(path)
    assert meta["version"] == 2
    assert any(entry["nbytes"] >= PACK_THRESHOLD for entry in meta["files"].values())
    for rel, entry in meta["files"].items():
        data = (path / rel).read_bytes()
        assert entry["nbytes"] == len(data)
        assert entry["xxh3_64"] == xxhash.xxh3_64_hexdigest(data)
        assert "crc32" not in entry


@pytest.mark.parametrize("kind", ["tensor", "memmap", "memmap-empty"])
def test_round_trip(ckpt, tmp_path, kind):
    path, saved = ckpt
    rb = _target(kind, tmp_path)
    rb.loads(path)
    assert_same(_state(rb), _state(saved), "the loaded buffer")


@pytest.mark.parametrize("kind", ["tensor", "memmap", "memmap-empty"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_is_detected_and_the_target_left_unchanged(ckpt, tmp_path, kind, where):
    path, _ = ckpt
    files = _meta(path)["files"]
    victim = path / max(files, key=lambda rel: files[rel]["nbytes"])
    data = bytearray(victim.read_bytes())
    at = {"first": 0, "middle": len(data) // 2, "last": len(data) - 1}[where]
    data[at] ^= 0x01
    victim.write_bytes(bytes(data))
    rb = _target(kind, tmp_path)
    before, files_before = snapshot(rb), _left_in(tmp_path / "target-files")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        rb.loads(path)
    assert_same(snapshot(rb), before, "the buffer after a refused load")
    # An empty memory-mapped target: the copies made while verifying are gone with the load.
    assert _left_in(tmp_path / "target-files") == files_before


@pytest.mark.parametrize("kind", ["tensor", "memmap", "memmap-empty"])
def test_a_truncated_file_is_detected(ckpt, tmp_path, kind):
    path, _ = ckpt
    files = _meta(path)["files"]
    victim = path / max(files, key=lambda rel: files[rel]["nbytes"])
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 4096)
    rb = _target(kind, tmp_path)
    before = snapshot(rb)
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        rb.loads(path)
    assert_same(snapshot(rb), before, "the buffer after a refused load")


@pytest.mark.parametrize("value", ["0" * 16, "ABCDEF0123456789", "12345", 12345, None, True])
def test_an_edited_checksum_in_meta_json_is_refused(ckpt, tmp_path, value):
    path, _ = ckpt
    meta = _meta(path)
    rel = max(meta["files"], key=lambda r: meta["files"][r]["nbytes"])
    meta["files"][rel]["xxh3_64"] = value
    (path / "meta.json").write_text(json.dumps(seal_meta(meta)))  # sealed: the checksum check is what refuses it
    rb = _target("tensor", tmp_path)
    before = snapshot(rb)
    with pytest.raises(CheckpointCorruptError):
        rb.loads(path)
    assert_same(snapshot(rb), before, "the buffer after a refused load")


def test_a_missing_checksum_field_is_refused(ckpt, tmp_path):
    path, _ = ckpt
    meta = _meta(path)
    for entry in meta["files"].values():
        del entry["xxh3_64"]
    (path / "meta.json").write_text(json.dumps(seal_meta(meta)))  # sealed: the checksum check is what refuses it
    with pytest.raises(CheckpointCorruptError, match="xxh3_64"):
        _target("tensor", tmp_path).loads(path)


def _as_version_1(path: Path, *, corrupt: bool = False) -> None:
    """Rewrites a checkpoint as format version 1 wrote it: CRC-32 checksums as integers."""
    meta = _meta(path)
    meta["version"] = 1
    meta.pop(DIGEST_KEY, None)  # version 1 wrote no digest of meta.json
    for rel, entry in meta["files"].items():
        crc = zlib.crc32((path / rel).read_bytes())
        del entry["xxh3_64"]
        entry["crc32"] = crc ^ 1 if corrupt else crc
    (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("kind", ["tensor", "memmap"])
def test_version_1_checkpoints_load(ckpt, tmp_path, kind):
    path, saved = ckpt
    _as_version_1(path)
    rb = _target(kind, tmp_path)
    rb.loads(path)
    assert_same(_state(rb), _state(saved), "the loaded buffer")


def test_version_1_checksums_are_verified(ckpt, tmp_path):
    path, _ = ckpt
    _as_version_1(path, corrupt=True)
    rb = _target("tensor", tmp_path)
    before = snapshot(rb)
    with pytest.raises(CheckpointCorruptError, match="crc32"):
        rb.loads(path)
    assert_same(snapshot(rb), before, "the buffer after a refused load")


def test_a_memmap_buffer_dumped_elsewhere_round_trips(tmp_path):
    rb = _buffer("memmap", tmp_path / "files", 3)
    rb.extend(_rows(ROWS + 7, 2))  # wrapped once
    path = tmp_path / "ckpt"
    rb.dumps(path)
    fresh = _buffer("memmap", tmp_path / "other-files", 4)
    fresh.loads(path)
    assert_same(snapshot(fresh), snapshot(rb), "the loaded buffer")
    # The loaded rows live in the target's own files, not in the checkpoint's.
    (path / "meta.json").unlink()
    for file in path.rglob("*.bin"):
        file.write_bytes(b"\0" * file.stat().st_size)
    assert torch.equal(fresh[:]["obs"], rb[:]["obs"])
