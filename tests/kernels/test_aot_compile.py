"""Every kernel specialisation the launchers produce compiles for sm_80 and sm_90 without spills
(but the few bytes of ``SPILL_TOLERANCE_BYTES``).

Runs ``python -m gpubuf.tools.aot`` in a child process with Triton's interpreter off (the check
compiles the jitted functions, which the interpreter replaces). The committed table
``benchmarks/results/aot/aot.json`` is handed over as ``--reuse``: specialisations whose kernel
sources, signature, target and Triton version are unchanged keep their committed row, the others
compile here (all of them under another Triton version than the table's: slower). The table
written must then equal the committed one row for row, so a kernel change comes with its
regenerated table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "benchmarks" / "results" / "aot" / "aot.json"

pytest.importorskip("triton.backends.nvidia.compiler")

from gpubuf.tools.aot import SPILL_TOLERANCE_BYTES  # noqa: E402


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = tmp_path_factory.mktemp("aot")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run(
        [sys.executable, "-m", "gpubuf.tools.aot", "--out", str(out), "--reuse", str(COMMITTED)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    return run, json.loads((out / "aot.json").read_text()) if (out / "aot.json").exists() else None


def test_every_specialisation_compiles_without_spills(table):
    run, written = table
    assert run.returncode == 0, run.stdout + run.stderr
    rows = written["rows"]
    assert {row["arch"] for row in rows} == {80, 90}
    for row in rows:
        assert row["error"] is None, row
        assert row["spill_stores"] <= SPILL_TOLERANCE_BYTES and row["spill_loads"] <= SPILL_TOLERANCE_BYTES, row
        assert row["registers"] and 0 < row["occupancy"] <= 1, row


def test_the_gathers_stay_at_128_registers_with_16_byte_accesses(table):
    _, written = table
    gathers = [row for row in written["rows"] if row["module"] in ("gather", "gather_packed")]
    assert gathers
    for row in gathers:
        assert row["registers"] <= 128 and row["vector_16b"], row


def test_the_committed_table_is_the_one_the_kernels_give(table):
    _, written = table
    committed = json.loads(COMMITTED.read_text())
    if written["meta"]["triton"] != committed["meta"]["triton"]:
        pytest.skip(f"the table was made with Triton {committed['meta']['triton']}, this is {written['meta']['triton']}")
    assert [row["key"] for row in written["rows"]] == [row["key"] for row in committed["rows"]], (
        "kernels or specialisations changed: regenerate with `python -m gpubuf.tools.aot --out benchmarks/results/aot`"
    )
    assert written["rows"] == committed["rows"]


def test_every_triton_launch_goes_through_the_launch_helper():
    """The device-work counter hears of Triton launches at ``gpubuf_kernels._launch.launch`` only."""
    import re

    direct = []
    for path in sorted((ROOT / "kernels" / "gpubuf_kernels").glob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\b_\w*_kernel\[", line):
                direct.append(f"{path.name}:{number}: {line.strip()}")
    assert not direct, "launch these through gpubuf_kernels._launch.launch:\n" + "\n".join(direct)
