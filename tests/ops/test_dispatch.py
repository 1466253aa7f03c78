"""Backend choice: by the tensor's device, the op's kernels, Numba's presence and GPUBUF_NUMBA."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gpubuf.errors import BackendUnavailableError
from gpubuf.ops import _dispatch
from gpubuf.ops._dispatch import KERNELS, check_backend, device_path, implementation, resolve, resolve_backend
from gpubuf.ops.gather_rows import gather_rows
from gpubuf.ops.write_rows import write_rows
from gpubuf.ops.sumtree import SumTree, sumtree_sample, sumtree_update
from helpers import switch_numba

pytest.importorskip("numba")


def test_auto_picks_the_cpu_kernel_only_for_ops_that_have_one():
    cpu = torch.zeros(1)
    assert resolve_backend(cpu, "auto", has_cpu_kernel=True) == "numba"
    assert resolve_backend(cpu, "auto") == "torch"
    assert resolve_backend(cpu, "torch", has_cpu_kernel=True) == "torch"


def test_environment_switch_turns_the_cpu_kernels_off(monkeypatch):
    switch_numba(monkeypatch, on=False)
    assert resolve_backend(torch.zeros(1), "auto", has_cpu_kernel=True) == "torch"
    # An explicit request still runs them: the switch only steers "auto".
    assert resolve_backend(torch.zeros(1), "numba", has_cpu_kernel=True) == "numba"


@pytest.mark.parametrize(("value", "picked"), [("0", "torch"), ("1", "numba"), (None, "numba")])
def test_the_environment_switch_is_read_when_gpubuf_is_imported(value, picked):
    """A process started with ``GPUBUF_NUMBA=0`` keeps the twins under "auto"; any other value, or
    none, lets the CPU kernels run."""
    env = {k: v for k, v in os.environ.items() if k != "GPUBUF_NUMBA"}
    if value is not None:
        env["GPUBUF_NUMBA"] = value
    code = ("import torch; from gpubuf.ops._dispatch import resolve_backend; "
            "print(resolve_backend(torch.zeros(1), 'auto', has_cpu_kernel=True))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == picked


def test_explicit_numba_where_it_cannot_run_raises():
    with pytest.raises(BackendUnavailableError, match="no CPU kernel"):
        resolve_backend(torch.zeros(1), "numba")
    with pytest.raises(BackendUnavailableError, match="no CPU kernel"):
        resolve("encode_rows_of_another_kind", torch.zeros(1), "numba")
    with pytest.raises(BackendUnavailableError, match="no Triton kernel"):
        resolve("encode_rows", torch.zeros(1), "triton")
    meta = torch.zeros(1, device="meta")
    with pytest.raises(BackendUnavailableError, match="CPU tensors only"):
        resolve_backend(meta, "numba", has_cpu_kernel=True)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend(torch.zeros(1), "cpp")


def test_missing_numba_raises_for_an_explicit_request(monkeypatch):
    monkeypatch.setattr(_dispatch, "numba_importable", lambda: False)
    assert resolve_backend(torch.zeros(1), "auto", has_cpu_kernel=True) == "torch"
    with pytest.raises(BackendUnavailableError, match="pip install gpubuf\\[cpu\\]"):
        resolve_backend(torch.zeros(1), "numba", has_cpu_kernel=True)


def test_sumtree_ops_run_the_chosen_cpu_path(monkeypatch):
    """Both CPU paths give the same tree and draws; a broken kernel module shows which one ran."""
    trees = {}
    for which in ("torch", "numba"):
        tree = SumTree(100, fanout=4)
        sumtree_update(tree, torch.arange(100), torch.rand(100, generator=torch.Generator().manual_seed(1)), backend=which)
        draws = sumtree_sample(tree, torch.rand(50, dtype=torch.float64, generator=torch.Generator().manual_seed(2)), backend=which)
        trees[which] = (tree, draws)
    (a, da), (b, db) = trees["torch"], trees["numba"]
    assert torch.equal(a.sums, b.sums) and torch.equal(a.mins, b.mins) and torch.equal(da[0], db[0])

    def broken(name):
        raise RuntimeError(f"kernel module {name} requested")

    monkeypatch.setattr("gpubuf.ops.sumtree.kernel_module", broken)
    sumtree_update(a, torch.tensor([3]), torch.tensor([2.0]), backend="torch")  # never loads a kernel
    with pytest.raises(RuntimeError, match="cpu.sumtree"):
        sumtree_update(a, torch.tensor([3]), torch.tensor([2.0]))  # auto: the compiled kernel


def test_decode_rows_runs_the_chosen_cpu_path(monkeypatch):
    """The row decode takes the compiled kernel by default on CPU, the twin for "torch" or GPUBUF_NUMBA=0."""
    from gpubuf.codec.checksum import as_int32
    from gpubuf.ops.encode_rows import encode_planes
    from gpubuf.codec.format import RowGeometry
    from gpubuf.ops.decode_rows import RowTable, decode_rows

    rows = torch.zeros(3, 2, 4, 6, dtype=torch.uint8)
    rows[1, :, 2] = 7
    g = RowGeometry.of(rows.dtype, rows.shape[1:])
    enc = encode_planes(g.to_planes(rows), g)
    table = RowTable(enc.data, enc.starts, enc.lengths.to(torch.int32), as_int32(enc.checksums), None, g)
    index = torch.tensor([2, 1, 1])
    for which in ("torch", "numba", "auto"):
        assert torch.equal(decode_rows(table, index, backend=which), rows[index])

    def broken(name):
        raise RuntimeError(f"kernel module {name} requested")

    monkeypatch.setattr("gpubuf.ops.decode_rows.kernel_module", broken)
    assert torch.equal(decode_rows(table, index, backend="torch"), rows[index])
    with pytest.raises(RuntimeError, match="cpu.codec"):
        decode_rows(table, index)
    switch_numba(monkeypatch, on=False)
    assert torch.equal(decode_rows(table, index), rows[index])


def test_every_kernel_of_the_table_imports():
    """Every ``(op, device)`` row names a function that exists (the Triton ones through the interpreter here)."""
    for (op, device_type), where in KERNELS.items():
        which = {"cuda": "triton", "cpu": "numba"}[device_type]
        assert callable(implementation(op, which)), where


@pytest.mark.interpreter
def test_the_table_decides_auto_and_explicit_choices():
    cpu = torch.zeros(1)
    assert resolve("gather_rows", cpu, "auto") == "numba"
    assert resolve("gather_rows", cpu, "triton") == "triton"  # the interpreter is on in the tests
    assert resolve("write_rows", cpu, "auto") == "torch"  # no compiled CPU ring write: slice copies
    assert resolve("encode_rows", cpu, "auto") == "numba"
    assert resolve("no_such_op", cpu, "auto") == "torch"


def test_an_op_without_a_cpu_kernel_refuses_the_numba_backend():
    """The ring write has no compiled CPU kernel (slice copies are the CPU write): asking for
    one is a typed error, not a silent fallback, and nothing is written."""
    dests = [torch.zeros(10, 3), torch.zeros(10)]
    sources = [torch.ones(4, 3), torch.ones(4)]
    with pytest.raises(BackendUnavailableError, match="no CPU kernel"):
        write_rows(dests, sources, 8, backend="numba")
    assert all(not bool(d.any()) for d in dests)
    write_rows(dests, sources, 8)
    assert all(int(d.count_nonzero()) == s.numel() for d, s in zip(dests, sources))


@pytest.mark.interpreter
def test_device_path_follows_the_backend_not_the_machine(monkeypatch):
    cpu = torch.zeros(1)
    assert device_path(cpu, "triton")
    assert not device_path(cpu, "auto") and not device_path(cpu, "torch") and not device_path(cpu, "numba")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        device_path(cpu, "triton")


@pytest.mark.interpreter
def test_check_backend_refuses_what_cannot_run(monkeypatch):
    assert check_backend("auto") == "auto" and check_backend("triton") == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        check_backend("cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="needs a CUDA device"):
        check_backend("triton")
    monkeypatch.setattr(_dispatch, "numba_importable", lambda: False)
    with pytest.raises(BackendUnavailableError, match="numba"):
        check_backend("numba")


@pytest.mark.interpreter
def test_the_buffer_hands_its_backend_to_storage_and_sampler():
    from gpubuf import LazyTensorStorage, RandomSampler, ReplayBuffer

    rb = ReplayBuffer(storage=LazyTensorStorage(10), backend="triton")
    assert rb.backend == rb.storage._backend == rb.sampler._backend == "triton"
    rb.set_sampler(RandomSampler())
    rb.set_storage(LazyTensorStorage(5))
    assert rb.sampler._backend == rb.storage._backend == "triton"
    rb.set_backend("torch")
    assert rb.sampler._backend == rb.storage._backend == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        ReplayBuffer(storage=LazyTensorStorage(10), backend="gpu")
