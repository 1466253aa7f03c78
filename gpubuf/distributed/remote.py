"""``RemoteTensorDictReplayBuffer``: TorchRL's remote-invocation-friendly TensorDict buffer."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from gpubuf.buffers import TensorDictReplayBuffer
from gpubuf.distributed._ray import default_remote_config, require_ray

__all__ = ["RemoteTensorDictReplayBuffer", "actor_class"]


class RemoteTensorDictReplayBuffer(TensorDictReplayBuffer):
    """A :class:`~gpubuf.TensorDictReplayBuffer` whose public methods have explicit signatures, so
    that remote agents can call them (TorchRL's ``RemoteTensorDictReplayBuffer``).

    TorchRL serves it over ``torch.distributed.rpc``; gpubuf serves it as a Ray actor: build one
    with :meth:`as_remote`, or give it as ``replay_buffer_cls`` to
    :class:`~gpubuf.distributed.RayReplayBuffer`. Locally it is an ordinary TensorDict buffer.

    Examples:
        >>> rb = RayReplayBuffer(replay_buffer_cls=RemoteTensorDictReplayBuffer,
        ...                      storage=partial(LazyTensorStorage, 1000), batch_size=32)
        >>> actor = RemoteTensorDictReplayBuffer.as_remote({"num_cpus": 1}).remote(
        ...     storage=partial(LazyTensorStorage, 1000))
        >>> ray.get(actor.extend.remote(TensorDict({"obs": torch.randn(8, 3)}, [8])))
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def sample(
        self, batch_size: int | None = None, include_info: bool | None = None, return_info: bool = False
    ) -> TensorDictBase:
        return super().sample(batch_size=batch_size, include_info=include_info, return_info=return_info)

    def add(self, data: TensorDictBase) -> int:
        return super().add(data)

    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> torch.Tensor:
        return super().extend(tensordicts, update_priority=update_priority)

    def update_priority(self, index: int | torch.Tensor, priority: int | torch.Tensor) -> None:
        return super().update_priority(index, priority)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        return super().update_tensordict_priority(data)


def actor_class(buffer_cls: type, remote_config: dict[str, Any] | None = None) -> Any:
    """The Ray actor class of ``buffer_cls`` (what every buffer's ``as_remote`` returns, as TorchRL's):
    ``.remote(**kwargs)`` builds one.

    Args:
        buffer_cls: a buffer class.
        remote_config: the actor's options; defaults to TorchRL's (one CPU, 2 GiB, 0.2 GPU where
            CUDA is available).

    Raises:
        ImportError: Ray is not installed.
    """
    ray = require_ray()
    config = default_remote_config() if remote_config is None else remote_config
    remote_cls = ray.remote(**{k: v for k, v in config.items() if v is not None})(buffer_cls)
    remote_cls.is_remote = True
    return remote_cls
