"""Synthetic replay rows for profiling sessions and the benchmarks.

Two row kinds for profiling and the gather benchmark, chosen to bracket what replay buffers hold:

- ``"transition"``: the default 292-byte row of a TorchRL off-policy collector with a small
  vector observation: ``observation``/``next_observation`` f32[32], ``action`` f32[4],
  ``reward`` f32[1], ``done``/``terminated``/``truncated``/``is_init`` bool[1],
  ``step_count`` int64[1] and ``traj_id`` int32[1]. Ten leaves of four dtypes and widths from
  1 to 128 bytes: many narrow fields, where per-field overhead shows.
- ``"frames"``: one ``pixels`` leaf of uint8[4, 84, 84] (28,224 bytes), a stack of four Atari
  frames as DQN agents see them: one wide field, where bandwidth shows.

and two for the harness (``gpubuf bench``): ``"small"``, 48-byte rows (``obs`` f32[8], ``action``
f32[3], ``reward`` f32[1]), and ``"wide"``, its 277-byte transition (``obs``/``next_obs`` f32[32],
``action`` f32[4], ``reward`` f32[1], ``done`` bool[1]).
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict

__all__ = ["ROW_KINDS", "make_rows", "row_bytes"]

#: kind -> {key: (dtype, per-row shape)}, in storage order.
ROW_KINDS: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {
    "transition": {
        "observation": (torch.float32, (32,)),
        "next_observation": (torch.float32, (32,)),
        "action": (torch.float32, (4,)),
        "reward": (torch.float32, (1,)),
        "done": (torch.bool, (1,)),
        "terminated": (torch.bool, (1,)),
        "truncated": (torch.bool, (1,)),
        "is_init": (torch.bool, (1,)),
        "step_count": (torch.int64, (1,)),
        "traj_id": (torch.int32, (1,)),
    },
    "frames": {
        "pixels": (torch.uint8, (4, 84, 84)),
    },
    "small": {"obs": (torch.float32, (8,)), "action": (torch.float32, (3,)), "reward": (torch.float32, (1,))},
    "wide": {
        "obs": (torch.float32, (32,)),
        "action": (torch.float32, (4,)),
        "reward": (torch.float32, (1,)),
        "done": (torch.bool, (1,)),
        "next_obs": (torch.float32, (32,)),
    },
}


def row_bytes(kind: str) -> int:
    """Payload bytes of one row of ``kind`` (292 for ``"transition"``, 28,224 for ``"frames"``)."""
    return sum(dtype.itemsize * math.prod(shape) for dtype, shape in _fields(kind).values())


def _fields(kind: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    try:
        return ROW_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown row kind {kind!r}; expected one of {sorted(ROW_KINDS)}") from None


def make_rows(kind: str, rows: int, device: torch.device | str = "cpu", seed: int = 0) -> TensorDict:
    """``rows`` random rows of ``kind`` as a TensorDict of batch size ``[rows]`` on ``device``.

    Values are drawn on the CPU from a generator seeded with ``seed`` (so every device sees the
    same data) and then moved; floats are standard normal, integers and bools uniform.
    """
    gen = torch.Generator().manual_seed(seed)
    data = {}
    for key, (dtype, shape) in _fields(kind).items():
        size = (rows, *shape)
        if dtype.is_floating_point:
            value = torch.randn(size, generator=gen).to(dtype)
        elif dtype == torch.bool:
            value = torch.rand(size, generator=gen) < 0.05
        else:
            high = 256 if dtype == torch.uint8 else 1_000
            value = torch.randint(0, high, size, generator=gen, dtype=dtype)
        data[key] = value
    return TensorDict(data, batch_size=[rows]).to(device)
