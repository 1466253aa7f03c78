"""Shared fixtures of the codec tests: real Atari frames and small encode/decode helpers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest


DATA = Path(__file__).resolve().parents[1] / "data" / "atari_small.npz"


@pytest.fixture(scope="session")
def atari():
    """The shipped sample of real frames (scripts/make_atari_frames.py --steps 150 --max-episode-steps 60 --seed 1)."""
    data = np.load(DATA)
    return {k: data[k] for k in data.files}


@pytest.fixture(
    params=[
        "torch",
        pytest.param("numba", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None, reason="numba not installed")),
    ]
)
def cpu_backend(request):
    """The two CPU decode paths: the torch twin and the compiled kernel (Numba)."""
    return request.param
