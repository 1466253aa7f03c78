"""Prioritized replay cycle (sample + gather + weights + priority update) for gpubuf, TorchRL and raw torch.

The same workload as ``gpubuf bench``'s ``cycle`` ops (see :mod:`gpubuf.benchmark.prioritized`),
grouped by batch size so that pytest-benchmark's table puts the providers side by side::

    python -m pytest benchmarks/ --benchmark-only -k test_cycle [--bench-rows 1000000] [--no-torchrl]

TorchRL's prioritized buffers need its C++ extension; where it does not load (a wheel built for
another torch), their benchmarks are skipped with the reason.
"""

from __future__ import annotations

import pytest

from gpubuf.benchmark.workloads import OpSpec

OPS = [OpSpec("cycle", 256), OpSpec("cycle", 65_536)]
PROVIDERS = ["gpubuf TDPRB", "torchrl TDPRB", "raw", "gpubuf PRB", "torchrl PRB"]


@pytest.mark.parametrize("provider_label", PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_cycle(op, provider_label, run_provider_op, bench_rows):
    run_provider_op(op, provider_label)
