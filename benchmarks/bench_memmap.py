"""LazyMemmapStorage side by side: gpubuf vs TorchRL, extend and sample (pytest-benchmark).

Both buffers hold the workload's ``N`` transitions (see :mod:`gpubuf.tools.bench.workloads`) in a
``LazyMemmapStorage(N)`` filled before timing, so an extend overwrites rows in place, as in a
running training loop. ``scratch`` says where the files are:

- ``temp``: each library's default (``scratch_dir=None``): gpubuf and TorchRL both map
  ``/dev/shm`` when the buffer fits in memory;
- ``disk``: a directory of the system temporary directory (``TMPDIR``) for both.

::

    python -m pytest benchmarks/bench_memmap.py --benchmark-only [--bench-rows 1000000] [--no-torchrl]
"""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from gpubuf.tools.bench import torchrl_compat
from gpubuf.tools.bench.workloads import ROW_BYTES

OPS = [("extend", 1_000), ("extend", 100_000), ("sample", 65_536)]
LIBRARIES = ["gpubuf", "torchrl"]
BUFFERS = ["TensorDictReplayBuffer", "ReplayBuffer"]
SCRATCH = ["temp", "disk"]
_FILL_CHUNK = 100_000


def _classes(library: str):
    if library == "gpubuf":
        import gpubuf
        from gpubuf.storages.memmap import LazyMemmapStorage

        return gpubuf, LazyMemmapStorage
    module = torchrl_compat.load_torchrl_data()
    return module, module.LazyMemmapStorage


@pytest.fixture(scope="module")
def memmap_buffers(pytestconfig, bench_data, bench_rows):
    """``get(library, buffer, scratch)`` -> a full buffer on a memmap storage (built once)."""
    built: dict = {}
    dirs: list[str] = []
    skip_torchrl = pytestconfig.getoption("--no-torchrl")

    def get(library: str, buffer: str, scratch: str):
        key = (library, buffer, scratch)
        if key not in built:
            if library == "torchrl" and skip_torchrl:
                pytest.skip("--no-torchrl")
            directory = None
            if scratch == "disk":
                directory = tempfile.mkdtemp(prefix=f"bench_memmap_{library}_")
                dirs.append(directory)

            def build():
                ns, storage_cls = _classes(library)
                rb = getattr(ns, buffer)(storage=storage_cls(bench_rows, scratch_dir=directory))
                for start in range(0, bench_rows, _FILL_CHUNK):
                    rb.extend(bench_data[start : start + _FILL_CHUNK].clone(recurse=False))
                return rb

            with torchrl_compat.quiet_logs():
                rb, reason = torchrl_compat.attempt(build, "construction")
            if reason is not None:
                if library == "gpubuf":
                    raise AssertionError(reason)
                pytest.skip(f"torchrl unavailable: {reason}")
            built[key] = rb
        return built[key]

    yield get
    for rb in built.values():
        cleanup = getattr(rb.storage, "cleanup", None)
        if cleanup is not None:
            cleanup()
    built.clear()
    for directory in dirs:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("scratch", SCRATCH)
@pytest.mark.parametrize("buffer", BUFFERS, ids=lambda b: "TDRB" if b.startswith("TensorDict") else "RB")
@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op[0]}-{op[1]}")
def test_memmap(benchmark, op, library, buffer, scratch, memmap_buffers, bench_data, bench_rows):
    kind, size = op
    if kind == "extend" and size > bench_rows:
        pytest.skip(f"chunk {size} exceeds the buffer's {bench_rows} rows")
    rb = memmap_buffers(library, buffer, scratch)
    if kind == "extend":
        chunk = bench_data[:size].clone(recurse=False)

        def call():
            rb.extend(chunk)

    else:

        def call():
            rb.sample(size)

    with torchrl_compat.quiet_logs():
        call()
    benchmark.group = f"memmap {kind} {'chunk' if kind == 'extend' else 'B'}={size:,} {scratch} (N={bench_rows:,})"
    benchmark.extra_info.update(
        provider=library,
        buffer=buffer,
        storage="LazyMemmapStorage",
        scratch=scratch,
        rows=bench_rows,
        items=size,
        bytes_moved=2 * size * ROW_BYTES,
        device="cpu",
        torch=torch.__version__,
    )
    with torchrl_compat.quiet_logs():
        benchmark(call)
