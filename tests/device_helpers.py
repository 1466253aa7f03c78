"""Helpers for tests of the device path run on CPU tensors (Triton's interpreter).

Imported as ``device_helpers`` (``tests/`` is on ``sys.path``, as for ``helpers``). A buffer built
with ``backend="triton"`` over CPU rows runs the ops CUDA rows run; :func:`assert_work` checks
what a block of it asked of the device, counted by :func:`gpubuf.ops.device_work.count_device_work`
with ``device="cpu"``.

Example (the prioritized cycle, once its kernels are fused)::

    with count_device_work("cpu") as work:
        batch, info = rb.sample(256, return_info=True)
        rb.update_priority(info["index"], priority)
    assert_work(work, max_launches=8, host_syncs=0)
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from gpubuf.ops.device_work import DeviceWork


def rows_with_ids(n: int, start: int = 0) -> TensorDict:
    """``n`` rows of five fields of four widths (one nested), every value derived from the row's id."""
    ids = torch.arange(start, start + n)
    return TensorDict(
        {
            "obs": ids[:, None].float().expand(n, 7).clone(),
            "action": ids[:, None].expand(n, 3).clone(),
            "reward": ids.double(),
            "done": ids % 2 == 0,
            "next": {"obs": (ids[:, None] + 1).to(torch.int16).expand(n, 5).clone()},
        },
        batch_size=[n],
    )


def assert_work(
    work: DeviceWork,
    *,
    launches: int | None = None,
    max_launches: int | None = None,
    triton_launches: int | None = None,
    kernels: dict[str, int] | None = None,
    host_syncs: int | None = 0,
) -> None:
    """Asserts counts of a :class:`DeviceWork`; the message lists every launch and sync.

    Args:
        work: what :func:`count_device_work` counted.
        launches: the exact number of launches (Triton and torch), or None.
        max_launches: an upper bound of the launches, or None.
        triton_launches: the exact number of Triton launches, or None.
        kernels: exact counts of some launches by name (``"triton:_gather_rows_kernel"``,
            ``"aten:index_select.default"``); names not given are not checked.
        host_syncs: the exact number of host syncs (default 0), or None.
    """
    problems = []
    if launches is not None and work.launches != launches:
        problems.append(f"{work.launches} launches, expected {launches}")
    if max_launches is not None and work.launches > max_launches:
        problems.append(f"{work.launches} launches, expected at most {max_launches}")
    if triton_launches is not None and work.triton_launches != triton_launches:
        problems.append(f"{work.triton_launches} Triton launches, expected {triton_launches}")
    for name, count in (kernels or {}).items():
        if work.kernels[name] != count:
            problems.append(f"{work.kernels[name]} x {name}, expected {count}")
    if host_syncs is not None and work.host_syncs != host_syncs:
        problems.append(f"{work.host_syncs} host syncs, expected {host_syncs}")
    assert not problems, "; ".join(problems) + f"\n  {work.summary()}"
