"""Prioritized replay cycle (sample + gather + weights + priority update) for gpubuf, TorchRL and raw torch.

The same workload as ``gpubuf bench``'s ``cycle`` ops (see :mod:`gpubuf.benchmark.prioritized`),
grouped by batch size so that pytest-benchmark's table puts the providers side by side::

    python -m pytest benchmarks/ --benchmark-only -k test_cycle [--bench-rows 1000000] [--no-torchrl]

TorchRL's prioritized buffers need its C++ extension; where it does not load (a wheel built for
another torch), their benchmarks are skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.benchmark import torchrl_compat
from gpubuf.benchmark.workloads import OpSpec

OPS = [OpSpec("cycle", 256), OpSpec("cycle", 65_536)]
PROVIDERS = ["gpubuf TDPRB", "torchrl TDPRB", "raw", "gpubuf PRB", "torchrl PRB"]


@pytest.mark.parametrize("provider_label", PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_cycle(benchmark, op, provider_label, bench_provider, bench_data, bench_rows, bench_device):
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
