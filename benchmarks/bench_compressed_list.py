"""``CompressedListStorage`` with its default arguments, gpubuf's beside TorchRL's, on real Atari frames.

One run of each library's ``ReplayBuffer(storage=CompressedListStorage(max_size=rows))``: one
``extend`` of ``rows`` stacked transitions (``obs`` and ``next_obs`` as stacks of 4 frames of
84x84 uint8, ``action``, ``reward``), then ``samples`` samples of ``batch`` rows. Reported per
provider: the time of extend plus samples (median over ``repeats`` runs, providers interleaved so
that they share the machine's noise), its parts, stored bytes per row (``storage.bytes()`` over the
rows: both stacked leaves and the small ones), and a bit-exact check of every sampled batch
against the written rows. gpubuf runs one small untimed warm-up first (its compiled kernels load
from Numba's cache or compile there).

Frames come from ``scripts/make_atari_frames.py`` (see ``bench_compressed.py``)::

    python benchmarks/bench_compressed_list.py [--frames bench-out/atari_frames.npz] [--rows 3000]
        [--batch 256] [--samples 5] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_compressed import environment, load_frames, make_transitions  # noqa: E402


def providers():
    import torchrl.data as trl

    import gpubuf

    return {
        "torchrl.CompressedListStorage": (trl.ReplayBuffer, trl.CompressedListStorage),
        "gpubuf.CompressedListStorage": (gpubuf.ReplayBuffer, gpubuf.CompressedListStorage),
    }


def run_once(buffer_cls, storage_cls, td, batch: int, samples: int, seed: int) -> dict:
    torch.manual_seed(seed)
    storage = storage_cls(max_size=td.shape[0])
    rb = buffer_cls(storage=storage, batch_size=batch)
    t0 = time.perf_counter()
    rb.extend(td)
    t1 = time.perf_counter()
    drawn = [rb.sample(return_info=True) for _ in range(samples)]
    t2 = time.perf_counter()
    exact = True
    for data, info in drawn:
        want = td[torch.as_tensor(info["index"]).reshape(-1)]
        exact &= all(torch.equal(data[k], want[k]) for k in want.keys())
    return {
        "total_s": t2 - t0,
        "extend_s": t1 - t0,
        "sample_s": t2 - t1,
        "bytes_per_row": storage.bytes() / td.shape[0],
        "exact": bool(exact),
        "mode": getattr(storage, "mode", None),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=Path, default=ROOT / "bench-out" / "atari_frames.npz")
    parser.add_argument("--rows", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    td, _, _ = make_transitions(load_frames(args.frames), args.rows)
    which = providers()
    warm = time.perf_counter()
    run_once(*which["gpubuf.CompressedListStorage"], td[:64], 16, 1, seed=0)
    warm = time.perf_counter() - warm

    runs: dict[str, list[dict]] = {name: [] for name in which}
    for r in range(args.repeats):
        for name, (buffer_cls, storage_cls) in which.items():
            runs[name].append(run_once(buffer_cls, storage_cls, td, args.batch, args.samples, seed=r))

    result = {
        "benchmark": "compressed_list",
        "rows": int(td.shape[0]),
        "batch": args.batch,
        "samples": args.samples,
        "repeats": args.repeats,
        "gpubuf_warmup_s": warm,
        "environment": environment(torch.device("cpu"), torch.get_num_threads()),
        # Idle OpenMP workers spin (ACTIVE, libgomp's default for a while) or sleep (PASSIVE): on a
        # busy machine with few cores, spinning workers delay every small parallel torch op.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "providers": {},
    }
    for name, rs in runs.items():
        result["providers"][name] = {
            "total_s": statistics.median(r["total_s"] for r in rs),
            "extend_s": statistics.median(r["extend_s"] for r in rs),
            "sample_s": statistics.median(r["sample_s"] for r in rs),
            "bytes_per_row": rs[-1]["bytes_per_row"],
            "exact": all(r["exact"] for r in rs),
            "mode": rs[-1]["mode"],
            "runs_total_s": [r["total_s"] for r in rs],
        }
    ours = result["providers"]["gpubuf.CompressedListStorage"]
    theirs = result["providers"]["torchrl.CompressedListStorage"]
    result["speedup"] = theirs["total_s"] / ours["total_s"]
    result["bytes_ratio"] = ours["bytes_per_row"] / theirs["bytes_per_row"]

    print(f"{result['rows']} rows, extend + {args.samples} samples of {args.batch}, median of {args.repeats}")
    print(f"{'provider':32s} {'total s':>9s} {'extend s':>9s} {'sample s':>9s} {'B/row':>8s}  exact  mode")
    for name, p in result["providers"].items():
        print(
            f"{name:32s} {p['total_s']:9.4f} {p['extend_s']:9.4f} {p['sample_s']:9.4f} {p['bytes_per_row']:8.0f}"
            f"  {str(p['exact']):5s}  {p['mode']}"
        )
    print(f"speed-up {result['speedup']:.1f}x; bytes per row {result['bytes_ratio']:.2f}x TorchRL's")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
