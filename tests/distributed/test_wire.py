"""The compact wire format of a shard's sample, without a cluster: what is packed comes back
exactly, each shard's rows at the positions that drew it."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf.distributed.wire import assemble, chunk_bytes, chunk_count, pack, unpack_leaves


def sample(ids: torch.Tensor) -> tuple[TensorDict, dict]:
    n = len(ids)
    data = TensorDict(
        {
            "id": ids,
            "obs": ids.to(torch.float32)[:, None].expand(n, 3).clone(),
            ("next", "done"): (ids % 2 == 0)[:, None],
            "small": ids.to(torch.int16),  # 2-byte leaves: the next leaf starts unaligned unless padded
            "pixels": ids.to(torch.uint8)[:, None, None].expand(n, 2, 5).clone(),
        },
        [n],
    )
    return data, {"index": ids + 1000, "priority_weight": ids.to(torch.float64) / 7}


@pytest.mark.parametrize("chunks", [1, 3, 7])
def test_a_packed_sample_comes_back_exactly(chunks):
    data, info = sample(torch.arange(11))
    header, *parts = pack(data, info, chunks)
    assert header[0] == "td" and len(parts) == chunks
    leaves = unpack_leaves(header, parts)
    for key, value in data.items(include_nested=True, leaves_only=True):
        assert leaves[("data", key)].dtype == value.dtype and torch.equal(leaves[("data", key)], value)
    for key, value in info.items():
        assert torch.equal(leaves[("info", key)], value)


def test_assemble_puts_each_shards_rows_at_its_positions():
    shard_ids = [torch.tensor([10, 11, 12]), torch.tensor([20, 21]), torch.tensor([30])]
    positions = [torch.tensor([0, 3, 5]), torch.tensor([1, 2]), torch.tensor([4])]
    replies = []
    for ids, chunks in zip(shard_ids, (2, 1, 1)):
        header, *parts = pack(*sample(ids), chunks)
        replies.append((header, parts))
    data, info = assemble(replies, positions, 6)
    expected = torch.tensor([10, 20, 21, 11, 30, 12])
    assert torch.equal(data["id"], expected)
    assert torch.equal(data["obs"][:, 2], expected.to(torch.float32))
    assert torch.equal(data["next", "done"][:, 0], expected % 2 == 0)
    assert torch.equal(data["pixels"][:, 1, 4], expected.to(torch.uint8))
    assert torch.equal(info["index"], expected + 1000)


def test_data_the_format_does_not_cover_travels_pickled_and_is_placed_the_same_way():
    lists = [
        (("pickled", ["a", "b"], {"index": torch.tensor([0, 1])}), [None]),
        (("pickled", ["c"], {"index": torch.tensor([2])}), [None]),
    ]
    data, info = assemble(lists, [torch.tensor([2, 0]), torch.tensor([1])], 3)
    assert data == ["b", "c", "a"] and info["index"].tolist() == [1, 2, 0]
    # A tensor sample: packed; a list: pickled.
    header, *parts = pack(torch.arange(8.0).reshape(4, 2), {"index": torch.arange(4)}, 2)
    assert header[0] == "tensor"
    data, info = assemble([(header, parts)], [torch.tensor([3, 2, 1, 0])], 4)
    assert torch.equal(data, torch.arange(8.0).reshape(4, 2).flip(0)) and info["index"].tolist() == [3, 2, 1, 0]
    assert pack(["x"], {}, 2) == (("pickled", ["x"], {}), None, None)


def test_chunks_stay_under_the_inline_size():
    assert chunk_count(1000, None) == 1
    rows = 5 * chunk_bytes() // 100
    assert chunk_count(rows, 100) == 5
    header, *parts = pack(torch.zeros(rows, 25), {}, chunk_count(rows, 100))
    assert all(p.nbytes <= chunk_bytes() for p in parts)
