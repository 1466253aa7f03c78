"""Compressed storages on real Atari frames, side by side with TorchRL, in one run.

Providers, all holding the same transitions (``obs``, ``next_obs`` as stacks of 4 frames of
84x84 uint8, ``action``, ``reward``), each behind its library's ``ReplayBuffer``:

- ``torchrl.CompressedListStorage``: TorchRL's, zlib level 3, one item at a time on the host;
- ``torchrl.LazyTensorStorage``: TorchRL's uncompressed storage;
- ``gpubuf.FrameStackStorage``: the row codec plus frame deduplication;
- ``gpubuf.CompressedTensorStorage``: each stacked row on its own (zstd-3 frames on the host, the row
  codec on CUDA);
- ``gpubuf.LazyTensorStorage``: gpubuf's uncompressed storage.

Flat keys ``obs``/``next_obs`` are used because TorchRL's ``CompressedListStorage`` compresses
top-level tensors only (a nested ``("next", "obs")`` would stay raw there).

Reported: stored bytes per stacked row (one ``[4, 84, 84]`` observation: ``obs`` and
``next_obs`` rows both count) for zlib (each stacked row compressed on its own, as TorchRL
stores them), the codec without deduplication and with it, overall and per game, with ratios;
extend throughput (transitions per second filling the buffer in batches, after a warm-up); sample time for
B = 256 and 4,096 (median of repeats, providers interleaved so that they share the machine's
noise), as wall and CPU time, and speed-ups over TorchRL's compressed storage.

With ``--device cuda`` the gpubuf storages live on the GPU (TorchRL's compressed storage stays a
host codec; its lazy storage goes to the GPU), timings synchronise the device, and the decode
kernel's throughput (decoded bytes per second, ``triton.testing.do_bench`` median) and the
compressed sample against an uncompressed gather of the same batch are measured too.

Frames come from ``scripts/make_atari_frames.py`` (generated on first use when ale-py is
installed)::

    python benchmarks/bench_compressed.py [--frames bench-out/atari_frames.npz] [--rows N]
        [--device cpu|cuda] [--threads 1] [--repeats 7] [--json bench-out/compressed.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
STACKED_ROW = 4 * 84 * 84


# ---------------------------------------------------------------------------------------- data
def load_frames(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        spec = importlib.util.spec_from_file_location("make_atari_frames", ROOT / "scripts" / "make_atari_frames.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        print(f"{path} missing: generating it with ale-py (a few minutes)", flush=True)
        module.main(["--out", str(path)])
    data = np.load(path)
    return {k: data[k] for k in data.files}


def make_transitions(frames: dict[str, np.ndarray], rows: int | None):
    from tensordict import TensorDict

    from gpubuf.ops.match_frames import transition_indices

    obs_i, next_i = transition_indices(frames["episode_start"])
    if rows is not None:
        obs_i, next_i = obs_i[:rows], next_i[:rows]
    pixels = torch.from_numpy(frames["frames"])
    n = len(obs_i)
    td = TensorDict(
        {
            "obs": pixels[torch.from_numpy(obs_i)],
            "next_obs": pixels[torch.from_numpy(next_i)],
            "action": torch.from_numpy(frames["action"][obs_i[:, -1]].astype(np.int64)),
            "reward": torch.from_numpy(frames["reward"][next_i[:, -1]]),
        },
        [n],
    )
    game = frames["game"][obs_i[:, -1]]
    return td, game, [str(g) for g in frames["games"]]


# ---------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    _sync(device)
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    _sync(device)
    return time.perf_counter() - w0, time.process_time() - c0


def summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls = sorted(s[0] for s in samples)
    cpus = sorted(s[1] for s in samples)
    q = lambda xs, p: xs[min(len(xs) - 1, int(round(p * (len(xs) - 1))))]  # noqa: E731
    return {
        "wall_p50": statistics.median(walls),
        "wall_p20": q(walls, 0.2),
        "wall_p80": q(walls, 0.8),
        "cpu_p50": statistics.median(cpus),
        "n": len(samples),
    }


# ---------------------------------------------------------------------------------------- providers
def make_providers(n: int, device: torch.device, which: list[str]):
    import gpubuf
    from gpubuf.storages.codec_storage import CompressedTensorStorage
    from gpubuf.storages.frame_stack import FrameStackStorage

    providers = {}
    if "torchrl-compressed" in which or "torchrl-lazy" in which:
        import torchrl.data as trl
    if "torchrl-compressed" in which:
        providers["torchrl.CompressedListStorage"] = lambda: trl.ReplayBuffer(
            storage=trl.CompressedListStorage(n, compression_level=3), batch_size=256
        )
    if "torchrl-lazy" in which:
        providers["torchrl.LazyTensorStorage"] = lambda: trl.ReplayBuffer(
            storage=trl.LazyTensorStorage(n, device=device), batch_size=256
        )
    if "framestack" in which:
        providers["gpubuf.FrameStackStorage"] = lambda: gpubuf.ReplayBuffer(
            storage=FrameStackStorage(n, stack_keys=["obs", "next_obs"], device=device), batch_size=256
        )
    if "codec" in which:
        providers["gpubuf.CompressedTensorStorage"] = lambda: gpubuf.ReplayBuffer(
            storage=CompressedTensorStorage(n, compress_keys=["obs", "next_obs"], device=device), batch_size=256
        )
    if "gpubuf-lazy" in which:
        providers["gpubuf.LazyTensorStorage"] = lambda: gpubuf.ReplayBuffer(
            storage=gpubuf.LazyTensorStorage(n, device=device), batch_size=256
        )
    return providers


# ---------------------------------------------------------------------------------------- sizes
def zlib_sizes(rb) -> np.ndarray:
    """Compressed bytes of each stored stacked row (obs then next_obs per item) of TorchRL's storage."""
    sizes = []
    for item in rb.storage._storage:
        sizes.append((item["obs"].numel(), item["next_obs"].numel()))
    return np.asarray(sizes, dtype=np.int64)


def zlib_reference(td, rows: int = 2000) -> float:
    """zlib level 3 bytes per stacked row over the first rows, computed directly (cross-check)."""
    obs = td["obs"][:rows].numpy()
    return float(np.mean([len(zlib.compress(obs[i].tobytes(), 3)) for i in range(len(obs))]))


def framestack_bytes_per_game(td, game, names, device) -> dict[str, float]:
    from gpubuf.storages.frame_stack import FrameStackStorage

    out = {}
    for g, name in enumerate(names):
        sel = torch.from_numpy(np.nonzero(game == g)[0])
        if sel.numel() == 0:
            continue
        part = td[sel]
        storage = FrameStackStorage(len(part), stack_keys=["obs", "next_obs"], device=device)
        for i in range(0, len(part), 1024):
            storage._write_rows(i, part[i : i + 1024].to(device))
        out[name] = storage.stats()["stored_bytes"] / (2 * len(part))
    return out


# ---------------------------------------------------------------------------------------- GPU extras
def gpu_decode_metrics(rbs: dict, td, device: torch.device) -> dict:
    """Decode throughput and compressed-vs-uncompressed sample ratio on CUDA (do_bench medians)."""
    from triton.testing import do_bench

    from gpubuf.ops.decode_rows import decode_rows

    out = {}
    fs = rbs.get("gpubuf.FrameStackStorage")
    lazy = rbs.get("gpubuf.LazyTensorStorage")
    for B in (256, 4096):
        index = torch.randint(0, len(td), (B,), device=device)
        if fs is not None:
            storage = fs.storage
            ids = storage._refs.index_select(1, index).reshape(-1)
            table = storage._frames.table()
            decoded = ids.numel() * STACKED_ROW // 4
            ms = do_bench(lambda: decode_rows(table, ids, verify=True, check_bounds=False), quantiles=[0.5])
            ms = ms[0] if isinstance(ms, (list, tuple)) else ms
            out[f"decode_B{B}"] = {"ms": ms, "decoded_TB_per_s": decoded / (ms * 1e-3) / 1e12}
            ms_nv = do_bench(lambda: decode_rows(table, ids, verify=False, check_bounds=False), quantiles=[0.5])
            ms_nv = ms_nv[0] if isinstance(ms_nv, (list, tuple)) else ms_nv
            out[f"decode_B{B}_noverify"] = {"ms": ms_nv, "decoded_TB_per_s": decoded / (ms_nv * 1e-3) / 1e12}
            ms_c = do_bench(lambda: storage._gather(index), quantiles=[0.5])
            ms_c = ms_c[0] if isinstance(ms_c, (list, tuple)) else ms_c
            out[f"framestack_gather_B{B}_ms"] = ms_c
        if lazy is not None:
            ms_u = do_bench(lambda: lazy.storage._gather(index), quantiles=[0.5])
            ms_u = ms_u[0] if isinstance(ms_u, (list, tuple)) else ms_u
            out[f"uncompressed_gather_B{B}_ms"] = ms_u
            if fs is not None:
                out[f"compressed_vs_uncompressed_B{B}"] = ms_u / out[f"framestack_gather_B{B}_ms"]
    return out


# ---------------------------------------------------------------------------------------- main
def environment(device: torch.device, threads: int) -> dict:
    import tensordict

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tensordict": tensordict.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpu_count": __import__("os").cpu_count(),
        "torch_threads": threads,
    }
    for name in ("triton", "torchrl"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # not installed or broken: recorded as absent
            env[name] = None
    from gpubuf.tools.bench.environment import git_sha

    env["git_sha"] = git_sha()
    return env


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=Path, default=ROOT / "bench-out" / "atari_frames.npz")
    parser.add_argument("--rows", type=int, default=None, help="transitions (default: every one in the file)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads for every provider (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="samples per batch size and provider")
    parser.add_argument("--extend-batch", type=int, default=1024, help="transitions per extend call")
    parser.add_argument(
        "--providers",
        default="torchrl-compressed,torchrl-lazy,framestack,codec,gpubuf-lazy",
        help="comma-separated subset of the default",
    )
    parser.add_argument("--no-per-game", action="store_true", help="skip the per-game byte counts")
    parser.add_argument("--json", type=Path, default=ROOT / "bench-out" / "compressed.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    frames = load_frames(args.frames)
    td, game, names = make_transitions(frames, args.rows)
    n = len(td)
    print(f"{n} transitions ({2 * n} stacked rows of 4x84x84 uint8) from {args.frames.name}, games {names}", flush=True)
    result = {"env": environment(device, args.threads), "transitions": n, "sizes": {}, "extend": {}, "sample": {}}

    # Fill every provider, timing the extends. Each library's one-time start-up (imports,
    # compiled kernels loading on first call, first allocations) is paid first on a small
    # throwaway buffer of the same kind, so that the timed fill measures steady-state writes.
    rbs = {}
    data_on = {"cpu": td}
    warm_rows = min(n, 2 * args.extend_batch)
    for name, make in make_providers(warm_rows, device, args.providers.split(",")).items():
        src = td if name == "torchrl.CompressedListStorage" else data_on.setdefault(device.type, td.to(device))
        warm = make()
        for i in range(0, warm_rows, args.extend_batch):
            warm.extend(src[i : i + args.extend_batch])
        warm.sample(min(256, warm_rows))
        del warm
    for name, make in make_providers(n, device, args.providers.split(",")).items():
        rb = make()
        src = td if name == "torchrl.CompressedListStorage" else data_on.setdefault(device.type, td.to(device))
        samples = []
        for i in range(0, n, args.extend_batch):
            part = src[i : i + args.extend_batch]
            samples.append(timed(lambda: rb.extend(part), device))
        wall = sum(s[0] for s in samples)
        cpu = sum(s[1] for s in samples)
        result["extend"][name] = {"wall_s": wall, "cpu_s": cpu, "rows_per_s_wall": n / wall, "rows_per_s_cpu": n / cpu}
        print(f"  extend {name:34s} {n / wall:10.0f} rows/s wall {n / cpu:10.0f} rows/s cpu", flush=True)
        rbs[name] = rb
        gc.collect()

    # Sizes.
    raw = STACKED_ROW
    sizes = {"raw_bytes_per_stacked_row": raw}
    if "torchrl.CompressedListStorage" in rbs:
        z = zlib_sizes(rbs["torchrl.CompressedListStorage"])
        per_row = z.sum() / (2 * n)
        sizes["zlib"] = {"bytes_per_stacked_row": per_row, "ratio": raw / per_row}
        sizes["zlib"]["per_game"] = {
            names[g]: z[game == g].sum() / (2 * int((game == g).sum())) for g in range(len(names)) if (game == g).any()
        }
    sizes["zlib_direct_first_2000_obs"] = zlib_reference(td)
    if "gpubuf.CompressedTensorStorage" in rbs:
        st = rbs["gpubuf.CompressedTensorStorage"].storage.stats()
        per_row = st["stored_bytes"] / (2 * n)
        sizes["codec_without_dedup"] = {"bytes_per_stacked_row": per_row, "ratio": raw / per_row}
    if "gpubuf.FrameStackStorage" in rbs:
        st = rbs["gpubuf.FrameStackStorage"].storage.stats()
        per_row = st["stored_bytes"] / (2 * n)
        sizes["codec_with_dedup"] = {
            "bytes_per_stacked_row": per_row,
            "ratio": raw / per_row,
            "codec_ratio_on_distinct_frames": st["codec_ratio"],
            "dedup_factor": st["dedup"],
            "frames": st["frames"],
            "breakdown_bytes_per_stacked_row": {
                "frame_bytes": st["frame_bytes"] / (2 * n),
                "frame_table": st["frames"] * 20 / (2 * n),
                "references": st["slots"] * 4 / (2 * n),
            },
        }
        if not args.no_per_game:
            sizes["codec_with_dedup"]["per_game"] = framestack_bytes_per_game(td, game, names, device)
    result["sizes"] = sizes

    # Samples, interleaved.
    for B in (256, 4096):
        per = {name: [] for name in rbs}
        for _ in range(args.repeats):
            for name, rb in rbs.items():
                per[name].append(timed(lambda: rb.sample(B), device))
        result["sample"][B] = {name: summary(s) for name, s in per.items()}
        gc.collect()
    base = "torchrl.CompressedListStorage"
    for B, rows in result["sample"].items():
        for name, s in rows.items():
            if base in rows:
                s["speedup_vs_torchrl_compressed_wall"] = rows[base]["wall_p50"] / s["wall_p50"]
                s["speedup_vs_torchrl_compressed_cpu"] = rows[base]["cpu_p50"] / s["cpu_p50"]
    if base in result["extend"]:
        for name, e in result["extend"].items():
            e["speedup_vs_torchrl_compressed_wall"] = e["rows_per_s_wall"] / result["extend"][base]["rows_per_s_wall"]
            e["speedup_vs_torchrl_compressed_cpu"] = e["rows_per_s_cpu"] / result["extend"][base]["rows_per_s_cpu"]
    if device.type == "cuda":
        result["gpu"] = gpu_decode_metrics(rbs, td, device)

    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {args.json}")
    return result


def print_report(result: dict) -> None:
    s = result["sizes"]
    print("\nStored bytes per stacked row (4x84x84 uint8 = 28,224 raw):")
    for key in ("zlib", "codec_without_dedup", "codec_with_dedup"):
        if key in s:
            line = f"  {key:22s} {s[key]['bytes_per_stacked_row']:9.1f} B  ratio {s[key]['ratio']:7.1f}x"
            if "per_game" in s[key]:
                line += "   " + "  ".join(f"{g} {v:.0f}" for g, v in s[key]["per_game"].items())
            print(line)
    if "codec_with_dedup" in s:
        d = s["codec_with_dedup"]
        print(f"  (dedup: {d['dedup_factor']:.2f} slots per stored frame; codec alone on distinct frames {d['codec_ratio_on_distinct_frames']:.1f}x)")
    print("\nExtend (filling the buffer):")
    for name, e in result["extend"].items():
        sp = e.get("speedup_vs_torchrl_compressed_wall")
        print(f"  {name:34s} {e['rows_per_s_wall']:9.0f} rows/s wall  {e['rows_per_s_cpu']:9.0f} cpu" + (f"  x{sp:.1f} / x{e['speedup_vs_torchrl_compressed_cpu']:.1f} vs TorchRL compressed" if sp else ""))
    for B, rows in result["sample"].items():
        print(f"\nSample B={B} (median of {next(iter(rows.values()))['n']}):")
        for name, r in rows.items():
            sp = r.get("speedup_vs_torchrl_compressed_wall")
            print(
                f"  {name:34s} {r['wall_p50'] * 1e3:9.2f} ms wall [{r['wall_p20'] * 1e3:.1f}, {r['wall_p80'] * 1e3:.1f}]  {r['cpu_p50'] * 1e3:9.2f} ms cpu"
                + (f"  x{sp:.1f} / x{r['speedup_vs_torchrl_compressed_cpu']:.1f} vs TorchRL compressed" if sp else "")
            )
    if "gpu" in result:
        print("\nGPU:", json.dumps(result["gpu"], indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
