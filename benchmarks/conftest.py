"""pytest-benchmark setup for ``benchmarks/``: collects ``bench_*.py`` and shares built buffers.

Run with ``python -m pytest benchmarks/ --benchmark-only``. These files are not part of the
test suite (``tests/`` is); pyproject's ``testpaths`` keeps them out of a plain ``pytest``.
"""

from __future__ import annotations

import pytest
import torch

from gpubuf.tools.bench import environment, torchrl_compat
from gpubuf.tools.bench.workloads import Provider, UnavailableProvider, default_providers, make_transitions


def pytest_addoption(parser):
    group = parser.getgroup("gpubuf benchmarks")
    group.addoption("--bench-rows", type=int, default=1_000_000, help="N, the buffer's rows (default 1,000,000)")
    group.addoption("--bench-device", default="auto", choices=("auto", "cpu", "cuda"), help="default: cuda if present")
    group.addoption("--no-torchrl", action="store_true", help="skip TorchRL's benchmarks without importing it")


def pytest_collect_file(file_path, parent):
    # pytest only collects test_*.py by default; the benchmarks are named bench_*.py.
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


@pytest.fixture(scope="session")
def bench_device(pytestconfig) -> torch.device:
    return environment.resolve_device(pytestconfig.getoption("--bench-device"))


@pytest.fixture(scope="session")
def bench_rows(pytestconfig) -> int:
    return pytestconfig.getoption("--bench-rows")


@pytest.fixture(scope="session")
def bench_data(bench_rows, bench_device):
    """The workload's N transitions, generated once per session."""
    return make_transitions(bench_rows, bench_device)


@pytest.fixture(scope="session")
def bench_provider(pytestconfig, bench_data):
    """``bench_provider("gpubuf TDRB")`` -> that provider, filled with the data (built once, kept).

    An optional provider (TorchRL) that cannot be built skips the benchmark with the reason.
    """
    include_torchrl = not pytestconfig.getoption("--no-torchrl")
    by_label = {p.label: p for p in default_providers(include_torchrl)}
    built: dict[str, Provider] = {}
    reasons: dict[str, str] = {}

    def get(label: str) -> Provider:
        if label in reasons:
            pytest.skip(reasons[label])
        if label not in built:
            provider = by_label[label]
            if isinstance(provider, UnavailableProvider):
                reasons[label] = f"{label} unavailable: {provider.reason}"
                pytest.skip(reasons[label])
            with torchrl_compat.quiet_logs():
                if provider.optional:
                    _, reason = torchrl_compat.attempt(lambda: provider.setup(bench_data), "construction")
                    if reason:
                        reasons[label] = f"{label} unavailable: {reason}"
                        pytest.skip(reasons[label])
                else:
                    provider.setup(bench_data)
            built[label] = provider
        return built[label]

    yield get
    for provider in built.values():
        provider.close()


@pytest.fixture
def run_provider_op(benchmark, bench_provider, bench_data, bench_rows, bench_device):
    """Times one provider on one op with pytest-benchmark, the body every ``bench_*`` test shares.

    The returned function builds the provider's call (an optional provider that cannot run is
    skipped with the reason; a required one failing is an error), waits for CUDA kernels inside
    the timed call so they are counted, and records the op's sizes in ``extra_info``.
    """

    def run(op, provider_label: str) -> None:
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
            def timed() -> None:
                call()
                torch.cuda.synchronize()

        else:
            timed = call
        benchmark.group = f"{op.label} (N={bench_rows:,})"
        benchmark.extra_info.update(
            provider=provider.library,
            buffer=provider.buffer,
            rows=bench_rows,
            bytes_moved=op.bytes_moved,
            items=op.items,
            device=str(bench_device),
        )
        benchmark(timed)

    return run
