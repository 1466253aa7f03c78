"""Replay buffers past one process: Ray actors, shards, rate limiters.

Ray is an optional extra (``pip install gpubuf[ray]``) imported by the first buffer built here;
importing this package does not import it.

* :class:`RayReplayBuffer`: a gpubuf buffer in a Ray actor (TorchRL's ``RayReplayBuffer``).
* :class:`RemoteTensorDictReplayBuffer`: TorchRL's remote-call-friendly TensorDict buffer.
* :class:`ShardedReplayBuffer`: N shard actors sampled as one buffer (globally correct
  prioritized sampling), with fault isolation and restarts from checkpoints.
* :class:`SampleToInsertRatio`, :class:`MinSize`: Reverb's rate limiters, given as
  ``rate_limiter=`` to either buffer.
"""

from gpubuf.distributed.host import BufferHost
from gpubuf.distributed.rate_limiter import MinSize, RateLimiter, RateLimiterState, SampleToInsertRatio
from gpubuf.distributed.ray_buffer import RayReplayBuffer, RayReplayBufferClient
from gpubuf.distributed.remote import RemoteTensorDictReplayBuffer
from gpubuf.distributed.sharded import ShardedReplayBuffer

__all__ = [
    "BufferHost",
    "MinSize",
    "RateLimiter",
    "RateLimiterState",
    "RayReplayBuffer",
    "RayReplayBufferClient",
    "RemoteTensorDictReplayBuffer",
    "SampleToInsertRatio",
    "ShardedReplayBuffer",
]
