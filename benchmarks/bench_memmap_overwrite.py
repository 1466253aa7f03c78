"""Wrap-around extends into a full memory-mapped buffer, gpubuf and TorchRL side by side.

Each library fills a ``LazyMemmapStorage`` of ``N`` rows of 277 B in a scratch directory on disk,
then extends ``N`` more rows, ``--repeats`` times, the libraries alternating call by call. With
``--sync`` every extend follows ``os.sync()``: the rows it overwrites have been written back, as
a ring buffer's rows are a lap after they were written. Without it the pages are still dirty from
the fill.

    python benchmarks/bench_memmap_overwrite.py [--rows 1048576] [--repeats 6] [--sync] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch

import gpubuf
from gpubuf.tools.bench.environment import collect
from gpubuf.tools.bench.scale import _fill, make_chunk
from gpubuf.tools.bench.torchrl_compat import load_torchrl_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--sync", action="store_true", help="os.sync() before every extend")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chunk = make_chunk("wide", args.rows)
    libraries = {"gpubuf": gpubuf, "torchrl": load_torchrl_data()}
    scratch = tempfile.mkdtemp(prefix="memmap_overwrite_", dir=os.getcwd())  # on disk, not /dev/shm
    try:
        buffers = {}
        for name, ns in libraries.items():
            rb = ns.TensorDictReplayBuffer(storage=ns.LazyMemmapStorage(args.rows, scratch_dir=f"{scratch}/{name}"))
            _fill(rb, args.rows, chunk)
            buffers[name] = rb
        seconds: dict[str, list[float]] = {name: [] for name in buffers}
        for r in range(args.repeats):
            for name in list(buffers) if r % 2 == 0 else list(buffers)[::-1]:
                if args.sync:
                    os.sync()
                start = time.perf_counter()
                buffers[name].extend(chunk)
                seconds[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(times) for name, times in seconds.items()}
        ratio = medians["torchrl"] / medians["gpubuf"]
        print(f"extend {args.rows:,} rows into full ({'written back' if args.sync else 'dirty'}): gpubuf "
              f"{medians['gpubuf'] * 1e3:.1f} ms, torchrl {medians['torchrl'] * 1e3:.1f} ms, x{ratio:.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": collect(torch.device("cpu")), "rows": args.rows, "sync": args.sync,
                           "seconds": seconds, "median_s": medians, "speedup": ratio}, f, indent=1, default=str)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
