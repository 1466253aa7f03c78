"""gpubuf and TorchRL side by side on the host read and write paths, in one process.

Ops, for ``ReplayBuffer`` and ``TensorDictReplayBuffer`` over ``LazyTensorStorage(N)`` and
``LazyMemmapStorage(N)`` holding the bench harness's rows (277 B):

- ``extend``: a chunk of 1,000 rows into a full buffer (round robin, so it overwrites);
- ``first-fill``: a new buffer and storage, then one extend of 100,000 rows (the allocation,
  or the files, included);
- ``sample``: a uniform batch of 256 and of 65,536 rows.

Timings are interleaved call by call (:func:`~gpubuf.tools.bench.timing.measure_round_robin`);
the ratio is TorchRL's median time over gpubuf's (above 1: gpubuf is faster). Torch keeps its
default thread count unless ``--threads`` says otherwise.

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/side_by_side_host.py --rows 1000000 --out results.json

``GPUBUF_NUMBA=0`` gives a plain install's paths (no compiled CPU kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, Callable

import torch

import gpubuf
import gpubuf.host_memory
from gpubuf.tools.bench.timing import measure_round_robin
from gpubuf.tools.bench.workloads import make_transitions

STORAGES = ("tensor", "memmap")
BUFFERS = ("ReplayBuffer", "TensorDictReplayBuffer")


def _storage(ns: Any, kind: str, rows: int, scratch: str | None = None) -> Any:
    if kind == "tensor":
        return ns.LazyTensorStorage(rows)
    return ns.LazyMemmapStorage(rows, scratch_dir=scratch)


def _filled(ns: Any, kind: str, buffer: str, data: Any, scratch: str) -> Any:
    rb = getattr(ns, buffer)(storage=_storage(ns, kind, data.batch_size[0], scratch))
    for start in range(0, data.batch_size[0], 100_000):
        rb.extend(data[start : start + 100_000].clone(recurse=False))
    return rb


def _first_fill(ns: Any, kind: str, buffer: str, rows: int, chunk: Any, root: str) -> Callable[[], Any]:
    def call() -> None:
        scratch = tempfile.mkdtemp(dir=root) if kind == "memmap" else None
        rb = getattr(ns, buffer)(storage=_storage(ns, kind, rows, scratch))
        rb.extend(chunk.clone(recurse=False))
        del rb
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--ops", nargs="+", default=["extend", "first-fill", "sample:256", "sample:65536"])
    parser.add_argument("--storages", nargs="+", default=list(STORAGES), choices=STORAGES)
    parser.add_argument("--buffers", nargs="+", default=list(BUFFERS), choices=BUFFERS)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--huge-pages", action="store_true", help="gpubuf.host_memory.use_huge_pages() first")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.huge_pages:
        gpubuf.host_memory.use_huge_pages()
    import torchrl.data as trl

    data = make_transitions(args.rows)
    root = tempfile.mkdtemp(prefix="side_by_side_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    rows_out = []
    try:
        for kind in args.storages:
            for buffer in args.buffers:
                libs = {"gpubuf": gpubuf, "torchrl": trl}
                full = {name: _filled(ns, kind, buffer, data, tempfile.mkdtemp(dir=root)) for name, ns in libs.items()}
                for op in args.ops:
                    name, _, size = op.partition(":")
                    if name == "extend":
                        chunk = data[:1000]
                        calls = {lib: (lambda rb=rb: rb.extend(chunk.clone(recurse=False))) for lib, rb in full.items()}
                    elif name == "first-fill":
                        chunk = data[:100_000]
                        calls = {lib: _first_fill(ns, kind, buffer, args.rows, chunk, root) for lib, ns in libs.items()}
                    else:
                        b = int(size)
                        calls = {lib: (lambda rb=rb: rb.sample(b)) for lib, rb in full.items()}
                    repeats = max(5, args.repeats // 3) if name == "first-fill" else args.repeats
                    timings = measure_round_robin(calls, repeats=repeats, min_block_s=0.02, warmup=2)
                    g, t = timings["gpubuf"].p50, timings["torchrl"].p50
                    row = {"storage": kind, "buffer": buffer, "op": op, "gpubuf_s": g, "torchrl_s": t, "ratio": t / g}
                    rows_out.append(row)
                    print(f"{kind:7s} {buffer:24s} {op:12s} gpubuf {g * 1e6:10.1f} us  torchrl {t * 1e6:10.1f} us  "
                          f"x{t / g:5.2f}", flush=True)
                del full
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"git": sha, "rows": args.rows, "threads": torch.get_num_threads(), "torch": torch.__version__,
                "numba": os.environ.get("GPUBUF_NUMBA", "default"), "huge_pages": args.huge_pages}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
