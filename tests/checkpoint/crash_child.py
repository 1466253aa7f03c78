"""The child side of the SIGKILL tests: a process that keeps dumping a buffer, and the replay
that tells the parent what each committed version must hold.

Version ``v`` of the buffer is the result of ``v`` steps from an empty buffer, each step an
extend of a batch derived from its number and one sample (which moves the sampler and the
generator): any version can be rebuilt exactly, and the writer's write count tells which one a
checkpoint holds.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, ListStorage, ReplayBuffer, SamplerWithoutReplacement

ROWS = 4
WIDTH = 4096  # 16 KiB per row and leaf: a dump moves about 1 MiB, long enough to be killed inside


def make(kind: str, scratch: str | None = None) -> ReplayBuffer:
    """``kind``: "tensor", "list", or "memmap" (a LazyMemmapStorage whose files live in ``scratch``)."""
    if kind == "memmap":
        from gpubuf.storages.memmap import LazyMemmapStorage

        return ReplayBuffer(storage=LazyMemmapStorage(32, scratch_dir=scratch, existsok=True),
                            sampler=SamplerWithoutReplacement(), batch_size=3, generator=torch.Generator().manual_seed(11))
    if kind == "list":
        return ReplayBuffer(storage=ListStorage(24), sampler=SamplerWithoutReplacement(), batch_size=3,
                            generator=torch.Generator().manual_seed(11), collate_fn=list)
    return ReplayBuffer(storage=LazyTensorStorage(32), sampler=SamplerWithoutReplacement(), batch_size=3,
                        generator=torch.Generator().manual_seed(11))


def step(rb: ReplayBuffer, kind: str, v: int) -> None:
    if kind == "list":
        rb.extend([{"v": v, "i": i, "t": torch.full((WIDTH // 8,), float(v))} for i in range(ROWS)])
    else:
        base = torch.arange(ROWS * WIDTH, dtype=torch.float32).view(ROWS, WIDTH) + v
        rb.extend(TensorDict({"obs": base, "big": {"twice": base * 2}, "v": torch.full((ROWS,), v)}, [ROWS]))
    rb.sample()


def build(kind: str, version: int, scratch: str | None = None) -> ReplayBuffer:
    """The buffer at ``version`` (``version`` steps from empty)."""
    rb = make(kind, scratch)
    for v in range(version):
        step(rb, kind, v)
    return rb


def version_of(rb: ReplayBuffer) -> int:
    return rb.writer._write_count // ROWS


def _kill_at(event: int) -> None:
    """Makes this process SIGKILL itself right before its ``event``-th checkpoint I/O step."""
    import shutil

    from gpubuf.checkpoint import arrays, atomic, buffer

    count = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            if count[0] == event:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    atomic.fsync_path = counted(atomic.fsync_path)
    atomic._exchange = counted(atomic._exchange)
    atomic.os.rename = counted(os.rename)
    atomic.os.replace = counted(os.replace)
    atomic.shutil.rmtree = counted(shutil.rmtree)
    arrays._write_file = counted(arrays._write_file)
    buffer._write_meta = counted(buffer._write_meta)


def run(path: str, kind: str, start: int, use_exchange: bool, kill_event: int | None, report: Any,
        steps: int | None = None) -> None:
    """Dumps versions ``start + 1, start + 2, ...`` to ``path``, sending each committed version
    number through the connection ``report``; with ``kill_event``, dies at that I/O step."""
    from gpubuf.checkpoint import atomic

    atomic.USE_EXCHANGE = use_exchange
    # A memory-mapped storage lives in the checkpoint directory: its dumps are in place.
    rb = build(kind, start, os.path.join(path, "storage") if kind == "memmap" else None)
    if kill_event is not None:
        _kill_at(kill_event)
    report.send("ready")
    v = start
    while steps is None or v < start + steps:
        step(rb, kind, v)
        v += 1
        rb.dumps(path)
        report.send(v)
