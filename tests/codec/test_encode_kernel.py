"""The compiled CPU encoder (Numba) writes exactly the torch encoder's bytes, lengths and checksums."""

from __future__ import annotations

import pytest
import torch

from gpubuf.ops.encode_rows import encode_planes
from gpubuf.codec.format import RowGeometry

from helpers import DTYPES

pytest.importorskip("numba")

SHAPES = [(), (1,), (7,), (3, 5), (2, 4, 9), (4, 1, 1), (1, 300), (2, 3, 513), (3, 6, 84)]


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("data", "starts", "lengths", "checksums"))


def _check_all_options(rows: torch.Tensor, keys: torch.Tensor) -> None:
    """Both encoders agree without references, within rows, against reference rows, and both at once."""
    g = RowGeometry.of(rows.dtype, rows.shape[1:])
    planes = g.to_planes(rows)
    keyed = {"key_planes": planes[keys.clamp_min(0)], "has_key": keys >= 0, "ref_rows": keys.to(torch.int32)}
    for options in ({}, {"intra": True}, {"inrow": False}, keyed, {**keyed, "inrow": False}, {**keyed, "intra": True}):
        want = encode_planes(planes, g, backend="torch", **options)
        got = encode_planes(planes, g, backend="numba", **options)
        assert _same(got, want), sorted(options)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_encoders_agree_every_dtype(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) * 100 + DTYPES.index(dtype))
    size = torch.empty((), dtype=dtype).element_size()
    keys = torch.tensor([-1, 0, 0, -1, 3, 3, -1, 6, 6, 6, -1, 10])
    for high in (256, 3):  # full-range noise (stored raw) and few values (coded)
        raw = torch.randint(0, high, (12, *shape, size), generator=gen, dtype=torch.uint8)
        rows = raw[..., 0].bool() if dtype == torch.bool else raw.view(dtype).reshape(12, *shape).clone()
        if rows.numel():
            rows[1::2] = rows[0::2]  # repeated rows: REF lines
            rows[5] = rows[4] + (1 if dtype != torch.bool else 0)  # residuals
        _check_all_options(rows, keys)


def test_encoders_agree_on_edge_rows():
    keys = torch.tensor([-1, 0, 0])
    cases = [
        torch.full((3, 4, 84, 84), 7, dtype=torch.uint8),
        torch.full((3, 2, 9, 700), 1.5, dtype=torch.float32),
        torch.zeros(3, 1, 2, 1000, dtype=torch.uint8).index_fill_(3, torch.arange(250, 600), 4),
        torch.randint(0, 256, (3, 1), dtype=torch.uint8),
        torch.empty(3, 4, 0),
    ]
    for rows in cases:
        _check_all_options(rows, keys)


def test_encoders_agree_on_real_frames(atari):
    from gpubuf.ops.match_frames import stack_indices

    frames = torch.from_numpy(atari["frames"][:160])
    stacks = frames[torch.from_numpy(stack_indices(atari["episode_start"][:160]))]
    keys = torch.arange(160)
    keys = torch.where(keys % 4 == 0, -1, keys - keys % 4)
    _check_all_options(stacks, keys)
    _check_all_options(frames, keys)
