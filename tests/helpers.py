"""Data the tests of several folders share.

Imported as ``helpers``: pytest puts ``tests/`` on ``sys.path`` when it loads ``tests/conftest.py``
(no ``__init__.py`` here, so the rootdir-relative "prepend" import mode applies), the way the
checkpoint tests import ``ckpt_helpers`` from their own folder.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from gpubuf.ops import _dispatch
from gpubuf.samplers._episodes import EpisodeIndex

# Every real dtype a row gather must copy bit for bit, one to eight bytes wide.
DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]

TED_ROW_BYTES = 292


def switch_numba(monkeypatch: pytest.MonkeyPatch, *, on: bool) -> None:
    """What ``GPUBUF_NUMBA`` (``"0"`` unless ``on``) gives a process that starts with it: the
    compiled CPU kernels under ``backend="auto"``, or the twins; undone with ``monkeypatch``."""
    monkeypatch.setenv("GPUBUF_NUMBA", "1" if on else "0")
    monkeypatch.setattr(_dispatch, "NUMBA_SWITCHED_OFF", not on)


def ted_rows(n: int, start: int = 0) -> TensorDict:
    """``n`` transitions of 292 bytes each; every field encodes the row's id ``start + i``.

    Args:
        n: the number of rows.
        start: the id of the first row.

    Returns:
        A TensorDict of batch size ``[n]`` in TorchRL's transition layout (``next`` nested).
    """
    ids = torch.arange(start, start + n)
    f = ids.to(torch.float32)[:, None]
    return TensorDict(
        {
            "observation": f.expand(n, 32).clone(),
            "action": f.expand(n, 7).clone(),
            "done": (ids % 2 == 0)[:, None],
            "next": {
                "observation": (f + 1).expand(n, 32).clone(),
                "reward": f.clone(),
                "done": (ids % 3 == 0)[:, None],
                "terminated": (ids % 5 == 0)[:, None],
                "truncated": (ids % 7 == 0)[:, None],
            },
        },
        batch_size=[n],
    )


def episode_index(capacity: int, columns: int, written: int, seed: int):
    """An ``EpisodeIndex`` after ``written`` rows (about one in three starting a trajectory), a few
    rows a write, through the twin."""
    g = torch.Generator().manual_seed(seed)
    index = EpisodeIndex(capacity, columns, "cpu")
    while index.written < written:
        n = min(int(torch.randint(1, capacity + 1, (1,), generator=g)), written - index.written)
        index.append(torch.rand(n, columns, generator=g) < 0.3, "torch")
    return index
