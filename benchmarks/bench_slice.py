"""Trajectory slices, gpubuf's ``SliceSampler`` and ``PrioritizedSliceSampler`` side by side with TorchRL's, in one run.

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

The ``slice_cycle`` rows time what an online learner does at every step with ``SliceSampler``:
write 1,024 new steps (episodes continuing from one write to the next, into the full buffer), then
sample. gpubuf brings its boundaries up to date with the rows written; TorchRL's cache, when on, is
dropped by every write, so both of its rows scan the whole column at every step. The
``prioritized_slice_cycle`` rows do the same with ``PrioritizedSliceSampler`` and then set the
sampled steps' priorities (the batch's ``"index"``).

The prioritized rows (``prioritized_slice_sample``) run each library's ``PrioritizedSliceSampler``
(``alpha=0.7``, ``beta=0.5``, every step at priority 1 but one in 64 at 4) the same way, and the
``slice_sample_without_replacement`` rows each library's ``SliceSamplerWithoutReplacement`` (whose
boundaries TorchRL always caches: no ``torchrl-cache`` row).

Reported per N: the median (and p20/p80) of the sample time of each provider (providers
interleaved round robin, the order rotated from one round to the next and Python's collector paused,
as :func:`gpubuf.tools.bench.timing.measure_round_robin` times them), TorchRL's time over gpubuf's, and
gpubuf's time at the largest N over the smallest (flat in N when close to 1: the two gpubuf
buffers timed round robin together, see :func:`flatness`). On CUDA also
``gpubuf-graph`` for ``SliceSampler`` and ``PrioritizedSliceSampler``: the same sample captured
once in a CUDA graph and replayed (no host sync on the device path makes that possible;
TorchRL's samplers read the device on the host and cannot be captured)::

    python benchmarks/bench_slice.py [--sizes 1000000 10000000] [--repeats 30] [--threads N]
        [--samplers slice prioritized without cycle pcycle] [--device cpu|cuda]
        [--json benchmarks/results/cpu-2core/slice-<date>.json]

``--threads`` sets torch's thread count for both libraries; without it each runs with torch's
default (the machine's cores).
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

from gpubuf.tools.bench.timing import measure_round_robin

ROOT = Path(__file__).resolve().parents[1]
NUM_SLICES, SLICE_LEN = 32, 32
#: Steps a write of the cycle rows adds, and how many different writes they cycle through.
CYCLE_ROWS, CYCLE_WRITES = 1024, 64
OPS = {"slice": "slice_sample", "prioritized": "prioritized_slice_sample",
       "without": "slice_sample_without_replacement", "cycle": "slice_cycle",
       "pcycle": "prioritized_slice_cycle"}
#: The sampler of each kind (the cycles' are the samples').
SAMPLER_OF = {"cycle": "slice", "pcycle": "prioritized"}


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


def make(provider: str, key: str, n: int, device: str, kind: str = "slice"):
    kind = SAMPLER_OF.get(kind, kind)
    if provider == "gpubuf":
        import gpubuf as lib

        kwargs = {}
    else:
        import torchrl.data as lib

        kwargs = {"cache_values": provider == "torchrl-cache"}
    boundary = {"traj_key": "episode"} if key == "traj_key" else {"end_key": ("next", "done")}
    if kind == "prioritized":
        sampler = lib.PrioritizedSliceSampler(n, alpha=0.7, beta=0.5, num_slices=NUM_SLICES, **boundary, **kwargs)
    elif kind == "without":
        sampler = lib.SliceSamplerWithoutReplacement(num_slices=NUM_SLICES, **boundary)
    else:
        sampler = lib.SliceSampler(num_slices=NUM_SLICES, **boundary, **kwargs)
    return lib.TensorDictReplayBuffer(
        storage=lib.LazyTensorStorage(n, device=device), sampler=sampler, batch_size=NUM_SLICES * SLICE_LEN
    )


def writes(device: str) -> list[TensorDict]:
    """The cycle rows' writes: ``CYCLE_WRITES`` consecutive pieces of one stream of steps whose ids
    follow every stored one (episodes of 20 to 2,000 steps running from one piece into the next)."""
    stream = transitions(CYCLE_ROWS * CYCLE_WRITES, seed=1)
    stream["episode"] += 10**9
    return [piece.to(device) for piece in stream.split(CYCLE_ROWS)]


def workload(rb, kind: str, pieces: list[TensorDict]):
    """What a timed call runs: ``rb.sample``, or for the cycle rows the next write then a sample
    (and for the prioritized cycle, priorities for the sampled steps)."""
    if kind not in SAMPLER_OF:
        return rb.sample
    step = iter(range(1 << 62))
    priorities = torch.linspace(0.5, 2.0, NUM_SLICES * SLICE_LEN, device=pieces[0].device)

    def cycle():
        rb.extend(pieces[next(step) % len(pieces)])
        batch = rb.sample()
        if kind == "pcycle":
            rb.update_priority(batch["index"], priorities)
        return batch

    return cycle


def fill(rb, data: TensorDict, kind: str) -> None:
    """Writes ``data``; a prioritized buffer then gets one step in 64 at priority 4."""
    rb.extend(data)
    if SAMPLER_OF.get(kind, kind) == "prioritized":
        index = torch.arange(0, data.shape[0], 64)
        rb.update_priority(index, torch.full((index.shape[0],), 4.0))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def captured(rb):
    """``rb.sample`` captured in a CUDA graph after a warm-up on a side stream; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            rb.sample()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rb.sample()
    return graph.replay


def quantiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]

    return {"p50_s": statistics.median(ordered), "p20_s": at(0.2), "p80_s": at(0.8), "n": len(ordered)}


def run(sizes: list[int], repeats: int, device: str, kinds: list[str]) -> dict:
    providers = ["gpubuf", "torchrl", "torchrl-cache"]
    results: dict = {"rows": [], "ratios": [], "flat": []}
    pieces = writes(device) if set(kinds) & set(SAMPLER_OF) else []
    # Compiled CPU kernels (the window draws) compile on first use: not part of any timing.
    for kind in kinds:
        for key in ("traj_key", "end_key"):
            warm = make("gpubuf", key, 4096, device, kind)
            fill(warm, transitions(4096).to(device), kind)
            warm.sample()
    gpubuf_p50: dict = {}
    for n in sizes:
        data = transitions(n).to(device)
        for kind in kinds:
            op = OPS[kind]
            for key in ("traj_key", "end_key"):
                buffers = {}
                for provider in providers if kind != "without" else providers[:2]:
                    try:
                        rb = make(provider, key, n, device, kind)
                        fill(rb, data, kind)
                        if provider != "gpubuf":
                            rb.sample()  # warm-up (TorchRL's cache fills here)
                    except Exception as err:  # noqa: BLE001 - a baseline that cannot run here is reported, not fatal
                        if provider == "gpubuf":
                            raise
                        print(f"{op:24s} N={n:>10,} {key:9s} {provider}: cannot run here: {err!r:.200}", flush=True)
                        results["rows"].append({"op": f"{op}[{key}]", "provider": provider, "rows": n, "error": repr(err)})
                        continue
                    buffers[provider] = rb
                build = timed(lambda: buffers["gpubuf"].sample(), device)  # reads the N rows written
                running = [p for p in providers if p in buffers]
                # Round robin in a rotated order with the collector paused (the house's timing
                # helper): no provider always runs right after the same other one.
                timings = measure_round_robin({p: workload(buffers[p], kind, pieces) for p in running}, device=device,
                                              warmup=0, repeats=repeats)
                row_stats = {p: quantiles(t.samples) for p, t in timings.items()}
                # A replay repeats the captured launches: it cannot move an epoch kept on the host,
                # so the sampler without replacement gets no graph row.
                if device.startswith("cuda") and kind in ("slice", "prioritized"):
                    try:
                        replay = captured(buffers["gpubuf"])
                        graph_stats = quantiles([timed(replay, device) for _ in range(repeats)])
                    except Exception as err:  # noqa: BLE001 - reported, the other rows stand
                        print(f"{op:24s} N={n:>10,} {key:9s} gpubuf-graph: cannot capture: {err!r:.200}", flush=True)
                        results["rows"].append({"op": f"{op}[{key}]", "provider": "gpubuf-graph", "rows": n,
                                                "error": repr(err)})
                    else:
                        results["rows"].append({"op": f"{op}[{key}]", "provider": "gpubuf-graph", "rows": n,
                                                "num_slices": NUM_SLICES, "slice_len": SLICE_LEN, **graph_stats})
                        print(f"{op:24s} N={n:>10,} {key:9s} gpubuf-graph {graph_stats['p50_s'] * 1e6:9.1f} us "
                              "(one CUDA graph replay)", flush=True)
                for provider in running:
                    results["rows"].append(
                        {
                            "op": f"{op}[{key}]",
                            "provider": provider,
                            "rows": n,
                            "num_slices": NUM_SLICES,
                            "slice_len": SLICE_LEN,
                            **row_stats[provider],
                            "items_per_s": NUM_SLICES * SLICE_LEN / row_stats[provider]["p50_s"],
                        }
                    )
                results["rows"].append(
                    {"op": f"index_build[{op}][{key}]", "provider": "gpubuf", "rows": n, "first_sample_s": build,
                     "ns_per_row": build / n * 1e9}
                )
                ours = row_stats["gpubuf"]["p50_s"]
                gpubuf_p50[(op, key, n)] = ours
                for provider in running[1:]:
                    ratio = row_stats[provider]["p50_s"] / ours
                    results["ratios"].append({"op": op, "key": key, "rows": n, "versus": provider, "speedup": ratio})
                    print(
                        f"{op:24s} N={n:>10,} {key:9s} gpubuf {ours * 1e6:9.1f} us   {provider:14s} "
                        f"{row_stats[provider]['p50_s'] * 1e6:11.1f} us   x{ratio:8.1f}",
                        flush=True,
                    )
                print(f"{op:24s} N={n:>10,} {key:9s} gpubuf index build (first sample after the fill): "
                      f"{build * 1e3:.1f} ms", flush=True)
                del buffers
                gc.collect()
        del data
        gc.collect()
    if len(sizes) > 1:
        results["flat"] = flatness(min(sizes), max(sizes), repeats, device, kinds, gpubuf_p50, pieces)
    return results


def flatness(small: int, large: int, repeats: int, device: str, kinds: list[str], p50: dict,
             pieces: list[TensorDict]) -> list[dict]:
    """gpubuf's sample at ``large`` rows over its sample at ``small`` rows, the two buffers timed
    round robin in the same process: each call follows a gpubuf call, so the ratio is the
    sample's own growth with N. (The per-N rows above follow TorchRL's calls, whose scan at
    10M evicts ten times what it does at 1M: their ratio, also reported, says how much of a
    neighbour's cache damage each sample pays, not how the sample scales.)"""
    rows = []
    data = {n: transitions(n).to(device) for n in (small, large)}
    for kind in kinds:
        op = OPS[kind]
        for key in ("traj_key", "end_key"):
            buffers = {}
            for n in (small, large):
                rb = buffers[n] = make("gpubuf", key, n, device, kind)
                fill(rb, data[n], kind)
                rb.sample()  # reads the rows written
            timings = measure_round_robin({n: workload(rb, kind, pieces) for n, rb in buffers.items()}, device=device,
                                          warmup=3, repeats=repeats)
            paired = timings[large].p50 / timings[small].p50
            after_torchrl = p50[(op, key, large)] / p50[(op, key, small)]
            rows.append({"op": op, "key": key, "rows_small": small, "rows_large": large, "time_ratio": paired,
                         "small_p50_s": timings[small].p50, "large_p50_s": timings[large].p50,
                         "time_ratio_after_torchrl": after_torchrl})
            print(f"gpubuf {op} {key}: N={large:,} takes x{paired:.2f} the time of N={small:,} "
                  f"({timings[large].p50 * 1e6:.1f} against {timings[small].p50 * 1e6:.1f} us, timed together; "
                  f"x{after_torchrl:.2f} in the rows above, each after TorchRL's calls)", flush=True)
            del buffers
            gc.collect()
    return rows


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
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--samplers", nargs="+", choices=list(OPS), default=list(OPS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "kernels"))
    results = run(args.sizes, args.repeats, args.device, args.samplers)
    results["env"] = environment(args.device)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
