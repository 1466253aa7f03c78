"""Variable-length sampling: gpubuf's packed LazyStackStorage vs TorchRL's LazyStackStorage.

Workload: N = 4,096 token sequences of lengths drawn uniformly in [64, 2,048] (an RLHF batch:
``input_ids`` int64 and ``attention_mask`` bool per token), sampled B = 256 at a time.

What is compared: a batch a training step can use, i.e. the sampled sequences as jagged nested
tensors. TorchRL's ``LazyStackStorage`` samples a ``LazyStackedTensorDict`` (a list of the B
items, nothing copied) and ``densify(layout=torch.jagged)`` turns it into nested tensors;
gpubuf's ``LazyStackStorage(densify=True)`` returns the same nested tensors straight from one
packed gather. TorchRL's lazy sample alone (no tensor built yet) is timed as well, for the
record::

    python -m pytest benchmarks/ -k varlen --benchmark-only [--bench-device cuda]
    OMP_NUM_THREADS=1 python -m pytest benchmarks/ -k varlen --benchmark-only  # one thread

(pass the directory, not the file: benchmarks/conftest.py collects ``bench_*.py`` itself.)
The last item prints the ratio of the medians (TorchRL sample + densify over gpubuf sample),
in wall-clock time and in CPU time of the process; on a shared machine the CPU time is the
steadier of the two.

On an oversubscribed host (more runnable threads than cores), OpenMP's default busy-waiting
makes every parallel op stall, and the packed gather's copies are large enough to run in
parallel while TorchRL's per-row copies are not: set ``OMP_WAIT_POLICY=PASSIVE`` or
``OMP_NUM_THREADS=1`` there, or the comparison measures the scheduler.
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from tensordict import TensorDict

from gpubuf import ReplayBuffer
from gpubuf.storages.stack import LazyStackStorage

N_SEQUENCES = 4_096
BATCH = 256
MIN_LEN, MAX_LEN = 64, 2_048
VOCAB = 32_000


def _sequences(seed: int = 0) -> list[TensorDict]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (N_SEQUENCES,), generator=gen).tolist()
    return [
        TensorDict(
            input_ids=torch.randint(0, VOCAB, (n,), generator=gen),
            attention_mask=torch.ones(n, dtype=torch.bool),
        )
        for n in lengths
    ]


@pytest.fixture(scope="module")
def varlen_items():
    return _sequences()


def _device(pytestconfig) -> torch.device:
    try:
        choice = pytestconfig.getoption("--bench-device")
    except ValueError:
        choice = "auto"
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice)


def _gpubuf_packed(items, device):
    rb = ReplayBuffer(storage=LazyStackStorage(N_SEQUENCES, densify=True, device=device), batch_size=BATCH)
    rb.extend(items)
    return lambda: rb.sample()


def _gpubuf_lazy(items, device):
    rb = ReplayBuffer(storage=LazyStackStorage(N_SEQUENCES), batch_size=BATCH)
    rb.extend(items)
    return lambda: rb.sample()


def _torchrl(items, densify: bool):
    torchrl_data = pytest.importorskip("torchrl.data")
    rb = torchrl_data.ReplayBuffer(storage=torchrl_data.LazyStackStorage(N_SEQUENCES), batch_size=BATCH)
    rb.extend(items)
    if densify:
        return lambda: rb.sample().densify(layout=torch.jagged)
    return lambda: rb.sample()


CASES = {
    "gpubuf LazyStackStorage(densify=True): sample": lambda items, device: _gpubuf_packed(items, device),
    "torchrl LazyStackStorage: sample + densify(jagged)": lambda items, device: _torchrl(items, True),
    "torchrl LazyStackStorage: sample (lazy, no tensor)": lambda items, device: _torchrl(items, False),
    "gpubuf LazyStackStorage: sample (lazy, no tensor)": lambda items, device: _gpubuf_lazy(items, device),
}


def _synced(call, device):
    if device.type != "cuda":
        return call

    def timed():
        out = call()
        torch.cuda.synchronize()
        return out

    return timed


def _case_id(case: str) -> str:
    provider, what = case.split(": ")
    return f"{provider.replace(' ', '-')}-{'dense' if 'densify' in what or 'densify' in provider else 'lazy'}"


@pytest.mark.parametrize("case", list(CASES), ids=_case_id)
def test_varlen_sample(benchmark, case, varlen_items, pytestconfig):
    device = _device(pytestconfig)
    call = _synced(CASES[case](varlen_items, device), device)
    call()  # warm-up: first-call allocations, the jagged-tensor machinery
    benchmark.group = f"varlen sample B={BATCH} of N={N_SEQUENCES} (lengths {MIN_LEN}..{MAX_LEN})"
    benchmark.extra_info.update(case=case, device=str(device), threads=torch.get_num_threads())
    benchmark(call)


def _medians_ms(calls: dict, rounds: int = 7, repeats: int = 10) -> dict:
    """Median wall and CPU time per call, the providers interleaved round by round (same load)."""
    wall: dict = {name: [] for name in calls}
    cpu: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            for _ in range(repeats):
                w, c = time.perf_counter(), time.process_time()
                call()
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - c)
    return {name: (statistics.median(wall[name]) * 1e3, statistics.median(cpu[name]) * 1e3) for name in calls}


def test_varlen_ratio(benchmark, varlen_items, pytestconfig):
    """Side by side in one process: prints and records the speed-up on the same workload."""
    device = _device(pytestconfig)
    calls = {
        "gpubuf": _synced(_gpubuf_packed(varlen_items, device), device),
        "torchrl densify": _torchrl(varlen_items, True),
        "torchrl lazy": _torchrl(varlen_items, False),
    }
    for call in calls.values():
        call()
    times = _medians_ms(calls)
    (ours_wall, ours_cpu), (theirs_wall, theirs_cpu), (lazy_wall, lazy_cpu) = times.values()
    benchmark.extra_info.update(
        device=str(device),
        threads=torch.get_num_threads(),
        gpubuf_ms=ours_wall,
        torchrl_densify_ms=theirs_wall,
        torchrl_lazy_ms=lazy_wall,
        speedup_wall=theirs_wall / ours_wall,
        speedup_cpu=theirs_cpu / ours_cpu,
    )
    print(
        f"\nvarlen B={BATCH} ({device}, {torch.get_num_threads()} threads), median wall / CPU ms: "
        f"gpubuf {ours_wall:.3f} / {ours_cpu:.3f}; TorchRL sample+densify {theirs_wall:.3f} / {theirs_cpu:.3f} "
        f"-> {theirs_wall / ours_wall:.1f}x wall, {theirs_cpu / ours_cpu:.1f}x CPU; "
        f"TorchRL lazy sample alone {lazy_wall:.3f} / {lazy_cpu:.3f}"
    )
    benchmark.pedantic(calls["gpubuf"], rounds=5, iterations=1)
