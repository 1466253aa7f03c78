"""``InPlaceSampler``: removed from TorchRL without replacement; the name is kept so that importing
it works and constructing it raises TorchRL's error."""

from __future__ import annotations

from typing import Any


class InPlaceSampler:
    """[Deprecated] A sampler that wrote TensorDicts in place; constructing one raises.

    Raises:
        RuntimeError: always (TorchRL's message).
    """

    def __init__(self, device: Any = None):
        raise RuntimeError("This class has been removed without replacement. In-place sampling should be avoided.")
