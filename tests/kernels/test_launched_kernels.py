"""What the device path launches is what the ahead-of-time check compiles.

Triton's JIT types a launch's arguments from their values on the GPU: a Python float becomes
float32 unless the parameter is annotated, an int takes 32 or 64 bits by its size, a bool tensor
is ``*u1``. The ``SPECIALIZATIONS`` tables of ``gpubuf_kernels`` are written by hand, so they can
list types the launchers never pass (as they once listed float64 exponents the JIT passed as
float32, and the kernels did not compile on a GPU). These tests run the counted workloads of
``gpubuf.tools.counts`` (and a float64-leaf cycle, the packed storage's compaction and a
compressed storage's decode) on the
device path, record every launch as the JIT would specialise it (``gpubuf.tools.aot.launched``),
and check that

- the table lists each launch's parameter types (so the committed table is what a GPU compiles);
- each distinct launch compiles for sm_90 with no more spill than the table's tolerance.

On CPU the device path runs through Triton's interpreter; on CUDA the launches are the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import gpubuf
from gpubuf.tools.aot import launched, uncovered
from gpubuf.tools.counts import WORKLOADS
from gpubuf.tools.profile import ProfileConfig

ROOT = Path(__file__).resolve().parents[2]


def _float64_cycle(device: torch.device) -> None:
    rb = gpubuf.TensorDictPrioritizedReplayBuffer(
        alpha=0.6, beta=0.4, dtype=torch.float64, storage=gpubuf.LazyTensorStorage(500, device=device),
        backend="triton", batch_size=64,
    )
    rb.extend(TensorDict({"obs": torch.randn(300, 3)}, [300]).to(device))
    batch = rb.sample()
    rb.update_priority(batch["index"], torch.rand(64, dtype=torch.float64, device=device) + 0.1)


def _packed_compaction(device: torch.device) -> None:
    from gpubuf.storages.packed import PackedStorage

    gen = torch.Generator().manual_seed(3)
    items = [TensorDict(ids=torch.randint(0, 9, (n,), generator=gen)) for n in (3, 5, 2, 7, 4, 6, 1)]
    rb = gpubuf.ReplayBuffer(storage=PackedStorage(4, device=device), batch_size=3, backend="triton")
    rb.extend(items)  # overwrites rows: the arena compacts through the kernel
    rb.storage.compact()
    rb.sample()


def _compressed_sample(device: torch.device) -> None:
    rb = gpubuf.TensorDictReplayBuffer(
        storage=gpubuf.CompressedTensorStorage(64, device=device), backend="triton", batch_size=8
    )
    gen = torch.Generator().manual_seed(4)
    frames = torch.randint(0, 4, (40, 4, 16, 16), dtype=torch.uint8, generator=gen)
    rb.extend(TensorDict({"pixels": frames, "action": torch.randn(40, 2, generator=gen)}, [40]).to(device))
    rb.sample()


@pytest.fixture(scope="module")
def found():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with launched() as records:
        for name, build in WORKLOADS.items():
            config = ProfileConfig(name, device=device, rows=2000, batch_size=256, backend="triton")
            build(config)()
        _float64_cycle(device)
        _packed_compaction(device)
        _compressed_sample(device)
    return records


def test_every_workload_launches_kernels(found):
    kernels = {spec["kernel"] for _, spec in found}
    assert {"_gather_rows_kernel", "_write_rows_kernel", "_sumtree_claim_kernel", "_sumtree_write_kernel",
            "_sumtree_sample_kernel", "_slice_windows_kernel", "_sumtree_windows_kernel", "_episode_rows_kernel",
            "_episode_lists_kernel", "_start_exclusions_kernel", "_gather_packed_kernel", "_line_table_kernel",
            "_decode_lines_kernel"} <= kernels
    claims = [spec for _, spec in found if spec["kernel"] == "_sumtree_claim_kernel"]
    # The exponents reach the kernel as float64, whatever Triton's default for a Python float.
    assert {(spec["signature"]["alpha"], spec["signature"]["eps"]) for spec in claims} == {("fp64", "fp64")}
    assert {spec["constexprs"]["LIBDEVICE"] for spec in claims} == {True}  # as launched on a GPU


def test_the_table_lists_every_launch(found):
    assert uncovered(found) == []


def test_an_unlisted_type_is_reported():
    from gpubuf_kernels.sumtree import SPECIALIZATIONS

    spec = json.loads(json.dumps([s for s in SPECIALIZATIONS if s["kernel"] == "_sumtree_sample_kernel"][0]))
    assert uncovered([("sumtree", spec)]) == []
    spec["signature"]["beta"] = "fp32"  # what an unannotated Python float gives
    assert len(uncovered([("sumtree", spec)])) == 1
    spec["signature"]["beta"] = "fp64"
    spec["signature"]["n"] = "i64"  # a 64-bit scalar where the table has 32 bits
    assert len(uncovered([("sumtree", spec)])) == 1


def test_every_launch_compiles_for_sm_90(found, tmp_path):
    pytest.importorskip("triton.backends.nvidia.compiler")
    path = tmp_path / "launched.json"
    path.write_text(json.dumps(found, default=str))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    run = subprocess.run(
        [sys.executable, "-m", "gpubuf.tools.aot", "--launched", str(path), "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 problems" in run.stdout
