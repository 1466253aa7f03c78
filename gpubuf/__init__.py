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
from gpubuf.checkpoint.ted_hooks import Flat2TED, H5Combine, H5Split, Nested2TED, TED2Flat, TED2Nested
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
from gpubuf.buffers.conditional import ConditionalUpdateResult
from gpubuf.buffers.her import HERReplayBuffer, HindsightStrategy
from gpubuf.buffers.query import Trajectory, TrajectoryPredicate, filter_trajectories, iter_trajectories, traj
from gpubuf.buffers.offline_to_online import OfflineToOnlineReplayBuffer, prefill_replay_buffer
from gpubuf.buffers.sample_units import SampleUnit, Sequence, Transition
from gpubuf.buffers.scheduler import LambdaScheduler, LinearScheduler, ParameterScheduler, SchedulerList, StepScheduler
from gpubuf.samplers.deprecated import InPlaceSampler
from gpubuf.distributed import MinSize, RayReplayBuffer, RemoteTensorDictReplayBuffer, SampleToInsertRatio, ShardedReplayBuffer
from gpubuf.utils import DEFAULT_DONE_KEYS, find_start_stop_traj, pin_memory_output, stack_tensors
from gpubuf.samplers import (
    ConsumingSampler,
    PrioritizedSampler,
    PrioritizedSliceSampler,
    PromptGroupSampler,
    StalenessAwareSampler,
    RandomSampler,
    Sampler,
    SamplerEnsemble,
    SamplerWithoutReplacement,
    SharedPrioritizedSampler,
    SliceSampler,
    SliceSamplerWithoutReplacement,
    StreamingSliceSampler,
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
    StoreStorage,
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
from gpubuf.checkpoint import dump_buffer as _dump_buffer, dump_storage as _dump_storage
from gpubuf.checkpoint import load_buffer as _load_buffer, load_storage as _load_storage
from gpubuf.checkpoint import dump_component as _dump_component, load_component as _load_component
from gpubuf.distributed.ray_buffer import ray_service as _ray_service
from gpubuf.distributed.remote import actor_class as _actor_class

# Buffers, storages, samplers and writers expose their state and never import the checkpoint code: the package,
# above them all, tells them how their dumps() and loads() are done.
Storage._checkpoint_io = (_dump_storage, _load_storage)
ReplayBuffer._checkpoint_io = (_dump_buffer, _load_buffer)
Sampler._checkpoint_io = Writer._checkpoint_io = (_dump_component, _load_component)
# Likewise for the buffers served elsewhere: Buffer(..., service_backend="ray").
ReplayBuffer._services = {"ray": _ray_service}
ReplayBuffer._actor_class = staticmethod(_actor_class)


__all__ = [
    "errors",
    "RayReplayBuffer",
    "RemoteTensorDictReplayBuffer",
    "ShardedReplayBuffer",
    "SampleToInsertRatio",
    "MinSize",
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
    "PrioritizedSliceSampler",
    "SharedPrioritizedSampler",
    "SliceSampler",
    "SliceSamplerWithoutReplacement",
    "StreamingSliceSampler",
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
    "ConsumingSampler",
    "InPlaceSampler",
    "ConditionalUpdateResult",
    "SampleUnit",
    "Transition",
    "Sequence",
    "ParameterScheduler",
    "LambdaScheduler",
    "LinearScheduler",
    "StepScheduler",
    "SchedulerList",
    "DEFAULT_DONE_KEYS",
    "find_start_stop_traj",
    "pin_memory_output",
    "stack_tensors",
    "StoreStorage",
    "PromptGroupSampler",
    "StalenessAwareSampler",
    "OfflineToOnlineReplayBuffer",
    "prefill_replay_buffer",
    "HERReplayBuffer",
    "HindsightStrategy",
    "TED2Flat",
    "Flat2TED",
    "TED2Nested",
    "Nested2TED",
    "H5Split",
    "H5Combine",
    "Trajectory",
    "TrajectoryPredicate",
    "traj",
    "iter_trajectories",
    "filter_trajectories",
]
