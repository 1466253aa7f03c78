"""The sample-path gather, as GB/s, for gpubuf, raw torch and TorchRL (pytest-benchmark).

The same ops, row kinds and sizes as :mod:`gpubuf.tools.bench_gather` (which also measures the
device's copy bandwidth in the same run and prints ratios)::

    python -m pytest benchmarks/bench_gather.py --benchmark-only [--bench-device cuda] [--no-torchrl]

Each benchmark records ``gb_per_s`` (payload read + written per call, at the median) and
``copy_gb_per_s`` (``dst.copy_(src)`` on the same device, measured once per session) in its
``extra_info``.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.tools.bench_gather import (
    PROVIDERS,
    GatherBenchConfig,
    _gpubuf_provider,
    _raw_provider,
    _torchrl_provider,
    measure_copy_bandwidth,
)
from gpubuf.tools.synthetic import make_rows, row_bytes

BATCHES = (256, 4_096, 65_536)
KINDS = ("transition", "frames")
OPS = ("gather", "sample")
_BUILD = {"gpubuf": _gpubuf_provider, "raw": _raw_provider, "torchrl": _torchrl_provider}


def _device(pytestconfig) -> torch.device:
    name = pytestconfig.getoption("--bench-device", default="auto")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("--bench-device cuda: CUDA is not available")
    return torch.device(name)


@pytest.fixture(scope="module")
def gather_env(pytestconfig):
    """The device, its copy bandwidth, and a cache of filled providers per (kind, provider)."""
    device = _device(pytestconfig)
    config = GatherBenchConfig(device=device)
    copy = measure_copy_bandwidth(device)
    built: dict = {}
    failures: dict = {}

    def provider(kind: str, name: str):
        key = (kind, name)
        if key in failures:
            pytest.skip(failures[key])
        if key not in built:
            if name == "torchrl" and pytestconfig.getoption("--no-torchrl", default=False):
                failures[key] = "torchrl not requested (--no-torchrl)"
                pytest.skip(failures[key])
            data = built.get((kind, "data"))
            if data is None:
                data = built[(kind, "data")] = make_rows(kind, config.rows_for(kind), device)
            try:
                built[key] = _BUILD[name](data)
            except Exception as err:  # TorchRL missing or broken: reported as a skip, not a failure
                if name != "torchrl":
                    raise
                failures[key] = f"torchrl unavailable: {type(err).__name__}: {err}"
                pytest.skip(failures[key])
        return built[key], built[(kind, "data")]

    yield device, copy, provider
    built.clear()


@pytest.mark.parametrize("provider_name", PROVIDERS)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", KINDS)
def test_gather(benchmark, gather_env, kind, op, batch, provider_name):
    device, copy, provider = gather_env
    make, data = provider(kind, provider_name)
    n = data.batch_size[0]
    index = torch.randint(0, n, (batch,), generator=torch.Generator(device=device).manual_seed(batch), device=device)
    call = make(index, batch)[op]
    if device.type == "cuda":
        timed = call

        def call() -> None:  # pytest-benchmark reads a host clock: count the kernels too
            timed()
            torch.cuda.synchronize()

    benchmark.group = f"{op} {kind} ({row_bytes(kind)} B rows) B={batch:,} N={n:,}"
    moved = 2 * batch * row_bytes(kind)
    # Big calls (frames at B=65,536 move ~3.7 GB) get a few rounds, not pytest-benchmark's seconds.
    if moved > 200e6:
        benchmark.pedantic(call, rounds=3, iterations=1, warmup_rounds=1)
    else:
        benchmark(call)
    median = benchmark.stats.stats.median
    benchmark.extra_info.update(
        provider=provider_name,
        kind=kind,
        batch=batch,
        rows=n,
        bytes_moved=moved,
        gb_per_s=moved / median / 1e9,
        copy_gb_per_s=copy["gb_per_s"],
        device=str(device),
    )
