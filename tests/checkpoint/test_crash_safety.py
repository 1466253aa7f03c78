"""Crash safety: child processes killed with SIGKILL while dumping never damage the checkpoint.

After every kill the checkpoint at the path must load, and hold exactly either the version
committed before the interrupted dump or the one that dump was writing, never anything else.
Children come from a fork server that has torch and gpubuf imported, so each starts in
milliseconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import crash_child  # noqa: E402
from ckpt_helpers import assert_same, snapshot  # noqa: E402

from gpubuf.checkpoint import CheckpointError, NotACheckpointError  # noqa: E402

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and fork server are POSIX only")


# Waits on a child are bounded only to turn a hung child into a failure instead of a hung suite:
# the bound is far above what a dump of 1 MiB takes on any machine, however loaded, and no
# assertion depends on how long anything took.
HANG_GUARD_S = 600.0


@pytest.fixture(scope="module")
def ctx():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "tensordict", "gpubuf", "gpubuf.checkpoint", "crash_child"])
    return context


def _receive(conn, timeout: float) -> list:
    """Everything the child sent until its end closed (it was killed) or ``timeout`` passed."""
    out = []
    deadline = time.monotonic() + timeout
    while conn.poll(max(deadline - time.monotonic(), 0)):
        try:
            out.append(conn.recv())
        except EOFError:
            break
    return out


def _wait_ready(conn, timeout: float = HANG_GUARD_S) -> list:
    """Waits for the child's "ready"; returns what it sent after (versions already committed)."""
    deadline = time.monotonic() + timeout
    while True:
        assert conn.poll(max(deadline - time.monotonic(), 0)), "the child did not start"
        if conn.recv() == "ready":
            return []


def _check(path: Path, kind: str, allowed: set[int]) -> int:
    """Loads the checkpoint, checks it is exactly one of the ``allowed`` versions, returns it."""
    fresh = crash_child.make(kind)
    fresh.loads(path)
    version = crash_child.version_of(fresh)
    assert version in allowed, f"checkpoint holds version {version}, expected one of {sorted(allowed)}"
    assert_same(snapshot(fresh), snapshot(crash_child.build(kind, version)), f"version {version}")
    return version


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def _dump_once_killed_at(ctx, path: Path, kind: str, version: int, use_exchange: bool, event: int) -> int | None:
    """Runs a child that dumps version ``version + 1`` of ``kind`` to ``path`` and kills itself
    right before its I/O step ``event``; returns its exit code (0 when the dump completed first)."""
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=crash_child.run, args=(str(path), kind, version, use_exchange, event, writer, 1))
    child.start()
    writer.close()
    child.join(HANG_GUARD_S)
    reader.close()
    return child.exitcode


def test_sigkill_at_random_moments(tmp_path, ctx):
    rng = random.Random(20240601)
    versions = {"tensor": 0, "list": 0}
    paths = {kind: tmp_path / kind / "ckpt" for kind in versions}
    kills = 0
    for i in range(24):
        kind = "list" if i % 4 == 3 else "tensor"
        path = paths[kind]
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=crash_child.run,
                            args=(str(path), kind, versions[kind], i % 2 == 0, None, writer))
        child.start()
        writer.close()
        early = _wait_ready(reader)
        # The first dump tells how long one takes on this machine now; the kill then lands at a
        # random moment of the following ones (the child dumps back to back).
        started = time.monotonic()
        assert reader.poll(HANG_GUARD_S), "the child's first dump did not complete"
        early.append(reader.recv())
        duration = time.monotonic() - started
        time.sleep(rng.uniform(0.0, 1.5 * duration))
        assert child.is_alive(), "the child stopped dumping before it was killed"
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL
        kills += 1
        # The child is dead: what it sent is already in the pipe, a short poll collects it.
        reported = [int(x) for x in early + _receive(reader, 0.1)]
        reader.close()
        last = reported[-1] if reported else versions[kind]
        if last == 0:
            # Killed before its first dump completed: no checkpoint, or the first one.
            try:
                versions[kind] = _check(path, kind, {0, 1})
            except NotACheckpointError:
                assert not path.exists()
            continue
        versions[kind] = _check(path, kind, {last, last + 1})
        # A leftover temporary directory is never at the path, and never loads as anything but
        # a complete checkpoint of the version its dump was writing.
        for name in _siblings(path):
            try:
                _check(path.parent / name, kind, {last + 1})
            except CheckpointError:
                pass
    assert kills >= 20
    # Each child is killed only after its first dump completed, so every round commits a version.
    assert versions["tensor"] >= 18, "a round committed no version"
    # The next successful dump cleans up what killed dumps left behind.
    for kind, path in paths.items():
        crash_child.build(kind, versions[kind] + 1).dumps(path)
        assert _siblings(path) == []
        _check(path, kind, {versions[kind] + 1})


@pytest.mark.parametrize("use_exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_sigkill_before_every_io_step(tmp_path, ctx, use_exchange):
    """Kills a dump right before each of its file writes, fsyncs, renames and deletions in turn."""
    path = tmp_path / "ckpt"
    # Every interrupted dump replaces an existing checkpoint, so that event numbers mean the same
    # steps from one child to the next.
    crash_child.build("tensor", 1).dumps(path)
    version = 1
    for event in range(200):
        exitcode = _dump_once_killed_at(ctx, path, "tensor", version, use_exchange, event)
        if exitcode == 0:
            break
        assert exitcode == -signal.SIGKILL
        version = _check(path, "tensor", {version, version + 1})
    else:
        pytest.fail("the dump never completed")
    assert event >= 8, f"only {event} I/O steps were interrupted"
    _check(path, "tensor", {version + 1})


def test_sigkill_before_every_io_step_of_an_in_place_dump(tmp_path, ctx):
    """A memory-mapped storage dumped where it lives: the rows are its live files, so only the
    rest of the state is versioned; it must be exactly the previous or the new version."""
    pytest.importorskip("gpubuf.storages.memmap", reason="LazyMemmapStorage is not available")
    path = tmp_path / "ckpt"
    crash_child.build("memmap", 1, str(path / "storage")).dumps(path)
    version = 1
    for event in range(200):
        exitcode = _dump_once_killed_at(ctx, path, "memmap", version, True, event)
        if exitcode == 0:
            break
        assert exitcode == -signal.SIGKILL
        fresh = crash_child.make("tensor")
        fresh.loads(path)
        loaded = crash_child.version_of(fresh)
        assert loaded in (version, version + 1)
        expected = snapshot(crash_child.build("tensor", loaded))
        got = snapshot(fresh)
        for key in ("len", "writer", "sampler", "rng"):
            assert_same(got[key], expected[key], key)
        version = loaded
    else:
        pytest.fail("the dump never completed")
    assert event >= 4, f"only {event} I/O steps were interrupted"
