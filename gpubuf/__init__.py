"""gpubuf: a GPU-first replay buffer for PyTorch with TorchRL's ``torchrl.data`` API.

``import gpubuf`` needs no GPU and does not import Triton: kernels are imported on first use
by a CUDA tensor.
"""

from gpubuf import errors
from gpubuf._version import __version__
from gpubuf.buffers import (
    PrioritizedReplayBuffer,
    ReplayBuffer,
    ReplayBufferEnsemble,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from gpubuf.checkpoint import (
    CompressedListStorageCheckpointer,
    FlatStorageCheckpointer,
    H5StorageCheckpointer,
    ListStorageCheckpointer,
    NestedStorageCheckpointer,
    StorageCheckpointerBase,
    StorageEnsembleCheckpointer,
    TensorStorageCheckpointer,
)
from gpubuf.samplers import (
    PrioritizedSampler,
    RandomSampler,
    Sampler,
    SamplerEnsemble,
    SamplerWithoutReplacement,
    SharedPrioritizedSampler,
)
from gpubuf.data import RewardData
from gpubuf.storages import (
    CompressedListStorage,
    CompressedTensorStorage,
    FrameStackStorage,
    LazyMemmapStorage,
    LazyStackStorage,
    LazyTensorStorage,
    ListStorage,
    PackedStorage,
    SpillStorage,
    Storage,
    StorageEnsemble,
    TensorStorage,
)
from gpubuf.writers import (
    ImmutableDatasetWriter,
    RoundRobinWriter,
    TensorDictMaxValueWriter,
    TensorDictRoundRobinWriter,
    Writer,
    WriterEnsemble,
)


__all__ = [
    "errors",
    "ReplayBuffer",
    "TensorDictReplayBuffer",
    "PrioritizedReplayBuffer",
    "TensorDictPrioritizedReplayBuffer",
    "Storage",
    "ListStorage",
    "TensorStorage",
    "LazyTensorStorage",
    "LazyMemmapStorage",
    "SpillStorage",
    "LazyStackStorage",
    "PackedStorage",
    "StorageEnsemble",
    "CompressedListStorage",
    "CompressedTensorStorage",
    "FrameStackStorage",
    "ReplayBufferEnsemble",
    "SamplerEnsemble",
    "TensorDictMaxValueWriter",
    "ImmutableDatasetWriter",
    "WriterEnsemble",
    "RewardData",
    "Sampler",
    "RandomSampler",
    "SamplerWithoutReplacement",
    "PrioritizedSampler",
    "SharedPrioritizedSampler",
    "Writer",
    "RoundRobinWriter",
    "TensorDictRoundRobinWriter",
    "StorageCheckpointerBase",
    "TensorStorageCheckpointer",
    "FlatStorageCheckpointer",
    "NestedStorageCheckpointer",
    "H5StorageCheckpointer",
    "ListStorageCheckpointer",
    "CompressedListStorageCheckpointer",
    "StorageEnsembleCheckpointer",
]
