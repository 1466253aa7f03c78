"""The ``gpubuf bench`` subcommand: its arguments and what it does with them."""

from __future__ import annotations

import argparse
from datetime import datetime
from pathlib import Path

DEFAULT_OUT = "bench-out"


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Adds ``bench`` to the ``gpubuf`` command's subparsers."""
    parser = subparsers.add_parser(
        "bench",
        help="time gpubuf against TorchRL and raw torch on the replay workloads",
        description=(
            "Times extend (chunks of 1,000 and 100,000 rows), uniform sample (B = 256 and 65,536) and the "
            "prioritized cycle (sample + gather + weights + priority update; B = 256, and 65,536 with --full) "
            "on a full buffer of N rows {obs: f32[32], action: f32[4], reward: f32[1], done: bool[1], "
            "next_obs: f32[32]}, for gpubuf, TorchRL (when installed) and raw torch, interleaved in one "
            "process. Prints a table and writes <out>/bench-<device>-<timestamp>.json and .png."
        ),
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--quick", dest="config", action="store_const", const="quick", help="short timing (default)")
    length.add_argument("--full", dest="config", action="store_const", const="full", help="long timing")
    parser.set_defaults(config="quick")
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT}/)")
    parser.add_argument("--no-torchrl", action="store_true", help="do not import or time TorchRL")
    parser.add_argument(
        "--ops",
        nargs="+",
        metavar="OP",
        help=(
            "ops to run: extend, sample, cycle, draw, update, or one size such as extend:100000, sample:256, "
            "cycle:65536 or update:65536 (draw and update time the prioritized sampler alone; default: those of "
            "--quick or --full)"
        ),
    )
    parser.add_argument("--rows", type=int, help="override N, the buffer's rows (printed as a note)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default on CPU: 1, steadier when other processes share the cores; "
        "on CUDA: torch's own choice)",
    )
    scale = parser.add_argument_group(
        "scaling sweep (--scale)",
        "time against the buffer's rows N, gpubuf and TorchRL side by side (see gpubuf.tools.bench.scale)",
    )
    scale.add_argument("--scale", action="store_true", help="run the scaling sweep instead of the workload table")
    scale.add_argument("--sizes", default="1M,4M,16M,64M", help="rows of the sweep (default: 1M,4M,16M,64M; M = 2^20)")
    scale.add_argument(
        "--memmap-sizes", default="128M", help="further rows for the memory-mapped storage alone (default: 128M; '' for none)"
    )
    scale.add_argument(
        "--workloads", default="fill,memmap,checkpoint,prioritized",
        help="of fill, memmap, checkpoint, prioritized (default: all)",
    )
    scale.add_argument("--row-kind", choices=("small", "wide"), default="small", help="48 B rows (small) or 277 B (wide)")
    scale.add_argument("--batch", type=int, default=65_536, help="sample / update batch (default: 65536)")
    scale.add_argument("--repeat", type=int, default=7, help="timed calls of a sample / update / cycle (median kept)")
    scale.add_argument("--prioritized-max", default="16M", help="largest N of the prioritized rows (default: 16M)")
    scale.add_argument("--ckpt-tensor-max", default="16M", help="largest N of the in-memory checkpoint round trip")
    scale.add_argument("--ckpt-repeat", type=int, default=1, help="round trips per checkpoint measurement (medians)")
    scale.add_argument("--scratch", help="directory for memmap files and checkpoints (default: the temp dir)")
    parser.set_defaults(func=run)
    return parser


def run_scale(args: argparse.Namespace) -> int:
    """The ``--scale`` sweep: prints its table and writes ``<out>/scale-<timestamp>.json`` and ``.png``."""
    import torch

    from gpubuf.tools.bench import scale
    from gpubuf.tools.bench.harness import stderr_progress

    try:
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip())
        unknown = set(workloads) - set(scale.WORKLOADS)
        if unknown:
            raise ValueError(f"unknown workloads {sorted(unknown)}; expected some of {list(scale.WORKLOADS)}")
        config = scale.ScaleConfig(
            sizes=tuple(scale.iter_sizes(args.sizes)),
            memmap_sizes=tuple(scale.iter_sizes(args.memmap_sizes)),
            workloads=workloads,
            kind=args.row_kind,
            batch=args.batch,
            repeat=args.repeat,
            prioritized_max=scale.parse_size(args.prioritized_max),
            ckpt_tensor_max=scale.parse_size(args.ckpt_tensor_max),
            scratch=args.scratch,
            ckpt_repeat=args.ckpt_repeat,
            libraries=("gpubuf",) if args.no_torchrl else ("gpubuf", "torchrl"),
        )
        if not config.sizes or min(args.batch, args.repeat, args.ckpt_repeat) <= 0:
            raise ValueError("--sizes needs at least one size; --batch, --repeat and --ckpt-repeat must be positive")
    except ValueError as err:
        return _fail(str(err))
    if args.threads is not None:
        if args.threads <= 0:
            return _fail(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    stem = Path(args.out) / f"scale-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    result = scale.run_scale(config, progress=stderr_progress, partial=lambda r: scale.write_json(r, stem.with_suffix(".json")))
    print(scale.format_table(result), flush=True)
    stderr_progress(f"wrote {scale.write_json(result, stem.with_suffix('.json'))}")
    try:
        stderr_progress(f"wrote {scale.write_plot(result, stem.with_suffix('.png'))}")
    except ImportError as err:
        stderr_progress(f"no plot: {err} (pip install matplotlib)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark described by parsed ``args``; returns the exit status."""
    if args.scale:
        return run_scale(args)
    # Imported here so that `gpubuf --help` and other subcommands do not pay for them.
    import torch

    from gpubuf.tools.bench import environment, report
    from gpubuf.tools.bench.config import CONFIGS, parse_ops
    from gpubuf.tools.bench.harness import run_benchmark, stderr_progress

    config = CONFIGS[args.config]
    if args.rows is not None:
        if args.rows <= 0:
            return _fail(f"--rows must be positive, got {args.rows}")
        config = config.with_rows(args.rows)
    try:
        device = environment.resolve_device(args.device)
        ops = parse_ops(args.ops, config)
    except ValueError as err:
        return _fail(str(err))
    threads = args.threads
    if threads is None and device.type == "cpu":
        # Multi-threaded CPU ops stall whenever another process holds a core (their threads wait
        # for each other), which turns side-by-side ratios into scheduler noise; one thread per
        # provider keeps the comparison about the code.
        threads = 1
    if threads is not None:
        if threads <= 0:
            return _fail(f"--threads must be positive, got {threads}")
        torch.set_num_threads(threads)

    result = run_benchmark(config, device=device, ops=ops, include_torchrl=not args.no_torchrl, progress=stderr_progress)
    print(report.format_table(result), flush=True)

    stem = Path(args.out) / f"bench-{device.type}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    json_path = report.write_json(result, stem.with_suffix(".json"))
    stderr_progress(f"wrote {json_path}")
    try:
        png_path = report.write_plot(result, stem.with_suffix(".png"))
    except ImportError as err:
        # matplotlib is an optional extra ("gpubuf[bench]"); the JSON and the table stand alone.
        stderr_progress(f"no plot: {err} (pip install matplotlib)")
    else:
        stderr_progress(f"wrote {png_path}")
    return 0


def _fail(message: str) -> int:
    import sys

    print(f"gpubuf bench: error: {message}", file=sys.stderr)
    return 2


__all__ = ["DEFAULT_OUT", "register", "run", "run_scale"]
