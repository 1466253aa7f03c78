"""Trajectory slices, gpubuf's ``SliceSampler`` side by side with TorchRL's, in one run.

Each provider is a ``TensorDictReplayBuffer`` over a ``LazyTensorStorage`` of ``N`` rows
holding the same transitions (``obs`` of 4 float32, ``episode`` ids, ``("next", "done")``
flags; episodes of 20 to 2,000 steps), filled once. A sample is 32 slices of 32 steps (a batch
of 1,024 rows, gathered), through ``rb.sample()``, with the boundaries read from ``traj_key``
and from ``end_key``:

- ``gpubuf``: boundaries kept up to date by the writes; the first sample after the fill reads
  the rows written (reported apart, as ``index build``), the following ones do not;
- ``torchrl``: TorchRL's ``SliceSampler`` as it ships (``cache_values=False``: it scans the
  whole id or done column at every sample);
- ``torchrl-cache``: with ``cache_values=True`` (the scan is kept until the next write).

Reported per N: the median (and p20/p80) of the sample time of each provider (providers
interleaved so that they share the machine's noise), TorchRL's time over gpubuf's, and
gpubuf's time at the largest N over the smallest (flat in N when close to 1)::

    python benchmarks/bench_slice.py [--sizes 1000000 10000000] [--repeats 30] [--threads 1]
        [--device cpu|cuda] [--json benchmarks/results/cpu-2core/slice-<date>.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parents[1]
NUM_SLICES, SLICE_LEN = 32, 32


def transitions(n: int, seed: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 2001, (n // 20 + 1,), generator=g)
    episode = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)[:n]
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[:-1, 0] = episode[1:] != episode[:-1]
    return TensorDict(
        {"obs": torch.randn(n, 4, generator=g), "episode": episode, ("next", "done"): done},
        [n],
    )


def make(provider: str, key: str, n: int, device: str):
    if provider == "gpubuf":
        import gpubuf as lib

        kwargs = {}
    else:
        import torchrl.data as lib

        kwargs = {"cache_values": provider == "torchrl-cache"}
    boundary = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")}
    sampler = lib.SliceSampler(num_slices=NUM_SLICES, **boundary, **kwargs)
    return lib.TensorDictReplayBuffer(
        storage=lib.LazyTensorStorage(n, device=device), sampler=sampler, batch_size=NUM_SLICES * SLICE_LEN
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    return {"p50_s": statistics.median(ordered), "p20_s": at(0.2), "p80_s": at(0.8), "n": len(ordered)}


def run(sizes: list[int], repeats: int, device: str) -> dict:
    providers = ["gpubuf", "torchrl", "torchrl-cache"]
    results: dict = {"rows": [], "ratios": [], "flat": []}
    # Compiled CPU helpers (the gather's prefetch) compile on first use: not part of any timing.
    for key in ("traj_key", "end_key"):
        warm = make("gpubuf", key, 4096, device)
        warm.extend(transitions(4096).to(device))
        warm.sample()
    gpubuf_p50: dict = {}
    for n in sizes:
        data = transitions(n).to(device)
        for key in ("traj_key", "end_key"):
            buffers = {}
            for provider in providers:
                rb = make(provider, key, n, device)
                rb.extend(data)
                buffers[provider] = rb
            build = timed(lambda: buffers["gpubuf"].sample(), device)  # reads the N rows written
            for provider in providers[1:]:
                buffers[provider].sample()  # warm-up (TorchRL's cache fills here)
            times: dict = {p: [] for p in providers}
            # TorchRL's uncached sampler rescans N rows per call: fewer repeats at large N.
            slow_repeats = max(3, min(repeats, int(repeats * 1_000_000 / n)))
            for r in range(repeats):
                for provider in providers:
                    if provider == "torchrl" and r >= slow_repeats:
                        continue
                    times[provider].append(timed(buffers[provider].sample, device))
            row_stats = {p: quantiles(t) for p, t in times.items()}
            for provider in providers:
                results["rows"].append(
                    {
                        "op": f"slice_sample[{key}]",
                        "provider": provider,
                        "rows": n,
                        "num_slices": NUM_SLICES,
                        "slice_len": SLICE_LEN,
                        **row_stats[provider],
                        "items_per_s": NUM_SLICES * SLICE_LEN / row_stats[provider]["p50_s"],
                    }
                )
            results["rows"].append(
                {"op": f"index_build[{key}]", "provider": "gpubuf", "rows": n, "first_sample_s": build, "ns_per_row": build / n * 1e9}
            )
            ours = row_stats["gpubuf"]["p50_s"]
            gpubuf_p50[(key, n)] = ours
            for provider in providers[1:]:
                ratio = row_stats[provider]["p50_s"] / ours
                results["ratios"].append({"key": key, "rows": n, "versus": provider, "speedup": ratio})
                print(
                    f"N={n:>10,} {key:9s} gpubuf {ours * 1e6:9.1f} us   {provider:14s} "
                    f"{row_stats[provider]['p50_s'] * 1e6:11.1f} us   x{ratio:8.1f}",
                    flush=True,
                )
            print(f"N={n:>10,} {key:9s} gpubuf index build (first sample after the fill): {build * 1e3:.1f} ms", flush=True)
            del buffers
            gc.collect()
        del data
        gc.collect()
    if len(sizes) > 1:
        small, large = min(sizes), max(sizes)
        for key in ("traj_key", "end_key"):
            growth = gpubuf_p50[(key, large)] / gpubuf_p50[(key, small)]
            results["flat"].append({"key": key, "rows_small": small, "rows_large": large, "time_ratio": growth})
            print(f"gpubuf {key}: N={large:,} takes x{growth:.2f} the time of N={small:,}", flush=True)
    return results


def environment(device: str) -> dict:
    import tensordict
    import torchrl

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sha = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "torchrl": torchrl.__version__,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "cpu_count": __import__("os").cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_sha": sha,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "kernels"))
    results = run(args.sizes, args.repeats, args.device)
    results["env"] = environment(args.device)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
