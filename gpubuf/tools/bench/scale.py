"""``gpubuf bench --scale``: how each operation's time grows with the buffer's rows N.

For every N of a sweep (1M to 64M rows by default, and up to 128M through the memory-mapped
storage) gpubuf and TorchRL run the same workloads side by side in one process, one library
after the other with the order alternating from one N to the next, and everything of one
library freed before the other starts (64M rows of 48 B are 3 GB per library):

- ``fill``: extends in chunks of 1M rows into a new ``LazyTensorStorage(N)`` until it is full,
  then one more chunk into the full buffer (the wrap-around extend), then uniform samples;
- ``memmap``: the same through ``LazyMemmapStorage(N)`` in a scratch directory;
- ``checkpoint``: ``dumps`` of the memory-mapped buffer to a new directory and ``loads`` into a
  new memory-mapped buffer (a round trip, checked row for row on a sample of rows), and the
  same for the in-memory storage up to ``--ckpt-tensor-max`` rows. Each library's filled
  buffers are kept until both libraries have theirs, then the round trips run interleaved, one
  of each library in turn (see :func:`_round_trips`);
- ``prioritized``: a ``TensorDictPrioritizedReplayBuffer`` filled the same way, then
  ``update_priority`` of B items and the cycle (sample B with weights, update B).

A fill, an extend, a dump and a load are timed once each (at these sizes one call is long;
``--ckpt-repeat`` repeats the round trips and keeps the medians);
a sample, an update and a cycle are timed ``--repeat`` times and the median is kept. Before a
dump the page cache's dirty pages are written back (``os.sync``), so that neither library pays
for the other's writes. Rows are ``{obs: f32[8], action: f32[3], reward: f32[1]}`` (48 B, the
``small`` kind) or the 277 B transition of the other benchmarks (``wide``); TensorDict buffers
add an ``index`` entry of 8 B a row in both libraries.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from tensordict import TensorDict

from gpubuf.tools.bench import environment
from gpubuf.tools.bench.torchrl_compat import load_torchrl_data, quiet_logs
from gpubuf.tools.synthetic import ROW_KINDS, make_rows, row_bytes

M = 1 << 20
#: Default sweep, in rows; the memory-mapped storage goes on to MEMMAP_SIZES beyond.
SIZES = (1 * M, 4 * M, 16 * M, 64 * M)
MEMMAP_SIZES = (128 * M,)
CHUNK = 1 * M
WORKLOADS = ("fill", "memmap", "checkpoint", "prioritized")

def parse_size(text: str) -> int:
    """``"16M"`` -> 16 * 2**20 rows, ``"500k"`` -> 500 * 2**10, ``"1000"`` -> 1000."""
    text = text.strip()
    scale = {"k": 1 << 10, "K": 1 << 10, "m": M, "M": M, "g": 1 << 30, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"not a row count: {text!r} (examples: 1000, 500k, 16M)") from None
    if value <= 0:
        raise ValueError(f"a row count must be positive, got {text!r}")
    return value


def format_rows(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", M), ("k", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def make_chunk(kind: str, rows: int, seed: int = 0) -> TensorDict:
    """``rows`` random rows of ``kind`` (``"small"`` or ``"wide"``) on the CPU."""
    return make_rows(kind, rows, seed=seed)


@dataclass
class ScaleConfig:
    sizes: tuple[int, ...] = SIZES
    memmap_sizes: tuple[int, ...] = MEMMAP_SIZES
    workloads: tuple[str, ...] = WORKLOADS
    kind: str = "small"
    batch: int = 65_536
    repeat: int = 7
    prioritized_max: int = 16 * M
    ckpt_tensor_max: int = 16 * M
    scratch: str | None = None
    libraries: tuple[str, ...] = ("gpubuf", "torchrl")
    chunk: int = CHUNK
    #: Write back every dirty page (``os.sync``) before each dump and load: off in tests, where
    #: it would wait for whatever else the machine writes.
    sync: bool = True
    #: Round trips per checkpoint measurement (each to a new directory; medians kept).
    ckpt_repeat: int = 1


@dataclass
class Measure:
    workload: str
    op: str
    n: int
    seconds: dict[str, float | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


#: Wrap-around extends timed per buffer (median kept): one call varies by 2x with the page cache's
#: writeback of the fill before it.
WRAP_REPEAT = 3


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _median(fn: Callable[[], Any], repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()  # the first calls pay for lazy set-up (allocator, caches, TorchRL's first draws): not timed
    return statistics.median(_timed(fn) for _ in range(repeat))


def _free() -> None:
    gc.collect()


class _Library:
    """The classes of one library under a common name."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "gpubuf":
            import gpubuf as module
        else:
            module = load_torchrl_data()
        self.module = module

    # No batch_size at construction: every sample passes its own.
    def tensor_buffer(self, n: int, *, prioritized: bool = False) -> Any:
        m = self.module
        if prioritized:
            return m.TensorDictPrioritizedReplayBuffer(alpha=0.7, beta=0.5, storage=m.LazyTensorStorage(n))
        return m.TensorDictReplayBuffer(storage=m.LazyTensorStorage(n))

    def memmap_buffer(self, n: int, scratch: str) -> Any:
        m = self.module
        return m.TensorDictReplayBuffer(storage=m.LazyMemmapStorage(n, scratch_dir=scratch))


def _fill(rb: Any, n: int, chunk: TensorDict) -> None:
    left = n
    while left > 0:
        take = min(left, chunk.batch_size[0])
        rb.extend(chunk if take == chunk.batch_size[0] else chunk[:take])
        left -= take


def _check_round_trip(saved: Any, loaded: Any, n: int) -> None:
    """The loaded buffer holds the saved rows: same length, same rows on a spread of indices."""
    if len(loaded) != len(saved):
        raise AssertionError(f"loaded {len(loaded)} rows, saved {len(saved)}")
    count = min(n, 1024)
    index = torch.arange(count, dtype=torch.long) * (n - 1) // max(count - 1, 1)  # exact in integers, both ends
    a, b = saved.storage[index], loaded.storage[index]
    for key in a.keys():
        if key != "index" and not torch.equal(a[key], b[key]):
            raise AssertionError(f"rows of {key!r} differ after the round trip")


@dataclass
class _Trip:
    """A buffer whose checkpoint round trips are still to be timed, and what they need."""

    lib: _Library
    rb: Any
    storage: str
    scratch: Path
    fresh: Callable[[], Any]
    after_each: Callable[[], None] = lambda: None
    at_end: Callable[[], None] = lambda: None
    dumps: list = field(default_factory=list)
    loads: list = field(default_factory=list)


def _run_library(
    lib: _Library, n: int, config: ScaleConfig, chunk: TensorDict, scratch: Path, out: dict, trips: list[_Trip]
) -> None:
    """Runs every workload of ``config`` at ``n`` rows for one library; records into ``out``.

    The buffers to checkpoint go to ``trips``, kept alive: their round trips are timed once every
    library has its own (:func:`_round_trips`)."""
    batch = min(config.batch, n)
    wrap = f"extend {format_rows(chunk.batch_size[0])} into full"

    def record(workload: str, op: str, seconds: float | None, note: str | None = None) -> None:
        measure = out.setdefault((workload, op), Measure(workload, op, n))
        measure.seconds[lib.name] = seconds
        if note:
            measure.notes[lib.name] = note

    if "fill" in config.workloads:
        rb = lib.tensor_buffer(n)
        record("fill", "fill", _timed(lambda: _fill(rb, n, chunk)))
        record("fill", wrap, _median(lambda: rb.extend(chunk), WRAP_REPEAT, warmup=0))
        record("fill", f"sample {batch}", _median(lambda: rb.sample(batch), config.repeat))
        if "checkpoint" in config.workloads and n <= config.ckpt_tensor_max:
            trips.append(_Trip(lib, rb, "tensor", scratch, lambda: lib.tensor_buffer(n)))
        del rb
        _free()
    if "memmap" in config.workloads or "checkpoint" in config.workloads:
        files = scratch / f"{lib.name}-files"
        rb = lib.memmap_buffer(n, str(files))
        record("memmap", "fill", _timed(lambda: _fill(rb, n, chunk)))
        record("memmap", wrap, _median(lambda: rb.extend(chunk), WRAP_REPEAT, warmup=0))
        # The fill's dirty pages go to disk first: samples timed while the kernel writes back
        # gigabytes measure the disk (they varied 0.3x to 3x between runs at 64M rows).
        os.sync()
        record("memmap", f"sample {batch}", _median(lambda: rb.sample(batch), config.repeat))
        if "checkpoint" in config.workloads:
            other = scratch / f"{lib.name}-loaded"
            trips.append(_Trip(lib, rb, "memmap", scratch, lambda: lib.memmap_buffer(n, str(other)),
                               after_each=lambda: shutil.rmtree(other, ignore_errors=True),
                               at_end=lambda: shutil.rmtree(files, ignore_errors=True)))
        else:
            shutil.rmtree(files, ignore_errors=True)
        del rb
        _free()
    if "prioritized" in config.workloads and n <= config.prioritized_max:
        rb = lib.tensor_buffer(n, prioritized=True)
        record("prioritized", "fill", _timed(lambda: _fill(rb, n, chunk)))
        gen = torch.Generator().manual_seed(1)
        index = torch.randint(0, n, (batch,), generator=gen)
        priority = torch.rand(batch, generator=gen) + 0.01
        record("prioritized", f"update_priority {batch}", _median(lambda: rb.update_priority(index, priority), config.repeat))

        def cycle() -> None:
            sample = rb.sample(batch)
            rb.update_priority(sample["index"], priority)

        record("prioritized", f"cycle {batch}", _median(cycle, config.repeat))
        del rb
        _free()


def _round_trips(trips: list[_Trip], n: int, config: ScaleConfig, out: dict) -> None:
    """Times the checkpoint round trips of every library's buffers, interleaved: round ``r`` runs
    one round trip of each library in turn (the order alternating from round to round), so that
    both meet the same state of the machine (its page cache, the disk's other writers); medians of
    ``config.ckpt_repeat`` rounds are recorded. Each round trip dumps to a new directory and loads
    into a new buffer, checked row for row on a spread of rows."""
    for storage in ("tensor", "memmap"):
        group = [trip for trip in trips if trip.storage == storage]
        for r in range(config.ckpt_repeat):
            for trip in group if r % 2 == 0 else group[::-1]:
                path = trip.scratch / f"{trip.lib.name}-ckpt-{storage}"
                shutil.rmtree(path, ignore_errors=True)
                if config.sync:
                    os.sync()
                with quiet_logs():
                    trip.dumps.append(_timed(lambda: trip.rb.dumps(str(path))))
                    target = trip.fresh()
                    if config.sync:
                        os.sync()
                    trip.loads.append(_timed(lambda: target.loads(str(path))))
                _check_round_trip(trip.rb, target, n)
                del target
                _free()
                shutil.rmtree(path, ignore_errors=True)
                trip.after_each()
        for trip in group:
            for op, times in (("dumps", trip.dumps), ("loads", trip.loads)):
                measure = out.setdefault((f"checkpoint {storage}", op), Measure(f"checkpoint {storage}", op, n))
                measure.seconds[trip.lib.name] = statistics.median(times)
            trip.rb = None
            _free()
            trip.at_end()


def run_scale(
    config: ScaleConfig, progress: Callable[[str], None] = lambda _: None, partial: Callable[[dict], None] | None = None
) -> dict:
    """Runs the sweep; returns the result (environment, config, one row per workload, op and N).

    ``partial`` is handed the result so far after each N (to keep what a long sweep measured).
    """
    env = environment.collect(torch.device("cpu"))
    chunk = make_chunk(config.kind, config.chunk)
    libraries = []
    with quiet_logs():
        for name in config.libraries:
            try:
                libraries.append(_Library(name))
            except Exception as err:  # TorchRL missing or broken: gpubuf alone
                progress(f"{name} unavailable: {err}")
    base = config.scratch or tempfile.gettempdir()
    sizes = sorted(set(config.sizes) | {s for s in config.memmap_sizes if "memmap" in config.workloads})
    measures: list[Measure] = []
    for step, n in enumerate(sizes):
        out: dict = {}
        order = libraries if step % 2 == 0 else libraries[::-1]
        scratches: list[Path] = []
        trips: list[_Trip] = []
        try:
            for lib in order:
                scratch = Path(tempfile.mkdtemp(prefix="gpubuf-scale-", dir=base))
                scratches.append(scratch)
                progress(f"N = {format_rows(n)}: {lib.name}")
                with quiet_logs():
                    run_config = config
                    if n not in config.sizes:  # past the in-memory sweep: the memory-mapped storage only
                        run_config = ScaleConfig(**{**config.__dict__, "workloads": tuple(
                            w for w in config.workloads if w in ("memmap", "checkpoint"))})
                    _run_library(lib, n, run_config, chunk, scratch, out, trips)
                _free()
            if trips:
                progress(f"N = {format_rows(n)}: checkpoint round trips, libraries interleaved")
                _round_trips(trips, n, config, out)
        finally:
            trips.clear()
            _free()
            for scratch in scratches:
                shutil.rmtree(scratch, ignore_errors=True)
        measures.extend(out.values())
        progress(format_table_rows([m for m in out.values()]))
        if partial is not None:
            partial(_result(env, config, measures))
    return _result(env, config, measures)


def _result(env: dict, config: ScaleConfig, measures: list[Measure]) -> dict:
    return {
        "benchmark": "scale",
        "environment": env,
        "config": {
            "row_kind": config.kind,
            "row_bytes": row_bytes(config.kind),
            "chunk_rows": config.chunk,
            "batch": config.batch,
            "repeat": config.repeat,
            "sizes": list(config.sizes),
            "memmap_sizes": list(config.memmap_sizes),
            "workloads": list(config.workloads),
            "prioritized_max": config.prioritized_max,
            "ckpt_tensor_max": config.ckpt_tensor_max,
            "ckpt_repeat": config.ckpt_repeat,
        },
        "rows": [
            {
                "workload": m.workload,
                "op": m.op,
                "n": m.n,
                "seconds": m.seconds,
                "speedup_vs_torchrl": _ratio(m.seconds),
                **({"notes": m.notes} if m.notes else {}),
            }
            for m in measures
        ],
    }


def _ratio(seconds: dict[str, float | None]) -> float | None:
    ours, theirs = seconds.get("gpubuf"), seconds.get("torchrl")
    if not ours or not theirs:
        return None
    return round(theirs / ours, 3)


def _format_seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} us"


def format_table_rows(measures: list[Measure]) -> str:
    lines = []
    for m in measures:
        ratio = _ratio(m.seconds)
        lines.append(
            f"{m.workload:<18} {m.op:<24} {format_rows(m.n):>6} {_format_seconds(m.seconds.get('gpubuf')):>10} "
            f"{_format_seconds(m.seconds.get('torchrl')):>10} {('%.2fx' % ratio) if ratio else '-':>7}"
        )
    return "\n".join(lines)


def format_table(result: dict) -> str:
    """The sweep as a text table: one line per workload, op and N (speed-up = TorchRL time / gpubuf's)."""
    header = f"{'workload':<18} {'op':<24} {'N':>6} {'gpubuf':>10} {'torchrl':>10} {'speedup':>7}"
    rows = sorted(result["rows"], key=lambda r: (r["workload"], r["op"], r["n"]))
    measures = [Measure(r["workload"], r["op"], r["n"], r["seconds"]) for r in rows]
    return "\n".join([header, "-" * len(header), format_table_rows(measures)])


def format_markdown(result: dict) -> str:
    """The sweep as a Markdown table with N across (for the README)."""
    rows = result["rows"]
    sizes = sorted({r["n"] for r in rows})
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["workload"], r["op"]) not in keys:
            keys.append((r["workload"], r["op"]))
    lines = [
        "| workload | op | " + " | ".join(format_rows(n) for n in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    by = {(r["workload"], r["op"], r["n"]): r for r in rows}
    for workload, op in keys:
        cells = []
        for n in sizes:
            r = by.get((workload, op, n))
            if r is None:
                cells.append("")
                continue
            s = r["seconds"]
            ratio = r["speedup_vs_torchrl"]
            cells.append(
                f"{_format_seconds(s.get('gpubuf'))} / {_format_seconds(s.get('torchrl'))}"
                + (f" ({ratio:.2f}x)" if ratio else "")
            )
        lines.append(f"| {workload} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return path


def write_plot(result: dict, path: Path) -> Path:
    """Time against N, log-log, one panel per workload and op, one line per library."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    keys: list[tuple[str, str]] = []
    for r in rows:
        if (r["workload"], r["op"]) not in keys:
            keys.append((r["workload"], r["op"]))
    cols = 4
    nrows = -(-len(keys) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.2 * nrows), squeeze=False)
    for ax, (workload, op) in zip(axes.flat, keys):
        points = sorted((r for r in rows if (r["workload"], r["op"]) == (workload, op)), key=lambda r: r["n"])
        for lib, style in (("gpubuf", "o-"), ("torchrl", "s--")):
            xs = [r["n"] for r in points if r["seconds"].get(lib)]
            ys = [r["seconds"][lib] for r in points if r["seconds"].get(lib)]
            if xs:
                ax.plot(xs, ys, style, label=lib)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{workload}: {op}", fontsize=9)
        ax.set_xlabel("rows N")
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    env = result["environment"]
    fig.suptitle(
        f"gpubuf vs TorchRL, time against N ({result['config']['row_bytes']} B rows, "
        f"{env.get('cpu_cores')} cores, {env.get('torch_threads')} torch threads)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def iter_sizes(text: str) -> Iterator[int]:
    for part in text.split(","):
        if part.strip():
            yield parse_size(part)


__all__ = [
    "ROW_KINDS",
    "ScaleConfig",
    "WORKLOADS",
    "format_markdown",
    "format_table",
    "make_chunk",
    "parse_size",
    "run_scale",
    "write_json",
    "write_plot",
]
