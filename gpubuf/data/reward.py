"""``RewardData``: the tensorclass of reward-model training data (TorchRL's ``torchrl.data.RewardData``)."""

from __future__ import annotations

from typing import Sequence

import torch
from tensordict import tensorclass

__all__ = ["RewardData", "reward_data_from_sequences"]


@tensorclass
class RewardData:
    """A dataclass for reward model training (same fields and constructor as TorchRL's).

    Attributes:
        input_ids: token ids, ``[*batch_size, L]`` (int64 as tokenizers give them). ``L`` may
            differ between items: a batch of items of different lengths holds a jagged nested
            tensor ``[B, j]`` (``layout=torch.jagged``), as sampled from a
            :class:`~gpubuf.storages.PackedStorage` or ``LazyStackStorage(densify=True)``.
        attention_mask: ``[*batch_size, L]``, same lengths as ``input_ids`` (bool or int).
        rewards: optional per-token or per-sequence rewards.
        end_scores: optional score of each sequence, ``[*batch_size]``.

    Keyword Args:
        batch_size, device, names: as every tensorclass. The tensorclass methods (``memmap``,
        ``memmap_``, ``memmap_like``, ``load_memmap``, ``save``, ``state_dict``,
        ``to_tensordict``, ``unbind``, indexing, ``torch.stack``) come with the decorator.

    Examples:
        >>> item = RewardData(input_ids=torch.arange(5), attention_mask=torch.ones(5, dtype=torch.bool), batch_size=[])
        >>> rb = ReplayBuffer(storage=PackedStorage(1000))
        >>> rb.extend([item, item])
        >>> rb.sample(4).input_ids.shape
        torch.Size([4, 5])
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rewards: torch.Tensor | None = None
    end_scores: torch.Tensor | None = None


def reward_data_from_sequences(
    input_ids: Sequence[torch.Tensor],
    attention_mask: Sequence[torch.Tensor] | None = None,
    rewards: Sequence[torch.Tensor] | torch.Tensor | None = None,
    end_scores: torch.Tensor | None = None,
) -> list[RewardData]:
    """Wraps per-sequence tensors into a list of :class:`RewardData` items (batch size ``[]``).

    A list of items is what ``ReplayBuffer.extend`` takes for variable-length data.

    Args:
        input_ids: ``n`` 1-D tensors of token ids, any lengths.
        attention_mask: ``n`` tensors of the same lengths; all ones (bool) when omitted.
        rewards: ``n`` tensors (or an ``[n, ...]`` tensor) of rewards, or None.
        end_scores: ``[n]`` scores, or None.

    Returns:
        ``n`` items; their tensors are the given ones (no copy).

    Raises:
        ValueError: sequences of different counts, or a mask whose length differs from its ids.
    """
    n = len(input_ids)
    if attention_mask is None:
        attention_mask = [torch.ones(ids.shape, dtype=torch.bool, device=ids.device) for ids in input_ids]
    for name, seq in (("attention_mask", attention_mask), ("rewards", rewards), ("end_scores", end_scores)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name} holds {len(seq)} entries for {n} sequences")
    items = []
    for i in range(n):
        if attention_mask[i].shape != input_ids[i].shape:
            raise ValueError(
                f"sequence #{i}: attention_mask has shape {list(attention_mask[i].shape)}, input_ids "
                f"{list(input_ids[i].shape)}"
            )
        items.append(
            RewardData(
                input_ids=input_ids[i],
                attention_mask=attention_mask[i],
                rewards=None if rewards is None else rewards[i],
                end_scores=None if end_scores is None else end_scores[i],
                batch_size=[],
            )
        )
    return items
