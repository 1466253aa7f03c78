"""Profiling sessions: one workload under ``torch.profiler``, a chrome trace, a table per call.

A session builds one workload (a filled buffer and the call to repeat), then

1. times ``steps`` calls without the profiler, for the wall time per call (the profiler's own
   overhead would inflate it);
2. runs ``steps`` more calls under ``torch.profiler`` (CPU, plus CUDA when the workload runs
   there), each inside a ``record_function("gpubuf::<workload>")`` range, and writes the
   chrome trace to ``profiling/out/`` (open it in ``chrome://tracing`` or Perfetto);
3. prints the top ops and kernels by self time, with calls per step, and the host overhead per
   call: the wall time per call minus the device time per call.

Device time per call is the self time of CUDA kernels and copies on a GPU. On a CPU, where the
torch twins are the kernels, it is the self time of ``aten::`` ops: the host overhead is then
everything else (Python, dispatch, TensorDict construction).

Used by ``profiling/profile_*.py`` and by ``gpubuf profile WORKLOAD`` (:func:`register`, or
:func:`add_profile_parser` and :func:`run_profile`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from gpubuf.ops.device_work import DeviceWork, count_device_work
from gpubuf.tools.bench.environment import resolve_device

__all__ = [
    "OpRow",
    "ProfileConfig",
    "ProfileResult",
    "WORKLOADS",
    "Workload",
    "add_profile_parser",
    "format_table",
    "main",
    "profile_workload",
    "register",
    "run_profile",
]

#: Where traces go by default: ``profiling/out`` under the current directory.
DEFAULT_OUT_DIR = Path("profiling") / "out"


# ------------------------------------------------------------------------------------------
# Workloads
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileConfig:
    """What one session runs.

    Attributes:
        workload: a key of :data:`WORKLOADS`.
        device: where the buffer (and so the work) lives.
        rows: buffer capacity ``N``; the buffer is filled before profiling.
        batch_size: rows per call (sample batch, or extend chunk).
        steps: calls timed, and calls profiled.
        warmup: untimed calls first (allocator, Triton compilation, caches).
        row_kind: ``"transition"`` (292 B rows) or ``"frames"`` (84x84x4 uint8).
        out_dir: where the chrome trace is written (created if missing).
        top: rows of the printed table.
        seed: seed of the data and of the buffer's generator.
        trace: write the chrome trace.
        backend: the buffer's backend (``"triton"`` takes the device path on any device).
    """

    workload: str
    device: torch.device = torch.device("cpu")
    rows: int = 100_000
    batch_size: int = 4_096
    steps: int = 20
    warmup: int = 3
    row_kind: str = "transition"
    out_dir: Path = DEFAULT_OUT_DIR
    top: int = 15
    seed: int = 0
    trace: bool = True
    backend: str = "auto"


@dataclass(frozen=True)
class Workload:
    """A named workload.

    Attributes:
        name: the CLI name.
        description: one line for ``--help``.
        build: ``config -> step``, a no-argument callable doing one call; built outside the
            profiler (buffer creation and filling are not profiled).
        unavailable: ``config -> reason`` or None when it can run.
    """

    name: str
    description: str
    build: Callable[[ProfileConfig], Callable[[], Any]]
    unavailable: Callable[[ProfileConfig], str | None] = lambda config: None


def filled_buffer(config: ProfileConfig, cls_name: str = "TensorDictReplayBuffer", **kwargs: Any) -> tuple[Any, Any]:
    import gpubuf
    from gpubuf.tools.synthetic import make_rows

    data = make_rows(config.row_kind, config.rows, config.device, seed=config.seed)
    storage = gpubuf.LazyTensorStorage(config.rows, device=kwargs.pop("storage_device", config.device))
    generator = torch.Generator(device=storage.device).manual_seed(config.seed)
    rb = getattr(gpubuf, cls_name)(storage=storage, generator=generator, backend=config.backend, **kwargs)
    chunk = 100_000
    for start in range(0, config.rows, chunk):
        rb.extend(data[start : start + chunk])
    return rb, data


def _build_sample(config: ProfileConfig) -> Callable[[], Any]:
    rb, _ = filled_buffer(config)
    size = config.batch_size
    return lambda: rb.sample(size)


def _build_sample_prefetch(config: ProfileConfig) -> Callable[[], Any]:
    rb, _ = filled_buffer(config, batch_size=config.batch_size, prefetch=2)
    return rb.sample


def _build_sample_h2d(config: ProfileConfig) -> Callable[[], Any]:
    rb, _ = filled_buffer(config, storage_device="cpu", batch_size=config.batch_size, prefetch=2,
                           batch_device=config.device)
    return rb.sample


def _build_extend(config: ProfileConfig) -> Callable[[], Any]:
    rb, data = filled_buffer(config)
    if config.batch_size > config.rows:
        raise ValueError(f"extend chunk {config.batch_size} exceeds the buffer's {config.rows} rows")
    chunk = data[: config.batch_size]
    return lambda: rb.extend(chunk)


def _build_gather(config: ProfileConfig) -> Callable[[], Any]:
    from gpubuf.ops.gather_rows import gather_rows

    rb, _ = filled_buffer(config, cls_name="ReplayBuffer")
    leaves = list(rb.storage._flat_leaves)
    gen = torch.Generator(device=config.device).manual_seed(config.seed)
    index = torch.randint(0, config.rows, (config.batch_size,), generator=gen, device=config.device)
    return lambda: gather_rows(leaves, index, check_bounds=False)


def _build_prioritized(config: ProfileConfig) -> Callable[[], Any]:
    rb, _ = filled_buffer(config, cls_name="TensorDictPrioritizedReplayBuffer", alpha=0.7, beta=0.5)
    size = config.batch_size
    gen = torch.Generator(device=config.device).manual_seed(config.seed + 1)

    def cycle() -> Any:
        # One learner step's worth of replay work: sample, then write back new TD errors.
        batch = rb.sample(size)
        batch.set("td_error", torch.rand(size, generator=gen, device=config.device))
        rb.update_tensordict_priority(batch)
        return batch

    return cycle


def _needs_cuda(config: ProfileConfig) -> str | None:
    if config.device.type != "cuda":
        return "profiles a host storage with CUDA batches: run with --device cuda on a machine with a GPU"
    return None


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("sample", "uniform sample of B rows (TensorDictReplayBuffer, LazyTensorStorage)", _build_sample),
        Workload("extend", "extend a full buffer by a chunk of B rows (round robin)", _build_extend),
        Workload("prioritized", "prioritized cycle: sample B rows, then update their priorities", _build_prioritized),
        Workload("sample-prefetch", "uniform sample with prefetch=2", _build_sample_prefetch),
        Workload("sample-h2d", "host storage, CUDA batches (pinned staging, side stream, prefetch=2)",
                 _build_sample_h2d, _needs_cuda),
        Workload("gather", "the fused row gather alone, fixed index, every leaf of the storage", _build_gather),
    )
}


# ------------------------------------------------------------------------------------------
# The session
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpRow:
    """One line of the table: an op (host) or a kernel (device), per profiled step.

    Attributes:
        name: op or kernel name.
        kind: ``"kernel"`` (device activity), ``"op"`` (a host op) or ``"range"`` (a
            ``record_function`` range; its self time is the host time outside torch ops).
        calls_per_step: calls per workload call.
        self_host_us: self host time per step, microseconds.
        self_device_us: self device time per step, microseconds (on a CPU, an ``aten::`` op's
            self time: the twins' ops are the CPU's kernels).
    """

    name: str
    kind: str
    calls_per_step: float
    self_host_us: float
    self_device_us: float


@dataclass
class ProfileResult:
    """The outcome of a session (all times per workload call).

    Attributes:
        config: the session's configuration.
        wall_s: wall time per call, measured without the profiler.
        device_s: device time per call (see the module docstring for the CPU meaning).
        host_overhead_s: ``wall_s - device_s``, at least 0.
        profiled_wall_s: wall time per call under the profiler.
        profiled_host_overhead_s: ``profiled_wall_s - device_s``, at least 0: both from the same
            run (so noise on a shared machine hits both alike), profiler overhead included.
        range_self_s: self time of the workload's range per call under the profiler: host time
            spent outside any torch op (Python, TensorDict, dispatch), profiler included.
        ops: the table's rows, heaviest first.
        trace_path: the chrome trace, or None when not written.
        work: launches and host syncs of one call (:func:`gpubuf.ops.device_work.count_device_work`
            on the workload's device; on a CPU every aten op counts as a launch).
    """

    config: ProfileConfig
    wall_s: float
    device_s: float
    host_overhead_s: float
    profiled_wall_s: float
    profiled_host_overhead_s: float
    range_self_s: float
    ops: list[OpRow] = field(default_factory=list)
    trace_path: Path | None = None
    work: DeviceWork | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trace_path(config: ProfileConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(config.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{config.workload}-{config.row_kind}-{config.device.type}-B{config.batch_size}-{stamp}.json"
    n = 1
    while path.exists():
        path = path.with_name(f"{path.stem}-{n}.json")
        n += 1
    return path


def profile_workload(config: ProfileConfig) -> ProfileResult:
    """Runs one profiling session (see the module docstring).

    Args:
        config: what to run.

    Returns:
        The :class:`ProfileResult`; the trace file is written under ``config.out_dir``.

    Raises:
        KeyError: an unknown workload.
        RuntimeError: the workload cannot run here (the message says why).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    workload = WORKLOADS[config.workload]
    reason = workload.unavailable(config)
    if reason:
        raise RuntimeError(f"workload {config.workload!r} cannot run: {reason}")
    if config.steps < 1:
        raise ValueError(f"steps must be >= 1, got {config.steps}")
    device = config.device
    step = workload.build(config)
    for _ in range(config.warmup):
        step()
    _sync(device)

    start = time.perf_counter()
    for _ in range(config.steps):
        step()
    _sync(device)
    wall = (time.perf_counter() - start) / config.steps
    with count_device_work(device) as work:
        step()
    _sync(device)

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    label = f"gpubuf::{config.workload}"
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(config.steps):
            with record_function(label):
                step()
        _sync(device)
        profiled_wall = (time.perf_counter() - start) / config.steps

    trace_path = None
    if config.trace:
        trace_path = _trace_path(config)
        prof.export_chrome_trace(str(trace_path))

    ops, device_us, range_us = _summarize(prof.key_averages(), config.steps, label, cuda=device.type == "cuda")
    device_s = device_us / 1e6
    return ProfileResult(
        config=config,
        wall_s=wall,
        device_s=device_s,
        host_overhead_s=max(wall - device_s, 0.0),
        profiled_wall_s=profiled_wall,
        profiled_host_overhead_s=max(profiled_wall - device_s, 0.0),
        range_self_s=range_us / 1e6,
        ops=ops,
        trace_path=trace_path,
        work=work,
    )


def _summarize(averages: Any, steps: int, label: str, *, cuda: bool) -> tuple[list[OpRow], float, float]:
    """Table rows, device microseconds per step, and the range's self host microseconds per step."""
    rows = []
    device_us = 0.0
    range_us = 0.0
    for event in averages:
        is_kernel = event.device_type != torch.autograd.DeviceType.CPU
        self_host = event.self_cpu_time_total / steps
        self_device = event.self_device_time_total / steps if is_kernel else 0.0
        if event.key == label:
            if not is_kernel:  # the range's device-side mirror on CUDA carries no time of its own
                range_us += self_host
                rows.append(OpRow(event.key, "range", event.count / steps, self_host, 0.0))
            continue
        if getattr(event, "is_user_annotation", False):
            if cuda or not event.key.startswith("gpubuf::"):
                continue  # other ranges (ProfilerStep, user annotations) would double count
            # A compiled CPU kernel's range (it runs no aten op): its self time is device time,
            # as an aten op's is on the CPU.
            rows.append(OpRow(event.key, "kernel", event.count / steps, self_host, self_host))
            device_us += self_host
            continue
        if is_kernel:
            kind = "kernel"
            device_us += self_device
        else:
            kind = "op"
            if not cuda and event.key.startswith("aten::"):
                # On the CPU the twins' aten ops are the kernels: their self time is device time.
                self_device = self_host
                device_us += self_host
        rows.append(OpRow(event.key, kind, event.count / steps, self_host, self_device))
    weight = (lambda r: (r.self_device_us, r.self_host_us)) if cuda else (lambda r: (r.self_host_us, 0.0))
    rows.sort(key=weight, reverse=True)
    return rows, device_us, range_us


def format_table(result: ProfileResult, top: int | None = None) -> str:
    """The session's report: a table of the top ops and kernels, then the per-call summary."""
    config = result.config
    top = config.top if top is None else top
    name_width = 60
    lines = [
        f"gpubuf profile: {config.workload} ({WORKLOADS[config.workload].description})",
        f"device {config.device}, rows {config.row_kind} x {config.rows:,}, B = {config.batch_size:,}, "
        f"{config.steps} steps",
        "",
        f"{'name':<{name_width}} {'kind':<6} {'calls/step':>10} {'self host us':>13} {'self device us':>15}",
        "-" * (name_width + 48),
    ]
    for row in result.ops[:top]:
        name = row.name if len(row.name) <= name_width else row.name[: name_width - 3] + "..."
        lines.append(
            f"{name:<{name_width}} {row.kind:<6} {row.calls_per_step:>10.2f} {row.self_host_us:>13.1f} "
            f"{row.self_device_us:>15.1f}"
        )
    if len(result.ops) > top:
        lines.append(f"... {len(result.ops) - top} more (see the trace)")
    device_what = "CUDA kernels and copies" if config.device.type == "cuda" else "aten ops (the torch twins)"
    lines += [
        "",
        f"wall time per call       {result.wall_s * 1e6:12.1f} us   (without the profiler)",
        f"device time per call     {result.device_s * 1e6:12.1f} us   ({device_what})",
        f"host overhead per call   {result.host_overhead_s * 1e6:12.1f} us   (wall - device)",
        f"under the profiler       {result.profiled_wall_s * 1e6:12.1f} us per call: host overhead "
        f"{result.profiled_host_overhead_s * 1e6:.1f} us, of which {result.range_self_s * 1e6:.1f} us "
        "outside torch ops",
    ]
    if result.work is not None:
        work = result.work
        lines.append(
            f"device work per call     {work.launches:12d} launches ({work.triton_launches} Triton, "
            f"{work.torch_ops} torch ops), {work.host_syncs} host syncs"
        )
    if result.trace_path is not None:
        lines.append(f"chrome trace             {result.trace_path}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Command line: `gpubuf profile WORKLOAD` and python -m gpubuf.tools.profile
# ------------------------------------------------------------------------------------------


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    names = ", ".join(f"{w.name} ({w.description})" for w in WORKLOADS.values())
    parser.add_argument("workload", choices=sorted(WORKLOADS), metavar="WORKLOAD", help=f"one of: {names}")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda or cuda:N")
    parser.add_argument("--rows", type=int, default=ProfileConfig.rows, help="buffer capacity N (filled first)")
    parser.add_argument("--batch-size", "-B", type=int, default=ProfileConfig.batch_size, help="rows per call")
    parser.add_argument("--steps", type=int, default=ProfileConfig.steps, help="calls timed and profiled")
    parser.add_argument("--warmup", type=int, default=ProfileConfig.warmup, help="untimed calls first")
    parser.add_argument("--row-kind", default="transition", choices=("transition", "frames"),
                        help="transition: 292 B rows of 10 fields; frames: 84x84x4 uint8")
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where the chrome trace goes")
    parser.add_argument("--top", type=int, default=ProfileConfig.top, help="rows of the table")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-trace", action="store_true", help="do not write the chrome trace")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default on CPU: 1, as gpubuf bench; on CUDA: torch's own choice)",
    )
    return parser


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds ``profile`` to a ``gpubuf`` subparsers object; its ``func`` is :func:`run_profile`."""
    parser = subparsers.add_parser(
        "profile",
        help="run one workload under torch.profiler: chrome trace + table of kernels and host overhead",
        description=__doc__.split("\n\n")[0],
    )
    _configure(parser)
    parser.set_defaults(func=run_profile)
    return parser


#: The ``register(subparsers)`` entry point that ``gpubuf.tools.cli`` expects of a subcommand module.
register = add_profile_parser


def run_profile(args: argparse.Namespace) -> int:
    """Runs the session described by parsed arguments and prints its table.

    Returns:
        0 on success, 2 when the workload cannot run here (the reason is printed).
    """
    try:
        device = resolve_device(args.device)
        threads = args.threads if args.threads is not None else (1 if device.type == "cpu" else None)
        if threads is not None:
            if threads <= 0:
                raise ValueError(f"--threads must be positive, got {threads}")
            # Multi-threaded CPU ops stall when another process holds a core; one thread keeps
            # the table about the code, not the scheduler.
            torch.set_num_threads(threads)
        config = ProfileConfig(
            workload=args.workload,
            device=device,
            rows=args.rows,
            batch_size=args.batch_size,
            steps=args.steps,
            warmup=args.warmup,
            row_kind=args.row_kind,
            out_dir=Path(args.out_dir),
            top=args.top,
            seed=args.seed,
            trace=not args.no_trace,
        )
        result = profile_workload(config)
    except (RuntimeError, ValueError) as err:
        print(f"gpubuf profile: {err}")
        return 2
    print(format_table(result))
    return 0


def main(argv: Sequence[str] | None = None, *, defaults: dict | None = None) -> int:
    """``python -m gpubuf.tools.profile WORKLOAD [options]`` (and the ``profiling/`` scripts)."""
    parser = _configure(argparse.ArgumentParser(prog="gpubuf-profile", description=__doc__.split("\n\n")[0]))
    if defaults:
        parser.set_defaults(**defaults)
    return run_profile(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
