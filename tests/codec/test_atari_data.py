"""The shipped frame sample and the script that makes it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_atari_frames.py"


def _script():
    spec = importlib.util.spec_from_file_location("make_atari_frames", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_sample_is_small_and_consistent(atari):
    assert (SCRIPT.parents[1] / "tests" / "data" / "atari_small.npz").stat().st_size < 500_000
    frames = atari["frames"]
    assert frames.dtype == np.uint8 and frames.shape[1:] == (84, 84)
    n = len(frames)
    for key in ("episode_start", "action", "reward", "terminal", "game"):
        assert atari[key].shape == (n,)
    assert list(atari["games"]) == ["pong", "breakout", "space_invaders", "seaquest"]
    assert atari["episode_start"].sum() >= 8  # episode boundaries for the dedup tests
    assert (atari["action"][np.roll(atari["episode_start"], -1)] == -1).all()


def test_area_resize_keeps_flat_areas_flat():
    module = _script()
    screen = np.full((1, 210, 160), 87, dtype=np.uint8)
    assert (module._resize(screen) == 87).all()
    screen[0, :, 80:] = 200
    out = module._resize(screen)
    assert out.shape == (1, 84, 84) and set(np.unique(out)) <= set(range(87, 201))


def test_script_is_deterministic():
    pytest.importorskip("ale_py", reason="ale-py is not installed (pip install ale-py)")
    module = _script()
    a = module.make(("pong",), 20, seed=3, max_episode_steps=8)
    b = module.make(("pong",), 20, seed=3, max_episode_steps=8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["frames"].shape == (20 + a["episode_start"].sum(), 84, 84)
