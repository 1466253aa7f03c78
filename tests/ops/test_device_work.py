"""The device-work counter: Triton launches, torch ops on the device, host syncs."""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.device_work import count_device_work
from gpubuf.ops.gather_rows import gather_rows

from device_helpers import assert_work


@pytest.mark.interpreter
def test_counts_triton_launches_at_the_launch_helper_and_not_the_interpreter_copies():
    sources = [torch.arange(40.0).view(10, 4), torch.arange(10, dtype=torch.uint8)]
    index = torch.tensor([9, 0, 0])
    out = [torch.empty(3, 4), torch.empty(3, dtype=torch.uint8)]
    with count_device_work("cpu") as work:
        gather_rows(sources, index, out, backend="triton", check_bounds=False)
    # The gather is one launch; the interpreter's copies of the arguments count for nothing.
    assert_work(work, launches=1, triton_launches=1, kernels={"triton:_gather_rows_kernel": 1}, host_syncs=0)
    assert torch.equal(out[0], sources[0][index]) and torch.equal(out[1], sources[1][index])


def test_counts_torch_ops_but_not_views_or_allocations():
    x = torch.arange(12.0)
    with count_device_work("cpu") as work:
        y = x.view(3, 4)[1:, ::2].t()  # views: nothing launched
        z = torch.empty(5)
        y.sum()  # one kernel
        torch.index_select(x, 0, torch.tensor([1, 2]))  # one kernel; the index literal launches nothing
        z.fill_(1.0)  # one kernel
    assert_work(work, launches=3, triton_launches=0, host_syncs=0,
                kernels={"aten:sum.default": 1, "aten:index_select.default": 1, "aten:fill_.Scalar": 1})


def test_counts_every_kind_of_host_read():
    x = torch.arange(6)
    with count_device_work("cpu") as work:
        x[2].item()
        bool(x[1])
        int(x[3])
        x.tolist()
        x.numpy()
    assert work.host_syncs == 5, work.summary()
    assert work.syncs[-2:] == ["Tensor.tolist", "Tensor.numpy"]
    assert work.launches == 0


def test_ops_whose_output_size_depends_on_the_data_count_as_syncs():
    x = torch.arange(10)
    mask = x > 3
    with count_device_work("cpu") as work:
        x[mask]
        x.nonzero()
        torch.unique(x)
        torch.masked_select(x, mask)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized by the caller: no sync
        x[torch.tensor([1, 2])]  # integer indexing: no sync
    assert work.host_syncs == 5, work.summary()
    assert all(s.endswith("(output size read on the host)") for s in work.syncs)


def test_only_the_counted_device_counts():
    x = torch.arange(6.0)
    with count_device_work("cuda") as work:  # nothing here is on a CUDA device
        (x + 1).tolist()
        x.sum().item()
    assert_work(work, launches=0, host_syncs=0)


def test_nested_counters_both_count_and_the_tensor_methods_come_back():
    tolist, numpy = torch.Tensor.tolist, torch.Tensor.numpy
    x = torch.arange(3)
    with count_device_work("cpu") as outer:
        x.tolist()
        with count_device_work("cpu") as inner:
            x.tolist()
            x + 1
        x + 1
    assert (outer.host_syncs, outer.torch_ops) == (2, 2)
    assert (inner.host_syncs, inner.torch_ops) == (1, 1)
    assert torch.Tensor.tolist is tolist and torch.Tensor.numpy is numpy
    x.tolist()  # after the block: counted by nobody
    assert outer.host_syncs == 2


def test_a_failing_block_still_restores_the_tensor_methods():
    tolist = torch.Tensor.tolist
    with pytest.raises(RuntimeError, match="boom"):
        with count_device_work("cpu"):
            raise RuntimeError("boom")
    assert torch.Tensor.tolist is tolist


@pytest.mark.gpu
def test_cuda_copies_sort_into_syncs_and_host_to_device():
    x = torch.arange(1024, device="cuda")
    pinned = torch.empty(1024, dtype=x.dtype, pin_memory=True)
    with count_device_work("cuda") as work:
        x.cpu()  # blocking device-to-host copy
        pinned.copy_(x, non_blocking=True)  # asynchronous: no sync
        torch.arange(4).to("cuda")  # host-to-device copy
        x[:3].tolist()  # one sync, although torch copies to the host inside
    assert work.host_syncs == 2, work.summary()
    assert work.host_to_device == 1, work.summary()
