"""The gather benchmark: sampled rows per second as GB/s, next to the device's copy bandwidth.

Two ops, three providers, measured in one process, interleaved round robin:

- ``gather``: rows ``index`` (fixed, uniform, with duplicates) of every field of a filled
  storage. gpubuf: the storage's sample-path gather (one fused Triton launch on CUDA, the twin's
  ``index_select`` per field on CPU); raw: ``index_select`` per field; TorchRL: its storage's
  ``get(index)``.
- ``sample``: a whole ``sample(B)``: draw and gather. gpubuf and TorchRL:
  ``TensorDictReplayBuffer(storage=LazyTensorStorage(N)).sample(B)``; raw: ``randint`` then
  ``index_select`` per field (the floor).

for two row kinds (:mod:`gpubuf.tools.synthetic`): 292-byte transitions and 84x84x4 uint8 frames
(28,224 bytes), at ``B`` = 256, 4,096 and 65,536.

GB/s counts payload bytes read plus written, ``2 * B * row_bytes`` per call, the same for every
provider. The copy bandwidth is ``dst.copy_(src)`` of a large buffer on the same device in the
same run (``2 * nbytes`` per call): memory-bound ops are judged against it.

Run: ``python -m gpubuf.tools.bench_gather [--device cpu] [--quick] [--json out.json]``; the
harness calls :func:`run_gather_benchmark` and :func:`format_report`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

__all__ = [
    "GatherBenchConfig",
    "format_report",
    "main",
    "measure_copy_bandwidth",
    "run_gather_benchmark",
]

OPS = ("gather", "sample")
PROVIDERS = ("gpubuf", "raw", "torchrl")

#: (op, kind, B) -> bars on the CPU, as (baseline, max ratio of gpubuf's time to the baseline's).
CPU_BARS = {
    ("sample", "transition", 65_536): (("raw", 1.3), ("torchrl", 1 / 1.5)),
}


@dataclass(frozen=True)
class GatherBenchConfig:
    """What the benchmark runs.

    Attributes:
        device: where storages and batches live.
        kinds: row kinds (``"transition"``, ``"frames"``).
        batches: sample sizes ``B``.
        rows: kind -> buffer capacity ``N`` (filled before timing). Defaults: 1,000,000
            transitions; frames 100,000 on CUDA (2.8 GB) and 16,384 on CPU (460 MB).
        ops: ``"gather"`` and/or ``"sample"``.
        include_torchrl: False reports TorchRL as not requested, without importing it.
        warmup, repeats, min_repeats, min_block_s, max_op_s: timing, see
            :func:`gpubuf.tools.bench.timing.measure_round_robin` (``max_op_s`` per op).
        copy_bytes: size of the copy-bandwidth buffer.
        seed: data and index seed.
    """

    device: torch.device
    kinds: tuple[str, ...] = ("transition", "frames")
    batches: tuple[int, ...] = (256, 4_096, 65_536)
    rows: dict[str, int] = field(default_factory=dict)
    ops: tuple[str, ...] = OPS
    include_torchrl: bool = True
    warmup: int = 2
    repeats: int = 15
    min_repeats: int = 3
    min_block_s: float = 0.01
    max_op_s: float = 20.0
    copy_bytes: int | None = None
    seed: int = 0

    def rows_for(self, kind: str) -> int:
        if kind in self.rows:
            return self.rows[kind]
        if kind == "frames":
            return 100_000 if self.device.type == "cuda" else 16_384
        return 1_000_000


def _timer(device: torch.device, **kwargs: Any) -> Callable[[dict], dict]:
    from gpubuf.tools.bench.timing import measure_round_robin

    return lambda calls: measure_round_robin(calls, device=device, **kwargs)


def measure_copy_bandwidth(device: torch.device, nbytes: int | None = None, repeats: int = 10) -> dict[str, float]:
    """The device's copy bandwidth: ``dst.copy_(src)`` of ``nbytes``, counted as read + written.

    Args:
        device: where both buffers live.
        nbytes: buffer size; default 1 GiB on CUDA, 256 MiB on CPU (well past the caches).
        repeats: timed blocks (the median is reported).

    Returns:
        ``{"bytes", "p50_s", "gb_per_s"}``.
    """
    from gpubuf.tools.bench.timing import measure_round_robin

    if nbytes is None:
        nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = measure_round_robin({"copy": lambda: dst.copy_(src)}, device=device, warmup=2, repeats=repeats)["copy"]
    return {"bytes": nbytes, "p50_s": timing.p50, "gb_per_s": 2 * nbytes / timing.p50 / 1e9}


# ------------------------------------------------------------------------------------------
# Providers: built (and filled) once per row kind; then (index, B) -> {op: callable}
# ------------------------------------------------------------------------------------------

Calls = Callable[[torch.Tensor, int], dict[str, Callable[[], Any]]]


def _gpubuf_provider(data: Any) -> Calls:
    import gpubuf

    n = data.batch_size[0]
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(n, device=data.device))
    _fill(rb, data)
    storage = rb.storage
    # The sample path's gather skips the stored "index" leaf (TensorDictReplayBuffer fills it
    # from the sampler's index): the same fields as raw and TorchRL move.
    skip = storage.layout.index_of(("index",))
    return lambda index, batch: {"gather": lambda: storage._gather(index, skip), "sample": lambda: rb.sample(batch)}


def _raw_provider(data: Any) -> Calls:
    fields = [data[key] for key in data.keys()]
    n = data.batch_size[0]
    device = data.device

    def calls(index: torch.Tensor, batch: int) -> dict[str, Callable[[], Any]]:
        def sample() -> list[torch.Tensor]:
            idx = torch.randint(0, n, (batch,), device=device)
            return [torch.index_select(f, 0, idx) for f in fields]

        return {"gather": lambda: [torch.index_select(f, 0, index) for f in fields], "sample": sample}

    return calls


def _torchrl_provider(data: Any) -> Calls:
    from gpubuf.tools.bench import torchrl_compat

    with torchrl_compat.quiet_logs():
        trl = torchrl_compat.namespace()
        n = data.batch_size[0]
        rb = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(n, device=data.device))
        _fill(rb, data)
    storage = rb.storage
    return lambda index, batch: {"gather": lambda: storage.get(index), "sample": lambda: rb.sample(batch)}


_BUILDERS = {"gpubuf": _gpubuf_provider, "raw": _raw_provider, "torchrl": _torchrl_provider}


def _fill(rb: Any, data: Any) -> None:
    n = data.batch_size[0]
    for start in range(0, n, 100_000):
        # A shallow copy: TensorDictReplayBuffer.extend may write "index" into what it is given.
        rb.extend(data[start : start + 100_000].clone(recurse=False))


# ------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------


def run_gather_benchmark(config: GatherBenchConfig) -> dict[str, Any]:
    """Runs every (kind, B, op) for every provider, plus the copy bandwidth.

    Returns:
        ``{"meta": {...}, "copy": {...}, "rows": [...], "ratios": [...]}``. A row: ``op``,
        ``kind``, ``row_bytes``, ``buffer_rows``, ``batch``, ``provider``, ``status`` (``"ok"``
        or ``"unavailable"``), ``reason``, ``p50_s``/``p20_s``/``p80_s``, ``gb_per_s``,
        ``items_per_s``, ``copy_fraction`` (GB/s over the copy bandwidth). A ratio: gpubuf's
        median time over a baseline's (below 1: gpubuf is faster), with the bar where one
        applies.
    """
    from gpubuf.tools.bench import environment, torchrl_compat
    from gpubuf.tools.synthetic import make_rows, row_bytes

    device = config.device
    timer = _timer(
        device,
        warmup=config.warmup,
        repeats=config.repeats,
        min_repeats=config.min_repeats,
        min_block_s=config.min_block_s,
        max_total_s=config.max_op_s,
    )
    copy = measure_copy_bandwidth(device, config.copy_bytes)
    rows: list[dict[str, Any]] = []
    for kind in config.kinds:
        n = config.rows_for(kind)
        data = make_rows(kind, n, device, seed=config.seed)
        nbytes = row_bytes(kind)
        built: dict[str, Calls] = {}
        reasons: dict[str, str] = {}
        for name in PROVIDERS:
            if name == "torchrl" and not config.include_torchrl:
                reasons[name] = "not requested"
            elif name == "torchrl":
                made, reason = torchrl_compat.attempt(lambda data=data: _torchrl_provider(data), "construction")
                if reason is None:
                    built[name] = made
                else:
                    reasons[name] = reason
            else:
                built[name] = _BUILDERS[name](data)
        for batch in config.batches:
            gen = torch.Generator(device=device).manual_seed(config.seed + batch)
            index = torch.randint(0, n, (batch,), generator=gen, device=device)
            providers: dict[str, dict[str, Callable]] = {}
            for name, make in built.items():
                calls = make(index, batch)
                if name == "torchrl":
                    # An optional provider that fails on its first call is reported, not raised.
                    reason = None
                    for op in config.ops:
                        _, reason = torchrl_compat.attempt(calls[op], f"first {op}")
                        if reason:
                            break
                    if reason is not None:
                        reasons[name] = reason
                        continue
                providers[name] = calls
            for op in config.ops:
                with torchrl_compat.quiet_logs():
                    timings = timer({name: calls[op] for name, calls in providers.items()})
                for name in PROVIDERS:
                    row = {
                        "op": op,
                        "kind": kind,
                        "row_bytes": nbytes,
                        "buffer_rows": n,
                        "batch": batch,
                        "provider": name,
                        "device": str(device),
                    }
                    if name in timings:
                        t = timings[name]
                        moved = 2 * batch * nbytes
                        gbps = moved / t.p50 / 1e9
                        row.update(
                            status="ok",
                            reason=None,
                            p50_s=t.p50,
                            p20_s=t.p20,
                            p80_s=t.p80,
                            repeats=t.repeats,
                            gb_per_s=gbps,
                            items_per_s=batch / t.p50,
                            copy_fraction=gbps / copy["gb_per_s"],
                        )
                    else:
                        row.update(status="unavailable", reason=reasons.get(name, "failed"))
                    rows.append(row)
            del providers
            reasons.pop("torchrl", None) if "torchrl" in built else None
        del built, data
    return {
        "meta": {"config": _config_dict(config), **environment.collect(device), "load_average": _load()},
        "copy": copy,
        "rows": rows,
        "ratios": _ratios(rows, device),
    }


def _load() -> list[float] | None:
    # CPU timings on a shared machine mean little without it: other processes' threads take
    # the cores that torch's intra-op threads wait on.
    import os

    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _config_dict(config: GatherBenchConfig) -> dict[str, Any]:
    out = asdict(config)
    out["device"] = str(config.device)
    out["rows"] = {kind: config.rows_for(kind) for kind in config.kinds}
    return out


def _ratios(rows: list[dict], device: torch.device) -> list[dict[str, Any]]:
    by_key = {(r["op"], r["kind"], r["batch"], r["provider"]): r for r in rows}
    out = []
    for (op, kind, batch, provider), row in by_key.items():
        if provider != "gpubuf" or row["status"] != "ok":
            continue
        bars = dict(CPU_BARS.get((op, kind, batch), ())) if device.type == "cpu" else {}
        for baseline in ("raw", "torchrl"):
            other = by_key.get((op, kind, batch, baseline))
            entry = {"op": op, "kind": kind, "batch": batch, "baseline": baseline}
            if other is None or other["status"] != "ok":
                entry.update(ratio=None, reason=None if other is None else other["reason"])
            else:
                entry.update(ratio=row["p50_s"] / other["p50_s"], reason=None)
            if baseline in bars:
                limit = bars[baseline]
                entry["bar_max_ratio"] = limit
                entry["meets_bar"] = None if entry["ratio"] is None else entry["ratio"] <= limit
            out.append(entry)
    return out


def format_report(result: dict[str, Any]) -> str:
    """A printable report: the copy bandwidth, one table per op, then the ratios and bars."""
    meta, copy = result["meta"], result["copy"]
    lines = [
        f"gather benchmark on {meta.get('device_name', meta.get('device'))} "
        f"(torch threads: {meta.get('torch_threads')}, load average {meta.get('load_average')}, "
        f"git {meta.get('git_sha')})",
        f"copy bandwidth (dst.copy_(src), {copy['bytes'] / 2**20:.0f} MiB, read + written): "
        f"{copy['gb_per_s']:.2f} GB/s",
        "",
    ]
    header = f"{'op':<7} {'rows':<11} {'B':>7} {'provider':<8} {'p50':>11} {'GB/s':>8} {'% copy':>7} {'Mrows/s':>8}"
    lines += [header, "-" * len(header)]
    for r in result["rows"]:
        rows_label = f"{r['kind'][:5]} {r['row_bytes']}B"
        if r["status"] != "ok":
            lines.append(f"{r['op']:<7} {rows_label:<11} {r['batch']:>7} {r['provider']:<8} unavailable: {r['reason']}")
            continue
        lines.append(
            f"{r['op']:<7} {rows_label:<11} {r['batch']:>7} {r['provider']:<8} {_fmt_time(r['p50_s']):>11} "
            f"{r['gb_per_s']:>8.2f} {100 * r['copy_fraction']:>6.1f}% {r['items_per_s'] / 1e6:>8.2f}"
        )
    lines += ["", "gpubuf time / baseline time (below 1: gpubuf faster)"]
    for q in result["ratios"]:
        if q["ratio"] is None:
            text = f"n/a ({q['reason']})"
        else:
            text = f"{q['ratio']:.3f}"
            if q["baseline"] == "torchrl" and q["ratio"] > 0:
                text += f"  ({1 / q['ratio']:.2f}x faster than torchrl)" if q["ratio"] < 1 else ""
        if "bar_max_ratio" in q:
            limit = q["bar_max_ratio"]
            bar = f"within {limit:.2f}x" if limit >= 1 else f"at least {1 / limit:.2f}x faster"
            verdict = {True: "meets", False: "MISSES", None: "n/a"}[q["meets_bar"]]
            text += f"   bar: {bar} -> {verdict}"
        lines.append(f"  {q['op']:<7} {q['kind']:<11} B={q['batch']:<7} vs {q['baseline']:<8} {text}")
    return "\n".join(lines)


def _fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gpubuf.tools.bench_gather``: runs the benchmark and prints the report."""
    parser = argparse.ArgumentParser(prog="gpubuf-bench-gather", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda")
    parser.add_argument("--kinds", nargs="+", default=["transition", "frames"], choices=("transition", "frames"))
    parser.add_argument("--batches", nargs="+", type=int, default=[256, 4_096, 65_536])
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--rows", nargs="+", default=[], metavar="KIND=N", help="buffer rows per kind")
    parser.add_argument("--no-torchrl", action="store_true")
    parser.add_argument("--quick", action="store_true", help="few repeats: a rough run in a minute or two")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result as JSON")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available here")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    rows = {}
    for item in args.rows:
        kind, _, n = item.partition("=")
        rows[kind] = int(n)
    timing = dict(warmup=1, repeats=5, min_repeats=3, min_block_s=0.005, max_op_s=6.0) if args.quick else {}
    config = GatherBenchConfig(
        device=device,
        kinds=tuple(args.kinds),
        batches=tuple(args.batches),
        rows=rows,
        ops=tuple(args.ops),
        include_torchrl=not args.no_torchrl,
        **timing,
    )
    result = run_gather_benchmark(config)
    print(format_report(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=_json_default))
    return 0


def _json_default(value: Any) -> Any:
    if isinstance(value, (torch.device, torch.dtype, Path)):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"cannot serialise {type(value).__name__}")


if __name__ == "__main__":
    raise SystemExit(main())
