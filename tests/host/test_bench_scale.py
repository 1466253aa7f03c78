"""The scaling sweep (``gpubuf bench --scale``) on tiny sizes: every workload runs for every N, the
memory-mapped storage alone past the in-memory sizes, the round trips are checked, outputs written."""

from __future__ import annotations

import json

import pytest

from gpubuf.tools.bench import scale
from gpubuf.tools.cli import main


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    config = scale.ScaleConfig(
        sizes=(300, 1000), memmap_sizes=(2000,), batch=64, repeat=1, chunk=256,
        prioritized_max=1000, ckpt_tensor_max=300, scratch=str(tmp_path_factory.mktemp("scratch")),
        libraries=("gpubuf",), sync=False,
    )
    return scale.run_scale(config)


def _ops(result, n):
    return {(r["workload"], r["op"]) for r in result["rows"] if r["n"] == n}


def test_every_workload_runs_at_every_size(result):
    memmap = {("memmap", "fill"), ("memmap", "extend 256 into full"), ("memmap", "sample 64"),
              ("checkpoint memmap", "dumps"), ("checkpoint memmap", "loads")}
    tensor = {("fill", "fill"), ("fill", "extend 256 into full"), ("fill", "sample 64"),
              ("prioritized", "fill"), ("prioritized", "update_priority 64"), ("prioritized", "cycle 64")}
    assert _ops(result, 300) == memmap | tensor | {("checkpoint tensor", "dumps"), ("checkpoint tensor", "loads")}
    assert _ops(result, 1000) == memmap | tensor  # past ckpt_tensor_max: no in-memory round trip
    assert _ops(result, 2000) == memmap  # past the in-memory sweep: the memory-mapped storage alone
    for row in result["rows"]:
        assert row["seconds"]["gpubuf"] > 0
        assert row["speedup_vs_torchrl"] is None  # TorchRL was not run


def test_outputs(result, tmp_path):
    path = scale.write_json(result, tmp_path / "s.json")
    assert json.loads(path.read_text())["config"]["row_bytes"] == 48
    assert scale.write_plot(result, tmp_path / "s.png").stat().st_size > 0
    table = scale.format_table(result)
    assert len(table.splitlines()) == 2 + len(result["rows"])
    markdown = scale.format_markdown(result)
    assert markdown.splitlines()[0] == "| workload | op | 300 | 1000 | 2000 |"


def test_the_round_trip_check_compares_rows():
    import gpubuf

    chunk = scale.make_chunk("small", 100)
    a = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(100))
    b = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(100))
    a.extend(chunk)
    b.extend(chunk.clone())
    scale._check_round_trip(a, b, 100)
    b.storage._leaves[0][99, 0] += 1  # the last row is among the rows compared
    with pytest.raises(AssertionError, match="differ"):
        scale._check_round_trip(a, b, 100)
    b.extend(chunk[:1])
    c = gpubuf.TensorDictReplayBuffer(storage=gpubuf.LazyTensorStorage(100))
    c.extend(chunk[:50])
    with pytest.raises(AssertionError, match="rows"):
        scale._check_round_trip(a, c, 100)


@pytest.mark.parametrize("text,rows", [("16M", 16 << 20), ("500k", 500 << 10), ("1000", 1000), ("0.5M", 1 << 19)])
def test_parse_size(text, rows):
    assert scale.parse_size(text) == rows


@pytest.mark.parametrize("text", ["", "ten", "-1", "0"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        scale.parse_size(text)


def test_cli_rejects_unknown_workloads(capsys):
    assert main(["bench", "--scale", "--workloads", "fill,nope"]) == 2
    assert "nope" in capsys.readouterr().err
