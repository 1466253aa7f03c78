"""Benchmark configurations (``--quick``, ``--full``) and the bars gpubuf is measured against."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gpubuf.tools.bench.workloads import KINDS, SAMPLER_KINDS, TDPRB, TDRB, OpSpec


@dataclass(frozen=True)
class BenchConfig:
    """What to run and how long to time it.

    Attributes:
        name: ``"quick"``, ``"full"`` or a custom name; recorded in the result.
        rows: ``N``, the buffer capacity; buffers are filled to it before timing.
        extend_chunks: chunk lengths of the ``extend`` ops.
        sample_batches: batch sizes of the ``sample`` ops.
        cycle_batches: batch sizes of the prioritized ``cycle`` ops (none unless given).
        sampler_batches: batch sizes of the prioritized sampler's ``draw`` and ``update`` ops,
            timed alone (none unless given).
        warmup: untimed calls per provider before timing.
        repeats: timed blocks per provider and op.
        min_repeats: blocks always timed, even past ``max_op_s``.
        min_block_s: the shortest timed block (short calls are repeated inside a block).
        max_op_s: wall-time budget of one op (all providers together) once ``min_repeats`` is met.
        seed: the data's seed.
    """

    name: str
    rows: int
    extend_chunks: tuple[int, ...] = (1_000, 100_000)
    sample_batches: tuple[int, ...] = (256, 65_536)
    cycle_batches: tuple[int, ...] = ()
    sampler_batches: tuple[int, ...] = ()
    warmup: int = 3
    repeats: int = 30
    min_repeats: int = 5
    min_block_s: float = 0.005
    max_op_s: float = math.inf
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rows <= 0:
            raise ValueError(f"rows must be positive, got {self.rows}")
        too_long = [c for c in self.extend_chunks if c > self.rows]
        if too_long:
            raise ValueError(f"extend chunks {too_long} exceed the buffer's {self.rows} rows")

    def ops(self) -> list[OpSpec]:
        """Every op of the configuration: extends, samples, prioritized cycles, then the sampler's steps."""
        return (
            [OpSpec("extend", c) for c in self.extend_chunks]
            + [OpSpec("sample", b) for b in self.sample_batches]
            + [OpSpec("cycle", b) for b in self.cycle_batches]
            + [OpSpec(kind, b) for b in self.sampler_batches for kind in SAMPLER_KINDS]
        )

    def with_rows(self, rows: int) -> "BenchConfig":
        """A copy with another ``N`` (chunks longer than ``rows`` are dropped)."""
        chunks = tuple(c for c in self.extend_chunks if c <= rows)
        return replace(self, rows=rows, extend_chunks=chunks)


#: The reference workload, timed at length: N = 1M, extend 1k / 100k, sample 256 / 65,536, the
#: prioritized cycle (sample + gather + weights + priority update) at 256 / 65,536, and the
#: sampler's draw and update of 65,536 alone.
FULL = BenchConfig(
    name="full",
    rows=1_000_000,
    cycle_batches=(256, 65_536),
    sampler_batches=(65_536,),
    warmup=5,
    repeats=150,
    min_repeats=30,
    min_block_s=0.02,
    max_op_s=60.0,
)

#: The same sizes timed briefly, the cycle at B = 256 only: about two minutes on a 2-core CPU,
#: seconds on a GPU.
QUICK = BenchConfig(
    name="quick",
    rows=1_000_000,
    cycle_batches=(256,),
    sampler_batches=(65_536,),
    warmup=2,
    repeats=20,
    min_repeats=5,
    min_block_s=0.005,
    max_op_s=8.0,
)

CONFIGS = {"quick": QUICK, "full": FULL}


@dataclass(frozen=True)
class Bar:
    """A target ratio of gpubuf's median time to a baseline's (measured and reported, not asserted).

    Attributes:
        kind, size: the op.
        baseline: ``"torchrl"`` or ``"raw"``.
        max_ratio: gpubuf / baseline must not exceed this.
        buffer: the gpubuf buffer class the bar applies to.
        device: the device type it applies to (``"cpu"``, ``"cuda"``), or None for any.
    """

    kind: str
    size: int
    baseline: str
    max_ratio: float
    buffer: str = TDRB
    device: str | None = None

    @property
    def text(self) -> str:
        if self.max_ratio < 1:
            return f"at least {1 / self.max_ratio:.3g}x faster than {self.baseline}"
        return f"within {self.max_ratio:.3g}x of {self.baseline}"


@dataclass(frozen=True)
class TimeBar:
    """A time gpubuf's median must not exceed on one device type (measured and reported, not asserted).

    Attributes:
        kind, size: the op.
        max_s: the median's limit, in seconds.
        device: the device type it applies to (``"cuda"``).
        buffer: the gpubuf buffer class the bar applies to.
    """

    kind: str
    size: int
    max_s: float
    device: str
    buffer: str = TDPRB

    @property
    def text(self) -> str:
        return f"at most {self.max_s * 1e6:.3g} us on {self.device}"


BARS = (
    Bar("sample", 256, "torchrl", 1 / 2.5),
    Bar("sample", 65_536, "raw", 1.3),
    Bar("extend", 100_000, "raw", 1.2),
    Bar("cycle", 256, "torchrl", 1 / 3, TDPRB, "cpu"),
    Bar("cycle", 65_536, "torchrl", 1 / 3, TDPRB, "cpu"),
    # On a GPU the cycle must beat TorchRL's configuration that runs there by far more.
    Bar("cycle", 256, "torchrl", 1 / 20, TDPRB, "cuda"),
    Bar("cycle", 65_536, "torchrl", 1 / 20, TDPRB, "cuda"),
)

TIME_BARS = (
    TimeBar("update", 65_536, 20e-6, "cuda"),
    TimeBar("draw", 65_536, 20e-6, "cuda"),
    TimeBar("cycle", 256, 100e-6, "cuda"),
    TimeBar("cycle", 65_536, 100e-6, "cuda"),
)


def device_type(device: str) -> str:
    """``"cuda"`` for ``"cuda:0"``, ``"cpu"`` for ``"cpu"``: the part the bars name."""
    return device.split(":", 1)[0]


def bar_for(kind: str, size: int, baseline: str, buffer: str | None, device: str = "cpu") -> Bar | None:
    """The ratio bar for a ratio measured on ``device`` (a type or ``"type:index"``), if there is one."""
    kind_of_device = device_type(device)
    for bar in BARS:
        if (bar.kind, bar.size, bar.baseline, bar.buffer) == (kind, size, baseline, buffer) and bar.device in (
            None,
            kind_of_device,
        ):
            return bar
    return None


def time_bar_for(kind: str, size: int, buffer: str | None, device: str) -> TimeBar | None:
    """The time bar of an op measured on ``device``, if there is one."""
    kind_of_device = device_type(device)
    for bar in TIME_BARS:
        if (bar.kind, bar.size, bar.buffer, bar.device) == (kind, size, buffer, kind_of_device):
            return bar
    return None


def parse_ops(specs: list[str] | None, config: BenchConfig) -> list[OpSpec]:
    """Selects ops from ``--ops`` arguments.

    Args:
        specs: items like ``"sample"`` (every size of that kind in ``config``) or
            ``"sample:4096"`` / ``"extend:1000"`` / ``"cycle:256"`` / ``"draw:65536"`` /
            ``"update:65536"`` (one size, which may be outside ``config``); None or empty
            selects every op of ``config``.
        config: the configuration providing the default sizes.

    Raises:
        ValueError: a malformed item, or an extend chunk longer than ``config.rows``.
    """
    if not specs:
        return config.ops()
    chosen: list[OpSpec] = []
    for spec in specs:
        kind, _, size = spec.partition(":")
        if kind not in KINDS:
            raise ValueError(
                f"unknown op {spec!r}: expected one of {', '.join(KINDS)}, alone or as <op>:<size> "
                "(extend:<rows>, sample:<batch>, ...)"
            )
        if size:
            try:
                value = int(size.replace("_", "").replace(",", ""))
            except ValueError:
                raise ValueError(f"bad size in op {spec!r}") from None
            ops = [OpSpec(kind, value)]
        else:
            ops = [op for op in config.ops() if op.kind == kind]
        for op in ops:
            if op.kind == "extend" and op.size > config.rows:
                raise ValueError(f"extend chunk {op.size} exceeds the buffer's {config.rows} rows")
            if op not in chosen:
                chosen.append(op)
    return chosen


__all__ = [
    "BARS",
    "CONFIGS",
    "FULL",
    "QUICK",
    "TIME_BARS",
    "Bar",
    "BenchConfig",
    "TimeBar",
    "bar_for",
    "device_type",
    "parse_ops",
    "time_bar_for",
]
