"""Launches and host syncs of the replay operations, counted call by call.

For each workload and batch size, one call after a warm-up call runs under
:func:`gpubuf.ops.device_work.count_device_work` on the buffer's device:

- ``sample``: a uniform ``TensorDictReplayBuffer.sample(B)`` (draw, gather of every field);
- ``extend``: ``extend`` of B rows;
- ``prioritized-cycle``: ``TensorDictPrioritizedReplayBuffer.sample(B, return_info=True)``
  (draw with importance weights, gather) then ``update_priority`` of the batch with priorities
  already on the device;
- ``slice-sample``, ``prioritized-slice-sample`` and ``slice-sample-without-replacement``: a
  ``TensorDictReplayBuffer.sample(B)`` with a ``SliceSampler`` / ``PrioritizedSliceSampler`` /
  ``SliceSamplerWithoutReplacement`` of ``B / 32`` slices of 32 steps (episodes of 20 to 200
  steps, 32 to 64 without replacement; boundaries from ``traj_key``).

On a GPU this is what a step costs in launches and syncs. Without one, ``--device cpu --backend
triton`` counts the device path through Triton's interpreter (``TRITON_INTERPRET=1``; small sizes).

``--host-calls N`` also times N calls back to back, the device synchronised once at the end: on
a GPU the time per call of a host that launches ahead of the device; on the interpreted path the
host's work alone, the Triton kernels skipped (:func:`gpubuf_kernels._launch.host_only`; Triton's
own launch cost is then not in it). With ``--host-profile`` those calls run again under
:mod:`cProfile`, and the host time is split by where it is spent: gpubuf's Python layers, its
launchers (``gpubuf_kernels``), Triton's launch path, torch, tensordict, and calls into C
(the kernels' launchers among them); the functions that cost most are listed too. On a GPU this
says whether an eager call is bound by gpubuf's layers or by the launches.

Example:
    $ python -m gpubuf.tools.counts --device cuda --json counts.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import itertools
import json
import time
from typing import Any, Callable, Sequence

import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.ops.device_work import count_device_work
from gpubuf_kernels._launch import host_only
from gpubuf.tools.profile import WORKLOADS as PROFILED
from gpubuf.tools.profile import ProfileConfig, filled_buffer

__all__ = ["WORKLOADS", "count_workloads", "main"]


def _prioritized_cycle(config: ProfileConfig) -> Callable[[], Any]:
    rb, _ = filled_buffer(config, cls_name="TensorDictPrioritizedReplayBuffer", alpha=0.7, beta=0.5)
    batch = config.batch_size
    priority = torch.rand(batch, generator=torch.Generator().manual_seed(2)).to(config.device) + 0.1

    def cycle() -> Any:
        data, info = rb.sample(batch, return_info=True)
        rb.update_priority(info["index"], priority)
        return data

    return cycle


#: Steps a slice of the slice workloads.
SLICE_LEN = 32


def _slice_sample(config: ProfileConfig, *, kind: str) -> Callable[[], Any]:
    rb, batch = _slice_buffer(config, kind=kind)
    return lambda: rb.sample(batch)


def _slice_cycle(config: ProfileConfig, *, kind: str) -> Callable[[], Any]:
    """A learner's step: extend ``B`` new steps (whole episodes of 20 to 200 steps, continued
    from one call to the next), sample ``B``, and for the prioritized sampler update the sampled
    steps' priorities. The boundaries of the new steps are read at the sample."""
    rb, batch = _slice_buffer(config, kind=kind)
    device = config.device
    g = torch.Generator().manual_seed(config.seed + 1)
    chunks, priorities = [], []
    first = 10**9  # episode ids after every stored one
    for _ in range(4):
        lengths = torch.randint(20, 201, (batch // 20 + 1,), generator=g)
        episode = torch.repeat_interleave(torch.arange(lengths.shape[0]) + first, lengths)[:batch]
        first = int(episode[-1]) + 1
        done = torch.zeros(batch, 1, dtype=torch.bool)
        done[:-1, 0] = episode[1:] != episode[:-1]
        chunks.append(TensorDict({"obs": torch.randn(batch, 4, generator=g), "episode": episode,
                                  ("next", "done"): done}, [batch]).to(device))
        priorities.append((torch.rand(batch, generator=g) + 0.1).to(device))
    step = itertools.count()

    def cycle() -> None:
        i = next(step) % len(chunks)
        rb.extend(chunks[i])
        sampled = rb.sample(batch)
        if kind == "prioritized":
            rb.update_priority(sampled["index"], priorities[i])

    return cycle


def _slice_buffer(config: ProfileConfig, *, kind: str) -> tuple[Any, int]:
    """A buffer of ``rows`` steps with the ``kind`` slice sampler, its boundaries read; and the batch size."""
    n, device = config.rows, config.device
    g = torch.Generator().manual_seed(config.seed)
    # Without replacement, episodes that all hold a slice: the epoch's picks then go straight to
    # the window draw (a shorter one would be dropped from its batch, a size read on the host);
    # and short enough that the call counted is not an epoch's last, which also draws the next
    # epoch's order (a few launches once per epoch).
    shortest, longest = (SLICE_LEN, 2 * SLICE_LEN) if kind == "without-replacement" else (20, 200)
    lengths = torch.randint(shortest, longest + 1, (n // shortest + 1,), generator=g)
    if kind == "without-replacement":
        # Whole episodes only: the one that would cross row n ends there, or joins its predecessor.
        ends = lengths.cumsum(0)
        k = int((ends < n).sum())
        last = n - (int(ends[k - 1]) if k else 0)
        lengths = lengths[: k + 1].clone()
        lengths[k] = last
        if last < shortest and k:
            lengths[k - 1] += last
            lengths = lengths[:k]
    episode = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)[:n]
    done = torch.zeros(n, 1, dtype=torch.bool)
    done[:-1, 0] = episode[1:] != episode[:-1]
    data = TensorDict({"obs": torch.randn(n, 4, generator=g), "episode": episode, ("next", "done"): done}, [n])
    num_slices = max(config.batch_size // SLICE_LEN, 1)
    if kind == "prioritized":
        sampler = gpubuf.PrioritizedSliceSampler(n, alpha=0.7, beta=0.5, num_slices=num_slices, traj_key="episode")
    elif kind == "without-replacement":
        sampler = gpubuf.SliceSamplerWithoutReplacement(num_slices=num_slices, traj_key="episode")
    else:
        sampler = gpubuf.SliceSampler(num_slices=num_slices, traj_key="episode")
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.LazyTensorStorage(n, device=device), sampler=sampler, backend=config.backend,
        generator=torch.Generator(device=device).manual_seed(config.seed),
    )
    rb.extend(data.to(device))
    batch = num_slices * SLICE_LEN
    rb.sample(batch)  # reads the boundaries written (work proportional to the rows, once)
    return rb, batch


#: name -> builder(config) of the call to count: the profiled sample and extend, and the
#: prioritized cycle with priorities already on the device.
WORKLOADS: dict[str, Callable[[ProfileConfig], Callable[[], Any]]] = {
    "sample": PROFILED["sample"].build,
    "extend": PROFILED["extend"].build,
    "prioritized-cycle": _prioritized_cycle,
    "slice-sample": lambda config: _slice_sample(config, kind="uniform"),
    "prioritized-slice-sample": lambda config: _slice_sample(config, kind="prioritized"),
    "slice-sample-without-replacement": lambda config: _slice_sample(config, kind="without-replacement"),
    "slice-cycle": lambda config: _slice_cycle(config, kind="uniform"),
    "prioritized-slice-cycle": lambda config: _slice_cycle(config, kind="prioritized"),
}


def count_workloads(
    device: torch.device,
    *,
    rows: int,
    batches: Sequence[int],
    backend: str = "auto",
    workloads: Sequence[str] = tuple(WORKLOADS),
    row_kind: str = "transition",
    host_calls: int = 0,
    host_profile: bool = False,
) -> list[dict[str, Any]]:
    """Counts one call of each workload at each batch size; one dict per count.

    Args:
        host_calls: when positive, also time that many calls (see the module docstring).
        host_profile: with ``host_calls``, also profile that many calls (see :func:`host_profile_of`).

    Returns:
        Dicts with ``workload``, ``batch``, ``launches``, ``triton_launches``, ``torch_ops``,
        ``host_syncs``, ``host_to_device``, ``kernels`` (launches by name) and ``syncs``; with
        ``host_calls``, ``host_us`` (microseconds a call) and ``kernels_run`` (False where the
        Triton kernels were skipped); with ``host_profile`` too, ``host_profile``.
    """
    if host_profile and host_calls <= 0:
        raise ValueError(f"host_profile profiles the timed calls: it needs host_calls > 0, got {host_calls}")
    results = []
    for name in workloads:
        for batch in batches:
            config = ProfileConfig(name, device=device, rows=rows, batch_size=batch, row_kind=row_kind, backend=backend)
            call = WORKLOADS[name](config)
            call()  # warm-up: lazy allocations, pointer tables, compiled kernels
            with count_device_work(device) as work:
                call()
            result = {
                "workload": name,
                "batch": batch,
                "launches": work.launches,
                "triton_launches": work.triton_launches,
                "torch_ops": work.torch_ops,
                "host_syncs": work.host_syncs,
                "host_to_device": work.host_to_device,
                "kernels": dict(work.kernels),
                "syncs": work.syncs,
            }
            if host_calls > 0:
                result["host_us"], result["kernels_run"] = _host_time(call, device, host_calls)
                if host_profile:
                    result["host_profile"] = host_profile_of(call, device, host_calls)
            results.append(result)
    return results


def _host_work(device: torch.device) -> contextlib.AbstractContextManager:
    """Where the timed and profiled calls run: on CUDA as they are; on the interpreted path with
    the Triton launches skipped (:func:`host_only`), so that only the host's own work is in them."""
    return contextlib.nullcontext() if device.type == "cuda" else host_only()


def _host_time(call: Callable[[], Any], device: torch.device, calls: int) -> tuple[float, bool]:
    """Microseconds a call over ``calls`` calls back to back, and whether the kernels ran."""
    interpreted = device.type != "cuda"
    with _host_work(device):
        call()
        if not interpreted:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            call()
        if not interpreted:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    return elapsed / calls * 1e6, not interpreted


#: Where a profiled function's time is counted, by the first part of its file's path that
#: matches (``gpubuf_kernels`` before ``gpubuf``); C functions (no file) count as ``"C calls"``.
_PLACES = (("/gpubuf_kernels/", "gpubuf launchers"), ("/gpubuf/", "gpubuf"), ("/triton/", "triton"),
           ("/tensordict/", "tensordict"), ("/torch/", "torch"))


def _place(filename: str) -> str:
    if filename == "~":
        return "C calls"
    for part, place in _PLACES:
        if part in filename:
            return place
    return "other Python"


def host_profile_of(call: Callable[[], Any], device: torch.device, calls: int, top: int = 12) -> dict[str, Any]:
    """``calls`` calls under :mod:`cProfile`: where their host time goes.

    Profiled times run slower than unprofiled ones (each Python call pays the profiler), so the
    shares are what to read; the microseconds only rank.

    Returns:
        ``{"by_place": {place: share of the time}, "top": [{"function", "place", "us",
        "calls"}, ...]}``: the time of each place (see :data:`_PLACES`) over the total, and the
        ``top`` functions by their own time, with microseconds and calls per call of the workload.
    """
    profiler = cProfile.Profile()
    with _host_work(device):
        call()
        profiler.enable()
        for _ in range(calls):
            call()
        profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = pstats.Stats(profiler).stats
    by_place: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, count, own, _, _) in stats.items():
        place = _place(filename)
        by_place[place] = by_place.get(place, 0.0) + own
        where = name if filename == "~" else f"{'/'.join(filename.split('/')[-2:])}:{line}({name})"
        functions.append((own, count, where, place))
    total = sum(by_place.values()) or 1.0
    functions.sort(reverse=True)
    return {
        "by_place": {place: own / total for place, own in sorted(by_place.items(), key=lambda kv: -kv[1])},
        "top": [{"function": where, "place": place, "us": own / calls * 1e6, "calls": count / calls}
                for own, count, where, place in functions[:top]],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpubuf.tools.counts", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "torch", "numba"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 65_536])
    parser.add_argument("--workload", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--host-calls", type=int, default=0, help="also time this many calls of each (see above)")
    parser.add_argument("--host-profile", action="store_true",
                        help="with --host-calls, also profile them: where the host time goes (see above)")
    parser.add_argument("--json", default=None, help="write the counts and the environment here")
    args = parser.parse_args(argv)
    if args.host_profile and args.host_calls <= 0:
        parser.error("--host-profile profiles the timed calls: give --host-calls N (N > 0) with it")
    device = torch.device(args.device)
    results = count_workloads(
        device, rows=args.rows, batches=args.batch, backend=args.backend, workloads=args.workload,
        host_calls=args.host_calls, host_profile=args.host_profile,
    )
    for r in results:
        print(
            f"{r['workload']:>24} B={r['batch']:<7} {r['launches']:4d} launches ({r['triton_launches']} Triton, "
            f"{r['torch_ops']} torch), {r['host_syncs']} host syncs: "
            + ", ".join(f"{k} x{v}" for k, v in sorted(r["kernels"].items(), key=lambda kv: -kv[1]))
            + (f"; syncs: {', '.join(r['syncs'])}" if r["syncs"] else "")
            + (f"; {r['host_us']:.1f} us a call" + ("" if r["kernels_run"] else " (host only, kernels skipped)")
               if "host_us" in r else "")
        )
        if "host_profile" in r:
            profile = r["host_profile"]
            print(" " * 26 + "host time: " + ", ".join(f"{place} {share:.0%}" for place, share in profile["by_place"].items()))
            for entry in profile["top"][:6]:
                print(" " * 30 + f"{entry['us']:7.1f} us  x{entry['calls']:<5.1f} {entry['function']} ({entry['place']})")
    if args.json:
        from gpubuf.tools.bench import environment

        meta = environment.collect(device)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "backend": args.backend, "rows": args.rows, "counts": results}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
