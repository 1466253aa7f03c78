"""Ray-backed buffers on a local Ray cluster, side by side with TorchRL's ``RayReplayBuffer``.

Providers, each a uniform TensorDict buffer of the same total capacity holding the same
transitions (``obs`` and ``("next", "obs")`` of 32 float32, ``action``, ``reward``, ``done``):

- ``torchrl RayReplayBuffer``: TorchRL's, one actor owning a ``TensorDictReplayBuffer``;
- ``gpubuf RayReplayBuffer``: gpubuf's, one actor owning a gpubuf ``TensorDictReplayBuffer``;
- ``gpubuf Sharded x1`` and ``gpubuf Sharded x4``: :class:`~gpubuf.distributed.ShardedReplayBuffer`
  with 1 and 4 shard actors; ``... prefetch=N`` the same drawing ``N`` batches ahead per request
  to the shards, with the next request in flight (``--prefetch``).

Every actor gets the same ``remote_config`` (no reserved CPU, so that all of them fit the
cluster together). Reported, per provider, as the median over ``--repeats`` rounds (providers
interleaved within a round, so they share the machine's noise): rows inserted per second by
one driver extending ``--extend-batch`` rows at a time, and rows sampled per second by
``--samplers`` driver threads each drawing ``--sample-batch`` rows at a time; with ratios to
TorchRL's. The cluster runs on 127.0.0.1 with ``--cpus`` CPUs (the actors use one torch
thread each, Ray's default; the driver ``--threads``)::

    python benchmarks/bench_ray.py [--rows 200000] [--extend-batch 1024] [--sample-batch 4096]
        [--samplers 1] [--repeats 5] [--prefetch 4] [--threads 1] [--json bench-out/ray.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parents[1]


def make_rows(n: int, start: int = 0) -> TensorDict:
    g = torch.Generator().manual_seed(start)
    return TensorDict(
        {
            "obs": torch.randn(n, 32, generator=g),
            ("next", "obs"): torch.randn(n, 32, generator=g),
            "action": torch.randint(0, 18, (n, 1), generator=g),
            "reward": torch.randn(n, 1, generator=g),
            "done": torch.zeros(n, 1, dtype=torch.bool),
        },
        batch_size=[n],
    )


def start_cluster(cpus: int) -> None:
    # A single-machine cluster: every server on 127.0.0.1 (see tests/distributed/conftest.py).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        object_store_memory=1024**3,
        configure_logging=False,
        log_to_driver=False,
    )


def make_providers(rows: int, sample_batch: int, remote_config: dict, prefetch: int) -> dict:
    from gpubuf import LazyTensorStorage, TensorDictReplayBuffer
    from gpubuf.distributed import RayReplayBuffer, ShardedReplayBuffer

    providers = {}
    try:
        from torchrl.data import LazyTensorStorage as TorchRLLazyTensorStorage
        from torchrl.data import RayReplayBuffer as TorchRLRayReplayBuffer
        from torchrl.data import TensorDictReplayBuffer as TorchRLTensorDictReplayBuffer

        providers["torchrl RayReplayBuffer"] = TorchRLRayReplayBuffer(
            replay_buffer_cls=TorchRLTensorDictReplayBuffer,
            storage=partial(TorchRLLazyTensorStorage, rows),
            batch_size=sample_batch,
            remote_config=remote_config,
        )
    except Exception as err:  # an optional baseline: report why it is missing
        print(f"torchrl RayReplayBuffer unavailable: {type(err).__name__}: {err}", flush=True)
    providers["gpubuf RayReplayBuffer"] = RayReplayBuffer(
        replay_buffer_cls=TensorDictReplayBuffer,
        storage=partial(LazyTensorStorage, rows),
        batch_size=sample_batch,
        remote_config=remote_config,
    )
    for shards, ahead in ((1, None), (4, None), (1, prefetch), (4, prefetch)):
        if ahead == 0:
            continue
        name = f"gpubuf Sharded x{shards}" + (f" prefetch={ahead}" if ahead else "")
        providers[name] = ShardedReplayBuffer(
            num_shards=shards,
            replay_buffer_cls=TensorDictReplayBuffer,
            storage=partial(LazyTensorStorage, rows // shards),
            batch_size=sample_batch,
            remote_config=remote_config,
            seed=shards,
            prefetch=ahead,
        )
    return providers


def fill(rb, data: list[TensorDict]) -> float:
    """Seconds to extend every batch of ``data``, one call after another."""
    t0 = time.perf_counter()
    for part in data:
        rb.extend(part)
    return time.perf_counter() - t0


def draw(rb, samplers: int, calls: int, batch: int) -> float:
    """Seconds for ``samplers`` threads to draw ``calls`` batches each."""

    def one() -> None:
        for _ in range(calls):
            rb.sample(batch)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(samplers) as pool:
        for f in [pool.submit(one) for _ in range(samplers)]:
            f.result()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000, help="total capacity, and rows inserted per round")
    parser.add_argument("--extend-batch", type=int, default=1024)
    parser.add_argument("--sample-batch", type=int, default=4096)
    parser.add_argument("--sample-calls", type=int, default=30, help="sample calls per sampler and round")
    parser.add_argument("--samplers", type=int, default=1, help="driver threads sampling at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--prefetch", type=int, default=4, help="batches drawn ahead by the prefetching providers (0: none)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads of the driver (default 1)")
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2, help="the local cluster's CPUs")
    parser.add_argument("--json", type=Path, default=ROOT / "bench-out" / "ray.json")
    args = parser.parse_args(argv)

    from gpubuf.tools.bench.environment import collect

    # One thread: on a busy 2-core host a multi-threaded gather waits for its slowest thread.
    torch.set_num_threads(args.threads)
    env = collect(torch.device("cpu"))
    start_cluster(args.cpus)
    import ray

    remote_config = {"num_cpus": 0}
    providers = make_providers(args.rows, args.sample_batch, remote_config, args.prefetch)
    batches = [make_rows(args.extend_batch, i) for i in range(0, args.rows, args.extend_batch)]
    inserted = sum(b.batch_size[0] for b in batches)
    for rb in providers.values():  # start-up paid before timing: first calls, first allocations
        rb.extend(batches[0])
        rb.sample(args.sample_batch)
    runs: dict[str, dict[str, list[float]]] = {name: {"insert": [], "sample": []} for name in providers}
    for r in range(args.repeats):
        for name, rb in providers.items():
            runs[name]["insert"].append(inserted / fill(rb, batches))
            sampled = args.samplers * args.sample_calls * args.sample_batch
            runs[name]["sample"].append(sampled / draw(rb, args.samplers, args.sample_calls, args.sample_batch))
        print(f"round {r + 1}/{args.repeats} done", flush=True)

    result = {
        "env": env,
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "remote_config": remote_config,
        "row_bytes": sum(v.element_size() * v[0].numel() for v in batches[0].values(True, True)),
        "providers": {},
    }
    base = "torchrl RayReplayBuffer"
    for name, r in runs.items():
        row = {
            "insert_rows_per_s": statistics.median(r["insert"]),
            "sample_rows_per_s": statistics.median(r["sample"]),
            "insert_runs": r["insert"],
            "sample_runs": r["sample"],
        }
        if base in runs and name != base:
            row["insert_vs_torchrl"] = row["insert_rows_per_s"] / statistics.median(runs[base]["insert"])
            row["sample_vs_torchrl"] = row["sample_rows_per_s"] / statistics.median(runs[base]["sample"])
        result["providers"][name] = row

    for rb in providers.values():
        try:
            rb.close()
        except Exception:  # a provider's own runtime bookkeeping; the cluster goes down next
            pass
    ray.shutdown()

    print(
        f"\n{args.rows} rows of {result['row_bytes']} B; extend {args.extend_batch}, sample {args.sample_batch} x "
        f"{args.samplers} sampler(s); median of {args.repeats}; load average {env.get('load_average')}"
    )
    print(f"{'provider':26s} {'insert rows/s':>14s} {'x torchrl':>9s} {'sample rows/s':>14s} {'x torchrl':>9s}")
    for name, row in result["providers"].items():
        ins = row.get("insert_vs_torchrl")
        smp = row.get("sample_vs_torchrl")
        print(
            f"{name:26s} {row['insert_rows_per_s']:14,.0f} {'' if ins is None else f'{ins:.2f}':>9s} "
            f"{row['sample_rows_per_s']:14,.0f} {'' if smp is None else f'{smp:.2f}':>9s}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
