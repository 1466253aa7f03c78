"""The compiled write path of ``FrameStackStorage`` stores exactly what the torch steps store.

The compiled path reads the new frames and their key frames where they lie in the batch
(:func:`gpubuf.ops.encode_rows.encode_planes_at`) and numbers and keys them in one kernel
(``gpubuf_kernels.cpu.framestack.plan_frames``); the torch steps (``GPUBUF_NUMBA=0``) gather
them first. Both must give the same arena, row table, references, ages and stats.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf.ops.encode_rows import encode_planes, encode_planes_at
from gpubuf.codec.format import RowGeometry
from gpubuf.ops.match_frames import transition_indices
from gpubuf.storages.frame_stack import FrameStackStorage
from helpers import switch_numba

pytest.importorskip("numba")


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("data", "starts", "lengths", "checksums"))


@pytest.mark.parametrize("shape", [(84, 84), (3, 6, 84), (5, 7), (1, 1)], ids=str)
@pytest.mark.parametrize("inrow", [False, True])
def test_encode_planes_at_matches_gathered_rows(shape, inrow):
    """Rows and key rows spread over several buffers encode as the gathered rows do."""
    gen = torch.Generator().manual_seed(len(shape) * 10 + inrow)
    g = RowGeometry.of(torch.uint8, shape)
    RB = g.raw_bytes
    pool = torch.randint(0, 3, (6, RB), dtype=torch.uint8, generator=gen)
    sources = [pool[torch.randint(0, 6, (k,), generator=gen)].reshape(-1).clone() for k in (5, 9, 2)]
    n = 17
    row_src = torch.randint(0, 3, (n,), generator=gen)
    sizes = torch.tensor([5, 9, 2])
    row_off = (torch.randint(0, 1 << 20, (n,), generator=gen) % sizes[row_src]) * RB
    key_src = torch.randint(0, 3, (n,), generator=gen)
    key_off = (torch.randint(0, 1 << 20, (n,), generator=gen) % sizes[key_src]) * RB
    has_key = torch.rand(n, generator=gen) < 0.6
    ref_rows = torch.where(has_key, torch.arange(n), -1).to(torch.int32)

    def gather(src, off):
        return torch.stack([sources[s][o : o + RB] for s, o in zip(src.tolist(), off.tolist())])

    rows = gather(row_src, row_off).view(n, g.planes, g.height, g.width)
    keys = gather(key_src, key_off).view_as(rows)
    want = encode_planes(rows, g, key_planes=keys, has_key=has_key, ref_rows=ref_rows, inrow=inrow, backend="torch")
    args = (sources, row_src, row_off, key_src, key_off, has_key, ref_rows, g)
    assert _same(encode_planes_at(*args, inrow=inrow, backend="torch"), want)
    assert _same(encode_planes_at(*args, inrow=inrow, backend="numba"), want)
    # Into a reused buffer, dirty and larger than needed.
    out = torch.full((n * RB + 100,), 7, dtype=torch.uint8)
    assert _same(encode_planes_at(*args, inrow=inrow, out=out, backend="numba"), want)
    none = torch.zeros(n, dtype=torch.bool)
    assert _same(
        encode_planes_at(sources, row_src, row_off, key_src, key_off, none, ref_rows, g, inrow=inrow, backend="numba"),
        encode_planes(rows, g, has_key=none, ref_rows=ref_rows, inrow=inrow, backend="torch"),
    )


def _transitions(atari, nested: bool) -> TensorDict:
    frames = torch.from_numpy(atari["frames"])
    obs_i, next_i = transition_indices(atari["episode_start"])
    n = len(obs_i)
    obs, nxt = frames[torch.from_numpy(obs_i)], frames[torch.from_numpy(next_i)]
    fields = {"obs": obs, "reward": torch.arange(n).float()}
    if nested:
        fields["next"] = {"obs": nxt}
    else:
        fields["next_obs"] = nxt
    return TensorDict(fields, [n])


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _assert_identical(a: FrameStackStorage, b: FrameStackStorage) -> None:
    sa, sb = _flat(a.state_dict()), _flat(b.state_dict())
    assert sa.keys() == sb.keys()
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), key
    assert a.stats() == b.stats()
    assert a._n_frames == b._n_frames and torch.equal(a._age[: a._n_frames], b._age[: b._n_frames])


def _both(monkeypatch, fill) -> None:
    """Fills a storage through the torch steps and through the compiled path; they must be identical."""
    storages = {}
    for env in ("0", "1"):
        switch_numba(monkeypatch, on=env == "1")
        storages[env] = fill()
    _assert_identical(storages["0"], storages["1"])


@pytest.mark.parametrize(("key_interval", "batch"), [(1, 64), (3, 7), (4, 1000), (9, 33)])
def test_extend_identical_on_atari(atari, monkeypatch, key_interval, batch):
    """Round-robin writes, wrapping around a small capacity (frames compacted, keys of earlier batches decoded)."""
    data = _transitions(atari, nested=False)
    n = len(data)

    def fill():
        storage = FrameStackStorage(75, stack_keys=["obs", "next_obs"], key_interval=key_interval)
        at = 0
        for first in range(0, 2 * n, batch):  # twice over the data
            part = data[torch.arange(first, first + batch) % n]
            at += storage._write_rows(at, part)
        return storage

    _both(monkeypatch, fill)


def test_set_identical_on_atari(atari, monkeypatch):
    """Rows written out of order, one leaf alone, and a nested next leaf."""
    data = _transitions(atari, nested=True)
    n = len(data)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1))

    def fill_shuffled():
        storage = FrameStackStorage(n, key_interval=3)
        for first in range(0, n, 29):
            rows = order[first : first + 29]
            storage.set(rows, data[rows])
        return storage

    def fill_one_leaf():
        storage = FrameStackStorage(60, stack_keys=["obs"])
        for first in range(0, n, 31):
            part = data[first : first + 31]
            storage.set(torch.arange(first, first + len(part)) % 60, part)
        return storage

    _both(monkeypatch, fill_shuffled)
    _both(monkeypatch, fill_one_leaf)


def test_reads_back_after_compiled_writes(atari, monkeypatch):
    """What the compiled path stored decodes to the written rows."""
    switch_numba(monkeypatch, on=True)
    data = _transitions(atari, nested=False)
    storage = FrameStackStorage(len(data), stack_keys=["obs", "next_obs"])
    for first in range(0, len(data), 40):
        storage._write_rows(first, data[first : first + 40])
    index = torch.arange(len(data))
    got = storage.get(index)
    assert torch.equal(got["obs"], data["obs"]) and torch.equal(got["next_obs"], data["next_obs"])


@pytest.mark.parametrize("width, unit", [(16, 8), (12, 4), (6, 2), (7, 1), (32, 1), (33, 1), (84, 1), (300, 1)])
def test_line_compares_in_wide_units_see_every_byte(width, unit):
    """Lines equal to the one above (or to the key's) but for one byte, at every position of a
    unit, or of the 32-byte compares of lines 32 bytes wide or more (those need no units)."""
    from gpubuf.ops.encode_rows import _compare_units

    gen = torch.Generator().manual_seed(width)
    g = RowGeometry.of(torch.uint8, (2, 8, width))
    RB = g.raw_bytes
    n = 2 * width
    rows = torch.randint(0, 4, (n, 1, 1, width), dtype=torch.uint8, generator=gen).expand(n, 2, 8, width).clone()
    keys = rows.clone()
    for r in range(n):
        # Row r differs from its upper line and from its key in byte r % width of line 3 of plane 1.
        rows[r, 1, 3, r % width] += 1
    sources = [rows.reshape(-1).clone(), keys.reshape(-1).clone()]
    arrays = tuple(s.numpy() for s in sources)
    row_off = torch.arange(n) * RB
    assert _compare_units(arrays, (row_off, row_off), width)[1] == unit
    has_key = torch.arange(n) % 2 == 0
    ref_rows = torch.where(has_key, torch.arange(n), -1).to(torch.int32)
    want = encode_planes(rows, g, key_planes=keys, has_key=has_key, ref_rows=ref_rows, inrow=True, backend="torch")
    got = encode_planes_at(
        sources, torch.zeros(n, dtype=torch.int64), row_off, torch.ones(n, dtype=torch.int64), row_off, has_key, ref_rows, g,
        inrow=True, backend="numba",
    )
    assert _same(got, want)
    # An offset off the unit falls back to byte compares, with the same bytes out.
    if unit > 1:
        shifted = [torch.cat([torch.zeros(1, dtype=torch.uint8), s]) for s in sources]
        assert _compare_units(tuple(s.numpy() for s in shifted), (row_off + 1, row_off + 1), width)[1] == 1
        moved = encode_planes_at(
            shifted, torch.zeros(n, dtype=torch.int64), row_off + 1, torch.ones(n, dtype=torch.int64), row_off + 1,
            has_key, ref_rows, g, inrow=True, backend="numba",
        )
        assert _same(moved, want)


def test_a_fill_passes_the_compiled_encoder_one_set_of_argument_types(atari, monkeypatch):
    """Batches that decode key frames of earlier batches and batches that do not call the
    encoder with the same argument types: one compiled specialisation serves a whole fill
    (a second one compiles in the middle of it, for seconds)."""
    numba = pytest.importorskip("numba")
    from gpubuf.ops._dispatch import kernel_module

    switch_numba(monkeypatch, on=True)
    kernels = kernel_module("cpu.encoder")
    real = kernels.encode_rows_at
    types, earlier_keys = set(), set()

    def spy(*args):
        types.add(tuple(numba.typeof(a) for a in args))
        earlier_keys.add(args[0][-1].size > 0)  # the last source: decoded keys of earlier batches
        return real(*args)

    monkeypatch.setattr(kernels, "encode_rows_at", spy)
    data = _transitions(atari, nested=False)
    storage = FrameStackStorage(len(data), stack_keys=["obs", "next_obs"], key_interval=6)
    for first in range(0, len(data), 5):
        storage._write_rows(first, data[first : first + 5])
    assert earlier_keys == {False, True}
    assert len(types) == 1
