"""The device path end to end on CPU tensors: buffers built with ``backend="triton"`` run the
ops CUDA rows run (Triton through the interpreter), with counted launches and no host sync."""

from __future__ import annotations

import pytest
import torch

from gpubuf import LazyTensorStorage, TensorDictReplayBuffer
from gpubuf.ops.device_work import count_device_work

from device_helpers import assert_work, rows_with_ids as _rows

pytestmark = pytest.mark.interpreter


def _buffer(backend: str, seed: int = 0) -> TensorDictReplayBuffer:
    rb = TensorDictReplayBuffer(
        storage=LazyTensorStorage(40), batch_size=19, backend=backend, generator=torch.Generator().manual_seed(seed)
    )
    rb.extend(_rows(33))
    return rb


def test_a_uniform_sample_on_the_device_path_is_one_draw_and_the_gather():
    rb = _buffer("triton")
    with count_device_work("cpu") as work:
        batch = rb.sample()
    # The draw (randint) and the fused gather of the five fields; "index" is the draw itself.
    assert_work(work, launches=2, host_syncs=0,
                kernels={"aten:randint.low_generator": 1, "triton:_gather_rows_kernel": 1})
    want = _buffer("auto").sample()
    assert (batch == want).all()
    assert torch.equal(batch["index"], batch["reward"].long())


def test_an_extend_on_the_device_path_writes_every_field_in_one_launch_and_never_syncs():
    rb = _buffer("triton")
    data = _rows(5, start=100)
    with count_device_work("cpu") as work:
        index = rb.extend(data)
    # One fused write of the stored fields (five and "index"), and the index range: the storage
    # writes it into "index", and extend hands the same rows back.
    assert_work(work, launches=2, host_syncs=0,
                kernels={"triton:_write_rows_kernel": 1, "aten:arange.start": 1})
    assert torch.equal(index, torch.arange(33, 38))
    assert torch.equal(rb[33:38]["index"], index)
    assert torch.equal(rb[33:38]["reward"], torch.arange(100, 105).double())
    want = _buffer("auto")
    want.extend(data)
    assert (rb[:] == want[:]).all()


def test_an_extend_that_wraps_on_the_device_path_writes_in_one_launch_and_never_syncs():
    rb = _buffer("triton")
    data = _rows(10, start=200)
    with count_device_work("cpu") as work:
        index = rb.extend(data)  # rows 33..39 then 0..2
    # The fused write wraps by itself; the wrapped index range takes an arange and a modulo.
    assert_work(work, launches=3, host_syncs=0,
                kernels={"triton:_write_rows_kernel": 1, "aten:arange.start": 1, "aten:remainder.Scalar": 1})
    assert torch.equal(index, torch.cat([torch.arange(33, 40), torch.arange(3)]))
    assert torch.equal(rb[:3]["reward"], torch.tensor([207.0, 208.0, 209.0], dtype=torch.float64))
    want = _buffer("auto")
    want.extend(data)
    assert (rb[:] == want[:]).all()


def test_the_forced_path_refuses_tensors_triton_cannot_run_on(monkeypatch):
    rb = _buffer("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from gpubuf.errors import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET"):
        rb.sample()


def _prioritized(backend: str):
    from gpubuf import TensorDictPrioritizedReplayBuffer

    rb = TensorDictPrioritizedReplayBuffer(
        storage=LazyTensorStorage(40), alpha=0.7, beta=0.5, backend=backend, generator=torch.Generator().manual_seed(3)
    )
    rb.extend(_rows(33))
    return rb


def test_a_prioritized_cycle_on_the_device_path_takes_at_most_8_launches_and_no_sync():
    rb = _prioritized("triton")
    priority = torch.rand(19, generator=torch.Generator().manual_seed(4)) + 0.1
    rb.sample(19)  # warm-up: pointer tables
    with count_device_work("cpu") as work:
        batch, info = rb.sample(19, return_info=True)
        rb.update_priority(info["index"], priority)
    assert_work(work, max_launches=8, host_syncs=0)
    assert torch.equal(batch["index"], batch["reward"].long())


def test_an_extend_of_a_prioritized_buffer_on_the_device_path_never_syncs():
    rb = _prioritized("triton")
    data = _rows(6, start=50)
    with count_device_work("cpu") as work:
        rb.extend(data)
    assert_work(work, host_syncs=0)


def test_the_counts_tool_counts_the_device_path():
    from gpubuf.tools.counts import count_workloads

    (sample,) = count_workloads(torch.device("cpu"), rows=50, batches=[9], backend="triton", workloads=["sample"])
    assert (sample["launches"], sample["triton_launches"], sample["host_syncs"]) == (2, 1, 0)
    assert sample["kernels"] == {"aten:randint.low_generator": 1, "triton:_gather_rows_kernel": 1}


def test_the_counts_tool_counts_slice_samples_on_the_device_path():
    from gpubuf.tools.counts import count_workloads

    plain, prioritized, epoch = count_workloads(
        torch.device("cpu"), rows=400, batches=[64], backend="triton",
        workloads=["slice-sample", "prioritized-slice-sample", "slice-sample-without-replacement"],
    )
    assert (plain["launches"], plain["host_syncs"]) == (3, 0)
    assert plain["kernels"] == {"aten:rand.generator": 1, "triton:_slice_windows_kernel": 1,
                                "triton:_gather_rows_kernel": 1}
    assert (prioritized["launches"], prioritized["host_syncs"]) == (3, 0)
    assert prioritized["kernels"] == {"aten:rand.generator": 1, "triton:_sumtree_windows_kernel": 1,
                                      "triton:_gather_rows_kernel": 1}
    assert (epoch["launches"], epoch["host_syncs"]) == (3, 0)
    assert epoch["kernels"] == {"aten:uniform_.default": 1, "triton:_slice_windows_kernel": 1,
                                "triton:_gather_rows_kernel": 1}


def test_the_counts_tool_counts_a_learner_s_slice_cycle_on_the_device_path():
    """Extend, sample and (prioritized) update: one fused write, one window draw, one gather, and
    no host sync (the boundary update of the new steps runs as torch ops)."""
    from gpubuf.tools.counts import count_workloads

    plain, prioritized = count_workloads(
        torch.device("cpu"), rows=400, batches=[64], backend="triton",
        workloads=["slice-cycle", "prioritized-slice-cycle"], host_calls=3,
    )
    for cycle, draw in ((plain, "triton:_slice_windows_kernel"), (prioritized, "triton:_sumtree_windows_kernel")):
        assert cycle["kernels"]["triton:_write_rows_kernel"] == 1
        assert cycle["kernels"][draw] == 1 and cycle["kernels"]["triton:_gather_rows_kernel"] == 1
        assert cycle["host_us"] > 0
    assert prioritized["host_syncs"] == 0, prioritized
    assert plain["host_syncs"] == 0, plain


def test_host_only_skips_the_launches_and_the_counts_tool_times_the_host_work():
    """Inside ``host_only()`` no Triton launch is made (the listeners hear of none); the counts
    tool uses it to time the forced device path's host work alone."""
    from gpubuf.ops.gather_rows import gather_rows
    from gpubuf.tools.counts import count_workloads
    from gpubuf_kernels._launch import add_launch_listener, host_only, kernel_name, remove_launch_listener

    heard: list[str] = []

    def listener(kernel, args, kwargs):
        heard.append(kernel_name(kernel))

    add_launch_listener(listener)
    try:
        src, index = torch.arange(40.0).view(20, 2), torch.tensor([3, 7])
        with host_only():
            gather_rows([src], index, backend="triton")
        assert heard == []
        assert torch.equal(gather_rows([src], index, backend="triton")[0], src[index])
        assert heard == ["_gather_rows_kernel"]
    finally:
        remove_launch_listener(listener)
    (result,) = count_workloads(torch.device("cpu"), rows=400, batches=[64], backend="triton",
                                workloads=["slice-sample"], host_calls=3)
    assert result["launches"] == 3 and result["host_us"] > 0 and result["kernels_run"] is False


def test_the_counts_tool_splits_the_host_time_by_where_it_is_spent():
    """``host_profile``: shares of the profiled host time by place (they add up to one), gpubuf's
    layers and launchers among them, none in Triton when the launches are skipped; and the
    functions that cost most, with their calls per workload call."""
    from gpubuf.tools.counts import count_workloads

    (result,) = count_workloads(torch.device("cpu"), rows=400, batches=[64], backend="triton",
                                workloads=["sample"], host_calls=3, host_profile=True)
    profile = result["host_profile"]
    shares = profile["by_place"]
    assert abs(sum(shares.values()) - 1.0) < 1e-9
    assert shares["gpubuf"] > 0 and shares["gpubuf launchers"] > 0
    assert "triton" not in shares  # host_only: no launch reached Triton
    launcher = [e for e in profile["top"] if e["function"].startswith("gpubuf_kernels/gather.py")]
    assert launcher and all(e["place"] == "gpubuf launchers" and e["us"] > 0 for e in launcher)
    assert any(e["function"].endswith("(gather_rows_triton)") and e["calls"] == 1.0 for e in profile["top"])


def test_the_counts_tool_refuses_a_profile_without_timed_calls(capsys):
    """``--host-profile`` profiles the ``--host-calls`` calls: alone it is refused, before any
    workload is built."""
    from gpubuf.tools.counts import count_workloads, main

    with pytest.raises(ValueError, match="host_calls > 0"):
        count_workloads(torch.device("cpu"), rows=400, batches=[64], backend="triton", workloads=["sample"],
                        host_profile=True)
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--backend", "triton", "--workload", "sample", "--host-profile"])
    assert exit_info.value.code == 2 and "--host-calls" in capsys.readouterr().err
