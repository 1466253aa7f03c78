"""Prioritized replay against the buffer's size: fill, ``update_priority`` and the cycle at N = 1M .. 64M.

gpubuf's ``TensorDictPrioritizedReplayBuffer`` and TorchRL's side by side in one process, on rows of
48 bytes (``obs: f32[11]``, ``reward: f32``): for each N, both buffers are filled to N in chunks
of 1M rows (the fill is timed), then ``update_priority`` of B random indices and the cycle
(``sample(B)``, new ``td_error``, ``update_tensordict_priority``) are timed at B = 256 and 65,536,
the two libraries' calls interleaved, median of the repeats. Memory stays bounded: one N at a time,
both buffers freed before the next. Each library first runs one small fill, update and cycle, so
that one-time loads (gpubuf's compiled kernels from Numba's cache) are not timed as part of a fill.

    PYTHONPATH=$PWD:$PWD/kernels python benchmarks/scale_prioritized.py --rows 1M 16M 64M \
        --out benchmarks/results/cpu-2core/scale-prioritized.json

Prints a table of times and gpubuf's speed-up (TorchRL's time / gpubuf's), and the resident memory
each buffer adds per stored row once full, and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict

import gpubuf

ALPHA, BETA, EPS = 0.7, 0.5, 1e-8
CHUNK = 1 << 20
BATCHES = (256, 65_536)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _rows(n: int, gen: torch.Generator) -> TensorDict:
    return TensorDict(
        {"obs": torch.randn(n, 11, generator=gen), "reward": torch.randn(n, generator=gen)},
        batch_size=[n],
    )


def _build(ns: Any, rows: int) -> Any:
    return ns.TensorDictPrioritizedReplayBuffer(
        alpha=ALPHA, beta=BETA, eps=EPS, storage=ns.LazyTensorStorage(rows), priority_key="td_error"
    )


def _fill(rb: Any, rows: int, gen: torch.Generator) -> float:
    chunk = _rows(min(CHUNK, rows), gen)
    start = time.perf_counter()
    for _ in range(0, rows, CHUNK):
        rb.extend(chunk)
    return time.perf_counter() - start


def _update(rb: Any, rows: int, b: int) -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(b)
    pool = [(torch.randint(0, rows, (b,), generator=gen), torch.rand(b, generator=gen) + 0.01) for _ in range(4)]
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % len(pool)
        index, priority = pool[state["i"]]
        return rb.update_priority(index, priority)

    return call


def _cycle(rb: Any, b: int) -> Callable[[], Any]:
    gen = torch.Generator().manual_seed(b + 1)
    pool = [torch.rand(b, generator=gen) + 0.01 for _ in range(4)]
    state = {"i": 0}

    def call() -> Any:
        state["i"] = (state["i"] + 1) % len(pool)
        batch = rb.sample(b)
        batch.set("td_error", pool[state["i"]])
        rb.update_tensordict_priority(batch)
        return batch

    return call


def _interleaved(calls: dict[str, Callable[[], Any]], repeats: int, min_block_s: float) -> dict[str, float]:
    """Median seconds per call of each callable, timed in alternating blocks of at least ``min_block_s``.

    On a shared machine a short block can fall into another job's time slice; longer blocks
    average that out, for both libraries alike.
    """
    for fn in calls.values():
        for _ in range(2):
            fn()
    numbers = {}
    for name, fn in calls.items():
        start = time.perf_counter()
        fn()
        once = time.perf_counter() - start
        numbers[name] = max(1, int(min_block_s / max(once, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start = time.perf_counter()
            for _ in range(numbers[name]):
                fn()
            times[name].append((time.perf_counter() - start) / numbers[name])
    return {name: statistics.median(t) for name, t in times.items()}


def _resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``), in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _warm_up(libraries: dict[str, Any]) -> None:
    """One small fill, update and cycle per library before anything is timed.

    The first call of each library loads what it loads lazily (gpubuf its compiled CPU kernels
    from Numba's cache, about a second here); the sweep times steady-state calls, not that.
    """
    gen = torch.Generator().manual_seed(1)
    for ns in libraries.values():
        rb = _build(ns, 1 << 12)
        _fill(rb, 1 << 12, gen)
        _update(rb, 1 << 12, 256)()
        _cycle(rb, 256)()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["1M", "16M", "64M"], help="buffer sizes (1M, 16M, 64M, ...)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--min-block", type=float, default=0.1, help="seconds of calls per timed block (short calls repeat)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    import torchrl.data as trl

    results = []
    _warm_up({"gpubuf": gpubuf, "torchrl": trl})
    for rows in map(_size, args.rows):
        gen = torch.Generator().manual_seed(0)
        buffers, fills, resident = {}, {}, {}
        for name, ns in (("gpubuf", gpubuf), ("torchrl", trl)):
            # Resident memory the buffer adds, built and full (rows, priorities and any index the
            # library keeps), per stored row; the fill's source chunk is freed by then.
            before = _resident_bytes()
            buffers[name] = _build(ns, rows)
            fills[name] = _fill(buffers[name], rows, gen)
            gc.collect()
            resident[name] = (_resident_bytes() - before) / rows
        results.append({"op": "fill", "rows": rows, "batch": CHUNK, **{f"{k}_s": v for k, v in fills.items()}})
        results.append({"op": "memory", "rows": rows, **{f"{k}_bytes_per_row": v for k, v in resident.items()}})
        print(
            f"{'memory':>16} N={rows:>10,}  gpubuf {resident['gpubuf']:6.1f} B/row  torchrl {resident['torchrl']:6.1f} B/row",
            flush=True,
        )
        for b in BATCHES:
            for op, make in (("update_priority", lambda rb: _update(rb, rows, b)), ("cycle", lambda rb: _cycle(rb, b))):
                med = _interleaved({name: make(rb) for name, rb in buffers.items()}, args.repeats, args.min_block)
                results.append({"op": op, "rows": rows, "batch": b, **{f"{k}_s": v for k, v in med.items()}})
        for row in [r for r in results[-6:] if r["op"] != "memory"]:
            ratio = row["torchrl_s"] / row["gpubuf_s"]
            print(
                f"{row['op']:>16} N={row['rows']:>10,} B={row['batch']:>8,}  gpubuf {row['gpubuf_s'] * 1e3:9.3f} ms"
                f"  torchrl {row['torchrl_s'] * 1e3:9.3f} ms  speed-up {ratio:5.2f}x",
                flush=True,
            )
        del buffers
        gc.collect()
    if args.out is not None:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        import torchrl

        meta = {
            "machine": platform.processor() or platform.machine(),
            "torch_threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "torchrl": torchrl.__version__, "gpubuf": gpubuf.__version__},
            "git_sha": sha,
            "row_bytes": 48,
            "command": "python benchmarks/scale_prioritized.py --rows " + " ".join(args.rows),
            "repeats": args.repeats,
            "min_block_s": args.min_block,
            "warm_up": "one fill of 4,096 rows, update and cycle of 256 per library before the sweep",
        }
        for row in results:
            if row["op"] == "memory":
                row["torchrl_over_gpubuf"] = row["torchrl_bytes_per_row"] / row["gpubuf_bytes_per_row"]
            else:
                row["speedup"] = row["torchrl_s"] / row["gpubuf_s"]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
