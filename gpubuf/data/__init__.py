"""Data types stored in gpubuf buffers: TorchRL's tensorclasses and helpers for variable-length data."""

from gpubuf.data.jagged import load_memmap_packed, memmap_packed, pack_jagged, unpack_jagged
from gpubuf.data.reward import RewardData, reward_data_from_sequences

__all__ = [
    "RewardData",
    "reward_data_from_sequences",
    "pack_jagged",
    "unpack_jagged",
    "memmap_packed",
    "load_memmap_packed",
]
