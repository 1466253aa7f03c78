"""Uniform replay: extend and sample for gpubuf, TorchRL and raw torch (pytest-benchmark).

The same workload as ``gpubuf bench`` (see :mod:`gpubuf.tools.bench.workloads`), grouped by op
so that pytest-benchmark's table puts the providers of one op next to each other::

    python -m pytest benchmarks/ --benchmark-only [--bench-rows 1000000] [--no-torchrl]
"""

from __future__ import annotations

import pytest

from gpubuf.tools.bench.workloads import OpSpec

OPS = [OpSpec("extend", 1_000), OpSpec("extend", 100_000), OpSpec("sample", 256), OpSpec("sample", 65_536)]
PROVIDERS = ["gpubuf TDRB", "torchrl TDRB", "raw", "gpubuf RB", "torchrl RB"]


@pytest.mark.parametrize("provider_label", PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_uniform(op, provider_label, run_provider_op, bench_rows):
    if op.kind == "extend" and op.size > bench_rows:
        pytest.skip(f"chunk {op.size} exceeds the buffer's {bench_rows} rows")
    run_provider_op(op, provider_label)
