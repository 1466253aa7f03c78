"""Sampling under CUDA graph capture: a fixed batch size, captured once, replayed.

A sample on the device path launches a draw and the fused gather, never reads a device value on
the host and allocates its outputs from the graph's pool, so ``torch.cuda.graph`` can capture it;
each replay draws new indices into the same output tensors. Capture after a warm-up (which builds
the gather's pointer table), as ``torch.cuda.graph`` asks.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf import LazyTensorStorage, TensorDictReplayBuffer

pytestmark = pytest.mark.gpu


def _rows(n: int) -> TensorDict:
    ids = torch.arange(n, device="cuda")
    return TensorDict(
        {
            "obs": ids[:, None].float().expand(n, 17).clone(),
            "action": ids[:, None].expand(n, 3).clone(),
            "reward": ids.double(),
            "done": ids % 2 == 0,
            "next": {"obs": (ids[:, None] + 1).float().expand(n, 17).clone()},
        },
        batch_size=[n],
        device="cuda",
    )


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: allocations, pointer tables, compiled kernels
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_a_uniform_sample_is_captured_and_replays_fresh_draws():
    rb = TensorDictReplayBuffer(storage=LazyTensorStorage(10_000, device="cuda"), batch_size=256)
    rb.extend(_rows(10_000))
    graph, batch = _capture(rb.sample)
    seen = []
    for _ in range(4):
        graph.replay()
        torch.cuda.synchronize()
        index = batch["index"].clone()
        seen.append(index)
        # The rows gathered are those of the drawn index, for every field.
        assert torch.equal(batch["reward"], index.double())
        assert torch.equal(batch["obs"], index[:, None].float().expand(256, 17))
        assert torch.equal(batch["next", "obs"], (index[:, None] + 1).float().expand(256, 17))
        assert torch.equal(batch["done"], index % 2 == 0)
    assert not all(torch.equal(seen[0], s) for s in seen[1:]), "every replay drew the same indices"
