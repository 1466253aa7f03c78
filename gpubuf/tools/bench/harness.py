"""The side-by-side sweep: every op of a configuration, every provider, one process."""

from __future__ import annotations

import sys
import time
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

import torch

from gpubuf.tools.bench import environment, report, torchrl_compat
from gpubuf.tools.bench.config import BenchConfig
from gpubuf.tools.bench.timing import measure_round_robin
from gpubuf.tools.bench.workloads import (
    ROW_BYTES,
    OpSpec,
    Provider,
    UnavailableProvider,
    default_providers,
    make_transitions,
)

Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    """Prints a progress line to stderr (stdout is kept for the table)."""
    print(f"[gpubuf bench] {message}", file=sys.stderr, flush=True)


def _silent(message: str) -> None:
    pass


def _setup(provider: Provider, data: Any) -> str | None:
    """Builds and fills ``provider``; returns why it is unavailable, or None.

    Only optional providers (TorchRL) turn errors into a reason: an error in gpubuf or in the
    raw floor is a bug and is raised.
    """
    if isinstance(provider, UnavailableProvider):
        return provider.reason
    if not provider.optional:
        provider.setup(data)
        return None
    _, reason = torchrl_compat.attempt(lambda: provider.setup(data), "construction")
    return reason


def _first_call(provider: Provider, op: OpSpec, data: Any) -> tuple[Callable[[], Any] | None, str | None]:
    """Prepares ``op`` for ``provider`` and runs it once, untimed."""

    def prepare() -> Callable[[], Any]:
        call = provider.make_call(op, data)
        call()
        return call

    if not provider.optional:
        return prepare(), None
    return torchrl_compat.attempt(prepare, "first call")


def run_benchmark(
    config: BenchConfig,
    *,
    device: torch.device | str = "cpu",
    ops: Sequence[OpSpec] | None = None,
    include_torchrl: bool = True,
    providers: Sequence[Provider] | None = None,
    progress: Progress | None = stderr_progress,
) -> dict:
    """Runs the sweep and returns the result (see :mod:`gpubuf.tools.bench.report` for its form).

    Args:
        config: sizes and timing budget.
        device: where data, buffers and timing live.
        ops: the ops to run; defaults to every op of ``config``.
        include_torchrl: when False, TorchRL is not imported and its rows say "not requested".
        providers: overrides :func:`~gpubuf.tools.bench.workloads.default_providers` (tests).
        progress: called with one line per step; None for silence.

    Returns:
        ``{"meta": ..., "rows": [...], "ratios": [...], "time_bars": [...]}``.
    """
    say = progress or _silent
    device = torch.device(device)
    ops = list(ops) if ops is not None else config.ops()
    started = time.perf_counter()
    env = environment.collect(device)
    notes: list[str] = []
    contention = environment.contention_note(env)
    if contention:
        notes.append(contention)
    if config.rows != 1_000_000:
        notes.append(f"NOTE: N = {config.rows:,} rows, not the 1,000,000 of the reference workload")
    providers = list(providers) if providers is not None else default_providers(include_torchrl)
    # A provider none of whose op kinds is requested is not built (each holds a copy of the data).
    kinds = {op.kind for op in ops}
    providers = [p for p in providers if kinds.intersection(p.kinds)]

    with torchrl_compat.quiet_logs():
        say(f"generating {config.rows:,} rows ({config.rows * ROW_BYTES / 1e6:.0f} MB) on {device}")
        data = make_transitions(config.rows, device, config.seed)
        reasons: dict[int, str | None] = {}
        for provider in providers:
            say(f"building {provider.label}")
            reasons[id(provider)] = _setup(provider, data)
            if reasons[id(provider)]:
                say(f"  {provider.label} unavailable: {reasons[id(provider)]}")
        rows: list[dict] = []
        try:
            for op in ops:
                rows.extend(_run_op(op, providers, reasons, data, config, device, env, say))
        finally:
            for provider in providers:
                provider.close()

    result = {
        "meta": {
            "config": {
                "name": config.name,
                "rows": config.rows,
                "ops": [{"op": op.kind, "size": op.size} for op in ops],
                "warmup": config.warmup,
                "repeats": config.repeats,
                "min_repeats": config.min_repeats,
                "min_block_s": config.min_block_s,
                "max_op_s": config.max_op_s,
                "seed": config.seed,
            },
            "row_bytes": ROW_BYTES,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": None,
            "notes": notes,
            **env,
        },
        "rows": rows,
        "ratios": report.compute_ratios(rows),
        "time_bars": report.compute_time_bars(rows),
    }
    result["meta"]["wall_s"] = round(time.perf_counter() - started, 2)
    return result


def _run_op(
    op: OpSpec,
    providers: Sequence[Provider],
    reasons: dict[int, str | None],
    data: Any,
    config: BenchConfig,
    device: torch.device,
    env: dict,
    say: Progress,
) -> list[dict]:
    calls: dict[str, Callable[[], Any]] = {}
    failed: dict[int, str] = {}
    providers = [p for p in providers if op.kind in p.kinds]
    for provider in providers:
        reason = reasons[id(provider)]
        if reason:
            failed[id(provider)] = reason
            continue
        call, reason = _first_call(provider, op, data)
        if reason:
            failed[id(provider)] = reason
            say(f"  {provider.label} cannot {op.label}: {reason}")
        else:
            calls[str(id(provider))] = call
    say(f"timing {op.label} ({len(calls)} providers)")
    timings = {} if not calls else measure_round_robin(
        calls,
        device=device,
        warmup=config.warmup,
        repeats=config.repeats,
        min_repeats=config.min_repeats,
        min_block_s=config.min_block_s,
        max_total_s=config.max_op_s,
    )
    rows = []
    summary = []
    for provider in providers:
        if id(provider) in failed:
            rows.append(report.unavailable_row(op, provider, failed[id(provider)], config.rows, env))
            continue
        timing = timings[str(id(provider))]
        rows.append(report.measured_row(op, provider, timing, config.rows, env))
        summary.append(f"{provider.label} {report.format_time(timing.p50)}")
    say(f"  {op.label}: " + ", ".join(summary))
    return rows


__all__ = ["run_benchmark", "stderr_progress"]
