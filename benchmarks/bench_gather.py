"""The sample-path gather, as GB/s, for gpubuf, raw torch and TorchRL (pytest-benchmark).

Two ops, three providers:

- ``gather``: rows ``index`` (fixed, uniform, with duplicates) of every field of a filled
  storage. gpubuf: the storage's sample-path gather (one fused Triton launch on CUDA, the twin's
  ``index_select`` per field on CPU); raw: ``index_select`` per field; TorchRL: its storage's
  ``get(index)``.
- ``sample``: a whole ``sample(B)``: draw and gather. gpubuf and TorchRL:
  ``TensorDictReplayBuffer(storage=LazyTensorStorage(N)).sample(B)``; raw: ``randint`` then
  ``index_select`` per field (the floor).

for two row kinds (:mod:`gpubuf.tools.synthetic`): 292-byte transitions and 84x84x4 uint8 frames
(28,224 bytes), at ``B`` = 256, 4,096 and 65,536::

    python -m pytest benchmarks/bench_gather.py --benchmark-only [--bench-device cuda] [--no-torchrl]

Each benchmark records ``gb_per_s`` (payload read + written per call, ``2 * B * row_bytes``, at
the median) and ``copy_gb_per_s`` (``dst.copy_(src)`` on the same device, measured once per
session, ``2 * nbytes`` per call: memory-bound ops are judged against it) in its ``extra_info``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import gpubuf
from gpubuf.tools.bench import torchrl_compat
from gpubuf.tools.bench.timing import measure_round_robin
from gpubuf.tools.synthetic import make_rows, row_bytes

PROVIDERS = ("gpubuf", "raw", "torchrl")
BATCHES = (256, 4_096, 65_536)
KINDS = ("transition", "frames")
OPS = ("gather", "sample")

#: Built (and filled) once per row kind; then ``(index, B) -> {op: callable}``.
Calls = Callable[[torch.Tensor, int], dict[str, Callable[[], Any]]]


def _rows_for(kind: str, device: torch.device) -> int:
    """The buffer's rows: 1,000,000 transitions; frames 100,000 on CUDA (2.8 GB) and 16,384 on CPU (460 MB)."""
    if kind == "frames":
        return 100_000 if device.type == "cuda" else 16_384
    return 1_000_000


def measure_copy_bandwidth(device: torch.device) -> dict[str, float]:
    """``dst.copy_(src)`` of 1 GiB on CUDA, 256 MiB on CPU (well past the caches), counted as read + written."""
    nbytes = (1 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    timing = measure_round_robin({"copy": lambda: dst.copy_(src)}, device=device, warmup=2, repeats=10)["copy"]
    return {"bytes": nbytes, "p50_s": timing.p50, "gb_per_s": 2 * nbytes / timing.p50 / 1e9}


def _fill(rb: Any, data: Any) -> None:
    n = data.batch_size[0]
    for start in range(0, n, 100_000):
        # A shallow copy: TensorDictReplayBuffer.extend may write "index" into what it is given.
        rb.extend(data[start : start + 100_000].clone(recurse=False))


def _gpubuf_provider(data: Any) -> Calls:
    rb = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(data.batch_size[0], device=data.device))
    _fill(rb, data)
    storage = rb.storage
    # The sample path's gather skips the stored "index" leaf (TensorDictReplayBuffer fills it
    # from the sampler's index): the same fields as raw and TorchRL move.
    skip = storage.layout.index_of(("index",))
    return lambda index, batch: {"gather": lambda: storage._gather(index, skip), "sample": lambda: rb.sample(batch)}


def _raw_provider(data: Any) -> Calls:
    fields = [data[key] for key in data.keys()]
    n, device = data.batch_size[0], data.device

    def calls(index: torch.Tensor, batch: int) -> dict[str, Callable[[], Any]]:
        def sample() -> list[torch.Tensor]:
            idx = torch.randint(0, n, (batch,), device=device)
            return [torch.index_select(f, 0, idx) for f in fields]

        return {"gather": lambda: [torch.index_select(f, 0, index) for f in fields], "sample": sample}

    return calls


def _torchrl_provider(data: Any) -> Calls:
    with torchrl_compat.quiet_logs():
        trl = torchrl_compat.namespace()
        rb = trl.TensorDictReplayBuffer(storage=trl.LazyTensorStorage(data.batch_size[0], device=data.device))
        _fill(rb, data)
    storage = rb.storage
    return lambda index, batch: {"gather": lambda: storage.get(index), "sample": lambda: rb.sample(batch)}


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
                data = built[(kind, "data")] = make_rows(kind, _rows_for(kind, device), device)
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
