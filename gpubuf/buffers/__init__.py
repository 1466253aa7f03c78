"""Replay buffers: storage + sampler + writer behind TorchRL's API."""

from gpubuf.buffers.base import ReplayBuffer
from gpubuf.buffers.ensemble import ReplayBufferEnsemble
from gpubuf.buffers.prioritized import PrioritizedReplayBuffer, TensorDictPrioritizedReplayBuffer
from gpubuf.buffers.tensordict import TensorDictReplayBuffer

__all__ = [
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "TensorDictPrioritizedReplayBuffer",
    "ReplayBufferEnsemble",
]
