"""The compiled frame matcher finds the same roots as the torch steps of ``match_frames``, and storages written through either are identical."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tensordict import TensorDict

from gpubuf.ops.match_frames import match_frames, transition_indices
from gpubuf.storages.frame_stack import FrameStackStorage
from helpers import switch_numba

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")


def _both(stacks, pairs, tail=None):
    """Roots by the torch steps and by the kernel, checked equal."""
    want = match_frames(stacks, pairs, tail, backend="torch")
    got = match_frames(stacks, pairs, tail, backend="numba")
    assert got.dtype == torch.int64
    assert torch.equal(got, want), (got, want)
    return got


def _pool_stacks(gen, n, J, S, F, pool, with_tail):
    """Stacks drawn from a few frames, so that matches, partial matches and misses all happen."""
    frames = torch.randint(0, 256, (pool, F), dtype=torch.uint8, generator=gen)
    stacks = [frames[torch.randint(0, pool, (n, S), generator=gen)] for _ in range(J)]
    tail = [frames[torch.randint(0, pool, (S,), generator=gen)] for _ in range(J)] if with_tail else None
    return stacks, tail


@pytest.mark.parametrize("with_tail", [False, True], ids=["no-tail", "tail"])
@pytest.mark.parametrize("S", [1, 2, 4])
@pytest.mark.parametrize("J", [1, 2])
@pytest.mark.parametrize("F", [0, 1, 7, 12, 64, 84 * 84 + 3])  # 0: zero-byte frames, all equal
def test_random_pools(J, S, F, with_tail):
    gen = torch.Generator().manual_seed(J * 1000 + S * 100 + F)
    pairs = [None] if J == 1 else [None, 0]
    for trial in range(12):
        stacks, tail = _pool_stacks(gen, 1 + trial % 7, J, S, F, 2 + trial % 3, with_tail)
        _both(stacks, pairs, tail)


def test_real_episodes_built_from_frames():
    """Stacks from stack indices over episodes: along an episode nearly every slot matches."""
    gen = torch.Generator().manual_seed(3)
    frames = torch.randint(0, 256, (60, 40), dtype=torch.uint8, generator=gen)
    starts = torch.zeros(60, dtype=torch.bool)
    starts[[0, 7, 8, 30, 31, 32, 50]] = True
    obs_i, next_i = transition_indices(starts.numpy())
    obs, nxt = frames[torch.from_numpy(obs_i)], frames[torch.from_numpy(next_i)]
    for first in range(0, len(obs), 9):
        tail = [obs[first - 1], nxt[first - 1]] if first else None
        roots = _both([obs[first : first + 9], nxt[first : first + 9]], [None, 0], tail)
        assert (roots != torch.arange(roots.numel())).any()


@pytest.mark.parametrize("where", ["first", "last"])
@pytest.mark.parametrize("F", [8, 13, 4096])
def test_frames_differing_in_one_byte(where, F):
    """Candidates equal but for their first or last byte never match (a compare must not stop short)."""
    base = torch.arange(F, dtype=torch.int64).remainder(251).to(torch.uint8)
    other = base.clone()
    other[0 if where == "first" else -1] ^= 1
    a, b = base, other
    # obs[i] alternates a/b against next[i-1]; next stacks shift with one byte changed.
    obs = torch.stack([torch.stack([a, b, a, a]), torch.stack([b, a, b, b]), torch.stack([a, a, a, b])])
    nxt = torch.stack([torch.stack([a, a, b, b]), torch.stack([b, a, a, b]), torch.stack([a, b, a, a])])
    roots = _both([obs, nxt], [None, 0], [obs[0].clone(), nxt[0].clone()])
    _both([obs, nxt], [None, 0])
    _both([obs], [None])
    assert len(set(roots.tolist())) > 2


def test_non_contiguous_and_unaligned_inputs():
    gen = torch.Generator().manual_seed(5)
    frames = torch.randint(0, 4, (3, 64), dtype=torch.uint8, generator=gen)
    big = frames[torch.randint(0, 3, (12, 4), generator=gen)]  # [12, 4, 64]
    # Every other row, and frames starting one byte in (no wide unit divides their offset).
    strided = [big[::2], big[1::2]]
    assert not strided[0].is_contiguous()
    _both(strided, [None, 0], [big[0, :, :], big[1, :, :]])
    wide = torch.randint(0, 2, (6, 4, 65), dtype=torch.uint8, generator=gen)
    shifted = wide.view(-1)[1 : 1 + 6 * 4 * 64].view(6, 4, 64)
    assert shifted.data_ptr() % 2 == 1
    _both([shifted[:, :, :], shifted.flip(0)], [None, 0], [shifted[0], shifted[1]])
    _both([big[::2, :, ::2]], [None])


def test_more_leaves_and_edge_sizes():
    gen = torch.Generator().manual_seed(9)
    for pairs in ([None, 0, None, 2], [None, None, 0], [0, None]):
        J = len(pairs)
        for with_tail in (False, True):
            stacks, tail = _pool_stacks(gen, 6, J, 4, 9, 3, with_tail)
            _both(stacks, pairs, tail)
    # No rows: only the tail's slots, their own roots.
    _both([torch.zeros(0, 4, 8, dtype=torch.uint8)] * 2, [None, 0], [torch.zeros(4, 8, dtype=torch.uint8)] * 2)


def test_atari_transitions(atari):
    frames = torch.from_numpy(atari["frames"])
    obs_i, next_i = transition_indices(atari["episode_start"])
    obs = frames[torch.from_numpy(obs_i)].reshape(len(obs_i), 4, -1)
    nxt = frames[torch.from_numpy(next_i)].reshape(len(next_i), 4, -1)
    for first, size in ((0, 50), (50, 1), (51, 37), (88, len(obs))):
        tail = [obs[first - 1], nxt[first - 1]] if first else None
        roots = _both([obs[first : first + size], nxt[first : first + size]], [None, 0], tail)
        rows = roots.numel() // 8
        # About one new frame per row along the episodes.
        assert (roots == torch.arange(roots.numel())).sum() < 2 * rows + 8
    _both([obs[:60]], [None])


def _flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_storage_identical_through_both_paths(atari, monkeypatch):
    """Stored bytes, references, stats and sampled batches do not depend on the matcher."""
    frames = torch.from_numpy(atari["frames"])
    obs_i, next_i = transition_indices(atari["episode_start"])
    n = len(obs_i)
    data = TensorDict(
        {"obs": frames[torch.from_numpy(obs_i)], "next": {"obs": frames[torch.from_numpy(next_i)]}, "reward": torch.arange(n).float()},
        [n],
    )
    storages = {}
    for env in ("0", "1"):
        switch_numba(monkeypatch, on=env == "1")
        storage = FrameStackStorage(90, key_interval=3)
        for first in range(0, n, 23):  # wraps around the capacity, so frames are compacted too
            part = data[first : first + 23]
            storage.set(torch.arange(first, first + len(part)) % 90, part)
        storages[env] = storage
    a, b = storages["0"], storages["1"]
    sa, sb = _flat(a.state_dict()), _flat(b.state_dict())
    assert sa.keys() == sb.keys()
    for key in sa:
        if isinstance(sa[key], torch.Tensor):
            assert torch.equal(sa[key], sb[key]), key
    assert a.stats() == b.stats()
    index = torch.randint(0, 90, (64,), generator=torch.Generator().manual_seed(0))
    ga, gb = a.get(index), b.get(index)
    for key in ga.keys(True, True):
        assert torch.equal(ga[key], gb[key]), key
