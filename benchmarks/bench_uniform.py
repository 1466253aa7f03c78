"""Uniform replay: extend and sample for gpubuf, TorchRL and raw torch (pytest-benchmark).

The same workload as ``gpubuf bench`` (see :mod:`gpubuf.benchmark.workloads`), grouped by op
so that pytest-benchmark's table puts the providers of one op next to each other::

    python -m pytest benchmarks/ --benchmark-only [--bench-rows 1000000] [--no-torchrl]
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.benchmark import torchrl_compat
from gpubuf.benchmark.workloads import OpSpec

OPS = [OpSpec("extend", 1_000), OpSpec("extend", 100_000), OpSpec("sample", 256), OpSpec("sample", 65_536)]
PROVIDERS = ["gpubuf TDRB", "torchrl TDRB", "raw", "gpubuf RB", "torchrl RB"]


@pytest.mark.parametrize("provider_label", PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_uniform(benchmark, op, provider_label, bench_provider, bench_data, bench_rows, bench_device):
    if op.kind == "extend" and op.size > bench_rows:
        pytest.skip(f"chunk {op.size} exceeds the buffer's {bench_rows} rows")
    provider = bench_provider(provider_label)
    with torchrl_compat.quiet_logs():
        call, reason = torchrl_compat.attempt(lambda: provider.make_call(op, bench_data), "construction")
        if reason is None:
            _, reason = torchrl_compat.attempt(call, "first call")
    if reason is not None:
        if not provider.optional:
            raise AssertionError(f"{provider_label} failed on {op.label}: {reason}")
        pytest.skip(f"{provider_label} cannot {op.label}: {reason}")

    if bench_device.type == "cuda":
        # pytest-benchmark reads a host clock: wait for the kernels so they are counted.
        timed = call

        def call() -> None:
            timed()
            torch.cuda.synchronize()

    benchmark.group = f"{op.label} (N={bench_rows:,})"
    benchmark.extra_info.update(
        provider=provider.library,
        buffer=provider.buffer,
        rows=bench_rows,
        bytes_moved=op.bytes_moved,
        items=op.items,
        device=str(bench_device),
    )
    benchmark(call)
