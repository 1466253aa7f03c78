"""Prioritized replay cycle (sample + gather + weights + priority update) for gpubuf, TorchRL and raw torch,
and the sampler's draw and update alone for gpubuf and TorchRL.

The same workload as ``gpubuf bench``'s ``cycle``, ``draw`` and ``update`` ops (see
:mod:`gpubuf.tools.bench.prioritized`), grouped by op so that pytest-benchmark's table puts the
providers side by side::

    python -m pytest benchmarks/ --benchmark-only -k "test_cycle or test_sampler" [--bench-rows 1000000] [--no-torchrl]

TorchRL's prioritized buffers need its C++ extension; where it does not load (a wheel built for
another torch), their benchmarks are skipped with the reason.
"""

from __future__ import annotations

import pytest

from gpubuf.tools.bench.workloads import OpSpec

OPS = [OpSpec("cycle", 256), OpSpec("cycle", 65_536)]
PROVIDERS = ["gpubuf TDPRB", "torchrl TDPRB", "raw", "gpubuf PRB", "torchrl PRB"]


SAMPLER_OPS = [OpSpec("draw", 65_536), OpSpec("update", 65_536)]
SAMPLER_PROVIDERS = ["gpubuf TDPRB", "torchrl TDPRB"]


@pytest.mark.parametrize("provider_label", PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_cycle(op, provider_label, run_provider_op, bench_rows):
    run_provider_op(op, provider_label)


@pytest.mark.parametrize("provider_label", SAMPLER_PROVIDERS, ids=lambda s: s.replace(" ", "-"))
@pytest.mark.parametrize("op", SAMPLER_OPS, ids=lambda op: f"{op.kind}-{op.size}")
def test_sampler(op, provider_label, run_provider_op, bench_rows):
    run_provider_op(op, provider_label)
