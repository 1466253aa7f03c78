"""The benchmark harness on a tiny configuration: rows, ratios, unavailable TorchRL, outputs, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

import gpubuf
from gpubuf.tools.bench import prioritized, report, torchrl_compat
from gpubuf.tools.bench.config import FULL, QUICK, BenchConfig, bar_for, parse_ops, time_bar_for
from gpubuf.tools.bench.harness import run_benchmark
from gpubuf.tools.bench.timing import measure_round_robin
from gpubuf.tools.bench.workloads import PRB, RB, ROW_BYTES, TDPRB, TDRB, OpSpec, make_transitions
from gpubuf.tools.cli import main
from helpers import switch_numba

TINY = BenchConfig(
    name="tiny",
    rows=2_000,
    extend_chunks=(100, 1_000),
    sample_batches=(32, 512),
    warmup=1,
    repeats=3,
    min_repeats=2,
    min_block_s=0.0,
)
PROVIDERS = {("gpubuf", TDRB), ("torchrl", TDRB), ("raw", None), ("gpubuf", RB), ("torchrl", RB)}
ROW_FIELDS = {
    "op", "size", "buffer_rows", "provider", "buffer", "label", "status", "reason", "p50_s", "p20_s", "p80_s",
    "repeats", "calls_per_repeat", "bytes_moved", "gb_per_s", "items_per_s", "device", "device_name",
    "versions", "git_sha",
}  # fmt: skip


def _torchrl_rows(result):
    return [r for r in result["rows"] if r["provider"] == "torchrl"]


@pytest.fixture(scope="module")
def result():
    return run_benchmark(TINY, device="cpu", progress=None)


def test_rows_have_fields_and_every_provider(result):
    assert row_ops(result) == [("extend", 100), ("extend", 1_000), ("sample", 32), ("sample", 512)]
    for op in row_ops(result):
        rows = [r for r in result["rows"] if (r["op"], r["size"]) == op]
        assert {(r["provider"], r["buffer"]) for r in rows} == PROVIDERS
    for row in result["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["device"] == "cpu" and row["buffer_rows"] == TINY.rows
        assert set(row["versions"]) == {"torch", "triton", "tensordict", "torchrl", "numba", "gpubuf"}
        assert row["bytes_moved"] == 2 * row["size"] * ROW_BYTES
        if row["provider"] != "torchrl":
            assert row["status"] == report.OK
        if row["status"] == report.OK:
            assert 0 < row["p20_s"] <= row["p50_s"] <= row["p80_s"]
            assert row["repeats"] >= TINY.min_repeats
            assert row["gb_per_s"] == pytest.approx(row["bytes_moved"] / row["p50_s"] / 1e9)
            assert row["items_per_s"] == pytest.approx(row["size"] / row["p50_s"])
        else:
            assert row["status"] == report.UNAVAILABLE and row["reason"]


def test_meta_records_the_cpu_tree_path_and_torchrl_extension(result, monkeypatch, tmp_path):
    from gpubuf.tools.bench import environment

    meta = result["meta"]
    assert meta["cpu_kernels"] == "numba"  # the test extra installs Numba
    assert meta["torchrl_extension"] in ("shipped", "rebuilt")
    switch_numba(monkeypatch, on=False)
    assert environment.collect(__import__("torch").device("cpu"))["cpu_kernels"] == "torch"
    # A package directory holding the shipped binary's backup reads as rebuilt.
    (tmp_path / "_torchrl.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    assert environment.torchrl_extension(tmp_path) == "shipped"
    (tmp_path / "_torchrl.cpython-311-x86_64-linux-gnu.so.orig").write_bytes(b"")
    assert environment.torchrl_extension(tmp_path) == "rebuilt"


def row_ops(result):
    ops = []
    for row in result["rows"]:
        if (row["op"], row["size"]) not in ops:
            ops.append((row["op"], row["size"]))
    return ops


def test_ratios_are_gpubuf_over_baseline_medians(result):
    rows = {(r["op"], r["size"], r["provider"], r["buffer"]): r for r in result["rows"]}
    ratios = result["ratios"]
    # Per op: TDRB and RB, each against TorchRL (same class) and raw.
    assert len(ratios) == 4 * 2 * 2
    for entry in ratios:
        mine = rows[(entry["op"], entry["size"], "gpubuf", entry["buffer"])]
        base_buffer = entry["buffer"] if entry["baseline"] == "torchrl" else None
        base = rows[(entry["op"], entry["size"], entry["baseline"], base_buffer)]
        if base["status"] == report.OK:
            assert entry["ratio"] == pytest.approx(mine["p50_s"] / base["p50_s"])
        else:
            assert entry["ratio"] is None and entry["reason"]


def test_unimportable_torchrl_gives_unavailable_rows(monkeypatch):
    # None in sys.modules makes `import torchrl.data` raise, whether or not it was imported before.
    monkeypatch.setitem(sys.modules, "torchrl", None)
    monkeypatch.setitem(sys.modules, "torchrl.data", None)
    result = run_benchmark(TINY, device="cpu", progress=None)
    torchrl_rows = _torchrl_rows(result)
    assert len(torchrl_rows) == 2 * len(TINY.ops())
    for row in torchrl_rows:
        assert row["status"] == report.UNAVAILABLE
        assert "cannot import torchrl.data" in row["reason"]
        assert row["p50_s"] is None
    assert all(r["status"] == report.OK for r in result["rows"] if r["provider"] != "torchrl")
    vs_torchrl = [r for r in result["ratios"] if r["baseline"] == "torchrl"]
    assert vs_torchrl and all(r["ratio"] is None and "torchrl unavailable" in r["reason"] for r in vs_torchrl)
    assert all(r["ratio"] is not None for r in result["ratios"] if r["baseline"] == "raw")
    assert "unavailable" in report.format_table(result)


def test_failing_construction_or_first_call_is_reported(monkeypatch):
    class BrokenStorage:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("extension not loaded")

    class SampleFails(gpubuf.TensorDictReplayBuffer):
        def sample(self, *args, **kwargs):
            raise RuntimeError("sampler broke")

    # A stand-in "torchrl.data": TDRB builds but cannot sample; RB cannot even build its storage.
    fake = types.SimpleNamespace(
        TensorDictReplayBuffer=SampleFails, ReplayBuffer=gpubuf.ReplayBuffer, LazyTensorStorage=gpubuf.LazyTensorStorage
    )
    calls = {"n": 0}

    def namespace():
        calls["n"] += 1
        if calls["n"] == 2:  # the second TorchRL provider built is RB
            return types.SimpleNamespace(
                TensorDictReplayBuffer=SampleFails, ReplayBuffer=gpubuf.ReplayBuffer, LazyTensorStorage=BrokenStorage
            )
        return fake

    monkeypatch.setattr(torchrl_compat, "namespace", namespace)
    result = run_benchmark(TINY, device="cpu", progress=None)
    by = {(r["op"], r["buffer"]): r for r in _torchrl_rows(result)}
    assert by[("extend", TDRB)]["status"] == report.OK
    assert by[("sample", TDRB)]["status"] == report.UNAVAILABLE
    assert by[("sample", TDRB)]["reason"] == "first call failed: RuntimeError: sampler broke"
    for kind in ("extend", "sample"):
        assert by[(kind, RB)]["status"] == report.UNAVAILABLE
        assert by[(kind, RB)]["reason"] == "construction failed: RuntimeError: extension not loaded"


def test_no_torchrl_option_skips_torchrl():
    config = BenchConfig(name="tiny", rows=500, extend_chunks=(100,), sample_batches=(16,), warmup=0, repeats=2,
                         min_repeats=1, min_block_s=0.0)  # fmt: skip
    result = run_benchmark(config, device="cpu", include_torchrl=False, progress=None)
    for row in _torchrl_rows(result):
        assert row["status"] == report.UNAVAILABLE and "not requested" in row["reason"]
    assert any("N = 500 rows" in note for note in result["meta"]["notes"])


def test_json_and_png_are_written(result, tmp_path):
    json_path = report.write_json(result, tmp_path / "out" / "r.json")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(result))
    png_path = report.write_plot(result, tmp_path / "out" / "r.png")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_every_row(result):
    table = report.format_table(result)
    for label in ("gpubuf TDRB", "gpubuf RB", "raw", "torchrl TDRB"):
        assert label in table
    assert "sample 512" in table and "extend 1,000" in table


def test_round_robin_interleaves_and_counts():
    order = []
    calls = {name: (lambda name=name: order.append(name)) for name in "abc"}
    timings = measure_round_robin(calls, warmup=0, repeats=4, min_repeats=1, min_block_s=0.0)
    assert [t.repeats for t in timings.values()] == [4, 4, 4]
    timed = order[9:]  # after three calibration calls each
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"]


def test_parse_ops():
    assert parse_ops(None, TINY) == TINY.ops()
    assert parse_ops(["sample"], TINY) == [OpSpec("sample", 32), OpSpec("sample", 512)]
    assert parse_ops(["extend:100", "sample:64"], TINY) == [OpSpec("extend", 100), OpSpec("sample", 64)]
    assert parse_ops(["cycle:64"], TINY) == [OpSpec("cycle", 64)]
    assert parse_ops(["cycle"], CYCLE) == [OpSpec("cycle", 32), OpSpec("cycle", 300)]
    with pytest.raises(ValueError):
        parse_ops(["gather"], TINY)
    with pytest.raises(ValueError):
        parse_ops(["extend:5000"], TINY)


def test_cli_bench_help():
    done = subprocess.run(
        [sys.executable, "-m", "gpubuf.tools.cli", "bench", "--help"], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    for option in ("--device", "--quick", "--full", "--out", "--no-torchrl", "--ops"):
        assert option in done.stdout


def test_cli_bench_writes_outputs(tmp_path, capsys):
    status = main(["bench", "--device", "cpu", "--rows", "1000", "--ops", "extend:100", "sample:32",
                   "--out", str(tmp_path), "--no-torchrl"])  # fmt: skip
    assert status == 0
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".png"]
    stem = next(tmp_path.glob("*.json")).stem
    assert stem.startswith("bench-cpu-")
    out = capsys.readouterr()
    assert "gpubuf TDRB" in out.out and "N = 1,000 rows" in out.out
    assert "[gpubuf bench]" in out.err


def test_cli_rejects_cuda_without_cuda(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


# ------------------------------------------------------------------------------ prioritized cycle
CYCLE = BenchConfig(
    name="tiny-cycle",
    rows=2_000,
    extend_chunks=(),
    sample_batches=(),
    cycle_batches=(32, 300),
    warmup=1,
    repeats=3,
    min_repeats=2,
    min_block_s=0.0,
)
CYCLE_PROVIDERS = {("gpubuf", TDPRB), ("torchrl", TDPRB), ("raw", None), ("gpubuf", PRB), ("torchrl", PRB)}


@pytest.fixture(scope="module")
def cycle_result():
    return run_benchmark(CYCLE, device="cpu", progress=None)


def test_cycle_rows_ratios_and_table(cycle_result):
    assert row_ops(cycle_result) == [("cycle", 32), ("cycle", 300)]
    for op in row_ops(cycle_result):
        rows = [r for r in cycle_result["rows"] if (r["op"], r["size"]) == op]
        assert {(r["provider"], r["buffer"]) for r in rows} == CYCLE_PROVIDERS
    for row in cycle_result["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["bytes_moved"] == 2 * row["size"] * ROW_BYTES
        if row["provider"] != "torchrl":
            assert row["status"] == report.OK and 0 < row["p20_s"] <= row["p50_s"] <= row["p80_s"]
        elif row["status"] != report.OK:
            # Here, TorchRL's C++ extension may not load: a reason, never a crash.
            assert row["status"] == report.UNAVAILABLE and row["reason"]
    rows = {(r["op"], r["size"], r["provider"], r["buffer"]): r for r in cycle_result["rows"]}
    # Per op: TDPRB and PRB, each against TorchRL (same class) and raw.
    assert len(cycle_result["ratios"]) == 2 * 2 * 2
    for entry in cycle_result["ratios"]:
        mine = rows[(entry["op"], entry["size"], "gpubuf", entry["buffer"])]
        base_buffer = entry["buffer"] if entry["baseline"] == "torchrl" else None
        base = rows[(entry["op"], entry["size"], entry["baseline"], base_buffer)]
        if base["status"] == report.OK:
            assert entry["ratio"] == pytest.approx(mine["p50_s"] / base["p50_s"])
        else:
            assert entry["ratio"] is None and "torchrl unavailable" in entry["reason"]
    table = report.format_table(cycle_result)
    assert "cycle 300" in table and "gpubuf TDPRB" in table and "gpubuf PRB" in table


@pytest.mark.parametrize(
    "error,reason",
    [
        (RuntimeError("SumSegmentTreeFp32 is not available"), "construction failed: RuntimeError: SumSegmentTreeFp32"),
        (torchrl_compat.TorchRLUnavailable("extension does not load"), "extension does not load"),
    ],
)
def test_cycle_torchrl_without_extension_is_unavailable(monkeypatch, error, reason):
    def prioritized_namespace():
        raise error

    monkeypatch.setattr(torchrl_compat, "prioritized_namespace", prioritized_namespace)
    config = BenchConfig(name="tiny", rows=500, extend_chunks=(), sample_batches=(), cycle_batches=(16,), warmup=0,
                         repeats=2, min_repeats=1, min_block_s=0.0)  # fmt: skip
    result = run_benchmark(config, device="cpu", progress=None)
    torchrl_rows = _torchrl_rows(result)
    assert len(torchrl_rows) == 2
    assert all(r["status"] == report.UNAVAILABLE and reason in r["reason"] for r in torchrl_rows)
    assert all(r["status"] == report.OK for r in result["rows"] if r["provider"] != "torchrl")


def test_cycle_is_in_the_configurations_and_bars():
    assert OpSpec("cycle", 256) in QUICK.ops()
    assert {OpSpec("cycle", 256), OpSpec("cycle", 65_536)} <= set(FULL.ops())
    for size in (256, 65_536):
        bar = bar_for("cycle", size, "torchrl", TDPRB)
        assert bar is not None and bar.max_ratio == pytest.approx(1 / 3)
    # The cycle's bars depend on the device: 3x on a CPU, 20x (and absolute times) on CUDA.
    assert bar_for("cycle", 256, "torchrl", TDPRB, "cuda:0").max_ratio == pytest.approx(1 / 20)
    assert bar_for("cycle", 256, "torchrl", TDPRB, "cpu").max_ratio == pytest.approx(1 / 3)
    # Bars without a device hold everywhere.
    assert bar_for("sample", 256, "torchrl", TDRB, "cuda:1") is bar_for("sample", 256, "torchrl", TDRB, "cpu")


# ------------------------------------------------------------------------------ the sampler's steps alone
SAMPLER = replace(CYCLE, name="tiny-sampler", rows=3_000, cycle_batches=(), sampler_batches=(40, 700))


@pytest.fixture(scope="module")
def sampler_result():
    return run_benchmark(SAMPLER, device="cpu", progress=None)


def test_draw_and_update_time_the_tdprb_sampler_of_each_library(sampler_result):
    assert row_ops(sampler_result) == [("draw", 40), ("update", 40), ("draw", 700), ("update", 700)]
    for op in row_ops(sampler_result):
        rows = [r for r in sampler_result["rows"] if (r["op"], r["size"]) == op]
        # Both buffers hold the same sampler class: timed once; no raw floor without a tree.
        assert {(r["provider"], r["buffer"]) for r in rows} == {("gpubuf", TDPRB), ("torchrl", TDPRB)}
    for row in sampler_result["rows"]:
        assert set(row) == ROW_FIELDS
        assert row["bytes_moved"] == 0 and row["gb_per_s"] is None  # no rows move
        if row["provider"] == "gpubuf":
            assert row["status"] == report.OK and 0 < row["p20_s"] <= row["p50_s"] <= row["p80_s"]
            assert row["items_per_s"] == pytest.approx(row["size"] / row["p50_s"])
    assert {(r["op"], r["size"], r["baseline"]) for r in sampler_result["ratios"]} == {
        (kind, size, "torchrl") for kind in ("draw", "update") for size in (40, 700)
    }
    assert sampler_result["time_bars"] == []  # the time bars are CUDA's
    table = report.format_table(sampler_result)
    assert "draw 700" in table and "update 40" in table


def test_the_sampler_steps_draw_from_and_write_to_the_buffer_s_tree():
    data = make_transitions(500)
    rb = prioritized.build_prioritized(gpubuf, TDPRB, gpubuf.LazyTensorStorage(500))
    rb.extend(data)
    prioritized.fill_priorities(rb, data)
    index, info = prioritized.sampler_draw(rb, 64)()
    assert index.shape == (64,) and bool(((index >= 0) & (index < 500)).all())
    assert info["priority_weight"].shape == (64,)
    update = prioritized.sampler_update(rb, 64, torch.device("cpu"))
    expected = prioritized.index_pool(64, 500, torch.device("cpu"))  # the same vectors, in the same order
    seen = []
    for _ in range(3):
        before = rb.sampler._tree.values().clone()
        update()
        vector = set(expected().tolist())
        changed = set((rb.sampler._tree.values() != before).nonzero().flatten().tolist())
        # New random priorities land at this call's indices (any of them may keep its value by chance).
        assert changed <= vector and len(changed) >= len(vector) - 2
        seen.append(vector)
    assert seen[0] != seen[1] != seen[2]  # the calls rotate among vectors


def test_sampler_steps_and_time_bars_are_configured():
    for config in (QUICK, FULL):
        assert {OpSpec("draw", 65_536), OpSpec("update", 65_536)} <= set(config.ops())
    assert parse_ops(["draw:64", "update"], SAMPLER) == [OpSpec("draw", 64), OpSpec("update", 40), OpSpec("update", 700)]
    for kind in ("draw", "update"):
        bar = time_bar_for(kind, 65_536, TDPRB, "cuda:0")
        assert bar is not None and bar.max_s == pytest.approx(20e-6)
        assert time_bar_for(kind, 65_536, TDPRB, "cpu") is None
    assert time_bar_for("cycle", 256, TDPRB, "cuda").max_s == pytest.approx(100e-6)


def _gpubuf_row(op, size, p50, device="cuda:0", status=report.OK):
    return {"op": op, "size": size, "provider": "gpubuf", "buffer": TDPRB, "device": device, "status": status,
            "reason": None if status == report.OK else "broke", "p50_s": p50 if status == report.OK else None}  # fmt: skip


def test_time_bars_are_met_missed_or_unavailable_and_printed():
    rows = [
        _gpubuf_row("update", 65_536, 15e-6),
        _gpubuf_row("draw", 65_536, 25e-6),
        _gpubuf_row("cycle", 256, None, status=report.UNAVAILABLE),
        _gpubuf_row("draw", 65_536, 1e-6, device="cpu"),  # no time bar on a CPU
        _gpubuf_row("draw", 4_096, 1e-6),  # nor at other sizes
    ]
    bars = report.compute_time_bars(rows)
    assert [(b["op"], b["meets_bar"]) for b in bars] == [("update", True), ("draw", False), ("cycle", None)]
    assert bars[2]["reason"] == "gpubuf unavailable: broke"
    result = {"meta": {"config": {"name": "x", "rows": 1}, "device": "cuda:0", "device_name": "GPU",
                       "torch_threads": 1}, "rows": [], "ratios": [], "time_bars": bars}  # fmt: skip
    table = report.format_table(result)
    assert "update 65,536 gpubuf TensorDictPrioritizedReplayBuffer: at most 20 us on cuda: median 15.0 us met" in table
    assert "draw 65,536 gpubuf TensorDictPrioritizedReplayBuffer: at most 20 us on cuda: median 25.0 us MISSED" in table
    assert "cycle 256 gpubuf TensorDictPrioritizedReplayBuffer: at most 100 us on cuda: n/a (gpubuf unavailable: broke)" in table
