"""Profiling sessions on the CPU: a tiny workload through torch.profiler, its trace and its table."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpubuf.tools.profile import (
    WORKLOADS,
    ProfileConfig,
    add_profile_parser,
    format_table,
    main,
    profile_workload,
    register,
    run_profile,
)

TINY = dict(device=torch.device("cpu"), rows=2_000, batch_size=64, steps=3, warmup=1)


def _trace_names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    return {event.get("name") for event in trace["traceEvents"]}


def test_sample_session_writes_a_trace_and_a_table(tmp_path):
    result = profile_workload(ProfileConfig("sample", out_dir=tmp_path, **TINY))
    assert result.trace_path is not None and result.trace_path.parent == tmp_path
    names = _trace_names(result.trace_path)
    assert "gpubuf::sample" in names and "gpubuf::gather_rows" in names and "aten::index_select" not in names
    ops = {row.name: row for row in result.ops}
    # Ten fields gathered per sample in one compiled call, which the trace shows as a named range.
    assert ops["gpubuf::gather_rows"].calls_per_step == pytest.approx(1)
    assert ops["gpubuf::sample"].kind == "range" and ops["gpubuf::sample"].calls_per_step == 1
    assert result.wall_s > 0 and result.device_s > 0
    assert result.host_overhead_s == pytest.approx(max(result.wall_s - result.device_s, 0.0))
    # One call counted: the draw's one torch op (the gather is compiled, not an aten op), no sync.
    assert "aten:index_select.default" not in result.work.kernels and result.work.host_syncs == 0
    table = format_table(result)
    for text in ("gpubuf::gather_rows", "host overhead per call", "device time per call", str(result.trace_path),
                 f"{result.work.launches} launches"):
        assert text in table


@pytest.mark.parametrize("workload", ["extend", "gather", "sample-prefetch"])
def test_other_workloads_run(tmp_path, workload):
    result = profile_workload(ProfileConfig(workload, out_dir=tmp_path, **TINY))
    assert result.trace_path.exists()
    assert f"gpubuf::{workload}" in _trace_names(result.trace_path)
    assert result.ops


def test_no_trace_option(tmp_path):
    result = profile_workload(ProfileConfig("gather", out_dir=tmp_path, trace=False, **TINY))
    assert result.trace_path is None and not list(tmp_path.iterdir())


def test_cli_hooks(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="gpubuf")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_profile_parser(subparsers)
    args = parser.parse_args(
        ["profile", "sample", "--device", "cpu", "--rows", "1000", "-B", "32", "--steps", "2", "--warmup", "0",
         "--out-dir", str(tmp_path), "--top", "5"]
    )
    assert args.func is run_profile
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "gpubuf profile: sample" in out and "host overhead per call" in out
    assert len(list(tmp_path.glob("sample-*.json"))) == 1
    assert register is add_profile_parser


def test_unavailable_workloads_exit_with_a_reason(tmp_path, capsys):
    # The host-to-CUDA workload needs a GPU; asked for on the CPU it says so and exits 2.
    assert main(["sample-h2d", "--device", "cpu", "--out-dir", str(tmp_path)]) == 2
    assert "cannot run" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_prioritized_cycle(tmp_path, capsys):
    if WORKLOADS["prioritized"].unavailable(ProfileConfig("prioritized")):
        # Until the prioritized buffers exist, the workload says why it cannot run.
        assert main(["prioritized", "--device", "cpu", "--out-dir", str(tmp_path)]) == 2
        assert "not available yet" in capsys.readouterr().out
        return
    result = profile_workload(ProfileConfig("prioritized", out_dir=tmp_path, **TINY))
    assert result.trace_path.exists()
    assert "gpubuf::prioritized" in _trace_names(result.trace_path)


def test_every_workload_is_described():
    assert {"sample", "extend", "prioritized"} <= set(WORKLOADS)
    assert all(w.description for w in WORKLOADS.values())


def test_profiling_script_runs(tmp_path):
    script = Path(__file__).resolve().parents[2] / "profiling" / "profile_sample.py"
    done = subprocess.run(
        [sys.executable, str(script), "--device", "cpu", "--rows", "500", "-B", "16", "--steps", "2",
         "--warmup", "0", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host overhead per call" in done.stdout
    assert list(tmp_path.glob("sample-*.json"))
