"""``ConditionalUpdateResult``: what :meth:`ReplayBuffer.update_if_present` did to each record."""

from __future__ import annotations

import torch
from tensordict import TensorClass


class ConditionalUpdateResult(TensorClass["nocast"]):
    """The outcome of a conditional update, one entry per record addressed.

    Attributes:
        updated: bool mask, aligned with the indices given: True where the record was still
            live and was patched.
        version_rejected: bool mask (only with ``version_key``, else None): True where the
            record was live but lost the version comparison.

    ``stale_count`` counts the records whose slot had been rewritten or emptied since their handle
    was taken (not those rejected by the version comparison).
    """

    updated: torch.Tensor
    version_rejected: torch.Tensor | None = None

    @property
    def updated_count(self) -> int:
        """The number of records patched."""
        return int(self.updated.sum().item())

    @property
    def version_rejected_count(self) -> int:
        """The number of live records rejected by the version comparison."""
        return 0 if self.version_rejected is None else int(self.version_rejected.sum().item())

    @property
    def stale_count(self) -> int:
        """The number of records skipped because their slot was rewritten or emptied."""
        return int(self.updated.numel()) - self.updated_count - self.version_rejected_count
